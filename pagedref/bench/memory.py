"""Memory benchmark: where the KV memory goes, contiguous reservation vs paged blocks.

One idea: replay the same request trace through the stage 1 cache (each request reserves its maximum
length up front) and the stage 4 KVCacheManager (blocks taken on demand) at the same KV memory budget,
and account for every token slot as in Fig. 2 of the PagedAttention paper (Kwon et al., SOSP 2023):
token states, reserved, internal and external fragmentation. Then measure what sharing saves for
parallel sampling and beam search (Fig. 15): 1 - blocks_with_sharing / blocks_without.

The simulation is discrete-time, one decode step per tick:
  1. admit waiting requests first come, first served while memory allows (the prompt gets its slots);
  2. account for the memory (the system is *saturated* when a request is still waiting now);
  3. every request admitted before this step gains one token; the paged system takes a block only
     when the last one is full, and when the pool is dry it preempts the newest request (vLLM's
     recompute: its blocks are freed and it re-enters the front of the queue);
  4. requests that reached their final length release their memory.
A request's final length is drawn from the workload but never shown to an allocator: the contiguous
cache reserves max_model_len, the paged cache grows by blocks. Fractions are memory-time averages over
the saturated steps (the regime Fig. 2 describes); max_concurrent_requests is over all steps.

Invariant: run(seed, quick) is a pure function of its arguments; `--json` prints exactly its result.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from pagedref.memory.contiguous import ContiguousKVCache, MemoryUsage
from pagedref.memory.sharing import KVCacheManager

# The KV budget of OPT-13B on one A100-40GB, the paper's main setting: ~12 GiB left for the KV cache
# after the 26 GB of weights, at 2 (K, V) x 40 layers x 5120 x 2 bytes = 800 KiB per token.
BLOCK_SIZE = 16
NUM_KV_BLOCKS = (12 * 2**30) // (800 * 2**10) // BLOCK_SIZE  # 983 blocks = 15,728 token slots
MAX_MODEL_LEN = 2048
WATERMARK = 0.01  # vLLM's admission watermark: keep 1% of the blocks free for running requests to grow


@dataclass(frozen=True)
class Workload:
    """Lognormal prompt and output lengths with the paper's means; sigma is the spread of log(length)."""

    name: str
    input_mean: float
    input_sigma: float
    output_mean: float
    output_sigma: float
    arrival_rate: float  # requests per step (Poisson), well above what either system serves
    num_steps: int
    quick_steps: int


WORKLOADS = (
    Workload("sharegpt", 161.31, 1.0, 337.99, 0.8, arrival_rate=0.5, num_steps=3000, quick_steps=1200),
    Workload("alpaca", 19.31, 0.6, 58.45, 0.9, arrival_rate=8.0, num_steps=800, quick_steps=300),
)
ALPACA = WORKLOADS[1]


def lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    """Integer lengths >= 1 from a lognormal whose mean is `mean`: mu = ln(mean) - sigma^2 / 2."""
    mu = math.log(mean) - sigma**2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size))).astype(np.int64)


@dataclass
class Request:
    rid: int
    arrival: int
    prompt_len: int
    output_len: int  # unknown to the allocators: only the simulation's clock uses it
    generated: int = 0
    admitted_at: int = -1

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated


def make_trace(rng: np.random.Generator, w: Workload, num_steps: int) -> list[Request]:
    """Poisson arrivals over num_steps; lengths clipped so prompt + output <= MAX_MODEL_LEN."""
    arrivals = rng.poisson(w.arrival_rate, num_steps)
    n = int(arrivals.sum())
    prompt = np.minimum(lognormal_lengths(rng, w.input_mean, w.input_sigma, n), MAX_MODEL_LEN - 1)
    output = np.minimum(lognormal_lengths(rng, w.output_mean, w.output_sigma, n), MAX_MODEL_LEN - prompt)
    steps = np.repeat(np.arange(num_steps), arrivals)
    return [Request(i, int(steps[i]), int(prompt[i]), int(output[i])) for i in range(n)]


