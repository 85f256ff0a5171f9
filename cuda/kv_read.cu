// kv_read.cu: a kernel that only reads the paged K/V pool, the way decode attention does: the read roofline
// of an access pattern (`python -m pagedref.bench gather`), with nothing computed but a checksum.
//
// Layout read: k/v_cache [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] 16-bit, block_tables [num_seqs,
// max_blocks] int32, every sequence PARTITION_SIZE * gridDim.y tokens long. Launch: grid (num_kv_heads,
// partitions, num_seqs), 128 threads (4 warps), any dynamic shared memory (reserved, never touched: what a
// kernel's shared memory costs the stream is the question it answers). Each CTA reads PARTITION_SIZE tokens'
// K and V, as many bytes as a v3 decode CTA, with the same pipeline: each warp takes the partition's 16-token
// steps warp, warp + 4, ..., and has the next step's K in flight while it uses this step's V, and its V
// while it uses the next K (one step ahead, 8 KB a warp: 128 registers' worth as in v3).
//   PATTERN 0: v3's lanes (cuda/paged_attention.cu, load_k_slab / load_v_slab): K rows grp and grp + 8, 16
//              bytes at dims 32c + 8tig; V rows 2tig + {0, 1, 8, 9} at dims 64c + 8grp. One instruction
//              touches 64 bytes of each of 8 rows.
//   PATTERN 1: the same rows of the CTA's KV head, two whole 256-byte rows an instruction.
//   PATTERN 2: the CTA reads whole blocks (every KV head: 2 token rows, 4 KB contiguous, a step): blocks
//              kv_head, kv_head + num_kv_heads, ... of its partition. The same bytes over the grid.
// out[cta] = the xor of every 32-bit word the CTA read (bench/gather.py's test checks the bytes read).

#ifndef PATTERN
#define PATTERN 0
#endif
#ifndef PARTITION_SIZE
#define PARTITION_SIZE 1024  // build.kv_read_config passes v3's (splitk.MMA_PARTITION_SIZE), or a short context's length
#endif
static_assert(HEAD_DIM == 128 && BLOCK_SIZE == 16, "kv_read measures v3's layout at head_dim 128, 16-token blocks");
constexpr int STEPS = PARTITION_SIZE / 16;  // 16-token steps a CTA reads

// One step's K (kv = 0) or V (kv = 1): 8 16-byte words a lane.
__device__ __forceinline__ void load_step(const unsigned short *cache, const int *blocks, int num_kv_heads, int kv_head,
                                          int step, int lane, int kv, uint4 (&r)[8]) {
  const int row = num_kv_heads * HEAD_DIM;  // elements from one token row to the next
#if PATTERN == 2
  const int b = blocks[kv_head + num_kv_heads * (step / 8)];  // the CTA's block step / 8, eighth step % 8 of it
  const unsigned short *p = cache + (long long)b * BLOCK_SIZE * row + step % 8 * 2 * row;
#pragma unroll
  for (int j = 0; j < 8; ++j) r[j] = __ldg(reinterpret_cast<const uint4 *>(p + j * 256 + lane * 8));
#else
  const unsigned short *p = cache + (long long)blocks[step] * BLOCK_SIZE * row + kv_head * HEAD_DIM;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#if PATTERN == 0
    const int grp = lane / 4, tig = lane % 4;
    const int t = kv == 0 ? grp + 8 * (j / 4) : 2 * tig + (j / 2 & 1) + 8 * (j / 4);
    const int d = kv == 0 ? 32 * (j % 4) + 8 * tig : 64 * (j % 2) + 8 * grp;
#else
    const int t = 2 * j + lane / 16, d = lane % 16 * 8;
#endif
    r[j] = __ldg(reinterpret_cast<const uint4 *>(p + t * row + d));
  }
#endif
}

__device__ __forceinline__ unsigned xor_words(const uint4 (&r)[8]) {
  unsigned x = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) x ^= r[j].x ^ r[j].y ^ r[j].z ^ r[j].w;
  return x;
}

extern "C" __global__ void __launch_bounds__(128, 4) kv_read(
    const unsigned short *__restrict__ k_cache, const unsigned short *__restrict__ v_cache, const int *__restrict__ block_tables,
    int max_blocks, unsigned *__restrict__ out) {
  const int kv_head = blockIdx.x, num_kv_heads = gridDim.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int *blocks = block_tables + (long long)blockIdx.z * max_blocks + blockIdx.y * (PARTITION_SIZE / 16);
  uint4 k[8], v[8];
  unsigned acc = 0;
  load_step(k_cache, blocks, num_kv_heads, kv_head, warp, lane, 0, k);
  load_step(v_cache, blocks, num_kv_heads, kv_head, warp, lane, 1, v);
  for (int step = warp; step < STEPS; step += 4) {
    acc ^= xor_words(k);
    if (step + 4 < STEPS) load_step(k_cache, blocks, num_kv_heads, kv_head, step + 4, lane, 0, k);
    acc ^= xor_words(v);
    if (step + 4 < STEPS) load_step(v_cache, blocks, num_kv_heads, kv_head, step + 4, lane, 1, v);
  }
  for (int off = 16; off > 0; off /= 2) acc ^= __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) atomicXor(out + (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x, acc);
}
