// gemm_hopper.cu: the weight GEMMs of a decode step, C = A B^T, on Hopper's own instructions (sm_90a).
//
// What it computes (torch's F.linear without bias): A [M, K] activations, B [N, K] a weight matrix as a
// checkpoint stores it (row n holds output feature n), both K-contiguous, 16-bit; C [M, N] in the same
// dtype, each element the fp32 sum over K of A[m, k] B[n, k], rounded once. M is the step's tokens (any),
// N and K the layer's (K a multiple of 64, N of the tile width BN).
//
// Why a GEMM of our own: at a decode batch of 256 rows an 8B step's GEMMs sit at the ridge between
// reading the weights and computing (3.8 TFLOP against 15 GB), and cuBLAS's tiles fill the H200's 132 SMs
// unevenly (bench gemm: 436-662 TFLOP/s at the model's widths, ~720 where the tiles fill whole waves).
// Here the tile width is a compile-time choice per weight shape (pagedref.kernels.gemm), and the split of
// K for the narrow ones too, both fixed by the weight's shape alone.
//
// Design (FlashAttention-3's producer/consumer, as prefill v3, with TMA doing the copies):
//   * CTA = 3 warpgroups. Warpgroup 0 is the producer: one thread issues, per k-step of BK = 64 (128
//     bytes of a row: one swizzle row), bulk tensor copies (TMA: cp.async.bulk.tensor) of A's 128 rows
//     and B's BN rows (two halves) into a ring of STAGES shared-memory stages (the deepest that fits: the
//     narrow tiles need it, o took 29.1 us at 4 stages, 23.8 at 8), and the copies signal the stage's
//     "full" mbarrier with their byte count (expect_tx / complete_tx). Rows of A past M are zeros (the
//     tensor map's bounds), so no row's sum is touched by another's.
//   * Warpgroups 1 and 2 are the consumers, 64 rows of A each: per k-step four wgmma m64nBNk16 with both
//     operands in shared memory (128-byte-swizzled, K-major: the layout TMA writes with SWIZZLE_128B, and
//     prefill v3's for Q and K), fp32 accumulators in registers (BN / 2 per thread). The wgmmas of a
//     k-step are committed as one group; the consumer waits only for the group before it and then
//     releases that group's stage ("empty"), so the tensor cores always have the next k-step queued.
//   * Clusters (GEMM_CLUSTER=2): the CTAs of row tiles 2i and 2i + 1 (same B tile) form a cluster; each copies
//     one half of B with TMA multicast into both, and a stage is refilled only once the consumers of both
//     released it (each consumer warp arrives on the "empty" barriers of both CTAs). B then crosses L2 once
//     per cluster (gate/up: 5% faster). The grid's row tiles are padded to whole clusters (a tile past M
//     copies TMA's zeros and stores nothing).
//   * setmaxnreg: the producer gives its registers back (40), the consumers take them (232).
//   * Epilogue: the accumulators rounded to 16 bits (split-K: fp32) into the ring's shared memory, and from
//     there to C by one bulk tensor store (TMA): whole rows, where the fragments' own stores cost 10-22%.
//     The row-major staging has bank conflicts (Nsight Compute: 4 wavefronts a store where 1 would do at BN = 96
//     and for the fp32 partials, 2 for gate/up's SiLU rows). Staged in 32-byte swizzled boxes instead (one
//     SWIZZLE_32B store per box) it had none, gave the same bits and moved no GEMM by more than 1% (gate/up -0.9%,
//     down -0.3%, SiLU +0.3%; docs/benchmarks.md, 2026-12-02, evening): not kept.
//   * GEMM_SILU_MUL=1 (the MLP's gate/up): B is the merged [gate | up] matrix [2 I, K]; a CTA's BN rows are
//     BN / 2 gate rows and the same BN / 2 up rows (two copies per stage), so one lane holds gate and up
//     of the same column, and the epilogue writes out = silu(gate) * up [M, I] with exactly the arithmetic
//     of fused_ops.cu's silu_and_mul on the rounded gate and up: the same bits as the GEMM then that kernel.
//   * Split-K (gridDim.z > 1, the narrow shapes): split z sums its own k-steps and writes fp32 partials
//     [splits, M, N]; gemm_splitk_reduce adds them in split order and rounds once (or, for down in a decode
//     step, fused_ops.cu's splitk_add_rms_norm does, as the first pass of the residual add and norm that
//     follow, so down's output is never stored: pagedref.kernels.gemm.linear_add_rms_norm). Serial split-K (the splits of
//     a tile taking turns on a flag, split 1 adding split 0's sums from L2, no reduce launch) gave the same bits
//     and was slower: o 23.7 us against 21.8, down 50.5 against 49.8 (docs/benchmarks.md, 2026-12-02, evening):
//     the last split finishes alone on half the SMs, where the reduce spreads over all. Summing two splits inside
//     a cluster instead (split 1's sums stored into split 0's shared memory) gave the same bits and was
//     dropped: beside the row-tile multicast it makes clusters of four CTAs, which do not all fit on the GPU
//     at once (down at 256 rows: 88.5 us against 49.8; docs/benchmarks.md, 2026-12-02).
//   * One CTA an SM. Two (288 threads: a producer warp, no setmaxnreg; half the ring each, so one CTA's epilogue
//     runs beside the other's main loop) gave the same bits and lost at every 8B shape: q/k/v at 256 rows 33.2 us
//     against 23.1, gate/up + SiLU 99.2 against 89.3 (the ring 3 stages deep, narrower tiles; docs/benchmarks.md,
//     2026-12-02, afternoon). A 384-thread CTA cannot be one of two: ptxas holds its consumers to the launch
//     bounds' 80 registers whatever setmaxnreg grants.
// Bits: every output element is a sum over K in an order fixed by (BN, the split count, wgmma's own
// order within a k-step): the same for every row, whatever M, the other rows or the launch. So a row's
// result does not depend on the batch (cuBLAS picks its kernel, hence its order, from M).
// Measured on an H200 (docs/benchmarks.md, 2026-12-02; bench gemm, the 8B layer at 256 rows): at cuBLAS's
// speed, not past it. With the fragments stored from registers, 6.04-6.24 ms against cuBLAS's 5.92-6.06 for
// the step's 128 GEMMs; the same kernel with no store at all took 5.46-5.48, so the epilogue cost 10-22% a
// GEMM (gate/up 93.3 -> 83.7 us). With the bulk tensor store: 5.81-6.01 ms against 5.80-5.88 (gate/up 87.4
// against cuBLAS's 89.7, q/k/v and down level, o behind: 22.7-25.9 against 18.8-21.7 with split-K's reduce
// launch). Still slower at 128 and 512 rows (tiles chosen for 256). With SiLU fused into gate/up (89.9 us
// against cuBLAS's 100.1 for gate/up then silu_and_mul) the engine's opt-in weight_gemm="pagedref" runs gate/up
// and down here: its 8B decode step 8.46-8.77 ms against 8.75-9.03 with cuBLAS (docs/benchmarks.md,
// 2026-12-02). What is left is the epilogue itself (a persistent grid would run the next tile's loads under it).
// Launch: grid (ceil(M / 128) rounded up to GEMM_CLUSTER, N / BN (SILU: I / (BN / 2)), splits), block 384,
// dynamic shared memory gemm_shared_bytes (pagedref.kernels.build): STAGES x (128 + BN) rows of 128 bytes,
// 1 KB of alignment slack, the mbarriers; STAGES at least gemm_min_stages (the fp32 epilogue tile fits).
// Compile-time parameters (-D): PR_DTYPE (1 or 2), GEMM_BN, GEMM_STAGES, GEMM_SILU_MUL, GEMM_CLUSTER (1 or 2).
#include "hopper.cuh"  // dtype.cuh, mbarriers, wgmma fences, descriptors

