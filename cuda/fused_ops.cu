// fused_ops.cu: the small per-token operations of a Llama layer, each one pass over its rows.
//
// One idea: between the matrix multiplies, a decode step's per-token work (RMSNorm, the residual add,
// SwiGLU's activation, RoPE, the K/V write into the paged pool) is a chain of memory-bound torch
// ops, each reading and writing whole activations and each a launch. Fused (vLLM's
// fused_add_rms_norm, silu_and_mul, rotary_embedding + reshape_and_cache), every activation is read
// once and written once, in four launches per layer.
//
// Kernels (scalar_t from -DPR_DTYPE=0|1|2; every one also comes in vector widths W = 1, 2, 4, 8
// elements per load, `_w<W>`, W * sizeof(scalar_t) <= 16 bytes; the launcher picks W from the row
// length alone, so the arithmetic never depends on the batch or on addresses):
//
// rms_norm_w<W>: out[t] = weight * round(x[t] * rstd(x[t]))  (transformers' Llama RMSNorm: statistics
//   in fp32, the normalised row rounded to the model dtype, then multiplied by the weight).
// fused_add_rms_norm_w<W>: z = round(x[t] + residual[t]); residual_out[t] = z; out[t] = RMSNorm(z).
//   The norm is taken of the rounded sum, so it equals `r = x + r; rms_norm(r)` in torch bit for bit.
//   out may alias x and residual_out residual (vLLM's in-place form): each element is read and then
//   written by the same thread, never another's.
//   Launch: grid (num_tokens), block NT threads (a function of hidden_size only, <= 1024). The sum of
//   squares is per thread in index order, then an xor butterfly per warp, then the warps' partials in
//   warp order: one fixed order per row, so a row's result does not depend on its batch.
// splitk_add_rms_norm_w<W>: fused_add_rms_norm whose x is a split-K GEMM's fp32 partials [splits, T,
//   hidden], summed in split order and rounded once (gemm_hopper.cu's gemm_splitk_reduce): the down
//   projection's reduce, the residual add and the next norm in one pass over a row, so down's bf16 output
//   never goes to memory and the reduce is not a launch of its own. The same bits as the reduce then
//   fused_add_rms_norm (the same sum, the same rounding, the same norm). It is launched under the GEMM's
//   tail (a programmatic dependent launch) and waits for the GEMM's end before its first read
//   (griddepcontrol.wait, sm_90; a no-op without a primary grid). Launch as fused_add_rms_norm's.
// silu_and_mul_w<W>: out[t, i] = round(silu(gate[t, i]) * up[t, i]) in fp32 (one rounding). gate and
//   up are row-strided, so they can be the two halves of one gate_up row or two tensors.
//   Launch: grid (num_tokens, ceil(n / (W * blockDim.x))), any block size.
// rotary_embedding_and_cache_w<W>: RoPE in transformers' rotate-half layout (dimension i pairs with
//   i + head_dim / 2) on every query head (into q_out) and every key head, then the key heads, rotated,
//   and the value heads go to slot slot_mapping[t] of k/v_cache [num_blocks, block_size, Hkv, head_dim]
//   (a slot < 0 is padding: nothing is written for it, as vLLM's reshape_and_cache skips it).
//   cos/sin are fp32 tables [rows, head_dim / 2] (the model's, so llama3 / linear scaling come for
//   free); token t reads row positions[t], or row t when positions is null (tables already gathered).
//   With write_k the rotated keys also go back into k (RoPE alone: k_cache null, nothing cached).
//   The rotated queries go to q_out (its own token stride; q_out == q: in place), so q may be a strided
//   view into a merged qkv row and q_out the contiguous query tensor attention reads.
//   The rotation is fp32 with one rounding per output (transformers rounds cos/sin to the model dtype
//   and each product: within the same tolerance, closer to the float64 oracle).
//   Launch: grid (num_tokens), any block size; each thread rotates W dimension pairs of one head or
//   copies W values of one value head.
//
// The dtype and its conversions are dtype.cuh's (common.cuh also demands the attention kernels'
// HEAD_DIM and BLOCK_SIZE, which these kernels take at run time).