# --- the two systems, behind one small interface -------------------------------------------------
class ContiguousSystem:
    """Stage 1: one contiguous reservation per request, sized by `policy` (first fit)."""

    def __init__(self, policy: str = "max") -> None:
        self.policy = policy
        self.cache = ContiguousKVCache(NUM_KV_BLOCKS * BLOCK_SIZE, MAX_MODEL_LEN)
        self.preemptions = 0

    def reservation(self, r: Request) -> int:
        if self.policy == "max":  # the honest baseline: the final length is unknown
            return MAX_MODEL_LEN
        if self.policy == "pow2":  # Orca (Pow2): over-reserves by at most 2x (needs the final length)
            return min(MAX_MODEL_LEN, 1 << (r.final_len - 1).bit_length())
        return r.final_len  # Orca (Oracle): knows the final length exactly

    def try_admit(self, r: Request) -> bool:
        if self.cache.find_hole(self.reservation(r)) is None:
            return False
        self.cache.admit(r.rid, self.reservation(r))
        self.cache.append(r.rid, num_tokens=r.num_tokens)
        return True

    def grow(self, running: list[Request]) -> list[Request]:
        for r in running:
            self.cache.append(r.rid, num_tokens=1)
        return []  # a reservation never runs out: it was sized for the final length

    def release(self, r: Request) -> None:
        self.cache.release(r.rid)

    def usage(self, running: list[Request], head: Request | None) -> MemoryUsage:
        u = self.cache.usage({r.rid: r.final_len for r in running})
        # External fragmentation: free holes too small for the request at the head of the queue.
        size = self.reservation(head) if head else MAX_MODEL_LEN
        external = sum(length for _, length in self.cache.holes() if length < size)
        return MemoryUsage(u.total, u.token_states, u.reserved, u.internal_fragmentation, external)


class PagedSystem:
    """Stage 4's KVCacheManager: blocks on demand, preemption by recompute when the pool is dry."""

    def __init__(self) -> None:
        self.kv = KVCacheManager(NUM_KV_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN, enable_prefix_caching=False)
        self.watermark = math.ceil(WATERMARK * NUM_KV_BLOCKS)
        self.preemptions = 0

    def try_admit(self, r: Request) -> bool:
        n = r.num_tokens  # prompt, plus the tokens generated before a preemption (recomputed)
        if math.ceil(n / BLOCK_SIZE) > self.kv.num_free_blocks - self.watermark:
            return False
        self.kv.allocate(r.rid, [0] * n, n)
        return True

    def grow(self, running: list[Request]) -> list[Request]:
        """One token for each running request, oldest first; returns the preempted requests."""
        preempted: list[Request] = []
        alive = list(running)
        while alive:
            r = alive.pop(0)
            while not self.kv.can_append(r.rid, 1):
                victim = alive.pop() if alive else r  # the newest request gives its blocks back
                self.kv.free(victim.rid)
                preempted.append(victim)
                self.preemptions += 1
                if victim is r:
                    break
            else:
                self.kv.append_slots(r.rid, [0])
        return preempted

    def release(self, r: Request) -> None:
        self.kv.free(r.rid)

    def usage(self, running: list[Request], head: Request | None) -> MemoryUsage:
        tokens = sum(self.kv.num_tokens(r.rid) for r in running)
        used = self.kv.allocator.num_used * BLOCK_SIZE
        # Nothing is reserved ahead and any free block fits any request: no external fragmentation.
        return MemoryUsage(NUM_KV_BLOCKS * BLOCK_SIZE, tokens, 0, used - tokens, 0)


