"""`python -m pagedref.bench step`: the engine's HOST cost per step, with the model's math taken out.

One idea: on a fast GPU a decode step of a 1B model is 1–2 ms of device work, so every millisecond the
engine spends in Python (scheduling, building metadata, sampling bookkeeping, stop checks) is lost
throughput. This benchmark runs the real `LLMEngine` (real scheduler, block manager, model runner,
sampler) around a stub model whose forward is nearly free: one Llama layer of hidden size 64 with the
vocabulary of a real model (so the logits, and the sampling over them, have real size), and an
attention backend that writes the step's K/V into its slots and attends to nothing. It measures, per
step, at a steady number of running sequences:

- schedule  — `Scheduler.schedule()` (block allocation and slot mappings included);
- prepare   — `ModelRunner.prepare()`: input ids, positions, AttentionMetadata;
- forward   — the stub model and its lm_head (the part a GPU would run; near zero here, except the
              lm_head matmul over the real vocabulary);
- sample    — the `Sampler` over the step's logits rows, and reading the tokens back;
- update    — `Scheduler.update()`: appending tokens, stop checks (detokenization for stop strings),
              finishing and freeing;
- other     — the rest of `LLMEngine.step()`: outputs and step statistics.

Two workloads: `decode` (every sequence decodes one token per step) and `chunked` (the same decodes plus
one long prompt's chunk of prefill per step, chunked prefill). Two request mixes: `greedy` (what
`bench serve` runs) and `mixed` (greedy and seeded temperature/top-k/top-p sampling alternate, and a
quarter of the requests carry a stop string, as a server's would).

Invariant: the numbers are host (CPU) wall-clock times of the real engine code; only the model's math
is stubbed out. Nothing is asserted about them (benchmarks are code, not tests).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedref.memory.block_table import cdiv

PHASES = ("schedule", "prepare", "forward", "sample", "update", "other")
WORKLOADS = ("decode", "chunked")
SAMPLING = ("greedy", "mixed")
DEFAULT_NUM_SEQS = (32, 128, 256)
BLOCK_SIZE = 16
PROMPT_LEN = 200  # decoding sequences: a chat-like prompt, so block tables have ~13-20 blocks
LONG_PROMPT_LEN = 4096  # the chunked workload's prompts, prefilled CHUNK tokens per step
CHUNK = 256


class StubAttentionBackend:
    """Writes the step's K/V into their slots (what every backend does first), then attends to nothing:
    the output is zeros. The metadata is still consumed, so the engine's work is the real one."""

    name = "stub"

    def forward(self, q, k, v, kv_cache, meta, scale):
        from pagedref.backends.reference import write_kv

        write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        return torch.zeros_like(q)

    def copy_blocks(self, kv_caches, src, dst) -> None:
        for k_cache, v_cache in kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))


def stub_config(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }


def make_engine(num_seqs: int, vocab_size: int, max_num_batched_tokens: int, seed: int = 0):
    """A real LLMEngine (paged KV, prefix caching, chunked prefill) around the stub model, on the CPU."""
    from pagedref.bench.common import word_tokenizer
    from pagedref.engine.block_manager import BlockManager
    from pagedref.engine.llm import LLMEngine
    from pagedref.engine.model_runner import ModelRunner
    from pagedref.engine.scheduler import Scheduler, SchedulerConfig
    from pagedref.models import LlamaForCausalLM, ModelConfig
    from pagedref.models.tokenizer import Tokenizer

    torch.manual_seed(seed)
    config = ModelConfig.from_dict(stub_config(vocab_size))
    model = LlamaForCausalLM(config, dtype=torch.float32, batch_invariant=False).eval()
    tokenizer = Tokenizer(word_tokenizer(vocab_size), 1, 2)
    max_model_len = LONG_PROMPT_LEN + 1024
    num_blocks = (num_seqs + 4) * (max_model_len // BLOCK_SIZE)  # never preempts: the host cost of a steady batch
    block_manager = BlockManager(num_blocks, BLOCK_SIZE, max_model_len, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(num_seqs + 64, max_num_batched_tokens, True), block_manager)
    runner = ModelRunner(model, StubAttentionBackend(), num_blocks, BLOCK_SIZE, "cpu", torch.float32)
    return LLMEngine(model, tokenizer, runner, scheduler, max_model_len, seed)


def request_params(i: int, max_tokens: int, sampling: str = "mixed"):
    """"greedy": what `bench serve` runs. "mixed": greedy and seeded sampling alternate, and every
    fourth request has a stop string (random tokens essentially never produce it), as a server's would."""
    from pagedref.engine.sampling import SamplingParams

    if sampling not in SAMPLING:
        raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
    if sampling == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    stop = ["t3 t3 t3"] if i % 4 == 0 else None
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=stop)
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True,
                          stop=stop)