#ifndef GEMM_BN
#define GEMM_BN 128
#endif
#ifndef GEMM_STAGES
#define GEMM_STAGES 4
#endif
#ifndef GEMM_SILU_MUL
#define GEMM_SILU_MUL 0
#endif
#ifndef GEMM_CLUSTER
#define GEMM_CLUSTER 2  // CTAs of one cluster (neighbouring row tiles) sharing each B tile by TMA multicast
#endif
#if PR_DTYPE != 1 && PR_DTYPE != 2
#error "the Hopper GEMM takes 16-bit operands: PR_DTYPE 1 (float16) or 2 (bfloat16)"
#endif

constexpr int WG = 128;                   // threads per warpgroup
constexpr int BM = 128, BN = GEMM_BN, BK = 64, STAGES = GEMM_STAGES;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;  // 128 x 40 + 256 x 232 <= 384 x 168 (launch bounds)
static_assert(BN % 16 == 0 && BN >= 64 && BN <= 256, "GEMM_BN: a multiple of 16 from 64 to 256");
static_assert(STAGES >= 2 && STAGES <= 8, "GEMM_STAGES from 2 to 8");
static_assert(GEMM_CLUSTER == 1 || GEMM_CLUSTER == 2, "GEMM_CLUSTER: 1 or 2");