def simulate(system, trace: list[Request], num_steps: int) -> dict:
    """Replay the trace through one system; memory-time averages over the saturated steps."""
    trace = [Request(r.rid, r.arrival, r.prompt_len, r.output_len) for r in trace]  # fresh state
    pending, waiting, running = deque(trace), deque(), []
    sums = np.zeros(5)  # token states, reserved, internal, external, total: summed over saturated steps
    saturated = finished = max_running = 0
    running_sum = 0
    for step in range(num_steps):
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        while waiting and system.try_admit(waiting[0]):  # FCFS: the head of the queue blocks the rest
            r = waiting.popleft()
            r.admitted_at = step
            running.append(r)
        max_running = max(max_running, len(running))
        if waiting:
            u = system.usage(running, waiting[0])
            sums += (u.token_states, u.reserved, u.internal_fragmentation, u.external_fragmentation, u.total)
            saturated += 1
            running_sum += len(running)
        growing = [r for r in running if r.admitted_at < step]  # a new arrival's prefill was its step
        preempted = system.grow(growing)
        for r in sorted(preempted, key=lambda r: r.rid, reverse=True):
            running.remove(r)
            waiting.appendleft(r)  # back to the front, in arrival order
        for r in growing:
            if r not in preempted:
                r.generated += 1
        for r in [r for r in running if r.generated == r.output_len]:
            system.release(r)
            running.remove(r)
            finished += 1
    tokens, reserved, internal, external, total = sums
    occupied = tokens + reserved + internal + external
    frac = (lambda x: float(x / occupied)) if occupied else (lambda x: 0.0)
    return {
        "token_state_fraction": frac(tokens),
        "reserved_fraction": frac(reserved),
        "internal_fragmentation_fraction": frac(internal),
        "external_fragmentation_fraction": frac(external),
        "kv_utilization": float(tokens / total) if total else 0.0,  # token states / whole budget
        "mean_occupied_slots": float(occupied / saturated) if saturated else 0.0,
        "max_concurrent_requests": max_running,
        "mean_concurrent_requests": running_sum / saturated if saturated else 0.0,
        "saturated_steps": saturated,
        "finished_requests": finished,
        "preemptions": system.preemptions,
    }


def run_workload(w: Workload, seed: int, quick: bool) -> dict:
    num_steps = w.quick_steps if quick else w.num_steps
    trace = make_trace(np.random.default_rng([seed, len(w.name)]), w, num_steps)
    return {
        "distribution": {
            "input": f"lognormal(mean={w.input_mean}, sigma={w.input_sigma})",
            "output": f"lognormal(mean={w.output_mean}, sigma={w.output_sigma})",
            "clip": f"lengths >= 1, prompt + output <= {MAX_MODEL_LEN}",
        },
        "arrival_rate": w.arrival_rate,
        "num_steps": num_steps,
        "num_requests": len(trace),
        "mean_input_len": float(np.mean([r.prompt_len for r in trace])),
        "mean_output_len": float(np.mean([r.output_len for r in trace])),
        "contiguous": simulate(ContiguousSystem("max"), trace, num_steps),
        "paged": simulate(PagedSystem(), trace, num_steps),
        "contiguous_pow2": simulate(ContiguousSystem("pow2"), trace, num_steps),
        "contiguous_oracle": simulate(ContiguousSystem("oracle"), trace, num_steps),
    }


# --- sharing: parallel sampling and beam search (Fig. 15) ------------------------------------------
class SharingMeter:
    """Sums, over decode steps, the blocks actually held and the blocks the same sequences would hold
    without sharing (each block-table entry its own block)."""

    def __init__(self) -> None:
        self.kv = KVCacheManager(4096, BLOCK_SIZE, MAX_MODEL_LEN, enable_prefix_caching=False)
        self.with_sharing = self.without_sharing = 0
        self.next_id = 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def measure(self, seq_ids) -> None:
        self.with_sharing += self.kv.allocator.num_used
        self.without_sharing += sum(len(self.kv.block_ids(s)) for s in seq_ids)

    @property
    def saving(self) -> float:
        return 1 - self.with_sharing / self.without_sharing


