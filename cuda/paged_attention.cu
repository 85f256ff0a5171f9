// paged_attention.cu: decode attention (one new query token per sequence) over a paged KV cache.
//
// Layout read (vLLM's):
//   q            [num_seqs, num_heads, HEAD_DIM]                      scalar_t
//   k/v_cache    [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]     scalar_t (one layer's pool)
//   block_tables [num_seqs, max_blocks] int32: logical block i of sequence s lives in physical
//                block block_tables[s, i]; token t of s is at slot (block_tables[s, t / BLOCK_SIZE],
//                t % BLOCK_SIZE). Entries past a sequence's last block are padding and never read.
//   context_lens [num_seqs] int32: tokens of each sequence, the new one included.
//   out          [num_seqs, num_heads, HEAD_DIM]                      scalar_t
// Query head h reads KV head h / (num_heads / num_kv_heads) (grouped-query attention).
//
// Algorithm: out = softmax(scale * q.K^T) . V over the sequence's context, accumulated in fp32.
//
// Versions, in rising sophistication (all are kept and tested; the backend uses v2 with registers):
//   v1 paged_attention_v1: one CTA per (sequence, query head) walks the whole context in chunks
//      of NUM_THREADS tokens, one thread per token computing a full dot product with scalar loads,
//      and keeps an online softmax (running max and sum, rescaling the accumulator). Easy to read,
//      but K rows are read by one thread each (uncoalesced), a group of query heads re-reads the
//      same K/V, and a long context runs on a single CTA while most of the GPU idles (H200: 0.2 TB/s).
//   v2 paged_attention_v2 + paged_attention_reduce (split-K, "flash-decoding"): the context is cut
//      into partitions of PARTITION_SIZE tokens, a FIXED number never derived from the batch.
//      One CTA per (group of HEADS_PER_CTA query heads sharing one KV head, partition, sequence):
//        - K and V of the partition are read once for all the heads of the group;
//        - TPT threads cooperate on one token, each holding NCHUNK 16-byte slices (VEC elements)
//          of its row, so a warp reads whole row segments; fewer threads per token means fewer
//          shuffles per dot product (8 rather than 16 at head_dim 128 was worth +20% on an H200);
//        - loads are software-pipelined: while a thread computes on UNROLL tokens, its next step
//          is already in flight (V's first step flies during the softmax);
//        - the partition's block numbers are staged in shared memory, so address arithmetic does
//          not wait on a dependent global load;
//        - phase 1 writes the logits to shared memory, phase 2 turns them into exp(logit - max),
//          phase 3 accumulates p.V, reduced across warps through shared memory;
//        - a sequence with one partition writes its output directly; otherwise each partition
//          writes its normalized partial output with its max logit and exp-sum, and the reduce
//          kernel merges them: w_p = sum_p * exp(max_p - max), out = sum_p w_p o_p / sum_p w_p.
//   v2 with ASYNC_COPY=1: the in-flight steps live in a per-thread cp.async ring in shared memory
//      (STAGES deep) instead of registers, so the depth no longer costs occupancy. Same arithmetic,
//      same bits. With 8 threads per token and 1024-token partitions it was the fastest variant
//      measured (docs/benchmarks.md); it is not the default yet because float32 builds overflow
//      48 KB of static shared memory with it.
//   v3 paged_attention_v3 (with -DDECODE_MMA=1; 16-bit K/V, HEAD_DIM 64/128/256): the same split-K
//      and partials, but each warp streams 16-token slabs through two tensor-core products
//      (mma.sync: S^T = K Q^T, O^T += V^T P^T) with a one-pass online softmax, so the instructions
//      per byte drop ~4x and the loads of the next slab fly while this one is computed. Its own
//      section below says how the fragments line up with plain 16-byte loads. The default decode
//      kernel (1024-token partitions) wherever it applies; v2 (512) everywhere else.
//   v3 with spans (SPAN_SLOTS > 1 compiled in; the launcher picks `span` per launch, build.span_schedule):
//      one CTA computes `span` (2 or 4) of a sequence's fixed partitions in turn, where a span holds
//      every context of the launch and a CTA per context still fills the GPU. A warp's slabs run on from one partition into the next;
//      at its last slab of a partition it saves its state (max, exp-sums, p.V) in that partition's shared
//      slot and starts afresh, with no barrier. After the loop each partition's warps are merged as
//      before, and a CTA holding its whole context merges the partitions with the reduce kernel's
//      operations in its order (no partials, no reduce for it); otherwise it writes each partition's
//      share. Same arithmetic per partition, same merge: the same bits whatever the span, so the span
//      is chosen from the batch. What it saves is the partials and the reduce launch (and each CTA's start
//      and end, paid once for 4 partitions). What it costs even at span 1: its slots' shared memory (32 KB
//      at head_dim 128) leaves L1 less room for the loads in flight (python -m pagedref.bench gather), and
//      its loop tests for partition ends; so a launch of one partition a CTA runs the build without span
//      slots (SPAN_SLOTS=1, build.span_build), the same operations in the same order. (This is the tree of
//      SPAN_FOLD=0, build.MmaTuning(fold=False): a candidate since 2026-12-04.)
//   v3 with SPAN_FOLD=1, the folded tree (the default since 2026-12-04; build.MmaTuning.fold): another fixed
//      order of the same sums. A sequence's partitions are grouped in superpartitions of FOLD_SPAN (4); in
//      each, warp w's state of each partition is folded into its state of the partitions before, in order
//      (M = max(m, m'), l = l' f' + l f with f = exp2(m - M): fold_partition), then the superpartition's
//      four folded warp states are merged as a partition's were, and superpartitions are merged as the
//      reduce kernel merges partitions. Why: a CTA that computes a whole superpartition folds in its slab
//      loop into ONE slot per warp (8 KB at head_dim 128, not the unfolded span's 4 slots of 32 KB, past
//      the 32-KB step where L1 loses room for the loads in flight) with no barrier, and writes no partials
//      for contexts up to 4 partitions: +1-2% at (64, 4096), (8, 32768) and (1, 131072), at FlashInfer's speed
//      there (docs/benchmarks.md, 2026-12-04 evening and night). A launch whose grid of one partition a CTA fits
//      about one wave (a few long sequences; build.span_schedule, FOLD_WAVES) runs that instead; each CTA
//      writes its 4 warps' states as they are and paged_attention_fold_reduce folds them with the same
//      operations in the same order: the same bits, for 4x the partials and a longer merge (1.5-4% slower
//      than the unfolded tree at (2-12, 8192-32768)). The bits are a function of the sequence alone either way.
//   v3 with SPAN_FOLD=1 and RAW_SPAN=1 (the default's third build since 2026-12-05; build.MmaTuning.raw_span): a
//      CTA computes 2 partitions of a superpartition in turn, keeps each one's warp states in a slot of their own
//      (no fold in the loop) and writes them as two CTAs of one partition would (write_raw_states), so the fold
//      reduce folds the same states: the bits of one partition a CTA, from half the CTAs. Where one partition a
//      CTA would run more than one wave and at most 1.5 (build.RAW_WAVES: its second wave at most half full,
//      its CTAs a tail on an otherwise idle GPU), the grid of 2 partitions a CTA is one wave: +17% at 1.09 waves
//      ((9, 8192), (18, 4096)), +13% at 1.21, +5% at 1.33, +1-3% at 1.45; -3 to -10% from 1.58 waves up and
//      -6% within one wave, where it is not taken (H200, 2026-12-05, docs/benchmarks.md).
//   v3 with MERGE_IN_KERNEL=1 (candidates, not the default): the last partition CTA of each
//      (sequence, head group) to finish merges the partitions itself (a ticket counter per group,
//      flash-decoding's "last block reduces"), so no reduce launch follows; the same operations in
//      the same order per output element as paged_attention_reduce, hence the same bits. Measured
//      slower than the reduce launch in its first form (see merge_partitions).
//   v3 with PDL=1 (the default on sm_90; build.MmaTuning.pdl): the reduce kernel is launched as v3's programmatic
//      dependent (cuLaunchKernelEx, pagedref.kernels.driver). Every v3 CTA lets it be scheduled once its slab loop
//      is done (griddepcontrol.launch_dependents), so it launches when the grid's last CTAs are in their
//      epilogues, and the reduce waits for v3's end in the kernel (griddepcontrol.wait) before it reads a
//      partial: only its launch is hidden, so the same bits. Triggered at v3's start instead (2026-12-02) it
//      moved (64, 4096) +0.5-0.7% and (8, 32768) -0.9-1.2%: the reduce's CTAs took the SM slots of v3 CTAs
//      still waiting to start. After the loop (2026-12-04, A-B in two calls, docs/benchmarks.md): +0.2-0.4% at
//      (1, 131072), 0-0.5% at (16, 8192), 0-0.3% at (8, 32768), level where no reduce follows.
//      Also measured on 2026-12-02 and dropped: the partitions of a context merged inside a thread-block
//      cluster through distributed shared memory (no partials in global memory, no reduce launch). It lost
//      2% at (64, 4096) and 4% at (8, 32768) (clusters of 8 CTAs are placed as a unit, and that cost more
//      than the reduce it saved), and racecheck flagged its writes into a CTA that might have exited.
//   Bit-level consequences: every reduction runs in an order fixed by (HEAD_DIM, PARTITION_SIZE,
//   THREADS_PER_TOKEN, NUM_THREADS; v3: and its tree, SPAN_FOLD) and by token index only, so a sequence's result is the same
//   bits whatever physical blocks hold its K/V, whatever else is in the batch, and however the
//   loads are scheduled. It is NOT the same bits as a single-pass softmax (or as another GPU's
//   expf): the sums are associated differently.
//
// Launch shapes:
//   v1:     grid (num_seqs, num_heads),                              block NUM_THREADS
//   v2, v3: grid (num_heads / HEADS_PER_CTA, max_parts / span, num_seqs), block NUM_THREADS (the CTAs
//           of one sequence and partition are neighbours in launch order; v2's span is 1)
//   reduce: grid (num_seqs, ceil(num_heads * ceil(HEAD_DIM / 32) / NUM_WARPS)), block NUM_THREADS (a warp per
//           32 dims of a head)
//   fold reduce (SPAN_FOLD=1, spans of 1 or 2): grid (num_seqs, num_heads * ceil(HEAD_DIM / 32)), a CTA per 32
//           dims of a head, its warps folding different superpartitions
//
// Compile-time parameters (-D): PR_DTYPE (0 fp32, 1 fp16, 2 bf16), HEAD_DIM (a multiple of VEC,
// <= 256), BLOCK_SIZE, HEADS_PER_CTA (<= 8, divides the GQA group), PARTITION_SIZE (a multiple of
// BLOCK_SIZE), UNROLL (tokens per pipeline step per thread), THREADS_PER_TOKEN (power of two <= 32),
// MIN_CTAS_PER_SM (v2's and v3's register budget: __launch_bounds__'s second argument), SPAN_SLOTS (v3:
// partitions a CTA may compute in turn, 1-4; build.span_slots), SPAN_FOLD (0/1: v3's folded tree), RAW_SPAN (0/1:
// its spans of 2 write raw warp states), ASYNC_COPY
// (0/1), STAGES (depth of the cp.async ring), DECODE_MMA (0/1: compile v3), KV_LOAD_HINT (0/1: v3's
// K/V loads skip L1 and prefetch whole 256-byte rows into L2), KV_EVICT_FIRST (0/1: v3's K/V loads
// skip L1 and leave L2 first), KV_PREFETCH (0/1: v3 asks L2 for the
// slab after next), MERGE_IN_KERNEL (0/1: v3's last partition CTA merges; v3 takes merge counters), PDL
// (0/1: v3 triggers its dependent launch after its slab loop and the reduce waits for v3 in the kernel; sm_90).
#include "common.cuh"

