"""Deeper checks of stage 2: the block allocator against a plain model, step by step (Hypothesis).

The model is a dict of reference counts and a list for the free queue. After every random allocate /
incref / free / take, and every misuse, the allocator must agree with it exactly: the same block
handed out (LRU order), the same counts, the same typed errors, free + used == total, and a block is
free exactly when its count is 0. tests/test_memory_sharing.py runs the same machine over stage 4's
PrefixCachingAllocator, which must keep the contract.

Under `--impl PKG` it checks the learner's package (stage 2).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedref.course import lesson

ba = lesson("pagedref.memory.block_allocator")
pytestmark = pytest.mark.stage2


class AllocatorMachine(RuleBasedStateMachine):
    @staticmethod
    def make(num_blocks: int, block_size: int):
        return ba.BlockAllocator(num_blocks, block_size)

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 16]))
    def setup(self, num_blocks, block_size):
        self.a = self.make(num_blocks, block_size)
        self.n = num_blocks
        self.refs = [0] * num_blocks  # the model
        self.queue = list(range(num_blocks))  # free blocks, longest-free first

    def held(self) -> list[int]:
        return [b for b in range(self.n) if self.refs[b]]

    @rule()
    def allocate(self):
        if not self.queue:
            with pytest.raises(ba.NoFreeBlocksError):
                self.a.allocate()
            return
        b = self.a.allocate()
        assert b == self.queue.pop(0), "allocate() must hand out the block free the longest"
        self.refs[b] = 1

    @precondition(lambda self: any(self.refs))
    @rule(i=st.integers(0, 10**6))
    def incref(self, i):
        b = self.held()[i % len(self.held())]
        self.a.incref(b)
        self.refs[b] += 1

    @precondition(lambda self: any(self.refs))
    @rule(i=st.integers(0, 10**6))
    def free(self, i):
        b = self.held()[i % len(self.held())]
        self.refs[b] -= 1
        went_free = self.refs[b] == 0
        if went_free:
            self.queue.append(b)
        assert self.a.free(b) is went_free, "free() must return True exactly when the block went back to the free list"

    @precondition(lambda self: self.queue)
    @rule(i=st.integers(0, 10**6))
    def take(self, i):
        b = self.queue.pop(i % len(self.queue))
        self.a.take(b)
        self.refs[b] = 1

    @rule(b=st.integers(-2, 14))
    def misuse(self, b):
        """Free / share / take a block in a state that forbids it: a typed error, and nothing changes."""
        before = (list(self.a.ref_counts), self.a.num_free)
        if not 0 <= b < self.n:
            for op in (self.a.free, self.a.incref, self.a.take):
                with pytest.raises(ba.InvalidBlockError):
                    op(b)
        elif self.refs[b] == 0:
            with pytest.raises(ba.DoubleFreeError):
                self.a.free(b)
            with pytest.raises(ba.InvalidBlockError):
                self.a.incref(b)
        else:
            with pytest.raises(ba.InvalidBlockError):
                self.a.take(b)
        assert (list(self.a.ref_counts), self.a.num_free) == before, "a refused operation changed the allocator"

    @invariant()
    def agrees_with_the_model(self):
        a = self.a
        assert a.num_free + a.num_used == a.num_total == self.n, "free + used must equal total"
        assert a.num_free == len(self.queue) and a.num_used == self.n - len(self.queue)
        assert a.num_shared == sum(1 for c in self.refs if c > 1), "num_shared counts blocks with 2+ holders"
        for b in range(self.n):
            assert a.ref_count(b) == self.refs[b], f"block {b}: ref count {a.ref_count(b)}, model {self.refs[b]}"
            assert a.is_free(b) == (self.refs[b] == 0), f"block {b}: free exactly when its count is 0"
        assert list(a.free_list) == self.queue, "free_list holds the free blocks, longest-free first"
        assert list(a.ref_counts) == self.refs, "ref_counts[b] is block b's number of holders"


AllocatorMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)
TestBlockAllocator = AllocatorMachine.TestCase


def test_the_free_list_order_is_the_lru_order_across_a_full_cycle():
    a = ba.BlockAllocator(5, 4)
    blocks = [a.allocate() for _ in range(5)]
    for b in (blocks[4], blocks[1], blocks[3]):
        a.free(b)
    assert [a.allocate() for _ in range(3)] == [blocks[4], blocks[1], blocks[3]]


def test_a_non_integer_block_id_is_refused_not_misread():
    a = ba.BlockAllocator(4, 4)
    with pytest.raises(ba.InvalidBlockError):
        a.free(1.0)