def parallel_sampling(meter: SharingMeter, rng: np.random.Generator, prompt_len: int, output_len: int,
                      n: int) -> None:
    """n samples of one prompt: forks share the prompt blocks; the first append to the shared partial
    last block copies it. Every sample generates the request's output length (as in the paper's runs,
    where each request's output length comes from the trace)."""
    root = meter.new_id()
    meter.kv.allocate(root, rng.integers(0, 32000, prompt_len).tolist(), prompt_len)
    seqs = [root]
    for _ in range(n - 1):
        seqs.append(meter.new_id())
        meter.kv.fork(root, seqs[-1])
    for _ in range(output_len):
        for s in seqs:
            meter.kv.append_slots(s, [int(rng.integers(0, 32000))])
        meter.measure(seqs)
    for s in seqs:
        meter.kv.free(s)


BEAM_VOCAB = 1000  # logits of a synthetic next-token distribution
BEAM_LOGIT_STD = 4.0  # its peakedness: the top token gets ~40% of the probability on average


def beam_search(meter: SharingMeter, rng: np.random.Generator, prompt_len: int, output_len: int,
                width: int) -> None:
    """Beam search over a synthetic model: each step every beam's next-token log-probabilities are a
    log-softmax of BEAM_VOCAB logits ~ N(0, BEAM_LOGIT_STD^2), drawn afresh; the `width` best
    (beam, token) pairs by cumulative log-probability survive. A beam chosen c times forks c - 1 times
    (vLLM v0's fork + copy-on-write), a beam not chosen is freed — so the survivors descend from few
    recent ancestors and share long prefixes."""
    root = meter.new_id()
    meter.kv.allocate(root, rng.integers(0, 32000, prompt_len).tolist(), prompt_len)
    beams = {root: 0.0}  # seq id -> cumulative log-probability
    for _ in range(output_len):
        ids = list(beams)
        logits = rng.normal(0.0, BEAM_LOGIT_STD, (len(ids), BEAM_VOCAB))  # [beams, vocab]
        top = np.argpartition(-logits, width - 1, axis=1)[:, :width]  # [beams, width] best tokens
        mx = logits.max(1)
        logz = np.log(np.exp(logits - mx[:, None]).sum(1)) + mx  # [beams] log-softmax normaliser
        cum = np.array([beams[s] for s in ids])
        scores = cum[:, None] + np.take_along_axis(logits, top, 1) - logz[:, None]  # [beams, width]
        children: dict[int, list[tuple[int, float]]] = {s: [] for s in ids}
        for flat in np.argsort(-scores, axis=None, kind="stable")[:width]:
            b, j = divmod(int(flat), width)
            children[ids[b]].append((int(top[b, j]), float(scores[b, j])))
        new_beams = {}
        for s in ids:
            if not children[s]:  # no child survives: the beam dies
                meter.kv.free(s)
                continue
            forks = [s] + [meter.new_id() for _ in children[s][1:]]
            for f in forks[1:]:
                meter.kv.fork(s, f)
            for f, (token, score) in zip(forks, children[s]):
                meter.kv.append_slots(f, [token])
                new_beams[f] = score
        beams = new_beams
        meter.measure(beams)
    for s in beams:
        meter.kv.free(s)


def run_sharing(seed: int, quick: bool) -> dict:
    """Alpaca-like requests, the same (prompt, output) lengths for every n and width."""
    num_requests = 80 if quick else 300
    rng = np.random.default_rng([seed, 1])
    prompts = lognormal_lengths(rng, ALPACA.input_mean, ALPACA.input_sigma, num_requests)
    outputs = lognormal_lengths(rng, ALPACA.output_mean, ALPACA.output_sigma, num_requests)
    out: dict = {
        "workload": "alpaca",
        "block_size": BLOCK_SIZE,
        "num_requests": num_requests,
        "metric": "1 - blocks_with_sharing / blocks_without, summed over decode steps",
        "beam_model": f"vocab {BEAM_VOCAB}, logits ~ N(0, {BEAM_LOGIT_STD}^2) i.i.d. per step and beam, "
                      "the width best (beam, token) pairs by cumulative log-probability survive",
        "paper": {"parallel_sampling": [0.061, 0.098], "beam_search": [0.376, 0.552]},
    }
    for name, fn in (("parallel_sampling", parallel_sampling), ("beam_search", beam_search)):
        out[name] = {}
        for n in (2, 4, 6):
            meter = SharingMeter()
            sub = np.random.default_rng([seed, 2, n, len(name)])
            for p, o in zip(prompts, outputs):
                fn(meter, sub, int(p), int(o), n)
            if meter.kv.allocator.num_free != meter.kv.allocator.num_total:
                raise RuntimeError(f"{name} n={n} leaked blocks")  # a bug in the memory code
            out[name][str(n)] = meter.saving
    return out


