"""`python -m pagedref.bench latency`: what chunked prefill does to inter-token latency, and what it costs.

One idea: a stream of short chat requests is decoding when, now and then, a long prompt (8k
tokens) arrives. Without chunking, the step that prefills it carries all 8k tokens, and every
running chat request waits that whole step for its next token: an inter-token latency (ITL) spike.
With chunked prefill (stage 7) a step carries at most `max_num_batched_tokens` tokens, decodes
first, so the long prompt is spread over several steps and no decode waits long. The same arrival
trace (chat and long prompts each a Poisson stream, as vLLM's serving benchmark draws arrivals, or
long prompts on a fixed clock with `--long-arrivals fixed`; wall-clock times) is replayed through
`LLMEngine.add_request` / `step` for chunked prefill at budgets 512, 2048 and 8192 and for the two
policies without chunking: `no-chunking` (a whole prompt mixed into the decodes' step: vLLM v1,
Orca) and `prefill-first` (prompts in steps of their own, decodes wait: vLLM v0, nano-vllm). Every
token's wall time is recorded when the step that sampled it returns; ITL is the gap between
consecutive tokens of a chat request, TTFT the wait for the first one.

Throughput is tokens over the makespan (first arrival to last token). While the engine keeps up with
the arrivals that is the offered load whatever the budget; a budget that costs capacity shows as a
longer makespan.

Invariant: each configuration sees the same requests at the same arrival times, with the same
random-weight model (`pagedref.bench.common.random_model_dir`) and the same KV pool.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedref.bench.common import (SHAPES, add_output_flags, emit, environment, free_device, parse_or_replay, progress,
                                   pyplot, random_model_dir, require_positive, save_figure, sharegpt_lengths, sync_device)

# A long prompt every 0.5 s on average for the 30 s of chat arrivals: at the 8B shape on an H200 its
# prefill takes ~0.3 s of the GPU, and with CUDA graphs a decode step ~15 ms, so the long prompts'
# steps are a few percent of all steps (P99 must see them) while the engine still keeps up with the
# arrivals.
CUDA_DEFAULTS = dict(long_prompt_len=8192, budgets="512,2048,8192", num_short=480, num_long=60, request_rate=16.0,
                     long_interval=0.5, short_output_len=128, long_output_len=32, num_kv_blocks=16384)
CPU_DEFAULTS = dict(long_prompt_len=256, budgets="16,64,256", num_short=8, num_long=2, request_rate=float("inf"),
                    long_interval=0.0, short_output_len=16, long_output_len=4, num_kv_blocks=1024)


LONG_ARRIVALS = ("fixed", "poisson")


@dataclass(frozen=True)
class Arrival:
    time: float  # seconds after the start
    prompt_token_ids: list[int]
    output_len: int
    kind: str  # "chat" or "long"


def make_trace(num_short: int, num_long: int, rate: float, long_interval: float, long_prompt_len: int,
               short_output_len: int, long_output_len: int, vocab_size: int, seed: int,
               long_arrivals: str = "poisson") -> list[Arrival]:
    """Chat prompts with ShareGPT-like lengths arriving as a Poisson stream (rate inf: all at 0), and
    long prompts at (j + 1/2) × long_interval ("fixed"), or as a Poisson stream of the same mean
    interval ("poisson": now and then two arrive close together); sorted by time. The prompts' tokens
    are the same either way."""
    if long_arrivals not in LONG_ARRIVALS:
        raise ValueError(f"long_arrivals must be one of {LONG_ARRIVALS}, got {long_arrivals!r}")
    long_times = (np.arange(num_long) + 0.5) * long_interval
    if long_arrivals == "poisson":
        long_times = np.cumsum(np.random.default_rng(seed + 1).exponential(long_interval, num_long))
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, num_short) if np.isfinite(rate) else np.zeros(num_short)
    times = np.cumsum(gaps)
    trace = [Arrival(float(t), rng.integers(0, vocab_size, p).tolist(), short_output_len, "chat")
             for t, (p, _) in zip(times, sharegpt_lengths(rng, num_short))]
    trace += [Arrival(float(t), rng.integers(0, vocab_size, long_prompt_len).tolist(), long_output_len, "long")
              for t in long_times]
    return sorted(trace, key=lambda a: a.time)


@dataclass
class Timeline:
    """Per request: arrival time and the wall time of each of its tokens."""

    arrival: dict[str, float] = field(default_factory=dict)
    kind: dict[str, str] = field(default_factory=dict)
    token_times: dict[str, list[float]] = field(default_factory=dict)

    def itl(self, kind: str = "chat") -> np.ndarray:
        gaps = [np.diff(t) for rid, t in self.token_times.items() if self.kind[rid] == kind and len(t) > 1]
        return np.concatenate(gaps) if gaps else np.zeros(0)

    def ttft(self, kind: str) -> np.ndarray:
        return np.array([t[0] - self.arrival[rid] for rid, t in self.token_times.items() if self.kind[rid] == kind and t])


def replay(engine, trace: list[Arrival]) -> tuple[Timeline, float, int]:
    """Feed the trace in wall-clock time and step until everything is done: (timeline, makespan s, steps)."""
    from pagedref import SamplingParams

    tl = Timeline()
    pending = list(trace)
    steps = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].time <= now:
            a = pending.pop(0)
            rid = f"{a.kind}-{len(tl.arrival)}"
            engine.add_request(rid, {"prompt_token_ids": a.prompt_token_ids},
                               SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True))
            tl.arrival[rid], tl.kind[rid], tl.token_times[rid] = a.time, a.kind, []
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(pending[0].time - now, 0.01)))  # idle until the next arrival
            continue
        outputs = engine.step()  # returns after sampling: the tokens exist now
        steps += 1
        t = time.perf_counter() - start
        for out in outputs:
            times = tl.token_times[out.request_id]
            times += [t] * (len(out.outputs[0].token_ids) - len(times))
    return tl, time.perf_counter() - start, steps


# The unchunked policies: configuration name → prefill_first.
UNCHUNKED = {"no-chunking": False, "prefill-first": True}


def config_name(config: int | str) -> str:
    return config if isinstance(config, str) else f"chunked-{config}"


def run_config(model_dir: Path, trace: list[Arrival], config: int | str, args: argparse.Namespace, device: str,
               max_model_len: int, log) -> dict[str, Any]:
    """One configuration: chunked prefill at a budget of `config` tokens per step (an int), or the
    unchunked policy named `config` (a key of UNCHUNKED)."""
    from pagedref import LLM, SamplingParams

    name = config_name(config)
    chunked = not isinstance(config, str)
    # Without chunking a whole prompt must fit in one step beside every running decode (the same
    # budget for both policies, so the policy is the only difference).
    tokens = config if chunked else max_model_len + args.max_num_seqs
    llm = LLM(model=str(model_dir), device=device, dtype="bfloat16" if device == "cuda" else "float32",
              max_model_len=max_model_len, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=tokens,
              enable_chunked_prefill=chunked, enable_prefix_caching=False, num_kv_blocks=args.num_kv_blocks,
              enforce_eager=args.enforce_eager, prefill_first=not chunked and UNCHUNKED[config])
    try:
        llm.generate([{"prompt_token_ids": trace[0].prompt_token_ids[:8]}], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        sync_device(device)
        log(f"[latency] {name}: {len(trace)} requests, max_num_batched_tokens={tokens}")
        engine = llm.llm_engine
        engine.reset_stats()
        tl, makespan, steps = replay(engine, trace)
        stats = engine.get_stats()
    finally:
        llm.close()
        del llm
        free_device(device)
    itl = tl.itl("chat") * 1e3
    out_tokens = sum(len(t) for t in tl.token_times.values())
    prompt_tokens = sum(len(a.prompt_token_ids) for a in trace)
    pct = lambda x, q: float(np.percentile(x, q)) if len(x) else float("nan")  # noqa: E731
    return {
        "config": name, "max_num_batched_tokens": tokens, "steps": steps, "makespan_s": makespan,
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99), "itl_max_ms": float(itl.max()) if len(itl) else float("nan"),
        "ttft_chat_p50_ms": pct(tl.ttft("chat") * 1e3, 50), "ttft_chat_p99_ms": pct(tl.ttft("chat") * 1e3, 99),
        "ttft_long_p50_ms": pct(tl.ttft("long") * 1e3, 50),
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / makespan,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / makespan,
        "peak_running_seqs": stats["peak_num_running_seqs"], "preemptions": stats["num_preemptions"],
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per configuration; P99 and throughput relative to each unchunked policy that ran."""
    bases = [r for r in rows if r["config"] in UNCHUNKED and "skipped" not in r]
    head = (f"{'config':<15} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'ITL max ms':>10} {'TTFT chat p50':>13} "
            f"{'TTFT long p50':>13} {'out tok/s':>9} {'steps':>6} {'preempt':>7}"
            + "".join(f" {'p99/' + b['config']:>18} {'tok/s vs ' + b['config']:>23}" for b in bases))
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['config']:<15} failed: {r['skipped']}")
            continue
        rel = "".join(f" {r['itl_p99_ms'] / b['itl_p99_ms']:>18.1%} {r['output_tokens_per_s'] / b['output_tokens_per_s'] - 1:>+23.1%}"
                      for b in bases)
        lines.append(f"{r['config']:<15} {r['itl_p50_ms']:>10.1f} {r['itl_p99_ms']:>10.1f} {r['itl_max_ms']:>10.1f} "
                     f"{r['ttft_chat_p50_ms']:>13.1f} {r['ttft_long_p50_ms']:>13.1f} {r['output_tokens_per_s']:>9.1f} "
                     f"{r['steps']:>6} {r['preemptions']:>7}{rel}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedref.bench latency", description=__doc__.split("\n\n")[0],
                                epilog="Defaults are the H200 run's on cuda and a seconds-long scaled-down run on cpu.")
    p.add_argument("--model-shape", default=None, help=f"{'|'.join(SHAPES)} (default llama-3.1-8b on cuda, tiny on cpu)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--long-prompt-len", type=int, default=None, help="tokens of each long prompt (cuda 8192, cpu 256)")
    p.add_argument("--budgets", default=None, help="chunked-prefill token budgets, comma-separated (cuda 512,2048,8192; cpu 16,64,256)")
    p.add_argument("--unchunked", default=",".join(UNCHUNKED),
                   help="the policies without chunking to run first, comma-separated: no-chunking (a prompt mixed into "
                        "the decodes' step, vLLM v1), prefill-first (prompts in steps of their own, vLLM v0); '' for none")
    p.add_argument("--num-short", type=int, default=None, help="chat requests (cuda 480, cpu 8)")
    p.add_argument("--num-long", type=int, default=None, help="long-prompt requests (cuda 60, cpu 2)")
    p.add_argument("--request-rate", type=float, default=None, help="chat arrivals per second, inf = all at once (cuda 16)")
    p.add_argument("--long-interval", type=float, default=None, help="seconds between long prompts (cuda 0.5)")
    p.add_argument("--long-arrivals", choices=LONG_ARRIVALS, default="poisson",
                   help="long prompts as a Poisson stream of mean interval --long-interval (default), or one every "
                        "--long-interval s (fixed)")
    p.add_argument("--short-output-len", type=int, default=None, help="tokens each chat request generates (cuda 128)")
    p.add_argument("--long-output-len", type=int, default=None, help="tokens each long request generates (cuda 32)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="the KV pool, blocks of 16 (cuda 16384, cpu 1024)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="issue every step's launches eagerly instead of replaying CUDA graphs (cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=None, help="where random-weight checkpoints are kept (default: the temp dir)")
    p.add_argument("--quick", action="store_true", help="a quarter of the requests")
    add_output_flags(p, "ITL P50/P99 and throughput per configuration")
    return p


def plot(doc: dict[str, Any], path: Path) -> None:
    """ITL P50 and P99 per configuration (bars), output tokens/s beside them (line, right axis)."""
    plt = pyplot()
    rows = [r for r in doc["results"] if "skipped" not in r]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(1.5 + 1.4 * len(rows), 4))
    ax.bar(x - 0.2, [r["itl_p50_ms"] for r in rows], 0.4, label="ITL P50", color="#55A868")
    ax.bar(x + 0.2, [r["itl_p99_ms"] for r in rows], 0.4, label="ITL P99", color="#C44E52")
    ax.set_xticks(x, [r["config"] for r in rows])
    ax.set_ylabel("inter-token latency of the chat requests (ms)")
    ax2 = ax.twinx()
    ax2.plot(x, [r["output_tokens_per_s"] for r in rows], "o-", color="#4C72B0", label="output tokens/s")
    ax2.set_ylabel("output tokens / s")
    ax2.set_ylim(0, 1.3 * max(r["output_tokens_per_s"] for r in rows))  # the line clear of the legend
    ax.set_ylim(0, 1.3 * max(r["itl_p99_ms"] for r in rows))
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper right", ncol=3)
    w, env = doc["workload"], doc["environment"]
    ax.set_title(f"{doc['shape']} on {env.get('gpu', env['device'])}: {w['chat_requests']} chat requests + "
                 f"{w['long_requests']} prompts of {w['long_prompt_len']} tokens"
                 f"{', all arriving as Poisson streams' if w.get('long_arrivals') == 'poisson' else ''}", fontsize=9)
    save_figure(fig, path)
    plt.close(fig)


