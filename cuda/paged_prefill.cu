// paged_prefill.cu: prefill / chunked-prefill attention over a paged KV cache (variable-length batch).
//
// Layout read:
//   q               [num_tokens, num_heads, HEAD_DIM]                  scalar_t
//   k/v_cache       [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]   scalar_t (one layer's pool)
//   block_tables    [num_seqs, max_blocks] int32, context_lens [num_seqs] int32 (as in decode)
//   query_start_loc [num_seqs + 1] int32: sequence s owns query rows query_start_loc[s] ..
//                   query_start_loc[s+1]-1; they are the LAST query_len tokens of its context, so row
//                   j sits at position context_lens[s] - query_len + j and sees keys 0 .. that position.
//   out             [num_tokens, num_heads, HEAD_DIM]                  scalar_t
// The new tokens' K/V are already in the pool (reshape_and_cache runs first), so a chunk attends to
// the cached prefix and to itself through the same block table: this is what chunked prefill needs.
//
// Algorithm (flash-attention's online softmax, on CUDA cores): a CTA owns ROWS query rows of one
// sequence and one query head. It walks the keys in tiles of KEYS = 32 tokens (tiles start at
// multiples of 32 in the sequence, whatever the chunking), stopping at the tile of its last row's
// position. Per tile: the 128 threads gather the K tile through the block table into shared memory
// (fp32, rows padded by 4 floats so float4 reads are conflict-free); each warp owns ROWS_PER_WARP rows
// and lane j scores key j against them (keys past a row's position get -inf); the row's running
// max m and sum l are updated and its accumulator rescaled by exp(m_old - m_new); then the V tile
// replaces the K tile and each lane accumulates p.V for its HEAD_DIM / 32 output dimensions.
// A row's arithmetic depends only on its own position and the tile grid, never on which other rows,
// sequences or physical blocks share the launch: results are invariant under batching and placement.
//
// Launch shape: grid (num_seqs, num_heads, ceil(max_query_len / ROWS)), block 128 (4 warps),
// dynamic shared memory (ROWS * HEAD_DIM + KEYS * (HEAD_DIM + 4)) * 4 bytes.
//
// Versions, in rising sophistication:
//   v1 paged_prefill: scores and p.V as fp32 FMAs on CUDA cores; correct for every dtype and head_dim,
//      bounded by the FMA rate (about 67 TFLOP/s on an H100/H200) and shared-memory traffic.
//   v2 paged_prefill_v2 (with -DPREFILL_MMA=1; 16-bit Q/K/V, vLLM's head sizes 64 .. 256): FlashAttention-2
//      on the tensor cores (mma.sync m16n8k16, cp.async double buffering, ldmatrix). Its own section
//      at the end of this file; the default wherever v3 does not apply. The launcher runs v1 for any
//      other dtype or head_dim (a choice made from the model's shapes, never from the batch).
//   v3 paged_prefill_v3 (its own file, paged_prefill_hopper.cu: sm_90a only; 16-bit, HEAD_DIM 64 or
//      128): FlashAttention-3 on Hopper's own instructions: wgmma with operands in shared memory, a
//      producer warpgroup gathering K/V tiles through the block table with cp.async into an mbarrier
//      ring, two consumer warpgroups, setmaxnreg. The default on sm_90 devices where it applies (a
//      choice from the model's shapes and the device).
//
// Compile-time parameters (-D): PR_DTYPE, HEAD_DIM (multiple of VEC, <= 256), BLOCK_SIZE, PREFILL_MMA (0/1).
#include "common.cuh"


constexpr int ROWS_PER_WARP = 4;
constexpr int ROWS = NUM_WARPS * ROWS_PER_WARP;  // query rows per CTA
constexpr int KEYS = PR_WARP;                    // keys per tile: one per lane
constexpr int KV_STRIDE = HEAD_DIM + 4;          // floats per K/V row in shared memory
constexpr int DPL = (HEAD_DIM + PR_WARP - 1) / PR_WARP;  // output dims per lane
constexpr int VPR = HEAD_DIM / VEC;                      // 16-byte vectors per row

