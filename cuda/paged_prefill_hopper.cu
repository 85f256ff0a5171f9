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
//   * setmaxnreg: the producer needs few registers and gives them back (40), the consumers take them
//     (232): the S (64 x 128 fp32) and O (64 x HEAD_DIM fp32) accumulators stay in registers.
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
// Work items and schedules (build.PrefillV3Schedule; none changes a row's arithmetic, so all give the
// same bits): a work item is 128 query rows of one sequence and head, the most keys first. One CTA
// per item, or a persistent grid of one CTA per SM that takes items in a snake (item_index) and keeps
// its KV ring running across them, the next item's query rows loading (q_full / q_empty) while the
// consumers finish the current one. V3_OVERLAP 1 / 2 and V3_PINGPONG are FA3's intra-warpgroup
// overlap and consumer ping-pong (consume()); V3_QPREFETCH asks L2 for the next item's query rows.
// Measured on an H200 (bf16, 32 / 8 heads, head_dim 128, graphed, same pool, one call: 2026-12-01),
// us at 4 x 2048 / 1 x 8192 / chunk 2048 @ 8192 / 16 x 512, FlashInfer 308 / 1002 / 452 / 136:
//   persistent (the default here)  372 / 1217 / 549 / 153     one CTA per item   411 / 1262 / 552 / 198
//   persistent + ping-pong         370 / 1272 / 549 / 150     + Q prefetch       378 / 1250 / 556 / 156
//   persistent + overlap 1         384 / 1271 / 570 / 157     + overlap 2        383 / 1268 / 569 / 156
//   persistent + overlap 2 + ping-pong 380 / 1311 / 573 / 153; one CTA per item + the same 419 / 1343 / 584 / 196
// against the plain kernel this file replaced (one CTA per item, no item loop; commit 11d0dcb):
// 373 / 1120 / 489 / 183 the same day. So the persistent grid buys 16 x 512 (183 -> 153 us, 89% of
// FlashInfer) and holds 4 x 2048, but this code's main loop runs 9-12% slower at the long shapes even
// with one CTA per item: not kept as the default (see the next commit). Suspect: the producer, which
// now carries the work item's state under its 40 registers (giving it more costs the consumers: the
// register budget after setmaxnreg is the launch's 168 x 384 = 64512, so producer + 2 x consumer <=
// 504 per thread: 40 + 2 x 232, or 56 + 2 x 224; 48 + 2 x 232 deadlocks in the consumers' setmaxnreg.inc).
//
// Launch: grid (work items, or min(work items, SMs) persistent), block 384 threads, dynamic shared
// memory prefill_v3_shared_bytes (build.py): TQ + 2 * KV_STAGES * TK rows of HEAD_DIM * 2 bytes,
// 1 KB of alignment slack and the mbarriers.
// Compile-time parameters (-D): PR_DTYPE (1 or 2), HEAD_DIM (64 or 128), BLOCK_SIZE, KV_STAGES,
// V3_OVERLAP, V3_PINGPONG, V3_QPREFETCH.
#define PREFILL_WGMMA 1
#include "common.cuh"

#ifndef KV_STAGES
#define KV_STAGES 3  // build.prefill_v3_stages: 3 at HEAD_DIM 128 (227 KB of shared memory), 4 at 64
#endif
#ifndef V3_OVERLAP
#define V3_OVERLAP 0  // consume(): 0 one tile at a time, 1 S_t issued with P_{t-1} V_{t-1}, 2 FA3's overlap
#endif
#ifndef V3_PINGPONG
#define V3_PINGPONG 0  // 1: the consumers take turns issuing their mmas (named barriers 1 and 2)
#endif
#ifndef V3_QPREFETCH
#define V3_QPREFETCH 0  // 1: the producer asks L2 for the next work item's query rows
#endif
static_assert(PR_DTYPE == 1 || PR_DTYPE == 2, "prefill v3 needs 16-bit Q/K/V: float16 or bfloat16");
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "prefill v3 takes HEAD_DIM 64 or 128");
static_assert(KV_STAGES >= 2 && KV_STAGES <= 4, "KV_STAGES from 2 to 4");