def run(seed: int = 0, quick: bool = False) -> dict:
    """The whole benchmark as one JSON-able dict (what `--json` prints)."""
    return {
        "seed": seed,
        "quick": quick,
        "kv_budget": {
            "num_kv_blocks": NUM_KV_BLOCKS,
            "block_size": BLOCK_SIZE,
            "num_slots": NUM_KV_BLOCKS * BLOCK_SIZE,
            "max_model_len": MAX_MODEL_LEN,
            "setting": "OPT-13B on one A100-40GB: 12 GiB of KV cache at 800 KiB per token",
        },
        "policies": {
            "contiguous": "reserve max_model_len slots per request (final length unknown)",
            "contiguous_pow2": "reserve the final length rounded up to a power of two (Orca Pow2; needs the final length)",
            "contiguous_oracle": "reserve exactly prompt + output length (Orca Oracle; needs the final length)",
            "paged": f"blocks of {BLOCK_SIZE} on demand, admission watermark {WATERMARK:.0%}, preemption by recompute",
        },
        "averaging": "memory-time averages over saturated steps (a request still waits after admission); "
                     "max_concurrent_requests over all steps",
        "workloads": {w.name: run_workload(w, seed, quick) for w in WORKLOADS},
        "sharing": run_sharing(seed, quick),
    }


# --- command line ---------------------------------------------------------------------------------
SYSTEMS = ("contiguous", "contiguous_pow2", "contiguous_oracle", "paged")


def format_report(res: dict, elapsed: float) -> str:
    b = res["kv_budget"]
    lines = [f"KV budget: {b['num_kv_blocks']} blocks x {b['block_size']} = {b['num_slots']} token slots "
             f"({b['setting']}), max_model_len {b['max_model_len']}", res["averaging"], ""]
    head = f"{'system':<18}{'tokens':>8}{'reserved':>10}{'internal':>10}{'external':>10}{'max reqs':>10}{'mean reqs':>11}{'done':>7}"
    for name, w in res["workloads"].items():
        lines += [f"{name}: {w['num_requests']} requests over {w['num_steps']} steps, mean input "
                  f"{w['mean_input_len']:.1f}, mean output {w['mean_output_len']:.1f}", head]
        for s in SYSTEMS:
            m = w[s]
            lines.append(f"{s:<18}{m['token_state_fraction']:>8.1%}{m['reserved_fraction']:>10.1%}"
                         f"{m['internal_fragmentation_fraction']:>10.1%}{m['external_fragmentation_fraction']:>10.1%}"
                         f"{m['max_concurrent_requests']:>10}{m['mean_concurrent_requests']:>11.1f}{m['finished_requests']:>7}")
        lines.append("")
    sh = res["sharing"]
    lines.append(f"KV memory saved by sharing ({sh['workload']}-like, {sh['num_requests']} requests, block size {sh['block_size']}):")
    for name in ("parallel_sampling", "beam_search"):
        lo, hi = sh["paper"][name]
        vals = "  ".join(f"{k}: {v:.1%}" for k, v in sh[name].items())
        lines.append(f"  {name:<18} {vals}   (paper: {lo:.1%} - {hi:.1%})")
    lines.append(f"\n{elapsed:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedref.bench memory", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--seed", type=int, default=0, help="seed of the traces (default 0)")
    parser.add_argument("--quick", action="store_true", help="shorter traces (what the tests run)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    res = run(seed=args.seed, quick=args.quick)
    print(json.dumps(res, indent=2) if args.json else format_report(res, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
