"""GPU sweeps of the stage 5 kernels: every dtype, head_dim, block_size and GQA shape against the
float64 oracle (decode v2 and v3, prefill v1, v2 and v3; v3 / prefill v2 fall back to v2 / v1 outside
16-bit K/V at vLLM's head sizes 64..256, prefill v3 to v2 outside head_dim 64 / 128 on an sm_90
device), bitwise invariance under block placement and batching,
chunked-prefill invariance, and the `cuda` backend end to end. Skips without a GPU."""

import pytest
import torch

from pagedref import kernels
from pagedref.backends import get_backend
from pagedref.backends.metadata import AttentionMetadata
from pagedref.kernels import build, gpu_available
from pagedref.kernels import testing as T

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")]

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def decode(p, **kw):
    return kernels.paged_attention_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, **kw)


def prefill(p, **kw):
    return kernels.paged_prefill(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.query_start_loc,
                                 p.scale, **kw)


def check(out, p, dtype):
    assert torch.isfinite(out).all()
    err = T.max_rel_err(out, T.oracle(p), p)
    assert err <= TOL[dtype], err


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", kernels.SUPPORTED_HEAD_DIMS)
def test_decode_every_head_dim_and_dtype(head_dim, dtype, version):
    p = T.make_problem([1, 100, 513, 1500], num_heads=8, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                       seed=head_dim)
    check(decode(p, out=torch.full_like(p.q, float("nan")), version=version), p, dtype)


PREFILL_VERSIONS = [1, 2, 3]


@pytest.mark.parametrize("version", PREFILL_VERSIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", kernels.SUPPORTED_HEAD_DIMS)
def test_prefill_every_head_dim_and_dtype(head_dim, dtype, version):
    # 150 rows: a full 64-row tile of v2, a partial one and a 16-row warp slice past the chunk.
    p = T.make_problem([20, 150, 33, 200], [20, 150, 1, 70], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                       dtype=dtype, seed=head_dim + 1)
    check(prefill(p, out=torch.full_like(p.q, float("nan")), version=version), p, dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (7, 1), (16, 2)])
@pytest.mark.parametrize("version", PREFILL_VERSIONS)
def test_prefill_grouped_query_shapes(num_heads, num_kv_heads, version):
    p = T.make_problem([300, 45, 130], [300, 7, 64], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=128,
                       dtype=torch.bfloat16, seed=num_heads)
    check(prefill(p, out=torch.full_like(p.q, float("nan")), version=version), p, torch.bfloat16)


@pytest.mark.parametrize("version", PREFILL_VERSIONS)
def test_prefill_long_chunk_over_a_long_context(version):
    # Many key tiles (both cp.async buffers reused many times), a chunk of 700 rows after 2300 cached.
    p = T.make_problem([3000, 64], [700, 64], num_heads=4, num_kv_heads=1, head_dim=128, block_size=32,
                       dtype=torch.float16, seed=21)
    check(prefill(p, out=torch.full_like(p.q, float("nan")), version=version), p, torch.float16)


@pytest.mark.parametrize("block_size", kernels.SUPPORTED_BLOCK_SIZES)
@pytest.mark.parametrize("kernel", ["decode_v1", "decode_v2", "decode_v3", "prefill_v1", "prefill_v2", "prefill_v3"])
def test_every_block_size(block_size, kernel):
    qlens = [9, 1, 40] if kernel.startswith("prefill") else None
    p = T.make_problem([9, 1030, 77], qlens, head_dim=64, block_size=block_size, dtype=torch.bfloat16, seed=block_size)
    run = prefill if kernel.startswith("prefill") else decode
    check(run(p, version=int(kernel[-1])), p, torch.bfloat16)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (7, 1), (16, 2), (32, 2)])
def test_grouped_query_shapes(num_heads, num_kv_heads):
    # group sizes 1, 3, 7, 8 and 16 (two CTAs per KV head: at most 8 query heads per CTA)
    p = T.make_problem([600, 45], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
                       dtype=torch.float16, seed=num_heads)
    check(decode(p), p, torch.float16)
    check(decode(p, version=1), p, torch.float16)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (7, 1), (16, 2), (32, 2)])
