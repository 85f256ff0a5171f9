"""Stage 4 — sharing KV blocks: fork + copy-on-write, then prefix caching. One lesson step per test.

Run: pytest stages -m stage4 (add --impl PKG to grade your own package).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedref.attention import attention
from pagedref.course import lesson, raises

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
        assert len(slots) == len(prompt) - n, (
            f"stage 4: allocate(seq, prompt, len(prompt)) must give slots to the uncached rest of the prompt only "
            f"(num_new_tokens is capped): {len(prompt)} tokens, {n} cached, {len(slots)} slots")
        self.cache.write(slots, *token_kv(prompt[n:], n, self.dtype))
        self.tokens[seq_id] = list(prompt)
        return num_cached

    def fork(self, parent: int, child: int) -> None:
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def append(self, seq_id: int, new_tokens: list[int]) -> list[tuple[int, int]]:
        slots, copies = self.kv.append_slots(seq_id, new_tokens)
        assert len(slots) == len(new_tokens), "stage 4: append_slots returns one slot per new token"
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


def holds(kv, when: str) -> None:
    """kv.check_invariants() must not raise: a failure says so, with the learner's own message."""
    try:
        kv.check_invariants()
    except AssertionError as e:
        raise AssertionError(f"stage 4: check_invariants() must not raise when {when}, but raised: {e}") from e


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
    assert set(kv.seqs) == {0, 1}, "stage 4: kv.seqs holds the live sequences: allocate and fork add one"


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


def test_step5_blocks_needed_and_can_append_count_a_pending_copy_on_write():
    kv = sh.KVCacheManager(num_blocks=5, block_size=4)
    kv.allocate(0, list(range(10)), 10)  # blocks: [full, full, 2 of 4], 2 blocks left
    kv.fork(0, 1)
    assert kv.blocks_needed(1, 0) == 0, "stage 4: appending nothing needs no block, not even a copy"
    assert kv.append_slots(1, []) == ([], []), "stage 4: appending nothing copies nothing and gives no slot"
    assert kv.blocks_needed(1, 1) == 1, "stage 4: blocks_needed counts the copy-on-write of the shared, partly filled last block"
    assert kv.blocks_needed(1, 3) == 2, "stage 4: 3 tokens into a shared block holding 2 of 4: the copy, plus 1 new block"
    assert kv.can_append(1, 3) and not kv.can_append(1, 7), \
        "stage 4: can_append answers blocks_needed <= free blocks (2 free: 3 tokens need 2, 7 tokens need 3)"
    kv.allocate(2, [7, 7, 7], 3)  # takes 1 of the 2 free blocks
    assert not kv.can_append(1, 3), "stage 4: with 1 block free, the copy plus a new block do not fit: can_append must say no"
    before = (kv.block_ids(0), kv.block_ids(1), list(kv.allocator.ref_counts), kv.num_free_blocks)
    with raises(ba.NoFreeBlocksError, "stage 4: append_slots must raise NoFreeBlocksError when the copy and the new blocks do not fit"):
        kv.append_slots(1, [1, 2, 3])
    assert (kv.block_ids(0), kv.block_ids(1), list(kv.allocator.ref_counts), kv.num_free_blocks) == before, \
        "stage 4: a refused append must not have started the copy-on-write"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 8, 16, 32])
def test_step6_every_fork_reads_exactly_its_own_tokens_parallel_sampling(block_size, dtype):
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


def test_step7_blocks_go_back_to_the_free_list_only_when_their_count_reaches_zero():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    kv.allocate(0, list(range(6)), 6)
    kv.fork(0, 1)
    kv.append_slots(1, [7, 8, 9])
    parent_blocks = kv.block_ids(0)
    kv.free(0)
    assert 0 not in kv.seqs and 1 in kv.seqs, "stage 4: free() removes the sequence from kv.seqs"
    assert not kv.allocator.is_free(parent_blocks[0]), "stage 4: a block the fork still holds must stay allocated after the parent frees"
    assert kv.allocator.is_free(parent_blocks[1]), "stage 4: the parent's private (copied-from) block is free once the parent frees it"
    kv.free(1)
    assert kv.num_free_blocks == 16, "stage 4: once every sequence is freed, every block is free: nothing leaks"