static_assert(HEAD_DIM % VEC == 0 && HEAD_DIM % 4 == 0, "HEAD_DIM must be a multiple of 16 bytes");
static_assert(HEAD_DIM <= 256, "HEAD_DIM above 256 is not supported");

// Gather keys [tile*KEYS, tile*KEYS + KEYS) of one KV head into kv_s as fp32; zeros past the context.
__device__ __forceinline__ void load_tile(float *kv_s, const scalar_t *__restrict__ cache, const int *bt,
                                          int tile, int ctx, int kv_head, int num_kv_heads) {
#pragma unroll
  for (int idx = threadIdx.x; idx < KEYS * VPR; idx += NUM_THREADS) {
    const int j = idx / VPR, vi = idx % VPR;
    const int tok = tile * KEYS + j;
    float f[VEC];
    if (tok < ctx) {
      const long long slot = (long long)bt[tok / BLOCK_SIZE] * BLOCK_SIZE + tok % BLOCK_SIZE;
      unpack(load16(cache + (slot * num_kv_heads + kv_head) * HEAD_DIM + vi * VEC), f);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = 0.f;
    }
    float4 *dst = reinterpret_cast<float4 *>(kv_s + j * KV_STRIDE + vi * VEC);
#pragma unroll
    for (int e = 0; e < VEC; e += 4) dst[e / 4] = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
  }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_prefill(
    scalar_t *__restrict__ out, const scalar_t *__restrict__ q,
    const scalar_t *__restrict__ k_cache, const scalar_t *__restrict__ v_cache,
    const int *__restrict__ block_tables, const int *__restrict__ context_lens,
    const int *__restrict__ query_start_loc, int max_blocks, int num_heads, int num_kv_heads, float scale) {
  extern __shared__ float4 smem4[];  // float4: 16-byte aligned
  float *smem = reinterpret_cast<float *>(smem4);
  float *q_s = smem;                    // [ROWS][HEAD_DIM]
  float *kv_s = smem + ROWS * HEAD_DIM;  // [KEYS][KV_STRIDE]: the K tile, then the V tile

  const int s = blockIdx.x, h = blockIdx.y, row0 = blockIdx.z * ROWS;
  const int q0 = query_start_loc[s], qlen = query_start_loc[s + 1] - q0;
  if (row0 >= qlen) return;  // the whole CTA leaves together
  const int ctx = context_lens[s];
  const int first_pos = ctx - qlen;  // position of the sequence's first query row
  const int kv_head = h / (num_heads / num_kv_heads);
  const int *bt = block_tables + (long long)s * max_blocks;
  const int tid = threadIdx.x, warp = tid / PR_WARP, lane = tid % PR_WARP;

  // Stage the CTA's query rows in fp32 (zeros for rows past the chunk).
#pragma unroll
  for (int idx = tid; idx < ROWS * VPR; idx += NUM_THREADS) {
    const int r = idx / VPR, vi = idx % VPR;
    float f[VEC];
    if (row0 + r < qlen) {
      unpack(load16(q + ((long long)(q0 + row0 + r) * num_heads + h) * HEAD_DIM + vi * VEC), f);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) q_s[r * HEAD_DIM + vi * VEC + e] = f[e];
  }

  // This warp's rows; a row past the chunk borrows the last row's position and is never written.
  int pos[ROWS_PER_WARP];
  float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][DPL];
#pragma unroll
  for (int i = 0; i < ROWS_PER_WARP; ++i) {
    pos[i] = first_pos + min(row0 + warp * ROWS_PER_WARP + i, qlen - 1);
    m[i] = neg_inf();
    l[i] = 0.f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[i][e] = 0.f;
  }
  const int last_pos = first_pos + min(row0 + ROWS, qlen) - 1;
  const int num_tiles = last_pos / KEYS + 1;

  for (int tile = 0; tile < num_tiles; ++tile) {
    __syncthreads();  // the previous V tile (and, first time, q_s) fully consumed / written
    load_tile(kv_s, k_cache, bt, tile, ctx, kv_head, num_kv_heads);
    __syncthreads();

    // Scores: lane j <-> key tile*KEYS + j, against the warp's rows.
    float sc[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) sc[i] = 0.f;
    const float *kr = kv_s + lane * KV_STRIDE;
#pragma unroll 4
    for (int d = 0; d < HEAD_DIM; d += 4) {
      const float4 k4 = *reinterpret_cast<const float4 *>(kr + d);
#pragma unroll
      for (int i = 0; i < ROWS_PER_WARP; ++i) {
        const float4 q4 = *reinterpret_cast<const float4 *>(q_s + (warp * ROWS_PER_WARP + i) * HEAD_DIM + d);
        sc[i] = fmaf(q4.x, k4.x, sc[i]);
        sc[i] = fmaf(q4.y, k4.y, sc[i]);
        sc[i] = fmaf(q4.z, k4.z, sc[i]);
        sc[i] = fmaf(q4.w, k4.w, sc[i]);
      }
    }
    const int key = tile * KEYS + lane;
    float p[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
      const float x = key <= pos[i] ? sc[i] * scale : neg_inf();  // causal mask
      const float m_new = fmaxf(m[i], group_max<PR_WARP>(x));      // finite: key 0 is always visible
      const float corr = expf(m[i] - m_new);                       // 0 on the first tile, 1 if unchanged
      p[i] = expf(x - m_new);
      l[i] = l[i] * corr + group_sum<PR_WARP>(p[i]);
      m[i] = m_new;
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[i][e] *= corr;
    }

    __syncthreads();  // every warp is done with the K tile
    load_tile(kv_s, v_cache, bt, tile, ctx, kv_head, num_kv_heads);
    __syncthreads();
#pragma unroll 4
    for (int j = 0; j < KEYS; ++j) {
#pragma unroll
      for (int i = 0; i < ROWS_PER_WARP; ++i) {
        const float pj = __shfl_sync(PR_FULL_MASK, p[i], j);
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
          const int d = lane + e * PR_WARP;
          if (d < HEAD_DIM) acc[i][e] = fmaf(pj, kv_s[j * KV_STRIDE + d], acc[i][e]);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < ROWS_PER_WARP; ++i) {
    const int row = row0 + warp * ROWS_PER_WARP + i;
    if (row >= qlen) continue;
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      const int d = lane + e * PR_WARP;
      if (d < HEAD_DIM) out[((long long)(q0 + row) * num_heads + h) * HEAD_DIM + d] = from_float(acc[i][e] / l[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// v2: FlashAttention-2 on the tensor cores. Compiled only with -DPREFILL_MMA=1 (its own config).
// ---------------------------------------------------------------------------------------------
// Why: v1 spends two fp32 FMAs and a shared-memory read per multiply-add; an mma.sync m16n8k16 does
// 2048 multiply-adds per warp instruction. One CTA = (sequence, query head, tile of TQ = 64 query
// rows); warp w owns rows 16w .. 16w + 15 of the tile: the M of every mma it issues.
// Per key tile of TK keys (64; 32 at HEAD_DIM 256, for registers), tiles at multiples of TK of the
// sequence's own positions whatever the chunking:
//   1. the tile's K and V rows are copied through the block table into shared memory with 16-byte
//      cp.async, one tile ahead (two buffers): tile t + 1 flies while tile t is computed. The
//      tile's physical block ids are staged in shared memory two tiles ahead (read from the block
//      table during tile t's math, so no copy waits on a dependent global load);
//   2. S = Q K^T (fp32 accumulators): A = the warp's Q rows (registers, loaded once; at HEAD_DIM
//      256 from shared memory with ldmatrix each tile), B = K^T fragments by ldmatrix from K's rows;
//   3. online softmax in registers, log2 units (scale * log2(e) folded in), per row: running max m,
//      per-lane exp-sum l, accumulators rescaled by 2^(m_old - m_new); keys after a row's absolute
//      position (context_len - query_len + row) get -inf;
//   4. O += P V: S's accumulator fragments ARE P's A fragments once packed to 16 bits (FA2's
//      register reuse), B = V fragments by ldmatrix.trans from V's rows.
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type";
// lane = 4 * grp + tig):
//   A 16x16 (row):  a0 = A[grp][2tig, 2tig+1], a1 = A[grp+8][2tig, 2tig+1],
//                   a2 = A[grp][2tig+8, 2tig+9], a3 = A[grp+8][2tig+8, 2tig+9]   (low half = lower col)
//   B 16x8 (col):   b0 = B[2tig, 2tig+1][grp], b1 = B[2tig+8, 2tig+9][grp]
//   C/D 16x8 fp32:  c0, c1 = C[grp][2tig, 2tig+1], c2, c3 = C[grp+8][2tig, 2tig+1]
// ldmatrix.m8n8.x4 ("Warp-level matrix load instruction: ldmatrix"): lanes 8i .. 8i+7 give the row
// addresses of 8x8 matrix i; register i of lane (grp, tig) receives row grp, elements 2tig, 2tig+1
// of matrix i; with .trans it receives rows 2tig, 2tig+1 of column grp instead. Hence:
//   - K (B of Q K^T: B[k = dim][n = key] = K[key][dim]): matrix i = keys n0 + 8(i/2) .., dims
//     k0 + 8(i%2) .. (non-transposed) -> b0, b1 of key n-tile n0, then b0, b1 of n-tile n0 + 8;
//   - V (B of P V: B[k = key][n = dim] = V[key][dim]): matrix i = keys k0 + 8(i%2) .., dims
//     d0 + 8(i/2) .. (.trans) -> b0, b1 of dim n-tile d0, then of d0 + 8;
//   - Q (A): matrix i = rows 8(i%2) .., dims k0 + 8(i/2) .. -> a0 .. a3.
// Shared-memory rows are HEAD_DIM + 8 elements long: consecutive rows start 16 bytes apart modulo
// 128, so the 8 rows of an ldmatrix matrix hit 8 distinct 16-byte bank groups (no conflict).
// Head dims that are not a multiple of 16 (vLLM's 120): shared-memory rows and the mma loops run
// over DP = HEAD_DIM rounded up to 16 (120 -> 128); the copies fill the first HEAD_DIM columns and
// the last DP - HEAD_DIM columns of every K/V row are zeroed once, so the padded k-step adds exact
// zeros to every score and the padded output columns are computed but never written. Where
// DP == HEAD_DIM (every multiple of 16) the code is the same as before, and so are the bits.
// Never NaN from the pool: tokens past the context (the last tile's tail) copy the context's last
// token (a real one) instead, and are masked like every key after the row's position. Every row of
// the tile is written (rows past the chunk are computed with the last row's position, not written).
// Bits: a row's arithmetic depends only on its position and the tile grid: the mma computes each
// output element from its own row of A, the max and sum run over the row's 4 lanes in a fixed xor
// order, and a key tile entirely after a row's position is an exact no-op (corr = 2^0 = 1, p = +0),
// which is why a warp may skip it. So the result is invariant under block placement, batch
// composition AND chunking (a chunk's rows land on other warps and lanes, but each row's operations
// and their order are the same).
#ifndef PREFILL_MMA
#define PREFILL_MMA 0
#endif
#if PREFILL_MMA
static_assert(PR_DTYPE == 1 || PR_DTYPE == 2, "v2 (PREFILL_MMA) needs 16-bit Q/K/V: float16 or bfloat16");
static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM >= 64 && HEAD_DIM <= 256, "v2 (PREFILL_MMA) needs HEAD_DIM a multiple "
              "of 8 from 64 to 256");

constexpr int DP = (HEAD_DIM + 15) / 16 * 16;   // the head dim the mmas run over: a multiple of their k = 16
constexpr int TQ = NUM_WARPS * 16;              // query rows per CTA (pagedref.kernels.splitk.PREFILL_MMA_ROWS)
constexpr int TK = DP <= 128 ? 64 : 32;         // keys per tile (splitk.prefill_mma_key_tile)
constexpr bool Q_IN_REGS = DP <= 128;           // else Q waits in shared memory, re-read each tile
constexpr int SROW = DP + 8;                    // elements per shared-memory row (+16 bytes: no bank conflict)
constexpr int CPR = HEAD_DIM / 8;               // 16-byte chunks per row copied (columns past HEAD_DIM: zeros)
constexpr int TILE_BLOCKS = TK / BLOCK_SIZE;    // physical blocks per key tile (BLOCK_SIZE <= 32 <= TK)
constexpr int KSTEPS = DP / 16;                 // k-steps of S = Q K^T
constexpr int SN = TK / 8;                      // n-tiles of S (8 keys each)
constexpr int ON = DP / 8;                      // n-tiles of O (8 dims each)
static_assert(TK % BLOCK_SIZE == 0, "a key tile covers whole blocks");

__device__ __forceinline__ void cp_async16_ca(void *dst, const scalar_t *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

// ldmatrix .x4: r[i] <- this lane's word of 8x8 matrix i, whose rows lanes 8i .. 8i+7 point at.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const scalar_t *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const scalar_t *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory");
}

// Start copying key tile t (K then V: kv [2][TK][SROW]) of one KV head; blk = the tile's block ids.
// Keys past the context copy the last token (ctx - 1 >= t * TK: the tile has a real key).
__device__ __forceinline__ void copy_kv_tile(scalar_t *kv, const scalar_t *__restrict__ k_cache,
                                             const scalar_t *__restrict__ v_cache, const int *blk, int t, int ctx,
                                             int row_stride, int kv_off) {
#pragma unroll
  for (int idx = threadIdx.x; idx < TK * CPR; idx += NUM_THREADS) {
    const int r = idx / CPR, c = idx % CPR;
    const int tok = min(t * TK + r, ctx - 1);
    const int b = tok / BLOCK_SIZE - t * TILE_BLOCKS;
    const long long off = ((long long)blk[b] * BLOCK_SIZE + tok % BLOCK_SIZE) * row_stride + kv_off + c * 8;
    cp_async16_ca(kv + r * SROW + c * 8, k_cache + off);
    cp_async16_ca(kv + (TK + r) * SROW + c * 8, v_cache + off);
  }
}

// Thread tid's block id of key tile t (0 where no block of the sequence is: never used then).
__device__ __forceinline__ int tile_block_id(const int *bt, int t, int tid, int max_blocks, int ctx) {
  const int col = t * TILE_BLOCKS + tid;
  return tid < TILE_BLOCKS && col < max_blocks && col * BLOCK_SIZE < ctx ? bt[col] : 0;
}

// v1's arguments, shape for shape. Launch: grid (num_seqs, num_heads, ceil(max_query_len / TQ)),
// block NUM_THREADS, dynamic shared memory (4 * TK + (Q_IN_REGS ? 0 : TQ)) * SROW * 2 bytes.
extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_prefill_v2(
    scalar_t *__restrict__ out, const scalar_t *__restrict__ q,
    const scalar_t *__restrict__ k_cache, const scalar_t *__restrict__ v_cache,
    const int *__restrict__ block_tables, const int *__restrict__ context_lens,
    const int *__restrict__ query_start_loc, int max_blocks, int num_heads, int num_kv_heads, float scale) {
  extern __shared__ uint4 smem_v2[];
  scalar_t *kv_s = reinterpret_cast<scalar_t *>(smem_v2);  // [2 buffers][K, V][TK][SROW]
  scalar_t *q_s = kv_s + 4 * TK * SROW;                    // [TQ][SROW], only when !Q_IN_REGS
  __shared__ int blk_s[2][TILE_BLOCKS];                    // block ids of the tiles in flight

  // Query tiles in reverse launch order: the last tiles of a sequence see the most keys, so they
  // start first and the short ones fill the tail (the arithmetic of a tile does not change).
  const int s = blockIdx.x, h = blockIdx.y, row0 = (gridDim.z - 1 - blockIdx.z) * TQ;
  const int q0 = query_start_loc[s], qlen = query_start_loc[s + 1] - q0;
  if (row0 >= qlen) return;  // the whole CTA leaves together, before any barrier
  const int ctx = context_lens[s];
  const int first_pos = ctx - qlen;
  const int kv_head = h / (num_heads / num_kv_heads);
  const int *bt = block_tables + (long long)s * max_blocks;
  const int tid = threadIdx.x, warp = tid / PR_WARP, lane = tid % PR_WARP;
  const int grp = lane / 4, tig = lane % 4;
  const int row_stride = num_kv_heads * HEAD_DIM, kv_off = kv_head * HEAD_DIM;
  const long long q_row_stride = (long long)num_heads * HEAD_DIM;
  const scalar_t *qh = q + (long long)q0 * q_row_stride + h * HEAD_DIM;
  const int num_tiles = (first_pos + min(row0 + TQ, qlen) - 1) / TK + 1;  // through the CTA's last row

  // This warp's rows: wrow0 .. wrow0 + 15 of the chunk; this lane's two rows grp and grp + 8 sit at
  // positions pos_lo and pos_hi (rows past the chunk borrow the last row's position).
  const int wrow0 = row0 + 16 * warp;
  const bool warp_active = wrow0 < qlen;
  const int warp_last = first_pos + min(wrow0 + 15, qlen - 1);  // the warp's last position
  const int pos_lo = first_pos + min(wrow0 + grp, qlen - 1), pos_hi = first_pos + min(wrow0 + grp + 8, qlen - 1);

  if (tid < TILE_BLOCKS) blk_s[0][tid] = tile_block_id(bt, 0, tid, max_blocks, ctx);
  if (!Q_IN_REGS) {  // the CTA's query rows into shared memory (zeros past the chunk)
    for (int idx = tid; idx < TQ * CPR; idx += NUM_THREADS) {
      const int r = idx / CPR, c = idx % CPR;
      scalar_t *dst = q_s + r * SROW + c * 8;
      if (row0 + r < qlen) cp_async16_ca(dst, qh + (row0 + r) * q_row_stride + c * 8);
      else *reinterpret_cast<uint4 *>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  if (DP != HEAD_DIM) {  // zero the padded columns once: no copy ever writes them
    for (int r = tid; r < 4 * TK + (Q_IN_REGS ? 0 : TQ); r += NUM_THREADS)
      *reinterpret_cast<uint4 *>(kv_s + r * SROW + HEAD_DIM) = make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();  // blk_s[0] ready
  copy_kv_tile(kv_s, k_cache, v_cache, blk_s[0], 0, ctx, row_stride, kv_off);
  asm volatile("cp.async.commit_group;\n" ::: "memory");  // group 0: Q (if in shared memory) and tile 0
  if (tid < TILE_BLOCKS) blk_s[1][tid] = tile_block_id(bt, 1, tid, max_blocks, ctx);

  // Q's A fragments (Q_IN_REGS): k-step kk, register i: row grp + 8(i%2), dims 16kk + 2tig + 8(i/2), +1.
  unsigned qf[Q_IN_REGS ? KSTEPS : 1][4];
  if (Q_IN_REGS) {
#pragma unroll
    for (int kk = 0; kk < (Q_IN_REGS ? KSTEPS : 1); ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = wrow0 + grp + 8 * (i % 2), dim = 16 * kk + 2 * tig + 8 * (i / 2);
        qf[kk][i] = row < qlen && (DP == HEAD_DIM || dim < HEAD_DIM) ? *reinterpret_cast<const unsigned *>(qh + row * q_row_stride + dim) : 0u;
      }
  }

  const float scale_log2 = scale * LOG2E;
  float m_lo = neg_inf(), m_hi = neg_inf(), l_lo = 0.f, l_hi = 0.f;  // rows grp, grp + 8
  float o[ON][4];  // C fragments of O: dims 8n + 2tig, +1 of rows grp (o[n][0..1]) and grp + 8 (o[n][2..3])
#pragma unroll
  for (int n = 0; n < ON; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;

  for (int t = 0; t < num_tiles; ++t) {
    __syncthreads();  // (A) buffer (t+1)%2 is no longer read (tile t-1 done); blk_s[(t+1)%2] is written
    if (t + 1 < num_tiles)
      copy_kv_tile(kv_s + ((t + 1) % 2) * 2 * TK * SROW, k_cache, v_cache, blk_s[(t + 1) % 2], t + 1, ctx,
                   row_stride, kv_off);
    asm volatile("cp.async.commit_group;\n" ::: "memory");  // one group per tile, empty or not
    const int next_id = tile_block_id(bt, t + 2, tid, max_blocks, ctx);  // in flight during the math
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");   // tile t (and Q) landed, for this thread
    __syncthreads();  // (B) ... and for every thread
    const scalar_t *k_s = kv_s + (t % 2) * 2 * TK * SROW, *v_s = k_s + TK * SROW;

    if (warp_active && t * TK <= warp_last) {  // else every key of the tile is masked: an exact no-op
      // S = Q K^T: sc[j] is the C fragment of keys t*TK + 8j .. + 7.
      float sc[SN][4];
#pragma unroll
      for (int j = 0; j < SN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[j][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        unsigned a[4];
        if (Q_IN_REGS) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[i] = qf[Q_IN_REGS ? kk : 0][i];
        } else {
          ldsm_x4(a, q_s + (16 * warp + lane % 8 + 8 * (lane / 8 % 2)) * SROW + 16 * kk + 8 * (lane / 16));
        }
#pragma unroll
        for (int jn = 0; jn < SN / 2; ++jn) {
          unsigned b[4];
          ldsm_x4(b, k_s + (16 * jn + lane % 8 + 8 * (lane / 16)) * SROW + 16 * kk + 8 * (lane / 8 % 2));
          mma_16816(sc[2 * jn], a[0], a[1], a[2], a[3], b[0], b[1]);
          mma_16816(sc[2 * jn + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
      }

      // Online softmax, log2 units. Key t*TK + 8j + 2tig + (e%2) of row grp (e < 2) or grp + 8.
      float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
      for (int j = 0; j < SN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = t * TK + 8 * j + 2 * tig + e % 2;
          const float x = key <= (e < 2 ? pos_lo : pos_hi) ? sc[j][e] * scale_log2 : neg_inf();
          sc[j][e] = x;
          if (e < 2) mx_lo = fmaxf(mx_lo, x);
          else mx_hi = fmaxf(mx_hi, x);
        }
#pragma unroll
      for (int off = 1; off < 4; off *= 2) {  // over the row's 4 lanes (equal grp)
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(PR_FULL_MASK, mx_lo, off));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(PR_FULL_MASK, mx_hi, off));
      }
      // Finite: tile 0 holds key 0, which every row sees; later tiles start from a finite m.
      const float corr_lo = exp2_approx(m_lo - mx_lo), corr_hi = exp2_approx(m_hi - mx_hi);  // 0 on tile 0
      m_lo = mx_lo;
      m_hi = mx_hi;
      l_lo *= corr_lo;
      l_hi *= corr_hi;
#pragma unroll
      for (int j = 0; j < SN; ++j) {
        sc[j][0] = exp2_approx(sc[j][0] - m_lo);
        sc[j][1] = exp2_approx(sc[j][1] - m_lo);
        sc[j][2] = exp2_approx(sc[j][2] - m_hi);
        sc[j][3] = exp2_approx(sc[j][3] - m_hi);
        l_lo += sc[j][0] + sc[j][1];
        l_hi += sc[j][2] + sc[j][3];
      }
#pragma unroll
      for (int n = 0; n < ON; ++n) {
        o[n][0] *= corr_lo;
        o[n][1] *= corr_lo;
        o[n][2] *= corr_hi;
        o[n][3] *= corr_hi;
      }

      // O += P V over the tile's 16-key k-steps; P's A fragment = S's C fragments of keys 16kk .. + 15.
#pragma unroll
      for (int kk = 0; kk < TK / 16; ++kk) {
        const unsigned a0 = pack2(sc[2 * kk][0], sc[2 * kk][1]), a1 = pack2(sc[2 * kk][2], sc[2 * kk][3]);
        const unsigned a2 = pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        const unsigned a3 = pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
        for (int dn = 0; dn < ON / 2; ++dn) {
          unsigned b[4];
          ldsm_x4_trans(b, v_s + (16 * kk + lane % 8 + 8 * (lane / 8 % 2)) * SROW + 16 * dn + 8 * (lane / 16));
          mma_16816(o[2 * dn], a0, a1, a2, a3, b[0], b[1]);
          mma_16816(o[2 * dn + 1], a0, a1, a2, a3, b[2], b[3]);
        }
      }
    }
    if (tid < TILE_BLOCKS) blk_s[t % 2][tid] = next_id;  // tile t+2's ids; tile t's were read before (B)
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // nothing may be in flight at exit

  write_rows(out, &o[0][0], l_lo, l_hi, q0, wrow0 + grp, qlen, q_row_stride, h, tig);
}
#endif  // PREFILL_MMA
