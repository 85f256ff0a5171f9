"""Stage 4 — sharing KV blocks: fork + copy-on-write, then prefix caching. One lesson step per test.

Run: pytest stages -m stage4 (add --impl PKG to grade your own package).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedref.attention import attention
from pagedref.course import lesson

ba = lesson("pagedref.memory.block_allocator")
bt = lesson("pagedref.memory.block_table")
sh = lesson("pagedref.memory.sharing")

NUM_KV_HEADS, HEAD_DIM, NUM_HEADS = 1, 4, 2


def token_kv(tokens, start: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """K/V of tokens at positions start, start+1, ...: a fixed function of (token id, position), so
    the expected cache content of any sequence is known. [n, num_kv_heads, head_dim] each."""
    t = np.asarray(tokens, dtype=np.float64)[:, None, None]
    p = np.arange(start, start + len(tokens), dtype=np.float64)[:, None, None]
    d = np.arange(HEAD_DIM, dtype=np.float64)
    return np.cos(0.37 * t + 1.3 * p + d).astype(dtype), np.sin(0.11 * t - 0.7 * p + 2 * d).astype(dtype)


class Pool:
    """One layer's numpy pool driven by a KVCacheManager, the way the model runner drives the GPU pool:
    do the copy-on-write copies first, then write the new tokens' K/V at their slots."""

    def __init__(self, kv, num_blocks: int, block_size: int, dtype=np.float32) -> None:
        self.kv, self.dtype = kv, dtype
        self.cache = bt.PagedKVCache(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        self.tokens: dict[int, list[int]] = {}  # seq id -> its logical tokens (what it must read back)

    def admit(self, seq_id: int, prompt: list[int]) -> int:
        num_cached, slots = self.kv.allocate(seq_id, prompt, len(prompt))
        n = num_cached  # the cached prefix is already in the pool: write only the rest
        self.cache.write(slots, *token_kv(prompt[n:], n, self.dtype))
        self.tokens[seq_id] = list(prompt)
        return num_cached

    def fork(self, parent: int, child: int) -> None:
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def append(self, seq_id: int, new_tokens: list[int]) -> list[tuple[int, int]]:
        slots, copies = self.kv.append_slots(seq_id, new_tokens)
        for src, dst in copies:  # copy-on-write: before this step's writes
            self.cache.k[dst] = self.cache.k[src]
            self.cache.v[dst] = self.cache.v[src]
        start = len(self.tokens[seq_id])
        self.cache.write(slots, *token_kv(new_tokens, start, self.dtype))
        self.tokens[seq_id] += new_tokens
        return copies

    def check_reads_own_tokens(self, seq_id: int) -> None:
        n = self.kv.num_tokens(seq_id)
        k, v = self.cache.gather(self.kv.block_ids(seq_id), n)
        ek, ev = token_kv(self.tokens[seq_id], 0, self.dtype)
        assert k.tobytes() == ek.tobytes() and v.tobytes() == ev.tobytes(), \
            f"stage 4: sequence {seq_id} must read exactly its own {n} tokens' K/V through its block table"


def test_step1_block_hashes_are_chained_so_equal_hashes_mean_equal_prefixes():
    h1 = sh.hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == sh.hash_block_tokens(None, (1, 2, 3, 4)), "stage 4: the hash must depend on the token ids only, not the container"
    h2 = sh.hash_block_tokens(h1, [5, 6, 7, 8])
    assert h2 != sh.hash_block_tokens(None, [5, 6, 7, 8]), \
        "stage 4: the same block of tokens after a different prefix must get a different hash (chain the parent's hash)"
    assert h2 != sh.hash_block_tokens(sh.hash_block_tokens(None, [1, 2, 3, 9]), [5, 6, 7, 8]), \
        "stage 4: a change anywhere in the prefix must change every later block's hash"


def test_step2_fork_shares_every_block_by_reference_count():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    kv.allocate(0, list(range(10)), 10)
    free_before = kv.num_free_blocks
    kv.fork(0, 1)
    assert kv.block_ids(1) == kv.block_ids(0), "stage 4: a fork must point at the very same physical blocks as its parent"
    assert kv.num_free_blocks == free_before, "stage 4: forking must not take a single block"
    assert all(kv.allocator.ref_count(b) == 2 for b in kv.block_ids(0)), "stage 4: each shared block's ref count is 2 after one fork"
    assert kv.num_tokens(1) == 10 and kv.stats()["num_shared_blocks"] == 3, "stage 4: the fork has the parent's 10 tokens, 3 shared blocks"


def test_step3_the_first_append_to_a_shared_partly_filled_block_copies_it_first():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    kv.allocate(0, list(range(10)), 10)  # blocks: [full, full, 2 of 4]
    kv.fork(0, 1)
    shared_last = kv.block_ids(0)[-1]
    slots, copies = kv.append_slots(1, [100])
    assert len(copies) == 1 and copies[0][0] == shared_last, "stage 4: append_slots must return (src, dst) for the copy-on-write"
    src, dst = copies[0]
    assert kv.block_ids(1)[-1] == dst != src and kv.block_ids(0)[-1] == src, \
        "stage 4: the appender gets the copy; the other holder keeps the original block"
    assert slots == [dst * 4 + 2], "stage 4: the new token goes into the copy, right after the copied tokens"
    assert kv.allocator.ref_count(src) == 1 and kv.allocator.ref_count(dst) == 1, "stage 4: after the copy each block has one holder"
    assert all(kv.allocator.ref_count(b) == 2 for b in kv.block_ids(0)[:2]), "stage 4: full blocks never change, so they stay shared"
    assert kv.append_slots(1, [101])[1] == [], "stage 4: the copy is private now: the next append must not copy again"
    assert kv.append_slots(0, [200])[1] == [], "stage 4: the parent is now the only holder of its block: it writes in place"


def test_step4_a_full_last_block_is_never_copied():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    kv.allocate(0, list(range(8)), 8)  # two full blocks
    kv.fork(0, 1)
    slots, copies = kv.append_slots(1, [42])
    assert copies == [], "stage 4: appending after a full shared block takes a new block: nothing to copy"
    assert len(kv.block_ids(1)) == 3 and kv.block_ids(1)[:2] == kv.block_ids(0), "stage 4: the fork still shares both full blocks"
    assert kv.blocks_needed(0, 1) == 1, "stage 4: the parent's next token needs exactly one new block, no copy"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 8, 16, 32])
