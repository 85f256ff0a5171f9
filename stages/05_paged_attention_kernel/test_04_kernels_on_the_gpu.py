"""Stage 5, GPU part: the kernels against the float64 oracle, and the invariances they promise.

Each test is one step of the lesson (README.md). They skip cleanly without a GPU and cupy; on the
device machine run them with `PYTHONPATH=$PWD python3 -m pytest stages/05_paged_attention_kernel -m gpu`.
"""

import pytest
import torch

from pagedref.course import lesson
from pagedref.kernels import gpu_available
from pagedref.kernels import testing as T

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")]

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def K():
    return lesson("pagedref.kernels")


def decode(p, **kw):
    return K().paged_attention_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, **kw)


def prefill(p, **kw):
    return K().paged_prefill(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.query_start_loc,
                             p.scale, **kw)


def poisoned(p):
    return torch.full_like(p.q, float("nan"))


# Step 24: the decode kernel computes attention, to float tolerance, writing every output element.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("version", [1, 2])
def test_step24_decode_matches_the_float64_oracle(dtype, version):
    p = T.make_problem([1, 17, 300, 1300], num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seed=1)
    out = decode(p, out=poisoned(p), version=version)
    assert torch.isfinite(out).all(), "some output element was never written (or NaN leaked in)"
    assert T.max_rel_err(out, T.oracle(p), p) <= TOL[dtype]


# Step 25: contexts spanning many partitions are merged correctly by the reduce kernel.
def test_step25_long_context_split_into_partitions():
    ctx = [3 * 512, 3 * 512 + 1, 5000]  # whole partitions, one token over, a ragged tail
    p = T.make_problem(ctx, num_heads=4, num_kv_heads=4, head_dim=128, block_size=32, seed=2)
    out = decode(p, out=poisoned(p))
    assert T.max_rel_err(out, T.oracle(p), p) <= 1e-5


# Step 26: the slots nobody owns hold NaN; a kernel that read one would return NaN.
UNOWNED = "a slot no token owns (past a context, in its last block) reached the output: never read it, not even masked"


def test_step26_nan_in_unused_slots_never_reaches_a_result():
    p = T.make_problem([5, 16, 33], head_dim=32, block_size=16, dtype=torch.bfloat16, spare_blocks=8, seed=3)
    assert torch.isnan(p.k_cache).any() and torch.isnan(p.v_cache).any()
    assert torch.isfinite(decode(p)).all(), UNOWNED
    assert torch.isfinite(prefill(p)).all(), UNOWNED
    # The tensor-core shapes too (head_dim 128: prefill v3 on an H100 / H200, whose key tiles of whole blocks
    # may be copied block by block): contexts ending inside a block, inside a 128-key tile, and on one.
    p = T.make_problem([130, 5, 300, 256], [130, 5, 44, 256], num_heads=8, num_kv_heads=2, head_dim=128,
                       block_size=16, dtype=torch.bfloat16, spare_blocks=8, seed=3)
    assert torch.isfinite(decode(T.make_problem([130, 5, 300, 256], num_heads=8, num_kv_heads=2, head_dim=128,
                                                dtype=torch.bfloat16, spare_blocks=8, seed=3))).all(), UNOWNED
    assert torch.isfinite(prefill(p, out=poisoned(p))).all(), UNOWNED


# Step 27: where the blocks live does not change a single bit.
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_step27_block_placement_does_not_change_a_bit(kernel):
    p = T.make_problem([700, 40, 1200], [1, 7, 30] if kernel == "prefill" else None, head_dim=64,
                       dtype=torch.bfloat16, seed=4)
    run = decode if kernel == "decode" else prefill
    assert T.same_bits(run(p), run(T.permute_blocks(p, seed=5)))