def test_step8_misuse_gets_a_clear_error_and_changes_nothing():
    with raises(ValueError, "stage 4: a block_size of 0 must raise ValueError naming block_size", match="block_size"):
        sh.KVCacheManager(num_blocks=4, block_size=0)
    kv = sh.KVCacheManager(num_blocks=16, block_size=4, max_model_len=8)
    kv.allocate(0, list(range(6)), 6)
    kv.fork(0, 1)
    before = (kv.block_ids(0), kv.block_ids(1), list(kv.allocator.ref_counts), kv.num_free_blocks)
    with raises(sh.MaxModelLenError, "stage 4: appending 3 tokens to 6 must raise MaxModelLenError (max_model_len = 8)"):
        kv.append_slots(1, [1, 2, 3])
    assert (kv.block_ids(0), kv.block_ids(1), list(kv.allocator.ref_counts), kv.num_free_blocks) == before, \
        "stage 4: a refused append must not have started a copy-on-write"
    with raises(sh.MaxModelLenError, "stage 4: allocating a 9-token prompt must raise MaxModelLenError (max_model_len = 8)"):
        kv.allocate(2, list(range(9)), 9)
    assert kv.allocate(4, list(range(50, 58)), 8)[0] == 0 and kv.num_tokens(4) == 8, \
        "stage 4: a prompt of exactly max_model_len tokens is allowed"
    kv.free(4)
    assert 2 not in kv.seqs and kv.num_free_blocks == before[3], "stage 4: a refused allocate must hold nothing"
    with raises(ValueError, "stage 4: allocating a live sequence again must raise ValueError (\"already\")", match="already"):
        kv.allocate(0, [1], 1)
    with raises(ValueError, "stage 4: allocate with a negative num_new_tokens must raise ValueError"):
        kv.allocate(3, [1, 2], -1)
    assert 3 not in kv.seqs, "stage 4: a refused allocate must hold nothing"
    with raises(ValueError, "stage 4: forking into sequence 1, which is live, must raise ValueError"):
        kv.fork(0, 1)
    kv.free(1)
    with raises(sh.FreedSequenceError, "stage 4: forking a freed sequence must raise FreedSequenceError: it has nothing to share"):
        kv.fork(1, 5)
    with raises(sh.FreedSequenceError, "stage 4: freeing twice must raise FreedSequenceError: it would drop others' references"):
        kv.free(1)
    with raises(sh.FreedSequenceError, "stage 4: append_slots on a freed sequence must raise FreedSequenceError"):
        kv.append_slots(1, [3])
    with raises(sh.FreedSequenceError, "stage 4: a sequence never allocated has no blocks: FreedSequenceError"):
        kv.block_ids(42)