#ifndef HEADS_PER_CTA
#define HEADS_PER_CTA 1
#endif
#ifndef PARTITION_SIZE
#define PARTITION_SIZE 512
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef MIN_CTAS_PER_SM
#define MIN_CTAS_PER_SM 1
#endif
#ifndef ASYNC_COPY
#define ASYNC_COPY 0
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef SPAN_FOLD
#define SPAN_FOLD 0  // v3's folded tree (superpartitions of FOLD_SPAN partitions; build.MmaTuning.fold): see write_folded
#endif
constexpr int FOLD_SPAN = 4;  // partitions of a superpartition (build.MAX_SPAN)
#ifndef RAW_SPAN
#define RAW_SPAN 0  // SPAN_FOLD: a CTA of RAW_SLOTS partitions writes each one's warp states (write_raw_states)
#endif

constexpr int G = HEADS_PER_CTA;

constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }
constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

// TPT threads share one token, each holding NCHUNK 16-byte slices of the head dimension. Fewer
// threads per token means fewer shuffles to finish each dot product but more query registers;
// the Python side picks it (pagedref.kernels.splitk.threads_per_token).
#ifndef THREADS_PER_TOKEN
#define THREADS_PER_TOKEN cmin(pow2_ceil(HEAD_DIM / VEC), PR_WARP)
#endif
constexpr int TPT = THREADS_PER_TOKEN;

static_assert(HEAD_DIM % VEC == 0, "HEAD_DIM must be a multiple of 16 bytes of elements");
static_assert(HEAD_DIM <= 256, "HEAD_DIM above 256 is not supported");
static_assert(PARTITION_SIZE % BLOCK_SIZE == 0, "a partition must hold whole blocks");
static_assert(G >= 1 && G <= 8, "HEADS_PER_CTA must be 1..8");
static_assert(!ASYNC_COPY || STAGES >= 2, "the cp.async ring needs at least 2 stages");
static_assert(TPT >= 1 && TPT <= PR_WARP && (TPT & (TPT - 1)) == 0, "THREADS_PER_TOKEN: a power of two <= 32");

// Element offset of (token, kv head, dim 0) in the pool, given the token's physical block.
__device__ __forceinline__ long long slot_offset(int block, int token, int kv_head, int num_kv_heads) {
  const long long slot = (long long)block * BLOCK_SIZE + token % BLOCK_SIZE;
  return (slot * num_kv_heads + kv_head) * HEAD_DIM;
}

// ---------------------------------------------------------------------------------------------
// v1: one CTA per (sequence, query head), one thread per token, online softmax.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float block_reduce_v1(float x, float *red, bool is_max) {
  const int warp = threadIdx.x / PR_WARP, lane = threadIdx.x % PR_WARP;
  x = is_max ? group_max<PR_WARP>(x) : group_sum<PR_WARP>(x);
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < NUM_WARPS; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
  __syncthreads();  // red is reused by the next call
  return r;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_v1(
    scalar_t *__restrict__ out, const scalar_t *__restrict__ q,
    const scalar_t *__restrict__ k_cache, const scalar_t *__restrict__ v_cache,
    const int *__restrict__ block_tables, const int *__restrict__ context_lens,
    int max_blocks, int num_heads, int num_kv_heads, float scale) {
  constexpr int DPT = (HEAD_DIM + NUM_THREADS - 1) / NUM_THREADS;  // output dims per thread
  __shared__ float q_s[HEAD_DIM];
  __shared__ float p_s[NUM_THREADS];
  __shared__ float red[NUM_WARPS];
  const int s = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int kv_head = h / (num_heads / num_kv_heads);
  const int ctx = context_lens[s];
  const int *bt = block_tables + (long long)s * max_blocks;
  for (int d = tid; d < HEAD_DIM; d += NUM_THREADS)
    q_s[d] = to_float(q[((long long)s * num_heads + h) * HEAD_DIM + d]);
  __syncthreads();

  float acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc[i] = 0.f;
  float m = neg_inf(), l = 0.f;
  for (int t0 = 0; t0 < ctx; t0 += NUM_THREADS) {
    const int t = t0 + tid;
    float score = neg_inf();
    if (t < ctx) {
      const scalar_t *k = k_cache + slot_offset(bt[t / BLOCK_SIZE], t, kv_head, num_kv_heads);
      float dot = 0.f;
      for (int d = 0; d < HEAD_DIM; ++d) dot = fmaf(q_s[d], to_float(k[d]), dot);
      score = dot * scale;
    }
    const float m_new = fmaxf(m, block_reduce_v1(score, red, true));
    const float p = t < ctx ? expf(score - m_new) : 0.f;
    const float corr = expf(m - m_new);  // 0 on the first chunk (m = -inf)
    l = l * corr + block_reduce_v1(p, red, false);
    m = m_new;
    p_s[tid] = p;
    __syncthreads();
    const int n = min(NUM_THREADS, ctx - t0);
#pragma unroll
    for (int i = 0; i < DPT; ++i) {
      const int d = tid + i * NUM_THREADS;
      if (d >= HEAD_DIM) continue;
      float a = acc[i] * corr;
      for (int j = 0; j < n; ++j) {
        const int tj = t0 + j;
        const scalar_t *v = v_cache + slot_offset(bt[tj / BLOCK_SIZE], tj, kv_head, num_kv_heads);
        a = fmaf(p_s[j], to_float(v[d]), a);
      }
      acc[i] = a;
    }
    __syncthreads();  // p_s is rewritten by the next chunk
  }
#pragma unroll
  for (int i = 0; i < DPT; ++i) {
    const int d = tid + i * NUM_THREADS;
    if (d < HEAD_DIM) out[((long long)s * num_heads + h) * HEAD_DIM + d] = from_float(acc[i] / l);
  }
}

#ifndef DECODE_MMA
#define DECODE_MMA 0
#endif

// ---------------------------------------------------------------------------------------------
// v2: split-K over fixed partitions, a group of query heads per CTA, 16-byte loads.
// ---------------------------------------------------------------------------------------------
// Not in a v3 module (-DDECODE_MMA=1, its own config, which never launches v2): there v2's logits,
// [G][PARTITION_SIZE] floats of static shared memory, would have to fit 48 KB at v3's partition
// sizes too (8 heads x 2048 tokens do not).
#if !DECODE_MMA
constexpr int NCHUNK = (HEAD_DIM + TPT * VEC - 1) / (TPT * VEC);
constexpr int TOK_PER_ITER = NUM_THREADS / TPT;
constexpr int STEP = TOK_PER_ITER * UNROLL;
// v2's shared scratch: the logits [G][PARTITION_SIZE], later the per-warp partial sums.
constexpr int SMEM_FLOATS = cmax(G * PARTITION_SIZE, NUM_WARPS * G * HEAD_DIM);

// Where the UNROLL tokens of pipeline step `step` are for this thread: token t of the partition
// (t < n), 16-byte slice c of its row. Threads past the partition's end get nullptr.
__device__ __forceinline__ const scalar_t *token_slice(const scalar_t *__restrict__ cache, const int *blocks_s,
                                                       int start, int t, int n, int c, int kv_head, int num_kv_heads) {
  const int d0 = (c * TPT + threadIdx.x % TPT) * VEC;
  if (t >= n || d0 >= HEAD_DIM) return nullptr;
  return cache + slot_offset(blocks_s[t / BLOCK_SIZE], start + t, kv_head, num_kv_heads) + d0;
}

#if ASYNC_COPY
__device__ __forceinline__ void cp_async16(uint4 *dst, const scalar_t *src, const scalar_t *any_valid) {
  // src == nullptr: copy 0 bytes and zero-fill the 16 (nothing is read past the partition).
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src ? src : any_valid),
               "r"(src ? 16 : 0));
}
#endif

// One thread's stream of K (or V) slices through the partition, one step of UNROLL tokens at a
// time, with the next LOOKAHEAD steps already in flight. Two ways to keep bytes in flight:
//   ASYNC_COPY 0: the next step is loaded into registers while this one is computed (register cost
//                 grows with the depth, so occupancy falls);
//   ASYNC_COPY 1: cp.async copies STAGES-1 steps ahead into a per-thread ring in shared memory;
//                 each thread reads back only what it copied itself, so no barrier is needed.
struct TokenStream {
  const scalar_t *cache;
  const int *blocks_s;
  int start, n, kv_head, num_kv_heads;
#if ASYNC_COPY
  static constexpr int LOOKAHEAD = STAGES - 1;
  uint4 *ring;  // [STAGES][UNROLL][NCHUNK][NUM_THREADS]
#else
  static constexpr int LOOKAHEAD = 1;
  uint4 next[UNROLL][NCHUNK];
#endif

  __device__ __forceinline__ void fetch(int step) {  // start loading step `step` (none past the end)
    const int base = step * STEP + threadIdx.x / TPT;
#if ASYNC_COPY
    if (step * STEP < n)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int c = 0; c < NCHUNK; ++c)
          cp_async16(&ring[(((step % STAGES) * UNROLL + u) * NCHUNK + c) * NUM_THREADS + threadIdx.x],
                     token_slice(cache, blocks_s, start, base + u * TOK_PER_ITER, n, c, kv_head, num_kv_heads),
                     cache);
    asm volatile("cp.async.commit_group;\n" ::);  // one group per step, empty or not: uniform counting
#else
    if (step * STEP < n)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int c = 0; c < NCHUNK; ++c) {
          const scalar_t *p = token_slice(cache, blocks_s, start, base + u * TOK_PER_ITER, n, c, kv_head, num_kv_heads);
          next[u][c] = p ? load16(p) : make_uint4(0u, 0u, 0u, 0u);
        }
#endif
  }

  __device__ __forceinline__ void begin() {
#pragma unroll
    for (int j = 0; j < LOOKAHEAD; ++j) fetch(j);
  }

  // Hand over step `step` (zeros past the partition) and start fetching step + LOOKAHEAD.
  __device__ __forceinline__ void take(uint4 (&cur)[UNROLL][NCHUNK], int step) {
#if ASYNC_COPY
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));  // all but the newest STAGES-2 landed
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int c = 0; c < NCHUNK; ++c)
        cur[u][c] = ring[(((step % STAGES) * UNROLL + u) * NCHUNK + c) * NUM_THREADS + threadIdx.x];
#else
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int c = 0; c < NCHUNK; ++c) cur[u][c] = next[u][c];
#endif
    fetch(step + LOOKAHEAD);
  }
};

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS_PER_SM) paged_attention_v2(
    scalar_t *__restrict__ out,          // [num_seqs, num_heads, HEAD_DIM]
    float *__restrict__ tmp_out,         // [num_seqs, num_heads, max_parts, HEAD_DIM]
    float *__restrict__ max_logits,      // [num_seqs, num_heads, max_parts]
    float *__restrict__ exp_sums,        // [num_seqs, num_heads, max_parts]
    const scalar_t *__restrict__ q,      // [num_seqs, num_heads, HEAD_DIM]
    const scalar_t *__restrict__ k_cache, const scalar_t *__restrict__ v_cache,
    const int *__restrict__ block_tables, const int *__restrict__ context_lens,
    int max_blocks, int num_heads, int num_kv_heads, int max_parts, float scale) {
  __shared__ float4 smem4[(SMEM_FLOATS + 3) / 4];  // float4: 16-byte aligned
  float *smem = reinterpret_cast<float *>(smem4);  // logits [G][PARTITION_SIZE], later partial sums
  __shared__ int blocks_s[PARTITION_SIZE / BLOCK_SIZE];
  __shared__ float red[NUM_WARPS][G];
  __shared__ float max_s[G];

  const int head0 = blockIdx.x * G, part = blockIdx.y, s = blockIdx.z;
  const int ctx = context_lens[s];
  const int start = part * PARTITION_SIZE;
  if (start >= ctx) return;  // the whole CTA leaves together: no barrier is left half-reached
  const int n = min(PARTITION_SIZE, ctx - start);
  const int num_parts = (ctx + PARTITION_SIZE - 1) / PARTITION_SIZE;
  const int kv_head = head0 / (num_heads / num_kv_heads);
  const int tid = threadIdx.x, warp = tid / PR_WARP, lane = tid % PR_WARP;
  const int tok_lane = tid / TPT, d_lane = tid % TPT;
  float(*logits)[PARTITION_SIZE] = reinterpret_cast<float(*)[PARTITION_SIZE]>(smem);

  // Stage the partition's physical block numbers (only the blocks that hold its tokens).
  const int *bt = block_tables + (long long)s * max_blocks + start / BLOCK_SIZE;
  for (int i = tid; i < (n + BLOCK_SIZE - 1) / BLOCK_SIZE; i += NUM_THREADS) blocks_s[i] = bt[i];

  // This thread's slices of the G query vectors, in fp32.
  float qf[G][NCHUNK][VEC];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int c = 0; c < NCHUNK; ++c) {
      const int d0 = (c * TPT + d_lane) * VEC;
      const uint4 u = d0 < HEAD_DIM ? load16(q + ((long long)s * num_heads + head0 + g) * HEAD_DIM + d0)
                                    : make_uint4(0u, 0u, 0u, 0u);
      unpack(u, qf[g][c]);
    }
  __syncthreads();  // v3_blocks_s ready

  // Phase 1: logits = scale * q.k for every token of the partition and head of the group.
  float qk_max[G];