#include "dtype.cuh"

// W consecutive elements, loaded and stored as one access of W * sizeof(scalar_t) bytes.
template <int W>
struct alignas(W * sizeof(scalar_t)) Vec {
  scalar_t v[W];
};

template <int W>
__device__ __forceinline__ Vec<W> load(const scalar_t *p) {
  return *reinterpret_cast<const Vec<W> *>(p);
}

template <int W>
__device__ __forceinline__ void store(scalar_t *p, const Vec<W> &x) {
  *reinterpret_cast<Vec<W> *>(p) = x;
}

// A programmatic dependent launch's wait for the grid before it (its writes visible after it); a no-op when
// the kernel was launched normally, and before sm_90, which has no such launch.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// --- RMSNorm, with or without the residual add -------------------------------------------------------

// The sum of x over the CTA, the same bits in every thread: butterfly per warp, then the warps' partials
// added in warp order by every thread (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float partial[32];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(PR_FULL_MASK, x, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = x;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += partial[w];
  return total;
}

// W consecutive fp32 values, loaded as one access (two of 16 bytes at W = 8).
template <int W>
struct alignas(W * sizeof(float)) FVec {
  float v[W];
};

// The row's W elements at element i of a split-K GEMM's fp32 partials: the splits summed in split order,
// rounded once to scalar_t (exactly gemm_splitk_reduce's sum and rounding).
template <int W>
__device__ __forceinline__ Vec<W> sum_splits(const float *__restrict__ partial, long long i, int splits,
                                             long long split_stride) {
  FVec<W> acc = *reinterpret_cast<const FVec<W> *>(partial + i);
  for (int z = 1; z < splits; ++z) {
    const FVec<W> p = *reinterpret_cast<const FVec<W> *>(partial + z * split_stride + i);
#pragma unroll
    for (int j = 0; j < W; ++j) acc.v[j] += p.v[j];
  }
  Vec<W> r;
#pragma unroll
  for (int j = 0; j < W; ++j) r.v[j] = from_float(acc.v[j]);
  return r;
}

// Where a norm's input row comes from: x alone (rms_norm), x + residual (fused_add_rms_norm), or a
// split-K GEMM's partials + residual (splitk_add_rms_norm).
enum NormInput { NORM_X, NORM_X_PLUS_RESIDUAL, NORM_SPLITS_PLUS_RESIDUAL };

// x, residual, residual_out, out: rows of `hidden` elements, `stride` elements apart (the same stride for
// all four). No __restrict__: out may alias x, residual_out residual. With NORM_SPLITS_PLUS_RESIDUAL, x is
// unused and row t's partials start at partial + t * hidden, split z's `split_stride` elements after split 0's.
template <int W, NormInput IN>
__device__ __forceinline__ void add_rms_norm(scalar_t *out, const scalar_t *x, const scalar_t *residual,
                                             scalar_t *residual_out, const scalar_t *__restrict__ weight,
                                             long long stride, int hidden, float eps,
                                             const float *__restrict__ partial = nullptr, int splits = 0,
                                             long long split_stride = 0) {
  constexpr bool ADD = IN != NORM_X;
  const long long row = (long long)blockIdx.x * stride;
  const int nvec = hidden / W;
  float ss = 0.f;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Vec<W> a = IN == NORM_SPLITS_PLUS_RESIDUAL
                   ? sum_splits<W>(partial, (long long)blockIdx.x * hidden + i * W, splits, split_stride)
                   : load<W>(x + row + i * W);
    if (ADD) {
      const Vec<W> b = load<W>(residual + row + i * W);
#pragma unroll
      for (int j = 0; j < W; ++j) a.v[j] = from_float(to_float(a.v[j]) + to_float(b.v[j]));
      store<W>(residual_out + row + i * W, a);
    }
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float z = to_float(a.v[j]);
      ss += z * z;
    }
  }
  const float rstd = 1.f / sqrtf(block_sum(ss) / (float)hidden + eps);
  // Second pass over the row this thread itself read (or wrote): L1/L2 hits, and no other thread's data.
  const scalar_t *z_row = ADD ? residual_out : x;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    const Vec<W> z = load<W>(z_row + row + i * W);
    const Vec<W> w = load<W>(weight + i * W);
    Vec<W> y;
