"""`python -m pagedref.bench profile`: where one decode step's time goes, paged cache against contiguous.

One idea: `bench serve` says how much faster the paged engine is; this says why, per step. Both
engines get the same requests and the same KV budget. The paged one runs all of them at once, the
contiguous one as many as its max_model_len reservations fit (the rest wait, as in `bench serve`).
Once every running sequence decodes, it measures one `LLMEngine.step()`:

- wall: the step's wall-clock time, median over steps (with async scheduling, one `step()` call: it
  schedules and launches one step and updates with the one before, so in a steady batch that is
  the period of the step loop, and the window's first two calls are not: they fill the pipeline, the
  first waiting for no step and the second for one that began during the first, so the median leaves
  them out: `periods`); every step's wall and GPU span are kept in order (`step_ms`), since under a
  power cap the steps of one window are not alike (the limiter lets the first few run at full clock);
- GPU idle (CUDA only): over the wall-timed steps, the wall time minus the GPU's span of each step
  (CUDA events recorded when a step's first and last work are issued: `ModelRunner.step_events`), per
  step. It is the time the GPU waits for the host between steps, what async scheduling hides; time it
  waits inside a step (launches issued slower than the GPU runs them) is in the span. On the CPU it
  is not applicable (None);
- phases: schedule, prepare, forward, sample, other (as `bench step`; here `forward` includes the
  GPU's work, since the step synchronizes right after the forward);
- kernels (CUDA only, torch.profiler): GPU time in matrix multiplies, in attention (the paged
  kernels and the cache write) and in everything else (norms, RoPE, activations, copies);
- the GPU's SM clock and power over the wall-timed steps (`bench.telemetry`, sampled by nvidia-smi): a
  sustained 8B step at 256 sequences runs under the H200's 700 W cap, at a lower clock than a short
  burst of the same kernels;
- the roofline: what a step must read, the weights once and every running sequence's K/V in every
  layer, over the matmul and attention time, as a share of the device's copy bandwidth measured
  in the same run (a device-to-device copy: read + write bytes over its time).

A paged step carries 8x the sequences of a contiguous one but costs far less than 8x: its matmuls
read the same weights for more rows. How much less is what bounds `bench serve`'s ratio.

Invariant: the numbers are the real engine's on the real shapes (random weights); nothing is asserted
about them (benchmarks are code, not tests).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pagedref.bench import common, serve, telemetry
from pagedref.bench.memory import BLOCK_SIZE
from pagedref.bench.step import PHASES, PhaseTimer

KERNEL_CLASSES = ("gemm", "attention", "other")
TOP_KERNELS = 12  # kernels listed by name in the report
_GEMM_NAMES = ("gemm", "gemv", "nvjet", "cutlass", "cublas", "xmma", "splitkreduce")
_ATTENTION_NAMES = ("paged_attention", "paged_prefill", "reshape_and_cache")


@dataclass
class ProfileResult:
    kv_cache: str  # "paged" or "contiguous"
    num_seqs: int  # sequences decoding in every measured step
    mean_context_len: float  # tokens per sequence, mean over the kernel-timed steps (CPU: the timed ones)
    wall_ms: float  # per step, median over the window's periods (`periods`)
    phases_ms: dict[str, float]  # per step, mean
    kernels_ms: dict[str, float] | None  # per step, GPU time by KERNEL_CLASSES (None: no GPU)
    weight_bytes: int  # the weights a step reads (an untied embedding table is only gathered from)
    kv_bytes: float  # K/V a step reads: every running sequence's context, every layer
    linear_flops: float  # 2 x rows x the weights' parameters
    async_scheduling: bool | None = None  # the engine's loop: step N+1 scheduled while step N runs
    gpu_span_ms: float | None = None  # per step, mean: from its first GPU work to its last (CUDA events; None: CPU)
    gpu_idle_ms: float | None = None  # per step, mean: wall time the GPU had no step to run (None: CPU)
    top_kernels: list[tuple[str, str, float]] | None = None  # [(class, kernel name, ms per step)], the longest first
    weight_gemm: str = "torch"  # the engine's weight_gemm: "torch" (cuBLAS), "pagedref", or the ops, comma-joined
    telemetry: dict | None = None  # the wall-timed steps' SM clock, power, energy (bench.telemetry.Telemetry) and J a step
    wall_context_len: float | None = None  # tokens per sequence, mean over the wall-timed steps (2 x steps before
    # the kernel-timed ones: at 20 steps 40 tokens shorter than mean_context_len)
    step_ms: dict[str, list[float]] | None = None  # the wall-timed steps in order: {"wall": [...], "gpu_span": [...]}
    # (gpu_span only on CUDA). With async scheduling call i returns when step i - 1 ends: wall[i] is step i - 1's period

    def bandwidth(self, what: str) -> float | None:
        """Bytes per second the step's matmuls (what="gemm", the weights) or attention kernels
        (what="attention", the K/V) achieved."""
        if self.kernels_ms is None or self.kernels_ms[what] <= 0:
            return None
        nbytes = self.weight_bytes if what == "gemm" else self.kv_bytes
        return nbytes / (self.kernels_ms[what] / 1e3)


def kernel_class(name: str) -> str:
    """'gemm', 'attention' or 'other' for a GPU kernel's name."""
    low = name.lower()
    if any(k in low for k in _ATTENTION_NAMES):
        return "attention"
    if any(k in low for k in _GEMM_NAMES):
        return "gemm"
    return "other"