// Arrive and announce `bytes` more to come from bulk copies (complete_tx) before the phase completes.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// L2 policies for the copies (createpolicy): the weights are read once per step, evict them first; the
// activations are read by every column tile, keep them.
__device__ __forceinline__ unsigned long long l2_evict_first() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ unsigned long long l2_evict_last() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

// TMA: the box of `map` at (column c0, row c1) -> shared memory at dst; its bytes complete_tx on bar.
__device__ __forceinline__ void tma_load(unsigned dst, const TmaMap &map, int c0, int c1, unsigned bar,
                                         unsigned long long policy) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1, {%2, %3}], [%4], %5;\n"
               ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
               : "memory");
}

// The same box into the same shared-memory offset of every CTA of the cluster in `mask`, each CTA's copy
// completing on its own mbarrier at offset bar.
__device__ __forceinline__ void tma_load_multicast(unsigned dst, const TmaMap &map, int c0, int c1, unsigned bar,
                                                   unsigned short mask, unsigned long long policy) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5, %6;\n"
               ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask),
               "l"(policy)
               : "memory");
}

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster arrives, then waits for all (release / acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Arrive on the mbarrier at offset bar of CTA `rank` of the cluster (this CTA's own or its neighbour's).
// Release at CTA scope, as CUTLASS's ClusterBarrier: what it orders is this warp's wgmma reads of the stage,
// already complete (wgmma.wait_group). A .release.cluster arrive fenced the warp at cluster scope on every
// k-step, and the first clustered build ran 2-3x slower than without clusters (H200, bench gemm).
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar, unsigned rank) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
               "mbarrier.arrive.release.cta.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(rank)
               : "memory");
}

// wgmma m64nBNk16, D (BN / 2 fp32 per thread) += A B, both K-major by descriptor. The operand lists are
// spelled out per width: the accumulators' asm names %0 .. %(BN/2 - 1) in 8s, then the two descriptors.
#define G_ACC8(i) PR_ACC4(i), PR_ACC4(i + 4)
#define G_ACC32(i) PR_ACC16(i), PR_ACC16(i + 16)
#define G_R0 "%0, %1, %2, %3, %4, %5, %6, %7, "
#define G_R8 "%8, %9, %10, %11, %12, %13, %14, %15, "
#define G_R16 "%16, %17, %18, %19, %20, %21, %22, %23, "
#define G_R24 "%24, %25, %26, %27, %28, %29, %30, %31, "
#define G_R32 "%32, %33, %34, %35, %36, %37, %38, %39, "
#define G_R40 "%40, %41, %42, %43, %44, %45, %46, %47, "
#define G_R48 "%48, %49, %50, %51, %52, %53, %54, %55, "
#define G_R56 "%56, %57, %58, %59, %60, %61, %62, %63, "
#define G_R64 "%64, %65, %66, %67, %68, %69, %70, %71, "
#define G_R72 "%72, %73, %74, %75, %76, %77, %78, %79, "
#define G_R80 "%80, %81, %82, %83, %84, %85, %86, %87, "
#define G_R88 "%88, %89, %90, %91, %92, %93, %94, %95, "
#define G_R96 "%96, %97, %98, %99, %100, %101, %102, %103, "
#define G_R104 "%104, %105, %106, %107, %108, %109, %110, %111, "
#define G_R112 "%112, %113, %114, %115, %116, %117, %118, %119, "
#define G_R120 "%120, %121, %122, %123, %124, %125, %126, %127, "
#define G_REGS32 G_R0 G_R8 G_R16 G_R24
#define G_REGS64 G_REGS32 G_R32 G_R40 G_R48 G_R56
#define G_REGS96 G_REGS64 G_R64 G_R72 G_R80 G_R88
// hopper.cuh's PR_WGMMA: "{d...}, desc-a (operand A), desc-b (B), scale-d = (operand P != 0) = 1, both K-major".
#define G_WGMMA(NN, REGS, A, B, P) PR_WGMMA("m64n" #NN "k16", REGS, "%" #P, "%" #A ", %" #B ", p, 1, 1, 0, 0")

