"""Deeper checks of stage 1: the contiguous cache against a model, step by step (Hypothesis).

After every random admit / append / release, the arena must agree with a plain model: first fit picks
the same start, a request is refused exactly when no hole fits, reservations never overlap, the holes
and reservations tile the arena, the accounting adds up, and every request reads back exactly the K/V
it appended.

Under `--impl PKG` it checks the learner's package (stage 1, with stage 3's MaxModelLenError).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedref.attention import attention
from pagedref.course import lesson

contig = lesson("pagedref.memory.contiguous")
pytestmark = pytest.mark.stage1


def token_kv(rid: int, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """K/V of request rid's tokens at positions start..start+n-1: [n, 1, 2] float64, exact."""
    p = np.arange(start, start + n, dtype=np.float64)
    r = np.full(n, rid, dtype=np.float64)
    return np.stack([r, p], -1)[:, None, :], np.stack([p, -r], -1)[:, None, :]


class ContiguousMachine(RuleBasedStateMachine):
    @initialize(num_slots=st.integers(1, 80), max_model_len=st.integers(1, 30))
    def setup(self, num_slots, max_model_len):
        self.c = contig.ContiguousKVCache(num_slots, max_model_len, num_kv_heads=1, head_dim=2, dtype=np.float64)
        self.model: dict[int, list[int]] = {}  # rid -> [start, capacity, num_tokens]
        self.final: dict[int, int] = {}  # rid -> final length (an observer's knowledge)
        self.next_id = 0

    def model_holes(self) -> list[tuple[int, int]]:
        holes, cursor = [], 0
        for start, cap, _ in sorted(self.model.values()):
            if start > cursor:
                holes.append((cursor, start - cursor))
            cursor = start + cap
        if cursor < self.c.num_slots:
            holes.append((cursor, self.c.num_slots - cursor))
        return holes

    def pick(self, i: int) -> int:
        return sorted(self.model)[i % len(self.model)]

    @rule(size=st.one_of(st.none(), st.integers(0, 32)), extra=st.integers(0, 30))
    def admit(self, size, extra):
        rid = self.next_id
        self.next_id += 1
        want = self.c.max_model_len if size is None else size
        if not 1 <= want <= self.c.max_model_len:
            with pytest.raises(contig.MaxModelLenError):
                self.c.admit(rid, size)
            return
        fit = next((s for s, length in self.model_holes() if length >= want), None)
        if fit is None:
            with pytest.raises(contig.NoContiguousSpaceError):
                self.c.admit(rid, size)
            assert rid not in self.c.reservations
            return
        assert self.c.admit(rid, size) == fit, "first fit must pick the lowest hole that fits"
        self.model[rid] = [fit, want, 0]
        self.final[rid] = min(want, 1 + extra)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 10**6), n=st.integers(0, 12), with_kv=st.booleans())
    def append(self, i, n, with_kv):
        rid = self.pick(i)
        start, cap, tokens = self.model[rid]
        k, v = token_kv(rid, tokens, n)
        if tokens + n > cap:
            with pytest.raises(contig.MaxModelLenError):
                self.c.append(rid, k, v)
            return
        slots = self.c.append(rid, k, v) if with_kv else self.c.append(rid, num_tokens=n)
        assert slots == range(start + tokens, start + tokens + n), "new tokens take the next slots of the reservation"
        if not with_kv:  # K/V written separately, at the returned slots, as a model runner would
            self.c.k[slots.start:slots.stop], self.c.v[slots.start:slots.stop] = k, v
        self.model[rid][2] += n

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 10**6))
    def release(self, i):
        rid = self.pick(i)
        self.c.release(rid)
        del self.model[rid], self.final[rid]
        with pytest.raises(KeyError):
            self.c.release(rid)  # twice

    @precondition(lambda self: any(t for _, _, t in self.model.values()))
    @rule(i=st.integers(0, 10**6), seed=st.integers(0, 2**16))
    def attend(self, i, seed):
        rid = sorted(r for r, (_, _, t) in self.model.items() if t)[i % sum(1 for _, _, t in self.model.values() if t)]
        n = self.model[rid][2]
        q = np.random.default_rng(seed).standard_normal((min(n, 3), 2, 2))
        k, v = token_kv(rid, 0, n)
        assert self.c.attention(rid, q).tobytes() == attention(q, k, v).tobytes(), "attention must equal the oracle exactly"

    @invariant()
    def arena_agrees_with_the_model(self):
        assert {r: [x.start, x.capacity, x.num_tokens] for r, x in self.c.reservations.items()} == self.model
        assert self.c.holes() == self.model_holes(), "holes() must list the free stretches in address order"
        spans = sorted((s, s + cap) for s, cap, _ in self.model.values())
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "reservations overlap"
        assert sum(c for _, c, _ in self.model.values()) + sum(h for _, h in self.model_holes()) == self.c.num_slots

    @invariant()
    def accounting_adds_up(self):
        final = {r: max(self.final[r], t) for r, (_, _, t) in self.model.items()}
        u = self.c.usage(final)
        assert u.token_states == sum(t for _, _, t in self.model.values())
        assert u.token_states + u.reserved + u.internal_fragmentation + u.free == u.total, "the parts must tile the arena"
        assert u.external_fragmentation == sum(h for _, h in self.model_holes() if h < self.c.max_model_len)
        assert u.internal_fragmentation == sum(cap - min(final[r], cap) for r, (_, cap, _) in self.model.items())

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for rid, (_, _, n) in self.model.items():
            k, v = self.c.read(rid)
            ek, ev = token_kv(rid, 0, n)
            assert k.tobytes() == ek.tobytes() and v.tobytes() == ev.tobytes(), f"request {rid} reads K/V not its own"


ContiguousMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=30, deadline=None)
TestContiguousKVCache = ContiguousMachine.TestCase


def test_negative_token_counts_are_refused():
    c = contig.ContiguousKVCache(16, 8)
    c.admit(0)
    with pytest.raises(ValueError, match="num_tokens"):
        c.append(0, num_tokens=-1)
    with pytest.raises(ValueError, match="num_tokens"):
        c.append(0)
    assert c.reservations[0].num_tokens == 0