def test_step5_every_fork_reads_exactly_its_own_tokens_parallel_sampling(block_size, dtype):
    rng = np.random.default_rng(block_size)
    kv = sh.KVCacheManager(num_blocks=64, block_size=block_size, enable_prefix_caching=False)
    pool = Pool(kv, 64, block_size, dtype)
    prompt = rng.integers(0, 1000, 11).tolist()
    pool.admit(0, prompt)
    for child in (1, 2, 3):  # n = 4 parallel samples of one prompt
        pool.fork(0, child)
    for _ in range(9):  # each sample draws its own tokens
        for s in (0, 1, 2, 3):
            pool.append(s, [int(rng.integers(0, 1000))])
            pool.check_reads_own_tokens(s)
    for s in (0, 1, 2, 3):
        q = rng.standard_normal((1, NUM_HEADS, HEAD_DIM)).astype(dtype)
        k, v = token_kv(pool.tokens[s], 0, dtype)
        out = bt.paged_attention(q, pool.cache, kv.block_ids(s), kv.num_tokens(s))
        assert out.tobytes() == attention(q, k, v).tobytes(), \
            f"stage 4: sample {s}'s attention must equal the oracle on its own tokens, bit for bit"
    shared = set(kv.block_ids(0)[: 11 // block_size])
    assert all(set(kv.block_ids(s)) >= shared for s in (1, 2, 3)), "stage 4: the prompt's full blocks stay shared by every sample"


def test_step6_blocks_go_back_to_the_free_list_only_when_their_count_reaches_zero():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    kv.allocate(0, list(range(6)), 6)
    kv.fork(0, 1)
    kv.append_slots(1, [7, 8, 9])
    parent_blocks = kv.block_ids(0)
    kv.free(0)
    assert not kv.allocator.is_free(parent_blocks[0]), "stage 4: a block the fork still holds must stay allocated after the parent frees"
    assert kv.allocator.is_free(parent_blocks[1]), "stage 4: the parent's private (copied-from) block is free once the parent frees it"
    kv.free(1)
    assert kv.num_free_blocks == 16, "stage 4: once every sequence is freed, every block is free: nothing leaks"


def test_step7_misuse_gets_a_clear_error_and_changes_nothing():
    with pytest.raises(ValueError, match="block_size"):
        sh.KVCacheManager(num_blocks=4, block_size=0)
    kv = sh.KVCacheManager(num_blocks=16, block_size=4, max_model_len=8)
    kv.allocate(0, list(range(6)), 6)
    kv.fork(0, 1)
    before = (kv.block_ids(0), kv.block_ids(1), list(kv.allocator.ref_counts), kv.num_free_blocks)
    with pytest.raises(sh.MaxModelLenError):
        kv.append_slots(1, [1, 2, 3])  # 9 > max_model_len = 8
    assert (kv.block_ids(0), kv.block_ids(1), list(kv.allocator.ref_counts), kv.num_free_blocks) == before, \
        "stage 4: a refused append must not have started a copy-on-write"
    with pytest.raises(sh.MaxModelLenError):
        kv.allocate(2, list(range(9)), 9)
    assert 2 not in kv.seqs and kv.num_free_blocks == before[3], "stage 4: a refused allocate must hold nothing"
    with pytest.raises(ValueError, match="already"):
        kv.allocate(0, [1], 1)
    with pytest.raises(ValueError):
        kv.fork(0, 1)  # stage 4: sequence 1 already has blocks
    kv.free(1)
    with pytest.raises(sh.FreedSequenceError):
        kv.fork(1, 5)  # stage 4: a freed sequence has nothing left to share
    with pytest.raises(sh.FreedSequenceError):
        kv.free(1)  # stage 4: freeing twice would drop references that belong to others
    with pytest.raises(sh.FreedSequenceError):
        kv.append_slots(1, [3])


def test_step8_prefix_caching_reuses_another_requests_full_blocks_without_a_fork():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    a = list(range(10))
    kv.allocate(0, a, 10)
    b = a[:8] + [97, 98, 99]
    assert kv.num_cached_tokens(b) == 8, "stage 4: b's first two blocks equal a's: 8 tokens are cached"
    num_cached, slots = kv.allocate(1, b, len(b) - 8)
    assert num_cached == 8 and len(slots) == 3, "stage 4: allocate() must skip the cached tokens and give slots to the rest"
    assert kv.block_ids(1)[:2] == kv.block_ids(0)[:2], "stage 4: a prefix hit points at the cached blocks themselves"
    assert kv.block_ids(1)[2] != kv.block_ids(0)[2], "stage 4: the block after the shared prefix is the request's own"
    assert all(kv.allocator.ref_count(blk) == 2 for blk in kv.block_ids(0)[:2]), "stage 4: a prefix hit adds a reference"
    assert kv.stats()["prefix_cache_hit_rate"] == 2 / 4, \
        "stage 4: hit rate = blocks found / full prompt blocks looked up: a's 2 lookups missed, b's 2 hit"


def test_step9_only_full_blocks_are_shared_and_a_whole_prompt_hit_still_computes_the_last_token():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    a = list(range(10))
    kv.allocate(0, a, 10)
    assert kv.num_cached_tokens(a) == 8, "stage 4: the partial third block (2 tokens) is never shared across requests"
    assert kv.num_cached_tokens(a[:8]) == 4, \
        "stage 4: on a hit covering the whole prompt, the last block is recomputed: its last token's logits are needed"
    num_cached, slots = kv.allocate(1, a[:8], 4)
    assert num_cached == 4 and len(slots) == 4 and kv.block_ids(1)[0] == kv.block_ids(0)[0]


def test_step10_freed_cached_blocks_stay_reusable_until_memory_is_needed_lru():
    kv = sh.KVCacheManager(num_blocks=6, block_size=4)
    a = list(range(13))  # 3 full blocks + 1 token
    kv.allocate(0, a, 13)
    a_blocks = kv.block_ids(0)
    kv.free(0)
    assert kv.num_free_blocks == 6 and kv.stats()["num_cached_blocks"] == 3, \
        "stage 4: freed full blocks are free and still cached (findable by hash)"
    assert kv.allocate(1, a, 1)[0] == 12, "stage 4: a later request with the same prompt finds all 3 freed blocks"
    assert kv.block_ids(1)[:3] == a_blocks[:3], "stage 4: ... the very same physical blocks, taken back from the free list"
    kv.free(1)
    kv.allocate(2, [1000 + i for i in range(16)], 16)  # needs 4 of the 6 blocks: evicts the least recently freed
    assert kv.num_cached_tokens(a) == 8, \
        "stage 4: eviction goes in LRU order, tail blocks first: a's third block is gone, its first two are still cached"
    assert kv.block_ids(2)[-1] == a_blocks[2], "stage 4: the evicted block was reused by the new request"


def test_step11_a_prefix_hit_reads_the_kv_another_request_wrote_bit_for_bit():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    pool = Pool(kv, 16, 4, np.float32)
    prompt = [5, 9, 2, 7, 1, 1, 3, 8, 6]
    pool.admit(0, prompt)
    pool.append(0, [4])
    kv.free(0)
    assert pool.admit(1, prompt[:8] + [11, 12]) == 8, "stage 4: the new request hits the first 8 tokens"
    pool.append(1, [13])
    pool.check_reads_own_tokens(1)
    q = np.random.default_rng(0).standard_normal((1, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    k, v = token_kv(pool.tokens[1], 0)
    assert bt.paged_attention(q, pool.cache, kv.block_ids(1), kv.num_tokens(1)).tobytes() == attention(q, k, v).tobytes(), \
        "stage 4: attention over a cached prefix must equal the oracle bit for bit"


def test_step12_prefix_caching_never_needs_copy_on_write_because_partial_blocks_are_private():
    kv = sh.KVCacheManager(num_blocks=32, block_size=4)
    pool = Pool(kv, 32, 4)
    prompt = list(range(10))
    pool.admit(0, prompt)
    pool.admit(1, prompt)  # the same prompt: shares the 2 full blocks, not the partial one
    for step in range(10):
        for s in (0, 1):
            assert pool.append(s, [50 + 10 * s + step]) == [], "stage 4: blocks shared by prefix caching are full: never copied"
            pool.check_reads_own_tokens(s)
    kv.check_invariants()


def test_step13_the_invariants_hold_and_nothing_leaks():
    rng = np.random.default_rng(3)
    kv = sh.KVCacheManager(num_blocks=40, block_size=4)
    pool = Pool(kv, 40, 4)
    base = rng.integers(0, 50, 12).tolist()
    pool.admit(0, base)
    pool.fork(0, 1)
    pool.admit(2, base[:9] + [77])
    for step in range(6):
        for s in (0, 1, 2):
            pool.append(s, [int(rng.integers(0, 50))])
        kv.check_invariants()
    for s in (0, 1, 2):
        pool.check_reads_own_tokens(s)
        kv.free(s)
        kv.check_invariants()
    assert kv.num_free_blocks == 40 and all(c == 0 for c in kv.allocator.ref_counts), \
        "stage 4: once every sequence is freed, every block is free and no reference is left"