def exclusive_times(kernels: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """[(kernel name, start µs, end µs)] -> [(kernel name, µs)] summed per name, each kernel counting only the
    time when no kernel that started before it was still running. A kernel launched under another's tail (a
    programmatic dependent launch: it is resident early and waits in the kernel, as split-K's reduce after the
    GEMM) counts only what it runs after, so the classes' times add up to the GPU's busy time."""
    totals: dict[str, float] = {}
    covered = float("-inf")  # the end of the latest-ending kernel so far
    for name, start, end in sorted(kernels, key=lambda k: (k[1], k[2])):
        totals[name] = totals.get(name, 0.0) + max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return list(totals.items())


def top_kernels(times_us: list[tuple[str, float]], steps: int, n: int = TOP_KERNELS) -> list[tuple[str, str, float]]:
    """[(kernel name, GPU µs)] over `steps` steps -> the n longest as [(class, name, ms per step)]."""
    ranked = sorted(times_us, key=lambda t: -t[1])[:n]
    return [(kernel_class(name), name, us / 1e3 / steps) for name, us in ranked]


def classify_kernels(times_us: list[tuple[str, float]], steps: int) -> dict[str, float]:
    """[(kernel name, GPU µs)] over `steps` steps -> ms per step in each class."""
    out = {c: 0.0 for c in KERNEL_CLASSES}
    for name, us in times_us:
        out[kernel_class(name)] += us / 1e3 / steps
    return out


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float | None:
    """The device's copy bandwidth in bytes/s (read + write); None on the CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * nbytes * reps / (start.elapsed_time(end) / 1e3)


def _weights(model) -> tuple[int, int]:
    """(bytes a step reads, parameters a row multiplies): every weight once, but an untied embedding
    table (a step gathers its rows; the lm_head is a separate matrix)."""
    params = {id(p): p for p in model.parameters()}
    if not model.config.tie_word_embeddings:
        params.pop(id(model.model.embed_tokens.weight))
    return (sum(p.numel() * p.element_size() for p in params.values()), sum(p.numel() for p in params.values()))


def _gpu_kernels(step, steps: int) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        for _ in range(steps):
            step()
        if gpu:
            torch.cuda.synchronize()
    # the kernels themselves (device events), not the CPU ops that launched them: no double count; where two
    # overlap, the later one counts from the earlier one's end (exclusive_times)
    times = exclusive_times([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                             if e.device_type == DeviceType.CUDA])
    return classify_kernels(times, steps), top_kernels(times, steps)


def measure(model_dir: Path, kv_cache: str, num_requests: int, prompt_len: int, device: str, num_kv_blocks: int,
            steps: int = 20, warmup: int = 3, seed: int = 0, kernels: bool | None = None,
            async_scheduling: bool | None = None, weight_gemm: str = "torch") -> ProfileResult:
    """Add num_requests requests of prompt_len random tokens, step until every running one decodes,
    then time `steps` steps three ways (wall and GPU idle, phases, kernels). kernels: profile the GPU
    kernels (None: on a GPU; on the CPU there are no kernel events, every class comes out 0).
    async_scheduling: the engine's (None: its default, on with CUDA). weight_gemm: the engine's, "torch",
    "pagedref" or op names joined by commas (LLM's weight_gemm)."""
    from pagedref import LLM, SamplingParams

    if kv_cache not in ("paged", "contiguous"):
        raise ValueError(f"kv_cache must be 'paged' or 'contiguous', got {kv_cache!r}")
    if num_requests < 1 or prompt_len < 1 or steps < 1:
        raise ValueError(f"num_requests, prompt_len and steps must be at least 1, got {num_requests}, {prompt_len}, {steps}")
    dtype = "bfloat16" if device == "cuda" else "float32"
    gemm_arg = weight_gemm if weight_gemm in ("torch", "pagedref") else tuple(weight_gemm.split(","))
    llm = LLM(model=str(model_dir), kv_cache=kv_cache, async_scheduling=async_scheduling, weight_gemm=gemm_arg,
              **serve.engine_args(device, dtype, num_kv_blocks, num_requests, None, 0.9))
    engine = llm.llm_engine
    try:
        rng = random.Random(seed)
        vocab = engine.vocab_size
        max_tokens = warmup + 3 * steps + 64  # nobody finishes inside the measurement (+ the prefill steps)
        for i in range(num_requests):
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            engine.add_request(f"p{i}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        running = engine.scheduler.running
        while not running or any(s.is_prefill for s in running):
            engine.step()
        for _ in range(warmup):
            engine.step(final_only=True)
        num_seqs, contexts = len(running), []

        def timed_step() -> float:
            if len(running) != num_seqs or any(s.is_prefill for s in running):
                raise RuntimeError(f"the batch changed during the measurement ({num_seqs} -> {len(running)} running): "
                                   "the pool is too small for a steady decode batch (fewer requests, or more KV blocks)")
            contexts.append(statistics.mean(s.num_tokens for s in running))
            t0 = time.perf_counter()
            engine.step(final_only=True)
            return time.perf_counter() - t0

        span, idle, tele, step_ms = _timed_window(engine, timed_step, steps)
        wall = statistics.median(periods(step_ms["wall"], engine.async_scheduling))
        wall_context = statistics.mean(contexts)  # the wall window's own (contexts grow a token a step)
        phases = _phases(engine, timed_step, steps)
        kernel_ms = top = None
        if kernels or (kernels is None and device == "cuda"):  # the bytes below are the kernel steps' own
            contexts.clear()
            kernel_ms, top = _gpu_kernels(timed_step, steps)
        weight_bytes, num_params = _weights(engine.model)
        cfg = engine.model.config
        elem = engine.runner.kv_caches[0][0].element_size()
        kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem
        context = statistics.mean(contexts)
        return ProfileResult(kv_cache, num_seqs, context, wall, phases, kernel_ms, weight_bytes,
                             num_seqs * context * kv_per_token, 2.0 * num_seqs * num_params,
                             engine.async_scheduling, span, idle, top, weight_gemm, tele, wall_context, step_ms)
    finally:
        llm.close()
        common.free_device(device)


PIPELINE_FILL = 2  # async scheduling: calls at the start of a window that are shorter than a step's period


def periods(walls: list[float], async_scheduling: bool) -> list[float]:
    """The walls of a window's calls that are periods of the step loop: with async scheduling all but the first
    PIPELINE_FILL (where the window has more), otherwise all (each call runs its own step from start to end)."""
    return walls[PIPELINE_FILL:] if async_scheduling and len(walls) > PIPELINE_FILL else list(walls)


def _timed_window(engine, timed_step, steps: int):
    """(GPU span ms per step, GPU idle ms per step, the window's Telemetry, each step's {"wall": ms, "gpu_span": ms}
    in order); the GPU numbers are None on the CPU (and step_ms has no "gpu_span"). The window starts and ends with
    the device idle, so its wall time is the steps' own; the GPU's clock and power are sampled over it
    (bench.telemetry)."""
    runner = engine.runner
    if runner.device.type != "cuda":
        return None, None, None, {"wall": [1e3 * timed_step() for _ in range(steps)]}
    torch.cuda.synchronize()
    runner.step_events = []
    with telemetry.GpuSampler(telemetry.device_uuid(runner.device)) as sampler:
        start = time.perf_counter()
        try:
            walls = [timed_step() for _ in range(steps)]
            torch.cuda.synchronize()
            window = time.perf_counter() - start
            events = runner.step_events
        finally:
            runner.step_events = None
    spans = [a.elapsed_time(b) for a, b in events]  # the steps launched in the window, all done now
    tele = sampler.result and asdict(sampler.result)
    if tele and tele["energy_j"] is not None:
        tele["energy_per_step_j"] = tele["energy_j"] / len(events)
    span_ms = sum(spans)
    step_ms = {"wall": [1e3 * w for w in walls], "gpu_span": spans}
    return span_ms / len(events), (1e3 * window - span_ms) / len(events), tele, step_ms


def _phases(engine, timed_step, steps: int) -> dict[str, float]:
    """Per-step host phases (ms); the forward synchronizes, so the GPU's work is in it."""
    run_model = engine.runner.run_model
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)

    def synced(*args, **kwargs):
        out = run_model(*args, **kwargs)
        sync()
        return out

    engine.runner.run_model = synced
    timer = PhaseTimer(engine)
    try:
        total = sum(timed_step() for _ in range(steps))
    finally:
        engine.runner.run_model = run_model
    return timer.per_step_ms(total, steps)


def in_order(xs: list[float], most: int = 20) -> list[float]:
    """Per-step values to print in order: all of them up to `most`, else the means of ten equal parts."""
    if len(xs) <= most:
        return list(xs)
    cuts = [round(i * len(xs) / 10) for i in range(11)]
    return [statistics.mean(xs[a:b]) for a, b in zip(cuts, cuts[1:])]


def print_report(doc: dict[str, Any]) -> None:
    env = doc["environment"]
    bw = doc["copy_bandwidth"]
    print(f"profile: {env.get('gpu', env['device'])}, torch {env['torch']}, commit {env.get('commit')}, {env['date']}")
    print(f"{doc['shape']}: {doc['num_requests']} requests of {doc['prompt_len']} tokens, KV budget "
          f"{doc['num_kv_blocks'] * BLOCK_SIZE:,} token slots" + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else ""))
    ms = lambda x: f"{x:>9.2f}" if x is not None else f"{'n/a':>9}"  # noqa: E731  (n/a: the CPU has no GPU to idle)
    print(f"{'kv_cache':<11}{'weight_gemm':>18}{'async':>6}{'seqs':>5}{'context':>8}{'wall ms':>9}{'gpu ms':>9}{'idle ms':>9}"
          + "".join(f"{p:>10}" for p in PHASES))
    for r in doc["results"]:
        context = r.get("wall_context_len") or r["mean_context_len"]  # documents before 2026-12-04: the kernels'
        print(f"{r['kv_cache']:<11}{r.get('weight_gemm', 'torch'):>18}{'on' if r.get('async_scheduling') else 'off':>6}"
              f"{r['num_seqs']:>5}"
              f"{context:>8.0f}{r['wall_ms']:>9.2f}{ms(r.get('gpu_span_ms'))}{ms(r.get('gpu_idle_ms'))}"
              + "".join(f"{r['phases_ms'][p]:>10.2f}" for p in PHASES))
    print(f"context: the wall-timed steps' mean; wall ms: the median period (async: the window's first {PIPELINE_FILL} "
          "calls fill the pipeline and are left out); gpu ms: a step's span on the GPU (CUDA events); idle ms: wall time per step with "
          "no step on the GPU; phases: measured with a sync after each forward")
    for r in doc["results"]:
        if r.get("step_ms") and r["step_ms"].get("gpu_span"):
            wall, span = periods(r["step_ms"]["wall"], r.get("async_scheduling")), r["step_ms"]["gpu_span"]
            print(f"{r['kv_cache']}, weight_gemm {r.get('weight_gemm', 'torch')}: {len(span)} steps, wall mean "
                  f"{statistics.mean(wall):.2f} ms over {len(wall)} periods (median: wall ms), GPU span median "
                  f"{statistics.median(span):.2f} / mean {statistics.mean(span):.2f} ms; GPU span in order"
                  f"{'' if len(span) <= 20 else ', by tenths of the window'}: "
                  + " ".join(f"{x:.2f}" for x in in_order(span)))
    for r in doc["results"]:
        t = r.get("telemetry")
        if t:
            print(f"{r['kv_cache']}, weight_gemm {r.get('weight_gemm', 'torch')}: SM clock {t['sm_clock_mhz']:.0f} MHz "
                  f"(min {t['sm_clock_min_mhz']:.0f}), power {t['power_w']:.0f} W (max {t['power_max_w']:.0f}"
                  f"{'; 1-s averages' if t.get('query') == telemetry.FALLBACK_QUERY else ''}), "
                  f"power-capped in {t['power_capped_share']:.0%} of {t['samples']} samples (nvidia-smi)"
                  + (f"; {t['energy_per_step_j']:.2f} J a step, {t['energy_j'] / t['window_s']:.0f} W mean (NVML)"
                     if t.get("energy_per_step_j") else ""))
    if not all(r["kernels_ms"] for r in doc["results"]):
        return
    contexts = ", ".join(f"{r['mean_context_len']:.0f}" for r in doc["results"])
    print(f"GPU time per step (ms) and what it reads, at the kernel-timed steps' contexts ({contexts}); bandwidth as "
          "a share of the copy bandwidth")
    print(f"{'kv_cache, weight_gemm':<30}{'gpu ms':>8}{'gemm':>8}{'attn':>8}{'other':>8}{'weights GB':>12}{'gemm TB/s':>11}"
          f"{'TFLOP/s':>9}{'KV GB':>8}{'attn TB/s':>11}")
    for r in doc["results"]:
        res = ProfileResult(**r)
        k = res.kernels_ms
        g, a = res.bandwidth("gemm"), res.bandwidth("attention")
        share = (lambda x: f" ({x / bw:.0%})" if bw and x else "")
        print(f"{res.kv_cache + ' ' + res.weight_gemm:<30}{sum(k.values()):>8.2f}{k['gemm']:>8.2f}{k['attention']:>8.2f}{k['other']:>8.2f}"
              f"{res.weight_bytes / 1e9:>12.2f}{(g or 0) / 1e12:>6.2f}{share(g):>5}{res.linear_flops / (k['gemm'] / 1e3) / 1e12:>9.0f}"
              f"{res.kv_bytes / 1e9:>8.2f}{(a or 0) / 1e12:>6.2f}{share(a):>5}")
    for r in doc["results"]:
        if r.get("top_kernels"):
            print(f"{r['kv_cache']}, weight_gemm {r.get('weight_gemm', 'torch')}: the {len(r['top_kernels'])} longest "
                  "kernels, ms per step")
            for cls, name, ms_ in r["top_kernels"]:
                print(f"  {cls:<10}{ms_:>7.3f}  {name[:110]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedref.bench profile", description=__doc__.split("\n")[0])
    ap.add_argument("--model-shape", default=None, help="llama-3.2-1b|llama-3.1-8b|tiny (default llama-3.1-8b on cuda, tiny on cpu)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--num-requests", type=int, default=256, help="requests added at once (the paged engine's batch)")
    ap.add_argument("--prompt-len", type=int, default=160, help="tokens per prompt (bench serve's mean is 147)")
    ap.add_argument("--num-kv-blocks", type=int, default=4096, help="the KV budget in blocks of 16, for both engines")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--async-scheduling", choices=("default", "on", "off", "both"), default="default",
                    help="the engine's loop: default (on with CUDA), on, off, or both side by side")
    ap.add_argument("--systems", default="paged,contiguous", help="kv_cache layouts to profile: paged,contiguous")
    ap.add_argument("--weight-gemm", nargs="+", default=["torch"], metavar="GEMM",
                    help="the engine's weight_gemm, each profiled in turn: torch (cuBLAS), pagedref, or ops joined by "
                         "commas (qkv,o,gate_up,down,lm_head)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--json-out", type=Path, help="also write the results document here")
    args = ap.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.model_shape or ("llama-3.1-8b" if device == "cuda" else "tiny")
    if shape not in common.SHAPES:
        ap.error(f"--model-shape {shape!r} is not one of {', '.join(common.SHAPES)}")
    for flag in ("num_requests", "prompt_len", "num_kv_blocks", "steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    model_dir = common.random_model_dir(shape, args.model_dir, device, seed=args.seed)
    modes = {"default": [None], "on": [True], "off": [False], "both": [True, False]}[args.async_scheduling]
    systems = args.systems.split(",")
    if not systems or any(kv not in ("paged", "contiguous") for kv in systems):
        ap.error(f"--systems {args.systems!r}: a comma-separated subset of paged,contiguous")
    results = [measure(model_dir, kv, args.num_requests, args.prompt_len, device, args.num_kv_blocks, args.steps,
                       seed=args.seed, async_scheduling=mode, weight_gemm=gemm_mode)
               for kv in systems for mode in modes for gemm_mode in args.weight_gemm]
    doc = {"benchmark": "profile", "environment": common.environment(device), "shape": shape,
           "num_requests": args.num_requests, "prompt_len": args.prompt_len, "num_kv_blocks": args.num_kv_blocks,
           "copy_bandwidth": copy_bandwidth(torch.device(device)), "results": [asdict(r) for r in results]}
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=1))
    print_report(doc)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
