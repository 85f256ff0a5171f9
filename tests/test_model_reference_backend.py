"""The reference attention backend against the numpy oracle, bit for bit, through shuffled block tables.

Each sequence's blocks are scattered over a pool whose every slot starts as NaN; a prefix is written
in one step and the rest of the context in the next (a chunked prefill, or decode after a cached
prefix), several sequences per step. Every output row must equal `pagedref.attention.attention` on
that sequence's contiguous K/V exactly: a slot read that should not be would bring a NaN in.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import build_metadata
from pagedref.attention import attention
from pagedref.backends import get_backend
from pagedref.backends.reference import ReferenceBackend

DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int) -> torch.Tensor:
    """pagedref.attention.attention in numpy (bfloat16, which numpy lacks, goes through float32 exactly)."""
    as_np = lambda t: (t.float() if t.dtype == torch.bfloat16 else t).numpy()  # noqa: E731
    out = attention(as_np(q), as_np(k), as_np(v), scale=scale, q_start=q_start)
    return torch.from_numpy(out).to(q.dtype)


def run_two_steps(block_size, num_kv_heads, group, head_dim, dtype, seqs, seed):
    """seqs: [(prefix_len, query_len)]. Step 1 computes every prefix, step 2 the query tokens after it.
    Asserts each step's output equals the oracle bitwise."""
    gen = torch.Generator().manual_seed(seed)
    heads = num_kv_heads * group
    scale = head_dim**-0.5
    lens = [p + n for p, n in seqs]
    q_all = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for n in lens]
    k_all = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    v_all = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [pool[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(seqs))]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = (torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
    backend = ReferenceBackend()
    for step in ("prefix", "rest"):
        chunks = [list(range(0, p)) if step == "prefix" else list(range(p, p + n)) for p, n in seqs]
        live = [i for i, c in enumerate(chunks) if c]
        if not live:
            continue
        meta = build_metadata([tables[i] for i in live], [chunks[i] for i in live], block_size)
        pick = lambda xs: torch.cat([xs[i][chunks[i][0] : chunks[i][-1] + 1] for i in live])  # noqa: E731
        out = backend.forward(pick(q_all), pick(k_all), pick(v_all), kv_cache, meta, scale)
        assert out.dtype == dtype and out.shape == (sum(len(chunks[i]) for i in live), heads, head_dim)
        rows = out.split([len(chunks[i]) for i in live])
        for i, got in zip(live, rows):
            ctx = chunks[i][-1] + 1
            want = oracle(q_all[i][chunks[i][0] : ctx], k_all[i][:ctx], v_all[i][:ctx], scale, q_start=chunks[i][0])
            assert torch.equal(got, want), (step, i)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "block_size, num_kv_heads, group, head_dim",
    [(1, 1, 1, 8), (4, 2, 2, 16), (16, 2, 4, 64), (3, 4, 1, 32), (16, 1, 2, 128)],
)
def test_backend_equals_oracle_bitwise(block_size, num_kv_heads, group, head_dim, dtype):
    seqs = [(0, 9), (17, 1), (5, 12), (32, 3), (0, 1)]  # prefill, decode, chunk after a prefix, ...
    run_two_steps(block_size, num_kv_heads, group, head_dim, DTYPES[dtype], seqs, seed=block_size + head_dim)


@settings(max_examples=100, deadline=None)
@given(
    block_size=st.integers(1, 8),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 8, 16]),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    seqs=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 10)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_backend_equals_oracle_bitwise_any_layout(block_size, num_kv_heads, group, head_dim, dtype, seqs, seed):
    run_two_steps(block_size, num_kv_heads, group, head_dim, DTYPES[dtype], seqs, seed)


def test_get_backend_reference():
    assert isinstance(get_backend("reference"), ReferenceBackend)


def small_step(block_table: list[int], num_blocks: int = 4, block_size: int = 4, dtype=torch.float32):
    """One sequence prefilling 6 tokens with the given block table; returns the forward's arguments."""
    shape = (num_blocks, block_size, 1, 8)
    kv_cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    q, k, v = torch.randn(6, 2, 8), torch.randn(6, 1, 8), torch.randn(6, 1, 8)
    meta = build_metadata([[0, 1]], [list(range(6))], block_size)  # writes go to blocks 0 and 1
    meta.block_tables = torch.tensor([block_table], dtype=torch.int32)  # reads through the table under test
    return q, k, v, kv_cache, meta


@pytest.mark.parametrize("bad", [4, 99, -1])
def test_block_id_outside_the_pool_is_refused(bad):
    q, k, v, kv_cache, meta = small_step([0, bad])
    with pytest.raises(ValueError, match=f"block table of sequence 0 points at block {bad} outside the pool of 4 blocks"):
        ReferenceBackend().forward(q, k, v, kv_cache, meta, 1.0)


def test_block_table_too_short_is_refused():
    q, k, v, kv_cache, meta = small_step([0])
    with pytest.raises(ValueError, match="sequence 0 has 6 tokens \\(2 blocks\\) but its block table has 1 entries"):
        ReferenceBackend().forward(q, k, v, kv_cache, meta, 1.0)


def test_slot_outside_the_pool_is_refused():
    q, k, v, kv_cache, meta = small_step([0, 1])
    meta.slot_mapping[3] = 16  # the pool has 4 blocks of 4 slots
    with pytest.raises(ValueError, match="slot 16 is outside the pool of 16 slots"):
        ReferenceBackend().forward(q, k, v, kv_cache, meta, 1.0)


def test_cache_dtype_must_match_the_model():
    q, k, v, kv_cache, meta = small_step([0, 1], dtype=torch.float16)
    with pytest.raises(ValueError, match="KV cache dtype torch.float16 != the model's key dtype torch.float32"):
        ReferenceBackend().forward(q, k, v, kv_cache, meta, 1.0)


def test_copy_blocks_copies_whole_blocks_in_every_layer():
    gen = torch.Generator().manual_seed(0)
    kv_caches = [tuple(torch.randn(6, 4, 2, 8, generator=gen) for _ in range(2)) for _ in range(3)]
    before = [tuple(t.clone() for t in layer) for layer in kv_caches]
    ReferenceBackend().copy_blocks(kv_caches, torch.tensor([0, 3]), torch.tensor([5, 1]))
    for (k, v), (k0, v0) in zip(kv_caches, before):
        for now, old in ((k, k0), (v, v0)):
            assert torch.equal(now[5], old[0]) and torch.equal(now[1], old[3])
            assert torch.equal(now[[0, 2, 3, 4]], old[[0, 2, 3, 4]])


def test_copy_blocks_refuses_blocks_outside_the_pool():
    kv_caches = [(torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8))]
    with pytest.raises(ValueError, match="copy_blocks destination block 6 is outside the pool of 6 blocks"):
        ReferenceBackend().copy_blocks(kv_caches, torch.tensor([0]), torch.tensor([6]))
    with pytest.raises(ValueError, match="equal length"):
        ReferenceBackend().copy_blocks(kv_caches, torch.tensor([0, 1]), torch.tensor([2]))