constexpr int WG = 128;                  // threads per warpgroup
constexpr int V3_THREADS = 3 * WG;       // producer + 2 consumers (build.PREFILL_V3_THREADS)
constexpr int TQ = 128;                  // query rows per CTA (build.PREFILL_V3_ROWS)
constexpr int TK = 128;                  // keys per tile
constexpr int CPR = HEAD_DIM / 8;        // 16-byte chunks per row
constexpr int Q_BYTES = TQ * HEAD_DIM * 2;
constexpr int TILE_BYTES = TK * HEAD_DIM * 2;  // one K or V tile
constexpr int STAGE_BYTES = 2 * TILE_BYTES;    // K then V
// After setmaxnreg the CTA holds what it was launched with, 168 x 384 (the cap of __launch_bounds__(384, 1)):
// a consumer's setmaxnreg.inc waits until the producer's .dec freed enough, forever if the sum is larger.
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
static_assert(WG * PRODUCER_REGS + 2 * WG * CONSUMER_REGS <= V3_THREADS * 168, "setmaxnreg's budget: 64512 registers");
static_assert(TK % BLOCK_SIZE == 0, "a key tile covers whole blocks");

// Byte offset of 16-byte chunk c of row r in a swizzled tile of `rows` rows (see the header).
__device__ __forceinline__ unsigned swz(int rows, int r, int c) {
  return (unsigned)((c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) << 4));
}

// wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, leading
// and stride byte offsets (all >> 4), 128-byte swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void cp_async16_zfill(unsigned dst, const scalar_t *src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async16(unsigned dst, const scalar_t *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Arrive on `bar` when this thread's cp.asyncs so far have landed (counts as one expected arrival).
__device__ __forceinline__ void mbar_arrive_on_copies(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Wait until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, int parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// Keep the compiler from moving accumulator reads or writes across a wgmma boundary.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma's operand lists, written once: the accumulator registers D (32 for N = 64, 64 for N = 128) as
// asm operands "+f"(d[i]), and their names %0 .. %N-1 in the instruction text.
#define PR_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define PR_ACC16(i) PR_ACC4(i), PR_ACC4(i + 4), PR_ACC4(i + 8), PR_ACC4(i + 12)
#define PR_ACC32 PR_ACC16(0), PR_ACC16(16)
#define PR_ACC64 PR_ACC32, PR_ACC16(32), PR_ACC16(48)
#define PR_REGS32                                                                                       \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20,"       \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PR_REGS64                                                                                       \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20,"       \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39,"       \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58,"       \
  "%59, %60, %61, %62, %63"
// One wgmma: SHAPE, the accumulators' names REGS, the operand number PRED of `accumulate` (p = it is
// non-zero: D += A B, else D = A B), then OPERANDS: A's and B's (descriptors, or A's 4 registers), p,
// scale-a = scale-b = 1, and the transpose bits (_ss: 0, 0, both K-major; _rs: B's only, 1: MN-major V).
#define PR_WGMMA(SHAPE, REGS, PRED, OPERANDS)                                                           \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                                      \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32." PR_MMA_T "." PR_MMA_T " {" REGS "}, " OPERANDS ";\n}\n"

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

__device__ __forceinline__ void wgmma_wait_but_one() {  // all committed groups but the newest are done
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}

// Named barriers 1 and 2 (0 is __syncthreads) order the two consumers' mma issue: ping-pong.
template <int ID>
__device__ __forceinline__ void named_sync() { asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(2 * WG) : "memory"); }
template <int ID>
__device__ __forceinline__ void named_arrive() { asm volatile("bar.arrive %0, %1;\n" ::"n"(ID), "n"(2 * WG) : "memory"); }

// Turns of the two consumers (V3_PINGPONG): consumer cw waits for named barrier 1 + cw, issues its
// mmas, then hands the turn to the other. Both take the same number of turns per work item.
__device__ __forceinline__ void turn_begin(int cw) {
  if (!V3_PINGPONG) return;
  if (cw == 0) named_sync<1>();
  else named_sync<2>();
}
__device__ __forceinline__ void turn_end(int cw) {
  if (!V3_PINGPONG) return;
  if (cw == 0) named_arrive<2>();
  else named_arrive<1>();
}

// One arrival per warp on `bar` (the consumers' barriers count warps).
__device__ __forceinline__ void release(unsigned bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(bar);
}

// One work item: query rows row0 .. row0 + TQ - 1 of sequence s's chunk, head h.
struct Item {
  int s, h, row0, q0, qlen, ctx, first_pos, num_tiles;
};

