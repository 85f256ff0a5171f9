"""Deeper checks of stage 3: paged attention equals the oracle bit for bit, whatever the block size,
dtype, physical placement, number of sequences and step schedule (prefill chunks and decodes), and
block tables keep their invariant through random growth, exhaustion and frees (Hypothesis).

Under `--impl PKG` it checks the learner's package (stage 3, over the learner's stage 2 allocator).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedref.attention import attention
from pagedref.course import lesson

ba = lesson("pagedref.memory.block_allocator")
bt = lesson("pagedref.memory.block_table")
pytestmark = pytest.mark.stage3


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

DTYPES = [np.float16, np.float32, np.float64]


@settings(max_examples=500, deadline=None)
@given(block_size=st.sampled_from([1, 2, 3, 4, 5, 8, 16, 32]), dtype=st.sampled_from(DTYPES),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), head_dim=st.sampled_from([1, 4, 8]),
       steps=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9)), min_size=1, max_size=10),
       spare_blocks=st.integers(0, 4), seed=st.integers(0, 2**32 - 1))
def test_paged_attention_is_bit_identical_to_the_oracle(block_size, dtype, heads, head_dim, steps, spare_blocks, seed):
    """steps: (sequence, number of new tokens) in order; unused pool slots are NaN; blocks are handed
    out in a random order."""
    num_heads, num_kv_heads = heads
    rng = np.random.default_rng(seed)
    need = {s: sum(n for t, n in steps if t == s) for s in range(3)}
    num_blocks = sum(cdiv(n, block_size) for n in need.values()) + spare_blocks
    alloc = ba.BlockAllocator(num_blocks, block_size)
    for b in rng.permutation([alloc.allocate() for _ in range(num_blocks)]):
        alloc.free(int(b))  # the free list now hands blocks out in a random order
    cache = bt.PagedKVCache(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    tables = [bt.BlockTable(alloc) for _ in range(3)]
    ks = [np.empty((0, num_kv_heads, head_dim), dtype) for _ in range(3)]
    vs = [np.empty((0, num_kv_heads, head_dim), dtype) for _ in range(3)]
    for s, n in steps:
        k = rng.standard_normal((n, num_kv_heads, head_dim)).astype(dtype)
        v = rng.standard_normal((n, num_kv_heads, head_dim)).astype(dtype)
        q = rng.standard_normal((n, num_heads, head_dim)).astype(dtype)
        cache.write(tables[s].append_slots(n), k, v)
        ks[s], vs[s] = np.concatenate([ks[s], k]), np.concatenate([vs[s], v])
        out = bt.paged_attention(q, cache, tables[s].block_ids, tables[s].num_tokens, scale=0.7)
        assert out.tobytes() == attention(q, ks[s], vs[s], scale=0.7).tobytes()


class BlockTableMachine(RuleBasedStateMachine):
    """Several block tables over one small pool: growth is all or nothing, tables stay minimal, the
    allocator's counts match the tables, and the pool reads back what each table wrote."""

    @initialize(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 3, 4, 8]),
                max_model_len=st.sampled_from([None, 12, 40]))
    def setup(self, num_blocks, block_size, max_model_len):
        self.alloc = ba.BlockAllocator(num_blocks, block_size)
        self.cache = bt.PagedKVCache(num_blocks, block_size, 1, 1, dtype=np.float64)
        self.max_model_len = max_model_len
        self.tables: dict[int, bt.BlockTable] = {}
        self.next_id = 0

    @rule()
    def new_sequence(self):
        self.tables[self.next_id] = bt.BlockTable(self.alloc, self.max_model_len)
        self.next_id += 1

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 10**6), n=st.integers(0, 20))
    def append(self, i, n):
        sid = sorted(self.tables)[i % len(self.tables)]
        t = self.tables[sid]
        before = (list(t.block_ids), t.num_tokens, self.alloc.num_free)
        if self.max_model_len is not None and t.num_tokens + n > self.max_model_len:
            with pytest.raises(bt.MaxModelLenError):
                t.append_slots(n)
        elif cdiv(t.num_tokens + n, self.alloc.block_size) - len(t.block_ids) > self.alloc.num_free:
            with pytest.raises(ba.NoFreeBlocksError):
                t.append_slots(n)
        else:
            start = t.num_tokens
            slots = t.append_slots(n)
            vals = (sid * 1000 + np.arange(start, start + n, dtype=np.float64)).reshape(n, 1, 1)
            self.cache.write(slots, vals, -vals)
            return
        assert (list(t.block_ids), t.num_tokens, self.alloc.num_free) == before, "a refused append changed the table"

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 10**6), cut=st.integers(0, 10**6))
    def truncate(self, i, cut):
        """Shrink a table (speculative decoding's rollback): whole blocks past the new end go back, last first."""
        sid = sorted(self.tables)[i % len(self.tables)]
        t = self.tables[sid]
        keep = cut % (t.num_tokens + 1)
        ids, tail = list(t.block_ids), list(self.alloc.free_list)
        dropped = t.truncate(keep)
        assert dropped == ids[cdiv(keep, self.alloc.block_size):] and t.block_ids == ids[:len(ids) - len(dropped)]
        assert list(self.alloc.free_list) == tail + dropped[::-1], "truncate frees the dropped blocks, last first"
        with pytest.raises(ValueError):
            t.truncate(t.num_tokens + 1)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 10**6))
    def free(self, i):
        sid = sorted(self.tables)[i % len(self.tables)]
        ids = list(self.tables[sid].block_ids)
        self.tables.pop(sid).free()
        assert list(self.alloc.free_list)[len(self.alloc.free_list) - len(ids):] == ids[::-1], \
            "free() must return the blocks last block first (they join the free list's tail in that order)"

    @invariant()
    def tables_and_pool_agree(self):
        held = [b for t in self.tables.values() for b in t.block_ids]
        assert len(held) == len(set(held)), "two tables hold the same block"
        assert self.alloc.num_used == len(held) and self.alloc.num_free + self.alloc.num_used == self.alloc.num_total
        for sid, t in self.tables.items():
            assert len(t.block_ids) == cdiv(t.num_tokens, self.alloc.block_size), "a table holds a block it does not need"
            k, v = self.cache.gather(t.block_ids, t.num_tokens)
            expected = (sid * 1000 + np.arange(t.num_tokens, dtype=np.float64)).reshape(-1, 1, 1)
            assert k.tobytes() == expected.tobytes() and v.tobytes() == (-expected).tobytes()

    def teardown(self):
        for t in getattr(self, "tables", {}).values():
            t.free()
        if hasattr(self, "alloc"):
            assert self.alloc.num_free == self.alloc.num_total, "blocks leaked"


BlockTableMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=30, deadline=None)
TestBlockTables = BlockTableMachine.TestCase