template <int N>
__device__ __forceinline__ void wgmma_tn(float (&d)[N / 2], unsigned long long a, unsigned long long b);
template <>
__device__ __forceinline__ void wgmma_tn<64>(float (&d)[32], unsigned long long a, unsigned long long b) {
  asm volatile(G_WGMMA(64, G_R0 G_R8 G_R16 "%24, %25, %26, %27, %28, %29, %30, %31", 32, 33, 34)
               : G_ACC32(0) : "l"(a), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_tn<96>(float (&d)[48], unsigned long long a, unsigned long long b) {
  asm volatile(G_WGMMA(96, G_REGS32 G_R32 "%40, %41, %42, %43, %44, %45, %46, %47", 48, 49, 50)
               : G_ACC32(0), G_ACC8(32), G_ACC8(40) : "l"(a), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_tn<128>(float (&d)[64], unsigned long long a, unsigned long long b) {
  asm volatile(G_WGMMA(128, G_REGS32 G_R32 G_R40 G_R48 "%56, %57, %58, %59, %60, %61, %62, %63", 64, 65, 66)
               : G_ACC32(0), G_ACC32(32) : "l"(a), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_tn<192>(float (&d)[96], unsigned long long a, unsigned long long b) {
  asm volatile(G_WGMMA(192, G_REGS64 G_R64 G_R72 G_R80 "%88, %89, %90, %91, %92, %93, %94, %95", 96, 97, 98)
               : G_ACC32(0), G_ACC32(32), G_ACC32(64) : "l"(a), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_tn<224>(float (&d)[112], unsigned long long a, unsigned long long b) {
  asm volatile(G_WGMMA(224, G_REGS96 G_R96 "%104, %105, %106, %107, %108, %109, %110, %111", 112, 113, 114)
               : G_ACC32(0), G_ACC32(32), G_ACC32(64), G_ACC8(96), G_ACC8(104) : "l"(a), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_tn<256>(float (&d)[128], unsigned long long a, unsigned long long b) {
  asm volatile(G_WGMMA(256, G_REGS96 G_R96 G_R104 G_R112 "%120, %121, %122, %123, %124, %125, %126, %127", 128, 129, 130)
               : G_ACC32(0), G_ACC32(32), G_ACC32(64), G_ACC32(96) : "l"(a), "l"(b), "r"(1));
}

// fused_ops.cu's silu_and_mul on one element: gate and up rounded to 16 bits first (as the GEMM writes
// them), then silu(g) * u in fp32, rounded once.
__device__ __forceinline__ scalar_t silu_mul(float gate, float up) {
  const float a = to_float(from_float(gate));
  return from_float(a / (1.f + expf(-a)) * to_float(from_float(up)));
}

// a / b, rounded to nearest, by the fast path of the division `a / b` compiles to (div.rn.f32): a reciprocal
// refined by one Newton step, the quotient corrected by its exact remainder (each line one FFMA of that
// path, in its order and with its +0). It is correctly rounded wherever no step over- or underflows, which
// silu_mul_fast checks. Why not `/` itself: its rarely taken slow path is a call, and the branch around it
// makes each element of the epilogue a region of its own, so the compiler cannot interleave the elements'
// chains (exp, reciprocal), 56 a thread, while the tensor cores wait. Measured (bench gemm, H200, a model's
// scales): gate/up + SiLU 89.9 us against 91.5 with `/`; the plain gate/up GEMM 88.5.
__device__ __forceinline__ float div_rn_fast(float a, float b) {
  float y, e, q, r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(b));
  asm("fma.rn.f32 %0, %1, %2, 0f3F800000;" : "=f"(e) : "f"(-b), "f"(y));  // e = 1 - b y
  asm("fma.rn.f32 %0, %1, %2, %1;" : "=f"(y) : "f"(y), "f"(e));            // y = y + y e
  asm("fma.rn.f32 %0, %1, %2, 0f00000000;" : "=f"(q) : "f"(a), "f"(y));    // q = a y + 0
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(-b), "f"(q), "f"(a));   // r = a - b q, exact
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(q) : "f"(y), "f"(r), "f"(q));    // q = q + y r
  return q;
}

// silu_mul with div_rn_fast: the same bits wherever `exact` stays true. It turns false, and the caller redoes
// its elements with silu_mul, for a gate outside [-20, 2^60] (1 + exp(-a) above 2^29), below 2^-60 in
// magnitude (but not 0) or NaN: there a step of the fast path could leave the normal range. The quotient
// takes a's sign (b > 0), which also makes -0 / b the -0 of `/`. Branch-free (& and copysign, not && and ?:),
// so the compiler interleaves the elements. Tested over every 16-bit gate (tests/test_gemm_gpu.py).
__device__ __forceinline__ scalar_t silu_mul_fast(float gate, float up, bool &exact) {
  const float a = to_float(from_float(gate));
  exact &= (a >= -20.f) & (a <= 0x1p60f) & ((fabsf(a) >= 0x1p-60f) | (a == 0.f));
  const float s = copysignf(div_rn_fast(a, 1.f + expf(-a)), a);
  return from_float(s * to_float(from_float(up)));
}

// The epilogue, through shared memory and the copy engine (CUTLASS's TMA store): each consumer thread writes
// its fragments (mma.m16n8k16's layout per warp: lane (grp, tig) holds rows grp, grp + 8 and columns 8 j + 2 tig,
// + 1) into the tile, row-major [BM][W] in the ring (free once every k-step is consumed: no copy into it is
// still in flight, the cluster neighbour's included), then one thread hands the whole tile to a bulk tensor
// store, which writes whole rows and clips rows at or past M. Measured (H200, bench gemm, M = 256): the
// fragments' own stores (16 scattered bytes per row and instruction) cost 10-22% of each GEMM; without any
// store gate/up took 83.7 us against 93.3.
// What is staged: split-K partials in fp32 (the reduce kernel rounds), else the output rounded to 16 bits
// (SILU: silu(gate) * up, W = BN / 2: fused_ops.cu's silu_and_mul on the rounded gate and up).
static_assert(BM * BN * 4 <= STAGES * STAGE_BYTES, "the fp32 epilogue tile must fit in the ring (kernels.build.gemm_min_stages)");

// One row's silu(gate) * up into the staged tile (the gate columns first in d, then the up columns): f
// computes one element's 16 bits (the fast division or `/`).
template <typename F>
__device__ __forceinline__ void stage_silu_row(const float (&d)[BN / 2], unsigned char *tile, int row, int half,
                                               int tig, F f) {
#pragma unroll
  for (int j = 0; j < BN / 16; ++j)
    *reinterpret_cast<unsigned *>(tile + (row * (BN / 2) + 8 * j + 2 * tig) * 2) =
        (unsigned)f(d[4 * j + 2 * half], d[4 * (j + BN / 16) + 2 * half]) |
        (unsigned)f(d[4 * j + 2 * half + 1], d[4 * (j + BN / 16) + 2 * half + 1]) << 16;
}

__device__ __forceinline__ void stage_tile(const float (&d)[BN / 2], unsigned char *tile, bool fp32, int r, int tig) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = r + 8 * half;
    if (fp32) {
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
        *reinterpret_cast<float2 *>(tile + ((long long)row * BN + 8 * j + 2 * tig) * 4) =
            make_float2(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
    } else if (GEMM_SILU_MUL) {
      bool exact = true;  // every element below took the fast division's exact range (silu_mul_fast)
      stage_silu_row(d, tile, row, half, tig, [&](float g, float u) { return silu_mul_fast(g, u, exact); });
      if (!exact)  // rare (a gate below -20): this thread's row again, with `/` itself
        stage_silu_row(d, tile, row, half, tig, [](float g, float u) { return silu_mul(g, u); });
    } else {
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
        *reinterpret_cast<unsigned *>(tile + (row * BN + 8 * j + 2 * tig) * 2) =
            pack2(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
    }
  }
}

// The tile at src -> the box of `map` at (column c0, row c1, split c2); src may be reused (or the CTA leave)
// once the copy engine has read it (wait_group.read).
__device__ __forceinline__ void tma_store_tile(const TmaMap &map, unsigned src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
               "cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n"
               ::"l"(reinterpret_cast<unsigned long long>(&map)), "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

// a_map: A [M, K], box 64 x 128 rows; b_map: B [N, K] (SILU: [2 I, K]), box 64 x BN / 2 rows.
// c_map: the output as [splits][M][ldc] (columns, rows, splits; box W x 128 x 1, no swizzle): C [M, ldc] in 16
// bits (splits 1; SILU: ldc = I), or the fp32 partials [splits, M, ldc] when gridDim.z > 1. up_row0: the
// first up row of the merged gate/up matrix (I; SILU only). num_k_steps = K / 64.
extern "C" __global__ void __cluster_dims__(GEMM_CLUSTER, 1, 1) __launch_bounds__(3 * WG, 1) gemm_tn(
    const __grid_constant__ TmaMap a_map, const __grid_constant__ TmaMap b_map,
    const __grid_constant__ TmaMap c_map, int M, int num_k_steps, int up_row0) {
  extern __shared__ unsigned char smem_gemm[];
  // 1024-byte aligned (the swizzle atoms): STAGES x (A [128 rows], B [BN rows]), then full[], empty[].
  const unsigned base = (smem_u32(smem_gemm) + 1023u) & ~1023u;
  const unsigned full = base + STAGES * STAGE_BYTES, empty = full + 8 * STAGES;
  const int tid = threadIdx.x, wg = tid / WG;
  const int m0 = blockIdx.x * BM, tile_n = blockIdx.y, splits = gridDim.z, z = blockIdx.z;
  // This split's k-steps: [k_first, k_last) of the num_k_steps, the same cut for every tile.
  const int k_first = z * num_k_steps / splits, k_last = (z + 1) * num_k_steps / splits;
  const int steps = k_last - k_first;

  if (tid == 0) {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(full + 8 * i, 1);                  // the producer's arrive.expect_tx; the bytes complete the phase
      mbar_init(empty + 8 * i, 8 * GEMM_CLUSTER);  // one arrival per consumer warp of every CTA of the cluster
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cluster_sync();  // the neighbour's barriers exist before any copy or arrival reaches them
  const unsigned rank = GEMM_CLUSTER > 1 ? cluster_rank() : 0;
  // Split-K's reduce is launched as this grid's programmatic dependent (pagedref.kernels.gemm): it may be
  // scheduled once every CTA got here, and waits in the kernel for this grid's end before reading a partial.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    if (tid == 0) {
      prefetch_map(a_map);
      prefetch_map(b_map);
      prefetch_map(c_map);
      const unsigned long long keep = l2_evict_last(), stream = l2_evict_first();
      int stage = 0, phase = 0;  // the ring's slot of k-step s and that slot's round, kept as counters
      for (int s = 0; s < steps; ++s) {
        const int k = (k_first + s) * BK;
        if (s >= STAGES) mbar_wait(empty + 8 * stage, phase ^ 1);  // k-step s - STAGES consumed
        const unsigned a_s = base + stage * STAGE_BYTES, b_s = a_s + A_BYTES;
        mbar_expect_tx(full + 8 * stage, STAGE_BYTES);  // A's rows and both halves of B land here
        tma_load(a_s, a_map, k, m0, full + 8 * stage, keep);
        // B in two halves of BN / 2 rows (1024-byte aligned: BN % 16 == 0): plain, the tile's rows; SILU, its
        // gate rows then the same up rows. In a cluster, CTA r copies half r into every CTA of the cluster.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = GEMM_SILU_MUL ? (h ? up_row0 : 0) + tile_n * (BN / 2) : tile_n * BN + h * (BN / 2);
          if (GEMM_CLUSTER == 1)
            tma_load(b_s + h * (BN / 2) * 128, b_map, k, row, full + 8 * stage, stream);
          else if (h == (int)rank)
            tma_load_multicast(b_s + h * (BN / 2) * 128, b_map, k, row, full + 8 * stage, (1 << GEMM_CLUSTER) - 1,
                               stream);
        }
        if (++stage == STAGES) stage = 0, phase ^= 1;
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    // cw through a shuffle from lane 0: the compiler then knows it is the same in the whole warp and keeps the
    // descriptors in uniform registers (CUTLASS's canonical_warp_group_idx). The loop below is all the
    // consumer does per k-step, so every instruction in it sits between "full" and the next wgmmas.
    const int ctid = tid - WG, cw = __shfl_sync(PR_FULL_MASK, ctid / WG, 0), warp = ctid / 32 % 4, lane = ctid % 32;
    // Stage 0's descriptors; a stage, and a 16-element k-step within it, are offsets added to them (addresses
    // stay below 256 KB: the 14-bit start field never carries).
    const unsigned long long a_desc = wgmma_desc(base + cw * 64 * 128, 16, 1024), b_desc = wgmma_desc(base + A_BYTES, 16, 1024);
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    int stage = 0, phase = 0, prev = 0;
    for (int s = 0; s < steps; ++s) {
      mbar_wait(full + 8 * stage, phase);
      const unsigned off = stage * (STAGE_BYTES >> 4);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) wgmma_tn<BN>(d, a_desc + off + 2 * kk, b_desc + off + 2 * kk);
      wgmma_commit();
      wgmma_wait_but_one();  // k-step s - 1's products are done: its stage may be refilled
      if (s > 0) {  // every CTA of the cluster may now refill the stage (its half of B lands in ours too)
        __syncwarp();  // lane r arrives on CTA r's barrier: one instruction per warp
        if (GEMM_CLUSTER == 1 && lane == 0) mbar_arrive(empty + 8 * prev);
        if (GEMM_CLUSTER > 1 && lane < GEMM_CLUSTER) mbar_arrive_cluster(empty + 8 * prev, lane);
      }
      prev = stage;
      if (++stage == STAGES) stage = 0, phase ^= 1;
    }
    wgmma_wait_all();
    fence_regs(d);
    const int grp = lane / 4, tig = lane % 4;
    asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the other warpgroup's last wgmmas have read the ring too
    stage_tile(d, smem_gemm + (base - smem_u32(smem_gemm)), splits > 1, 64 * cw + 16 * warp + grp, tig);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the copy engine reads what was written
    asm volatile("bar.sync 1, 256;\n" ::: "memory");                // by both consumer warpgroups
    if (ctid == 0 && m0 < M)  // a padded row tile past M stores nothing
      tma_store_tile(c_map, base, tile_n * (GEMM_SILU_MUL ? BN / 2 : BN), m0, z);
  }
  // No CTA leaves while its neighbour may still arrive on its barriers (the copies into it have all landed:
  // its consumers waited for them).
  __syncwarp();
  if (GEMM_CLUSTER > 1) cluster_sync();
}

// out [M, n] = round(sum over z in order of partial[z] [M, n]): the split-K sums of gemm_tn, 4 columns a
// thread. Launch: grid (ceil(M * n / 4 / 256)), block 256; n a multiple of 4; as gemm_tn's programmatic
// dependent (its launch hidden under gemm_tn's last CTAs), so first it waits for gemm_tn's partials.
extern "C" __global__ void __launch_bounds__(256) gemm_splitk_reduce(scalar_t *__restrict__ out,
                                                                    const float *__restrict__ partial,
                                                                    int splits, long long count) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // every thread: this grid ends after gemm_tn's
  const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= count) return;
  float4 acc = *reinterpret_cast<const float4 *>(partial + i);
  for (int z = 1; z < splits; ++z) {
    const float4 p = *reinterpret_cast<const float4 *>(partial + z * count + i);
    acc.x += p.x;
    acc.y += p.y;
    acc.z += p.z;
    acc.w += p.w;
  }
  uint2 r;
  r.x = pack2(acc.x, acc.y);
  r.y = pack2(acc.z, acc.w);
  *reinterpret_cast<uint2 *>(out + i) = r;
}