#pragma unroll
  for (int g = 0; g < G; ++g) qk_max[g] = neg_inf();
#if ASYNC_COPY
  __shared__ uint4 ring[STAGES * UNROLL * NCHUNK * NUM_THREADS];
  TokenStream ks{k_cache, blocks_s, start, n, kv_head, num_kv_heads, ring};
#else
  TokenStream ks{k_cache, blocks_s, start, n, kv_head, num_kv_heads};
#endif
  ks.begin();
  for (int base = 0, step = 0; base < n; base += STEP, ++step) {  // the same trip count for every lane
    uint4 kbuf[UNROLL][NCHUNK];
    ks.take(kbuf, step);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * TOK_PER_ITER + tok_lane;
      float kf[NCHUNK][VEC];
#pragma unroll
      for (int c = 0; c < NCHUNK; ++c) unpack(kbuf[u][c], kf[c]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < NCHUNK; ++c)
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot = fmaf(qf[g][c][e], kf[c][e], dot);
        dot = group_sum<TPT>(dot) * scale;  // all TPT lanes of the token hold the same bits
        if (t < n) {
          if (d_lane == 0) logits[g][t] = dot;
          qk_max[g] = fmaxf(qk_max[g], dot);
        }
      }
    }
  }

  // V's first steps are fetched now, so they are in flight during the softmax below.
#if ASYNC_COPY
  TokenStream vs{v_cache, blocks_s, start, n, kv_head, num_kv_heads, ring};
#else
  TokenStream vs{v_cache, blocks_s, start, n, kv_head, num_kv_heads};
#endif
  vs.begin();

  // Phase 2: max over the partition, then p = exp(logit - max) in place, and its sum.
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float m = group_max<PR_WARP>(qk_max[g]);
    if (lane == 0) red[warp][g] = m;
  }
  __syncthreads();  // logits and red visible to all
  float gmax[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    gmax[g] = red[0][g];
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) gmax[g] = fmaxf(gmax[g], red[w][g]);
  }
  if (tid == 0)
#pragma unroll
    for (int g = 0; g < G; ++g) max_s[g] = gmax[g];
  __syncthreads();  // everyone has read red before it is reused for the sums
  float lsum[G];
#pragma unroll
  for (int g = 0; g < G; ++g) lsum[g] = 0.f;
  for (int t = tid; t < n; t += NUM_THREADS)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float e = expf(logits[g][t] - gmax[g]);
      logits[g][t] = e;
      lsum[g] += e;
    }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float x = group_sum<PR_WARP>(lsum[g]);
    if (lane == 0) red[warp][g] = x;  // red[.][g] now holds the per-warp sums until the end
  }
  __syncthreads();  // p and the per-warp sums visible to all

  // Phase 3: acc = sum_t p_t v_t for this thread's tokens and head-dim slices.
  float acc[G][NCHUNK][VEC];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int c = 0; c < NCHUNK; ++c)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][c][e] = 0.f;
  for (int base = 0, step = 0; base < n; base += STEP, ++step) {
    uint4 vbuf[UNROLL][NCHUNK];
    vs.take(vbuf, step);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * TOK_PER_ITER + tok_lane;
      if (t >= n) continue;  // never touch a slot past the context: it may hold NaN
      float vf[NCHUNK][VEC];
#pragma unroll
      for (int c = 0; c < NCHUNK; ++c) unpack(vbuf[u][c], vf[c]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = logits[g][t];
#pragma unroll
        for (int c = 0; c < NCHUNK; ++c)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][c][e] = fmaf(p, vf[c][e], acc[g][c][e]);
      }
    }
  }
  // Reduce over the token lanes of the warp (lanes with the same d_lane), then across warps.
#pragma unroll
  for (int o = TPT; o < PR_WARP; o *= 2)
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int c = 0; c < NCHUNK; ++c)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][c][e] += __shfl_xor_sync(PR_FULL_MASK, acc[g][c][e], o);
  __syncthreads();  // all reads of logits done: smem becomes the per-warp partial sums
  if (lane < TPT)
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int c = 0; c < NCHUNK; ++c) {
        const int d0 = (c * TPT + d_lane) * VEC;
        if (d0 < HEAD_DIM)
#pragma unroll
          for (int e = 0; e < VEC; ++e) smem[(warp * G + g) * HEAD_DIM + d0 + e] = acc[g][c][e];
      }
  __syncthreads();

  // Write: the output itself when the context has one partition, else this partition's share.
  for (int i = tid; i < G * HEAD_DIM; i += NUM_THREADS) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float o = smem[i], l = red[0][g];
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) {
      o += smem[w * G * HEAD_DIM + i];
      l += red[w][g];
    }
    const long long row = (long long)s * num_heads + head0 + g;
    if (num_parts == 1) out[row * HEAD_DIM + d] = from_float(o / l);
    else tmp_out[(row * max_parts + part) * HEAD_DIM + d] = o / l;
    if (num_parts > 1 && d == 0) {
      max_logits[row * max_parts + part] = max_s[g];
      exp_sums[row * max_parts + part] = l;
    }
  }
}
#endif  // !DECODE_MMA

// ---------------------------------------------------------------------------------------------
// v3: split-K on the tensor cores, one pass. Compiled only with -DDECODE_MMA=1 (its own config).
// ---------------------------------------------------------------------------------------------
// Why: v2 spends ~45 instructions on every 16-byte K/V load (unpack, 4 heads x 8 FMAs, shuffle
// trees), so an SM cannot issue enough loads to keep HBM busy. Here a warp's 16-token slab is two
// mma.sync m16n8k16 products, S^T = K Q^T and O^T += V^T P^T (fp32 accumulators): ~270 SASS
// instructions per 8 KB of K/V (head_dim 128, 4 heads) instead of ~1000, addressing included.
// What is left is keeping bytes in flight: 16 warps per SM (128 registers, no spill), each with
// its next slab's 8 KB on the way.
// The layout tricks that make it cheap (fragment layouts: the PTX ISA's mma.m16n8k16; lane =
// 4 * grp + tig):
//   - a dot product does not care in which order its terms come, so the head dimension is
//     permuted inside each mma: lane (grp, tig) loads 16 contiguous bytes of K row `grp` (and
//     `grp + 8`) at dims 32c + 8tig, and those 8 elements ARE its A-fragment words for two mmas;
//     the query's B fragment is loaded with the same permutation. No shuffle, no shared memory.
//   - S^T comes out with tokens on rows and heads on columns (a lane holds heads 2tig, 2tig+1),
//     the layout the per-head max needs (3 shuffles); P^T as the B operand of the p.V mma wants
//     heads on the lane's group instead: an 8x8 transpose in registers (two shuffles) per 8 tokens.
//   - V^T as the A operand needs pairs of tokens in one 32-bit word: lane (grp, tig) loads tokens
//     2tig, 2tig+1, 2tig+8, 2tig+9 at dims 64c + 8grp and pairs them with one prmt per word; the
//     output dims are permuted the same way and unscrambled when written.
//   - up to 8 query heads of one GQA group ride in the N = 8 columns (unused columns get a zero
//     query), so K and V are read once per group.
// Each warp owns the slabs warp, warp + 4, ... of the partition and keeps its own online softmax
// (running max, per-lane exp-sums, accumulators rescaled when the max grows) in log2 units
// (exp2 with scale * log2(e) folded in). While a slab is computed, the warp's next slab of K is
// already in flight, and its V right after; tokens past the context are clamped to the last one
// (a real token: no NaN from unused slots reaches an mma) and masked to -inf, so every load is
// unconditional. At the end the 4 warps merge through shared memory in warp order and the
// partition writes the same partials as v2, so paged_attention_reduce merges partitions (or, with
// MERGE_IN_KERNEL=1, the group's last partition CTA to finish: see merge_partitions).
// Bits: every sum runs in an order fixed by token index and lane, whatever the batch or blocks.
// Head dims that are not a multiple of 64 (vLLM's 80, 96, 112, 120, 192 is one): the head
// dimension is cut into pieces, each loaded by one load per lane and token row. K: pieces of 32
// dims (16-byte loads, two mmas), then at most one of 16 (8-byte loads at 4tig, one mma) and one
// of 8 (4-byte loads at 2tig, one mma whose k 8..15 are zero). V: bands of 64 dims (16-byte
// loads, four mmas), then at most one band of 32 (8-byte loads at 4grp, two mmas), of 16 (4-byte
// loads at 2grp, one mma) and of 8 (2-byte loads at grp, one mma whose rows grp + 8 are zero).
// A band of W elements per lane puts output dims OFF + W grp + 2j (+1) on rows grp (grp + 8) of
// its mma j. A multiple of 64 has no partial piece: its code, and so its bits, are as before.
// Scope: 16-bit K/V, HEAD_DIM a multiple of 8 from 64 to 256, up to 8 heads per CTA; the launcher
// runs v2 elsewhere (pagedref.kernels.splitk.mma_supported). The query is re-read from shared
// memory each slab rather than held in 16 registers: that is what fits 4 CTAs per SM at head_dim 128.
#ifndef KV_LOAD_HINT
#define KV_LOAD_HINT 0
#endif
#ifndef KV_EVICT_FIRST
#define KV_EVICT_FIRST 0
#endif
#ifndef KV_PREFETCH
#define KV_PREFETCH 0
#endif
#ifndef MERGE_IN_KERNEL
#define MERGE_IN_KERNEL 0
#endif
#ifndef PDL
#define PDL 0  // v3 lets the reduce launch before v3 ends (programmatic dependent launch; the reduce waits for v3's end)
#endif
#if DECODE_MMA
static_assert(PR_DTYPE == 1 || PR_DTYPE == 2, "v3 (DECODE_MMA) needs 16-bit K/V: float16 or bfloat16");
static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM >= 64, "v3 (DECODE_MMA) needs HEAD_DIM a multiple of 8, at least 64");
static_assert(G <= 8, "v3 serves at most 8 query heads per CTA: the N of one mma");

