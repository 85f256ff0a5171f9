"""Stage 5, step 1 (CPU): split-K, the arithmetic of the decode kernel, checked in numpy.

A decode kernel that gave one sequence to one CTA would leave most of the GPU idle on a small
batch with long contexts. Flash-decoding cuts each context into fixed partitions, computes a
partial softmax per partition in parallel, and merges the partials. These tests are the lesson's
claims about that arithmetic, on the CPU, against the oracle.
"""

import numpy as np
import pytest

from pagedref.attention import attend_row
from pagedref.course import lesson


def splitk():
    return lesson("pagedref.kernels.splitk")


def random_row(ctx_len, num_heads=8, num_kv_heads=2, head_dim=32, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((num_heads, head_dim)).astype(dtype)
    k = rng.standard_normal((ctx_len, num_kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((ctx_len, num_kv_heads, head_dim)).astype(dtype)
    return q, k, v, head_dim**-0.5


def test_step1_partitions_tile_the_context_exactly():
    sk = splitk()
    for ctx in (1, 511, 512, 513, 5000):
        spans = sk.partition_bounds(ctx, 512)
        assert len(spans) == sk.num_partitions(ctx, 512) == -(-ctx // 512)
        assert spans[0][0] == 0 and spans[-1][1] == ctx
        assert all(a == prev_b for (a, _), (_, prev_b) in zip(spans[1:], spans))  # no gap, no overlap
        assert all(0 < b - a <= 512 for a, b in spans)


def test_step2_the_partition_size_is_a_constant_not_a_function_of_the_batch():
    # The kernel's partition count for a sequence is computed from its own length and a constant:
    # nothing about the rest of the batch can enter it.
    sk = splitk()
    assert isinstance(sk.PARTITION_SIZE, int) and sk.PARTITION_SIZE % max(sk.SUPPORTED_BLOCK_SIZES) == 0


def test_step3_one_partition_is_the_oracle_bit_for_bit():
    q, k, v, scale = random_row(300)
    assert np.array_equal(splitk().split_k_attend_row(q, k, v, scale, 512), attend_row(q, k, v, scale))


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-6), (np.float64, 1e-13)])
def test_step4_merging_partials_reproduces_attention(dtype, tol):
    q, k, v, scale = random_row(1800, dtype=dtype, seed=1)  # 3 whole partitions and a partial one
    got = splitk().split_k_attend_row(q, k, v, scale, 512)
    ref = attend_row(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= tol


def test_step5_the_merge_reassociates_sums_so_the_bits_differ():
    # Merging adds the same terms in a different grouping ((a+b)+(c+d) instead of ((a+b)+c)+d);
    # float addition is not associative, so the last bits move: close, but not bit-identical.
    # That is why the CUDA path is held to a tolerance against the oracle, never to its bits.
    q, k, v, scale = random_row(1800, seed=2)
    got, ref = splitk().split_k_attend_row(q, k, v, scale, 512), attend_row(q, k, v, scale)
    assert not np.array_equal(got, ref)
    assert np.abs(got - ref).max() <= 1e-6


def test_step6_a_batch_dependent_partition_size_would_change_the_bits():
    # If the partition size were picked from the batch (say, to fill the GPU), the same sequence
    # would be merged differently in different batches, and its output bits would change with
    # its neighbours. A fixed size makes its arithmetic a function of the sequence alone.
    q, k, v, scale = random_row(1800, seed=3)
    sk = splitk()
    assert not np.array_equal(sk.split_k_attend_row(q, k, v, scale, 256), sk.split_k_attend_row(q, k, v, scale, 512)), (
        "stage 5: a sequence's split is the fixed partition size, never one chosen per call or per batch "
        "(256- and 512-token partitions gave the same bits: split_k_attend_row did not cut at the size it was given)")
    assert np.array_equal(sk.split_k_attend_row(q, k, v, scale, 512), sk.split_k_attend_row(q, k, v, scale, 512))


def test_step7_rescaling_by_the_running_max_keeps_huge_logits_finite():
    # Logits of several hundred overflow exp() in float32; each partition subtracts its own max,
    # and the merge rescales by exp(m_p - M) <= 1, so nothing overflows.
    q, k, v, _ = random_row(1500, seed=4)
    got = splitk().split_k_attend_row(q, k, v, 40.0, 512)
    ref = attend_row(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), 40.0)
    assert np.isfinite(got).all() and np.abs(got - ref).max() <= 1e-4


def test_step8_merge_weights_are_the_partition_exp_sums_on_a_common_max():
    sk = splitk()
    q, k, v, scale = random_row(1024, seed=5)
    (m0, l0), (m1, l1) = (sk.softmax_stats(q, k[a:b], scale) for a, b in sk.partition_bounds(1024, 512))
    m, l = sk.softmax_stats(q, k, scale)
    assert np.array_equal(m, np.maximum(m0, m1))  # max is exact: no rounding at all
    np.testing.assert_allclose(l, l0 * np.exp(m0 - m) + l1 * np.exp(m1 - m), rtol=1e-6)


def test_step9_each_cta_serves_a_whole_number_of_query_heads_of_one_kv_head():
    sk = splitk()
    for num_heads, num_kv_heads, expect in ((32, 8, 4), (28, 4, 7), (128, 8, 8), (8, 8, 1), (48, 4, 6)):
        g = sk.heads_per_cta(num_heads, num_kv_heads)
        assert g == expect and (num_heads // num_kv_heads) % g == 0 and g <= sk.MAX_HEADS_PER_CTA


def test_step10_a_v3_partition_is_its_warps_online_softmaxes_merged():
    # v3 gives a partition's 16-key slabs to 4 warps in turn (slab i to warp i % 4), each warp keeping an online
    # softmax over its own slabs; the epilogue merges the warps' states on their common max. In real arithmetic
    # that is the partition's softmax. A warp whose slabs ran out (a short partition) holds nothing and adds nothing.
    sk = splitk()
    for ctx in (16, 40, 64, 200):  # one slab; three, the last short; one a warp; several a warp
        q, k, v, scale = random_row(ctx, dtype=np.float64, seed=ctx)
        states = sk.warp_states(q, k, v, scale)
        busy = [not st.empty for st in states]
        assert len(states) == sk.MMA_WARPS and busy == [w < -(-ctx // sk.SLAB) for w in range(sk.MMA_WARPS)], (
            f"stage 5: slab i (keys 16 i .. 16 i + 15) is warp i % 4's: at {ctx} keys the warps with a slab are "
            f"{[w for w in range(sk.MMA_WARPS) if w < -(-ctx // sk.SLAB)]}, got {[w for w, b in enumerate(busy) if b]}")
        for w, st in enumerate(states):  # each warp's max is the largest logit of its own slabs' keys (exact)
            keys = [t for t in range(ctx) if t // sk.SLAB % sk.MMA_WARPS == w]
            assert not keys or np.array_equal(st.m, sk.softmax_stats(q, k[keys], scale)[0]), (
                f"stage 5: slab i (keys 16 i .. 16 i + 15) is warp i % 4's: warp {w}'s max at {ctx} keys is not the "
                f"largest logit of slabs {w}, {w + 4}, ...")
        o, m, l = sk.merge_warps(states)
        m_ref, l_ref = sk.softmax_stats(q, k, scale)
        assert np.array_equal(m, m_ref), "stage 5: the merged max is the partition's largest logit (a max is exact)"
        o_ref = attend_row(q, k, v, scale)
        exact = np.allclose(l, l_ref, rtol=1e-13, atol=0) and np.allclose(o, o_ref, rtol=0, atol=1e-13)
        assert exact, (
            "stage 5: the warps' states, each rescaled by exp(m_w - m) to the common max and added, are the "
            "partition's exp-sum and p.V")


def test_step11_the_folded_tree_is_attention_in_real_arithmetic_and_other_bits_than_the_plain_tree():
    # v3's default tree groups a sequence's partitions in superpartitions of FOLD_SPAN (4): each warp's state of
    # each partition is folded into its state of the partitions before (new max, both sides rescaled, added), then
    # the warps are merged, then the superpartitions as v2 merges partitions. fold_span=1 is the tree before it.
    # Both are exact in real arithmetic; in float32 they group the same terms differently, so the bits differ:
    # the tree is part of the contract, fixed by the library like the partition size, never by the batch.
    sk = splitk()
    q, k, v, scale = random_row(1000, seed=6)  # 16 partitions of 64 keys: 4 superpartitions
    ref = attend_row(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale)
    for fold_span in (1, sk.FOLD_SPAN):
        exact = sk.folded_attend_row(*(x.astype(np.float64) for x in (q, k, v)), scale, 64, fold_span)
        assert np.abs(exact - ref).max() <= 1e-13, (
            f"stage 5: the tree of superpartitions of {fold_span} is attention in real arithmetic")
    folded, plain = (sk.folded_attend_row(q, k, v, scale, 64, f) for f in (sk.FOLD_SPAN, 1))
    assert np.abs(folded - plain).max() <= 1e-6, (
        "stage 5: in float32 the two trees differ only by rounding (both are attention): one of them is not")
    assert not np.array_equal(folded, plain), (
        "stage 5: the folded tree associates the sums differently from the partition-by-partition one "
        "(fold_span 4 and 1 gave the same bits: the warps' states were not folded over the superpartition)")


def test_step12_one_partition_a_cta_then_the_fold_reduce_gives_the_superpartition_ctas_bits():
    # A few long sequences fill the GPU better with one partition a CTA: each CTA then writes its warps' states
    # as they are, and the fold reduce folds them, partition by partition in order, before it merges the warps:
    # the very folds a superpartition's CTA does as each partition ends. So the launcher may pick either from the
    # batch (build.span_schedule) and no bit moves.
    sk = splitk()
    for ctx in (64, 300, 1000, 1100):  # one partition; a whole superpartition and a short one; whole ones; a 1-slab end
        q, k, v, scale = random_row(ctx, seed=ctx)
        assert np.array_equal(sk.folded_attend_row(q, k, v, scale, 64, span=sk.FOLD_SPAN),
                              sk.folded_attend_row(q, k, v, scale, 64, span=1)), (
            f"stage 5: one partition a CTA, folded afterwards, must give a superpartition CTA's bits ({ctx} keys): "
            "fold each warp's states in partition order, then merge the warps, as the superpartition's CTA does")
