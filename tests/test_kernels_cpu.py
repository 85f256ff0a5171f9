"""CPU checks of the kernel package: split-K arithmetic under Hypothesis, the launch-shape rules,
the compile configurations, the argument checks and the test helpers (no GPU, no cupy needed)."""

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedref.attention import attend_row
from pagedref.backends import get_backend
from pagedref.backends.metadata import AttentionMetadata
from pagedref.kernels import build, splitk, validate
from pagedref.kernels import testing as T


@settings(max_examples=40, deadline=None)
@given(ctx=st.integers(1, 3000), partition=st.sampled_from([16, 64, 256, 512, 1024]),
       group=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**31))
def test_split_k_equals_attention_in_float64(ctx, partition, group, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2 * group, 8))
    k, v = rng.standard_normal((ctx, 2, 8)), rng.standard_normal((ctx, 2, 8))
    got = splitk.split_k_attend_row(q, k, v, 0.35, partition)
    ref = attend_row(q, k, v, 0.35)
    assert np.abs(got - ref).max() <= 1e-12 * max(1.0, np.abs(ref).max())


@settings(deadline=None)
@given(ctx=st.integers(0, 10**5), partition=st.integers(8, 4096))
def test_partition_bounds_cover_the_context(ctx, partition):
    spans = splitk.partition_bounds(ctx, partition)
    assert sum(b - a for a, b in spans) == ctx and len(spans) == splitk.num_partitions(ctx, partition)
    assert all(b - a == partition for a, b in spans[:-1])