# Step 28: what else is in the batch does not change a single bit (fixed partition size).
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_step28_batch_composition_does_not_change_a_bit(kernel):
    p = T.make_problem([2000, 3, 600, 129], [1, 2, 9, 20] if kernel == "prefill" else None, head_dim=128,
                       num_heads=8, num_kv_heads=2, dtype=torch.float16, seed=6)
    run = decode if kernel == "decode" else prefill
    full = run(p)
    for seqs in ([2], [3, 2], [1, 2, 0]):  # alone, reordered, with a longer neighbour
        sub = run(T.select(p, seqs))
        rows = torch.cat([torch.arange(T.seq_rows(p, s).start, T.seq_rows(p, s).stop) for s in seqs])
        assert T.same_bits(sub, full[rows.to(full.device)])


# Step 29: prefill of query chunks over a cached prefix is causal attention over the whole context.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step29_prefill_matches_the_float64_oracle(dtype):
    p = T.make_problem([37, 300, 64, 1], [37, 45, 1, 1], num_heads=6, num_kv_heads=2, head_dim=80,
                       block_size=8, dtype=dtype, seed=7)
    out = prefill(p, out=poisoned(p))
    assert torch.isfinite(out).all()
    assert T.max_rel_err(out, T.oracle(p), p) <= TOL[dtype]


# Step 30: the pool writes are exact copies: reshape_and_cache scatters, copy_blocks duplicates.
def test_step30_reshape_and_cache_and_copy_blocks_are_exact():
    pools = [(torch.randn(10, 16, 2, 64, device="cuda"), torch.randn(10, 16, 2, 64, device="cuda")) for _ in range(3)]
    expect = [(k.clone(), v.clone()) for k, v in pools]
    key, value = torch.randn(20, 2, 64, device="cuda"), torch.randn(20, 2, 64, device="cuda")
    slots = torch.randperm(160, device="cuda")[:20]
    K().reshape_and_cache(key, value, *pools[1], slots)
    expect[1][0].view(160, 2, 64)[slots], expect[1][1].view(160, 2, 64)[slots] = key, value
    src, dst = torch.tensor([0, 7, 3], device="cuda"), torch.tensor([9, 1, 4], device="cuda")
    K().copy_blocks(pools, src, dst)
    for k, v in expect:
        k[dst], v[dst] = k[src], v[src]
    assert all(T.same_bits(a, b) for pa, pb in zip(pools, expect) for a, b in zip(pa, pb))


# Step 31: a bad block id is refused before any launch, naming the argument.
def test_step31_a_block_id_outside_the_pool_is_refused():
    p = T.make_problem([40, 40], head_dim=16, seed=8)
    p.block_tables[1, 2] = p.k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\]"):
        decode(p)


# Step 32: step 12 on the GPU: v3's folded tree from a CTA per superpartition, a CTA per partition or a CTA per two
# partitions (their warps' states written as two CTAs of one would write them), the same bits.
def test_step32_the_folded_tree_gives_the_same_bits_whichever_ctas_compute_the_partitions():
    build = lesson("pagedref.kernels.build")
    P = 512  # contexts: one partition, a short superpartition, a whole one, one token past it, several and a tail
    p = T.make_problem([1, P + 1, 4 * P, 4 * P + 1, 9 * P + 77], num_heads=8, num_kv_heads=2, head_dim=128,
                       dtype=torch.bfloat16, seed=8)
    per_partition = decode(p, out=poisoned(p), tuning=build.MmaTuning(partition_size=P, span=1))
    assert T.max_rel_err(per_partition, T.oracle(p), p) <= TOL[torch.bfloat16]
    per_superpartition = decode(p, out=poisoned(p), tuning=build.MmaTuning(partition_size=P, span=4))
    assert T.same_bits(per_partition, per_superpartition), (
        "stage 5: one partition a CTA (the fold reduce folding its warps' states) and a CTA per superpartition "
        "(folding in its slab loop) must give the same bits: the same folds in the same order")
    two_a_cta = decode(p, out=poisoned(p), tuning=build.MmaTuning(partition_size=P, span=2))
    assert T.same_bits(per_partition, two_a_cta), (
        "stage 5: a CTA of two partitions (raw spans) must write each partition's warp states exactly as a CTA of "
        "one partition writes them, so the fold reduce folds the same states: the same bits")