def test_step9_prefix_caching_reuses_another_requests_full_blocks_without_a_fork():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    a = list(range(10))
    kv.allocate(0, a, 10)
    b = a[:8] + [97, 98, 99]
    assert kv.num_cached_tokens(b) == 8, "stage 4: b's first two blocks equal a's: 8 tokens are cached"
    hit = kv.lookup(b)
    assert hit.blocks == kv.block_ids(0)[:2] and hit.num_tokens == 8, \
        "stage 4: lookup(prompt) returns the cached blocks of its prefix (PrefixHit.blocks) and num_tokens = 2 blocks * 4"
    assert hit.hashes == [sh.hash_block_tokens(None, a[:4]), sh.hash_block_tokens(sh.hash_block_tokens(None, a[:4]), a[4:8])], \
        "stage 4: PrefixHit.hashes are the chained hashes of the blocks found"
    assert kv.can_allocate(b, len(b), hit), "stage 4: can_allocate takes the lookup made already (hit)"
    num_cached, slots = kv.allocate(1, b, len(b), hit)
    assert num_cached == 8 and len(slots) == 3 and kv.num_tokens(1) == 11, (
        "stage 4: allocate(seq, prompt, len(prompt)) must skip the 8 cached tokens and give slots to the 3 others: "
        "num_new_tokens is capped at the uncached rest of the prompt")
    assert kv.block_ids(1)[:2] == kv.block_ids(0)[:2], "stage 4: a prefix hit points at the cached blocks themselves"
    assert kv.block_ids(1)[2] != kv.block_ids(0)[2], "stage 4: the block after the shared prefix is the request's own"
    assert all(kv.allocator.ref_count(blk) == 2 for blk in kv.block_ids(0)[:2]), "stage 4: a prefix hit adds a reference"
    assert kv.stats()["prefix_cache_hit_rate"] == 2 / 4, \
        "stage 4: hit rate = blocks found / full prompt blocks looked up: a's 2 lookups missed, b's 2 hit"
    assert kv.allocate(3, a[:9]) == (8, []) and kv.num_tokens(3) == 8, \
        "stage 4: allocate(seq, prompt) takes the cached prefix only: num_new_tokens defaults to 0"
    num_cached, slots = kv.allocate(2, a[:8] + [5, 5, 5, 5, 5], 2)  # a chunk of the uncached rest
    assert (num_cached, len(slots), kv.num_tokens(2)) == (8, 2, 10), \
        "stage 4: allocate(seq, prompt, 2) gives slots to the first 2 uncached tokens only (a chunked prefill)"


def test_step10_the_prefix_caching_allocator_keeps_the_first_block_with_a_hash():
    a = sh.PrefixCachingAllocator(num_blocks=3, block_size=2)
    b0, b1 = a.allocate(), a.allocate()
    a.register(b0, 7, [1, 2])
    a.register(b1, 7, [1, 2])  # the same prefix computed twice
    assert a.cached == {7: b0} and a.block_hash == {b0: 7} and a.block_tokens == {b0: (1, 2)}, \
        "stage 4: register() keeps the first block with a hash; a later one with the same hash stays unregistered"
    a.register(b0, 8, [3, 4])
    assert a.cached == {7: b0} and a.num_cached == 1, "stage 4: a block already cached keeps its first hash"
    a.free(b0)
    assert a.is_free(b0) and a.cached == {7: b0}, "stage 4: a freed block stays findable by hash while it is on the free list"
    a.acquire(b0)
    assert a.ref_count(b0) == 1 and not a.is_free(b0), "stage 4: acquire() takes a free cached block off the free list"
    a.acquire(b0)
    assert a.ref_count(b0) == 2, "stage 4: acquire() of a held cached block shares it"
    for b in (b0, b0, b1):
        a.free(b)
    handed = [a.allocate() for _ in range(3)]
    assert b0 in handed and a.cached == {} and a.block_hash == {} and a.block_tokens == {}, \
        "stage 4: allocate() evicts the block it hands out: its hash no longer finds it"


def test_step11_only_full_blocks_are_shared_and_a_whole_prompt_hit_still_computes_the_last_token():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    a = list(range(10))
    kv.allocate(0, a, 10)
    assert kv.num_cached_tokens(a) == 8, "stage 4: the partial third block (2 tokens) is never shared across requests"
    assert kv.num_cached_tokens(a[:8]) == 4, (
        "stage 4: a hit covering the whole prompt still computes the last token (its logits sample the first new "
        "token): the lookup covers whole blocks of the first 7 of 8 tokens, so 4 tokens, and the last block is recomputed")
    num_cached, slots = kv.allocate(1, a[:8], 8)
    assert num_cached == 4 and len(slots) == 4 and kv.block_ids(1)[0] == kv.block_ids(0)[0], \
        "stage 4: the 8-token prompt takes a's first block and computes its last block (4 new slots)"


