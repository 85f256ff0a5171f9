// paged_prefill_hopper.cu: prefill v3, FlashAttention-3's design on Hopper's own instructions (sm_90a).
//
// Same contract and arguments as paged_prefill.cu's v1 and v2 (read that file's header first): causal;
// sequence s's query rows are the LAST query_len tokens of its context; K/V read from the paged pool
// [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] through the block table; 16-bit Q/K/V, HEAD_DIM 64
// or 128. Compiled for sm_90a only (wgmma and setmaxnreg exist nowhere else): the launcher picks this
// kernel on compute capability 9.0 and v2 / v1 elsewhere, from the model's shapes and the device.
//
// What changes from v2 (FlashAttention-2, mma.sync), and why:
//   * wgmma.mma_async: one instruction per warpgroup (4 warps) computes a 64 x N x 16 product with
//     both operands read by the tensor cores straight from shared memory (no ldmatrix into registers)
//     and runs asynchronously: issue, do other work, wait. S = Q K^T takes Q and K from shared memory;
//     O += P V takes P from registers (S's accumulators packed to 16 bits: FA2's register reuse holds,
//     the accumulator layout per warp is mma.m16n8k16's) and V from shared memory.
//   * warp specialisation: CTA = 3 warpgroups. Warpgroup 0 is the producer: it gathers each key
//     tile's K and V rows through the block table with 16-byte cp.async into a ring of KV_STAGES
//     shared-memory stages and signals each stage's "full" mbarrier as the copies land
//     (cp.async.mbarrier.arrive.noinc: no thread waits for its copies). Warpgroups 1 and 2 are the
//     consumers, 64 query rows each (TQ = 128 per CTA): they wait on "full", compute, and arrive on
//     the stage's "empty" mbarrier, which the producer waits on before it refills the stage. Copies
//     of the next tiles fly while the tensor cores work on this one, and the two consumers' softmax
//     and mma phases interleave on the SM.
//   * setmaxnreg: the producer needs few registers and gives them back (40; 56 on the persistent grid),
//     the consumers take them (232; 224): the S (64 x 128 fp32) and O (64 x HEAD_DIM fp32) accumulators
//     stay in registers.
// Shared memory (wgmma's canonical 128-byte-swizzled layout, the same for Q, K and V): a tile of R
// rows of HEAD_DIM 16-bit elements is HEAD_DIM / 64 column blocks, each R rows of 128 bytes; the
// 16-byte chunk c (0..7) of row r sits at chunk c ^ (r % 8) of its row (every 8 rows = one 1024-byte
// swizzle atom; each block starts 1024-byte aligned). So the 8 rows an 8x8 core matrix reads spread
// over all 32 banks, and the same bytes serve as
//   - Q, K: K-major operands (the reduction dim, HEAD_DIM, contiguous): descriptor start = block
//     base + 32 bytes per 16-element k-step, SBO = 1024 (8 rows to the next 8), LBO unused;
//   - V: an MN-major operand of O += P V (B[k = key][n = dim], n contiguous; wgmma's transpose bit):
//     start = base + 2048 bytes per 16-key k-step, SBO = 1024 (8 keys to the next 8), LBO = the
//     column-block stride (64 dims to the next 64) = TK * 128 bytes.
// Key tiles of TK = 128 keys start at multiples of TK of the sequence's own positions, whatever the
// chunking; the tile loop stops at the tile of the CTA's last row, and a consumer whose rows all
// precede a tile skips it (an exact no-op, as in v2). Keys past the context copy the context's last
// token (never a slot no sequence owns) and are masked with every key after a row's position.
// Bits: every row's arithmetic depends only on its position and the tile grid (the same products
// in the same order, max and sum over the row's 4 lanes in a fixed xor order, -inf masking, the
// same exp2 of the same fma): invariant under block placement, batch composition and chunking.
// Work items and schedules (build.PrefillV3Schedule, compile-time; launch.prefill_v3_schedule picks one):
// a work item is 128 query rows of one sequence and head. The plain grid runs one CTA per item. The
// persistent grid (V3_PERSISTENT) runs at most one CTA per SM, each taking items in a snake
// (item_of_round) through the plain kernel's own produce() and consume(), its KV ring running on across
// items; the producer copies the next item's first K/V tile, then its Q once the consumers read the
// current Q for the last time (q_empty), so the next item starts without the load latency a new CTA
// waits for. Its producer's item loop needs 56 registers (the consumers 224: setmaxnreg's budget).
// V3_RCP_EPILOGUE divides O by l as O * (1 / l), one division per row instead of 64 per lane.
// V3_BT_SHFL: the producer's lane j loads the tile's j-th block-table entry once per tile (before the
// "empty" wait) and each pass takes its rows' entry by a shuffle, instead of one dependent load per pass.
// V3_TMA: a key tile that lies wholly inside the context is gathered by the tensor-memory accelerator: one
// cp.async.bulk.tensor per block and 64-dim column block (a box of BLOCK_SIZE rows of 128 bytes at the
// block's first slot, read through a descriptor of the whole pool as [slots][num_kv_heads * HEAD_DIM], its
// 128-byte swizzle the layout above), 32 instructions from 8 lanes for a tile of 16-token blocks at
// HEAD_DIM 128 where the cp.async rows take 2048 from 128 threads, each after a table load and an
// address computation. The tile that holds the context's end keeps the cp.async rows (a box would read
// the slots past the context). The "full" barrier still takes one arrival per producer thread; lane 0
// adds the boxes' bytes (expect_tx) before its own arrival.
// Bits: the item order and the copies change no row's arithmetic; the epilogue does, the same for every
// row. The launcher's choices all take V3_RCP_EPILOGUE, so persistent or plain, a row's bits are the same.
// Measured on an H200 (bf16, 32 / 8 heads, head_dim 128, 16-token blocks in random order, graphed, the
// same pool; one call, 2026-12-01 16:51 UTC), us at 4 x 2048 / 1 x 8192 / chunk 2048 @ 8192 / 16 x 512,
// FlashInfer's FA3 314 / 1011 / 474 / 136:
//   plain (the kernel before, no knob)  370 / 1170 / 498 / 182   persistent             354 / 1169 / 507 / 155
//   rcp                                 364 / 1183 / 505 / 172   persistent rcp         341 / 1159 / 526 / 143
//   rcp bt (long contexts' choice)      355 / 1146 / 489 / 171   persistent rcp bt      366 / 1253 / 550 / 151
// The launcher took persistent rcp up to a longest context of 2048 (launch.PREFILL_V3_PERSISTENT_MAX_CONTEXT)
// and rcp bt past it: 341 / 1146 / 489 / 143 = 92% / 88% / 97% / 95% of FlashInfer (the plain kernel
// before: 85% / 86-89% / 95% / 75%; its two timings at 1 x 8192 in that call, 1134 and 1170, show the
// noise there). With V3_TMA (2026-12-03 09:01 UTC, same settings, FlashInfer 306 / 995 / 450 / 136 in the
// order 4 x 2048 / 1 x 8192 / chunk / 16 x 512): persistent rcp tma 316 / 1017 / 446 / 141, rcp tma
// 325 / 968 / 415 / 168, against 341 / 1088 / 480 / 142 for the cp.async choice. The launcher now takes
// persistent rcp tma up to 2048 and rcp tma past it: 312 / 954 / 417 / 139 in the next call, 98% / 105% /
// 108% / 98% of FlashInfer (docs/benchmarks.md). Tried before and not kept (commits fb77e6b and 99c42e8, in
// the history): FA3's intra-warpgroup overlap of softmax with P V and ping-pong between the consumers (at most 2% on top of
// a persistent grid, or up to 8% lost). What is left is named in the stage 5 lesson.
// FA3's intra-warpgroup overlap, tried again as a knob (e7ae4f0, V3_OVERLAP: a consumer issued S_t, then
// P_{t-1} V_{t-1}, and ran tile t's softmax while that P V ran; the SASS showed the softmax between the two
// waits) and measured on an H200 (2026-12-01 19:10 UTC, same settings): 399 / 1245 / 568 / 180 us for
// "rcp bt overlap" against 355 / 1091 / 481 / 172 without it, 387 / 1347 / 595 / 151 for "persistent rcp
// overlap" against 339 / 1154 / 493 / 143: 5-17% slower everywhere, so it is gone again. A likely reason:
// the two consumers already interleave softmax and mmas on the SM, while the overlap holds a second
// stage a softmax longer (KV_STAGES 3 at HEAD_DIM 128 leaves the producer one tile ahead, not two) and
// keeps 32 more registers live.
//
// Launch: grid (num_seqs, num_heads, ceil(max_query_len / TQ)), or (min(work items, SMs)) persistent;
// block 384 threads, dynamic shared memory prefill_v3_shared_bytes (build.py): TQ + 2 * KV_STAGES * TK
// rows of HEAD_DIM * 2 bytes, 1 KB of alignment slack and the mbarriers.
// Compile-time parameters (-D): PR_DTYPE (1 or 2), HEAD_DIM (64 or 128), BLOCK_SIZE, KV_STAGES,
// V3_PERSISTENT, V3_RCP_EPILOGUE, V3_BT_SHFL, V3_TMA, V3_PRODUCER_REGS.
#define PREFILL_WGMMA 1
#include "common.cuh"
#include "hopper.cuh"