constexpr int SLAB = 16;            // tokens per warp step: the M of QK^T, the K of p.V
constexpr int SLABS_PER_PART = PARTITION_SIZE / SLAB;
static_assert(PARTITION_SIZE % (SLAB * NUM_WARPS) == 0, "v3: a warp's slabs must not straddle partitions");
#ifndef SPAN_SLOTS
#define SPAN_SLOTS 1  // partitions one CTA may compute in turn (their warps' states share the CTA's shared memory)
#endif
constexpr int RAW_SLOTS = 2;  // RAW_SPAN: partitions of such a CTA (build.RAW_SPAN), a state slot each
constexpr int STATE_SLOTS = SPAN_FOLD ? (RAW_SPAN ? RAW_SLOTS : 1) : SPAN_SLOTS;  // warps' state slots in shared memory
static_assert(!SPAN_FOLD || SPAN_SLOTS == 1 || SPAN_SLOTS == FOLD_SPAN, "a folded span is one whole superpartition");
static_assert(!(SPAN_FOLD && MERGE_IN_KERNEL), "the in-kernel merge merges partitions, not folded superpartitions");
static_assert(!RAW_SPAN || (SPAN_FOLD && SPAN_SLOTS == FOLD_SPAN), "raw spans are the folded tree's span build's");
constexpr int KCH = HEAD_DIM / 32;  // K: 32-dim pieces, 16-byte slices per lane per token row (two rows per lane)
constexpr bool K16 = HEAD_DIM % 32 >= 16;  // K: a 16-dim piece after them (8-byte slices)
constexpr bool K8 = HEAD_DIM % 16 == 8;    // K: an 8-dim piece last (4-byte slices)
constexpr int K16_OFF = 32 * KCH, K8_OFF = K16_OFF + 16 * K16;
constexpr int VCH = HEAD_DIM / 64;  // V: 64-dim bands (four token rows per lane)
constexpr bool V32 = HEAD_DIM % 64 >= 32;  // V: a 32-dim band after them (8-byte slices)
constexpr bool V16 = HEAD_DIM % 32 >= 16;  // V: a 16-dim band (4-byte slices)
constexpr bool V8 = HEAD_DIM % 16 == 8;    // V: an 8-dim band last (2-byte slices)
constexpr int V32_OFF = 64 * VCH, V16_OFF = V32_OFF + 32 * V32, V8_OFF = V16_OFF + 16 * V16;

// One lane's K (two token rows) and V (four token rows) of a slab, piece by piece; the partial
// pieces' registers are dead code where HEAD_DIM has no such piece.
struct KSlab {
  uint4 c[KCH][2];
  uint2 t16[2];
  unsigned t8[2];
};
struct VSlab {
  uint4 c[VCH][4];
  uint2 t32[4];
  unsigned t16[4];
  unsigned t8[4];  // one 16-bit value in the low half
};
constexpr float LN2 = 0.6931471805599453f;  // LOG2E, mma_16816, pack2, exp2_approx, smem_u32: common.cuh


// The warp's 8x8 matrix X of 16-bit values, lane (grp, tig) holding X[grp][2tig] (low half) and
// X[grp][2tig + 1] -> its transpose in the same layout: X[2tig][grp] and X[2tig + 1][grp], which
// sit in lanes 8tig + grp/2 and 8tig + 4 + grp/2, in the half grp % 2. (What movmatrix does;
// two shuffles and a byte permute say it in plain CUDA.)
__device__ __forceinline__ unsigned transpose_8x8(unsigned x, int grp, int tig) {
  const unsigned a = __shfl_sync(PR_FULL_MASK, x, 8 * tig + grp / 2);
  const unsigned b = __shfl_sync(PR_FULL_MASK, x, 8 * tig + 4 + grp / 2);
  return __byte_perm(a, b, grp % 2 ? 0x7632 : 0x5410);
}


__device__ __forceinline__ unsigned word(const uint4 &u, int i) {  // i is a constant after unrolling
  return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// A 16-byte shared-memory read the compiler may not hoist out of the slab loop: re-reading the
// query each slab (4 loads at head_dim 128) is cheaper than holding it in 16 registers.
__device__ __forceinline__ uint4 lds16(const uint4 *p) {
  uint4 u;
  asm volatile("ld.volatile.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
               : "r"(smem_u32(p)));
  return u;
}

// A K/V load that is read exactly once: KV_LOAD_HINT=1 skips L1 and asks L2 for the whole
// 256-byte row (the row's other slices come from the same lane's next loads); KV_EVICT_FIRST=1
// skips L1 and marks the line first to go from L2, so the stream of K/V does not push out what
// is read again (the block numbers, and the partials the merge reads back).
__device__ __forceinline__ uint4 load_kv16(const scalar_t *p) {
#if KV_LOAD_HINT
  uint4 u;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p));
  return u;
#elif KV_EVICT_FIRST
  uint4 u;
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));  // per load: held, it spills
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;\n"
      : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p), "l"(policy));
  return u;
#else
  return load16(p);
#endif
}

// Where the partition's token rows are, for one kv head. Token t0 + r of a slab (t0 a multiple of
// SLAB) is clamped to the last real token n - 1; with BLOCK_SIZE >= SLAB a slab lies in one block,
// so all of a lane's rows share one block number (one shared-memory read, one 64-bit product).
__shared__ int v3_blocks_s[SPAN_SLOTS * (PARTITION_SIZE / BLOCK_SIZE)];  // the CTA's partitions' block numbers
struct PartitionRows {
  int n;                // tokens in the partition
  int row_stride;       // elements from one token's row to the next: num_kv_heads * HEAD_DIM
  int kv_off;           // kv_head * HEAD_DIM
  __device__ __forceinline__ const scalar_t *row(const scalar_t *cache, int t0, int r) const {
    const unsigned t = min(t0 + r, n - 1);  // >= 0: unsigned division is a shift
    const unsigned b = BLOCK_SIZE >= SLAB ? (unsigned)t0 / BLOCK_SIZE : t / BLOCK_SIZE;
    return cache + (long long)v3_blocks_s[b] * (BLOCK_SIZE * row_stride) + (int)(t % BLOCK_SIZE) * row_stride + kv_off;
  }
};

// KV_PREFETCH=1: ask L2 for a slab's K and V rows one step before their loads are issued (lane l
// takes token row l % 16 of K, or of V for l >= 16), so each warp has a third slab on the way
// without holding it in registers. It costs ~6 registers (3 CTAs per SM at head_dim 128), so the
// launcher runs it where that costs nothing: a grid of at most one CTA per SM (a few long sequences;
// build.small_grid_schedule), where it streams 12-16% faster (H200). A schedule: the same bits.
__device__ __forceinline__ void prefetch_slab_l2(const scalar_t *k_cache, const scalar_t *v_cache,
                                                 const PartitionRows &r, int t0, int lane) {
  const scalar_t *p = r.row(lane < SLAB ? k_cache : v_cache, t0, lane % SLAB);
#pragma unroll
  for (int c = 0; c < (HEAD_DIM + 63) / 64; ++c) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + 64 * c));  // 128-byte lines
}

// The partial pieces' narrower loads (row starts are 16-byte aligned: HEAD_DIM is a multiple of 8).
__device__ __forceinline__ uint2 load_kv8(const scalar_t *p) { return __ldg(reinterpret_cast<const uint2 *>(p)); }
__device__ __forceinline__ unsigned load_kv4(const scalar_t *p) { return __ldg(reinterpret_cast<const unsigned *>(p)); }
__device__ __forceinline__ unsigned load_kv2(const scalar_t *p) { return __ldg(p); }

// This lane's K slices of the slab starting at token t0: rows t0 + grp and t0 + grp + 8,
// dims 32c + 8tig .. + 8 (then K16_OFF + 4tig .. + 4, K8_OFF + 2tig .. + 2): exactly its A
// fragments of the QK^T mmas.
__device__ __forceinline__ void load_k_slab(KSlab &kt, const scalar_t *k_cache, const PartitionRows &r,
                                            int t0, int grp, int tig) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const scalar_t *p = r.row(k_cache, t0, grp + 8 * i);
#pragma unroll
    for (int c = 0; c < KCH; ++c) kt.c[c][i] = load_kv16(p + 32 * c + 8 * tig);
    if (K16) kt.t16[i] = load_kv8(p + K16_OFF + 4 * tig);
    if (K8) kt.t8[i] = load_kv4(p + K8_OFF + 2 * tig);
  }
}

// This lane's V slices of the slab: rows t0 + 2tig + {0, 1, 8, 9}, dims 64c + 8grp .. + 8 (then
// V32_OFF + 4grp .. + 4, V16_OFF + 2grp .. + 2, V8_OFF + grp).
__device__ __forceinline__ void load_v_slab(VSlab &vt, const scalar_t *v_cache, const PartitionRows &r,
                                            int t0, int grp, int tig) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const scalar_t *p = r.row(v_cache, t0, 2 * tig + (i & 1) + 8 * (i >> 1));
#pragma unroll
    for (int c = 0; c < VCH; ++c) vt.c[c][i] = load_kv16(p + 64 * c + 8 * grp);
    if (V32) vt.t32[i] = load_kv8(p + V32_OFF + 4 * grp);
    if (V16) vt.t16[i] = load_kv4(p + V16_OFF + 2 * grp);
    if (V8) vt.t8[i] = load_kv2(p + V8_OFF + grp);
  }
}

// The query's B fragments of the partial K pieces, re-read from shared memory each slab (as lds16).
__device__ __forceinline__ uint2 lds8(const scalar_t *p) {
  uint2 u;
  asm volatile("ld.volatile.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(u.x), "=r"(u.y) : "r"(smem_u32(p)));
  return u;
}
__device__ __forceinline__ unsigned lds4(const scalar_t *p) {
  unsigned u;
  asm volatile("ld.volatile.shared.u32 %0, [%1];\n" : "=r"(u) : "r"(smem_u32(p)));
  return u;
}

// O^T += V^T P^T for one band's mma: the lane's words of token rows 2tig, 2tig + 1 (a, b) and
// 2tig + 8, 2tig + 9 (e, f) at output dims d, d + 1 (low and high halves): rows grp and grp + 8.
__device__ __forceinline__ void mma_pv(float (&o)[4], unsigned a, unsigned b, unsigned e, unsigned f, float corr0,
                                       float corr1, unsigned pb0, unsigned pb1) {
  o[0] *= corr0;
  o[1] *= corr1;
  o[2] *= corr0;
  o[3] *= corr1;
  mma_16816(o, __byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632), __byte_perm(e, f, 0x5410),
            __byte_perm(e, f, 0x7632), pb0, pb1);
}

// Each lane's C fragment of one band mma -> the warp's unnormalized output in shared memory:
// rows grp, grp + 8 are dims d, d + 1 (d + 1 absent in an 8-dim band), columns heads 2tig, 2tig + 1.
__device__ __forceinline__ void store_o(float (*o_s)[HEAD_DIM], const float (&o)[4], int d, bool has_d1, int h0,
                                        int h1) {
  if (h0 < G) {
    o_s[h0][d] = o[0];
    if (has_d1) o_s[h0][d + 1] = o[2];
  }
  if (h1 < G) {
    o_s[h1][d] = o[1];
    if (has_d1) o_s[h1][d + 1] = o[3];
  }
}

// SPAN_FOLD's one rule, written once (v3's fold_partition and the fold reduce's fold_super use it): a later state
// (m', l', x') folded into a saved one (m, l, x) of the same warp: M = max(m, m'), every sum x (the exp-sum and each
// p.V) becomes fmaf(x', exp2(m' - M), x * exp2(m - M)), the max M.
struct FoldWeights {
  float big, f_old, f_new;  // M, exp2(m - M), exp2(m' - M)
};
__device__ __forceinline__ FoldWeights fold_weights(float m_saved, float m_later) {
  const float big = fmaxf(m_saved, m_later);
  return {big, exp2_approx(m_saved - big), exp2_approx(m_later - big)};
}
__device__ __forceinline__ float fold(float saved, float later, const FoldWeights &f) {
  return fmaf(later, f.f_new, saved * f.f_old);
}

// SPAN_FOLD: this lane's C fragment of one band folded into the warp's saved state (the very elements store_o
// wrote from this lane, so no other lane's write is read).
__device__ __forceinline__ void fold_o(float (*o_s)[HEAD_DIM], const float (&o)[4], int d, bool has_d1, int h0, int h1,
                                       const FoldWeights &f0, const FoldWeights &f1) {
  if (h0 < G) {
    o_s[h0][d] = fold(o_s[h0][d], o[0], f0);
    if (has_d1) o_s[h0][d + 1] = fold(o_s[h0][d + 1], o[2], f0);
  }
  if (h1 < G) {
    o_s[h1][d] = fold(o_s[h1][d], o[1], f1);
    if (has_d1) o_s[h1][d + 1] = fold(o_s[h1][d + 1], o[3], f1);
  }
}