def test_step12_freed_cached_blocks_stay_reusable_until_memory_is_needed_lru():
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


def test_step13_can_allocate_answers_exactly_and_a_refused_allocate_takes_no_cached_block():
    kv = sh.KVCacheManager(num_blocks=6, block_size=4)
    a = list(range(13))  # 3 full blocks + 1 token
    kv.allocate(0, a, 13)
    kv.free(0)  # 3 cached free blocks; the free list: 2 never used, then a's blocks, tail first
    kv.allocate(1, [100 + i for i in range(8)], 8)  # takes the 2 never used: no eviction
    assert kv.num_free_blocks == 4 and kv.num_cached_tokens(a) == 12, "stage 4: 4 blocks free, 3 of them cached"
    longer = a + [50, 51, 52, 53]  # 17 tokens: 3 hits (taken off the free list) + 2 new blocks = 5 > 4 free
    assert not kv.can_allocate(longer, len(longer)), \
        "stage 4: can_allocate must count the free cached hits it would take (3) plus the new blocks (2): 5 > 4 free"
    before = (list(kv.allocator.ref_counts), list(kv.allocator.free_list), dict(kv.allocator.cached), set(kv.seqs),
              kv.prefix_queries, kv.prefix_hits)
    with raises(ba.NoFreeBlocksError, "stage 4: allocate must raise NoFreeBlocksError when the pool cannot supply the blocks"):
        kv.allocate(2, longer, len(longer))
    after = (list(kv.allocator.ref_counts), list(kv.allocator.free_list), dict(kv.allocator.cached), set(kv.seqs),
             kv.prefix_queries, kv.prefix_hits)
    assert after == before, ("stage 4: allocate is all or nothing: a refused allocate takes no cached block, "
                             "changes no ref count, free list or cache entry, and counts no query")
    assert kv.can_allocate(a, len(a)), \
        "stage 4: a's 13 tokens need its 3 cached blocks + 1 new block = 4 free: can_allocate must say yes (count capped)"
    assert kv.allocate(2, a, len(a))[0] == 12 and kv.num_free_blocks == 0, "stage 4: ... and allocate then succeeds"
    assert not kv.can_allocate([9], 1), "stage 4: with no free block, can_allocate must say no"


def test_step14_a_prefix_hit_reads_the_kv_another_request_wrote_bit_for_bit():
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


def test_step15_prefix_caching_never_needs_copy_on_write_because_partial_blocks_are_private():
    kv = sh.KVCacheManager(num_blocks=32, block_size=4)
    pool = Pool(kv, 32, 4)
    prompt = list(range(10))
    pool.admit(0, prompt)
    pool.admit(1, prompt)  # the same prompt: shares the 2 full blocks, not the partial one
    for step in range(10):
        for s in (0, 1):
            assert pool.append(s, [50 + 10 * s + step]) == [], "stage 4: blocks shared by prefix caching are full: never copied"
            pool.check_reads_own_tokens(s)
    holds(kv, "two requests with the same prompt decode")


