"""`python -m pagedref.bench online`: online serving, over HTTP, as vLLM's `benchmark_serving` measures it.

One idea: `bench serve`'s workload (the same ShareGPT-like requests, `pagedref.bench.serve.make_requests`,
random token-id prompts, each generating exactly its output length with `ignore_eos`, greedy) sent to a
live `pagedref.serve` server as streamed /v1/completions, arriving as a Poisson process at each
`--request-rate` (requests per second; `inf`: all at time 0), and the figures `benchmark_serving`
reports, from the client's side of the socket:

  - request throughput, output and total token throughput (per second of the run);
  - TTFT, time to first token: from sending the request to its first text chunk;
  - TPOT, time per output token after the first: (latency - TTFT) / (output tokens - 1), per request;
  - ITL, inter-token latency: the gap between two consecutive chunks, over every chunk of every request;
  - E2EL, end-to-end latency; each as mean, median and P99 (and std), in milliseconds.

By default it starts the server itself (a subprocess on 127.0.0.1, a free port) with `bench serve`'s
engine settings (`pagedref.bench.serve.engine_args`: the same KV pool of --num-kv-blocks blocks, block
size, max_model_len, max_num_seqs, no prefix caching) on `bench serve`'s random weights at --model-shape
(8B on a GPU), so its `inf` throughput is comparable with `bench serve`'s offline one; `--compare-offline`
then stops the server and runs `bench serve`'s pagedref system on the same requests and engine settings,
and reports both, with the engine's steps per second each way (the server's from its /metrics) and the KV
pool each got. `--num-kv-blocks 0` sizes the pool from `--gpu-memory-utilization` instead (vLLM's way;
the server's engine profiles it in its own process, the offline engine in this one). `--base-url`
targets a server already running instead.

Invariant: every rate sends the same requests in the same order, and only requests that returned every
token asked for count as completed (the others are reported as failed, with their errors).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedref.bench.common import (SHAPES, add_output_flags, emit, environment, parse_or_replay, progress, pyplot,
                                   random_model_dir, require_positive, save_figure)
from pagedref.bench.memory import BLOCK_SIZE, MAX_MODEL_LEN
from pagedref.bench.serve import NUM_PROMPTS, BenchRequest, engine_args, make_requests, run_pagedref

SERVED_NAME = "bench"


# --------------------------------------------------------------------------------------------- the client


@dataclass
class RequestResult:
    """One request as the client saw it (seconds, time.perf_counter)."""

    prompt_len: int
    output_len: int  # asked for
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between consecutive text chunks
    output_tokens: int = 0  # generated, as the server's usage counts them


async def send(client, url: str, req: BenchRequest, model: str) -> RequestResult:
    """One streamed completion; every chunk timed on arrival (vLLM's async_request_openai_completions)."""
    result = RequestResult(len(req.prompt_token_ids), req.output_len)
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("error"):
                    result.error = chunk["error"]["message"]
                    return result
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except Exception as err:  # a broken connection is this request's failure, not the run's
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.latency = last - start
    result.ok = result.output_tokens == req.output_len
    if not result.ok:
        result.error = f"got {result.output_tokens} tokens, asked for {req.output_len}"
    return result


async def run_rate(url: str, model: str, reqs: list[BenchRequest], rate: float, seed: int,
                   max_concurrency: int | None) -> tuple[list[RequestResult], float]:
    """Send every request, arrivals a Poisson process of `rate` per second (inf: all at once); (results, duration)."""
    import httpx

    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = httpx.Timeout(None, connect=60.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                return await send(client, url, req, model)
            async with limit:
                return await send(client, url, req, model)

        tasks = []
        start = time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.create_task(one(req)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))  # vLLM's get_request, burstiness 1
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict[str, Any]:
    """benchmark_serving's figures (vLLM's calculate_metrics): throughputs, and TTFT/TPOT/ITL/E2EL in ms."""
    done = [r for r in results if r.ok]
    errors = sorted({r.error for r in results if not r.ok})
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    doc = {
        "request_rate": "inf" if rate == float("inf") else rate,
        "completed": len(done), "failed": len(results) - len(done), "errors": errors[:5],
        "duration_s": duration, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for name, values in (("ttft", [r.ttft for r in done]), ("tpot", tpots), ("itl", [x for r in done for x in r.itl]),
                         ("e2el", [r.latency for r in done])):
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        doc[f"{name}_ms"] = ({"mean": float(ms.mean()), "median": float(np.median(ms)), "p99": float(np.percentile(ms, 99)),
                              "std": float(ms.std())} if ms.size else dict.fromkeys(("mean", "median", "p99", "std"), 0.0))
    return doc


# --------------------------------------------------------------------------------------------- the server


def serve_flags(llm_kwargs: dict[str, Any]) -> list[str]:
    """`LLM(...)` keywords as `python -m pagedref.serve` flags (the server's engine flags are LLM's names)."""
    flags = []
    for key, value in llm_kwargs.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


class ServerProcess:
    """`python -m pagedref.serve` on 127.0.0.1 and a free port, its output forwarded to `log` with a prefix."""

    def __init__(self, model_dir: Path, llm_kwargs: dict[str, Any], log, timeout: float = 900.0) -> None:
        cmd = [sys.executable, "-m", "pagedref.serve", "--model", str(model_dir), *serve_flags(llm_kwargs),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
        log(f"[online] starting the server: {' '.join(cmd[1:])}")
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ready: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._forward, daemon=True).start()
        try:
            url = self.ready.get(timeout=timeout)  # loading 8B weights and capturing CUDA graphs takes a while
        except queue.Empty:
            url = None
        if url is None:
            self.stop()
            raise RuntimeError("the server did not start (its output is above)")
        self.url = url

    def _forward(self) -> None:
        for line in self.proc.stdout:
            m = re.search(r"pagedref\.serve: ready on (http://\S+)", line)
            if m:
                self.ready.put(m.group(1))
            self.log(f"[server] {line.rstrip()}")
        self.ready.put(None)

    def stop(self) -> int | None:
        """SIGTERM, as an operator would; the server's exit status (None if it had to be killed)."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


# ------------------------------------------------------------------------------------------------ report


def format_table(runs: list[dict[str, Any]]) -> str:
    head = (f"{'rate':>6} {'done':>6} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
            f"{'TTFT ms mean/med/P99':>24} {'TPOT ms mean/med/P99':>22} {'ITL ms mean/med/P99':>22}")
    lines = [head, "-" * len(head)]
    for r in runs:
        cells = [f"{r[k]['mean']:.1f}/{r[k]['median']:.1f}/{r[k]['p99']:.1f}" for k in ("ttft_ms", "tpot_ms", "itl_ms")]
        lines.append(f"{str(r['request_rate']):>6} {r['completed']:>6} {r['request_throughput']:>7.2f} "
                     f"{r['output_throughput']:>10.1f} {r['total_token_throughput']:>10.1f} {cells[0]:>24} {cells[1]:>22} {cells[2]:>22}")
    return "\n".join(lines)


def print_report(doc: dict[str, Any]) -> None:
    env = doc["environment"]
    w = doc["workload"]
    print(f"\nonline: {env.get('gpu', env['device'])}, torch {env['torch']}, commit {env['commit']}, {env['date']}")
    print(f"{doc['model']}: {w['num_prompts']} requests, mean prompt {w['mean_prompt_len']:.0f} / output "
          f"{w['mean_output_len']:.0f} tokens, streamed over HTTP, Poisson arrivals")
    print(format_table(doc["runs"]))
    for r in doc["runs"]:
        if r["failed"]:
            print(f"rate {r['request_rate']}: {r['failed']} failed: {'; '.join(r['errors'])}")
    off = doc.get("offline")
    if off:
        ratio = off["online_inf_over_offline"]
        print(f"\nbench serve (offline, the same requests and engine): {off['output_tokens_per_s']:.1f} output tok/s"
              + (f"; online at rate inf: {ratio:.1%} of it" if ratio is not None else " (no inf rate was run online)"))
        inf = next((r for r in doc["runs"] if r["request_rate"] == "inf"), None)
        if off.get("engine_steps_per_s") and inf and inf.get("engine_steps_per_s"):
            print(f"engine steps/s: {inf['engine_steps_per_s']:.1f} online at rate inf, {off['engine_steps_per_s']:.1f} offline; "
                  f"KV pool: {doc.get('server_kv_blocks') or 0:.0f} blocks served, {off['kv_blocks']} offline")


def plot(doc: dict[str, Any], path: Path) -> None:
    """TTFT, TPOT and ITL (median, P99) against the request rate; inf at the right."""
    plt = pyplot()
    runs = doc["runs"]
    labels = [str(r["request_rate"]) for r in runs]
    x = np.arange(len(runs))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, title) in zip(axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"))):
        ax.plot(x, [r[key]["median"] for r in runs], "o-", label="median", color="#4C72B0")
        ax.plot(x, [r[key]["p99"] for r in runs], "s--", label="P99", color="#DD8452")
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    env = doc["environment"]
    fig.suptitle(f"bench online: {doc['model']}, {doc['workload']['num_prompts']} ShareGPT-like requests on "
                 f"{env.get('gpu', env['device'])}, {env['date']}", fontsize=9)
    save_figure(fig, path)
    plt.close(fig)


# -------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedref.bench online", description=__doc__.split("\n\n")[0])
    p.add_argument("--request-rate", default="inf",
                   help="requests per second, comma-separated, 'inf' = all at once (e.g. 4,8,16,inf; default inf)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests per rate (default {NUM_PROMPTS} on cuda, as bench serve; 100 on the CPU)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight (default: no cap)")
    p.add_argument("--input-len", type=int, default=None, help="fix every prompt's length instead of drawing it")
    p.add_argument("--output-len", type=int, default=None, help="fix every output's length instead of drawing it")
    p.add_argument("--seed", type=int, default=0, help="the workload's and the arrivals' seed")
    p.add_argument("--base-url", default=None,
                   help="benchmark a server already running there (serving the model as 'bench', or any name: the first "
                        "of /v1/models is used) instead of starting one")
    m = p.add_argument_group("the server it starts (bench serve's engine settings)")
    m.add_argument("--model-shape", default=None, choices=tuple(SHAPES),
                   help="random weights in this shape, as bench serve (default llama-3.1-8b on cuda, tiny on the CPU); "
                        "with --base-url, the vocabulary the prompts are drawn from")
    m.add_argument("--model", type=Path, default=None, help="a model directory instead of random weights (its vocabulary "
                                                            "and max_position_embeddings bound the workload)")
    m.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    m.add_argument("--num-kv-blocks", type=int, default=4096,
                   help=f"the KV pool in blocks of {BLOCK_SIZE} tokens (bench serve's); 0: sized from "
                        "--gpu-memory-utilization by profiling, as vLLM does (cuda only)")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    m.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: the engine's (1024 on a GPU of >= 70 GiB, as vLLM's; 256 otherwise)")
    m.add_argument("--max-num-batched-tokens", type=int, default=None)
    m.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    m.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the random-weight checkpoints are written once and reused")
    m.add_argument("--compare-offline", action="store_true",
                   help="after the online runs, stop the server and run bench serve's pagedref system on the same "
                        "requests and engine settings: the inf rate's throughput against the offline one")
    add_output_flags(p, "TTFT, TPOT and ITL against the request rate")
    return p


def parse_rates(parser: argparse.ArgumentParser, text: str) -> list[float]:
    rates = []
    for item in text.split(","):
        try:
            rate = float(item)
        except ValueError:
            parser.error(f"--request-rate: {item!r} is not a number or 'inf'")
        if not rate > 0:
            parser.error(f"--request-rate must be > 0, got {item}")
        rates.append(rate)
    return rates


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[float], str]:
    from pagedref.generate import resolve_device

    rates = parse_rates(parser, args.request_rate)
    device = resolve_device(args.device, parser) if args.base_url is None else "remote"
    if args.model is not None and args.model_shape is not None:
        parser.error("--model and --model-shape: give one")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: not a model directory (no config.json)")
    if args.num_prompts is None:
        args.num_prompts = NUM_PROMPTS if device == "cuda" else 100
    require_positive(parser, args, "num_prompts")
    if args.num_kv_blocks < 0:
        parser.error(f"--num-kv-blocks must be >= 0, got {args.num_kv_blocks}")
    if args.num_kv_blocks == 0 and device != "cuda":
        parser.error("--num-kv-blocks 0 (size the pool by profiling the GPU) needs --device cuda")
    require_positive(parser, args, "max_num_seqs", "input_len", "output_len", "max_concurrency", "max_num_batched_tokens")
    if args.compare_offline and args.base_url is not None:
        parser.error("--compare-offline runs the offline benchmark here: it needs the server started here, not --base-url")
    return rates, device


def workload_model(args: argparse.Namespace, device: str, log) -> tuple[Path | None, str, int, int]:
    """(model directory or None, its name, vocabulary size, longest sequence) for the requests."""
    if args.model is not None:
        cfg = json.loads((args.model / "config.json").read_text())
        return args.model, str(args.model), cfg["vocab_size"], cfg["max_position_embeddings"]
    shape = args.model_shape or ("llama-3.1-8b" if device == "cuda" else "tiny")
    model_dir = None if args.base_url else random_model_dir(shape, args.model_dir, device, seed=args.seed, log=log)
    return model_dir, shape, SHAPES[shape]["vocab_size"], MAX_MODEL_LEN


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_or_replay(parser, argv, print_report, plot)
    if args is None:
        return 0
    rates, device = check_args(parser, args)
    model_dir, model_name, vocab_size, max_len = workload_model(args, device, progress)
    reqs = make_requests(args.num_prompts, vocab_size, args.seed, args.input_len, args.output_len)
    too_long = [r for r in reqs if len(r.prompt_token_ids) + r.output_len > min(max_len, MAX_MODEL_LEN)]
    if too_long:
        parser.error(f"{len(too_long)} requests are longer than the model's {min(max_len, MAX_MODEL_LEN)} positions: "
                     "fix their lengths with --input-len and --output-len")
    from pagedref.serve.server import raise_open_file_limit

    raise_open_file_limit()  # rate inf opens --num-prompts sockets at once (the server started here inherits it)
    dtype = "bfloat16" if device == "cuda" else "float32"
    llm_kwargs = engine_args(device, dtype, args.num_kv_blocks, args.max_num_seqs, args.max_num_batched_tokens,
                             args.gpu_memory_utilization, args.enforce_eager)
    if args.model is not None:
        llm_kwargs["max_model_len"] = min(max_len, MAX_MODEL_LEN)
    server = None if args.base_url else ServerProcess(model_dir, llm_kwargs, progress)
    url = args.base_url.rstrip("/") if args.base_url else server.url
    doc: dict[str, Any] = {
        "benchmark": "online", "command": "python -m pagedref.bench online " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(device), "model": model_name,
        "engine": None if args.base_url else {k: v for k, v in llm_kwargs.items() if v is not None},
        "workload": {"num_prompts": len(reqs), "mean_prompt_len": float(np.mean([len(r.prompt_token_ids) for r in reqs])),
                     "mean_output_len": float(np.mean([r.output_len for r in reqs])), "seed": args.seed},
        "runs": [],
    }
    try:
        served = _served_name(url) if args.base_url else SERVED_NAME
        warm = BenchRequest(reqs[0].prompt_token_ids[:8], 4)  # kernels compiled, first graphs replayed: not timed
        warm_result = asyncio.run(run_rate(url, served, [warm], float("inf"), args.seed, None))[0][0]
        if not warm_result.ok:
            raise RuntimeError(f"the warm-up request failed: {warm_result.error}")
        doc["server_kv_blocks"] = _server_figure(url, "pagedref:num_kv_blocks")
        for rate in rates:
            progress(f"[online] rate {rate}: {len(reqs)} requests ...")
            steps_before = _server_figure(url, "pagedref:num_engine_steps_total")
            results, duration = asyncio.run(run_rate(url, served, reqs, rate, args.seed, args.max_concurrency))
            run = summarize(results, duration, rate)
            steps_after = _server_figure(url, "pagedref:num_engine_steps_total")
            if steps_before is not None and steps_after is not None:  # a server of another kind may not count them
                run["engine_steps"] = steps_after - steps_before
                run["engine_steps_per_s"] = run["engine_steps"] / duration
            progress(f"[online] rate {rate}: {run['completed']} done in {duration:.1f} s, {run['output_throughput']:.1f} output tok/s")
            doc["runs"].append(run)
            if args.json_out:
                args.json_out.write_text(json.dumps(doc, indent=2))
    finally:
        if server is not None:
            status = server.stop()
            doc["server_exit_status"] = status
            if status != 0:
                progress(f"[online] the server exited with status {status}")
    if args.compare_offline:
        offline = run_pagedref(model_dir, reqs, "paged", llm_kwargs, progress)
        inf = next((r for r in doc["runs"] if r["request_rate"] == "inf"), None)
        steps = re.match(r"(\d+) steps", offline.note)
        doc["offline"] = {**offline.as_dict(),
                          "engine_steps_per_s": int(steps.group(1)) / offline.elapsed_s if steps else None,
                          "online_inf_over_offline": inf["output_throughput"] / offline.output_tokens_per_s if inf else None}
    emit(doc, args, print_report, plot)
    return 0


def _server_figure(url: str, name: str) -> float | None:
    """One sample of the server's /metrics (None when it has no such figure)."""
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _served_name(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