#ifndef KV_STAGES
#define KV_STAGES 3  // build.prefill_v3_stages: 3 at HEAD_DIM 128 (227 KB of shared memory), 4 at 64
#endif
static_assert(PR_DTYPE == 1 || PR_DTYPE == 2, "prefill v3 needs 16-bit Q/K/V: float16 or bfloat16");
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "prefill v3 takes HEAD_DIM 64 or 128");
#ifndef V3_PERSISTENT
#define V3_PERSISTENT 0  // 1: a persistent grid of at most one CTA per SM walks the work items (kernel)
#endif
#ifndef V3_RCP_EPILOGUE
#define V3_RCP_EPILOGUE 0  // 1: O / l as O * (1 / l), one division per row (common.cuh's write_rows)
#endif
#ifndef V3_BT_SHFL
#define V3_BT_SHFL 0  // 1: one block-table load per lane and tile, shared by shuffles (produce)
#endif
#ifndef V3_TMA
#define V3_TMA 0  // 1: whole tiles by TMA, one box per block (produce); the kernel takes the pool's two TmaMaps
#endif
static_assert(!(V3_TMA && V3_BT_SHFL), "V3_TMA loads each block-table entry once per tile already");
static_assert(KV_STAGES >= 2 && KV_STAGES <= 4, "KV_STAGES from 2 to 4");