def print_report(doc: dict[str, Any]) -> None:
    env, w = doc["environment"], doc["workload"]
    print(f"\nlatency: {doc['shape']} on {env.get('gpu', env['device'])}, torch {env['torch']}, commit {env['commit']}, {env['date']}")
    print(f"{w['chat_requests']} chat requests ({w['request_rate']}/s, {w['chat_output_len']} tokens each) + {w['long_requests']} "
          f"prompts of {w['long_prompt_len']} tokens every {w['long_interval_s']} s"
          f"{' on average (Poisson)' if w.get('long_arrivals') == 'poisson' else ''}; ITL over the chat requests")
    print(doc["table"])


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, list[int | str]]:
    """(device, configurations: unchunked policy names, then budgets), every flag checked; the device's
    defaults (and --quick's cut) filled in."""
    import tempfile

    from pagedref.generate import resolve_device

    device = resolve_device(args.device, parser)
    for key, value in (CUDA_DEFAULTS if device == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.num_short, args.num_long = max(1, args.num_short // 4), max(1, args.num_long // 4)
    args.model_shape = args.model_shape or ("llama-3.1-8b" if device == "cuda" else "tiny")
    if args.model_shape not in SHAPES:
        parser.error(f"--model-shape {args.model_shape!r}: choose from {', '.join(SHAPES)}")
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--budgets {args.budgets!r}: expected comma-separated integers")
    if any(b < 1 for b in budgets):
        parser.error(f"--budgets {args.budgets!r}: every budget must be >= 1")
    unchunked = [u.strip() for u in args.unchunked.split(",") if u.strip()]
    for u in unchunked:
        if u not in UNCHUNKED:
            parser.error(f"--unchunked {u!r}: choose from {', '.join(UNCHUNKED)}")
    require_positive(parser, args, "long_prompt_len", "num_short", "short_output_len", "long_output_len", "num_kv_blocks",
                     "max_num_seqs")
    if args.num_long < 0 or args.long_interval < 0 or not args.request_rate > 0:
        parser.error("--num-long and --long-interval must be >= 0 and --request-rate > 0")
    args.model_dir = args.model_dir or Path(tempfile.gettempdir())
    return device, [*unchunked, *budgets]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_or_replay(parser, argv, print_report, plot)
    if args is None:
        return 0
    device, configs = check_args(parser, args)
    log = progress
    cfg = SHAPES[args.model_shape]
    max_model_len = max(args.long_prompt_len + args.long_output_len, 1024 + args.short_output_len)
    if max_model_len > cfg["max_position_embeddings"]:
        raise SystemExit(f"error: --long-prompt-len {args.long_prompt_len} is longer than {args.model_shape}'s context")
    model_dir = random_model_dir(args.model_shape, args.model_dir, device, seed=args.seed, log=log)
    trace = make_trace(args.num_short, args.num_long, args.request_rate, args.long_interval, args.long_prompt_len,
                       args.short_output_len, args.long_output_len, cfg["vocab_size"], args.seed, args.long_arrivals)
    doc = {"benchmark": "latency", "command": "python -m pagedref.bench latency " + " ".join(argv if argv is not None else sys.argv[1:]),
           "environment": environment(device), "shape": args.model_shape,
           "workload": {"chat_requests": args.num_short, "long_requests": args.num_long, "request_rate": args.request_rate,
                        "long_interval_s": args.long_interval, "long_arrivals": args.long_arrivals,
                        "long_prompt_len": args.long_prompt_len,
                        "chat_output_len": args.short_output_len, "long_output_len": args.long_output_len,
                        "num_kv_blocks": args.num_kv_blocks, "max_num_seqs": args.max_num_seqs},
           "results": []}
    for config in configs:  # the unchunked baselines first
        try:
            row = run_config(model_dir, trace, config, args, device, max_model_len, log)
        except Exception as err:  # keep the other configurations' numbers
            log(f"[latency] {config_name(config)} failed: {type(err).__name__}: {err}")
            row = {"config": config_name(config), "skipped": f"{type(err).__name__}: {err}"}
            free_device(device)
        doc["results"].append(row)
        if args.json_out:
            args.json_out.write_text(json.dumps(doc, indent=2))
    doc["table"] = format_table(doc["results"])
    emit(doc, args, print_report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
