// hopper.cuh: what the kernels written for Hopper's own instructions (sm_90a) share: prefill v3
// (paged_prefill_hopper.cu) and the weight GEMM (gemm_hopper.cu).
//
// One idea: a warp-specialised Hopper kernel is copies that signal mbarriers, and wgmma products that read
// shared memory through descriptors and run asynchronously until waited for. These are those primitives,
// each one PTX instruction (PTX ISA: "mbarrier", "Asynchronous Warpgroup Level Matrix Multiply-Accumulate").
#pragma once

#include "dtype.cuh"

// wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, leading
// and stride byte offsets (all >> 4), 128-byte swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
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

// Announce `bytes` more to come from bulk copies (complete_tx) before the current phase completes, without
// arriving: the thread's own arrival comes later (prefill v3's producer: cp.async.mbarrier.arrive).
__device__ __forceinline__ void mbar_add_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// A CUtensorMap (the driver's opaque 128-byte TMA descriptor), passed by value as a __grid_constant__
// parameter: the copy engine reads it from the parameter space.
struct alignas(64) TmaMap {
  unsigned long long w[16];
};

// Fetch a descriptor into the copy engine's cache before its first use.
__device__ __forceinline__ void prefetch_map(const TmaMap &map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
}

// TMA, one instruction: the box of `map` at (column c0, row c1) -> shared memory at dst, laid out as the
// map's swizzle says; its bytes complete_tx on bar.
__device__ __forceinline__ void tma_load_box(unsigned dst, const TmaMap &map, int c0, int c1, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
               ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(bar)
               : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_but_one() {  // every committed group but the newest is done
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}

// Keep the compiler from moving accumulator reads or writes across a wgmma boundary.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma's operand lists, written once: the accumulator registers D (prefill v3: 32 for N = 64, 64 for
// N = 128) as asm operands "+f"(d[i]), and (each kernel's own) their names %0 .. %N-1 in the instruction text.
#define PR_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define PR_ACC16(i) PR_ACC4(i), PR_ACC4(i + 4), PR_ACC4(i + 8), PR_ACC4(i + 12)
#define PR_ACC32 PR_ACC16(0), PR_ACC16(16)
#define PR_ACC64 PR_ACC32, PR_ACC16(32), PR_ACC16(48)

// One wgmma: SHAPE, the accumulators' names REGS, the operand number PRED of `accumulate` (p = it is
// non-zero: D += A B, else D = A B), then OPERANDS: A's and B's (descriptors, or A's 4 registers), p,
// scale-a = scale-b = 1, and the transpose bits (_ss: 0, 0, both K-major; _rs: B's only, 1: MN-major V).
#define PR_WGMMA(SHAPE, REGS, PRED, OPERANDS)                                                           \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                                      \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32." PR_MMA_T "." PR_MMA_T " {" REGS "}, " OPERANDS ";\n}\n"