// Item i of the launch (0 = the most keys first: query tiles in reverse order, then heads, then
// sequences) -> false if its rows are past the sequence's chunk (no work, no barrier).
__device__ __forceinline__ bool item_at(int i, int num_seqs, int num_heads, int num_q_tiles, const int *query_start_loc,
                                        const int *context_lens, Item &it) {
  const int per_tile = num_seqs * num_heads, zi = i / per_tile, rem = i % per_tile;
  it.h = rem / num_seqs;
  it.s = rem % num_seqs;
  it.row0 = (num_q_tiles - 1 - zi) * TQ;
  it.q0 = query_start_loc[it.s];
  it.qlen = query_start_loc[it.s + 1] - it.q0;
  if (it.row0 >= it.qlen) return false;
  it.ctx = context_lens[it.s];
  it.first_pos = it.ctx - it.qlen;
  it.num_tiles = (it.first_pos + min(it.row0 + TQ, it.qlen) - 1) / TK + 1;  // through the item's last row
  return true;
}

// The CTA's k-th work item (k = 0, 1, ..), or -1 past the last: items are dealt to the gridDim.x CTAs
// in rounds, forward in even rounds and backward in odd ones (a snake), so that a CTA given one of a
// round's longest items gets one of the next round's shortest. One CTA per item (gridDim.x = items):
// CTA b takes item b alone, the launch order of a plain grid.
__device__ __forceinline__ int item_index(int k, int num_items) {
  const int g = gridDim.x, i = k * g + ((k & 1) ? g - 1 - (int)blockIdx.x : (int)blockIdx.x);
  return i < num_items ? i : -1;
}

// The CTA's shared memory, as 32-bit shared addresses (see the kernel).
struct Smem {
  unsigned q, kv, full, empty, q_full, q_empty;
};