// The CTA's partitions' states, one slot per partition it computes: each warp's unnormalized p.V, max (log2
// units) and exp-sum, written by the warp at its last slab of the partition, read by write_partitions.
__shared__ float v3_o_s[STATE_SLOTS][NUM_WARPS][G][HEAD_DIM];
__shared__ float v3_m_s[STATE_SLOTS][NUM_WARPS][G], v3_l_s[STATE_SLOTS][NUM_WARPS][G];

// Warps that saved a state for partition q: those with a slab there; all of them with one partition a CTA
// (each saves after its loop, zeros and -inf if it had no slab: the same values the others stand for).
__device__ __forceinline__ int warps_with_slabs(int q, int num_slabs) {
  return STATE_SLOTS == 1 ? NUM_WARPS : min(NUM_WARPS, num_slabs - q * SLABS_PER_PART);
}

// Partition q's max over its warps, in warp order (log2 units); `busy` warps had a slab there (warp 0 always
// has one), the others hold nothing: max -inf, exp-sum 0, p.V 0.
__device__ __forceinline__ float partition_max(int q, int g, int busy) {
  float m = v3_m_s[q][0][g];
#pragma unroll
  for (int w = 1; w < NUM_WARPS; ++w) m = fmaxf(m, w < busy ? v3_m_s[q][w][g] : neg_inf());
  return m;
}

// Partition q's exp-sum l and p.V at (head g, dim d) over its warps, each weighted by exp2(m_w - m), in warp order:
// the operations the kernel's epilogue has always done for its one partition.
__device__ __forceinline__ void partition_share(int q, int g, int d, int busy, float m, float &l, float &acc) {
  l = 0.f, acc = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) {
    const float f = exp2_approx((w < busy ? v3_m_s[q][w][g] : neg_inf()) - m);
    l = fmaf(w < busy ? v3_l_s[q][w][g] : 0.f, f, l);
    acc = fmaf(w < busy ? v3_o_s[q][w][g][d] : 0.f, f, acc);
  }
}

// After the slab loop and a barrier: per partition the CTA computed, merge its warps; then write the output
// itself when the context has one partition, or each partition's share (max in the natural-log units
// paged_attention_reduce expects), or, when the CTA computed every partition of the context, merge them as
// paged_attention_reduce does: M the largest m_p, w_p = l_p * expf(m_p - M), total += w_p and
// acc = fmaf(w_p, o_p, acc) for p increasing, out = acc / total (its operations in its order: its bits).
__device__ __forceinline__ void write_partitions(scalar_t *__restrict__ out, float *__restrict__ tmp_out,
                                                 float *__restrict__ max_logits, float *__restrict__ exp_sums,
                                                 long long row0, int num_parts, int max_parts, int part0, int span,
                                                 int num_slabs) {
  const int num_q = STATE_SLOTS == 1 ? 1 : (num_slabs + SLABS_PER_PART - 1) / SLABS_PER_PART;  // partitions computed
  const bool whole = SPAN_SLOTS > 1 && part0 == 0 && num_parts > 1 && num_parts <= span;
  for (int i = threadIdx.x; i < G * HEAD_DIM; i += NUM_THREADS) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    const long long row = row0 + g;
    float big = neg_inf();  // a whole context's M (exact in any order); m_p * ln 2 rounded as the partials store it
#pragma unroll 1
    for (int q = 0; whole && q < STATE_SLOTS && q < num_q; ++q)
      big = fmaxf(big, __fmul_rn(partition_max(q, g, warps_with_slabs(q, num_slabs)), LN2));
    float total = 0.f, merged = 0.f;
#pragma unroll 1
    for (int q = 0; q < STATE_SLOTS && q < num_q; ++q) {
      const int busy = warps_with_slabs(q, num_slabs);
      const float m = partition_max(q, g, busy);
      float l, acc;
      partition_share(q, g, d, busy, m, l, acc);
      if (whole) {  // merged as paged_attention_reduce merges: w rounded, then added
        const float w = __fmul_rn(l, expf(__fmul_rn(m, LN2) - big));
        total += w;
        merged = fmaf(w, acc / l, merged);
      } else if (num_parts == 1) {
        out[row * HEAD_DIM + d] = from_float(acc / l);
      } else {
        tmp_out[(row * max_parts + part0 + q) * HEAD_DIM + d] = acc / l;
        if (d == 0) {
          max_logits[row * max_parts + part0 + q] = m * LN2;
          exp_sums[row * max_parts + part0 + q] = l;
        }
      }
    }
    if (whole) out[row * HEAD_DIM + d] = from_float(merged / total);
  }
}

// SPAN_FOLD=1, after the slab loop and a barrier. Slot 0 holds each warp's state folded over the CTA's partitions
// (one partition, or one whole superpartition of up to FOLD_SPAN), merged over the warps as write_partitions merges
// a partition's. A context of one partition, or a CTA holding a context's one superpartition, writes the output:
// acc / l. Otherwise a superpartition CTA writes its share as a partition's (o = acc / l, its max in natural-log
// units, its exp-sum) at index part0 / FOLD_SPAN, and a CTA of one partition writes its warps' states as they are
// ([row, partition, warp]: p.V unnormalized, max in log2 units, exp-sum), for paged_attention_fold_reduce to fold.
__device__ __forceinline__ void write_folded(scalar_t *__restrict__ out, float *__restrict__ tmp_out,
                                             float *__restrict__ max_logits, float *__restrict__ exp_sums,
                                             long long row0, int num_parts, int max_parts, int part0) {
  const int num_supers = (num_parts + FOLD_SPAN - 1) / FOLD_SPAN;
  for (int i = threadIdx.x; i < G * HEAD_DIM; i += NUM_THREADS) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    const long long row = row0 + g;
    if (SPAN_SLOTS == 1 && num_parts > 1) {  // the reduce kernel folds these
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) {
        const long long at = (row * max_parts + part0) * NUM_WARPS + w;
        tmp_out[at * HEAD_DIM + d] = v3_o_s[0][w][g][d];
        if (d == 0) max_logits[at] = v3_m_s[0][w][g], exp_sums[at] = v3_l_s[0][w][g];
      }
      continue;
    }
    const float m = partition_max(0, g, NUM_WARPS);
    float l, acc;
    partition_share(0, g, d, NUM_WARPS, m, l, acc);
    if (num_supers == 1) {
      out[row * HEAD_DIM + d] = from_float(acc / l);
    } else {
      const long long at = row * max_parts + part0 / FOLD_SPAN;
      tmp_out[at * HEAD_DIM + d] = acc / l;
      if (d == 0) max_logits[at] = m * LN2, exp_sums[at] = l;
    }
  }
}

#if SPAN_FOLD && RAW_SPAN
// RAW_SPAN=1, a CTA of RAW_SLOTS partitions (span 2 < FOLD_SPAN; build.MmaTuning.raw_span), after the slab loop and a
// barrier: slot q holds each warp's state of partition part0 + q as it was at that partition's end (save_partition),
// or the empty state of a warp with no slab there. Written as write_folded writes a CTA of one partition's ([row,
// partition, warp]: p.V unnormalized, max in log2 units, exp-sum), the same values copied, so the fold reduce folds
// the same states as after one partition a CTA: its bits, from half the CTAs.
__device__ __forceinline__ void write_raw_states(float *__restrict__ tmp_out, float *__restrict__ max_logits,
                                                 float *__restrict__ exp_sums, long long row0, int max_parts, int part0,
                                                 int num_q) {
  for (int i = threadIdx.x; i < num_q * NUM_WARPS * G * HEAD_DIM; i += NUM_THREADS) {
    const int d = i % HEAD_DIM, g = i / HEAD_DIM % G, w = i / (G * HEAD_DIM) % NUM_WARPS, q = i / (NUM_WARPS * G * HEAD_DIM);
    const long long at = ((row0 + g) * max_parts + part0 + q) * NUM_WARPS + w;
    tmp_out[at * HEAD_DIM + d] = v3_o_s[q][w][g][d];
    if (d == 0) max_logits[at] = v3_m_s[q][w][g], exp_sums[at] = v3_l_s[q][w][g];
  }
}
#endif

#if MERGE_IN_KERNEL
// MERGE_IN_KERNEL=1: the last CTA of a (sequence, head group) to finish merges its partitions, so no
// second launch (and no ramp-up and tail of one) follows. Each partition CTA writes its partials as
// before, makes them visible device-wide (__threadfence) and takes a ticket from the group's counter;
// the CTA that draws num_parts - 1 saw every other partition's partials land, merges them, and puts
// the counter back to 0 for the next launch (or graph replay): the counters are zero between launches.
// Bits: each output element goes through paged_attention_reduce's operations in its order (weights
// w_p = l_p * expf(m_p - M) via shared memory; total += w_p and acc = fmaf(w_p, o_p, acc) over p
// increasing from 0; acc / total), so the result is the two-launch result, bit for bit, whichever
// CTA comes last (tests/test_kernels_gpu.py holds it). Which thread computes an element does not
// enter the arithmetic; the max M is exact in any order.
// Measured (H200, 2026-12-01, `python -m pagedref.bench kernel --no-prefill --peers flashinfer`, graphed,
// GB/s and share of FlashInfer's tensor-core decode), with the merge's loads issued one after the
// other (each thread: its G heads x partitions ld.cg in series):
//   shape                       (64,4096)      (256,1024)     (8,32768)      (32,512)       (256,512)      (1,131072)
//   FlashInfer                  4247           4022           4228           2537           3648           3933
//   p1024, reduce launch        4144 (97.6%)   4260 (105.9%)  4149 (98.1%)   2970 (117.1%)  4037 (110.7%)  3801 (96.6%)
//   p1024, merged in kernel     4086 (96.2%)   4257 (105.9%)  4011 (94.9%)   2937 (115.8%)  4029 (110.4%)  2913 (74.1%)
//   p2048, reduce launch        4177 (98.3%)   4263 (106.0%)  4202 (99.4%)   2966 (116.9%)  4037 (110.7%)  3988 (101.4%)
//   p2048, merged in kernel     4137 (97.4%)   4259 (105.9%)  4126 (97.6%)   2931 (115.5%)  4027 (110.4%)  3476 (88.4%)
// The merge sits on a group's critical path while L2 is busy with everyone's K/V, and a serial chain
// of round trips (G x partitions) cost more than the launch it saved: 43 us at (1, 131072), where 8
// CTAs merge 128 partitions each. So the loads are now issued MERGE_UNROLL partitions at a time (all
// of them for up to MERGE_UNROLL partitions), before the weights need the max. Measured in that form
// (H200, 2026-12-01 19:22 UTC, docs/results/kernel-2026-12-01-s5-q-empty-fix.json; FlashInfer 4334 / 4106 /
// 4318 / 2558 / 3723 / 4001 GB/s there):
//   p4096, merged in kernel     4405 (101.6%)  4339 (105.7%)  4318 (100.0%)  2987 (116.8%)  4099 (110.1%)  3996 (99.9%)
// the only tuning at or above FlashInfer at every shape but (1, 131072); the default keeps 1024-token
// partitions, which serve small batches with more CTAs (docs/benchmarks.md).
// At 1-8 sequences of 4096 tokens it runs at a third of the default's speed (2026-12-01 21:25 UTC,
// docs/results/kernel-2026-12-01-s6-small-batches.json). Tried next, and reverted: a CTA that computes
// several of its sequence's partitions in turn (k planned from the batch, the same bits) and merges
// them itself. The loop around a partition needed registers that the slab loop at 128 a thread does not
// have; kept spill-free, it took a barrier and shared-memory reads per partition and lost 2-6% even at
// one partition per CTA, which grouping only partly won back (64 x 4096: 4080 GB/s, the default 4142).
constexpr int MERGE_CHUNK = PR_WARP;  // partitions whose weights pass through shared memory at a time
constexpr int MERGE_PER_THREAD = (G * HEAD_DIM + NUM_THREADS - 1) / NUM_THREADS;  // output elements per thread
// Partitions whose partial outputs a thread has in flight at once (MERGE_PER_THREAD loads each):
// the merge runs while other CTAs stream K/V, so its L2 round trips, not its arithmetic, set its time.
// About an eighth of the registers MIN_CTAS_PER_SM leaves a thread (more spilled at head_dim 64 and 80).
constexpr int MERGE_LOADS = 65536 / (NUM_THREADS * MIN_CTAS_PER_SM) / 8;
constexpr int pow2_floor(int x) { return x < 2 ? 1 : 2 * pow2_floor(x / 2); }
constexpr int MERGE_UNROLL = pow2_floor(MERGE_LOADS / MERGE_PER_THREAD);
constexpr int MERGE_HEADS_PER_WARP = (G + NUM_WARPS - 1) / NUM_WARPS;

