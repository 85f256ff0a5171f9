// cache_ops.cu: the two writes into the paged KV pool, reshape_and_cache and copy_blocks.
//
// Layout: k/v_cache [num_blocks, block_size, num_kv_heads, head_dim] (any element type: these
// kernels move 16-byte words, so one compiled module serves fp32, fp16 and bf16).
//
// reshape_and_cache: the step's new key/value rows [num_tokens, num_kv_heads, head_dim] are scattered
//   to their slots: row t goes to slot slot_mapping[t] (= physical_block * block_size + offset), i.e.
//   to the row_words 16-byte words starting at slot * row_words. Launch: grid (num_tokens), block 128.
// copy_blocks: copy-on-write copies. For every layer (a pointer array of K pools and one of V pools)
//   and every (src, dst) pair of block_mapping [num_pairs, 2] int64, block dst becomes a copy of block
//   src. Launch: grid (num_layers, num_pairs), block 128. The Python side checks that no dst is also a
//   src or repeated, so the CTAs of one launch never read what another writes.
//
// Versions: v1 (this file) is one CTA per row / block copying 16-byte words, coalesced: these are
// bandwidth-bound copies with nothing to compute; fusing reshape_and_cache into the projection that
// produces K/V (as some engines do) is the next step and out of scope.

extern "C" __global__ void __launch_bounds__(128) reshape_and_cache(
    const uint4 *__restrict__ key, const uint4 *__restrict__ value,  // [num_tokens, row_words]
    uint4 *__restrict__ k_cache, uint4 *__restrict__ v_cache,        // [num_slots, row_words]
    const long long *__restrict__ slot_mapping, int row_words) {
  const long long t = blockIdx.x;
  const long long slot = slot_mapping[t];
  for (int i = threadIdx.x; i < row_words; i += blockDim.x) {
    k_cache[slot * row_words + i] = key[t * row_words + i];
    v_cache[slot * row_words + i] = value[t * row_words + i];
  }
}

extern "C" __global__ void __launch_bounds__(128) copy_blocks(
    const long long *__restrict__ key_cache_ptrs, const long long *__restrict__ value_cache_ptrs,  // [layers]
    const long long *__restrict__ block_mapping,  // [num_pairs, 2]: (src, dst)
    int block_words) {
  uint4 *k = reinterpret_cast<uint4 *>(key_cache_ptrs[blockIdx.x]);
  uint4 *v = reinterpret_cast<uint4 *>(value_cache_ptrs[blockIdx.x]);
  const long long src = block_mapping[2 * blockIdx.y] * block_words;
  const long long dst = block_mapping[2 * blockIdx.y + 1] * block_words;
  for (int i = threadIdx.x; i < block_words; i += blockDim.x) {
    k[dst + i] = k[src + i];
    v[dst + i] = v[src + i];
  }
}
