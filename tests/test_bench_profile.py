"""`python -m pagedref.bench profile`: what it measures and reports (no timing is asserted: benchmarks are code)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedref.bench import profile, serve
from pagedref.bench.memory import MAX_MODEL_LEN
from pagedref.bench.step import PHASES
from pagedref.kernels import gpu_available

needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")
NUM_KV_BLOCKS = 512  # 8192 slots: the contiguous engine's 2048-slot reservations fit 4 sequences


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return serve.random_model_dir("tiny", tmp_path_factory.mktemp("models"), "cpu", log=lambda *a: None)


def kv_bytes_per_token(shape: str, elem: int) -> int:
    cfg = serve.SHAPES[shape]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * elem


def test_paged_runs_every_request_and_contiguous_what_its_reservations_fit(tiny_dir):
    paged = profile.measure(tiny_dir, "paged", 12, 40, "cpu", NUM_KV_BLOCKS, steps=2, warmup=1)
    contiguous = profile.measure(tiny_dir, "contiguous", 12, 40, "cpu", NUM_KV_BLOCKS, steps=2, warmup=1)
    assert paged.num_seqs == 12, "the paged pool holds all 12 prompts: every one decodes in the measured steps"
    assert contiguous.num_seqs == NUM_KV_BLOCKS * 16 // MAX_MODEL_LEN, "one max_model_len reservation per sequence"
    for r in (paged, contiguous):
        assert set(r.phases_ms) == set(PHASES) and r.wall_ms > 0
        assert r.kernels_ms is None and r.bandwidth("gemm") is None, "kernel times are measured on a GPU only"
        # every sequence's context (prompt + its tokens so far), every layer, K and V, float32
        assert 40 < r.mean_context_len < 40 + 1 + 3 * 2 + 64
        assert r.kv_bytes == pytest.approx(r.num_seqs * r.mean_context_len * kv_bytes_per_token("tiny", 4))
    # tiny ties its embeddings: the one table is the lm_head, read whole every step
    assert paged.weight_bytes == contiguous.weight_bytes
    assert paged.linear_flops == pytest.approx(2 * 12 * paged.weight_bytes / 4)


def test_the_bytes_read_are_those_of_the_kernel_timed_steps(tiny_dir):
    # wall and phase windows: steps contexts c..c+2s-1 (mean c+s-1/2); the kernel window follows them
    # (c+2s..c+3s-1, mean c+5s/2-1/2): its K/V bytes must be counted at its own contexts, 1.5 s later
    steps = 2
    timed = profile.measure(tiny_dir, "paged", 4, 20, "cpu", NUM_KV_BLOCKS, steps=steps, warmup=1, kernels=False)
    kernel = profile.measure(tiny_dir, "paged", 4, 20, "cpu", NUM_KV_BLOCKS, steps=steps, warmup=1, kernels=True)
    assert kernel.mean_context_len == timed.mean_context_len + 1.5 * steps
    # the wall window is the first: contexts c..c+s-1, mean c+(s-1)/2, whatever else is timed after it
    assert timed.wall_context_len == kernel.wall_context_len == timed.mean_context_len - steps / 2, (
        "wall_context_len must be the mean context of the wall-timed steps, the first window")
    assert kernel.kernels_ms == {"gemm": 0.0, "attention": 0.0, "other": 0.0}, "the CPU has no kernel events"
    assert kernel.kv_bytes == pytest.approx(4 * kernel.mean_context_len * kv_bytes_per_token("tiny", 4))


def test_a_pool_too_small_for_a_steady_batch_is_refused(tiny_dir):
    # 12 prompts of 200 tokens fill 13 blocks each, 156 of 160; 8 tokens later each needs a 14th: preemption
    with pytest.raises(RuntimeError, match="pool is too small"):
        profile.measure(tiny_dir, "paged", 12, 200, "cpu", 160, steps=5, warmup=1)


def test_bad_kv_cache_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="kv_cache"):
        profile.measure(tiny_dir, "paged-v2", 4, 8, "cpu", NUM_KV_BLOCKS)


@pytest.mark.parametrize("name, cls", [
    ("nvjet_sm90_tst_128x96_64x7_4x1_v_bz_TNT", "gemm"),  # cuBLAS's Hopper GEMMs (H200 profile)
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
    ("paged_attention_v3", "attention"),
    ("paged_attention_reduce", "attention"),
    ("paged_prefill_v2", "attention"),
    ("reshape_and_cache", "attention"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "other"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
    ("Memcpy HtoD (Pageable -> Device)", "other"),
])
def test_kernels_are_classed_by_name(name, cls):
    assert profile.kernel_class(name) == cls


def test_classify_kernels_sums_per_step():
    times = [("nvjet_a", 3000.0), ("paged_attention_v3", 1000.0), ("nvjet_b", 1000.0), ("elementwise", 500.0)]
    assert profile.classify_kernels(times, steps=2) == {"gemm": 2.0, "attention": 0.5, "other": 0.25}


def test_overlapping_kernels_count_once_and_the_earlier_one_keeps_the_overlap():
    # gemm 0-10, its split-K reduce launched early (5-12: it waits in the kernel until 10), attention 12-20,
    # a copy inside the attention (14-15), gemm again 20-30: the reduce counts 2 µs, the copy none, and the
    # times add up to the 30 µs the GPU was busy.
    kernels = [("gemm_tn", 20.0, 30.0), ("gemm_tn", 0.0, 10.0), ("gemm_splitk_reduce", 5.0, 12.0),
               ("paged_attention_v3", 12.0, 20.0), ("Memcpy DtoD", 14.0, 15.0)]
    times = dict(profile.exclusive_times(kernels))
    assert times == {"gemm_tn": 20.0, "gemm_splitk_reduce": 2.0, "paged_attention_v3": 8.0, "Memcpy DtoD": 0.0}
    assert profile.classify_kernels(list(times.items()), steps=1) == {"gemm": 0.022, "attention": 0.008, "other": 0.0}


def test_top_kernels_are_the_longest_per_step_with_their_class():
    times = [("nvjet_a", 3000.0), ("paged_attention_v3", 1000.0), ("nvjet_b", 1200.0), ("elementwise", 500.0)]
    assert profile.top_kernels(times, steps=2, n=3) == [
        ("gemm", "nvjet_a", 1.5), ("gemm", "nvjet_b", 0.6), ("attention", "paged_attention_v3", 0.5)]


def test_bandwidth_is_bytes_over_the_class_time():
    r = profile.ProfileResult("paged", 2, 10.0, 1.0, {}, {"gemm": 2.0, "attention": 0.5, "other": 0.1},
                              weight_bytes=4_000_000, kv_bytes=1_000_000.0, linear_flops=1.0)
    assert r.bandwidth("gemm") == pytest.approx(4_000_000 / 2e-3)
    assert r.bandwidth("attention") == pytest.approx(1_000_000 / 0.5e-3)


def test_main_writes_the_document_and_prints_both_engines(tiny_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert profile.main(["--device", "cpu", "--num-requests", "6", "--prompt-len", "24", "--num-kv-blocks",
                         str(NUM_KV_BLOCKS), "--steps", "1", "--model-dir", str(tiny_dir.parent), "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["shape"] == "tiny" and doc["copy_bandwidth"] is None
    assert [r["kv_cache"] for r in doc["results"]] == ["paged", "contiguous"]
    assert [r["num_seqs"] for r in doc["results"]] == [6, 4]
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["kv_cache", "weight_gemm", "async", "seqs", "context", "wall", "ms", "gpu", "ms", "idle",
                                "ms", *PHASES]
    assert lines[3].split()[:4] == ["paged", "torch", "off", "6"] and lines[4].split()[:4] == ["contiguous", "torch", "off", "4"]
    assert lines[3].split()[6:8] == ["n/a", "n/a"], "the CPU has no GPU to idle: GPU span and idle are not applicable"
    assert all(r["telemetry"] is None for r in doc["results"]), "the CPU has no SM clock to sample"
    assert not any("SM clock" in line for line in lines)


def test_the_report_gives_the_steps_clock_and_power_where_they_were_sampled(capsys):
    tele = {"samples": 9, "sm_clock_mhz": 1512.0, "sm_clock_min_mhz": 1380.0, "power_w": 655.0, "power_max_w": 699.0,
            "slowed_share": 0.8, "power_capped_share": 0.75, "energy_j": 1260.0, "window_s": 1.8, "energy_per_step_j": 1260.0 / 200}
    r = profile.ProfileResult("paged", 256, 214.0, 9.1, {p: 0.0 for p in PHASES}, None, 1, 1.0, 1.0, telemetry=tele)
    doc = {"environment": {"device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11", "date": "today"}, "copy_bandwidth": None,
           "shape": "llama-3.1-8b", "num_requests": 256, "prompt_len": 160, "num_kv_blocks": 4096,
           "results": [dataclasses.asdict(r)]}
    profile.print_report(doc)
    out = capsys.readouterr().out
    assert "SM clock 1512 MHz (min 1380), power 655 W (max 699), power-capped in 75% of 9 samples" in out
    assert "6.30 J a step, 700 W mean (NVML)" in out, "the window's energy over its steps, and over its length"
    doc["results"][0]["telemetry"] = tele | {"query": profile.telemetry.FALLBACK_QUERY, "energy_per_step_j": None}
    profile.print_report(doc)
    out = capsys.readouterr().out
    assert "power 655 W (max 699; 1-s averages)" in out and "J a step" not in out, (
        "a driver without instant power says its power is averaged; a short window has no energy")



def test_every_wall_timed_step_is_kept_in_order(tiny_dir):
    r = profile.measure(tiny_dir, "paged", 4, 20, "cpu", NUM_KV_BLOCKS, steps=3, warmup=1, kernels=False)
    assert len(r.step_ms["wall"]) == 3 and "gpu_span" not in r.step_ms, "the CPU has no GPU span to record"
    assert r.wall_ms == pytest.approx(sorted(r.step_ms["wall"])[1]), "wall_ms is the median of the steps' walls"


def test_with_async_scheduling_the_calls_that_fill_the_pipeline_are_not_periods(tiny_dir):
    # call 1 waits for no step, call 2 for one that began during call 1: neither is the loop's period
    assert profile.periods([1.0, 2.0, 5.0, 6.0, 7.0], True) == [5.0, 6.0, 7.0]
    assert profile.periods([1.0, 2.0, 5.0], False) == [1.0, 2.0, 5.0], "synchronous: every call runs a whole step"
    assert profile.periods([1.0, 2.0], True) == [1.0, 2.0], "a window of 2 steps has nothing else to give"
    r = profile.measure(tiny_dir, "paged", 4, 20, "cpu", NUM_KV_BLOCKS, steps=5, warmup=1, kernels=False,
                        async_scheduling=True)
    assert r.wall_ms == pytest.approx(sorted(r.step_ms["wall"][2:])[1]), "the median of calls 3 to 5"


def test_the_report_gives_the_gpu_span_of_each_step_in_order(capsys):
    spans = [7.5, 7.6, 8.9, 9.0]
    r = profile.ProfileResult("paged", 256, 214.0, 8.3, {p: 0.0 for p in PHASES}, None, 1, 1.0, 1.0,
                              step_ms={"wall": [3.0, 7.5, 7.6, 8.9], "gpu_span": spans})
    doc = {"environment": {"device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11", "date": "today"}, "copy_bandwidth": None,
           "shape": "llama-3.1-8b", "num_requests": 256, "prompt_len": 160, "num_kv_blocks": 4096,
           "results": [dataclasses.asdict(r)]}
    profile.print_report(doc)
    out = capsys.readouterr().out
    assert ("4 steps, wall mean 6.75 ms over 4 periods (median: wall ms), GPU span median 8.25 / mean 8.25 ms; "
            "GPU span in order: 7.50 7.60 8.90 9.00") in out
    doc["results"][0]["async_scheduling"] = True
    profile.print_report(doc)
    assert "wall mean 8.25 ms over 2 periods" in capsys.readouterr().out, "async: calls 3 and 4 only"


def test_a_long_window_is_printed_by_tenths():
    assert profile.in_order([1.0] * 20) == [1.0] * 20
    tenths = profile.in_order([float(i // 20) for i in range(200)])
    assert tenths == [float(i) for i in range(10)], "200 steps: the means of ten parts of 20, in order"


def test_async_on_and_off_side_by_side(tiny_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert profile.main(["--device", "cpu", "--num-requests", "4", "--prompt-len", "16", "--num-kv-blocks",
                         str(NUM_KV_BLOCKS), "--steps", "1", "--model-dir", str(tiny_dir.parent), "--systems", "paged",
                         "--async-scheduling", "both", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["kv_cache"], r["async_scheduling"]) for r in doc["results"]] == [("paged", True), ("paged", False)]
    assert all(r["gpu_idle_ms"] is None and r["gpu_span_ms"] is None for r in doc["results"])


@pytest.mark.parametrize("argv, message", [
    (["--num-requests", "0"], "--num-requests must be at least 1"),
    (["--model-shape", "llama-70b"], "llama-70b"),
])
def test_bad_flags_name_themselves(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        profile.main(["--device", "cpu", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@needs_gpu
@pytest.mark.gpu
def test_on_a_gpu_the_kernels_are_timed_by_class(tiny_dir):
    r = profile.measure(tiny_dir, "paged", 8, 32, "cuda", NUM_KV_BLOCKS, steps=2, warmup=1)
    assert r.async_scheduling, "on CUDA the engine schedules asynchronously by default"
    assert r.gpu_span_ms > 0 and r.gpu_idle_ms is not None and r.gpu_span_ms + r.gpu_idle_ms > 0
    assert len(r.step_ms["gpu_span"]) == len(r.step_ms["wall"]) == 2
    assert r.gpu_span_ms == pytest.approx(sum(r.step_ms["gpu_span"]) / 2), "gpu_span_ms is the steps' mean span"
    assert set(r.kernels_ms) == set(profile.KERNEL_CLASSES)
    assert r.kernels_ms["gemm"] > 0 and r.kernels_ms["attention"] > 0, r.kernels_ms
    assert r.bandwidth("attention") > 0
    assert profile.copy_bandwidth(__import__("torch").device("cuda")) > 1e9
    if __import__("shutil").which("nvidia-smi"):
        assert r.telemetry and r.telemetry["samples"] > 0 and r.telemetry["sm_clock_mhz"] > 0, r.telemetry
