"""Stage 5, step 2 (CPU): a kernel trusts its indices, so Python checks every one of them first.

A block id past the pool, a context longer than its block-table row or a wrong dtype would not make
a CUDA kernel fail: it would read someone else's memory. The launchers refuse such inputs with an
error that names the argument. The checks run on CPU tensors too, so they are tested here.
"""

import pytest
import torch

from pagedref.course import lesson, raises
from pagedref.kernels import testing as T


def V():
    return lesson("pagedref.kernels.validate")


def K():
    return lesson("pagedref.kernels")


@pytest.fixture
def p():
    return T.make_problem([40, 5, 100], [3, 1, 10], head_dim=16, device="cpu", seed=0)


def check_all(p):
    shape = V().check_attention_args(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens)
    V().check_ranges(shape, p.block_tables, p.context_lens, p.max_context_len, p.query_start_loc,
                     p.q.shape[0], p.max_query_len)


def test_step13_a_well_formed_batch_passes_and_padding_is_never_checked(p):
    assert (p.block_tables == -1).any()  # -1 padding past each sequence's blocks is fine
    check_all(p)


def test_step14_a_block_id_outside_the_pool_is_named(p):
    p.block_tables[2, 3] = p.k_cache.shape[0]
    with raises(ValueError, "stage 5: a block id outside the pool is refused, naming its entry",
                match=r"block_tables\[2, 3\] = \d+ is not a physical block"):
        check_all(p)


def test_step15_a_padding_entry_inside_the_context_is_caught(p):
    p.block_tables[0, 1] = -1  # sequence 0 has 40 tokens: its second block is in use
    with raises(ValueError, "stage 5: a padding entry (-1) inside a sequence's context is refused",
                match=r"block_tables\[0, 1\] = -1"):
        check_all(p)


def test_step16_a_context_longer_than_its_block_table_row(p):
    p.context_lens[1] = p.block_tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match=r"context_lens\[1\]"):
        check_all(p)


def test_step17_wrong_dtypes_are_type_errors_naming_the_argument(p):
    with pytest.raises(TypeError, match="block_tables"):
        V().check_attention_args(p.q, p.k_cache, p.v_cache, p.block_tables.long(), p.context_lens)
    with pytest.raises(TypeError, match="k_cache"):
        V().check_attention_args(p.q, p.k_cache.half(), p.v_cache.half(), p.block_tables, p.context_lens)


def test_step18_shapes_must_agree(p):
    with pytest.raises(ValueError, match="head_dim"):
        V().check_attention_args(p.q[..., :8].contiguous(), p.k_cache, p.v_cache, p.block_tables, p.context_lens)
    with pytest.raises(ValueError, match="num_kv_heads"):
        V().check_attention_args(p.q[:, :3].contiguous(), p.k_cache, p.v_cache, p.block_tables, p.context_lens)
    with pytest.raises(ValueError, match="contiguous"):
        V().check_attention_args(p.q.transpose(0, 1), p.k_cache, p.v_cache, p.block_tables, p.context_lens)


def test_step19_query_rows_must_fit_their_context(p):
    p.query_start_loc[1] = 0  # sequence 0 would have no query rows
    with pytest.raises(ValueError, match="sequence 0"):
        check_all(p)


def test_step20_slots_are_distinct_and_inside_the_pool(p):
    key = torch.randn(2, 2, 16)
    with raises(ValueError, "stage 5: a slot outside the pool is refused", match=r"slot_mapping\[1\]"):
        V().check_cache_write(key, key, p.k_cache, p.v_cache, torch.tensor([0, 10**6]))
    with raises(ValueError, "stage 5: a slot written twice in one step is refused", match="twice"):
        V().check_cache_write(key, key, p.k_cache, p.v_cache, torch.tensor([7, 7]))


def test_step21_a_copy_may_not_read_a_block_another_copy_writes(p):
    caches = [(p.k_cache, p.v_cache)]
    with raises(ValueError, "stage 5: a copy may not read a block another copy writes", match="both a src and a dst"):
        V().check_block_copies(caches, torch.tensor([1, 2]), torch.tensor([2, 3]))
    with raises(ValueError, "stage 5: two copies may not write one block", match="repeats"):
        V().check_block_copies(caches, torch.tensor([1, 2]), torch.tensor([3, 3]))


def test_step22_the_launchers_refuse_cpu_tensors(p):
    with pytest.raises(ValueError, match="CUDA"):
        K().paged_attention_decode(p.q[:3].contiguous(), p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
