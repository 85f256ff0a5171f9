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
//   v1 (this file): scores and p.V as fp32 FMAs on CUDA cores; correct for every dtype and head_dim,
//      bounded by the FMA rate (about 67 TFLOP/s on an H100/H200) and shared-memory traffic.
//   next (not here): tensor-core tiles (mma.sync m16n8k16 with ldmatrix, FlashAttention-2), then
//      Hopper's wgmma fed by the bulk tensor copy engine (FlashAttention-3): 5-10x the FLOP/s.
//
// Compile-time parameters (-D): PR_DTYPE, HEAD_DIM (multiple of VEC, <= 256), BLOCK_SIZE.
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