def test_step16_stats_reports_exactly_its_keys_and_definitions():
    kv = sh.KVCacheManager(num_blocks=16, block_size=4)
    assert kv.stats()["token_state_fraction"] == 0.0 and kv.stats()["prefix_cache_hit_rate"] == 0.0, \
        "stage 4: with nothing used and nothing looked up, both rates are 0.0"
    assert sh.KVCacheManager(num_blocks=2).block_size == sh.PrefixCachingAllocator(2).block_size == 16, \
        "stage 4: block_size defaults to 16, as stage 2's"
    kv.allocate(0, list(range(10)), 10)  # 3 blocks: full, full, 2 of 4
    kv.fork(0, 1)
    kv.append_slots(1, [7])  # the fork copies the last block and writes its 3rd token
    stats = kv.stats()
    assert set(stats) == {"num_blocks", "num_free_blocks", "num_used_blocks", "num_shared_blocks", "num_cached_blocks",
                          "token_state_fraction", "prefix_cache_hit_rate"}, f"stage 4: stats() has exactly the keys of its docstring, not {sorted(stats)}"
    assert (stats["num_blocks"], stats["num_free_blocks"], stats["num_used_blocks"], stats["num_shared_blocks"]) == (16, 12, 4, 2), \
        "stage 4: 16 blocks; 4 used (2 shared full blocks, the parent's last block, the fork's copy), 12 free"
    assert stats["num_cached_blocks"] == 2, "stage 4: the 2 full blocks are cached (findable by hash)"
    assert stats["token_state_fraction"] == (4 + 4 + 2 + 3) / (4 * 4), \
        "stage 4: token_state_fraction = slots holding tokens / (used blocks * block_size), a shared block counted once"
    assert stats["prefix_cache_hit_rate"] == 0.0, "stage 4: the one prompt looked up 2 full blocks and found none"
    kv.allocate(2, list(range(9)) + [99], 10)
    assert kv.stats()["prefix_cache_hit_rate"] == 2 / 4, "stage 4: prefix_cache_hit_rate = prefix_hits / prefix_queries"
    assert (kv.prefix_queries, kv.prefix_hits) == (4, 2), \
        "stage 4: each allocate queries (len(prompt) - 1) // block_size full blocks and hits those it finds"
    kv.allocate(3, list(range(8)), 8)  # 8 tokens: only the first block may hit (the last token is computed)
    assert (kv.prefix_queries, kv.prefix_hits) == (5, 3), (
        "stage 4: each allocate queries (len(prompt) - 1) // block_size full blocks: an 8-token prompt queries 1 "
        f"block (its second holds the last token), so 5 queries and 3 hits, not {(kv.prefix_queries, kv.prefix_hits)}")
    kv.allocate(4, list(range(5)), 5)  # 5 tokens: the first block may hit, and does
    assert (kv.prefix_queries, kv.prefix_hits) == (6, 4), "stage 4: a 5-token prompt queries (5 - 1) // 4 = 1 full block"


def test_step17_the_invariants_hold_and_nothing_leaks():
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
        holds(kv, f"sequences have appended {step + 1} tokens")
    for s in (0, 1, 2):
        pool.check_reads_own_tokens(s)
        kv.free(s)
        holds(kv, f"sequence {s} was freed")
    assert kv.num_free_blocks == 40 and all(c == 0 for c in kv.allocator.ref_counts), \
        "stage 4: once every sequence is freed, every block is free and no reference is left"



def test_step18_check_invariants_catches_each_broken_invariant():
    kv = sh.KVCacheManager(num_blocks=12, block_size=4)
    kv.allocate(0, list(range(10)), 10)
    kv.fork(0, 1)
    kv.append_slots(1, [5])
    kv.allocate(2, [9, 9, 9, 9, 9], 5)
    holds(kv, "every invariant holds")
    a, seq = kv.allocator, kv.seqs[1]
    free_block = next(iter(a.free_list))
    cached_hash, cached_block = next(iter(a.cached.items()))
    other_block = kv.block_ids(2)[0]
    corruptions = {  # what breaks -> (break it, repair it)
        "a block's ref count differs from its block-table references":
            (lambda: a.ref_counts.__setitem__(other_block, 2), lambda: a.ref_counts.__setitem__(other_block, 1)),
        "a block with count 0 is missing from the free list":
            (lambda: a.free_list.pop(free_block), lambda: a.free_list.__setitem__(free_block, None)),
        "a sequence knows more tokens than its table holds":
            (lambda: seq.token_ids.append(0), lambda: seq.token_ids.pop()),
        "a table holds a block it does not need":
            (lambda: seq.table.block_ids.append(other_block), lambda: seq.table.block_ids.pop()),
        "a cache entry points at a block that does not hold its hash":
            (lambda: a.cached.__setitem__(cached_hash, other_block), lambda: a.cached.__setitem__(cached_hash, cached_block)),
        "a cached block held by a sequence holds other tokens than the sequence's":
            (lambda: a.block_tokens.__setitem__(cached_block, (-1,) * 4),
             lambda: a.block_tokens.__setitem__(cached_block, tuple(range(4)))),
    }
    for what, (corrupt, repair) in corruptions.items():
        corrupt()
        with raises(AssertionError, f"stage 4: check_invariants() must raise AssertionError when {what}"):
            kv.check_invariants()
        repair()
        holds(kv, f"the state is repaired after: {what}")



