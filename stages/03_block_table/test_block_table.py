"""Stage 3 — block tables and the paged KV cache, one lesson step per test, in order.

Run: pytest stages -m stage3 (add --impl PKG to grade your own package).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedref.attention import attention
from pagedref.course import lesson, raises

ba = lesson("pagedref.memory.block_allocator")
bt = lesson("pagedref.memory.block_table")

NUM_KV_HEADS, HEAD_DIM, NUM_HEADS = 2, 4, 4
BLOCK_SIZES = [1, 2, 3, 4, 8, 16, 32]
DTYPES = [np.float16, np.float32, np.float64]


def shuffled_allocator(num_blocks: int, block_size: int, seed: int) -> "ba.BlockAllocator":
    """An allocator whose free list hands blocks out in a random order (not 0, 1, 2, ...)."""
    a = ba.BlockAllocator(num_blocks, block_size)
    blocks = [a.allocate() for _ in range(num_blocks)]
    for b in np.random.default_rng(seed).permutation(blocks):
        a.free(int(b))
    return a


def test_step1_the_table_grows_one_block_at_a_time_only_when_the_last_block_is_full():
    table = bt.BlockTable(ba.BlockAllocator(num_blocks=8, block_size=4))
    for n in range(1, 14):
        before = list(table.block_ids)
        assert table.num_new_blocks(1) == (n % 4 == 1), \
            f"stage 3: num_new_blocks(1) with {n - 1} tokens must be {int(n % 4 == 1)}: a block only when the last one is full"
        table.append_slots(1)
        assert len(table.block_ids) == bt.cdiv(n, 4), f"stage 3: a table holds exactly ceil(num_tokens / block_size) blocks: {n} tokens need {bt.cdiv(n, 4)}, it holds {len(table.block_ids)}"
        grew = len(table.block_ids) > len(before)
        assert grew == (n % 4 == 1), f"stage 3: a new block is taken only when token {n} does not fit the last block"
        assert table.block_ids[:len(before)] == before, "stage 3: growing must not move the blocks already in the table"
    assert table.num_tokens == 13, "stage 3: num_tokens counts the tokens that have a slot"
    assert table.append_slots(0) == [] and table.num_tokens == 13, "stage 3: append_slots(0) is allowed: no slot, no change"


def test_step2_the_slot_mapping_is_physical_block_times_block_size_plus_offset():
    a = shuffled_allocator(num_blocks=8, block_size=4, seed=0)
    table = bt.BlockTable(a)
    slots = table.append_slots(10)
    expected = [table.block_ids[p // 4] * 4 + p % 4 for p in range(10)]
    assert slots == expected, "stage 3: the slot of position p is block_ids[p // block_size] * block_size + p % block_size"
    assert [table.slot(p) for p in range(10)] == expected, "stage 3: slot(p) must agree with the slot mapping"
    for start, end in ((0, 10), (3, 9), (4, 8), (5, 6), (7, 7)):
        assert bt.slot_range(table.block_ids, start, end, 4) == expected[start:end], \
            f"stage 3: slot_range(block_ids, {start}, {end}, block_size) is the slots of positions {start}..{end - 1}"
    with raises(IndexError, "stage 3: slot(10) of a 10-token table must raise IndexError: position 10 has no slot yet"):
        table.slot(10)
    with raises(IndexError, "stage 3: slot(-1) must raise IndexError: positions are 0..num_tokens-1, not counted from the end"):
        table.slot(-1)


def test_step3_a_prefill_gets_the_same_slots_as_the_same_tokens_decoded_one_by_one():
    prefill = bt.BlockTable(shuffled_allocator(16, 4, seed=1))
    decode = bt.BlockTable(shuffled_allocator(16, 4, seed=1))
    chunked = bt.BlockTable(shuffled_allocator(16, 4, seed=1))
    whole = prefill.append_slots(11)
    one_by_one = [s for _ in range(11) for s in decode.append_slots(1)]
    chunks = chunked.append_slots(3) + chunked.append_slots(6) + chunked.append_slots(2)
    assert whole == one_by_one == chunks, "stage 3: the layout must not depend on how the tokens were grouped into steps"


def test_step4_appending_is_all_or_nothing_when_the_pool_runs_dry():
    a = ba.BlockAllocator(num_blocks=3, block_size=4)
    table = bt.BlockTable(a)
    table.append_slots(6)  # 2 blocks
    assert (table.num_new_blocks(7), table.num_new_blocks(2), table.num_new_blocks(0)) == (2, 0, 0), \
        "stage 3: num_new_blocks(n) = ceil((num_tokens + n) / block_size) - the blocks held: 13 tokens need 2 more"
    with raises(ba.NoFreeBlocksError, "stage 3: 13 tokens need 4 blocks, 2 more than the table has, and only 1 is free: "
                "append_slots must raise NoFreeBlocksError"):
        table.append_slots(7)
    assert (table.num_tokens, len(table.block_ids), a.num_free) == (6, 2, 1), \
        "stage 3: a failed append must leave the table and the pool unchanged"
    assert len(table.append_slots(6)) == 6 and a.num_free == 0, "stage 3: an append that fits must still succeed"


def test_step5_a_sequence_cannot_grow_past_max_model_len():
    table = bt.BlockTable(ba.BlockAllocator(num_blocks=8, block_size=4), max_model_len=10)
    table.append_slots(10)
    with raises(bt.MaxModelLenError, "stage 3: growing past max_model_len must raise MaxModelLenError"):
        table.append_slots(1)
    with raises(ValueError, "stage 3: append_slots(-1) must raise ValueError: a negative number of tokens is a caller bug"):
        table.append_slots(-1)
    assert table.num_tokens == 10, "stage 3: refused appends must leave the table unchanged"


def test_step6_free_returns_every_block_and_a_freed_table_refuses_further_use():
    a = ba.BlockAllocator(num_blocks=8, block_size=4)
    table = bt.BlockTable(a)
    table.append_slots(9)
    table.free()
    assert a.num_free == 8 and table.block_ids == [], "stage 3: free() must return every block of the table to the pool"
    with raises(bt.FreedSequenceError, "stage 3: free() twice must raise FreedSequenceError: "
                "it would free blocks that now belong to someone else"):
        table.free()
    with raises(bt.FreedSequenceError, "stage 3: append_slots() after free() must raise FreedSequenceError"):
        table.append_slots(1)
    assert a.num_free == 8, "stage 3: a refused call on a freed table must leave the pool unchanged"


def test_step7_free_returns_the_blocks_last_block_first():
    a = shuffled_allocator(num_blocks=6, block_size=4, seed=3)
    table = bt.BlockTable(a)
    table.append_slots(16)  # 4 blocks, logical order
    blocks = list(table.block_ids)
    table.free()
    reused = [a.allocate() for _ in range(6)][2:]  # the 2 blocks free before come first (stage 2's queue)
    assert reused == blocks[::-1], (
        f"stage 3: free() must return the blocks last block first (the pool hands them out again in the order "
        f"{reused}, the table was {blocks}): under stage 4's LRU prefix cache a sequence's tail is evicted first")


@pytest.mark.parametrize("dtype", DTYPES)
def test_step8_the_pool_returns_exactly_what_was_written_through_the_slot_mapping(dtype):
    rng = np.random.default_rng(2)
    a = shuffled_allocator(num_blocks=6, block_size=4, seed=2)
    cache = bt.PagedKVCache(6, 4, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    assert cache.k.shape == cache.v.shape == (6, 4, NUM_KV_HEADS, HEAD_DIM) and cache.k.dtype == dtype, \
        "stage 3: the pools k and v are [num_blocks, block_size, num_kv_heads, head_dim] arrays of the dtype asked for"
    assert (cache.num_blocks, cache.block_size) == (6, 4), "stage 3: num_blocks and block_size are read from the pool's shape"
    zeros = bt.PagedKVCache(2, 2, 1, 1, dtype=dtype, fill=0.0)
    assert (zeros.k == 0).all() and (zeros.v == 0).all(), "stage 3: fill is the unwritten slots' value, in k and v"
    cache.write([], np.zeros((0, NUM_KV_HEADS, HEAD_DIM), dtype), np.zeros((0, NUM_KV_HEADS, HEAD_DIM), dtype))
    assert np.isnan(cache.k).all(), "stage 3: writing an empty slot mapping writes nothing"
    assert cache.gather([], 0)[0].shape == (0, NUM_KV_HEADS, HEAD_DIM), "stage 3: gathering 0 tokens gives an empty [0, Hkv, d]"
    assert np.isnan(cache.k).all() and np.isnan(cache.v).all(), "stage 3: unwritten slots must hold NaN so a stray read is visible"
    table = bt.BlockTable(a)
    k = rng.standard_normal((9, NUM_KV_HEADS, HEAD_DIM)).astype(dtype)
    v = rng.standard_normal((9, NUM_KV_HEADS, HEAD_DIM)).astype(dtype)
    cache.write(table.append_slots(9), k, v)
    gk, gv = cache.gather(table.block_ids, 9)
    assert gk.tobytes() == k.tobytes() and gv.tobytes() == v.tobytes(), \
        "stage 3: gather(block_ids, n) must return the written K/V, in logical order, bit for bit"
    flat_k = cache.k.reshape(-1, NUM_KV_HEADS, HEAD_DIM)
    assert np.array_equal(flat_k[table.slot(5)], k[5]), "stage 3: token 5 must sit in slot_mapping[5] of the flattened pool"


def _paged_vs_oracle(block_size: int, dtype, seed: int) -> None:
    """Three sequences, prefilled in chunks then decoded, interleaved over one shuffled NaN pool: every
    step's paged attention must equal the oracle on the sequence's contiguous K/V, bit for bit."""
    rng = np.random.default_rng(seed)
    lens = [(7, 4), (1, 6), (12, 3)]  # (prompt, decode steps) per sequence
    num_blocks = sum(bt.cdiv(p + d, block_size) for p, d in lens) + 3  # a few blocks never used (stay NaN)
    alloc = shuffled_allocator(num_blocks, block_size, seed)
    cache = bt.PagedKVCache(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    tables = [bt.BlockTable(alloc) for _ in lens]
    ks = [np.empty((0, NUM_KV_HEADS, HEAD_DIM), dtype) for _ in lens]
    vs = [np.empty((0, NUM_KV_HEADS, HEAD_DIM), dtype) for _ in lens]

    def step(s: int, n: int) -> None:
        k = rng.standard_normal((n, NUM_KV_HEADS, HEAD_DIM)).astype(dtype)
        v = rng.standard_normal((n, NUM_KV_HEADS, HEAD_DIM)).astype(dtype)
        q = rng.standard_normal((n, NUM_HEADS, HEAD_DIM)).astype(dtype)
        cache.write(tables[s].append_slots(n), k, v)
        ks[s], vs[s] = np.concatenate([ks[s], k]), np.concatenate([vs[s], v])
        scale = 0.3 if s == 1 else None  # the scale is passed on (None: 1/sqrt(head_dim))
        out = bt.paged_attention(q, cache, tables[s].block_ids, tables[s].num_tokens, scale=scale)
        ref = attention(q, ks[s], vs[s], scale=scale)
        assert out.dtype == ref.dtype and out.tobytes() == ref.tobytes(), (
            f"stage 3: paged attention of sequence {s} at {tables[s].num_tokens} tokens must equal the oracle bit for bit "
            f"(block_size={block_size}, {np.dtype(dtype).name})")

    for s, (prompt, _) in enumerate(lens):  # chunked prefill: first part, then the rest
        step(s, max(1, prompt // 2))
    for s, (prompt, _) in enumerate(lens):
        if prompt - max(1, prompt // 2):
            step(s, prompt - max(1, prompt // 2))
    for t in range(max(d for _, d in lens)):  # decode steps, interleaved
        for s, (_, decode) in enumerate(lens):
            if t < decode:
                step(s, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_step9_paged_attention_equals_the_oracle_bit_for_bit_for_every_block_size_and_placement(block_size, dtype):
    for seed in range(3):  # three different physical placements of the same logical sequences
        _paged_vs_oracle(block_size, dtype, seed)


def test_step10_a_bad_block_table_is_refused_with_a_clear_error():
    cache = bt.PagedKVCache(4, 4, NUM_KV_HEADS, HEAD_DIM)
    kv = np.zeros((1, NUM_KV_HEADS, HEAD_DIM), np.float32)
    for bad in (9, 4):
        with raises(ba.InvalidBlockError, f"stage 3: gather() through block {bad}, outside the pool of 4 (0..3), must raise InvalidBlockError"):
            cache.gather([0, bad], 6)
    with raises(ba.InvalidBlockError, "stage 3: gather() through block -1 must raise InvalidBlockError, "
                "not read the pool's last block (numpy's negative index)"):
        cache.gather([0, -1], 6)
    with raises(ValueError, "stage 3: gather([0], 6) must raise ValueError: one block of 4 slots cannot hold 6 tokens"):
        cache.gather([0], 6)
    for slot in (16, -1):
        with raises(ba.InvalidBlockError, f"stage 3: write() to slot {slot}, outside the pool's 16 slots, must raise InvalidBlockError"):
            cache.write([slot], kv, kv)
    assert np.isnan(cache.k).all() and np.isnan(cache.v).all(), "stage 3: a refused write must not write anything"


def test_step11_truncate_gives_back_the_blocks_past_the_new_end():
    a = shuffled_allocator(num_blocks=6, block_size=4, seed=5)
    table = bt.BlockTable(a)
    table.append_slots(10)  # blocks for tokens 0-3, 4-7, 8-9
    blocks, free_before = list(table.block_ids), a.num_free
    assert table.truncate(10) == [] and table.block_ids == blocks, "stage 3: truncate(num_tokens) keeps everything"
    dropped = table.truncate(5)  # speculative decoding rolls back: tokens 5-9 were rejected drafts
    assert dropped == blocks[2:] and table.block_ids == blocks[:2] and table.num_tokens == 5, (
        f"stage 3: truncate(5) on 10 tokens of block_size 4 keeps ceil(5 / 4) = 2 blocks and returns the rest "
        f"({blocks[2:]}), got {dropped}: the partly kept block {blocks[1]} stays")
    assert a.num_free == free_before + 1, "stage 3: truncate gives the dropped blocks back to the pool"
    assert table.append_slots(3) == [table.slot(p) for p in range(5, 8)] and table.block_ids == blocks[:2], \
        "stage 3: after truncate, the next tokens go into the kept block's free slots"
    for bad in (-1, 9):
        with raises(ValueError, f"stage 3: truncate({bad}) on a table of 8 tokens must raise ValueError (0..8 only)"):
            table.truncate(bad)
    assert table.num_tokens == 8 and table.block_ids == blocks[:2], "stage 3: a refused truncate changes nothing"
    assert table.truncate(0) == blocks[:2], "stage 3: truncate returns the dropped blocks in logical order"
    assert table.block_ids == [] and a.num_free == 6, "stage 3: truncate(0) returns every block to the pool"
    table.free()
    with raises(bt.FreedSequenceError, "stage 3: truncate() after free() must raise FreedSequenceError"):
        table.truncate(0)