constexpr int WG = 128;                  // threads per warpgroup
constexpr int V3_THREADS = 3 * WG;       // producer + 2 consumers (build.PREFILL_V3_THREADS)
constexpr int TQ = 128;                  // query rows per CTA (build.PREFILL_V3_ROWS)
constexpr int TK = 128;                  // keys per tile
constexpr int CPR = HEAD_DIM / 8;        // 16-byte chunks per row
constexpr int Q_BYTES = TQ * HEAD_DIM * 2;
constexpr int TILE_BYTES = TK * HEAD_DIM * 2;  // one K or V tile
constexpr int STAGE_BYTES = 2 * TILE_BYTES;    // K then V
// After setmaxnreg the CTA holds what it was launched with, 168 x 384 registers (the cap of
// __launch_bounds__(384, 1)), not the SM's 65536: a consumer's setmaxnreg.inc waits until the producer's
// .dec freed enough, forever if they ask for more (a build asking 48 + 2 x 232 hung on an H200).
#ifndef V3_PRODUCER_REGS
#define V3_PRODUCER_REGS 40  // 56 on the persistent grid: its item loop spills under 40 (build.prefill_config)
#endif
constexpr int PRODUCER_REGS = V3_PRODUCER_REGS, CONSUMER_REGS = (V3_THREADS * 168 - WG * PRODUCER_REGS) / (2 * WG) / 8 * 8;
static_assert(WG * PRODUCER_REGS + 2 * WG * CONSUMER_REGS <= V3_THREADS * 168, "setmaxnreg's budget: 64512 registers");
static_assert(TK % BLOCK_SIZE == 0, "a key tile covers whole blocks");

// Byte offset of 16-byte chunk c of row r in a swizzled tile of `rows` rows (see the header).
__device__ __forceinline__ unsigned swz(int rows, int r, int c) {
  return (unsigned)((c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) << 4));
}

