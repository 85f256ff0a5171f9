// dtype.cuh: the element type of the KV pool and the activations, and its conversions to fp32.
//
// One idea: kernels are written once against `scalar_t` and compiled per dtype with -DPR_DTYPE=0|1|2
// (fp32, fp16, bf16). Everything is accumulated in fp32; the element is only a storage format.
// fp16/bf16 are stored as raw 16-bit words and converted with single PTX instructions (cvt.*), so the
// kernels include no system header: the same source compiles under nvcc (CI) and NVRTC (CuPy).
// Shared by the attention kernels (through common.cuh), the small fused ops (fused_ops.cu) and the weight
// GEMM (gemm_hopper.cu), which take their sizes at run time and so do not include common.cuh. Last, two
// helpers every tensor-core kernel uses: smem_u32 and (16-bit types) pack2.
#pragma once

#ifndef PR_DTYPE
#error "compile with -DPR_DTYPE=0 (float32), 1 (float16) or 2 (bfloat16)"
#endif

#if PR_DTYPE == 0
typedef float scalar_t;
#elif PR_DTYPE == 1 || PR_DTYPE == 2
typedef unsigned short scalar_t;  // the raw bits of a half or a bfloat16
#else
#error "PR_DTYPE must be 0, 1 or 2"
#endif

#define PR_FULL_MASK 0xffffffffu

__device__ __forceinline__ float to_float(scalar_t x) {
#if PR_DTYPE == 0
  return x;
#elif PR_DTYPE == 1
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
#else
  return __uint_as_float(((unsigned int)x) << 16);  // bf16 is the top half of an fp32
#endif
}

__device__ __forceinline__ scalar_t from_float(float f) {
#if PR_DTYPE == 0
  return f;
#elif PR_DTYPE == 1
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));  // round to nearest even
  return h;
#else
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));  // round to nearest even (sm_80+)
  return h;
#endif
}

// A shared-memory address as the 32-bit operand of PTX's .shared instructions.
__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

#if PR_DTYPE == 1 || PR_DTYPE == 2
// scalar_t's name in PTX's tensor-core and conversion instructions.
#if PR_DTYPE == 2
#define PR_MMA_T "bf16"
#else
#define PR_MMA_T "f16"
#endif

// Two floats -> one word of two 16-bit values (lo in the low half), round to nearest even.
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn." PR_MMA_T "x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif
