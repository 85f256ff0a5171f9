"""Stage 2 — the block allocator, one lesson step per test, in order.

Run: pytest stages -m stage2 (add --impl PKG to grade your own package).
"""

from __future__ import annotations

import random

import pytest

from pagedref.course import lesson

ba = lesson("pagedref.memory.block_allocator")


def test_step1_a_pool_of_equal_blocks_starts_all_free():
    a = ba.BlockAllocator(num_blocks=8, block_size=4)
    assert a.block_size == 4, "stage 2: the allocator must remember its block_size"
    assert (a.num_total, a.num_free, a.num_used, a.num_shared) == (8, 8, 0, 0), \
        "stage 2: a new pool has every block free: total=8, free=8, used=0, shared=0"
    assert all(a.is_free(b) and a.ref_count(b) == 0 for b in range(8)), "stage 2: every block starts with ref count 0"
    assert ba.BlockAllocator(num_blocks=2).block_size == 16, "stage 2: block_size defaults to 16, as in vLLM"


@pytest.mark.parametrize("num_blocks, block_size, name", [(4, 0, "block_size"), (4, -2, "block_size"),
                                                         (0, 16, "num_blocks"), (4, 2.5, "block_size")])
def test_step2_a_block_size_or_pool_size_that_makes_no_sense_is_refused(num_blocks, block_size, name):
    with pytest.raises(ValueError, match=name):
        ba.BlockAllocator(num_blocks=num_blocks, block_size=block_size)


def test_step3_allocate_hands_out_distinct_blocks_with_ref_count_one():
    a = ba.BlockAllocator(num_blocks=8, block_size=4)
    got = [a.allocate() for _ in range(5)]
    assert len(set(got)) == 5 and all(0 <= b < 8 for b in got), "stage 2: allocate() must return distinct block ids of the pool"
    assert all(a.ref_count(b) == 1 and not a.is_free(b) for b in got), "stage 2: an allocated block has ref count 1"
    assert (a.num_free, a.num_used) == (3, 5), "stage 2: 5 blocks allocated out of 8 -> free=3, used=5"


def test_step4_an_exhausted_pool_raises_a_typed_error_and_changes_nothing():
    a = ba.BlockAllocator(num_blocks=3, block_size=4)
    for _ in range(3):
        a.allocate()
    with pytest.raises(ba.NoFreeBlocksError):
        a.allocate()  # stage 2: the caller (the scheduler) must know to wait or preempt
    assert (a.num_free, a.num_used) == (0, 3), "stage 2: a failed allocate() must not change the counters"


def test_step5_free_returns_a_block_to_the_free_list_when_its_ref_count_reaches_zero():
    a = ba.BlockAllocator(num_blocks=4, block_size=4)
    b = a.allocate()
    assert a.free(b) is True, "stage 2: free() must return True when the block went back to the free list"
    assert a.is_free(b) and a.ref_count(b) == 0, "stage 2: free() must return the block to the free list when its ref count reaches 0"
    assert (a.num_free, a.num_used) == (4, 0), "stage 2: after freeing every block the pool is all free again"


def test_step6_a_shared_block_is_freed_only_by_its_last_holder():
    a = ba.BlockAllocator(num_blocks=4, block_size=4)
    b = a.allocate()
    a.incref(b)
    a.incref(b)
    assert a.ref_count(b) == 3 and a.num_shared == 1, "stage 2: incref() adds a holder; a block with 2+ holders counts as shared"
    assert a.free(b) is False and a.free(b) is False, "stage 2: free() drops one reference and returns False while others remain"
    assert not a.is_free(b) and a.num_used == 1, "stage 2: a block still held by someone must not be on the free list"
    assert a.num_shared == 0, "stage 2: a block with one holder left is no longer shared"
    assert a.free(b) is True and a.is_free(b), "stage 2: the last holder's free() puts the block back"


def test_step7_the_free_list_is_a_queue_the_longest_free_block_is_reused_first():
    a = ba.BlockAllocator(num_blocks=4, block_size=4)
    blocks = [a.allocate() for _ in range(4)]
    order = [blocks[2], blocks[0], blocks[3], blocks[1]]
    for b in order:
        a.free(b)
    assert [a.allocate() for _ in range(4)] == order, \
        "stage 2: allocate() must take the block that has been free the longest (stage 4's prefix cache relies on it)"


def test_step8_take_removes_one_particular_free_block():
    a = ba.BlockAllocator(num_blocks=4, block_size=4)
    a.take(2)
    assert a.ref_count(2) == 1 and not a.is_free(2) and a.num_free == 3, "stage 2: take(b) moves free block b to ref count 1"
    assert 2 not in {a.allocate() for _ in range(3)}, "stage 2: a taken block must not be handed out again by allocate()"
    with pytest.raises(ba.InvalidBlockError):
        a.take(2)  # stage 2: only a free block can be taken


def test_step9_misuse_raises_typed_errors():
    a = ba.BlockAllocator(num_blocks=4, block_size=4)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ba.DoubleFreeError):
        a.free(b)  # stage 2: freeing twice must be caught, not turn the ref count negative
    with pytest.raises(ba.DoubleFreeError):
        a.free(3)  # stage 2: a block nobody holds cannot be freed
    with pytest.raises(ba.InvalidBlockError):
        a.incref(3)  # stage 2: nobody holds block 3, so it cannot be shared
    for bad in (-1, 4, "0"):
        with pytest.raises(ba.InvalidBlockError):
            a.free(bad)  # stage 2: ids outside 0..num_blocks-1 name no block
    for err in (ba.NoFreeBlocksError, ba.DoubleFreeError, ba.InvalidBlockError):
        assert issubclass(err, ba.BlockAllocatorError), f"stage 2: {err.__name__} must derive from BlockAllocatorError"
    assert a.ref_count(3) == 0 and a.num_free == 4, "stage 2: a refused operation must leave the pool unchanged"


def test_step10_the_invariant_holds_through_a_long_random_run():
    rng = random.Random(0)
    a = ba.BlockAllocator(num_blocks=16, block_size=4)
    held: list[int] = []  # one entry per reference we hold
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and a.num_free:
            held.append(a.allocate())
        elif op < 0.6 and held:
            b = rng.choice(held)
            a.incref(b)
            held.append(b)
        elif held:
            a.free(held.pop(rng.randrange(len(held))))
        assert a.num_free + a.num_used == a.num_total, "stage 2: num_free + num_used must always equal num_total"
        for blk in range(16):
            assert a.ref_count(blk) == held.count(blk), f"stage 2: block {blk}'s ref count must equal its number of holders"
            assert a.is_free(blk) == (held.count(blk) == 0), f"stage 2: block {blk} must be free exactly when nobody holds it"