def test_grouped_query_shapes_on_the_tensor_cores(num_heads, num_kv_heads):
    # v3 puts a CTA's query heads in the 8 columns of its mmas: 1, 3, 7 or 8 of them used.
    p = T.make_problem([600, 45, 16], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       dtype=torch.bfloat16, seed=num_heads)
    check(decode(p, version=3, out=torch.full_like(p.q, float("nan"))), p, torch.bfloat16)


@pytest.mark.parametrize("name", list(build.CANDIDATES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_candidate_tuning(name, dtype):
    # Each tuning the benchmark times is correct; scheduling knobs (pipeline depth, cp.async or
    # registers, occupancy hint, grid order) change no bit, only partition size and threads per
    # token change the arithmetic.
    tuning = build.CANDIDATES[name]
    p = T.make_problem([1, 500, 1100, 3000], num_heads=8, num_kv_heads=2, head_dim=128, dtype=dtype, seed=17)
    out = decode(p, version=tuning.version, tuning=tuning, out=torch.full_like(p.q, float("nan")))
    check(out, p, dtype)
    if tuning.version == 3:  # the reduce kernel merges (merge_in_kernel and pdl are schedules: same bits)
        same_arithmetic = build.MmaTuning(partition_size=tuning.partition_size, fold=tuning.fold)
    else:
        same_arithmetic = build.DecodeTuning(partition_size=tuning.partition_size,
                                             threads_per_token=tuning.threads_per_token or 8)
    assert T.same_bits(out, decode(p, version=tuning.version, tuning=same_arithmetic))


@pytest.mark.parametrize("version", [2, 3])
def test_very_long_context_many_partitions(version):
    p = T.make_problem([40000, 700], num_heads=8, num_kv_heads=1, head_dim=128, block_size=32,
                       dtype=torch.bfloat16, seed=11)
    check(decode(p, version=version), p, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("version", PREFILL_VERSIONS)
def test_chunked_prefill_is_bitwise_the_unchunked_prefill(version, head_dim):
    # Key tiles start at fixed positions of the sequence, so a row's arithmetic does not depend on
    # how the prompt was cut into chunks: chunking changes no bit on this path either. (v2: a chunk's
    # rows land on other warps and mma rows, and key tiles past a row are skipped or exact no-ops;
    # each row's operations and their order are the same.)
    whole = T.make_problem([300], [300], head_dim=head_dim, dtype=torch.bfloat16, seed=12)
    out = prefill(whole, version=version)
    for cut in (1, 100, 299):
        chunk = T.select(whole, [0])
        chunk.q = whole.q[cut:].contiguous()
        chunk.query_start_loc = torch.tensor([0, 300 - cut], dtype=torch.int32, device="cuda")
        assert T.same_bits(prefill(chunk, version=version), out[cut:])


@pytest.mark.parametrize("block_size", kernels.SUPPORTED_BLOCK_SIZES)
@pytest.mark.parametrize("version", PREFILL_VERSIONS)
def test_prefill_does_not_depend_on_block_placement_or_batch(version, block_size):
    p = T.make_problem([700, 40, 1200, 16, 333], [100, 40, 260, 1, 333], num_heads=8, num_kv_heads=2, head_dim=128,
                       block_size=block_size, dtype=torch.float16, seed=22)
    out = prefill(p, version=version)
    assert T.same_bits(out, prefill(T.permute_blocks(p, seed=23), version=version))
    for seqs in ([2], [4, 0], [3, 1, 2]):
        rows = torch.cat([torch.arange(r.start, r.stop) for r in (T.seq_rows(p, s) for s in seqs)]).cuda()
        assert T.same_bits(prefill(T.select(p, seqs), version=version), out[rows])


@pytest.mark.parametrize("version", [2, 3])
def test_tensor_core_prefill_agrees_with_v1(version):
    # Two kernels, one answer: within the 16-bit rounding of P and of the output.
    p = T.make_problem([500, 90], [500, 30], num_heads=4, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, seed=24)
    ref = prefill(p, version=1).double().cpu().numpy()
    assert T.max_rel_err(prefill(p, version=version), ref, p) <= 1e-2


def test_decode_and_prefill_agree_on_a_single_query_row():
    p = T.make_problem([1500, 20], head_dim=128, dtype=torch.float32, seed=13)
    assert T.max_rel_err(prefill(p), decode(p).double().cpu().numpy(), p) <= 1e-5


@pytest.mark.parametrize("version", [2, 3])
def test_results_do_not_depend_on_the_batch_under_random_subsets(version):
    gen = torch.Generator().manual_seed(14)
    p = T.make_problem(torch.randint(1, 2500, (12,), generator=gen).tolist(), head_dim=128, num_heads=8,
                       num_kv_heads=2, dtype=torch.bfloat16, seed=14)
    full = decode(p, version=version)
    for _ in range(5):
        seqs = torch.randperm(12, generator=gen)[: int(torch.randint(1, 12, (1,), generator=gen))].tolist()
        assert T.same_bits(decode(T.select(p, seqs), version=version), full[torch.tensor(seqs, device="cuda")])


@pytest.mark.parametrize("block_size", kernels.SUPPORTED_BLOCK_SIZES)
def test_tensor_core_decode_does_not_depend_on_block_placement(block_size):
    p = T.make_problem([700, 40, 1200, 16], num_heads=8, num_kv_heads=2, head_dim=128, block_size=block_size,
                       dtype=torch.float16, seed=18)
    assert T.same_bits(decode(p, version=3), decode(T.permute_blocks(p, seed=19), version=3))


def test_a_small_grid_prefetches_and_keeps_the_bits():
    # 32 / 8 heads, 4096 tokens: 32 CTAs a sequence. Up to 4 sequences the grid has at most one CTA per SM of
    # an H200 (132) and runs the prefetch build (build.small_grid_schedule); 5 and more run the plain one.
    # Either way each sequence gets the bits it gets alone and with the rule off, whatever the batch.
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    p = T.make_problem([4096, 4000, 1, 4096, 3000, 2500, 4096, 100], num_heads=32, num_kv_heads=8, head_dim=128,
                       dtype=torch.bfloat16, seed=41)
    off = build.CANDIDATES["v3 mma no small-grid prefetch"]
    full = decode(p)
    check(full, p, torch.bfloat16)
    assert T.same_bits(full, decode(p, tuning=off))
    for seqs in ([0], [3, 1], [6, 0, 4], [1, 2, 3, 0], [7, 6, 5, 4, 3]):
        sub = T.select(p, seqs)
        ctas = 8 * -(-int(sub.context_lens.max()) // build.MmaTuning().partition_size) * len(seqs)
        assert build.small_grid_schedule(build.MmaTuning(), 128, ctas, num_sms).prefetch == (ctas <= num_sms)
        rows = full[torch.tensor(seqs, device="cuda")]
        assert T.same_bits(decode(sub, out=torch.full_like(sub.q, float("nan"))), rows)
        assert T.same_bits(decode(T.permute_blocks(sub, seed=len(seqs)), tuning=off), rows)


# The unfolded tree's (fold=False) schedules of the merge, each the bits of the reduce kernel launched after v3: the
# last partition CTA merges
# (ticket counters), or the reduce kernel is launched as v3's programmatic dependent (PDL, the default: resident
# under v3's last CTAs, it waits for v3), or a CTA computes 2 or 4 of a sequence's partitions in turn and merges
# them itself when they are the whole context (build.span_schedule; spans are capped to 1 where the config has no
# room: 8 heads a CTA, 8-token blocks).
SCHEDULES = {"in kernel": dict(merge_in_kernel=True), "pdl": dict(pdl=True), "span 2": dict(span=2),
             "span 4": dict(span=4), "span 4 pdl": dict(span=4, pdl=True)}


def merged(partition_size: int, schedule: str | None = None) -> build.MmaTuning:  # the unfolded tree (fold=False)
    return build.MmaTuning(partition_size=partition_size,
                           **{"span": 1, "pdl": False, "fold": False, **SCHEDULES.get(schedule, {})})


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("partition_size", [512, 1024, 2048])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,block_size,dtype",
                         [(128, 32, 8, 16, torch.bfloat16), (64, 6, 2, 8, torch.float16), (120, 16, 2, 32, torch.bfloat16),
                          (96, 12, 4, 32, torch.float16)])
def test_merge_schedules_are_bitwise_the_reduce_kernel(schedule, partition_size, head_dim, num_heads, num_kv_heads,
                                                       block_size, dtype):
    # Each schedule merges with the reduce kernel's operations in its order: the reduce kernel's bits,
    # whichever CTA comes last or however early the reduce starts, under any block placement and batch.
    # Contexts: one partition (written directly), exactly one, one token more, a partial last one, 8 and 11
    # partitions (with spans: whole contexts merged in the CTA, partials of full and partial spans merged by
    # the reduce); a second launch gives the same bits (the counters went back to 0).
    P = partition_size
    p = T.make_problem([1, P, P + 1, 3 * P - 5, 7 * P + 100, 40, 11 * P - 3], num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                       seed=P + head_dim)
    two_launch = decode(p, tuning=merged(P))
    check(two_launch, p, dtype)
    fused = merged(P, schedule)
    for _ in range(2):
        assert T.same_bits(decode(p, tuning=fused, out=torch.full_like(p.q, float("nan"))), two_launch)
    assert T.same_bits(decode(T.permute_blocks(p, seed=P), tuning=fused), two_launch)
    for seqs in ([4], [3, 0, 4], [5, 2, 1], [2, 5], [6, 1]):
        assert T.same_bits(decode(T.select(p, seqs), tuning=fused), two_launch[torch.tensor(seqs, device="cuda")])


@pytest.mark.parametrize("partition_size", [512, 1024])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,block_size,dtype",
                         [(128, 32, 8, 16, torch.bfloat16), (96, 12, 4, 32, torch.float16), (256, 16, 2, 16, torch.bfloat16),
                          (80, 8, 2, 16, torch.float16), (112, 8, 8, 32, torch.bfloat16), (64, 8, 2, 16, torch.bfloat16)])
def test_the_folded_tree_gives_the_same_bits_from_a_cta_per_superpartition_or_per_partition(
        partition_size, head_dim, num_heads, num_kv_heads, block_size, dtype):
    # The default tree: each warp's states folded over a superpartition's 4 partitions, in the CTA that computes
    # the whole superpartition (span 4) or by the reduce kernel from one partition a CTA (span 1) or from two a CTA
    # (span 2, raw spans: each partition's warp states written as a CTA of one writes them), with the same
    # operations in the same order: the same bits, launched after v3 or as its programmatic dependent, under any
    # block placement and batch. Contexts: one partition (written directly), a superpartition of 1-4 partitions,
    # one token past a superpartition (its warps 1-3 fold nothing), partial and many superpartitions.
    P = partition_size
    p = T.make_problem([1, P, P + 1, 3 * P - 5, 4 * P, 4 * P + 1, 7 * P + 100, 40, 11 * P - 3, 17 * P + 9],
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                       dtype=dtype, seed=P + head_dim)
    folded = lambda span, pdl=True: build.MmaTuning(partition_size=P, span=span, pdl=pdl)  # noqa: E731
    ref = decode(p, tuning=folded(1, pdl=False), out=torch.full_like(p.q, float("nan")))
    check(ref, p, dtype)
    for t in (folded(4), folded(4, pdl=False), folded(1), folded(None), folded(2), folded(2, pdl=False)):
        assert T.same_bits(decode(p, tuning=t, out=torch.full_like(p.q, float("nan"))), ref)
    for t in (folded(1), folded(4), folded(2)):
        assert T.same_bits(decode(T.permute_blocks(p, seed=P), tuning=t), ref)
        for seqs in ([9], [3, 0, 9], [5, 2, 1], [2, 5], [6, 1, 8]):
            assert T.same_bits(decode(T.select(p, seqs), tuning=t), ref[torch.tensor(seqs, device="cuda")])
    # The unfolded tree is another order of the same sums: other bits, within the same tolerance.
    check(decode(p, tuning=build.MmaTuning(partition_size=P, fold=False)), p, dtype)


def test_the_default_runs_raw_spans_just_past_one_wave_with_the_bits_of_one_partition_a_cta():
    # A grid of one-partition CTAs between 1 and build.RAW_WAVES waves of this GPU's slots: the default launch runs
    # 2 partitions a CTA (span_schedule), whatever the contexts' lengths (odd partition counts, a short one).
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    seqs = num_sms * build.mma_ctas_per_sm(build.MmaTuning(), 128) * 11 // 10 // (8 * 8) + 1  # ~1.1-1.2 waves
    lens = [8 * 1024 - 3 - (i * 1500) % 7000 if i % 3 else 8 * 1024 - 3 for i in range(seqs)]
    p = T.make_problem(lens, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, seed=seqs)
    assert build.span_schedule(build.MmaTuning(), 128, 4, 16, 8 * seqs, 8, num_sms) == build.RAW_SPAN
    ref = decode(p, tuning=build.MmaTuning(span=1))
    check(ref, p, torch.bfloat16)
    assert T.same_bits(decode(p, out=torch.full_like(p.q, float("nan"))), ref)
    assert T.same_bits(decode(T.permute_blocks(p, seed=3)), ref)


def test_the_fold_reduce_merges_superpartitions_over_several_rounds():
    # paged_attention_fold_reduce folds 16 superpartitions a round (4 warps x FOLD_ROUND); past that it takes the
    # largest max first and merges round after round. 71 and 130 partitions of 512 tokens: 18 and 33
    # superpartitions, two and three rounds, beside short contexts; the same bits as a CTA per superpartition.
    P = 512
    p = T.make_problem([70 * P + 3, 5, 130 * P - 7, 2 * P], num_heads=8, num_kv_heads=2, head_dim=128,
                       dtype=torch.bfloat16, seed=71)
    per_partition = decode(p, tuning=build.MmaTuning(partition_size=P, span=1), out=torch.full_like(p.q, float("nan")))
    check(per_partition, p, torch.bfloat16)
    assert T.same_bits(per_partition, decode(p, tuning=build.MmaTuning(partition_size=P, span=4)))
    assert T.same_bits(per_partition[2:3], decode(T.select(p, [2]), tuning=build.MmaTuning(partition_size=P, span=1)))


def test_a_large_grid_spans_partitions_and_keeps_the_bits():
    # 32 / 8 heads, contexts of 2-4 partitions: 64 sequences fill an H200 with a CTA per context (one superpartition
    # folded there: build.span_schedule), a few sequences keep one partition a CTA (the reduce kernel folds). Each
    # sequence gets the same bits either way, alone or in any batch, under any block placement, and the same as
    # with one partition a CTA.
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(42)
    lens = torch.randint(2049, 4097, (64,), generator=gen).tolist()
    p = T.make_problem(lens[:60] + [4096, 1, 1024, 3000], num_heads=32, num_kv_heads=8, head_dim=128,
                       dtype=torch.bfloat16, seed=42)
    per_sm = build.mma_ctas_per_sm(build.MmaTuning(), 128)  # one partition a CTA: 2048 CTAs, this many an SM
    fills = 8 * 64 * 4 >= build.FOLD_WAVES_WHOLE * per_sm * num_sms
    assert build.span_schedule(build.MmaTuning(), 128, 4, 16, 8 * 64, 4, num_sms) == (4 if fills else 1)
    full = decode(p)
    assert T.same_bits(full, decode(p, tuning=build.MmaTuning(span=1)))
    for seqs in ([63], [61, 62, 0], list(range(0, 64, 3)), list(range(60, 64)) + list(range(30))):
        sub = T.select(p, seqs)
        rows = full[torch.tensor(seqs, device="cuda")]
        assert T.same_bits(decode(sub, out=torch.full_like(sub.q, float("nan"))), rows)
    assert T.same_bits(decode(T.permute_blocks(p, seed=43)), full)
    check(full[-4:], T.select(p, [60, 61, 62, 63]), torch.bfloat16)


def test_merge_in_kernel_over_many_partitions():
    # 79 and 40 partitions of 512: the merge's weights pass through shared memory 32 partitions at a time.
    p = T.make_problem([40000, 20000, 700], num_heads=8, num_kv_heads=1, head_dim=128, block_size=32,
                       dtype=torch.bfloat16, seed=32)
    out = decode(p, tuning=merged(512, "in kernel"))
    check(out, p, torch.bfloat16)
    assert T.same_bits(out, decode(p, tuning=merged(512)))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_merge_schedules_replay_in_a_cuda_graph(schedule):
    # A captured launch replays (its counters zero each time; its programmatic dependency captured as a
    # graph edge): new queries and a new block placement copied into the captured buffers give the
    # two-launch kernel's bits on every replay.
    p = T.make_problem([3000, 700, 2100, 5], num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, seed=33)
    out = torch.empty_like(p.q)

    def run():
        decode(p, tuning=merged(1024, schedule), out=out, max_context_len=3000, check=False)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed in range(3):
        moved = T.permute_blocks(p, seed=34 + seed)
        for name in ("k_cache", "v_cache", "block_tables"):
            getattr(p, name).copy_(getattr(moved, name))
        p.q.copy_(torch.randn(p.q.shape, generator=torch.Generator().manual_seed(seed)).to(p.q))
        graph.replay()
        assert T.same_bits(out, decode(p, tuning=merged(1024)))


def metadata(p: T.PagedProblem, slot_mapping: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping, p.query_start_loc, p.context_lens, p.block_tables, p.max_query_len,
                             p.max_context_len, p.k_cache.shape[1])


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 12]])
def test_cuda_backend_writes_then_attends(query_lens):
    # The step's new K/V start out only in k/v: the backend must write them to their slots first.
    p = T.make_problem([50, 300, 12], query_lens, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16, seed=15)
    bt, block_size = p.block_tables.cpu(), p.k_cache.shape[1]
    slots, k_new, v_new = [], [], []
    for s, (ctx, ql) in enumerate(zip(p.context_lens.tolist(), query_lens)):
        for pos in range(ctx - ql, ctx):
            slot = int(bt[s, pos // block_size]) * block_size + pos % block_size
            slots.append(slot)
            k_new.append(p.k_cache.view(-1, 2, 64)[slot].clone())
            v_new.append(p.v_cache.view(-1, 2, 64)[slot].clone())
            p.k_cache.view(-1, 2, 64)[slot] = float("nan")  # the kernel must not read the old slot
            p.v_cache.view(-1, 2, 64)[slot] = float("nan")
    meta = metadata(p, torch.tensor(slots, device="cuda"))
    backend = get_backend("cuda")
    out = backend.forward(p.q, torch.stack(k_new), torch.stack(v_new), (p.k_cache, p.v_cache), meta, p.scale)
    check(out, p, torch.float16)


def test_cuda_backend_copy_blocks():
    pools = [tuple(torch.randn(5, 8, 1, 16, device="cuda", dtype=torch.bfloat16) for _ in "kv") for _ in range(2)]
    expect = [(k.clone(), v.clone()) for k, v in pools]
    get_backend("cuda").copy_blocks(pools, torch.tensor([2]), torch.tensor([0]))
    for k, v in expect:
        k[0], v[0] = k[2], v[2]
    assert all(T.same_bits(a, b) for pa, pb in zip(pools, expect) for a, b in zip(pa, pb))


def test_cuda_backend_refuses_a_bad_slot():
    p = T.make_problem([10], [2], head_dim=16, seed=16)
    meta = metadata(p, torch.tensor([3, 10**6], device="cuda"))
    with pytest.raises(ValueError, match=r"slot_mapping\[1\]"):
        get_backend("cuda").forward(p.q, p.q[:, :2], p.q[:, :2], (p.k_cache, p.v_cache), meta, p.scale)


_STATIC_AND_DYNAMIC = r"""
extern "C" __global__ void fill(float *out, int n_dynamic) {
  __shared__ float fixed[10240];  // 40 KB of static shared memory
  extern __shared__ float dynamic[];
  for (int i = threadIdx.x; i < 10240; i += blockDim.x) fixed[i] = (float)i;
  for (int i = threadIdx.x; i < n_dynamic; i += blockDim.x) dynamic[i] = 1.f;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = fixed[10239] + dynamic[n_dynamic - 1];
}
"""


def test_a_kernel_with_static_and_dynamic_shared_memory_past_48_kb_launches():
    """40 KB static + 16 KB dynamic: neither alone passes 48 KB, together they do, and the driver refuses
    the launch unless the kernel allows 16 KB of dynamic memory (launch.opt_in_shared_memory)."""
    import cupy

    from pagedref.kernels import launch

    kernel = cupy.RawKernel(_STATIC_AND_DYNAMIC, "fill")
    out = cupy.zeros(1, dtype=cupy.float32)
    dynamic = 16 * 1024
    assert kernel.shared_size_bytes == 40 * 1024
    with pytest.raises(cupy.cuda.driver.CUDADriverError):
        kernel((1,), (128,), (out, cupy.int32(dynamic // 4)), shared_mem=dynamic)
        cupy.cuda.Device().synchronize()
    launch.opt_in_shared_memory(kernel, dynamic)
    kernel((1,), (128,), (out, cupy.int32(dynamic // 4)), shared_mem=dynamic)
    assert float(out[0]) == 10240.0
