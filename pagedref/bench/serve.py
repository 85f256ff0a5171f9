"""`python -m pagedref.bench serve`: offline serving throughput, pagedref against the systems it replaces.

One idea: the same requests, the same weights and the same KV memory budget for every system, so
the only difference is how each one manages that memory. The workload is ShareGPT-like (the
PagedAttention paper's, Kwon et al., SOSP 2023, §6.1): prompt and output lengths drawn from
lognormals with the paper's means (161 and 338 tokens; `pagedref.bench.memory.WORKLOADS`), filtered
as vLLM's own `benchmark_throughput` filters ShareGPT (prompt 4..1024 tokens, prompt + output <=
2048), and every request generates exactly its output length (`ignore_eos`, as vLLM's benchmark).
All requests are there at time 0 (offline), decoding is greedy everywhere (the sampler is not what
is measured), and the weights are random in a real model's shape (nothing is downloaded):

  (a) pagedref            `LLM(kv_cache="paged")`: blocks on demand, continuous batching
  (b) contiguous          `LLM(kv_cache="contiguous")`: stage 1's max_model_len reservation per request,
                          otherwise the same engine, kernels, CUDA graphs and KV pool
  (c) hf-static           transformers `generate` on static, left-padded batches; a batch is as large as
                          fits the KV budget when every member is padded to the batch's longest
                          prompt + output (its peak footprint), capped at --hf-batch-size
  (d) hf-continuous       transformers' own continuous batching / paged cache (`ContinuousBatchingManager`,
                          transformers >= 4.5x) at the same number of KV token slots, where installed

More systems on request: `pagedref-eager` (pagedref without CUDA graphs: what they are worth),
`pagedref-sync` (pagedref without async scheduling: the host's time no longer hidden behind the GPU's),
`pagedref-gemm` (pagedref with `weight_gemm="pagedref"`: gate/up and down on the project's Hopper GEMM, sm_90)
and `pagedref-tpN` (tensor parallel over N GPUs, eager, synchronous).

The KV budget is --num-kv-blocks blocks of 16 tokens (default 4096 = 65,536 token slots: 8 GiB at
the Llama-3.1-8B shape, 2 GiB at Llama-3.2-1B), small enough that memory, not max_num_seqs, bounds
the batch: the regime the paper measures (its OPT-13B on an A100-40GB has ~15.7k slots).
`--num-kv-blocks 0` sizes the pool from --gpu-memory-utilization instead (vLLM's profiling).

Invariant: every system is asked for exactly the same (prompt, output length) pairs, and its output
tokens/s counts only the tokens asked for (padding a static batch generates is waste, not output).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedref.bench.common import (SHAPES, add_output_flags, emit, environment, free_device, parse_or_replay,  # noqa: F401
                                   progress, pyplot, random_model_dir, require_positive, save_figure, sharegpt_lengths,
                                   sync_device)
from pagedref.bench import telemetry
from pagedref.bench.memory import BLOCK_SIZE, MAX_MODEL_LEN

SYSTEMS = ("pagedref", "contiguous", "hf-static", "hf-continuous")
# vLLM's benchmark_throughput default. An offline run ends in a tail: the last, longest requests decode a
# few at a time, as many steps in every engine, so the fewer the requests the more of a run the tail is
# and the less memory decides its throughput (docs/benchmarks.md: the ratios at 500 and 1000).
NUM_PROMPTS = 1000

# ------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_requests(num: int, vocab_size: int, seed: int, input_len: int | None = None,
                  output_len: int | None = None, workload: str = "sharegpt") -> list[BenchRequest]:
    """Random prompt tokens; lengths from ShareGPT-like distributions unless fixed by input_len / output_len.
    workload "copy": each prompt is a passage followed by its first quarter again, so an answer that goes on
    copying the passage repeats long spans of its prompt (the shape of an edit or extract task: what
    speculative decoding's prompt lookup is for)."""
    rng = np.random.default_rng(seed)
    lengths = sharegpt_lengths(rng, num)
    lengths = [(input_len or p, output_len or o) for p, o in lengths]
    if workload == "copy":
        reqs = []
        for p, o in lengths:
            passage = rng.integers(0, vocab_size, p - p // 4).tolist()
            reqs.append(BenchRequest(passage + passage[: p // 4], o))
        return reqs
    return [BenchRequest(rng.integers(0, vocab_size, p).tolist(), o) for p, o in lengths]


# --------------------------------------------------------------------------------------------- results


@dataclass
class Result:
    system: str
    requests: int = 0  # requests completed (and timed)
    elapsed_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0  # tokens asked for, of the completed requests
    peak_running_seqs: int | None = None
    kv_blocks: int | None = None  # the pool, in BLOCK_SIZE-token blocks
    peak_kv_blocks_used: int | None = None
    kv_token_state_share: float | None = None  # share of occupied KV memory holding token states (time mean)
    preemptions: int | None = None
    spec_acceptance_rate: float | None = None  # speculative decoding (--speculative-config): accepted / draft tokens
    spec_mean_accepted_length: float | None = None  # ... tokens emitted per speculative step of a sequence
    note: str = ""
    skipped: str | None = None  # why the system did not run
    gpu: dict[str, Any] | None = None  # the run's SM clock, power and energy (bench.telemetry.Telemetry; None: not sampled)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(requests_per_s=self.requests_per_s, output_tokens_per_s=self.output_tokens_per_s)
        return d


# --------------------------------------------------------------------------------- (a), (b): pagedref


def engine_args(device: str, dtype: str, num_kv_blocks: int | None, max_num_seqs: int | None, max_num_batched_tokens: int | None,
                gpu_memory_utilization: float, enforce_eager: bool = False,
                speculative_config: dict[str, Any] | None = None) -> dict[str, Any]:
    return dict(device=device, dtype=dtype, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks or None,
                gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=False, enforce_eager=enforce_eager,
                speculative_config=speculative_config)


def _graph_note(stats: dict[str, Any]) -> str:
    decode, pieces = stats["num_cuda_graph_replays"], stats["num_piecewise_graph_replays"]
    note = f", {decode} decode + {pieces} piecewise graph replays" if decode or pieces else ", eager"
    return note + (", async" if stats.get("async_scheduling") else "")


def _spec_note(stats: dict[str, Any]) -> str:
    if not stats["spec_num_draft_tokens"]:
        return ""
    return (f", speculative: {stats['spec_acceptance_rate']:.1%} of {stats['spec_num_draft_tokens']} drafts accepted, "
            f"{stats['spec_mean_accepted_length']:.2f} tokens/step")


def power_note(tele: telemetry.Telemetry | None, output_tokens: int) -> str:
    """The run's GPU clock and power, and its energy per output token where NVML gave it (a long run at a batch
    of hundreds runs at the power cap: then tokens per joule, not the clock, is what a faster schedule must raise)."""
    if tele is None:
        return ""
    note = f", SM {tele.sm_clock_mhz:.0f} MHz, power-capped {tele.power_capped_share:.0%}"
    if tele.energy_j and output_tokens:
        note += f", {tele.energy_j / output_tokens * 1e3:.1f} mJ/out token"
    return note


def tp_size(system: str) -> int | None:
    """`pagedref-tp2` -> 2: pagedref with its model and KV cache split over 2 GPUs (None: not such a name)."""
    prefix = "pagedref-tp"
    if system.startswith(prefix) and system[len(prefix):].isdigit() and int(system[len(prefix):]) >= 1:
        return int(system[len(prefix):])
    return None


def run_pagedref(model_dir: Path, reqs: list[BenchRequest], kv_cache: str, llm_kwargs: dict[str, Any], log=print,
                 name: str | None = None) -> Result:
    """One engine run over every request; the stats are the engine's own (counted from this generate)."""
    from pagedref import LLM, SamplingParams

    name = name or ("pagedref" if kv_cache == "paged" else "contiguous")
    llm = LLM(model=str(model_dir), kv_cache=kv_cache, **llm_kwargs)
    try:
        # Warm-up (kernel compilation, allocator): two short requests, not timed.
        llm.generate([{"prompt_token_ids": r.prompt_token_ids[:8]} for r in reqs[:2]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
        log(f"[serve] {name}: {len(reqs)} requests, {llm.num_kv_blocks} KV blocks of {BLOCK_SIZE}")
        sync_device(llm_kwargs["device"])
        with telemetry.GpuSampler(telemetry.device_uuid(llm_kwargs["device"]), interval_ms=100) as sampler:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=True)
            sync_device(llm_kwargs["device"])
            elapsed = time.perf_counter() - start
        stats = llm.get_stats()
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        asked = sum(r.output_len for r in reqs)
        if produced != asked:
            raise RuntimeError(f"{name} generated {produced} tokens, {asked} were asked for (ignore_eos)")
        return Result(
            system=name, requests=len(outputs), elapsed_s=elapsed, prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs),
            output_tokens=produced, peak_running_seqs=stats["peak_num_running_seqs"], kv_blocks=stats["num_blocks"],
            peak_kv_blocks_used=stats["peak_num_used_blocks"], kv_token_state_share=stats["token_state_fraction_mean"],
            preemptions=stats["num_preemptions"],
            note=f"{stats['num_steps']} steps" + _graph_note(stats) + _spec_note(stats) + power_note(sampler.result, produced),
            gpu=asdict(sampler.result) if sampler.result else None,
            spec_acceptance_rate=stats["spec_acceptance_rate"] if stats["spec_num_draft_tokens"] else None,
            spec_mean_accepted_length=stats["spec_mean_accepted_length"] if stats["spec_num_draft_tokens"] else None,
        )
    finally:
        llm.close()
        del llm
        free_device(llm_kwargs["device"])


# ------------------------------------------------------------------------------ (c), (d): transformers


def _transformers():
    try:
        import transformers
    except ImportError:
        return None
    return transformers


def _load_hf(model_dir: Path, device: str, dtype: str):
    import torch

    tf = _transformers()
    torch_dtype = getattr(torch, dtype)
    try:  # transformers >= 4.56 calls it dtype; older releases torch_dtype
        model = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
    except TypeError:
        model = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch_dtype)
    return model.to(device).eval()


def static_batches(reqs: list[BenchRequest], kv_budget_tokens: int, max_batch: int) -> list[list[BenchRequest]]:
    """Arrival-order batches; a batch grows while batch_size × (longest prompt + longest output) fits the budget."""
    batches: list[list[BenchRequest]] = []
    cur: list[BenchRequest] = []
    longest_p = longest_o = 0
    for r in reqs:
        p, o = max(longest_p, len(r.prompt_token_ids)), max(longest_o, r.output_len)
        if cur and ((len(cur) + 1) * (p + o) > kv_budget_tokens or len(cur) >= max_batch):
            batches.append(cur)
            cur, p, o = [], len(r.prompt_token_ids), r.output_len
        cur.append(r)
        longest_p, longest_o = p, o
    if cur:
        batches.append(cur)
    return batches


def static_token_state_share(batch: list[BenchRequest]) -> tuple[float, int]:
    """(time-mean share of the batch's KV cache holding its requests' token states, KV steps): a static batch
    holds batch × (longest prompt + t) slots at decode step t; request i fills p_i + min(t, o_i) of them."""
    p = np.array([len(r.prompt_token_ids) for r in batch])
    o = np.array([r.output_len for r in batch])
    t = np.arange(o.max())[:, None]  # [steps, 1]
    useful = (p[None] + np.minimum(t, o[None])).sum(1)  # [steps]
    held = len(batch) * (p.max() + t[:, 0])
    return float((useful / held).mean()), int(o.max())


def generate_static_batch(model, batch: list[BenchRequest], device: str) -> None:
    """One transformers `generate` over a left-padded batch; every member decodes to the longest output."""
    import torch

    plen = max(len(r.prompt_token_ids) for r in batch)
    olen = max(r.output_len for r in batch)
    ids = torch.zeros(len(batch), plen, dtype=torch.long)  # left padding with id 0, masked out
    mask = torch.zeros(len(batch), plen, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, plen - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[i, plen - len(r.prompt_token_ids):] = 1
    # min_new_tokens = max_new_tokens: nothing stops early (ignore_eos), as in the other systems.
    model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=olen,
                   min_new_tokens=olen, do_sample=False, pad_token_id=0)


def run_hf_static(model_dir: Path, reqs: list[BenchRequest], device: str, dtype: str, kv_budget_tokens: int,
                  max_batch: int, time_limit_s: float, log=print) -> Result:
    import torch
    from tqdm import tqdm

    tf = _transformers()
    if tf is None:
        return Result("hf-static", skipped="transformers is not installed")
    model = _load_hf(model_dir, device, dtype)
    try:
        with torch.no_grad():
            generate_static_batch(model, reqs[:2], device)  # warm-up, not timed
            batches = static_batches(reqs, kv_budget_tokens, max_batch)
            log(f"[serve] hf-static: {len(batches)} batches (largest {max(map(len, batches))})")
            done: list[BenchRequest] = []
            shares: list[tuple[float, int]] = []
            sync_device(device)
            start = time.perf_counter()
            for batch in tqdm(batches, desc="hf-static batches", file=sys.stderr):
                generate_static_batch(model, batch, device)
                done += batch
                shares.append(static_token_state_share(batch))
                if time.perf_counter() - start > time_limit_s:
                    break
            sync_device(device)
            elapsed = time.perf_counter() - start
        note = f"{len(shares)} of {len(batches)} batches (time limit {time_limit_s:g} s)" if len(done) < len(reqs) else f"{len(batches)} batches"
        weights = np.array([steps for _, steps in shares], dtype=float)
        return Result(
            system="hf-static", requests=len(done), elapsed_s=elapsed, prompt_tokens=sum(len(r.prompt_token_ids) for r in done),
            output_tokens=sum(r.output_len for r in done), peak_running_seqs=max(len(b) for b in batches[: len(shares)]),
            kv_token_state_share=float(np.average([s for s, _ in shares], weights=weights)), note=note,
        )
    finally:
        del model
        free_device(device)


def continuous_batching_api(model) -> str | None:
    """Which transformers continuous-batching entry point this install has, if any."""
    for name in ("continuous_batching_context_manager", "init_continuous_batching"):
        if hasattr(model, name):
            return name
    return None


def run_hf_continuous(model_dir: Path, reqs: list[BenchRequest], device: str, dtype: str, kv_budget_tokens: int,
                      max_batch_tokens: int, time_limit_s: float, log=print) -> Result:
    """All requests at once into transformers' manager; past time_limit_s it is stopped and only the finished
    requests count (a lower bound on its throughput: the unfinished ones' tokens are left out)."""
    from tqdm import tqdm

    tf = _transformers()
    if tf is None:
        return Result("hf-continuous", skipped="transformers is not installed")
    model = _load_hf(model_dir, device, dtype)
    try:
        api = continuous_batching_api(model)
        if api is None:
            return Result("hf-continuous", skipped=f"not available in transformers {tf.__version__} (no ContinuousBatchingManager)")
        gen_config = tf.GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in reqs), eos_token_id=None,
                                         pad_token_id=0)
        kwargs: dict[str, Any] = {"generation_config": gen_config}
        cb_block = 256  # transformers' default block size
        if hasattr(tf, "ContinuousBatchingConfig"):  # 5.x: the KV budget in its own config
            kwargs["continuous_batching_config"] = tf.ContinuousBatchingConfig(
                num_blocks=max(1, kv_budget_tokens // cb_block), block_size=cb_block, max_batch_tokens=max_batch_tokens)
        else:  # 4.5x: the same knobs on the generation config
            gen_config.num_blocks, gen_config.block_size = max(1, kv_budget_tokens // cb_block), cb_block
            gen_config.max_batch_tokens = max_batch_tokens
        if api == "continuous_batching_context_manager":
            kwargs.update(block=True, timeout=30)  # on exit: stop the generation thread, waiting at most 30 s
            ctx = model.continuous_batching_context_manager(**_accepted(model.continuous_batching_context_manager, kwargs))
        else:
            ctx = _started(model.init_continuous_batching(**_accepted(model.init_continuous_batching, kwargs)))
        with ctx as manager:  # warm-up (CUDA graph capture, where it does it) happens on entry, not timed
            add_kw = {"eos_token_id": -1} if "eos_token_id" in inspect.signature(manager.add_request).parameters else {}
            start = time.perf_counter()
            for i, r in enumerate(reqs):
                manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len, **add_kw)
            finished: dict[str, int] = {}
            bar = tqdm(total=len(reqs), desc="hf-continuous requests", file=sys.stderr)
            while len(finished) < len(reqs) and time.perf_counter() - start < time_limit_s:
                res = manager.get_result(timeout=1)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped before every request finished")
                    continue
                if res.is_finished() and res.request_id not in finished:
                    if getattr(res, "error", None):
                        raise RuntimeError(f"transformers' continuous batching failed request {res.request_id}: {res.error}")
                    finished[res.request_id] = len(res.generated_tokens)
                    bar.update(1)
            sync_device(device)
            elapsed = time.perf_counter() - start
            bar.close()
        done = [r for i, r in enumerate(reqs) if f"r{i}" in finished]
        note = f"transformers {tf.__version__} {api}, KV {kv_budget_tokens // cb_block} blocks of {cb_block}"
        if len(done) < len(reqs):
            note += f"; stopped at the time limit ({time_limit_s:g} s) with {len(done)} of {len(reqs)} done: a lower bound"
        return Result(
            system="hf-continuous", requests=len(done), elapsed_s=elapsed,
            prompt_tokens=sum(len(r.prompt_token_ids) for r in done), output_tokens=sum(finished.values()), note=note,
        )
    finally:
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        del model
        free_device(device)


def _accepted(fn, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


@contextlib.contextmanager
def _started(manager):
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=True)


# ---------------------------------------------------------------------------------------------- report


def format_table(results: list[Result], baseline: str = "pagedref") -> str:
    base = next((r for r in results if r.system == baseline and not r.skipped and r.elapsed_s), None)
    head = f"{'system':<14} {'requests':>8} {'time s':>8} {'req/s':>7} {'out tok/s':>10} {'pagedref x':>10} " \
           f"{'peak seqs':>9} {'KV used':>11} {'token share':>11} {'preempt':>7}  note"
    lines = [head, "-" * len(head)]
    for r in results:
        if r.skipped:
            lines.append(f"{r.system:<14} skipped: {r.skipped}")
            continue
        ratio = f"{base.output_tokens_per_s / r.output_tokens_per_s:.2f}" if base and r.output_tokens_per_s else "-"
        used = f"{r.peak_kv_blocks_used}/{r.kv_blocks}" if r.kv_blocks else "-"
        share = f"{r.kv_token_state_share:.1%}" if r.kv_token_state_share is not None else "-"
        seqs = "-" if r.peak_running_seqs is None else str(r.peak_running_seqs)
        pre = "-" if r.preemptions is None else str(r.preemptions)
        lines.append(f"{r.system:<14} {r.requests:>8} {r.elapsed_s:>8.1f} {r.requests_per_s:>7.2f} {r.output_tokens_per_s:>10.1f} "
                     f"{ratio:>10} {seqs:>9} {used:>11} {share:>11} {pre:>7}  {r.note}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedref.bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default=None,
                   help=f"{'|'.join(SHAPES)}, or several separated by commas (default llama-3.1-8b on cuda, tiny on cpu)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests (default {NUM_PROMPTS}, vLLM's benchmark_throughput's; on the CPU and with --quick, 100)")
    p.add_argument("--input-len", type=int, default=None, help="fix every prompt's length instead of drawing it")
    p.add_argument("--output-len", type=int, default=None, help="fix every output's length instead of drawing it")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=4096,
                   help=f"the KV budget in blocks of {BLOCK_SIZE} tokens, for every system (0 = profile from --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: the engine's (1024 on a GPU of >= 70 GiB, as vLLM's; 256 otherwise)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's token budget per step (default: the engine's)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="pagedref and contiguous issue every step's launches eagerly instead of replaying CUDA graphs "
                        "(cuda; pagedref-tpN always runs eagerly; the system pagedref-eager does too)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding for the pagedref systems (vLLM's keys, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'); the acceptance rate is printed")
    p.add_argument("--workload", choices=("sharegpt", "copy"), default="sharegpt",
                   help="copy: each prompt is a passage then its opening again (answers that copy it repeat its spans)")
    p.add_argument("--hf-batch-size", type=int, default=256, help="cap on a static transformers batch")
    p.add_argument("--hf-time-limit", type=float, default=None,
                   help="seconds per transformers system (default 100, --quick 30): hf-static starts no batch after it "
                        "(its rate is measured on the batches done); hf-continuous is stopped and counts its finished requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the random-weight checkpoints are written once and reused")
    p.add_argument("--quick", action="store_true", help="100 requests, 30 s per transformers system (a smoke test)")
    add_output_flags(p, "output tokens/s per system")
    return p


def plot(doc: dict[str, Any], path: Path) -> None:
    """Output tokens/s of every system, one group of bars per model shape, pagedref's ratio over each bar."""
    plt = pyplot()
    shapes = doc["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        rows = [r for r in s["results"] if not r["skipped"]]
        base = next((r["output_tokens_per_s"] for r in rows if r["system"] == "pagedref"), None)
        bars = ax.bar([r["system"] for r in rows], [r["output_tokens_per_s"] for r in rows],
                      color=["#4C72B0" if r["system"] == "pagedref" else "#999999" for r in rows])
        for bar, r in zip(bars, rows):
            if base and r["output_tokens_per_s"]:
                ax.annotate(f"{base / r['output_tokens_per_s']:.1f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=9)
        ax.set_title(f"{s['shape']}: {s['num_prompts']} ShareGPT-like requests, {s['kv_budget_tokens']:,} KV slots", fontsize=9)
        ax.set_ylabel("output tokens / s")
        ax.tick_params(axis="x", labelsize=8)
    env = doc["environment"]
    fig.suptitle(f"bench serve on {env.get('gpu', env['device'])}, {env['date']} (labels: pagedref's speed-up)", fontsize=9)
    save_figure(fig, path)
    plt.close(fig)


def print_report(doc: dict[str, Any]) -> None:
    env = doc["environment"]
    print(f"\nserve: {env.get('gpu', env['device'])}, torch {env['torch']}, transformers {env['transformers']}, "
          f"commit {env['commit']}, {env['date']}")
    for s in doc["shapes"]:
        print(f"\n{s['shape']}: {s['num_prompts']} requests, mean prompt {s['mean_prompt_len']:.0f} / output "
              f"{s['mean_output_len']:.0f} tokens, KV budget {s['kv_budget_tokens']:,} token slots "
              f"(pagedref x = pagedref's output tokens/s over the system's)")
        print(s["table"])


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str], str]:
    """(shapes, systems, device), every flag checked; defaults that depend on the device or --quick filled in."""
    from pagedref.generate import resolve_device

    device = resolve_device(args.device, parser)
    shapes = (args.model_shape or ("llama-3.1-8b" if device == "cuda" else "tiny")).split(",")
    for s in shapes:
        if s not in SHAPES:
            parser.error(f"--model-shape {s!r}: choose from {', '.join(SHAPES)}")
    systems = args.systems.split(",")
    for s in systems:
        if s not in SYSTEMS and s not in ("pagedref-eager", "pagedref-sync", "pagedref-gemm") and tp_size(s) is None:
            parser.error(f"--systems: unknown system {s!r} (choose from {', '.join(SYSTEMS)}, pagedref-sync for "
                         "pagedref without async scheduling, pagedref-gemm for pagedref on its own Hopper GEMM, "
                         "pagedref-eager for "
                         "pagedref without CUDA graphs, or pagedref-tpN for pagedref with tensor_parallel_size=N)")
    if args.num_prompts is None:
        args.num_prompts = 100 if args.quick or device == "cpu" else NUM_PROMPTS  # the CPU's tiny shape: a smoke run
    if args.hf_time_limit is None:
        args.hf_time_limit = 30.0 if args.quick else 100.0
    if args.hf_time_limit <= 0:
        parser.error(f"--hf-time-limit must be > 0, got {args.hf_time_limit}")
    require_positive(parser, args, "num_prompts", "hf_batch_size", "max_num_seqs", "input_len", "output_len",
                     "max_num_batched_tokens")
    if args.num_kv_blocks < 0:
        parser.error(f"--num-kv-blocks must be >= 0, got {args.num_kv_blocks}")
    if args.num_kv_blocks == 0 and device == "cpu":
        parser.error("--num-kv-blocks 0 (profile the GPU) needs --device cuda")
    if args.num_kv_blocks and args.num_kv_blocks * BLOCK_SIZE < MAX_MODEL_LEN:
        parser.error(f"--num-kv-blocks {args.num_kv_blocks} holds fewer than one sequence of {MAX_MODEL_LEN} tokens")
    if (args.input_len or 0) + (args.output_len or 0) > MAX_MODEL_LEN:
        parser.error(f"--input-len + --output-len must be <= max_model_len {MAX_MODEL_LEN}")
    from pagedref.generate import parse_speculative_config

    args.speculative_config = parse_speculative_config(parser, args.speculative_config)
    if args.speculative_config is not None:
        bad = [s for s in systems if tp_size(s) is not None]
        if bad:
            parser.error(f"--speculative-config runs on one GPU: drop {', '.join(bad)} from --systems")
    return shapes, systems, device


def run_shape(args: argparse.Namespace, shape: str, systems: list[str], device: str, log, on_result=None) -> dict[str, Any]:
    """Every system on one shape; on_result(partial document) after each, so a later crash keeps the numbers."""
    dtype = "bfloat16" if device == "cuda" else "float32"  # CPU: the reference path's float32
    model_dir = random_model_dir(shape, args.model_dir, device, seed=args.seed, log=log)
    cfg = SHAPES[shape]
    reqs = make_requests(args.num_prompts, cfg["vocab_size"], args.seed, args.input_len, args.output_len, args.workload)
    llm_kwargs = engine_args(device, dtype, args.num_kv_blocks, args.max_num_seqs, args.max_num_batched_tokens,
                             args.gpu_memory_utilization, args.enforce_eager, args.speculative_config)
    num_kv_blocks = args.num_kv_blocks
    results: list[Result] = []
    for system in systems:
        log(f"[serve] {shape}: {system}")
        try:
            if system == "pagedref-eager":  # pagedref without CUDA graphs: what the graphs are worth
                res = run_pagedref(model_dir, reqs, "paged", {**llm_kwargs, "num_kv_blocks": num_kv_blocks or None,
                                                              "enforce_eager": True}, log, system)
            elif system == "pagedref-gemm":  # pagedref with gate/up and down on kernels.gemm (sm_90)
                res = run_pagedref(model_dir, reqs, "paged", {**llm_kwargs, "num_kv_blocks": num_kv_blocks or None,
                                                              "weight_gemm": "pagedref"}, log, system)
            elif system == "pagedref-sync":  # pagedref scheduling each step after the last one's tokens are back
                res = run_pagedref(model_dir, reqs, "paged", {**llm_kwargs, "num_kv_blocks": num_kv_blocks or None,
                                                              "async_scheduling": False}, log, system)
            elif system in ("pagedref", "contiguous"):  # (speculation needs paged blocks: not the contiguous baseline)
                res = run_pagedref(model_dir, reqs, "paged" if system == "pagedref" else "contiguous",
                                   {**llm_kwargs, "num_kv_blocks": num_kv_blocks or None,
                                    **({"speculative_config": None} if system == "contiguous" else {})}, log)
                num_kv_blocks = num_kv_blocks or res.kv_blocks  # profiled once: the same budget for the rest
            elif tp_size(system) is not None:  # the same engine over N GPUs: each holds 1/N of every block
                res = run_pagedref(model_dir, reqs, "paged", {**llm_kwargs, "num_kv_blocks": num_kv_blocks or None,
                                                              "tensor_parallel_size": tp_size(system),
                                                              "enforce_eager": True}, log, system)
            elif system == "hf-static":
                res = run_hf_static(model_dir, reqs, device, dtype, _budget_tokens(num_kv_blocks, args), args.hf_batch_size,
                                    args.hf_time_limit, log)
            else:
                res = run_hf_continuous(model_dir, reqs, device, dtype, _budget_tokens(num_kv_blocks, args),
                                        args.max_num_batched_tokens or (8192 if device == "cuda" else 2048),
                                        args.hf_time_limit, log)
        except Exception as err:  # one failing system must not cost the others' numbers (the GPU run is expensive)
            log(f"[serve] {system} failed: {type(err).__name__}: {err}")
            res = Result(system, skipped=f"failed: {type(err).__name__}: {err}")
            free_device(device)
        results.append(res)
        if on_result:
            on_result(shape_doc(shape, reqs, num_kv_blocks, results))
    return shape_doc(shape, reqs, num_kv_blocks, results)


def shape_doc(shape: str, reqs: list[BenchRequest], num_kv_blocks: int, results: list[Result]) -> dict[str, Any]:
    return {
        "shape": shape,
        "num_prompts": len(reqs),
        "mean_prompt_len": float(np.mean([len(r.prompt_token_ids) for r in reqs])),
        "mean_output_len": float(np.mean([r.output_len for r in reqs])),
        "kv_budget_tokens": (num_kv_blocks or 0) * BLOCK_SIZE,
        "results": [r.as_dict() for r in results],
        "table": format_table(results),
    }


def _budget_tokens(num_kv_blocks: int, args: argparse.Namespace) -> int:
    if num_kv_blocks:
        return num_kv_blocks * BLOCK_SIZE
    raise RuntimeError("the KV budget is profiled by the pagedref run: list pagedref first in --systems, or pass --num-kv-blocks")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_or_replay(parser, argv, print_report, plot)
    if args is None:
        return 0
    shapes, systems, device = check_args(parser, args)
    log = progress
    doc = {"benchmark": "serve", "command": "python -m pagedref.bench serve " + " ".join(argv if argv is not None else sys.argv[1:]),
           "environment": environment(device), "shapes": []}

    def save(partial: dict[str, Any]) -> None:
        if args.json_out:
            args.json_out.write_text(json.dumps({**doc, "shapes": doc["shapes"] + [partial]}, indent=2))

    for shape in shapes:
        doc["shapes"].append(run_shape(args, shape, systems, device, log, on_result=save))
    emit(doc, args, print_report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
