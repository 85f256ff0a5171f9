// common.cuh: what the attention kernels share: the element type (dtype.cuh), the -D parameters every
// attention kernel needs, the CTA size, 16-byte loads, warp reductions, the tensor-core helpers.
//
// One idea: kernels are written once against `scalar_t` (dtype.cuh: -DPR_DTYPE=0|1|2) and specialised
// with -D parameters. Loads are 16 bytes wide (uint4): VEC elements of scalar_t per load.
#pragma once

#include "dtype.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=..."
#endif
#ifndef BLOCK_SIZE
#error "compile with -DBLOCK_SIZE=..."
#endif

#define PR_WARP 32
constexpr int NUM_THREADS = 128;  // every attention CTA: 4 warps (pagedref.kernels.splitk.NUM_THREADS)
constexpr int NUM_WARPS = NUM_THREADS / PR_WARP;

// Elements of scalar_t in one 16-byte load.
constexpr int VEC = 16 / (int)sizeof(scalar_t);

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// One 16-byte word -> VEC floats.
__device__ __forceinline__ void unpack(const uint4 &u, float (&f)[VEC]) {
#if PR_DTYPE == 0
  f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
  f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
#else
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = to_float((scalar_t)(w[i] & 0xffffu));
    f[2 * i + 1] = to_float((scalar_t)(w[i] >> 16));
  }
#endif
}

// Read-only 16-byte load through the non-coherent cache: K/V never change during a kernel.
__device__ __forceinline__ uint4 load16(const scalar_t *p) {
  return __ldg(reinterpret_cast<const uint4 *>(p));
}

// Butterfly reductions over `width` consecutive lanes (width a power of two, <= 32). Every lane of
// the group ends with the same bits: a+b == b+a, so the xor tree gives every lane one order.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o /= 2) x += __shfl_xor_sync(PR_FULL_MASK, x, o);
  return x;
}

template <int WIDTH>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(PR_FULL_MASK, x, o));
  return x;
}

// Tensor-core helpers of the decode kernel's v3 (-DDECODE_MMA=1) and the prefill kernel's v2
// (-DPREFILL_MMA=1) and v3 (paged_prefill_hopper.cu defines PREFILL_WGMMA).
#if (defined(PREFILL_MMA) && PREFILL_MMA) || (defined(DECODE_MMA) && DECODE_MMA) || \
    (defined(PREFILL_WGMMA) && PREFILL_WGMMA)
constexpr float LOG2E = 1.4426950408889634f;


// d += A B: A 16x16 row-major, B 16x8 column-major, 16-bit inputs, fp32 accumulators (PTX ISA:
// mma.sync.aligned.m16n8k16; fragment layouts in paged_prefill.cu's v2 section).
__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." PR_MMA_T "." PR_MMA_T ".f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float exp2_approx(float x) {  // 2^x; 2^-inf = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The end of prefill v2 and v3: this lane's two rows of the chunk, row_lo and row_lo + 8, in
// mma.m16n8k16's accumulator layout (o[4 n + e]: row row_lo + 8 (e / 2), dim 8 n + 2 tig + e % 2).
// Each lane added its own keys; add the exp-sums over the row's 4 lanes, then write the rows' HEAD_DIM
// dims, divided by them (rows past the chunk are not written; padded dims past HEAD_DIM neither).
// RCP (prefill v3's V3_RCP_EPILOGUE, as FA3): one division per row, 1 / l, then a product per element;
// another rounding than O / l, the same for every row.
template <bool RCP = false>
__device__ __forceinline__ void write_rows(scalar_t *out, const float *o, float l_lo, float l_hi, int q0, int row_lo,
                                           int qlen, long long q_row_stride, int h, int tig) {
#pragma unroll
  for (int off = 1; off < 4; off *= 2) {
    l_lo += __shfl_xor_sync(PR_FULL_MASK, l_lo, off);
    l_hi += __shfl_xor_sync(PR_FULL_MASK, l_hi, off);
  }
  const float inv_lo = RCP ? 1.f / l_lo : 0.f, inv_hi = RCP ? 1.f / l_hi : 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_lo + 8 * half;
    if (row >= qlen) continue;
    const float l = half ? l_hi : l_lo, inv = half ? inv_hi : inv_lo;
    unsigned *dst = reinterpret_cast<unsigned *>(out + (long long)(q0 + row) * q_row_stride + h * HEAD_DIM + 2 * tig);
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n)
      dst[4 * n] = RCP ? pack2(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv)
                       : pack2(o[4 * n + 2 * half] / l, o[4 * n + 2 * half + 1] / l);
  }
}
#endif
