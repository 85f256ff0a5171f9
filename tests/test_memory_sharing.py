"""Deeper checks of stage 4: a Hypothesis state machine over KVCacheManager and a numpy KV pool.

Random runs of allocate (chunked prefill), prefill chunks, decode, fork, free and prefix hits
(re-admitting prompts that share prefixes with earlier ones), with pools small enough to run dry.
Every token's K/V is a fixed function of its token id and position, the test performs the
copy-on-write copies that append_slots returns, and after every step it checks, independently of
the manager's own bookkeeping:
- free + used == total;
- every block's ref count == the number of block-table references to it;
- no block is both free and referenced;
- every prefix-cache entry points at a block whose pool content is exactly the hashed tokens, at the
  hashed positions;
- every sequence (forked, prefix-hit or plain) reads exactly its own logical tokens;
and, at the end of each run, that freeing everything leaks nothing. Whether an allocate or an append
fits the pool is worked out from the block tables, not asked of the manager, whose can_allocate,
can_append and blocks_needed must then agree.

Under `--impl PKG` it checks the learner's package (stage 4, over the learner's stages 2 and 3); the
pool is the reference's PagedKVCache, a harness here, not a subject.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedref.course import lesson
from pagedref.memory.block_table import PagedKVCache

from test_memory_block_allocator import AllocatorMachine

ba = lesson("pagedref.memory.block_allocator")
bt = lesson("pagedref.memory.block_table")
sh = lesson("pagedref.memory.sharing")
pytestmark = pytest.mark.stage4
NoFreeBlocksError, FreedSequenceError, MaxModelLenError = ba.NoFreeBlocksError, bt.FreedSequenceError, bt.MaxModelLenError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PrefixCachingAllocatorMachine(AllocatorMachine):
    """Stage 2's allocator machine, over stage 4's PrefixCachingAllocator: the subclass keeps the contract."""

    @staticmethod
    def make(num_blocks: int, block_size: int):
        return sh.PrefixCachingAllocator(num_blocks, block_size)


PrefixCachingAllocatorMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestPrefixCachingAllocatorKeepsTheAllocatorContract = PrefixCachingAllocatorMachine.TestCase

VOCAB = 3  # a tiny vocabulary: random prompts share prefixes often


def token_kv(tokens, start: int) -> tuple[np.ndarray, np.ndarray]:
    """K = (token, position), V = (position, token + 0.5): [n, 1, 2] float64, exact."""
    t = np.asarray(tokens, dtype=np.float64)
    p = np.arange(start, start + len(tokens), dtype=np.float64)
    return np.stack([t, p], -1)[:, None, :], np.stack([p, t + 0.5], -1)[:, None, :]


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 3, 4, 4, 8, 16]), num_blocks=st.integers(3, 48),
                prefix_caching=st.sampled_from([True, True, True, False]), max_model_len=st.sampled_from([None, 16, 48]),
                prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24), chunk=st.integers(1, 24))
    def setup(self, block_size, num_blocks, prefix_caching, max_model_len, prompt, chunk):
        self.bs = block_size
        self.kv = sh.KVCacheManager(num_blocks, block_size, max_model_len, enable_prefix_caching=prefix_caching)
        self.pool = PagedKVCache(num_blocks, block_size, 1, 2, dtype=np.float64)
        self.tokens: dict[int, list[int]] = {}  # live seq -> tokens whose K/V are in the pool
        self.pending: dict[int, list[int]] = {}  # live seq -> prompt tokens not prefilled yet
        self.freed: set[int] = set()
        self.history: list[list[int]] = []  # every prompt and sequence seen: sources of prefix hits
        self.prefixes: dict[int, tuple[int, ...]] = {}  # chained hash -> the whole prefix it stands for
        self.next_id = 0
        self.admit(prompt, chunk)  # every run starts with one request

    # --- helpers ------------------------------------------------------------------------------
    def pick(self, i: int, ready_only: bool = False) -> int:
        live = sorted(s for s in self.tokens if not (ready_only and self.pending[s]))
        return live[i % len(live)]

    def snapshot(self):
        return ({s: list(self.kv.block_ids(s)) for s in self.tokens}, list(self.kv.allocator.ref_counts),
                dict(self.kv.allocator.cached))

    def learn_prefixes(self, tokens: list[int]) -> None:
        parent = None
        for i in range(len(tokens) // self.bs):
            parent = sh.hash_block_tokens(parent, tokens[i * self.bs:(i + 1) * self.bs])
            prefix = tuple(tokens[:(i + 1) * self.bs])
            assert self.prefixes.setdefault(parent, prefix) == prefix, "two different prefixes share a block hash"

    def expected_cached(self, prompt: list[int]) -> int:
        """Tokens a lookup must find: the run of chained hashes present in the cache, stopping one
        token short of the prompt (its last token is always computed)."""
        if not self.kv.enable_prefix_caching:
            return 0
        parent, n = None, 0
        for i in range((len(prompt) - 1) // self.bs):
            parent = sh.hash_block_tokens(parent, prompt[i * self.bs:(i + 1) * self.bs])
            if parent not in self.kv.allocator.cached:
                break
            n += 1
        return n * self.bs

    def references(self) -> list[int]:
        """Each block's block-table references, counted from the tables (not the allocator's counts)."""
        refs = [0] * self.kv.allocator.num_total
        for s in self.tokens:
            for b in self.kv.block_ids(s):
                refs[b] += 1
        return refs

    def free_blocks(self) -> int:
        return sum(1 for r in self.references() if r == 0)

    def cached_blocks(self, prompt: list[int], num_cached: int) -> list[int]:
        """The blocks a lookup of `prompt` finds: its first num_cached // block_size chained hashes."""
        blocks, parent = [], None
        for i in range(num_cached // self.bs):
            parent = sh.hash_block_tokens(parent, prompt[i * self.bs:(i + 1) * self.bs])
            blocks.append(self.kv.allocator.cached[parent])
        return blocks

    def write(self, seq: int, slots: list[int], copies: list[tuple[int, int]], new: list[int]) -> None:
        for src, dst in copies:  # copy-on-write before this step's writes, as the model runner does
            self.pool.k[dst] = self.pool.k[src]
            self.pool.v[dst] = self.pool.v[src]
        self.pool.write(slots, *token_kv(new, len(self.tokens[seq])))
        self.tokens[seq] += new
        self.learn_prefixes(self.tokens[seq])

    def admit(self, prompt: list[int], chunk: int) -> None:
        seq = self.next_id
        self.next_id += 1
        self.history.append(list(prompt))
        expected = self.expected_cached(prompt)
        num_new = min(chunk, len(prompt) - expected)
        before = self.snapshot()
        if self.kv.max_model_len is not None and len(prompt) > self.kv.max_model_len:
            with pytest.raises(MaxModelLenError):
                self.kv.allocate(seq, prompt, num_new)
            assert self.snapshot() == before and seq not in self.kv.seqs, "a refused allocate changed the state"
            return
        fits = self.free_blocks() >= cdiv(expected + num_new, self.bs) - expected // self.bs + sum(
            1 for b in self.cached_blocks(prompt, expected) if not self.references()[b])  # free hits are taken too
        assert self.kv.can_allocate(prompt, num_new) == fits, \
            f"can_allocate must answer {fits}: it counts the new blocks and the free cached hits it would take"
        if not fits:
            with pytest.raises(NoFreeBlocksError):
                self.kv.allocate(seq, prompt, num_new)
            assert self.snapshot() == before and seq not in self.kv.seqs, "a refused allocate changed the state"
            return
        num_cached, slots = self.kv.allocate(seq, prompt, num_new)
        assert num_cached == expected, f"prefix lookup found {num_cached} tokens, the cache holds {expected}"
        self.tokens[seq] = list(prompt[:num_cached])
        self.pending[seq] = list(prompt[num_cached + num_new:])
        self.write(seq, slots, [], prompt[num_cached:num_cached + num_new])

    def append(self, seq: int, new: list[int]) -> bool:
        """Append, or check that a refused append raises the right error and changes nothing."""
        before = self.snapshot()
        if self.kv.max_model_len is not None and len(self.tokens[seq]) + len(new) > self.kv.max_model_len:
            with pytest.raises(MaxModelLenError):
                self.kv.append_slots(seq, new)
            assert self.snapshot() == before, "a refused append changed the state (a half-done copy-on-write?)"
            return False
        ids, n = self.kv.block_ids(seq), len(self.tokens[seq])
        copy = bool(new) and n % self.bs != 0 and self.references()[ids[-1]] > 1  # a shared, partly filled last block
        need = cdiv(n + len(new), self.bs) - len(ids) + copy
        assert self.kv.blocks_needed(seq, len(new)) == need, f"blocks_needed must be {need} (copy-on-write: {copy})"
        assert self.kv.can_append(seq, len(new)) == (need <= self.free_blocks()), "can_append must answer blocks_needed <= free"
        if need > self.free_blocks():
            with pytest.raises(NoFreeBlocksError):
                self.kv.append_slots(seq, new)
            assert self.snapshot() == before, "a refused append changed the state"
            return False
        slots, copies = self.kv.append_slots(seq, new)
        assert len(copies) <= 1 and len(slots) == len(new)
        self.write(seq, slots, copies, new)
        return True

    # --- rules ----------------------------------------------------------------------------------
    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24), chunk=st.integers(1, 24))
    def allocate_new_prompt(self, prompt, chunk):
        self.admit(prompt, chunk)

    @precondition(lambda self: self.history)
    @rule(i=st.integers(0, 10**6), cut=st.integers(1, 64),
          suffix=st.lists(st.integers(0, VOCAB - 1), max_size=6), chunk=st.integers(1, 64))
    def prefix_hit(self, i, cut, suffix, chunk):
        """Re-admit (a prefix of) an earlier prompt or sequence, maybe with a new tail."""
        source = self.history[i % len(self.history)]
        prompt = source[:cut] + suffix
        self.admit(prompt, chunk)

    @precondition(lambda self: any(self.pending.values()))
    @rule(i=st.integers(0, 10**6), n=st.integers(1, 40))
    def prefill_chunk(self, i, n):
        prefilling = sorted(s for s, p in self.pending.items() if p)
        seq = prefilling[i % len(prefilling)]
        chunk = self.pending[seq][:n]
        if self.append(seq, chunk):
            self.pending[seq] = self.pending[seq][len(chunk):]

    @precondition(lambda self: any(not p for p in self.pending.values()))
    @rule(i=st.integers(0, 10**6), token=st.integers(0, VOCAB - 1))
    def decode(self, i, token):
        self.append(self.pick(i, ready_only=True), [token])

    @precondition(lambda self: any(not p for p in self.pending.values()))
    @rule(i=st.integers(0, 10**6))
    def fork(self, i):
        parent = self.pick(i, ready_only=True)
        child = self.next_id
        self.next_id += 1
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.pending[child] = []
        self.history.append(list(self.tokens[parent]))

    @precondition(lambda self: any(not p for p in self.pending.values()))
    @rule(i=st.integers(0, 10**6), cut=st.integers(0, 10**6))
    def truncate(self, i, cut):
        """Speculative decoding's rollback: keep the first tokens, drop the references past them. The
        invariants then check that no cache entry points at a block whose tail is rewritten after."""
        seq = self.pick(i, ready_only=True)
        keep = cut % (len(self.tokens[seq]) + 1)
        ids, refs = list(self.kv.block_ids(seq)), self.references()
        dropped = self.kv.truncate(seq, keep)
        assert dropped == ids[cdiv(keep, self.bs):] and self.kv.block_ids(seq) == ids[:cdiv(keep, self.bs)]
        for b in set(dropped):
            assert self.kv.allocator.ref_count(b) == refs[b] - dropped.count(b), "one reference dropped per block"
        self.tokens[seq] = self.tokens[seq][:keep]

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 10**6))
    def free(self, i):
        seq = self.pick(i)
        self.kv.free(seq)
        del self.tokens[seq], self.pending[seq]
        self.freed.add(seq)

    @precondition(lambda self: self.freed)
    @rule(i=st.integers(0, 10**6))
    def misuse_a_freed_sequence(self, i):
        seq = sorted(self.freed)[i % len(self.freed)]
        before = self.snapshot()
        with pytest.raises(FreedSequenceError):
            self.kv.free(seq)
        with pytest.raises(FreedSequenceError):
            self.kv.fork(seq, self.next_id)
        with pytest.raises(FreedSequenceError):
            self.kv.append_slots(seq, [0])
        assert self.snapshot() == before

    # --- invariants, checked after every step ---------------------------------------------------
    @invariant()
    def blocks_are_counted_exactly(self):
        a = self.kv.allocator
        refs = [0] * a.num_total
        for s in self.tokens:
            ids = self.kv.block_ids(s)
            assert len(ids) == cdiv(len(self.tokens[s]), self.bs), f"seq {s}: table size != ceil(tokens / block_size)"
            assert self.kv.num_tokens(s) == len(self.tokens[s])
            for b in ids:
                refs[b] += 1
        assert a.num_free + a.num_used == a.num_total, "free + used != total"
        for b in range(a.num_total):
            assert a.ref_count(b) == refs[b], f"block {b}: ref count {a.ref_count(b)} != {refs[b]} block-table references"
            assert not (a.is_free(b) and refs[b]), f"block {b} is both free and referenced"

    @invariant()
    def cache_entries_hold_their_tokens(self):
        for h, b in self.kv.allocator.cached.items():
            assert h in self.prefixes, f"cache entry {h} was never the hash of a full block"
            prefix = self.prefixes[h]
            k, v = token_kv(prefix[-self.bs:], len(prefix) - self.bs)
            assert self.pool.k[b].tobytes() == k.tobytes() and self.pool.v[b].tobytes() == v.tobytes(), \
                f"cached block {b} does not hold the tokens its hash stands for"

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for s, toks in self.tokens.items():
            k, v = self.pool.gather(self.kv.block_ids(s), len(toks))
            ek, ev = token_kv(toks, 0)
            assert k.tobytes() == ek.tobytes() and v.tobytes() == ev.tobytes(), f"seq {s} reads K/V that are not its own"

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for s in list(self.tokens):
            self.kv.free(s)
        a = self.kv.allocator
        assert a.num_free == a.num_total and not any(a.ref_counts), "blocks leaked once every sequence was freed"
        self.kv.check_invariants()


KVCacheMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=40, deadline=None)
TestKVCacheManager = KVCacheMachine.TestCase