__device__ __forceinline__ void cp_async16_zfill(unsigned dst, const scalar_t *src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async16(unsigned dst, const scalar_t *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// Arrive on `bar` when this thread's cp.asyncs so far have landed (counts as one expected arrival).
__device__ __forceinline__ void mbar_arrive_on_copies(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

#define PR_REGS32                                                                                       \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20,"       \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PR_REGS64                                                                                       \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20,"       \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39,"       \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58,"       \
  "%59, %60, %61, %62, %63"
// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B by descriptor (K-major both); accumulate = 0: D = A B.
__device__ __forceinline__ void wgmma_ss(float (&d)[32], unsigned long long a, unsigned long long b,
                                         int accumulate) {
  asm volatile(PR_WGMMA("m64n64k16", PR_REGS32, "%34", "%32, %33, p, 1, 1, 0, 0")
               : PR_ACC32
               : "l"(a), "l"(b), "r"(accumulate));
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A from registers (per warp: mma.m16n8k16's A fragment of rows
// 16 * warp ..), B by descriptor, MN-major (transposed: N contiguous in shared memory).
__device__ __forceinline__ void wgmma_rs(float (&d)[32], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned long long b, int accumulate) {
  asm volatile(PR_WGMMA("m64n64k16", PR_REGS32, "%37", "{%32, %33, %34, %35}, %36, p, 1, 1, 1")
               : PR_ACC32
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(accumulate));
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A and B by descriptor (K-major both); accumulate = 0: D = A B.
__device__ __forceinline__ void wgmma_ss(float (&d)[64], unsigned long long a, unsigned long long b,
                                         int accumulate) {
  asm volatile(PR_WGMMA("m64n128k16", PR_REGS64, "%66", "%64, %65, p, 1, 1, 0, 0")
               : PR_ACC64
               : "l"(a), "l"(b), "r"(accumulate));
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A from registers (per warp: mma.m16n8k16's A fragment of rows
// 16 * warp ..), B by descriptor, MN-major (transposed: N contiguous in shared memory).
__device__ __forceinline__ void wgmma_rs(float (&d)[64], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned long long b, int accumulate) {
  asm volatile(PR_WGMMA("m64n128k16", PR_REGS64, "%69", "{%64, %65, %66, %67}, %68, p, 1, 1, 1")
               : PR_ACC64
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(accumulate));
}

// One work item: query rows row0 .. row0 + TQ - 1 of sequence s's chunk, head h, through key tile num_tiles - 1.
struct Item {
  int s, h, row0, q0, qlen, ctx, first_pos, num_tiles;
};

// Item (s, h, query tile z counted from the sequence's end: 0 = its last 128 rows, the most keys) ->
// false if its rows are past the sequence's chunk (no work, no barrier).
__device__ __forceinline__ bool item_at(int s, int h, int z, int num_q_tiles, const int *__restrict__ query_start_loc,
                                        const int *__restrict__ context_lens, Item &it) {
  it.s = s;
  it.h = h;
  it.row0 = (num_q_tiles - 1 - z) * TQ;
  it.q0 = query_start_loc[s];
  it.qlen = query_start_loc[s + 1] - it.q0;
  if (it.row0 >= it.qlen) return false;
  it.ctx = context_lens[s];
  it.first_pos = it.ctx - it.qlen;
  it.num_tiles = (it.first_pos + min(it.row0 + TQ, it.qlen) - 1) / TK + 1;  // through the item's last row
  return true;
}

// Persistent grid (V3_PERSISTENT): the CTA's k-th work item, or false past the last. Items are numbered
// as the plain grid's CTAs launch (sequence fastest, then head, then query tile from the end: the most
// keys first) and dealt to the gridDim.x CTAs in rounds, forward in even rounds and backward in odd
// ones (a snake), so that a CTA given one of a round's longest items gets one of the next round's
// shortest. `more` turns false once the rounds are past the last item.
__device__ __forceinline__ bool item_of_round(int k, int num_seqs, int num_heads, int num_q_tiles,
                                              const int *__restrict__ query_start_loc,
                                              const int *__restrict__ context_lens, Item &it, bool &more) {
  const int g = gridDim.x, num_items = num_seqs * num_heads * num_q_tiles;
  const int i = k * g + ((k & 1) ? g - 1 - (int)blockIdx.x : (int)blockIdx.x);
  more = (k + 1) * g < num_items;
  if (i >= num_items) return false;
  const int per_tile = num_seqs * num_heads, rem = i % per_tile;
  return item_at(rem % num_seqs, rem / num_seqs, i / per_tile, num_q_tiles, query_start_loc, context_lens, it);
}

// One arrival per warp on `bar` (the consumers' barriers count warps).
__device__ __forceinline__ void release(unsigned bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(bar);
}

// S = Q K^T over HEAD_DIM / 16 k-steps of 32 bytes (4 per 128-byte column block); one commit group.
// q_wg: this consumer's 64 rows of Q; k_s: the stage's K tile [TK rows]. sc: 64 x TK fp32 per warpgroup.
__device__ __forceinline__ void issue_s(float (&sc)[TK / 2], unsigned q_wg, unsigned k_s) {
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
    wgmma_ss(sc, wgmma_desc(q_wg + (kk / 4) * TQ * 128 + (kk % 4) * 32, 16, 1024),
             wgmma_desc(k_s + (kk / 4) * TK * 128 + (kk % 4) * 32, 16, 1024), kk > 0);
  wgmma_commit();
}

// O += P V over TK / 16 k-steps of 16 keys (2048 bytes of V each); P's A fragment kk = S's accumulators
// of keys 16 kk .. + 15, packed (pack_p). One commit group. o: 64 x HEAD_DIM fp32 per warpgroup.
__device__ __forceinline__ void issue_pv(float (&o)[HEAD_DIM / 2], const unsigned (&pf)[TK / 16][4], unsigned v_s) {
#pragma unroll
  for (int kk = 0; kk < TK / 16; ++kk)
    wgmma_rs(o, pf[kk][0], pf[kk][1], pf[kk][2], pf[kk][3], wgmma_desc(v_s + kk * 2048, TK * 128, 1024), 1);
  wgmma_commit();
}

// One tile's scores -> P, in place (sc: keys key0 + 8 j + 2 tig + e % 2 of rows lo (e < 2) and hi): the
// causal mask where `masked`, then the online softmax in log2 units, p = 2^(s * scale_log2 - m *
// scale_log2) (one fma and one ex2); the running max m (raw score units) and this lane's exp-sums l move
// on, and corr = 2^((m_old - m_new) * scale_log2) is what O must be scaled by before this tile's P V.
__device__ __forceinline__ void softmax_tile(float (&sc)[TK / 2], int key0, bool masked, int pos_lo, int pos_hi,
                                             int tig, float scale_log2, float &m_lo, float &m_hi, float &l_lo,
                                             float &l_hi, float &corr_lo, float &corr_hi) {
  if (masked) {
#pragma unroll
    for (int j = 0; j < TK / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (key0 + 8 * j + 2 * tig + e % 2 > (e < 2 ? pos_lo : pos_hi)) sc[4 * j + e] = neg_inf();
  }
  float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
  for (int j = 0; j < TK / 8; ++j) {
    mx_lo = fmaxf(mx_lo, fmaxf(sc[4 * j], sc[4 * j + 1]));
    mx_hi = fmaxf(mx_hi, fmaxf(sc[4 * j + 2], sc[4 * j + 3]));
  }
#pragma unroll
  for (int off = 1; off < 4; off *= 2) {  // over the row's 4 lanes
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(PR_FULL_MASK, mx_lo, off));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(PR_FULL_MASK, mx_hi, off));
  }
  // Finite: tile 0 holds key 0, which every row sees; later tiles start from a finite m.
  corr_lo = exp2_approx((m_lo - mx_lo) * scale_log2);
  corr_hi = exp2_approx((m_hi - mx_hi) * scale_log2);
  m_lo = mx_lo;
  m_hi = mx_hi;
  const float ms_lo = mx_lo * scale_log2, ms_hi = mx_hi * scale_log2;
  l_lo *= corr_lo;
  l_hi *= corr_hi;
#pragma unroll
  for (int j = 0; j < TK / 8; ++j) {
    sc[4 * j] = exp2_approx(fmaf(sc[4 * j], scale_log2, -ms_lo));
    sc[4 * j + 1] = exp2_approx(fmaf(sc[4 * j + 1], scale_log2, -ms_lo));
    sc[4 * j + 2] = exp2_approx(fmaf(sc[4 * j + 2], scale_log2, -ms_hi));
    sc[4 * j + 3] = exp2_approx(fmaf(sc[4 * j + 3], scale_log2, -ms_hi));
    l_lo += sc[4 * j] + sc[4 * j + 1];
    l_hi += sc[4 * j + 2] + sc[4 * j + 3];
  }
}

// O's rows scaled by their softmax correction (O's layout: o[4 n + e], row lo for e < 2, hi else).
__device__ __forceinline__ void rescale_o(float (&o)[HEAD_DIM / 2], float corr_lo, float corr_hi) {
#pragma unroll
  for (int n = 0; n < HEAD_DIM / 8; ++n) {
    o[4 * n] *= corr_lo;
    o[4 * n + 1] *= corr_lo;
    o[4 * n + 2] *= corr_hi;
    o[4 * n + 3] *= corr_hi;
  }
}

// P's A fragments for O += P V: S's accumulators of keys 16 kk .. 16 kk + 15, packed to 16 bits.
__device__ __forceinline__ void pack_p(unsigned (&pf)[TK / 16][4], const float (&sc)[TK / 2]) {
#pragma unroll
  for (int kk = 0; kk < TK / 16; ++kk) {
    pf[kk][0] = pack2(sc[8 * kk], sc[8 * kk + 1]);
    pf[kk][1] = pack2(sc[8 * kk + 2], sc[8 * kk + 3]);
    pf[kk][2] = pack2(sc[8 * kk + 4], sc[8 * kk + 5]);
    pf[kk][3] = pack2(sc[8 * kk + 6], sc[8 * kk + 7]);
  }
}

// A consumer warpgroup on one work item: 64 query rows (the item's rows 64 * cw ..); warp w of it owns
// rows 16 w .. 16 w + 15, this lane rows grp and grp + 8 (the accumulator layout of wgmma,
// mma.m16n8k16's per warp: element 4 j + e of S or O is row grp + 8 (e / 2), column 8 j + 2 tig + e % 2).
// g: the CTA's key tiles before this item (0 on the plain grid), so tile t is the ring's tile g + t.
// On a persistent grid the consumer's warps arrive on q_empty once Q is read for the last time, and never
// before tile 0's "full" wait: the producer loads this item's Q only after the previous item's q_empty
// phase completed, and tile 0's barrier counts Q's copies, so an arrival after that wait counts toward
// this item's phase. (An idle consumer once arrived at the item's start: running ahead by a whole item
// while the other consumer still read the previous Q, its arrival completed the previous phase early and
// the producer overwrote a Q still in use. The GPU test of the schedules caught it at HEAD_DIM 64.)
// Its key tiles 0 .. last hold keys its rows see (the tiles after: an exact no-op, only released).
// Per tile t: S_t = Q K_t^T, wait; softmax; O = O * corr_t; O += P_t V_t, wait; release the stage.
__device__ __forceinline__ void consume(scalar_t *__restrict__ out, int q0, int qlen, int row0, int first_pos, int h,
                                        long long q_row_stride, unsigned q_s, unsigned kv_s, unsigned full,
                                        unsigned empty, unsigned q_empty, int num_tiles, int g, float scale,
                                        int ctid) {
  const int cw = ctid / WG, warp = ctid / 32 % 4, lane = ctid % 32, grp = lane / 4, tig = lane % 4;
  const int wg_row0 = row0 + 64 * cw;
  const bool active = wg_row0 < qlen;  // else the consumer only releases stages
  const int wg_first = first_pos + wg_row0, wg_last = first_pos + min(wg_row0 + 63, qlen - 1);
  const int wrow0 = wg_row0 + 16 * warp;
  // This lane's rows' positions (rows past the chunk borrow the last row's, and are never written).
  const int pos_lo = first_pos + min(wrow0 + grp, qlen - 1), pos_hi = first_pos + min(wrow0 + grp + 8, qlen - 1);
  const float scale_log2 = scale * LOG2E;
  const unsigned q_wg = q_s + cw * 64 * 128;  // this consumer's rows in Q's first column block

  float o[HEAD_DIM / 2];
#pragma unroll
  for (int i = 0; i < HEAD_DIM / 2; ++i) o[i] = 0.f;
  // Running max (raw score units) and exp-sums.
  float l_hi = 0.f, l_lo = 0.f, m_hi = neg_inf(), m_lo = neg_inf();

  for (int t = 0; t < num_tiles; ++t) {
    const int stage = (g + t) % KV_STAGES;
    mbar_wait(full + 8 * stage, ((g + t) / KV_STAGES) & 1);
    if (V3_PERSISTENT && !active && t == 0) release(q_empty, lane);  // no rows: Q not read at all
    if (active && t * TK <= wg_last) {  // else every key of the tile follows every row: an exact no-op
      // The stage was written by cp.async (the generic proxy); the tensor cores read it through the async proxy.
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      const unsigned k_s = kv_s + stage * STAGE_BYTES, v_s = k_s + TILE_BYTES;
      float sc[TK / 2];
      wgmma_fence();
      issue_s(sc, q_wg, k_s);
      wgmma_wait_all();
      fence_regs(sc);
      // The last tile of this consumer's rows: Q is read, the producer may load the next item's over it.
      if (V3_PERSISTENT && (t + 1) * TK > wg_last) release(q_empty, lane);
      // The causal mask only on tiles that reach past the consumer's first row (elsewhere it changes nothing).
      float corr_lo, corr_hi;
      softmax_tile(sc, t * TK, t * TK + TK - 1 > wg_first, pos_lo, pos_hi, tig, scale_log2, m_lo, m_hi, l_lo, l_hi,
                   corr_lo, corr_hi);
      rescale_o(o, corr_lo, corr_hi);
      unsigned pf[TK / 16][4];
      pack_p(pf, sc);
      wgmma_fence();
      issue_pv(o, pf, v_s);
      wgmma_wait_all();
      fence_regs(o);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * stage);  // this warp's mmas no longer read the stage
  }
  if (!active) return;
  write_rows<V3_RCP_EPILOGUE>(out, o, l_lo, l_hi, q0, wrow0 + grp, qlen, q_row_stride, h, tig);
}

// The producer warpgroup on one work item: the item's query rows (zeros past the chunk) with its tile 0,
// then each key tile t into the ring's stage (g + t) % KV_STAGES once the consumers released it; each
// thread's copies arrive on the stage's "full" barrier as they land. On a persistent grid (n: the CTA's
// items before this one) Q is loaded after tile 0's K and V, once the consumers read the previous
// item's for the last time (q_empty), so that tile 0's copies fly meanwhile.
__device__ __forceinline__ void produce(unsigned q_s, unsigned kv_s, unsigned full, unsigned empty, unsigned q_empty,
                                       const scalar_t *__restrict__ qh, long long q_row_stride, int row0, int qlen,
                                       const scalar_t *__restrict__ k_cache, const scalar_t *__restrict__ v_cache,
                                       const int *__restrict__ bt, int ctx, int row_stride, int kv_off,
                                       const TmaMap *k_map, const TmaMap *v_map, int num_tiles, int g, int n,
                                       int tid) {
  constexpr int ROWS_PER_PASS = WG / CPR;  // rows one pass of the warpgroup copies (16 chunks each at 128)
  const int c = tid % CPR, r_first = tid / CPR;
  auto load_q = [&]() {
    for (int r = r_first; r < TQ; r += ROWS_PER_PASS) {
      const bool real = row0 + r < qlen;
      cp_async16_zfill(q_s + swz(TQ, r, c), qh + (long long)(real ? row0 + r : 0) * q_row_stride + c * 8,
                       real ? 16 : 0);
    }
  };
  // Tile t's K and V rows into its stage once the consumers released it -> the stage.
  auto copy_tile = [&](int t) {
    const int stage = (g + t) % KV_STAGES;
#if V3_TMA
    // A tile whose keys all lie in the context is TK / BLOCK_SIZE whole blocks: lane j of the producer's
    // first warp loads block j's table entry (before the wait below, which hides its latency) and issues
    // that block's boxes, one per 64-dim column block of K and of V, each BLOCK_SIZE rows of 128 bytes
    // that land in the 128-byte-swizzled layout the cp.async rows use. The context's last tile, if keys
    // past the context fall in it, takes the cp.async rows below: a box would read the slots past the
    // context (NaN in a slot no token owns), and the masked P = 0 times a NaN of V is NaN.
    constexpr int BLOCKS = TK / BLOCK_SIZE;
    const bool boxes = (t + 1) * TK <= ctx;
    int my_block = 0;
    if (boxes && tid < BLOCKS) my_block = bt[t * BLOCKS + tid];
#elif V3_BT_SHFL
    // The tile's TK / BLOCK_SIZE block-table entries, lane j holding block j's (keys past the context:
    // the context's last block), loaded before the wait below so that the wait hides their latency;
    // each pass takes its rows' entry from the lane that holds it.
    const int my_block = bt[min(t * TK + (tid % 32 % (TK / BLOCK_SIZE)) * BLOCK_SIZE, ctx - 1) / BLOCK_SIZE];
#endif
    if (g + t >= KV_STAGES) mbar_wait(empty + 8 * stage, ((g + t) / KV_STAGES - 1) & 1);  // tile g + t - KV_STAGES done
    const unsigned k_s = kv_s + stage * STAGE_BYTES, v_s = k_s + TILE_BYTES;
#if V3_TMA
    if (boxes) {
      // The stage's bytes first (the phase cannot complete before this thread's own arrival, after
      // the return), then the boxes; each box's complete_tx counts its bytes off.
      if (tid == 0) mbar_add_tx(full + 8 * stage, STAGE_BYTES);
      if (tid < 32) __syncwarp();
      if (tid < BLOCKS) {
#pragma unroll
        for (int cb = 0; cb < HEAD_DIM / 64; ++cb) {
          const unsigned dst = cb * TK * 128 + tid * BLOCK_SIZE * 128;
          tma_load_box(k_s + dst, *k_map, kv_off + 64 * cb, my_block * BLOCK_SIZE, full + 8 * stage);
          tma_load_box(v_s + dst, *v_map, kv_off + 64 * cb, my_block * BLOCK_SIZE, full + 8 * stage);
        }
      }
      return stage;
    }
#endif
#pragma unroll 4
    for (int r = r_first; r < TK; r += ROWS_PER_PASS) {
      const int tok = min(t * TK + r, ctx - 1);
#if V3_BT_SHFL
      const int block = __shfl_sync(PR_FULL_MASK, my_block, r / BLOCK_SIZE);
#else
      const int block = bt[tok / BLOCK_SIZE];
#endif
      const long long off = ((long long)block * BLOCK_SIZE + tok % BLOCK_SIZE) * row_stride + kv_off + c * 8;
      cp_async16(k_s + swz(TK, r, c), k_cache + off);
      cp_async16(v_s + swz(TK, r, c), v_cache + off);
    }
    return stage;
  };
  int t = 0;
  if (V3_PERSISTENT) {  // tile 0 apart: Q's registers are free for the other tiles
    const int stage = copy_tile(t++);
    if (n > 0) mbar_wait(q_empty, (n - 1) & 1);  // the previous item's last S = Q K^T are done
    load_q();
    mbar_arrive_on_copies(full + 8 * stage);
  } else {
    load_q();
  }
  for (; t < num_tiles; ++t) mbar_arrive_on_copies(full + 8 * copy_tile(t));
}

// v1's arguments, shape for shape, then num_seqs and num_q_tiles = ceil(max_query_len / TQ) (read by the
// persistent grid only). Launch: see the header.
extern "C" __global__ void __launch_bounds__(V3_THREADS, 1) paged_prefill_v3(
    scalar_t *__restrict__ out, const scalar_t *__restrict__ q,
    const scalar_t *__restrict__ k_cache, const scalar_t *__restrict__ v_cache,
    const int *__restrict__ block_tables, const int *__restrict__ context_lens,
    const int *__restrict__ query_start_loc, int max_blocks, int num_heads, int num_kv_heads, float scale,
    int num_seqs, int num_q_tiles
#if V3_TMA
    , const __grid_constant__ TmaMap k_map, const __grid_constant__ TmaMap v_map
#endif
    ) {
  extern __shared__ unsigned char smem_v3[];
  // 1024-byte aligned base (the swizzle atoms): Q [TQ rows], then KV_STAGES x (K, V) [TK rows], then
  // the mbarriers: full[KV_STAGES], empty[KV_STAGES], q_empty, 8 bytes each.
  const unsigned base = (smem_u32(smem_v3) + 1023u) & ~1023u;
  const unsigned q_s = base, kv_s = base + Q_BYTES;
  const unsigned full = kv_s + KV_STAGES * STAGE_BYTES, empty = full + 8 * KV_STAGES, q_empty = empty + 8 * KV_STAGES;
  const long long q_row_stride = (long long)num_heads * HEAD_DIM;
  const int tid = threadIdx.x, wg = tid / WG;
#if !V3_PERSISTENT
  // One CTA per work item; query tiles in reverse launch order: the last tiles of a sequence see the
  // most keys, so they start first.
  Item it;
  if (!item_at(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.z, query_start_loc, context_lens, it))
    return;  // the whole CTA leaves together, before any barrier
#endif

  if (tid == 0) {
    for (int i = 0; i < KV_STAGES; ++i) {
      mbar_init(full + 8 * i, WG);  // one arrival per producer thread (its copies landed)
      mbar_init(empty + 8 * i, 8);  // one arrival per consumer warp (its mmas read the stage)
    }
    if (V3_PERSISTENT) mbar_init(q_empty, 8);  // one arrival per consumer warp (its S mmas read Q)
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
#if V3_TMA
    const TmaMap *k_map_p = &k_map, *v_map_p = &v_map;
    if (tid == 0) {
      prefetch_map(k_map);
      prefetch_map(v_map);
    }
#else
    const TmaMap *k_map_p = nullptr, *v_map_p = nullptr;
#endif
#if V3_PERSISTENT
    int g = 0, n = 0;  // the CTA's key tiles and items so far
    bool more = true;
    for (int k = 0; more; ++k) {
      Item it;
      if (!item_of_round(k, num_seqs, num_heads, num_q_tiles, query_start_loc, context_lens, it, more)) continue;
#else
    {
      const int g = 0, n = 0;
#endif
      produce(q_s, kv_s, full, empty, q_empty, q + (long long)it.q0 * q_row_stride + it.h * HEAD_DIM, q_row_stride,
              it.row0, it.qlen, k_cache, v_cache, block_tables + (long long)it.s * max_blocks, it.ctx,
              num_kv_heads * HEAD_DIM, it.h / (num_heads / num_kv_heads) * HEAD_DIM, k_map_p, v_map_p, it.num_tiles,
              g, n, tid);
#if V3_PERSISTENT
      g += it.num_tiles;
      ++n;
#endif
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // nothing in flight when the thread leaves
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
#if V3_PERSISTENT
    int g = 0;  // the CTA's key tiles so far
    bool more = true;
    for (int k = 0; more; ++k) {
      Item it;
      if (!item_of_round(k, num_seqs, num_heads, num_q_tiles, query_start_loc, context_lens, it, more)) continue;
#else
    {
      const int g = 0;
#endif
      consume(out, it.q0, it.qlen, it.row0, it.first_pos, it.h, q_row_stride, q_s, kv_s, full, empty, q_empty,
              it.num_tiles, g, scale, tid - WG);
#if V3_PERSISTENT
      g += it.num_tiles;
#endif
    }
  }
}
