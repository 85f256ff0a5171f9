"""Deeper checks of stage 2: the block allocator against a plain model, step by step (Hypothesis).

The model is a dict of reference counts and a list for the free queue. After every random allocate /
incref / free / take, and every misuse, the allocator must agree with it exactly: the same block
handed out (LRU order), the same counts, the same typed errors, free + used == total, and a block is
free exactly when its count is 0.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedref.memory.block_allocator import (BlockAllocator, DoubleFreeError, InvalidBlockError,
                                             NoFreeBlocksError)
from pagedref.memory.sharing import PrefixCachingAllocator


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 16]),
                prefix_caching=st.booleans())
    def setup(self, num_blocks, block_size, prefix_caching):
        cls = PrefixCachingAllocator if prefix_caching else BlockAllocator  # the subclass must keep the contract
        self.a = cls(num_blocks, block_size)
        self.n = num_blocks
        self.refs = [0] * num_blocks  # the model
        self.queue = list(range(num_blocks))  # free blocks, longest-free first

    def held(self) -> list[int]:
        return [b for b in range(self.n) if self.refs[b]]

    @rule()
    def allocate(self):
        if not self.queue:
            with pytest.raises(NoFreeBlocksError):
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
                with pytest.raises(InvalidBlockError):
                    op(b)
        elif self.refs[b] == 0:
            with pytest.raises(DoubleFreeError):
                self.a.free(b)
            with pytest.raises(InvalidBlockError):
                self.a.incref(b)
        else:
            with pytest.raises(InvalidBlockError):
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


AllocatorMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)
TestBlockAllocator = AllocatorMachine.TestCase


def test_the_free_list_order_is_the_lru_order_across_a_full_cycle():
    a = BlockAllocator(5, 4)
    blocks = [a.allocate() for _ in range(5)]
    for b in (blocks[4], blocks[1], blocks[3]):
        a.free(b)
    assert [a.allocate() for _ in range(3)] == [blocks[4], blocks[1], blocks[3]]


def test_a_non_integer_block_id_is_refused_not_misread():
    a = BlockAllocator(4, 4)
    with pytest.raises(InvalidBlockError, match="outside"):
        a.free(1.0)
