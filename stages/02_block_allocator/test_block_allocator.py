"""Stage 2 — the block allocator, one lesson step per test, in order.

Run: pytest stages -m stage2 (add --impl PKG to grade your own package).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from pagedref.course import lesson, raises

ba = lesson("pagedref.memory.block_allocator")


class CountingFreeList(OrderedDict):
    """The allocator's free list, counting the entries read by iterating it (a scan)."""

    reads = 0

    def __iter__(self):
        for key in super().__iter__():
            self.reads += 1
            yield key

    def __reversed__(self):
        for key in super().__reversed__():
            self.reads += 1
            yield key

    def keys(self):
        return list(self)

    def values(self):
        return [None for _ in self]

    def items(self):
        return [(key, None) for key in self]


class CountingList(list):
    """The allocator's ref counts, counting the entries read (by index, slice, iteration or search)."""

    reads = 0

    def __getitem__(self, i):
        self.reads += len(range(len(self))[i]) if isinstance(i, slice) else 1
        return super().__getitem__(i)

    def __iter__(self):
        for x in super().__iter__():
            self.reads += 1
            yield x

    def _scan(name):  # noqa: N805  (index, count, `in`: each reads the whole list)
        def method(self, *args):
            self.reads += len(self)
            return getattr(list, name)(self, *args)
        return method

    index, count, __contains__ = _scan("index"), _scan("count"), _scan("__contains__")


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
    with raises(ValueError, f"stage 2: BlockAllocator({num_blocks}, {block_size}) must raise ValueError naming {name}", match=name):
        ba.BlockAllocator(num_blocks=num_blocks, block_size=block_size)
    one = ba.BlockAllocator(num_blocks=1, block_size=1)
    assert (one.num_total, one.block_size) == (1, 1), "stage 2: the smallest pool, 1 block of 1 slot, is a valid pool"


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
    with raises(ba.NoFreeBlocksError, "stage 2: allocate() on an exhausted pool must raise NoFreeBlocksError, so the "
                "caller (the scheduler) knows to wait or preempt; its message names the pool's 3 blocks", match="3"):
        a.allocate()
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


@pytest.mark.parametrize("num_blocks", [64, 4096])
def test_step8_allocate_take_incref_and_free_are_o1_whatever_the_pool_size(num_blocks):
    a = ba.BlockAllocator(num_blocks=num_blocks, block_size=4)
    assert isinstance(a.free_list, OrderedDict) and sorted(a.free_list) == list(range(num_blocks)), \
        "stage 2: free_list must be an OrderedDict of the free blocks (a list's pop(0) and remove() are O(n))"
    assert isinstance(a.ref_counts, list) and a.ref_counts == [0] * num_blocks, \
        "stage 2: ref_counts must be a list with one count per block, all 0 in a new pool"
    a.free_list, a.ref_counts = CountingFreeList(a.free_list), CountingList(a.ref_counts)
    blocks = [a.allocate() for _ in range(num_blocks - 1)]  # every block but one
    (last,) = set(range(num_blocks)) - set(blocks)
    a.take(last)
    shared = blocks[::2]
    for b in shared:
        a.incref(b)
    for b in shared + blocks + [last]:
        a.free(b)
    a.allocate()
    ops = len(blocks) + 1 + 2 * len(shared) + len(blocks) + 1 + 1
    reads = a.free_list.reads + a.ref_counts.reads
    assert reads <= 4 * ops, (
        f"stage 2: allocate, take, incref and free must be O(1), but {ops} of them on a pool of {num_blocks} blocks "
        f"read {reads} entries of free_list and ref_counts: something scans the pool or the free list")


def test_step9_take_removes_one_particular_free_block():
    a = ba.BlockAllocator(num_blocks=4, block_size=4)
    a.take(2)
    assert a.ref_count(2) == 1 and not a.is_free(2) and a.num_free == 3, "stage 2: take(b) moves free block b to ref count 1"
    assert 2 not in {a.allocate() for _ in range(3)}, "stage 2: a taken block must not be handed out again by allocate()"
    with raises(ba.InvalidBlockError, "stage 2: take() of a block that is held must raise InvalidBlockError naming it", match="2"):
        a.take(2)


def test_step10_misuse_raises_typed_errors():
    a = ba.BlockAllocator(num_blocks=4, block_size=4)
    b = a.allocate()
    a.free(b)
    with raises(ba.DoubleFreeError, "stage 2: freeing twice must raise DoubleFreeError naming the block, not turn the "
                "ref count negative", match=str(b)):
        a.free(b)
    with raises(ba.DoubleFreeError, "stage 2: freeing a block nobody holds must raise DoubleFreeError naming it", match="3"):
        a.free(3)
    with raises(ba.InvalidBlockError, "stage 2: incref() of a free block must raise InvalidBlockError naming it: "
                "nobody holds it to share", match="3"):
        a.incref(3)
    for bad in (-1, 4, "0", 1.0):
        for op in (a.free, a.incref, a.take, a.ref_count, a.is_free):
            with raises(ba.InvalidBlockError, f"stage 2: {op.__name__}({bad!r}) must raise InvalidBlockError naming it: "
                        "only the ints 0..num_blocks-1 name a block", match=str(bad)):
                op(bad)
    for err in (ba.NoFreeBlocksError, ba.DoubleFreeError, ba.InvalidBlockError):
        assert issubclass(err, ba.BlockAllocatorError), f"stage 2: {err.__name__} must derive from BlockAllocatorError"
    assert a.ref_count(3) == 0 and a.num_free == 4, "stage 2: a refused operation must leave the pool unchanged"


def test_step11_the_invariant_holds_through_a_long_random_run():
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
        assert set(a.free_list) == {blk for blk in range(16) if blk not in held}, \
            "stage 2: free_list must hold exactly the blocks nobody holds"