#pragma unroll
    for (int j = 0; j < W; ++j) y.v[j] = from_float(to_float(w.v[j]) * to_float(from_float(to_float(z.v[j]) * rstd)));
    store<W>(out + row + i * W, y);
  }
}

#define PR_RMS_NORM(W)                                                                                         \
  extern "C" __global__ void __launch_bounds__(1024) rms_norm_w##W(                                          \
      scalar_t *out, const scalar_t *x, const scalar_t *__restrict__ weight, long long stride, int hidden,     \
      float eps) {                                                                                             \
    add_rms_norm<W, NORM_X>(out, x, nullptr, nullptr, weight, stride, hidden, eps);                            \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(1024) fused_add_rms_norm_w##W(                                \
      scalar_t *out, const scalar_t *x, const scalar_t *residual, scalar_t *residual_out,                      \
      const scalar_t *__restrict__ weight, long long stride, int hidden, float eps) {                          \
    add_rms_norm<W, NORM_X_PLUS_RESIDUAL>(out, x, residual, residual_out, weight, stride, hidden, eps);        \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(1024) splitk_add_rms_norm_w##W(                               \
      scalar_t *out, const float *__restrict__ partial, int splits, long long split_stride,                    \
      const scalar_t *residual, scalar_t *residual_out, const scalar_t *__restrict__ weight, long long stride, \
      int hidden, float eps) {                                                                                 \
    grid_dependency_wait();                                                                                    \
    add_rms_norm<W, NORM_SPLITS_PLUS_RESIDUAL>(out, nullptr, residual, residual_out, weight, stride, hidden,   \
                                               eps, partial, splits, split_stride);                            \
  }

// --- SiLU and multiply -------------------------------------------------------------------------------

template <int W>
__device__ __forceinline__ void silu_and_mul(scalar_t *__restrict__ out, const scalar_t *__restrict__ gate,
                                             const scalar_t *__restrict__ up, long long out_stride,
                                             long long gate_stride, long long up_stride, int n) {
  const long long t = blockIdx.x;
  const int i = (blockIdx.y * blockDim.x + threadIdx.x) * W;
  if (i >= n) return;
  const Vec<W> g = load<W>(gate + t * gate_stride + i);
  const Vec<W> u = load<W>(up + t * up_stride + i);
  Vec<W> y;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const float a = to_float(g.v[j]);
    y.v[j] = from_float(a / (1.f + expf(-a)) * to_float(u.v[j]));  // silu(a) = a * sigmoid(a); -> -0 as a -> -inf
  }
  store<W>(out + t * out_stride + i, y);
}

#define PR_SILU_AND_MUL(W)                                                                                     \
  extern "C" __global__ void silu_and_mul_w##W(scalar_t *__restrict__ out, const scalar_t *__restrict__ gate, \
                                               const scalar_t *__restrict__ up, long long out_stride,          \
                                               long long gate_stride, long long up_stride, int n) {            \
    silu_and_mul<W>(out, gate, up, out_stride, gate_stride, up_stride, n);                                     \
  }

// --- RoPE and the K/V write into the paged pool -----------------------------------------------------