class PhaseTimer:
    """Wraps the engine's phase methods on the instances (the engine code itself is untouched)."""

    def __init__(self, engine) -> None:
        self.times = {p: 0.0 for p in PHASES if p != "other"}
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "prepare", "prepare")
        self._wrap(engine.runner, "run_model", "forward")
        self._wrap(engine.model, "compute_logits", "forward")
        self._wrap(engine.runner.sampler, "sample_tokens", "sample")
        self._wrap(engine.scheduler, "update", "update", reads_tokens=True)

    def _wrap(self, obj, method: str, phase: str, reads_tokens: bool = False) -> None:
        """reads_tokens: the call's second argument is the runner's output; the wait for its tokens to
        reach the host is the sampler's (what update waits for), not update's."""
        fn = getattr(obj, method)
        times = self.times
        if reads_tokens:
            def timed(out, sampled, *args, **kwargs):
                t0 = time.perf_counter()
                sampled.token_ids  # noqa: B018  (the host copy of the tokens: it waits for the device)
                t1 = time.perf_counter()
                times["sample"] += t1 - t0
                try:
                    return fn(out, sampled, *args, **kwargs)
                finally:
                    times[phase] += time.perf_counter() - t1

            setattr(obj, method, timed)
            return

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[phase] += time.perf_counter() - t0

        setattr(obj, method, timed)

    def reset(self) -> None:
        for p in self.times:
            self.times[p] = 0.0

    def per_step_ms(self, total_s: float, steps: int) -> dict[str, float]:
        """Each phase's mean ms per step, and "other": the rest of the steps' total_s seconds."""
        phases = {p: 1e3 * t / steps for p, t in self.times.items()}
        phases["other"] = 1e3 * total_s / steps - sum(phases.values())
        return phases


@dataclass
class StepResult:
    workload: str
    sampling: str
    final_only: bool
    num_seqs: int  # running sequences (decoding) at the start of the measurement
    vocab_size: int
    steps: int
    mean_batched_tokens: float
    total_ms: float  # per step, median over steps
    phases_ms: dict[str, float]  # per step, mean over steps


def measure(workload: str, num_seqs: int, vocab_size: int, steps: int, warmup: int = 3, seed: int = 0,
            sampling: str = "mixed", final_only: bool = False) -> StepResult:
    """Host time of `engine.step()` at num_seqs decoding sequences. final_only: `step(final_only=True)`,
    as `LLM.generate` calls it (no output for requests still running); else every advanced request's."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if num_seqs < 1 or steps < 1:
        raise ValueError(f"num_seqs and steps must be at least 1, got {num_seqs} and {steps}")
    budget = num_seqs + (CHUNK if workload == "chunked" else 0)
    # the steady batch's prompts are prefilled 8 a step, beside the decodes of those admitted before them
    engine = make_engine(num_seqs, vocab_size, max(budget, num_seqs + PROMPT_LEN * 8), seed)
    import random

    rng = random.Random(seed)
    max_tokens = cdiv(num_seqs, 8) + warmup + steps + 64  # the first admitted still decode at the last step measured
    for i in range(num_seqs):  # the steady batch: prompts prefilled first, then they all decode
        prompt = [rng.randrange(3, vocab_size) for _ in range(PROMPT_LEN)]
        engine.add_request(f"d{i}", {"prompt_token_ids": prompt}, request_params(i, max_tokens, sampling))
    while any(s.is_prefill or s.num_computed_tokens == 0 for g in engine.requests.values() for s in g.seqs):
        engine.step()
    engine.scheduler.config.max_num_batched_tokens = budget  # decodes (+ one chunk) per step from here on
    if workload == "chunked":  # long prompts waiting: each step prefills CHUNK tokens of one
        for j in range(cdiv(steps + warmup, LONG_PROMPT_LEN // CHUNK) + 1):
            prompt = [rng.randrange(3, vocab_size) for _ in range(LONG_PROMPT_LEN)]
            engine.add_request(f"p{j}", {"prompt_token_ids": prompt}, request_params(num_seqs + j, max_tokens, sampling))
    timer = PhaseTimer(engine)
    totals, batched = [], []
    for k in range(warmup + steps):
        if k == warmup:
            timer.reset()
        tokens_before = engine.num_batched_tokens
        t0 = time.perf_counter()
        engine.step(final_only=final_only)
        dt = time.perf_counter() - t0
        if k >= warmup:
            totals.append(dt)
            batched.append(engine.num_batched_tokens - tokens_before)
    finished = sum(f"d{i}" not in engine.requests for i in range(num_seqs))
    if finished:  # (a bug of this benchmark, not a measurement: the batch it measured was smaller)
        raise RuntimeError(f"{finished} of the {num_seqs} decoding sequences finished before the measurement ended")
    return StepResult(workload, sampling, final_only, num_seqs, vocab_size, steps, statistics.mean(batched),
                      1e3 * statistics.median(totals), timer.per_step_ms(sum(totals), steps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedref.bench step", description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, nargs="+", default=list(DEFAULT_NUM_SEQS))
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--sampling", nargs="+", default=list(SAMPLING), choices=SAMPLING)
    ap.add_argument("--final-only", action="store_true",
                    help="step(final_only=True), as LLM.generate (default: an output per running request)")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host overhead: one thread, as an engine's Python thread has
    try:
        results = [measure(w, n, args.vocab_size, args.steps, seed=args.seed, sampling=m, final_only=args.final_only)
                   for m in args.sampling for w in args.workloads for n in args.num_seqs]
    finally:
        torch.set_num_threads(threads)
    if args.json:
        print(json.dumps({"device": "cpu", "cpu": platform.processor() or platform.machine(),
                          "torch": torch.__version__, "results": [asdict(r) for r in results]}, indent=2))
        return 0
    print(f"engine host time per step (CPU, stub model, vocab {args.vocab_size}), ms")
    print(f"{'sampling':<9}{'workload':<9}{'seqs':>6}{'total':>9}" + "".join(f"{p:>10}" for p in PHASES))
    for r in results:
        print(f"{r.sampling:<9}{r.workload:<9}{r.num_seqs:>6}{r.total_ms:>9.2f}" + "".join(f"{r.phases_ms[p]:>10.2f}" for p in PHASES))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