// This thread's partial outputs of partitions p .. p + MERGE_UNROLL - 1 (zeros past num_parts): its
// output element k is i = tid + k * NUM_THREADS, head i / HEAD_DIM, dim i % HEAD_DIM. The partials
// were written by other CTAs of this launch: read through L2 (ld.cg), never a stale L1 line.
__device__ __forceinline__ void load_partials(float (&ov)[MERGE_UNROLL][MERGE_PER_THREAD], const float *tmp_out,
                                              long long row0, int max_parts, int p, int num_parts) {
#pragma unroll
  for (int u = 0; u < MERGE_UNROLL; ++u)
#pragma unroll
    for (int k = 0; k < MERGE_PER_THREAD; ++k) {
      const int i = threadIdx.x + k * NUM_THREADS;
      ov[u][k] = p + u < num_parts && i < G * HEAD_DIM
                     ? __ldcg(tmp_out + ((row0 + i / HEAD_DIM) * max_parts + p + u) * HEAD_DIM + i % HEAD_DIM)
                     : 0.f;
    }
}

// Merge the partitions of query heads row0 .. row0 + G - 1 (rows of [num_seqs * num_heads]) into out.
// Every load that does not wait for the max is issued first (the first partial outputs, the first
// chunk's maxima and exp-sums, the maxima past it), so a merge of up to MERGE_UNROLL partitions
// takes about one L2 round trip.
// Not inlined: inlined, its registers pushed v3 (bf16, head_dim 128, 128 registers) into an 8-byte spill.
__device__ __noinline__ void merge_partitions(scalar_t *__restrict__ out, const float *tmp_out,
                                              const float *max_logits, const float *exp_sums, long long row0,
                                              int num_parts, int max_parts) {
  __shared__ float m_s[G][MERGE_CHUNK];  // a chunk of each head's partition maxima, then their weights
  __shared__ float e_s[G][MERGE_CHUNK];  // ... and exp-sums
  __shared__ float max_s[G];             // each head's largest partition max M
  const int tid = threadIdx.x, warp = tid / PR_WARP, lane = tid % PR_WARP;
  float ov[MERGE_UNROLL][MERGE_PER_THREAD];
  load_partials(ov, tmp_out, row0, max_parts, 0, num_parts);
  float far[MERGE_HEADS_PER_WARP];  // the max of head warp + j * NUM_WARPS's partitions past the first chunk
#pragma unroll
  for (int j = 0; j < MERGE_HEADS_PER_WARP; ++j) {
    const int g = warp + j * NUM_WARPS;
    far[j] = neg_inf();
    if (g < G)
#pragma unroll 4
      for (int p = MERGE_CHUNK + lane; p < num_parts; p += PR_WARP)
        far[j] = fmaxf(far[j], __ldcg(max_logits + (row0 + g) * max_parts + p));
  }
  float acc[MERGE_PER_THREAD], total[MERGE_PER_THREAD];
#pragma unroll
  for (int k = 0; k < MERGE_PER_THREAD; ++k) acc[k] = total[k] = 0.f;
  for (int p0 = 0; p0 < num_parts; p0 += MERGE_CHUNK) {
    const int np = min(MERGE_CHUNK, num_parts - p0);
    if (p0 > 0) __syncthreads();  // the previous chunk's weights are consumed
    for (int i = tid; i < G * MERGE_CHUNK; i += NUM_THREADS) {
      const int g = i / MERGE_CHUNK, p = i % MERGE_CHUNK;
      const long long at = (row0 + g) * max_parts + p0 + p;
      if (p < np) m_s[g][p] = __ldcg(max_logits + at), e_s[g][p] = __ldcg(exp_sums + at);
    }
    __syncthreads();
    if (p0 == 0) {  // M over every partition (exact in any order): the first chunk's, then those past it
#pragma unroll
      for (int j = 0; j < MERGE_HEADS_PER_WARP; ++j) {
        const int g = warp + j * NUM_WARPS;  // warp-uniform
        if (g >= G) continue;
        const float m = group_max<PR_WARP>(lane < np ? fmaxf(far[j], m_s[g][lane]) : far[j]);
        if (lane == 0) max_s[g] = m;
      }
      __syncthreads();
    }
    // The weights, as paged_attention_reduce computes them: w_p = l_p * expf(m_p - M).
    for (int i = tid; i < G * MERGE_CHUNK; i += NUM_THREADS) {
      const int g = i / MERGE_CHUNK, p = i % MERGE_CHUNK;
      if (p < np) m_s[g][p] = e_s[g][p] * expf(m_s[g][p] - max_s[g]);
    }
    __syncthreads();
    // total += w_p and acc = fmaf(w_p, o_p, acc), p in increasing order: the reduce kernel's sums.
    for (int p = 0; p < np; p += MERGE_UNROLL) {
      if (p0 + p > 0) load_partials(ov, tmp_out, row0, max_parts, p0 + p, num_parts);
#pragma unroll
      for (int u = 0; u < MERGE_UNROLL; ++u) {
        if (p + u >= np) break;
#pragma unroll
        for (int k = 0; k < MERGE_PER_THREAD; ++k) {
          const int i = tid + k * NUM_THREADS;
          if (i >= G * HEAD_DIM) continue;
          const float w = m_s[i / HEAD_DIM][p + u];
          total[k] += w;
          acc[k] = fmaf(w, ov[u][k], acc[k]);
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < MERGE_PER_THREAD; ++k) {
    const int i = tid + k * NUM_THREADS;
    if (i < G * HEAD_DIM) out[(row0 + i / HEAD_DIM) * HEAD_DIM + i % HEAD_DIM] = from_float(acc[k] / total[k]);
  }
}
#endif  // MERGE_IN_KERNEL

// v2's arguments and outputs, shape for shape (the launcher passes the same tuple to either), then
// merge_counters: [num_seqs, num_heads / G] int32, zeros between launches (MERGE_IN_KERNEL=1 only;
// otherwise unused and may be null), and span: partitions per CTA, 1 .. SPAN_SLOTS (1 with MERGE_IN_KERNEL).
extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS_PER_SM) paged_attention_v3(
    scalar_t *__restrict__ out, float *__restrict__ tmp_out, float *__restrict__ max_logits,
    float *__restrict__ exp_sums, const scalar_t *__restrict__ q, const scalar_t *__restrict__ k_cache,
    const scalar_t *__restrict__ v_cache, const int *__restrict__ block_tables,
    const int *__restrict__ context_lens, int max_blocks, int num_heads, int num_kv_heads, int max_parts,
    float scale, int *__restrict__ merge_counters, int span) {
  constexpr int PART_BLOCKS = PARTITION_SIZE / BLOCK_SIZE;
  __shared__ uint4 q_s[8][HEAD_DIM / VEC];                 // the query, 8 heads (zeros past G)

  const int head0 = blockIdx.x * G, part0 = blockIdx.y * span, s = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / PR_WARP, lane = tid % PR_WARP;
  const int grp = lane / 4, tig = lane % 4;  // this lane's row group and column pair in mma fragments
  const int start = part0 * PARTITION_SIZE;  // the CTA computes partitions part0 .. part0 + span - 1

  // Three independent reads, all in flight at once: the context length, the partition's block
  // numbers (columns past the sequence's last block are padding, staged but never used) and the
  // query's B fragments (head head0 + grp, dims 32c + 8tig; zeros in the columns past G).
  const int ctx = context_lens[s];
  const int *bt = block_tables + (long long)s * max_blocks + start / BLOCK_SIZE;
  for (int i = tid; i < span * PART_BLOCKS && start / BLOCK_SIZE + i < max_blocks; i += NUM_THREADS) v3_blocks_s[i] = bt[i];
  for (int i = tid; i < 8 * HEAD_DIM / VEC; i += NUM_THREADS) {
    const int h = i / (HEAD_DIM / VEC), c = i % (HEAD_DIM / VEC);
    q_s[h][c] = h < G ? load16(q + ((long long)s * num_heads + head0 + h) * HEAD_DIM + c * VEC) : make_uint4(0u, 0u, 0u, 0u);
  }
  const int num_parts = (ctx + PARTITION_SIZE - 1) / PARTITION_SIZE;
  if (start >= ctx) return;  // the whole CTA leaves together, before any barrier
  const int n = min(span * PARTITION_SIZE, ctx - start);  // tokens of the CTA's partitions
  const int num_slabs = (n + SLAB - 1) / SLAB;
  const float scale_log2 = scale * LOG2E;
  const PartitionRows rows{n, num_kv_heads * HEAD_DIM, head0 / (num_heads / num_kv_heads) * HEAD_DIM};
  __syncthreads();  // v3_blocks_s ready

  // Online softmax state for heads 2tig (…0) and 2tig + 1 (…1); o[c][j] is the C fragment of
  // O^T's rows 64c + 8grp + 2j (+1) and columns (heads) 2tig, 2tig + 1.
  float m0 = neg_inf(), m1 = neg_inf(), l0 = 0.f, l1 = 0.f;
  float o[VCH][4][4], o32[2][4], o16[4], o8[4];  // the partial bands' accumulators likewise
#pragma unroll
  for (int e = 0; e < 4; ++e) {
#pragma unroll
    for (int c = 0; c < VCH; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j) o[c][j][e] = 0.f;
    o32[0][e] = o32[1][e] = o16[e] = o8[e] = 0.f;
  }

  // The warp's exp-sums: each lane added its own tokens; add over the 8 token rows.
  auto sum_rows = [&]() {
#pragma unroll
    for (int off = 4; off < PR_WARP; off *= 2) {
      l0 += __shfl_xor_sync(PR_FULL_MASK, l0, off);
      l1 += __shfl_xor_sync(PR_FULL_MASK, l1, off);
    }
  };
  // band(fragment, d, has_d1) for each band of the warp's p.V: this lane's C fragment and its first dim (store_o).
  auto each_band = [&](auto &&band) {
#pragma unroll
    for (int c = 0; c < VCH; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j) band(o[c][j], 64 * c + 8 * grp + 2 * j, true);
    if (V32) {
      band(o32[0], V32_OFF + 4 * grp, true);
      band(o32[1], V32_OFF + 4 * grp + 2, true);
    }
    if (V16) band(o16, V16_OFF + 2 * grp, true);
    if (V8) band(o8, V8_OFF + grp, false);
  };

  // The warp's state for partition q -> shared memory (v3_o_s, v3_m_s, v3_l_s), for write_partitions.
  auto save_partition = [&](int q) {
    sum_rows();
    const int h0 = 2 * tig, h1 = 2 * tig + 1;  // the heads of this lane's C fragments
    if (grp == 0 && h0 < G) v3_m_s[q][warp][h0] = m0, v3_l_s[q][warp][h0] = l0;
    if (grp == 0 && h1 < G) v3_m_s[q][warp][h1] = m1, v3_l_s[q][warp][h1] = l1;
    each_band([&](const float (&f)[4], int d, bool has_d1) { store_o(v3_o_s[q][warp], f, d, has_d1, h0, h1); });
  };

#if SPAN_FOLD && SPAN_SLOTS > 1 && !RAW_SPAN
  // SPAN_FOLD: the warp's state of a later partition of the superpartition folded into its saved state, in
  // partition order (fold_weights, fold); no barrier (a lane re-reads only the p.V it wrote, and the max /
  // exp-sum the warp's lanes of grp 0 wrote, after a __syncwarp). paged_attention_fold_reduce folds the partials
  // of one partition a CTA with the same operations (fold_super).
  auto fold_partition = [&]() {
    sum_rows();
    __syncwarp();
    const int h0 = 2 * tig, h1 = 2 * tig + 1, g0 = min(h0, G - 1), g1 = min(h1, G - 1);
    const FoldWeights f0 = fold_weights(v3_m_s[0][warp][g0], m0), f1 = fold_weights(v3_m_s[0][warp][g1], m1);
    const float l_saved0 = v3_l_s[0][warp][g0], l_saved1 = v3_l_s[0][warp][g1];
    __syncwarp();
    if (grp == 0 && h0 < G) v3_m_s[0][warp][h0] = f0.big, v3_l_s[0][warp][h0] = fold(l_saved0, l0, f0);
    if (grp == 0 && h1 < G) v3_m_s[0][warp][h1] = f1.big, v3_l_s[0][warp][h1] = fold(l_saved1, l1, f1);
    each_band([&](const float (&f)[4], int d, bool has_d1) { fold_o(v3_o_s[0][warp], f, d, has_d1, h0, h1, f0, f1); });
  };
#endif

  KSlab kt;
  VSlab vt;
  if (warp < num_slabs) {
    load_k_slab(kt, k_cache, rows, warp * SLAB, grp, tig);
    load_v_slab(vt, v_cache, rows, warp * SLAB, grp, tig);
  }
  for (int slab = warp; slab < num_slabs; slab += NUM_WARPS) {  // warp-uniform trip count
    const int t0 = slab * SLAB, next = slab + NUM_WARPS;
    // S^T[token, head] = K Q^T over the 16 tokens: lane holds tokens grp, grp + 8 x heads 2tig, 2tig + 1.
    float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < KCH; ++c) {
      const uint4 qf = lds16(&q_s[grp][4 * c + tig]);  // B fragments of Q^T: head grp, dims 32c + 8tig .. + 8
#pragma unroll
      for (int h = 0; h < 2; ++h)
        mma_16816(sc, word(kt.c[c][0], 2 * h), word(kt.c[c][1], 2 * h), word(kt.c[c][0], 2 * h + 1),
                  word(kt.c[c][1], 2 * h + 1), word(qf, 2 * h), word(qf, 2 * h + 1));
    }
    const scalar_t *q_row = reinterpret_cast<const scalar_t *>(q_s[grp]);
    if (K16) {  // dims K16_OFF + 4tig .. + 4: k 2tig, 2tig + 1 (a0) and 2tig + 8, 2tig + 9 (a2)
      const uint2 qf = lds8(q_row + K16_OFF + 4 * tig);
      mma_16816(sc, kt.t16[0].x, kt.t16[1].x, kt.t16[0].y, kt.t16[1].y, qf.x, qf.y);
    }
    if (K8) {  // dims K8_OFF + 2tig, + 1: k 2tig, 2tig + 1; k 8..15 are zero
      const unsigned qf = lds4(q_row + K8_OFF + 2 * tig);
      mma_16816(sc, kt.t8[0], kt.t8[1], 0u, 0u, qf, 0u);
    }
    if (next < num_slabs) load_k_slab(kt, k_cache, rows, next * SLAB, grp, tig);  // in flight from here on
    if (KV_PREFETCH && next + NUM_WARPS < num_slabs) prefetch_slab_l2(k_cache, v_cache, rows, (next + NUM_WARPS) * SLAB, lane);

    // Softmax step, log2 units; tokens past the partition's end get -inf, i.e. p = 0.
    const bool in0 = t0 + grp < n, in1 = t0 + grp + 8 < n;
    const float x0 = in0 ? sc[0] * scale_log2 : neg_inf(), x1 = in0 ? sc[1] * scale_log2 : neg_inf();
    const float x2 = in1 ? sc[2] * scale_log2 : neg_inf(), x3 = in1 ? sc[3] * scale_log2 : neg_inf();
    float mx0 = fmaxf(x0, x2), mx1 = fmaxf(x1, x3);
#pragma unroll
    for (int off = 4; off < PR_WARP; off *= 2) {  // over the 8 token rows (lanes of equal tig)
      mx0 = fmaxf(mx0, __shfl_xor_sync(PR_FULL_MASK, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(PR_FULL_MASK, mx1, off));
    }
    const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);  // finite: the slab has a real token
    const float corr0 = exp2_approx(m0 - new0), corr1 = exp2_approx(m1 - new1);  // 0 on the first slab
    m0 = new0;
    m1 = new1;
    const float p0 = exp2_approx(x0 - new0), p1 = exp2_approx(x1 - new1);  // token grp
    const float p2 = exp2_approx(x2 - new0), p3 = exp2_approx(x3 - new1);  // token grp + 8
    l0 = l0 * corr0 + (p0 + p2);
    l1 = l1 * corr1 + (p1 + p3);
    const unsigned p_lo = pack2(p0, p1), p_hi = pack2(p2, p3);  // P in 16 bits for the mma
    // P^T as the B operand: lane holds head grp x tokens 2tig, 2tig + 1 (+ 8).
    const unsigned pb0 = transpose_8x8(p_lo, grp, tig), pb1 = transpose_8x8(p_hi, grp, tig);

    // O^T[dim, head] = O^T * corr + V^T P^T.
#pragma unroll
    for (int c = 0; c < VCH; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        mma_pv(o[c][j], word(vt.c[c][0], j), word(vt.c[c][1], j), word(vt.c[c][2], j), word(vt.c[c][3], j), corr0,
               corr1, pb0, pb1);
    if (V32) {
      mma_pv(o32[0], vt.t32[0].x, vt.t32[1].x, vt.t32[2].x, vt.t32[3].x, corr0, corr1, pb0, pb1);
      mma_pv(o32[1], vt.t32[0].y, vt.t32[1].y, vt.t32[2].y, vt.t32[3].y, corr0, corr1, pb0, pb1);
    }
    if (V16) mma_pv(o16, vt.t16[0], vt.t16[1], vt.t16[2], vt.t16[3], corr0, corr1, pb0, pb1);
    if (V8) mma_pv(o8, vt.t8[0], vt.t8[1], vt.t8[2], vt.t8[3], corr0, corr1, pb0, pb1);  // high halves 0: rows grp + 8 stay 0
#if SPAN_SLOTS > 1
    // The warp's last slab of a partition (warp-uniform): its state for that partition goes to shared
    // memory, and the next partition starts afresh, with no barrier. Before the next V is loaded: this V's
    // registers are free then, and the next K is already on the way.
    if (next >= num_slabs || slab % SLABS_PER_PART >= SLABS_PER_PART - NUM_WARPS) {
#if SPAN_FOLD && RAW_SPAN
      save_partition(slab / SLABS_PER_PART);  // a RAW_SPAN build runs spans of 2 only (build.span_build): no fold
#elif SPAN_FOLD
      if (slab < SLABS_PER_PART) save_partition(0); else fold_partition();
#else
      save_partition(slab / SLABS_PER_PART);
#endif
      m0 = m1 = neg_inf();
      l0 = l1 = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
#pragma unroll
        for (int c = 0; c < VCH; ++c)
#pragma unroll
          for (int j = 0; j < 4; ++j) o[c][j][e] -= o[c][j][e];  // +0 (o is finite); "= 0.f" spilled here
        o32[0][e] -= o32[0][e], o32[1][e] -= o32[1][e], o16[e] -= o16[e], o8[e] -= o8[e];
      }
    }
#endif
    if (next < num_slabs) load_v_slab(vt, v_cache, rows, next * SLAB, grp, tig);
  }
#if PDL
  // The reduce kernel may be scheduled once every CTA has left its slab loop (or exited): its CTAs then take the
  // slots of finishing v3 CTAs, never those of v3 CTAs still waiting to start. It waits (griddepcontrol.wait)
  // for this whole grid to finish and its writes to land before it reads a partial.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
#if SPAN_SLOTS == 1
  save_partition(0);  // one partition: after the loop, as before spans (fewer registers); a warp with no slab saves its zeros
#elif SPAN_FOLD
  // A warp with no slab saves an empty state (as constants: o is not kept past the loop): in slot 0, or with raw
  // spans in the slot of the CTA's last partition when it had no slab there (a short one), as one partition a CTA
  // saves it (p.V +0, max -inf, exp-sum 0: the fold reduce never folds it).
#if RAW_SPAN
  // A superpartition's partitions split over CTAs of 2 (a RAW_SPAN build runs no other span): each saved its
  // partitions' warp states, a slot each, for the fold reduce; a context of one partition is written whole, as ever.
  const bool raw = num_parts > 1;
  const int last_q = (num_slabs - 1) / SLABS_PER_PART;
#else
  constexpr int last_q = 0;
#endif
  if (warp >= num_slabs - last_q * SLABS_PER_PART) {
    for (int i = lane; i < G * HEAD_DIM; i += PR_WARP) v3_o_s[last_q][warp][i / HEAD_DIM][i % HEAD_DIM] = 0.f;
    if (lane < G) v3_m_s[last_q][warp][lane] = neg_inf(), v3_l_s[last_q][warp][lane] = 0.f;
  }
#endif
  __syncthreads();

#if SPAN_FOLD && RAW_SPAN
  if (raw)
    write_raw_states(tmp_out, max_logits, exp_sums, (long long)s * num_heads + head0, max_parts, part0, last_q + 1);
  else
#endif
#if SPAN_FOLD
  write_folded(out, tmp_out, max_logits, exp_sums, (long long)s * num_heads + head0, num_parts, max_parts, part0);
#else
  write_partitions(out, tmp_out, max_logits, exp_sums, (long long)s * num_heads + head0, num_parts, max_parts, part0,
                   span, num_slabs);
#endif
#if MERGE_IN_KERNEL
  if (num_parts == 1) return;  // the output is written: no partials, no counter
  __shared__ int is_last;
  __threadfence();  // this thread's partials are visible device-wide before the ticket below is taken
  __syncthreads();
  int *counter = merge_counters + (long long)s * gridDim.x + blockIdx.x;
  if (tid == 0) {
    __threadfence();
    is_last = atomicAdd(counter, 1) == num_parts - 1;
    if (is_last) *counter = 0;  // every partition has counted: ready for the next launch
    __threadfence();  // the other partitions' partials are read after their tickets
  }
  __syncthreads();
  if (is_last) merge_partitions(out, tmp_out, max_logits, exp_sums, (long long)s * num_heads + head0, num_parts, max_parts);
#endif
}
#endif  // DECODE_MMA

// Merge the partitions of each (sequence, head): the flash-decoding reduction. For each partition p (increasing):
// w_p = l_p * expf(m_p - M) with M the largest m_p, total += w_p, acc = fmaf(w_p, o_p, acc); out = acc / total.
// Why this shape: the merge is a chain of round trips (the context length, the maxima, then the partials), and it
// runs after v2/v3 with the GPU otherwise idle, so its latency is the cost. A row's head dimension is cut into
// slices of 32 dims, one warp each (lane = one output dim), and a warp has a whole chunk of 32 partitions' loads
// in flight at once: lane j loads partition j's max and exp-sum, and every lane its dim of all 32 partial
// outputs. Up to 32 partitions (32k tokens at 1024-token partitions) that is one round trip, issued beside the
// context length's. Lane p computes w_p and the lanes take the weights in partition order by shuffle, so
// every lane of every slice adds the same floats in the same order: the operations and their order per element
// are the ones this kernel has always had (a warp per row with 8 partitions in flight measured 4 chained round
// trips at (8 sequences, 32768 tokens)).
constexpr int REDUCE_CHUNK = PR_WARP;                            // partitions a warp has in flight at once
constexpr int REDUCE_SLICES = (HEAD_DIM + PR_WARP - 1) / PR_WARP;  // warps per (sequence, head) row

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_reduce(
    scalar_t *__restrict__ out, const float *__restrict__ tmp_out, const float *__restrict__ max_logits,
    const float *__restrict__ exp_sums, const int *__restrict__ context_lens, int num_heads, int max_parts, int span) {
#if PDL && DECODE_MMA
  // Launched as v3's programmatic dependent: wait until v3 has finished and its partials are visible. Every
  // CTA waits, so this grid ends after v3 does and whatever follows it sees v3's outputs too.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  const int s = blockIdx.x, w = blockIdx.y * NUM_WARPS + threadIdx.x / PR_WARP, lane = threadIdx.x % PR_WARP;
  const int h = w / REDUCE_SLICES, d = w % REDUCE_SLICES * PR_WARP + lane;
  if (h >= num_heads) return;  // whole warps
  const int ctx = context_lens[s];
  const long long row = (long long)s * num_heads + h;
  const float *ml = max_logits + row * max_parts;
  const float *es = exp_sums + row * max_parts;
  const float *o = tmp_out + row * max_parts * HEAD_DIM + min(d, HEAD_DIM - 1);  // a lane past HEAD_DIM: a real dim, unstored
  // A chunk's loads, all in flight at once: the first is issued before num_parts is known (any partition of the
  // row: p < max_parts). A partition past num_parts holds whatever is there and never enters a value.
  float m_p, e_p, o_c[REDUCE_CHUNK];  // lane j: partition p0 + j's max and exp-sum; o_c[u]: partition p0 + u at dim d
  auto load_chunk = [&](int p0) {
    m_p = p0 + lane < max_parts ? __ldcg(ml + p0 + lane) : 0.f;
    e_p = p0 + lane < max_parts ? __ldcg(es + p0 + lane) : 0.f;
#pragma unroll
    for (int u = 0; u < REDUCE_CHUNK; ++u) o_c[u] = p0 + u < max_parts ? __ldcg(o + (long long)(p0 + u) * HEAD_DIM) : 0.f;
  };
  load_chunk(0);
  // What a partial covers: a partition, or with SPAN_FOLD a superpartition of FOLD_SPAN (span == FOLD_SPAN).
  const int unit = SPAN_FOLD ? FOLD_SPAN * PARTITION_SIZE : PARTITION_SIZE;
  const int num_parts = (ctx + unit - 1) / unit;
  // No test before the first chunk is used: the compiler would sink its loads below an early return for rows of
  // one partition (a second round trip on every row); the test comes at the store.
  float m = lane < num_parts ? m_p : neg_inf();  // M: the largest partition max (exact in any order)
  for (int p = REDUCE_CHUNK + lane; p < num_parts; p += PR_WARP) m = fmaxf(m, ml[p]);  // past 32 partitions
  m = group_max<PR_WARP>(m);

  float total = 0.f, acc = 0.f;  // every lane adds the weights in the same order: the same bits
  for (int p0 = 0;;) {
    const float w_p = e_p * expf(m_p - m);  // lane j's weight, partition p0 + j
#pragma unroll
    for (int u = 0; u < REDUCE_CHUNK; ++u) {
      const bool in = p0 + u < num_parts;
      const float wu = __shfl_sync(PR_FULL_MASK, w_p, u);
      total = in ? total + wu : total;
      acc = in ? fmaf(wu, o_c[u], acc) : acc;
    }
    p0 += REDUCE_CHUNK;
    if (p0 >= num_parts) break;
    load_chunk(p0);
  }
  if (num_parts <= (SPAN_FOLD ? 1 : span) || d >= HEAD_DIM) return;  // v2/v3 wrote this row directly (one CTA computed all its partitions)
  out[row * HEAD_DIM + d] = from_float(acc / total);
}

#if DECODE_MMA && SPAN_FOLD
// The folded tree's partials of one partition a CTA ([row, partition, warp]: write_folded), merged: per
// superpartition, each warp's states folded in partition order with v3's fold_partition operations (a warp with
// no slab in a partition, max -inf, is skipped: v3 never folds it), the warps merged as write_folded merges them
// (o = acc / l, max m, exp-sum l), then the superpartitions merged as paged_attention_reduce merges partitions
// (w = l * expf(m ln 2 - M), total += w, acc = fmaf(w, o, acc), increasing order; a context of one superpartition
// is its o). The same operations in the same order as CTAs that compute whole superpartitions: the same bits
// (tests/test_kernels_gpu.py).
// Launch: grid (num_seqs, num_heads * REDUCE_SLICES), a CTA per 32 dims of a (sequence, head) row, lane = dim.
// Its warps fold different superpartitions (warp k: k, k + 4, ...; the next one's 16 states loading while one is
// folded; the first ones issued beside the context length's load, before the row's partition count is known),
// and warp 0 merges them in order from shared memory: about one round trip to L2 up to 64 partitions.
constexpr int FOLD_STATES = FOLD_SPAN * NUM_WARPS;  // (partition, warp) states of a superpartition
constexpr int FOLD_ROUND = 4;                       // superpartitions a warp folds a round
static_assert(FOLD_STATES <= PR_WARP, "a lane loads one state's max and exp-sum");
struct SuperStates {
  float m, l, o[FOLD_STATES];  // lane j < FOLD_STATES: state j's max (log2 units) and exp-sum; o[i]: state i's p.V at this lane's dim
};
__device__ __forceinline__ void load_super(SuperStates &st, const float *ml, const float *es, const float *o, int sp,
                                           int num_states, int lane) {
  const int first = sp * FOLD_STATES;
  const bool mine = lane < FOLD_STATES && first + lane < num_states;
  st.m = mine ? __ldcg(ml + first + lane) : neg_inf();  // past the context: -inf, never folded
  st.l = mine ? __ldcg(es + first + lane) : 0.f;
#pragma unroll
  for (int i = 0; i < FOLD_STATES; ++i) st.o[i] = first + i < num_states ? __ldcg(o + (long long)(first + i) * HEAD_DIM) : 0.f;
}

// One superpartition: (o, m, l) as write_folded computes them from a CTA's slot.
__device__ __forceinline__ void fold_super(const SuperStates &st, float &o_sp, float &m, float &l) {
  float fm[NUM_WARPS], fl[NUM_WARPS], fo[NUM_WARPS];
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w)
    fm[w] = __shfl_sync(PR_FULL_MASK, st.m, w), fl[w] = __shfl_sync(PR_FULL_MASK, st.l, w), fo[w] = st.o[w];
#pragma unroll
  for (int i = NUM_WARPS; i < FOLD_STATES; ++i) {
    const int w = i % NUM_WARPS;
    const float mi = __shfl_sync(PR_FULL_MASK, st.m, i), li = __shfl_sync(PR_FULL_MASK, st.l, i);
    if (mi == neg_inf()) continue;  // no slab of warp w in that partition (or past the context): warp-uniform
    const FoldWeights f = fold_weights(fm[w], mi);
    fl[w] = fold(fl[w], li, f);
    fo[w] = fold(fo[w], st.o[i], f);
    fm[w] = f.big;
  }
  m = fm[0];  // partition_max, then partition_share
#pragma unroll
  for (int w = 1; w < NUM_WARPS; ++w) m = fmaxf(m, fm[w]);
  float a = 0.f;
  l = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) {
    const float f = exp2_approx(fm[w] - m);
    l = fmaf(fl[w], f, l);
    a = fmaf(fo[w], f, a);
  }
  o_sp = a / l;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_fold_reduce(
    scalar_t *__restrict__ out, const float *__restrict__ tmp_out, const float *__restrict__ max_logits,
    const float *__restrict__ exp_sums, const int *__restrict__ context_lens, int num_heads, int max_parts) {
#if PDL
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // v3's programmatic dependent, as paged_attention_reduce
#endif
  constexpr int PER_ROUND = NUM_WARPS * FOLD_ROUND;  // superpartitions a round folds
  __shared__ float fs_o[PER_ROUND][PR_WARP], fs_m[PER_ROUND], fs_l[PER_ROUND];
  __shared__ float big_s[NUM_WARPS];
  const int s = blockIdx.x, h = blockIdx.y / REDUCE_SLICES, warp = threadIdx.x / PR_WARP, lane = threadIdx.x % PR_WARP;
  const int d = blockIdx.y % REDUCE_SLICES * PR_WARP + lane;
  const long long row = (long long)s * num_heads + h;
  const float *ml = max_logits + row * max_parts * NUM_WARPS, *es = exp_sums + row * max_parts * NUM_WARPS;
  const float *o = tmp_out + row * max_parts * NUM_WARPS * HEAD_DIM + min(d, HEAD_DIM - 1);  // past HEAD_DIM: unstored
  const int cap = max_parts * NUM_WARPS;  // states the row's partials hold; those past its context are masked below
  SuperStates cur, nxt;
  load_super(cur, ml, es, o, warp, cap, lane);  // in flight with the context length's load
  const int num_parts = (context_lens[s] + PARTITION_SIZE - 1) / PARTITION_SIZE;
  if (num_parts <= 1) return;  // v3 wrote this row (the whole CTA leaves)
  const int num_supers = (num_parts + FOLD_SPAN - 1) / FOLD_SPAN, num_states = num_parts * NUM_WARPS;
  // M: the largest max over every (partition, warp) (exact in any order; rounding m * ln 2 keeps the order). One
  // round takes it from its superpartitions' maxima; more rounds need it first.
  float big = neg_inf();
  if (num_supers > PER_ROUND) {
    for (int i = threadIdx.x; i < num_states; i += NUM_THREADS) big = fmaxf(big, __ldcg(ml + i));
    big = group_max<PR_WARP>(big);
    if (lane == 0) big_s[warp] = big;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) big = fmaxf(big, big_s[w]);
    big = __fmul_rn(big, LN2);
  }
  float total = 0.f, acc = 0.f, only = 0.f;  // warp 0's
  for (int sp0 = 0; sp0 < num_supers; sp0 += PER_ROUND) {
#pragma unroll
    for (int r = 0; r < FOLD_ROUND; ++r) {  // superpartition sp0 + r * NUM_WARPS + warp (warp-uniform)
      const int k = r * NUM_WARPS + warp, sp = sp0 + k;
      if (sp >= num_supers) break;
      if (r + 1 < FOLD_ROUND && sp + NUM_WARPS < num_supers) load_super(nxt, ml, es, o, sp + NUM_WARPS, cap, lane);
      if (sp * FOLD_STATES + lane >= num_states) cur.m = neg_inf();  // past the context: never folded
      float o_sp, m, l;
      fold_super(cur, o_sp, m, l);
      fs_o[k][lane] = o_sp;
      if (lane == 0) fs_m[k] = m, fs_l[k] = l;
      if (r + 1 < FOLD_ROUND) cur = nxt;
    }
    __syncthreads();
    if (warp == 0) {
      const int n = min(PER_ROUND, num_supers - sp0);
      if (num_supers <= PER_ROUND) {
        for (int k = 0; k < n; ++k) big = fmaxf(big, fs_m[k]);
        big = __fmul_rn(big, LN2);
      }
      for (int k = 0; k < n; ++k) {
        const float o_k = fs_o[k][lane];
        const float w = __fmul_rn(fs_l[k], expf(__fmul_rn(fs_m[k], LN2) - big));  // as a superpartition's partial is weighed
        only = o_k;
        total += w;
        acc = fmaf(w, o_k, acc);
      }
    }
    if (sp0 + PER_ROUND < num_supers) {
      __syncthreads();  // the round's slots are read
      load_super(cur, ml, es, o, sp0 + PER_ROUND + warp, cap, lane);
    }
  }
  if (warp == 0 && d < HEAD_DIM) out[row * HEAD_DIM + d] = from_float(num_supers == 1 ? only : acc / total);
}
#endif  // DECODE_MMA && SPAN_FOLD