// q, q_out [T, num_heads, head_dim] and k, v [T, num_kv_heads, head_dim], each with its own token stride
// (heads and dimensions contiguous); k_cache/v_cache [num_slots, num_kv_heads, head_dim] or null. No
// __restrict__ on q and q_out: they may be the same tensor (each element is read, then written, by one thread).
template <int W>
__device__ __forceinline__ void rotary_embedding_and_cache(
    scalar_t *q_out, const scalar_t *q, scalar_t *k, const scalar_t *v, long long q_out_stride, long long q_stride,
    long long k_stride, long long v_stride, scalar_t *__restrict__ k_cache, scalar_t *__restrict__ v_cache,
    const long long *__restrict__ slot_mapping, const long long *__restrict__ positions,
    const float *__restrict__ cos, const float *__restrict__ sin, int num_heads, int num_kv_heads, int head_dim,
    int write_k) {
  const long long t = blockIdx.x;
  const int half = head_dim / 2;
  const long long table_row = (positions ? positions[t] : t) * half;
  const long long slot = k_cache ? slot_mapping[t] : -1;
  const long long slot_row = slot * num_kv_heads * head_dim;  // the slot's first element in either pool
  const int pair_vecs = half / W;  // W-wide pairs of vectors per head
  const int rope_items = (num_heads + num_kv_heads) * pair_vecs;
  const int v_items = slot >= 0 ? num_kv_heads * (head_dim / W) : 0;
  for (int item = threadIdx.x; item < rope_items + v_items; item += blockDim.x) {
    if (item < rope_items) {
      const int h = item / pair_vecs, j = (item % pair_vecs) * W;
      const bool is_q = h < num_heads;
      const int kh = h - num_heads;
      const scalar_t *src = is_q ? q + t * q_stride + (long long)h * head_dim : k + t * k_stride + (long long)kh * head_dim;
      const Vec<W> x1 = load<W>(src + j), x2 = load<W>(src + half + j);
      Vec<W> o1, o2;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float c = __ldg(cos + table_row + j + w), s = __ldg(sin + table_row + j + w);
        const float a = to_float(x1.v[w]), b = to_float(x2.v[w]);
        o1.v[w] = from_float(a * c - b * s);  // (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        o2.v[w] = from_float(b * c + a * s);
      }
      if (is_q || write_k) {
        scalar_t *dst = is_q ? q_out + t * q_out_stride + (long long)h * head_dim : k + t * k_stride + (long long)kh * head_dim;
        store<W>(dst + j, o1);
        store<W>(dst + half + j, o2);
      }
      if (!is_q && slot >= 0) {
        scalar_t *dst = k_cache + slot_row + (long long)kh * head_dim;
        store<W>(dst + j, o1);
        store<W>(dst + half + j, o2);
      }
    } else {
      const int i = (item - rope_items) * W;  // [kv head][dimension] of the value row
      store<W>(v_cache + slot_row + i, load<W>(v + t * v_stride + i));
    }
  }
}

#define PR_ROTARY(W)                                                                                             \
  extern "C" __global__ void rotary_embedding_and_cache_w##W(                                                  \
      scalar_t *q_out, const scalar_t *q, scalar_t *k, const scalar_t *v, long long q_out_stride,                \
      long long q_stride, long long k_stride, long long v_stride, scalar_t *__restrict__ k_cache,                 \
      scalar_t *__restrict__ v_cache, const long long *__restrict__ slot_mapping,                                 \
      const long long *__restrict__ positions, const float *__restrict__ cos, const float *__restrict__ sin,     \
      int num_heads, int num_kv_heads, int head_dim, int write_k) {                                              \
    rotary_embedding_and_cache<W>(q_out, q, k, v, q_out_stride, q_stride, k_stride, v_stride, k_cache, v_cache,  \
                                  slot_mapping, positions, cos, sin, num_heads, num_kv_heads, head_dim, write_k); \
  }

#define PR_ALL(W) PR_RMS_NORM(W) PR_SILU_AND_MUL(W) PR_ROTARY(W)

PR_ALL(1)
PR_ALL(2)
PR_ALL(4)
#if PR_DTYPE != 0
PR_ALL(8)  // 16 bytes of 16-bit values
#endif