def test_step19_a_token_appended_before_it_is_known_is_registered_once_set_token_names_it():
    kv = sh.KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, [1, 2, 3], 3)
    slots, _ = kv.append_slots(0, [None])  # async scheduling: the slot of a token its step is still sampling
    assert len(slots) == 1 and kv.num_tokens(0) == 4, "stage 4: a token not known yet (None) still gets its slot"
    assert kv.num_cached_tokens([1, 2, 3, 7, 9]) == 0, \
        "stage 4: a full block whose last token is unknown (None) must not be findable by hash yet"
    kv.set_token(0, 3, 7)
    assert kv.num_cached_tokens([1, 2, 3, 7, 9]) == 4, "stage 4: set_token names the token: the full block becomes findable"
    with raises(ValueError, "stage 4: set_token on a token that is known already must raise ValueError"):
        kv.set_token(0, 3, 8)
    holds(kv, "a token was named by set_token")


def test_step20_truncate_drops_one_reference_per_block_past_the_new_end():
    kv = sh.KVCacheManager(num_blocks=8, block_size=4)
    pool = Pool(kv, 8, 4)
    pool.admit(0, [1, 2, 3, 4, 5, 6])  # blocks [b0 full, b1 holding 2 of 4]
    pool.fork(0, 1)  # n = 2: the fork shares both blocks
    pool.append(1, [7, 8, 9])  # its own copy of b1, then a third block of its own
    own = list(kv.block_ids(1))
    refs = list(kv.allocator.ref_counts)
    dropped = kv.truncate(1, 4)  # speculative decoding's rollback: tokens 4-8 were rejected drafts
    pool.tokens[1] = pool.tokens[1][:4]
    assert dropped == own[1:] and kv.block_ids(1) == own[:1], \
        f"stage 4: truncate(1, 4) keeps the one full block and drops the rest ({own[1:]}), got {dropped}"
    assert [kv.allocator.ref_counts[b] for b in own] == [refs[own[0]], 0, 0], \
        "stage 4: one reference dropped per block past the end: the fork's own blocks are free, the shared full one stays"
    pool.check_reads_own_tokens(0)
    pool.check_reads_own_tokens(1)
    assert kv.num_cached_tokens([1, 2, 3, 4, 9]) == 4, "stage 4: a full block kept by truncate stays findable by hash"
    dropped = kv.truncate(0, 3)  # back into the cached full block b0, which the fork still holds in full
    pool.tokens[0] = pool.tokens[0][:3]
    assert kv.num_cached_tokens([1, 2, 3, 4, 9]) == 0, \
        "stage 4: a cached block kept only partly must leave the cache: its tail is about to be rewritten"
    copies = pool.append(0, [5, 9])  # b0 is shared with the fork: copy-on-write, the fork keeps its tokens
    assert len(copies) == 1 and copies[0][0] == own[0], "stage 4: appending into the shared, now partial block copies it first"
    pool.check_reads_own_tokens(0)
    pool.check_reads_own_tokens(1)
    with raises(ValueError, "stage 4: truncate past the sequence's tokens must raise ValueError"):
        kv.truncate(1, 5)
    holds(kv, "sequences were truncated")
    kv.free(0)
    kv.free(1)
    assert kv.allocator.num_free == 8, "stage 4: truncated sequences, once freed, leak nothing"