// The producer warpgroup: for each work item, its key tiles into the ring (tile g of the CTA, counted
// over all its items, into stage g % KV_STAGES once the consumers released it; each thread's copies
// arrive on the stage's "full" barrier as they land), and the item's query rows (zeros past the chunk)
// right after its first tile, once the consumers are done reading the previous item's. With
// V3_QPREFETCH it first asks L2 for the next item's query rows, so their load is an L2 hit.
__device__ __forceinline__ void produce(const Smem &sm, const scalar_t *__restrict__ q,
                                       const scalar_t *__restrict__ k_cache, const scalar_t *__restrict__ v_cache,
                                       const int *__restrict__ block_tables, const int *__restrict__ context_lens,
                                       const int *__restrict__ query_start_loc, int max_blocks, int num_heads,
                                       int num_kv_heads, int num_seqs, int num_q_tiles, int tid) {
  constexpr int ROWS_PER_PASS = WG / CPR;  // rows one pass of the warpgroup copies (16 chunks each at 128)
  const int c = tid % CPR, r_first = tid / CPR;
  const int row_stride = num_kv_heads * HEAD_DIM;
  const long long q_row_stride = (long long)num_heads * HEAD_DIM;
  const int num_items = num_seqs * num_heads * num_q_tiles;
  int g = 0, n = 0;  // the CTA's tiles and items so far
  for (int k = 0; k * (int)gridDim.x < num_items; ++k) {
    const int i = item_index(k, num_items);
    Item it;
    if (i < 0 || !item_at(i, num_seqs, num_heads, num_q_tiles, query_start_loc, context_lens, it)) continue;
    if (V3_QPREFETCH) {
      Item nx;
      const int ni = item_index(k + 1, num_items);
      if (ni >= 0 && item_at(ni, num_seqs, num_heads, num_q_tiles, query_start_loc, context_lens, nx) &&
          nx.row0 + tid < nx.qlen) {
        const scalar_t *row = q + (long long)(nx.q0 + nx.row0 + tid) * q_row_stride + nx.h * HEAD_DIM;
#pragma unroll
        for (int b = 0; b < HEAD_DIM * 2; b += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"((const char *)row + b));
      }
    }
    const int *bt = block_tables + (long long)it.s * max_blocks;
    const int kv_off = it.h / (num_heads / num_kv_heads) * HEAD_DIM;
    for (int t = 0; t < it.num_tiles; ++t, ++g) {
      const int stage = g % KV_STAGES;
      if (g >= KV_STAGES) mbar_wait(sm.empty + 8 * stage, (g / KV_STAGES - 1) & 1);  // tile g - KV_STAGES done
      const unsigned k_s = sm.kv + stage * STAGE_BYTES, v_s = k_s + TILE_BYTES;
#pragma unroll 4
      for (int r = r_first; r < TK; r += ROWS_PER_PASS) {
        const int tok = min(t * TK + r, it.ctx - 1);
        const long long off = ((long long)bt[tok / BLOCK_SIZE] * BLOCK_SIZE + tok % BLOCK_SIZE) * row_stride +
                              kv_off + c * 8;
        cp_async16(k_s + swz(TK, r, c), k_cache + off);
        cp_async16(v_s + swz(TK, r, c), v_cache + off);
      }
      mbar_arrive_on_copies(sm.full + 8 * stage);
      if (t == 0) {
        if (n > 0) mbar_wait(sm.q_empty, (n - 1) & 1);  // the previous item's S = Q K^T all done
        const scalar_t *qh = q + (long long)it.q0 * q_row_stride + it.h * HEAD_DIM;
        for (int r = r_first; r < TQ; r += ROWS_PER_PASS) {
          const bool real = it.row0 + r < it.qlen;
          cp_async16_zfill(sm.q + swz(TQ, r, c), qh + (long long)(real ? it.row0 + r : 0) * q_row_stride + c * 8,
                           real ? 16 : 0);
        }
        mbar_arrive_on_copies(sm.q_full);
      }
    }
    ++n;
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // nothing in flight when the thread leaves
}

// Causal mask and online softmax of one tile's scores, in place: sc becomes P (fp32), the running
// max m (raw score units) and per-lane exp-sum l move on, corr = 2^((m_old - m_new) * scale_log2).
// Key key0 + 8 j + 2 tig + e % 2, row lo (e < 2) or hi. In log2 units: p = 2^(s * scale_log2 - m *
// scale_log2), one fma and one ex2.
__device__ __forceinline__ void softmax_tile(float (&sc)[TK / 2], int key0, bool masked, int pos_lo, int pos_hi, int tig,
                                             float scale_log2, float &m_lo, float &m_hi, float &l_lo, float &l_hi,
                                             float &corr_lo, float &corr_hi) {
  if (masked) {  // only on tiles that reach past the consumer's first row (elsewhere it changes nothing)
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

// P's A fragments: S's accumulators of keys 16 kk .. 16 kk + 15, packed to 16 bits.
__device__ __forceinline__ void pack_p(unsigned (&pf)[TK / 16][4], const float (&sc)[TK / 2]) {
#pragma unroll
  for (int kk = 0; kk < TK / 16; ++kk) {
    pf[kk][0] = pack2(sc[8 * kk], sc[8 * kk + 1]);
    pf[kk][1] = pack2(sc[8 * kk + 2], sc[8 * kk + 3]);
    pf[kk][2] = pack2(sc[8 * kk + 4], sc[8 * kk + 5]);
    pf[kk][3] = pack2(sc[8 * kk + 6], sc[8 * kk + 7]);
  }
}

// S = Q K^T over HEAD_DIM / 16 k-steps of 32 bytes (4 per 128-byte column block); one commit group.
__device__ __forceinline__ void issue_s(float (&sc)[TK / 2], unsigned q_wg, unsigned k_s) {
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
    wgmma_ss(sc, wgmma_desc(q_wg + (kk / 4) * TQ * 128 + (kk % 4) * 32, 16, 1024),
             wgmma_desc(k_s + (kk / 4) * TK * 128 + (kk % 4) * 32, 16, 1024), kk > 0);
  wgmma_commit();
}

// O += P V over TK / 16 k-steps of 16 keys (two 8-key core-matrix rows of 1024 bytes); one commit group.
__device__ __forceinline__ void issue_pv(float (&o)[HEAD_DIM / 2], const unsigned (&pf)[TK / 16][4], unsigned v_s) {
#pragma unroll
  for (int kk = 0; kk < TK / 16; ++kk)
    wgmma_rs(o, pf[kk][0], pf[kk][1], pf[kk][2], pf[kk][3], wgmma_desc(v_s + kk * 2048, TK * 128, 1024), 1);
  wgmma_commit();
}

// A consumer warpgroup: 64 query rows of each work item (rows 64 * cw ..); warp w of it owns rows
// 16 w .. 16 w + 15, this lane rows grp and grp + 8 (the accumulator layout of wgmma, mma.m16n8k16's
// per warp: element 4 j + e of S or O is row grp + 8 (e / 2), column 8 j + 2 tig + e % 2).
// Per tile t of its rows: V3_OVERLAP 0 issues S_t, waits, runs the softmax, issues O += P_t V_t and
// waits (one tile at a time); 1 issues S_t together with the previous tile's O += P_{t-1} V_{t-1} and
// waits for both; 2 (FA3's intra-warpgroup overlap) waits for S_t alone and runs its softmax while
// the P V mma still runs. Per row all three are the same sequence O = O * corr_t + P_t V_t tile after
// tile (the same products, rescales and sums in the same order), so the bits do not change.
__device__ __forceinline__ void consume(const Smem &sm, scalar_t *__restrict__ out, const int *__restrict__ context_lens,
                                        const int *__restrict__ query_start_loc, int num_heads, int num_seqs,
                                        int num_q_tiles, float scale, int ctid) {
  // Warp-uniform as the compiler sees it (a shuffle from lane 0): the branches around the wgmmas must
  // not look divergent, or ptxas serialises every wgmma (its warning C7520).
  const int cw = __shfl_sync(PR_FULL_MASK, ctid / WG, 0), warp = __shfl_sync(PR_FULL_MASK, ctid / 32 % 4, 0);
  const int lane = ctid % 32, grp = lane / 4, tig = lane % 4;
  const float scale_log2 = scale * LOG2E;
  const long long q_row_stride = (long long)num_heads * HEAD_DIM;
  const unsigned q_wg = sm.q + cw * 64 * 128;  // this consumer's rows in Q's first column block
  const int num_items = num_seqs * num_heads * num_q_tiles;
  if (V3_PINGPONG && cw == 1) named_arrive<1>();  // consumer 0 issues first
  int g = 0, n = 0;  // the CTA's tiles and items so far
  for (int k = 0; k * (int)gridDim.x < num_items; ++k) {
    const int i = item_index(k, num_items);
    Item it;
    if (i < 0 || !item_at(i, num_seqs, num_heads, num_q_tiles, query_start_loc, context_lens, it)) continue;
    const int wg_row0 = it.row0 + 64 * cw, wrow0 = wg_row0 + 16 * warp;
    // Tiles 0 .. last hold keys this consumer's rows see (none if its rows are past the chunk).
    const int last = wg_row0 < it.qlen ? (it.first_pos + min(wg_row0 + 63, it.qlen - 1)) / TK : -1;
    const int wg_first = it.first_pos + wg_row0;
    // This lane's rows' positions (rows past the chunk borrow the last row's, and are never written).
    const int pos_lo = it.first_pos + min(wrow0 + grp, it.qlen - 1);
    const int pos_hi = it.first_pos + min(wrow0 + grp + 8, it.qlen - 1);
    mbar_wait(sm.q_full, n & 1);
    float o[HEAD_DIM / 2];
#pragma unroll
    for (int e = 0; e < HEAD_DIM / 2; ++e) o[e] = 0.f;
    float m_lo = neg_inf(), m_hi = neg_inf(), l_lo = 0.f, l_hi = 0.f, corr_lo, corr_hi;
    unsigned pf[TK / 16][4];
    // S_t of this item's tile t: wait for its stage, issue S_t (and with V3_OVERLAP the previous
    // tile's P V, issued here from the packed P), wait as the variant says, mask and softmax.
#define V3_SCORES(T, WITH_PV)                                                                                     \
  const int stage = (g + (T)) % KV_STAGES;                                                                      \
  mbar_wait(sm.full + 8 * stage, ((g + (T)) / KV_STAGES) & 1);                                                  \
  turn_begin(cw);                                                                                               \
  /* The stage was written by cp.async (the generic proxy); the tensor cores read it through the async proxy. */ \
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");                                                \
  float sc[TK / 2];                                                                                             \
  wgmma_fence();                                                                                                \
  issue_s(sc, q_wg, sm.kv + stage * STAGE_BYTES);                                                               \
  if (WITH_PV) issue_pv(o, pf, sm.kv + (g + (T) - 1) % KV_STAGES * STAGE_BYTES + TILE_BYTES);                   \
  turn_end(cw);                                                                                                 \
  if (WITH_PV && V3_OVERLAP == 2) wgmma_wait_but_one(); /* S_t; P_{t-1} V_{t-1} may still run */                \
  else wgmma_wait_all();                                                                                        \
  fence_regs(sc);                                                                                               \
  if ((T) == last) release(sm.q_empty, lane); /* Q no longer read: the producer may load the next item's */     \
  softmax_tile(sc, (T) * TK, (T) * TK + TK - 1 > wg_first, pos_lo, pos_hi, tig, scale_log2, m_lo, m_hi, l_lo,  \
               l_hi, corr_lo, corr_hi);
    if (!V3_OVERLAP) {
      for (int t = 0; t <= last; ++t) {
        V3_SCORES(t, false)
#pragma unroll
        for (int e = 0; e < HEAD_DIM / 2; ++e) o[e] *= e % 4 < 2 ? corr_lo : corr_hi;
        pack_p(pf, sc);
        turn_begin(cw);
        wgmma_fence();
        issue_pv(o, pf, sm.kv + stage * STAGE_BYTES + TILE_BYTES);
        turn_end(cw);
        wgmma_wait_all();
        fence_regs(o);
        release(sm.empty + 8 * stage, lane);  // this warp's mmas no longer read the stage
      }
    } else if (last >= 0) {
      {  // tile 0: S_0 alone (O is still zero)
        V3_SCORES(0, false)
        pack_p(pf, sc);
      }
      for (int t = 1; t <= last; ++t) {
        V3_SCORES(t, true)
        wgmma_wait_all();
        fence_regs(o);
        release(sm.empty + 8 * ((g + t - 1) % KV_STAGES), lane);  // tile t - 1 fully read
#pragma unroll
        for (int e = 0; e < HEAD_DIM / 2; ++e) o[e] *= e % 4 < 2 ? corr_lo : corr_hi;
        pack_p(pf, sc);
      }
      const int stage = (g + last) % KV_STAGES;  // the last P V
      wgmma_fence();
      issue_pv(o, pf, sm.kv + stage * STAGE_BYTES + TILE_BYTES);
      wgmma_wait_all();
      fence_regs(o);
      release(sm.empty + 8 * stage, lane);
    }
#undef V3_SCORES
    if (last < 0) release(sm.q_empty, lane);  // no rows here: Q is not read
    for (int t = last + 1; t < it.num_tiles; ++t) {  // tiles after every row of this consumer: no-ops (as v2)
      const int stage = (g + t) % KV_STAGES;
      mbar_wait(sm.full + 8 * stage, ((g + t) / KV_STAGES) & 1);
      for (int turn = 0; turn < (V3_OVERLAP ? 1 : 2); ++turn) {  // the other consumer's turns go on
        turn_begin(cw);
        turn_end(cw);
      }
      release(sm.empty + 8 * stage, lane);
    }
    g += it.num_tiles;
    ++n;
    if (last >= 0) write_rows(out, o, l_lo, l_hi, it.q0, wrow0 + grp, it.qlen, q_row_stride, it.h, tig);
  }
  if (V3_PINGPONG && cw == 0) named_sync<1>();  // the last turn consumer 1 handed over
}

// v1's arguments, shape for shape, then num_seqs and num_q_tiles = ceil(max_query_len / TQ): the
// work items are num_seqs * num_heads * num_q_tiles, dealt to the gridDim.x CTAs (item_index).
extern "C" __global__ void __launch_bounds__(V3_THREADS, 1) paged_prefill_v3(
    scalar_t *__restrict__ out, const scalar_t *__restrict__ q,
    const scalar_t *__restrict__ k_cache, const scalar_t *__restrict__ v_cache,
    const int *__restrict__ block_tables, const int *__restrict__ context_lens,
    const int *__restrict__ query_start_loc, int max_blocks, int num_heads, int num_kv_heads, float scale,
    int num_seqs, int num_q_tiles) {
  extern __shared__ unsigned char smem_v3[];
  // 1024-byte aligned base (the swizzle atoms): Q [TQ rows], then KV_STAGES x (K, V) [TK rows], then
  // the mbarriers: full[KV_STAGES], empty[KV_STAGES], q_full, q_empty, 8 bytes each.
  Smem sm;
  sm.q = (smem_u32(smem_v3) + 1023u) & ~1023u;
  sm.kv = sm.q + Q_BYTES;
  sm.full = sm.kv + KV_STAGES * STAGE_BYTES;
  sm.empty = sm.full + 8 * KV_STAGES;
  sm.q_full = sm.empty + 8 * KV_STAGES;
  sm.q_empty = sm.q_full + 8;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int i = 0; i < KV_STAGES; ++i) {
      mbar_init(sm.full + 8 * i, WG);  // one arrival per producer thread (its copies landed)
      mbar_init(sm.empty + 8 * i, 8);  // one arrival per consumer warp (its mmas read the stage)
    }
    mbar_init(sm.q_full, WG);
    mbar_init(sm.q_empty, 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (tid < WG) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    produce(sm, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, max_blocks, num_heads, num_kv_heads,
            num_seqs, num_q_tiles, tid);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    consume(sm, out, context_lens, query_start_loc, num_heads, num_seqs, num_q_tiles, scale, tid - WG);
  }
}