def test_partition_arithmetic_rejects_nonsense():
    with pytest.raises(ValueError, match="partition_size"):
        splitk.num_partitions(10, 0)
    with pytest.raises(ValueError, match="context_len"):
        splitk.num_partitions(-1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        splitk.heads_per_cta(6, 4)


def test_the_folded_tree_model_refuses_what_the_kernel_cannot_be():
    q, k = np.zeros((4, 8), np.float32), np.zeros((100, 2, 8), np.float32)
    with pytest.raises(ValueError, match="multiple of 64"):  # a warp's slabs would straddle partitions
        splitk.folded_attend_row(q, k, k, 1.0, partition_size=96)
    with pytest.raises(ValueError, match="fold_span"):
        splitk.folded_attend_row(q, k, k, 1.0, 64, fold_span=0)
    with pytest.raises(ValueError, match="span is a CTA's partitions"):
        splitk.folded_attend_row(q, k, k, 1.0, 64, span=2)
    with pytest.raises(ValueError, match="at least one key"):
        splitk.folded_attend_row(q, k[:0], k[:0], 1.0, 64)


def test_the_folded_tree_of_one_slab_is_that_slabs_softmax():
    # One key, one slab, one warp: the other warps hold nothing, and the merge adds nothing for them.
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((4, 8)), rng.standard_normal((1, 2, 8)), rng.standard_normal((1, 2, 8))
    out = splitk.folded_attend_row(q, k, v, 0.5, 64)
    assert np.array_equal(out, np.repeat(v[0], 2, axis=0))  # softmax over one key is 1: the output is its value


@pytest.mark.parametrize("elem_size", [2, 4])
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", splitk.SUPPORTED_HEAD_DIMS)
def test_threads_per_token_rule(head_dim, heads, elem_size):
    tpt = splitk.threads_per_token(head_dim, elem_size, heads)
    assert tpt & (tpt - 1) == 0 and 1 <= tpt <= 32
    assert tpt <= max(1, head_dim * elem_size // 16) * 2  # never more threads than 16-byte slices, rounded up
    per_thread = -(-head_dim // (tpt * (16 // elem_size))) * (16 // elem_size)
    assert per_thread <= max(16, 16 // elem_size)  # bounded registers per thread
    assert splitk.min_ctas_per_sm(elem_size, heads) in (1, 4)


def test_the_launchers_constants_are_the_kernels():
    # A constant the launcher and the CUDA sources share, written in both: the CTA's thread count (the launcher's
    # grids count warps from it).
    import re

    cuda = build.CUDA_DIR
    assert re.search(r"constexpr int NUM_THREADS = (\d+);", (cuda / "common.cuh").read_text())[1] == str(splitk.NUM_THREADS)


def test_kernel_configs_are_distinct_and_their_sources_exist():
    configs = build.ci_configs()
    assert len(set(configs)) == len(configs)
    assert all(c.source.is_file() for c in configs)
    files = {c.file for c in configs}
    assert files == {p.name for p in build.CUDA_DIR.glob("*.cu")}  # CI compiles every kernel file
    opts = build.decode_config("bfloat16", 128, 16, 4).options()
    assert "-DHEAD_DIM=128" in opts and "-DPR_DTYPE=2" in opts and opts[0] == "-std=c++17"


def test_ci_config_listing_is_what_the_compile_script_reads():
    out = subprocess.run([sys.executable, "-c", "from pagedref.kernels.build import print_ci_configs; print_ci_configs()"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == len(build.ci_configs())
    words = [line.split() for line in out]  # FILE [-arch=TARGET] -D...: a target only where the config names one
    archs = [w[1] if w[1:] and w[1].startswith("-arch=") else None for w in words]
    assert all(w[0].endswith(".cu") and all(x.startswith("-D") for x in w[1 + bool(a):]) for w, a in zip(words, archs))
    assert archs == [c.arch and f"-arch={c.arch}" for c in build.ci_configs()]


def test_candidate_tunings_differ_only_in_scheduling_or_stated_arithmetic():
    assert build.CANDIDATES["default"] == build.MmaTuning()
    assert all(t.partition_size % 32 == 0 for t in build.CANDIDATES.values())


def test_pdl_is_a_compile_time_knob_of_v3_on_by_default():
    # The default launches the reduce as v3's programmatic dependent (PDL=1; the launcher drops it below sm_90);
    # off, the config is exactly what it was before (the same module, the same binary).
    assert ("PDL", 1) in build.mma_decode_config("bfloat16", 128, 16, 4).defines
    assert "PDL" not in dict(build.mma_decode_config("bfloat16", 128, 16, 4, build.MmaTuning(pdl=False)).defines)


def test_the_folded_tree_takes_a_cta_per_superpartition_where_the_grid_stays_large():
    # The default tree folds partitions into superpartitions of MAX_SPAN (4): a CTA computes a whole one (its warps
    # fold in the slab loop: no partials, no slots) where one partition a CTA would be a grid of FOLD_WAVES waves
    # (FOLD_WAVES_WHOLE where one superpartition holds every context: no reduce after it), otherwise one partition a
    # CTA and the reduce kernel folds (more CTAs for a few long sequences). The same bits either way. (Raw spans,
    # the next test, take a band of these grids.)
    rule = lambda seqs, parts, **kw: build.span_schedule(  # noqa: E731
        build.MmaTuning(raw_span=False, **kw), 128, 4, 16, 8 * seqs, parts, 132)
    assert build.MmaTuning().fold and build.MAX_SPAN == 4
    assert rule(64, 4) == rule(64, 3) == rule(8, 32) == rule(32, 8) == 4  # 512 / 512 / 512 / 512 CTAs
    assert rule(1, 128) == rule(16, 8) == 4  # 1024 one-partition CTAs: 1.94 waves of 528
    assert rule(8, 4) == rule(1, 4) == rule(1, 16) == rule(4, 16) == 1  # 256, 32, 128, 512 CTAs: a CTA per partition
    # Whole contexts: superpartitions from 1.2 waves of one-partition CTAs (640, 672 of 528 a wave), not below.
    assert rule(20, 4) == rule(28, 3) == 4 and rule(16, 4) == rule(24, 3) == rule(20, 3) == 1
    assert rule(5, 16) == rule(6, 13) == rule(3, 32) == rule(7, 16) == 1  # 640-896 CTAs, a reduce after either
    assert rule(256, 1) == 1  # one partition: nothing to fold
    assert rule(1, 4, span=4) == 4 and rule(64, 4, span=1) == 1 and rule(64, 4, span=2) == 1  # forced: 1 or 4
    # Where the loop's fold would spill (or a slab spans blocks, or more than 4 heads a CTA): one partition a CTA.
    for head_dim in build.FOLD_SPILLS:
        assert build.span_schedule(build.MmaTuning(), head_dim, 4, 16, 8 * 64, 4, 132) == 1
    assert build.span_schedule(build.MmaTuning(span=4), 128, 8, 16, 8 * 64, 4, 132) == 1
    assert build.span_schedule(build.MmaTuning(span=4), 128, 4, 8, 8 * 64, 4, 132) == 1
    # One state slot whatever the span (11 KB of shared memory at head_dim 128, where the unfolded span took 35.5).
    four = build.mma_decode_config("bfloat16", 128, 16, 4)
    assert dict(four.defines)["SPAN_SLOTS"] == 4 and dict(four.defines)["SPAN_FOLD"] == 1
    one = build.span_build(build.MmaTuning(), 1)
    assert dict(build.mma_decode_config("bfloat16", 128, 16, 4, one).defines)["SPAN_SLOTS"] == 1
    assert {build.mma_decode_config(d, h, 16, 4, t) for d in ("float16", "bfloat16") for h in splitk.MMA_HEAD_DIMS
            for t in (one, build.MmaTuning())} <= set(build.ci_configs())
    with pytest.raises(ValueError, match="fold=False"):
        build.mma_decode_config("bfloat16", 128, 16, 4, build.MmaTuning(merge_in_kernel=True))


def test_raw_spans_take_the_grids_whose_second_wave_would_be_at_most_half_full():
    # The default (raw_span=True): where one partition a CTA would run more than one wave and at most RAW_WAVES (1.5;
    # 528 CTAs a wave at head_dim 128), a CTA computes 2 partitions and writes each one's warp states for the fold
    # reduce, as one partition a CTA writes them: one wave of CTAs twice as long, the bits of one partition a CTA.
    # Within one wave, and past 1.5 (where a second wave is no tail), the rule of the test above.
    rule = lambda seqs, parts, **kw: build.span_schedule(build.MmaTuning(**kw), 128, 4, 16, 8 * seqs, parts, 132)  # noqa: E731
    assert build.MmaTuning().raw_span and build.RAW_SPAN == 2 and build.RAW_WAVES == 1.5
    assert rule(9, 8) == rule(18, 4) == rule(36, 2) == 2  # 576 CTAs: 1.09 waves (whole contexts of 4 and 2 too)
    assert rule(5, 16) == rule(20, 4) == rule(12, 8) == rule(3, 32) == rule(24, 4) == 2  # 640 to 768 CTAs
    assert rule(8, 8) == rule(4, 16) == 1  # 512 CTAs: one wave already
    assert rule(13, 8) == rule(7, 16) == 1 and rule(26, 4) == 4  # 832-896 CTAs: 1.58-1.70 waves, the rule above
    assert rule(8, 32) == rule(16, 8) == rule(64, 4) == 4 and rule(256, 1) == 1  # the tie shapes and 1 partition
    assert rule(1, 4, span=2) == 2 and rule(256, 1, span=2) == 1  # forced, where a context has partitions to split
    assert rule(9, 8, raw_span=False) == 1 and rule(9, 8, raw_span=False, span=2) == 1  # without raw spans
    assert build.span_schedule(build.MmaTuning(), 64, 4, 16, 72, 8, 132) == 1  # FOLD_SPILLS: no span build
    # The builds: spans of 2 run the raw-span build (RAW_SPAN, a state slot for each of its 2 partitions), other
    # spans the span build (its loop folds) or the build without spans.
    raw = build.MmaTuning()
    assert build.span_build(raw, 2) == raw and not build.span_build(raw, 4).raw_span
    assert not build.span_build(raw, 1).raw_span and build.span_build(raw, 1).max_span == 1
    defines = lambda t: dict(build.mma_decode_config("bfloat16", 128, 16, 4, t).defines)  # noqa: E731
    assert defines(raw)["RAW_SPAN"] == 1 and defines(raw)["SPAN_FOLD"] == 1 and defines(raw)["SPAN_SLOTS"] == 4
    assert "RAW_SPAN" not in defines(build.span_build(raw, 4)) and "RAW_SPAN" not in defines(build.MmaTuning(fold=False))
    assert {build.mma_decode_config(d, h, b, 4, build.span_build(raw, span)) for d in ("float16", "bfloat16")
            for h in splitk.MMA_HEAD_DIMS for b in build.SUPPORTED_BLOCK_SIZES for span in (1, 2, 4)} <= set(build.ci_configs())


def test_the_unfolded_tree_takes_spans_that_hold_whole_contexts():
    # fold=False (each partition merged over its warps, then the partitions): the shortest span (2 or 4 partitions
    # a CTA, each partition's warp states in a shared-memory slot) that holds every context, so that no reduce
    # kernel follows, where a CTA per (sequence, head group) still keeps SPAN_FILL of the CTA slots busy (4 CTAs
    # per SM at head_dim 128: 475). 64 x 4096 tokens, 32 / 8 heads: 512 CTAs of four partitions.
    rule = lambda seqs, parts, **kw: build.span_schedule(build.MmaTuning(fold=False, **kw), 128, 4, 16, 8 * seqs, parts, 132)  # noqa: E731
    assert rule(64, 4) == rule(128, 3) == 4 and rule(256, 2) == 2
    assert rule(8, 32) == rule(64, 5) == 1  # no span holds the context: one partition a CTA, the reduce merges
    assert rule(8, 4) == rule(1, 4) == 1  # 64 or 8 CTAs would leave most SMs idle
    assert rule(256, 1) == 1  # one partition: nothing to merge
    assert rule(64, 4, span=1) == 1 and rule(1, 4, span=4) == 4  # forced (benchmark candidates)
    assert rule(64, 4, merge_in_kernel=True) == 1  # its counters count partition CTAs
    # Where the state a span keeps would not fit (or would spill): one partition a CTA whatever the grid.
    unfolded = build.MmaTuning(fold=False, span=4)
    assert build.span_schedule(unfolded, 128, 8, 16, 8 * 64, 4, 132) == 1
    assert build.span_schedule(unfolded, 128, 4, 8, 8 * 64, 4, 132) == 1
    assert build.span_slots(256, 4, 16, unfolded) == 2 and build.span_slots(64, 4, 32, unfolded) == 4
    # A build with spans is a different binary; without them (slots 1) the kernel saves its state after its loop.
    t = build.MmaTuning(fold=False)
    assert dict(build.mma_decode_config("bfloat16", 128, 16, 4, t).defines)["SPAN_SLOTS"] == 4
    assert dict(build.mma_decode_config("bfloat16", 128, 8, 4, t).defines)["SPAN_SLOTS"] == 1
    one, four = build.span_build(t, 1), build.span_build(t, 4)
    assert dict(build.mma_decode_config("bfloat16", 128, 16, 4, one).defines)["SPAN_SLOTS"] == 1
    assert four == t and one.partition_size == four.partition_size
    assert {build.decode_config("bfloat16", 128, 16, 4, x) for x in (one, four)} <= set(build.ci_configs())


def test_a_grid_of_at_most_one_cta_per_sm_takes_the_prefetch_build_and_nothing_else_changes():
    # small_grid_schedule picks a schedule from the grid's size: prefetch (3 CTAs per SM) up to one CTA per
    # SM at head_dim 128; the partition size, and so the arithmetic, never moves; CI compiles what it picks.
    small = build.small_grid_schedule(build.MmaTuning(), 128, num_ctas=132, num_sms=132)
    assert (small.prefetch, small.min_ctas_per_sm, small.partition_size) == (True, 3, build.MmaTuning().partition_size)
    assert build.small_grid_schedule(build.MmaTuning(), 128, num_ctas=133, num_sms=132) == build.MmaTuning()
    assert build.small_grid_schedule(build.MmaTuning(), 64, num_ctas=8, num_sms=132) == build.MmaTuning()
    off = build.CANDIDATES["v3 mma no small-grid prefetch"]
    assert build.small_grid_schedule(off, 128, num_ctas=8, num_sms=132) == off
    p2048 = build.small_grid_schedule(build.MmaTuning(partition_size=2048), 128, num_ctas=8, num_sms=132)
    assert (p2048.partition_size, p2048.prefetch) == (2048, True)
    # A grid that small has one partition a CTA (span_schedule), so the launcher asks for it after span_build.
    compiled = set(build.ci_configs())
    one = build.small_grid_schedule(build.span_build(build.MmaTuning(), 1), 128, 1, 132)
    for dtype in ("float16", "bfloat16"):
        for block_size in splitk.SUPPORTED_BLOCK_SIZES:
            assert build.mma_decode_config(dtype, 128, block_size, 4, one) in compiled
        for name, t in build.CANDIDATES.items():
            if t.version == 3:
                t = build.span_build(t, t.span or 1)
                assert build.decode_config(dtype, 128, 16, 4, build.small_grid_schedule(t, 128, 1, 132)) in compiled, name


def test_driver_passes_each_argument_as_its_c_type():
    import ctypes

    from pagedref.kernels import driver

    assert isinstance(driver._value(np.uint64(7)), ctypes.c_uint64)
    assert isinstance(driver._value(np.int32(-1)), ctypes.c_int32)
    assert driver._value(np.float32(0.5)).value == 0.5
    with pytest.raises(TypeError, match="kernel argument"):
        driver._value(3)  # a bare int: its C type would be a guess
    # CUlaunchConfig / CUlaunchAttribute as cuda.h lays them out on a 64-bit host.
    assert ctypes.sizeof(driver._Attribute) == 72 and driver._Config.stream.offset == 32
    assert ctypes.sizeof(driver._Config) == 56


@pytest.fixture
def p():
    return T.make_problem([40, 5, 100], [3, 1, 10], head_dim=16, device="cpu", seed=0)


def test_more_argument_errors(p):
    shape = validate.check_attention_args(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens)
    with pytest.raises(ValueError, match="max_context_len"):
        validate.check_ranges(shape, p.block_tables, p.context_lens, 50)
    with pytest.raises(ValueError, match="max_query_len"):
        validate.check_ranges(shape, p.block_tables, p.context_lens, 100, p.query_start_loc, 14, 3)
    with pytest.raises(ValueError, match="num_tokens"):
        validate.check_ranges(shape, p.block_tables, p.context_lens, 100, p.query_start_loc, 13, 10)
    with pytest.raises(ValueError, match="query_start_loc"):
        validate.check_query_start_loc(p.query_start_loc[:3], 3, p.q.device)
    with pytest.raises(ValueError, match="out shape"):
        validate.check_out(torch.empty(2, 4, 16), p.q)
    with pytest.raises(ValueError, match="block_size"):
        validate.check_cache(torch.empty(4, 12, 2, 16), torch.empty(4, 12, 2, 16))
    with pytest.raises(ValueError, match="head_dim"):
        validate.check_cache(torch.empty(4, 16, 2, 48), torch.empty(4, 16, 2, 48))
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        validate.check_attention_args(p.q.numpy(), p.k_cache, p.v_cache, p.block_tables, p.context_lens)
    with pytest.raises(ValueError, match="at least one token"):
        p.context_lens[0] = 0
        validate.check_ranges(shape, p.block_tables, p.context_lens, 100)


def test_decode_launcher_shape_errors_come_before_the_device_check(p):
    from pagedref import kernels

    with pytest.raises(ValueError, match="one query row per sequence"):
        kernels.paged_attention_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    with pytest.raises(ValueError, match="version"):
        kernels.paged_attention_decode(p.q[:3].contiguous(), p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                       p.scale, version=4)
    with pytest.raises(TypeError, match="version 3 takes a MmaTuning"):
        kernels.paged_attention_decode(p.q[:3].contiguous(), p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                       p.scale, version=3, tuning=build.DecodeTuning())


def test_tensor_core_decode_falls_back_to_v2_by_dtype_and_head_dim_only():
    from pagedref.kernels.launch import _decode_kernel

    assert _decode_kernel(3, None, 2, 128) == (3, build.MmaTuning())
    assert _decode_kernel(3, build.MmaTuning(partition_size=1024), 2, 64) == (3, build.MmaTuning(partition_size=1024))
    for head_dim in splitk.MMA_HEAD_DIMS:  # vLLM's head sizes, 112, 120 and 192 included
        assert _decode_kernel(3, None, 2, head_dim) == (3, build.MmaTuning())
    for elem_size, head_dim in ((4, 128), (4, 120), (2, 8), (2, 16), (2, 32)):  # float32, or a small head_dim
        assert _decode_kernel(3, None, elem_size, head_dim) == (2, build.DecodeTuning())
    assert _decode_kernel(2, None, 2, 128) == (2, build.DecodeTuning())
    with pytest.raises(ValueError, match="v3"):
        build.mma_decode_config("float32", 128, 16, 4)
    with pytest.raises(ValueError, match="head_dim"):
        build.mma_decode_config("bfloat16", 32, 16, 4)


def ptxas_report(config: build.KernelConfig, entry: str, tmp_path) -> str:
    """What `nvcc -Xptxas -v` says about one kernel of a config (registers, spills, shared memory)."""
    cmd = ["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", *config.options(), str(config.source),
           "-o", str(tmp_path / "k.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stderr.split(f"Compiling entry function '{entry}'")[1].split("Compiling entry")[0]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("span", [1, 2, 4])
@pytest.mark.parametrize("head_dim", splitk.MMA_HEAD_DIMS)
def test_tensor_core_decode_fits_its_occupancy_without_spilling(head_dim, span, tmp_path):
    # MMA_MIN_CTAS_PER_SM caps v3's registers (4 CTAs per SM at head_dim 128: 128 registers); ptxas
    # must not spill to local memory to meet it, in each of its builds (span_build: spans of 1, 2 and 4).
    config = build.mma_decode_config("bfloat16", head_dim, 16, 4, build.span_build(build.MmaTuning(), span))
    report = ptxas_report(config, "paged_attention_v3", tmp_path)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


def test_tensor_core_prefill_falls_back_to_v1_by_dtype_and_head_dim_only():
    from pagedref.kernels.launch import _prefill_version

    for head_dim in splitk.MMA_HEAD_DIMS:
        assert _prefill_version(2, 2, head_dim) == 2
        assert build.prefill_config("float16", head_dim, 16, version=2).defines[-1] == ("PREFILL_MMA", 1)
    for elem_size, head_dim in ((4, 128), (4, 120), (2, 8), (2, 16), (2, 32)):  # float32, or a small head_dim
        assert _prefill_version(2, elem_size, head_dim) == 1
    assert _prefill_version(1, 2, 128) == 1
    for bad in (0, 4):
        with pytest.raises(ValueError, match="prefill version must be 1, 2 or 3"):
            _prefill_version(bad, 2, 128)
    with pytest.raises(ValueError, match="v2"):
        build.prefill_config("float32", 128, 16, version=2)
    with pytest.raises(ValueError, match="head_dim"):
        build.prefill_config("bfloat16", 32, 16, version=2)
    assert build.prefill_config("bfloat16", 128, 16) == build.prefill_config("bfloat16", 128, 16, version=1)


def test_prefill_launcher_checks_version_before_the_device(p):
    from pagedref import kernels

    with pytest.raises(ValueError, match="prefill version must be 1, 2 or 3"):
        kernels.paged_prefill(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.query_start_loc, p.scale,
                              version=4)
    with pytest.raises(ValueError, match="CUDA"):
        kernels.paged_prefill(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.query_start_loc, p.scale,
                              version=2)


def test_tensor_core_prefill_shared_memory_fits_an_sm():
    # K and V tiles, two buffers, rows padded by 8 elements (+ the query rows at head_dim 256): under
    # the H100/H200's 227 KB per CTA, and two CTAs per SM at head_dim <= 128.
    assert splitk.prefill_mma_shared_bytes(128) == 4 * 64 * 136 * 2
    assert splitk.prefill_mma_shared_bytes(256) == (4 * 32 + 64) * 264 * 2
    assert splitk.prefill_mma_shared_bytes(120) == splitk.prefill_mma_shared_bytes(128)  # 120 runs padded to 128
    assert splitk.prefill_mma_shared_bytes(192) == (4 * 32 + 64) * 200 * 2
    for head_dim in splitk.MMA_HEAD_DIMS:
        assert splitk.prefill_mma_shared_bytes(head_dim) <= 227 * 1024
    assert 2 * splitk.prefill_mma_shared_bytes(128) <= 227 * 1024


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim", splitk.MMA_HEAD_DIMS)
def test_tensor_core_prefill_does_not_spill(head_dim, tmp_path):
    report = ptxas_report(build.prefill_config("bfloat16", head_dim, 16, version=2), "paged_prefill_v2", tmp_path)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


def test_copy_blocks_arguments():
    k = torch.randn(6, 8, 1, 16)
    with pytest.raises(ValueError, match="non-empty"):
        validate.check_block_copies([], torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"dst\[0\] = 6"):
        validate.check_block_copies([(k, k.clone())], torch.tensor([0]), torch.tensor([6]))
    with pytest.raises(ValueError, match="layer 0"):
        validate.check_block_copies([(k, k.clone()), (k[:3].clone(), k[:3].clone())], torch.tensor([0]), torch.tensor([1]))
    validate.check_block_copies([(k, k.clone())], torch.tensor([0, 1]), torch.tensor([2, 3]))


def test_cuda_backend_builds_without_a_gpu_and_refuses_cpu_tensors(p):
    backend = get_backend("cuda")
    meta = AttentionMetadata(torch.arange(14), p.query_start_loc, p.context_lens, p.block_tables, 10, 100, 16)
    kv = p.q[:, :2].contiguous()
    with pytest.raises(ValueError, match="CUDA"):
        backend.forward(p.q, kv, kv, (p.k_cache, p.v_cache), meta, p.scale)
    meta.block_size = 8
    with pytest.raises(ValueError, match="block_size"):
        backend.forward(p.q, kv, kv, (p.k_cache, p.v_cache), meta, p.scale)


def test_test_helpers_keep_each_sequence_readable_through_its_block_table(p):
    for prob in (p, T.permute_blocks(p, seed=3)):
        bt = prob.block_tables
        for s, ctx in enumerate(prob.context_lens.tolist()):
            rows = torch.stack([prob.k_cache[bt[s, t // 16], t % 16] for t in range(ctx)])
            assert torch.equal(rows.double(), torch.from_numpy(prob.k_seq[s]))
    sub = T.select(p, [2, 0])
    ref = T.oracle(p)
    assert np.array_equal(T.oracle(sub), np.concatenate([ref[4:14], ref[0:3]]))


def test_the_kernel_tests_oracle_is_standard_attention_vectorised():
    # testing.oracle computes each sequence's rows a few hundred at a time (a GPU test's 8k rows in a
    # second); the row-by-row oracle of pagedref.attention gives the same float64 values to a few ulps,
    # with GQA, a chunk after a cached prefix, decode rows, and more rows than one step takes.
    from pagedref.attention import attention

    prob = T.make_problem([1, 700, 1300, 9], [1, 200, 1300, 9], num_heads=6, num_kv_heads=2, head_dim=32,
                          dtype=torch.bfloat16, device="cpu", seed=5)
    got, q64 = T.oracle(prob), prob.q.double().numpy()
    for s, (k, v) in enumerate(zip(prob.k_seq, prob.v_seq)):
        rows = T.seq_rows(prob, s)
        want = attention(q64[rows], k, v, prob.scale, q_start=k.shape[0] - (rows.stop - rows.start))
        np.testing.assert_allclose(got[rows], want, rtol=1e-12, atol=1e-14)
    assert not np.isnan(got).any()


def test_bench_dispatch():
    from pagedref.bench.__main__ import main

    assert main([]) == 2 and main(["nope"]) == 2
    if not torch.cuda.is_available():
        assert main(["kernel"]) == 1
        assert main(["gemm"]) == 1


def test_bench_gemm_times_each_projection_of_the_model_shape():
    from pagedref.bench.gemm import projection_shapes

    # Llama-3.1-8B: 32 query and 8 KV heads of 128, hidden 4096, intermediate 14336
    assert projection_shapes("llama-3.1-8b") == {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                                                 "down": (14336, 4096)}
    assert projection_shapes("llama-3.2-1b")["qkv"] == (2048, 3072)


def test_bench_gemm_report_sums_a_step_over_the_models_projections_only(capsys):
    from pagedref.bench.gemm import PROJECTIONS, print_report, projection_shapes

    shapes = projection_shapes("llama-3.1-8b") | {"4096x16896": (4096, 16896)}
    us = {f"{name}@256": 10.0 for name in shapes}  # 10 us each; the extra shape must not count
    print_report({"model_shape": "llama-3.1-8b", "num_layers": 32, "shapes": shapes, "rows": [256],
                  "modes": ["default"], "us": {"default": us}})
    assert f"{len(PROJECTIONS) * 10 * 32 / 1e3:.2f} ms" in capsys.readouterr().out  # 1.28 ms, not 1.60
    # With SwiGLU's fused row the step is also summed with it in place of gate_up (and the sweep's rows listed).
    shapes["gate_up_silu"] = shapes["gate_up"]
    us = {f"{name}@256": 10.0 for name in shapes} | {"gate_up_silu@256": 20.0}
    sweep = {**us, "qkv@256:96x1": 12.5, "qkv@2560:96x1": 99.0}  # a tiling at other rows is not these rows' line
    print_report({"model_shape": "llama-3.1-8b", "num_layers": 32, "shapes": shapes, "rows": [256],
                  "modes": ["default", "pagedref"], "us": {"default": us, "pagedref": sweep}})
    out = capsys.readouterr().out
    assert "qkv + o + gate_up_silu + down: 1.60 ms / 1.60 ms" in out and "pagedref qkv@256:96x1: 12.5 µs" in out
    assert "qkv@2560" not in out, "only the tilings at the rows printed (2560 is not 256)"


def test_bench_gemm_l2_resident_times_one_buffer_set_and_says_so(capsys):
    from pagedref.bench.gemm import buffer_sets, print_report, projection_shapes

    assert buffer_sets(2 * 4096 * 4096, l2_resident=True) == 1, "one set: a weight that fits stays in L2"
    shapes = projection_shapes("llama-3.1-8b")
    res = {"model_shape": "llama-3.1-8b", "num_layers": 32, "shapes": shapes, "rows": [256], "modes": ["default"],
           "us": {"default": {f"{name}@256": 10.0 for name in shapes}}}
    print_report(res | {"l2_resident": True})
    assert "one buffer set (weights that fit stay in L2)" in capsys.readouterr().out
    print_report(res)
    assert "one buffer set" not in capsys.readouterr().out, "the default cycles enough sets to stream from HBM"


def test_bench_gemm_weight_stream_gives_a_bytes_cost_and_the_line_over_the_extra_shapes(capsys):
    from pagedref.bench.gemm import print_stream, stream_cost

    shapes = {"qkv": (4096, 6144), "4096x2048": (4096, 2048), "4096x3072": (4096, 3072), "4096x4096": (4096, 4096)}
    fit = ["4096x2048", "4096x3072", "4096x4096"]

    def difference(name):  # mJ: 1 mJ a launch plus 40 pJ a byte for the fitted shapes; q/k/v off the line
        k, n = shapes[name]
        return 5.0 if name == "qkv" else 1.0 + 40e-9 * 2 * k * n

    def rnd(where, noise):  # one round of bench_mode's sustained figures, both modes
        return {mode: {f"{name}@256": {"mj": 10.0 + (difference(name) if where == "hbm" else 0.0) + noise}
                       for name in shapes} | {"o@256": {"mj": None}} for mode in ("default", "pagedref")}

    runs = {"hbm": [rnd("hbm", +0.3), rnd("hbm", -0.3)], "l2": [rnd("l2", -0.1), rnd("l2", +0.1)]}
    cost = stream_cost(runs, shapes | {"o": (4096, 4096)}, fit)
    for mode in ("default", "pagedref"):
        rows = cost[mode]["shapes"]
        assert "o@256" not in rows, "no energy counter, no figure: a key without joules is left out"
        assert rows["4096x2048@256"]["hbm_mj"] == pytest.approx(10.0 + difference("4096x2048")), "the mean of the rounds"
        assert rows["4096x2048@256"]["pj_per_byte"] == pytest.approx(1e9 * difference("4096x2048") / (2 * 4096 * 2048))
        line = cost[mode]["lines"]["256"]
        assert line["pj_per_byte"] == pytest.approx(40.0) and line["fixed_mj"] == pytest.approx(1.0), (
            "the line over the fitted shapes alone: q/k/v, off it, must not pull it")
    print_stream(cost, rounds=2)
    out = capsys.readouterr().out
    assert "default at 256 rows, over 4096x2048 4096x3072 4096x4096: 40 pJ a byte at the margin, 1.00 mJ a launch" in out
    with_o = stream_cost(runs, shapes | {"o": (4096, 4096)}, fit + ["o"])
    assert with_o["default"]["lines"]["256"]["shapes"] == fit, "the line names the shapes it was fitted over"
    one_size = stream_cost(runs, shapes | {"o": (4096, 4096)}, ["4096x2048"])
    assert one_size["default"]["lines"] == {}, "one size draws no line"
    tiled = {where: [{"pagedref": {f"{key}:64x1": f for key, f in r["pagedref"].items()}} for r in rounds]
             for where, rounds in runs.items()}  # the same figures under --tiles' keys, "name@M:BNxS"
    tiled_cost = stream_cost(tiled, shapes | {"o": (4096, 4096)}, fit)
    assert tiled_cost["pagedref"]["lines"]["256:64x1"]["pj_per_byte"] == pytest.approx(40.0), "a line per tiling"
    print_stream(tiled_cost, rounds=2)
    assert "pagedref at 256 rows, tile 64x1, over 4096x2048" in capsys.readouterr().out, "rows and tile apart"


def test_bench_gemm_weight_stream_refuses_l2_resident_and_negative_rounds(capsys):
    from pagedref.bench import gemm as bench_gemm

    with pytest.raises(SystemExit):
        bench_gemm.main(["--weight-stream", "2", "--l2-resident"])
    assert "leave out --l2-resident" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_gemm.main(["--weight-stream", "-1"])
    assert "--weight-stream at least 0" in capsys.readouterr().err


def test_bench_gemm_weight_stream_times_hbm_then_l2_in_every_round(monkeypatch, tmp_path, capsys):
    import json
    import types

    from pagedref.bench import gemm as bench_gemm

    # The GPU's part (bench_mode) stands in here; what is tested is main's order of runs and what it keeps.
    order = []

    def fake_bench_mode(mode, shapes, rows, reps, tiles, sustain_s, sustained, l2_resident):
        order.append((mode, l2_resident, sustain_s))
        for name, (k, n) in shapes.items():  # 40 pJ a byte more from HBM, nothing a launch
            sustained[f"{name}@256"] = {"us": 10.0, "mj": 10.0 + (0.0 if l2_resident else 40e-9 * 2 * k * n)}
        return {f"{name}@256": 10.0 for name in shapes}

    monkeypatch.setattr(bench_gemm, "bench_mode", fake_bench_mode)
    monkeypatch.setattr(bench_gemm, "environment", lambda device: {"gpu": "a stand-in"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(L2_cache_size=50 << 20))
    out = tmp_path / "stream.json"
    assert bench_gemm.main(["--rows", "256", "--modes", "default", "pagedref", "--extra", "4096x2048", "4096x3072",
                            "--weight-stream", "2", "--json", str(out)]) == 0
    round_ = [("default", False, 1.5), ("pagedref", False, 1.5), ("default", True, 1.5), ("pagedref", True, 1.5)]
    assert order == round_ * 2, "each round: every mode from HBM, then every mode from L2, sustained 1.5 s by default"
    res = json.loads(out.read_text())
    assert len(res["weight_stream"]["rounds"]["hbm"]) == 2 and len(res["weight_stream"]["rounds"]["l2"]) == 2
    assert res["us"]["pagedref"]["qkv@256"] == 10.0, "the first round from HBM is the plain report's"
    line = res["weight_stream"]["cost"]["pagedref"]["lines"]["256"]
    assert line["pj_per_byte"] == pytest.approx(40.0) and line["shapes"] == ["4096x2048", "4096x3072"]
    assert "40 pJ a byte at the margin" in capsys.readouterr().out


def test_bench_gemm_extra_shapes_parse_or_name_the_problem():
    import argparse

    from pagedref.bench.gemm import extra_shape

    assert extra_shape("4096x16896") == (4096, 16896)
    for bad in ("4096", "4096x", "0x8", "axb"):
        with pytest.raises(argparse.ArgumentTypeError, match="KxN"):
            extra_shape(bad)


def test_bench_gather_launch_constant_fits_and_refuses_bad_contexts(capsys):
    # `bench gather --launch-constant` fits time = constant + bytes / rate over the batches: exact on a line; it
    # takes contexts of whole 16-token steps and at least two batches; kv_read's CTA spans whole steps (whole
    # blocks of every KV head: 128 tokens).
    from pagedref.bench import gather
    from pagedref.kernels.kv_read import kv_read

    points = [{"kv_bytes": gb * 1e9, "t": 7.5 + gb * 1e6 / 4500} for gb in (0.1, 0.4, 0.9)]
    fitted = gather.fit(points, "t")
    assert fitted["constant_us"] == pytest.approx(7.5) and fitted["GBps"] == pytest.approx(4500)
    head = {"gpu": "GPU", "date": "today", "copy_GBps": 4280.0}
    points = [{"batch": 64, "read_us": 18.8, "decode_us": 19.8}, {"batch": 256, "read_us": 53.9, "decode_us": 65.1}]
    gather.print_launch_constant({**head, "launch_constant": [{"context": 208, "points": points, "read": fitted,
                                                                 "decode": fitted}]})
    gather.print_patterns({**head, "batch": 64, "context": 4096, "partition": 1024, "kv_GB": 1.07,
                           "GBps": {"v3 lanes, 0 KB": 4415.0}})
    printed = capsys.readouterr().out
    assert "    208 |   7.5 µs,  4500 GB/s" in printed and "256: 53.9 / 65.1" in printed, printed
    assert "(64, 4096), 1.07 GB of K/V, a CTA per KV head and 1024 tokens" in printed, printed
    assert "103.2% of the copy" in printed, printed
    for bad in (["--launch-constant", "200"], ["--launch-constant", "0"], ["--launch-constant", "208", "--batches", "8"]):
        with pytest.raises(SystemExit) as exit_info:
            gather.main(bad)
        assert exit_info.value.code == 2 and "--launch-constant takes" in capsys.readouterr().err, bad
    kv = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        kv_read(kv, kv, torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 1, 8, dtype=torch.int32), partition_size=40)
    with pytest.raises(ValueError, match="multiple of 128 for 'whole blocks'"):
        kv_read(kv, kv, torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 1, 8, dtype=torch.int32), "whole blocks",
                partition_size=64)


def test_bench_kernel_peers_argument(monkeypatch, capsys):
    # --peers names known libraries only (argparse refuses others); a peer that does not import is a
    # note on stderr and no rows, never a crash; one that imports is handed to the benchmark.
    import types

    from pagedref.bench import kernel

    with pytest.raises(SystemExit) as exit_info:
        kernel.main(["--peers", "vllm"])
    assert exit_info.value.code == 2 and "invalid choice: 'vllm'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        kernel.main(["--candidates", "v9"])
    assert exit_info.value.code == 2 and "unknown candidate(s) ['v9']" in capsys.readouterr().err
    assert kernel.decode_shape("8x4096") == (8, 4096) and kernel.decode_shape("1X131072") == (1, 131072)
    bad_shapes = {"8": "SEQUENCESxCONTEXT", "8x": "SEQUENCESxCONTEXT", "8x4096x2": "SEQUENCESxCONTEXT",
                  "eightx4096": "SEQUENCESxCONTEXT", "0x4096": "must be >= 1", "8x0": "must be >= 1"}
    for bad, why in bad_shapes.items():
        with pytest.raises(SystemExit) as exit_info:
            kernel.main(["--decode-shapes", bad])
        assert exit_info.value.code == 2 and why in capsys.readouterr().err, bad
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    assert kernel.load_peers(["flashinfer"]) == {}
    assert "note: peer flashinfer is not importable (ModuleNotFoundError" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert kernel.main(["--peers", "flashinfer", "--no-prefill"]) == 1  # the note, then the GPU check
        err = capsys.readouterr().err
        assert "flashinfer is not importable" in err and "needs a CUDA GPU" in err
    fake = types.ModuleType("flashinfer")
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    assert kernel.load_peers(["flashinfer"]) == {"flashinfer": fake}


def test_bench_gather_energy_is_joules_a_byte_over_the_idle_draw(capsys):
    # `--energy`: a run of 100 µs at 0.5 J over 1 GB of K/V is 500 pJ a byte; with 100 W idle (10 mJ in those 100
    # µs) 490 over idle. Without NVML's counter no energy, and the printout says so; --energy needs the contexts.
    from pagedref.bench import gather

    run = {"us": 100.0, "mJ": 500.0, "W": 690.0, "MHz": 1500.0, "capped": 1.0}
    assert gather.picojoules_a_byte(run, 10**9, 100.0) == pytest.approx((500.0, 490.0))
    assert gather.picojoules_a_byte(run, 10**9, None) == pytest.approx((500.0, None))
    assert gather.picojoules_a_byte({**run, "mJ": None}, 10**9, 100.0) == (None, None)
    gather.print_energy({"energy": {"idle_W": 100.0, "seconds": 1.5, "batch": 256, "contexts": [
        {"context": 208, "kv_bytes": 10**9, "runs": {"read": [run], "copy": [{**run, "mJ": None, "W": None}]}}]}})
    printed = capsys.readouterr().out
    assert "idle draw 100 W" in printed and "| 500 (490)" in printed and "| – (–)" in printed, printed
    with pytest.raises(SystemExit) as exit_info:
        gather.main(["--energy", "1.5"])
    assert exit_info.value.code == 2 and "--energy takes" in capsys.readouterr().err


def test_the_read_roofline_kernel_is_compiled_by_ci_and_the_gather_bench_refuses_bad_arguments():
    from pagedref.bench import gather

    assert {build.kv_read_config(p) for p in build.KV_READ_PATTERNS} <= set(build.ci_configs())
    assert build.kv_read_config("v3 lanes", 4096) in build.ci_configs()  # --partition 4096: a superpartition's CTA
    for bad in (["--context", "1000"], ["--shared-kb", "64"], ["--batch", "0"], ["--partition", "200"],
                ["--context", "4096", "--partition", "3072"]):
        with pytest.raises(SystemExit):
            gather.main(bad)
    from pagedref.kernels.kv_read import kv_read

    k = torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16)
    tables, out = torch.zeros(1, 64, dtype=torch.int32), torch.zeros(1, 1, 8, dtype=torch.int32)
    for kw, msg in ((dict(pattern="rows"), "unknown pattern"), (dict(shared_kb=64), "shared_kb"),
                    (dict(k_cache=k[..., :64].contiguous(), v_cache=k[..., :64].contiguous()), "head_dim 128"),
                    (dict(block_tables=tables[:, :32].contiguous()), "whole 1024-token partitions"),
                    (dict(out=out[:, :, :4].contiguous()), "out must be"), ({}, "CUDA tensor")):
        args = dict(k_cache=k, v_cache=k, block_tables=tables, out=out) | kw
        with pytest.raises(ValueError, match=msg):
            kv_read(**args)


class _Kernel:
    """What `launch.opt_in_shared_memory` reads and sets of a CuPy RawKernel."""

    def __init__(self, static: int, allowed: int = 0):
        self.shared_size_bytes, self.max_dynamic_shared_size_bytes = static, allowed


@pytest.mark.parametrize("static, dynamic, opted", [
    (0, 48 * 1024, 0),  # exactly the default limit: no opt-in
    (0, 64 * 1024, 64 * 1024),  # dynamic alone past it
    (40 * 1024, 16 * 1024, 16 * 1024),  # neither past it, the sum is: the launch needs the opt-in too
    (40 * 1024, 8 * 1024, 0),  # the sum exactly 48 KB
    (5632, 0, 0),  # static memory only: nothing to opt in
])
def test_a_kernel_opts_in_when_static_and_dynamic_shared_memory_pass_48_kb(static, dynamic, opted):
    from pagedref.kernels import launch

    k = _Kernel(static)
    launch.opt_in_shared_memory(k, dynamic)
    assert k.max_dynamic_shared_size_bytes == opted, (
        f"{static} B static + {dynamic} B dynamic: the kernel must allow {opted} B of dynamic shared memory "
        f"(a block may use 48 KB of static and dynamic together without the opt-in)")


def test_an_opt_in_already_large_enough_is_left_alone():
    from pagedref.kernels import launch

    k = _Kernel(0, allowed=100 * 1024)
    launch.opt_in_shared_memory(k, 64 * 1024)
    assert k.max_dynamic_shared_size_bytes == 100 * 1024
