"""The site's figures, drawn from real runs of pagedref — never by hand.

One idea: each figure is a function that runs the code it illustrates (the memory benchmark, a block
allocator with block tables, the scheduler) and draws what came out, so a figure cannot disagree with
the code. `python -m pagedref.figures [--out docs/figures]` regenerates every one of them (PNGs, and
beside the benchmark figures a Markdown table of their numbers); the site shows the committed files.

Invariant: every number or block id in a figure comes from the run, none is typed in. The GPU
benchmarks' figures come from the JSON those runs saved (docs/results/), since this machine has no GPU.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from pagedref.bench import memory as bench_memory  # noqa: E402
from pagedref.engine.block_manager import BlockManager  # noqa: E402
from pagedref.engine.sampling import SamplerOutput, SamplingParams  # noqa: E402
from pagedref.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from pagedref.engine.sequence import Sequence  # noqa: E402
from pagedref.memory.block_allocator import BlockAllocator  # noqa: E402
from pagedref.memory.block_table import BlockTable  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "figures"
SEQ_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3"]
FREE_COLOR = "#E6E6E6"
PNG = {"dpi": 150, "metadata": {"Software": None}}  # no version stamp: regenerating changes only what changed


def _save(fig: plt.Figure, out: Path, name: str) -> Path:
    path = out / f"{name}.png"
    fig.savefig(path, bbox_inches="tight", **PNG)
    plt.close(fig)
    return path


# --- (a) where the KV memory goes, and (c) what sharing saves: `bench memory` ----------------------
@functools.lru_cache(maxsize=2)
def memory_results(quick: bool) -> dict:
    """`python -m pagedref.bench memory --json` (seed 0); quick = its shorter traces."""
    return bench_memory.run(seed=0, quick=quick)


PARTS = (("token_state_fraction", "token states", "#55A868"), ("reserved_fraction", "reserved", "#8FB8DE"),
         ("internal_fragmentation_fraction", "internal fragmentation", "#DD8452"),
         ("external_fragmentation_fraction", "external fragmentation", "#C44E52"))
SYSTEM_LABELS = {"contiguous": "contiguous, reserve max_model_len", "contiguous_pow2": "contiguous, pow2 of final length*",
                 "contiguous_oracle": "contiguous, exact final length*", "paged": "paged (pagedref)"}


def fig_kv_memory(out: Path, quick: bool) -> list[Path]:
    res = memory_results(quick)
    systems = [s for s in bench_memory.SYSTEMS if s in SYSTEM_LABELS]
    workloads = list(res["workloads"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 0.6 * len(systems) + 1.8), sharey=True,
                             layout="constrained")
    for ax, name in zip(axes, workloads):
        w = res["workloads"][name]
        for row, system in enumerate(systems):
            left = 0.0
            for key, label, color in PARTS:
                width = w[system][key]
                ax.barh(row, width, left=left, color=color, label=label if row == 0 else None, edgecolor="white")
                if width >= 0.06:
                    ax.text(left + width / 2, row, f"{width:.0%}", ha="center", va="center", fontsize=8)
                left += width
        ax.set_yticks(range(len(systems)), [SYSTEM_LABELS[s] for s in systems])
        ax.set_xlim(0, 1)
        ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.set_title(f"{name}-like trace: {w['num_requests']} requests", fontsize=10)
    axes[0].invert_yaxis()  # shared: the first system on top
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    b = res["kv_budget"]
    fig.suptitle(f"Where the KV memory goes at the same budget ({b['num_slots']} token slots, max_model_len "
                 f"{b['max_model_len']}; * needs the final length in advance)", fontsize=10)
    table = ["| workload | system | token states | reserved | internal frag. | external frag. | max concurrent requests |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name in workloads:
        for system in systems:
            m = res["workloads"][name][system]
            table.append(f"| {name} | {SYSTEM_LABELS[system]} | " + " | ".join(f"{m[k]:.1%}" for k, _, _ in PARTS)
                         + f" | {m['max_concurrent_requests']} |")
    return [_save(fig, out, "kv_memory"), _table(out, "kv_memory", table, res)]


def fig_sharing(out: Path, quick: bool) -> list[Path]:
    sh = memory_results(quick)["sharing"]
    kinds = (("parallel_sampling", "parallel sampling", "n"), ("beam_search", "beam search", "width"))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True, layout="constrained")
    for ax, (key, title, knob) in zip(axes, kinds):
        ns, saved = list(sh[key]), list(sh[key].values())
        lo, hi = sh["paper"][key]
        ax.axhspan(lo, hi, color="gray", alpha=0.18, label=f"paper: {lo:.1%}–{hi:.1%}")
        bars = ax.bar([f"{knob} = {n}" for n in ns], saved, color="#4C72B0", width=0.55)
        ax.bar_label(bars, [f"{v:.1%}" for v in saved], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.legend(fontsize=8, loc="upper left", frameon=False)
    axes[0].set_ylabel("KV memory saved by sharing")
    axes[0].set_ylim(0, max(0.75, 1.15 * max(v for k, _, _ in kinds for v in sh[k].values())))
    fig.suptitle(f"Block sharing (fork + copy-on-write), {sh['workload']}-like requests, block_size {sh['block_size']}",
                 fontsize=10)
    table = ["| KV memory saved | " + " | ".join(f"n or width = {n}" for n in sh["parallel_sampling"]) + " | paper |",
             "|---|" + "---:|" * (len(sh["parallel_sampling"]) + 1)]
    for key, title, _ in kinds:
        lo, hi = sh["paper"][key]
        table.append(f"| {title} | " + " | ".join(f"{v:.1%}" for v in sh[key].values()) + f" | {lo:.1%}–{hi:.1%} |")
    return [_save(fig, out, "sharing"), _table(out, "sharing", table, memory_results(quick))]


def _table(out: Path, name: str, rows: list[str], res: dict) -> Path:
    """The figure's numbers as a Markdown table, for the site to include beside it."""
    path = out / f"{name}.md"
    note = (f"\n*`python -m pagedref.bench memory{' --quick' if res['quick'] else ''} --seed {res['seed']}`,"
            f" drawn by `python -m pagedref.figures`.*\n")
    path.write_text("\n".join(rows) + "\n" + note)
    return path


# --- (b) a block table: logical blocks -> physical blocks --------------------------------------------
def block_table_run(num_blocks: int = 16, block_size: int = 4) -> tuple[BlockAllocator, dict[str, BlockTable], list[int]]:
    """A small serving history on the stage 2–3 code: three prefills, decode steps, one request (X)
    finishing — its blocks go back to the free list — and a new one arriving. Returns the allocator,
    the live block tables and the blocks X held."""
    allocator = BlockAllocator(num_blocks, block_size)
    tables = {name: BlockTable(allocator) for name in ("A", "B", "X")}
    for name, prompt_len in (("A", 7), ("X", 9), ("B", 5)):
        tables[name].append_slots(prompt_len)  # prefill: the whole prompt at once
    for _ in range(4):  # decode steps: one token each
        for t in tables.values():
            t.append_slots(1)
    finished = tables.pop("X")
    freed = list(finished.block_ids)
    finished.free()  # X finishes: its blocks return to the back of the free list (taken last: LRU)
    tables["C"] = BlockTable(allocator)
    tables["C"].append_slots(10)
    for _ in range(3):
        for t in tables.values():
            t.append_slots(1)
    return allocator, tables, freed


def fig_block_table(out: Path, quick: bool) -> list[Path]:
    allocator, tables, freed = block_table_run()
    bs, nb = allocator.block_size, allocator.num_blocks
    colors = {name: SEQ_COLORS[i] for i, name in enumerate(tables)}
    owner = {b: (name, i) for name, t in tables.items() for i, b in enumerate(t.block_ids)}
    width, gap = bs + 1, 3  # a block is block_size unit cells; one cell between blocks
    fig, ax = plt.subplots(figsize=(13, 4.8))
    ax.set_aspect("equal")
    ax.axis("off")

    def draw_block(x: float, y: float, filled: int, color: str) -> None:
        for s in range(bs):
            ax.add_patch(Rectangle((x + s, y), 1, 1.4, facecolor=color if s < filled else "white", edgecolor="black", lw=0.6))

    # Top row: each sequence's logical blocks, left to right; bottom row: the physical pool.
    num_logical = sum(len(t.block_ids) for t in tables.values())
    x = (nb * width - (num_logical * width + gap * (len(tables) - 1))) / 2
    top, bottom = 6.0, 0.0
    for name, t in tables.items():
        x0 = x
        for i, b in enumerate(t.block_ids):
            draw_block(x, top, min(bs, t.num_tokens - i * bs), colors[name])
            ax.text(x + bs / 2, top + 1.6, str(i), ha="center", va="bottom", fontsize=7, color="dimgray")
            ax.annotate("", xy=(b * width + bs / 2, bottom + 1.5), xytext=(x + bs / 2, top - 0.1),
                        arrowprops={"arrowstyle": "->", "color": colors[name], "lw": 1.0, "alpha": 0.8})
            x += width
        ax.text((x0 + x - 1) / 2, top + 2.5, f"seq {name}: {t.num_tokens} tokens\nblock table {t.block_ids}",
                ha="center", va="bottom", fontsize=9)
        x += gap
    for b in range(nb):
        name, i = owner.get(b, (None, None))
        if name is None:
            ax.add_patch(Rectangle((b * width, bottom), bs, 1.4, facecolor=FREE_COLOR, edgecolor="gray", lw=0.6))
        else:
            draw_block(b * width, bottom, min(bs, tables[name].num_tokens - i * bs), colors[name])
        ax.text(b * width + bs / 2, bottom - 0.3, str(b), ha="center", va="top", fontsize=8)
    name, t = next(iter(tables.items()))
    pos = t.num_tokens - 1
    ax.text(0, top + 5.6, "block tables: each sequence's logical blocks, after prefills, decode steps, and a request X"
            f" that finished and returned blocks {freed} to the free list", fontsize=9, color="dimgray")
    ax.text(0, bottom - 2.6, f"physical blocks of the pool (block_size={bs}; grey = free).   Token {pos} of seq {name}: "
            f"logical block {pos // bs}, offset {pos % bs} → physical block {t.block_ids[pos // bs]} → "
            f"slot {t.block_ids[pos // bs]} × {bs} + {pos % bs} = {t.slot(pos)}", fontsize=9, color="dimgray")
    ax.set_xlim(-1, nb * width)
    ax.set_ylim(bottom - 3.2, top + 6.4)
    return [_save(fig, out, "block_table")]


# --- (b') the block allocator: reference counts and the free list, operation by operation ----------
def block_allocator_run(num_blocks: int = 8) -> list[tuple[str, list[int], list[int]]]:
    """A real BlockAllocator through allocations, a fork (incref) and frees: after each operation,
    (what happened, ref counts per block, free list head to tail)."""
    alloc = BlockAllocator(num_blocks, block_size=4)
    states = []

    def record(what: str) -> None:
        states.append((what, list(alloc.ref_counts), list(alloc.free_list)))

    record("a fresh pool: every block free, in id order")
    a = [alloc.allocate() for _ in range(3)]
    record(f"A allocates 3 blocks: the 3 at the head of the free list, {a}")
    b = [alloc.allocate() for _ in range(2)]
    record(f"B allocates 2: {b}")
    for block in a:
        alloc.incref(block)
    record(f"C forks A (stage 4): one more reference to each of {a}, no block copied")
    for block in a:
        alloc.free(block)
    record(f"A finishes and frees {a}: C still holds them, so none is free")
    for block in b:
        alloc.free(block)
    record(f"B finishes and frees {b}: count 0, so they go to the free list's tail")
    d = [alloc.allocate() for _ in range(4)]
    record(f"D allocates 4: {d}, in free-list order (the longest free first)")
    return states


def fig_block_allocator(out: Path, quick: bool) -> list[Path]:
    states = block_allocator_run()
    num_blocks = len(states[0][1])
    shades = {1: "#4C72B0", 2: "#8172B3", 3: "#3B2C6B"}
    fig, ax = plt.subplots(figsize=(11, 0.62 * len(states) + 1.0), layout="constrained")
    for row, (what, counts, free_list) in enumerate(states):
        y = -row
        for block, count in enumerate(counts):
            free = count == 0
            ax.add_patch(Rectangle((block, y - 0.35), 0.9, 0.7, facecolor=FREE_COLOR if free else shades[min(count, 3)],
                                   edgecolor="gray" if free else "black", lw=0.6))
            label = f"free #{free_list.index(block) + 1}" if free else f"ref {count}"
            ax.text(block + 0.45, y, label, ha="center", va="center", fontsize=7,
                    color="dimgray" if free else "white", fontweight=None if free else "bold")
        ax.text(num_blocks + 0.2, y, what, va="center", fontsize=8)
    ax.set_xticks([b + 0.45 for b in range(num_blocks)], [str(b) for b in range(num_blocks)])
    ax.tick_params(axis="x", length=0)
    ax.set_xlabel("physical block id")
    ax.set_yticks([])
    ax.set_xlim(-0.2, num_blocks + 6.5)
    ax.set_ylim(-len(states) + 0.4, 0.7)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.spines["bottom"].set_bounds(-0.1, num_blocks)
    ax.set_title("The block allocator, operation by operation: a block's reference count, and its place in the "
                 "free list (free #1 = the head, allocated next)", fontsize=9, loc="left")
    return [_save(fig, out, "block_allocator")]


# --- (d) the scheduler, step by step: continuous batching and chunked prefill ---------------------
# (arrival step, name, prompt tokens, tokens to generate)
REQUESTS = ((0, "A", 6, 6), (0, "B", 5, 9), (0, "C", 4, 4), (1, "D", 70, 3), (2, "E", 12, 3))
WHOLE_PROMPT_BUDGET = max(p for _, _, p, _ in REQUESTS) + 10  # without chunks a step must hold the longest prompt


@dataclass
class StepRecord:
    scheduled: list[tuple[str, int, bool]]  # (request, tokens, is_decode), in batch order
    preempted: list[str]  # requests preempted in this step
    used_blocks: int  # blocks in use once the step is scheduled


def run_scheduler(requests, scheduler: Scheduler, num_steps: int) -> list[StepRecord]:
    """The engine's Scheduler on a trace of (arrival step, name, prompt tokens, tokens to generate),
    driven step by step as the engine drives it, without a model: a sequence whose scheduled tokens
    complete it 'samples' a placeholder token, and finishes after its tokens to generate."""
    names, steps = {}, []
    for step in range(num_steps):
        for arrival, name, prompt_len, max_tokens in requests:
            if arrival == step:
                # Distinct token ids per request (the prefix cache, off here, would find nothing anyway).
                seq = Sequence(len(names), name, list(range(1000 * len(names), 1000 * len(names) + prompt_len)),
                               prompt_len, SamplingParams(max_tokens=max_tokens))
                names[seq.seq_id] = name
                scheduler.add(seq)
        out = scheduler.schedule()
        steps.append(StepRecord([(names[e.seq.seq_id], e.num_new_tokens, e.num_new_tokens == 1 and bool(e.sample_seqs))
                                 for e in out.scheduled],  # a decode: one token to compute, and it samples
                                [names[seq.seq_id] for seq in out.preempted], scheduler.block_manager.live_usage()[1]))
        # what the model runner and update do after the forward pass: each sampling sequence gets token 0,
        # and finishes after its tokens to generate (max_tokens)
        scheduler.update(out, SamplerOutput([0] * len(out.sampling_seqs())))
    return steps


def scheduling_run(budget: int = 32, num_steps: int = 7, chunked: bool = True,
                        prefill_first: bool = False) -> list[list[tuple[str, int, bool]]]:
    """`REQUESTS` through the engine's Scheduler at this budget and policy: per step, the scheduled
    (request, tokens, is_decode) in batch order."""
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                             prefill_first=prefill_first)
    scheduler = Scheduler(config, BlockManager(num_blocks=64, block_size=16, max_model_len=256, enable_prefix_caching=False))
    return [r.scheduled for r in run_scheduler(REQUESTS, scheduler, num_steps)]


# Stage 6: requests come and go every step; a small pool fills and preempts. (arrival, name, prompt, output)
BATCHING_REQUESTS = ((0, "A", 7, 10), (0, "B", 3, 4), (1, "C", 9, 12), (2, "D", 5, 3), (3, "E", 6, 8),
                     (5, "F", 4, 5), (6, "G", 10, 4))
BATCHING_POOL = dict(num_blocks=12, block_size=4, max_model_len=32)


def continuous_batching_run(num_steps: int = 15) -> list[StepRecord]:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                          BlockManager(enable_prefix_caching=False, **BATCHING_POOL))
    return run_scheduler(BATCHING_REQUESTS, scheduler, num_steps)


def fig_continuous_batching(out: Path, quick: bool) -> list[Path]:
    """Stage 6: each request's life, step by step (iteration-level scheduling), and the pool's blocks."""
    steps = continuous_batching_run()
    names = [name for _, name, _, _ in BATCHING_REQUESTS]
    arrival = {name: t for t, name, _, _ in BATCHING_REQUESTS}
    last = {name: max(i for i, r in enumerate(steps) if any(n == name for n, _, _ in r.scheduled)) for name in names}
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 5.6), height_ratios=(3, 1.2), sharex=True, layout="constrained")
    for row, name in enumerate(names):
        color = SEQ_COLORS[row % len(SEQ_COLORS)]
        for i, r in enumerate(steps):
            work = next(((n, is_decode) for who, n, is_decode in r.scheduled if who == name), None)
            if name in r.preempted:
                ax.barh(row, 1, left=i, color="white", edgecolor="#C44E52", lw=1.2)
                ax.text(i + 0.5, row, "✕", ha="center", va="center", color="#C44E52", fontsize=10, fontweight="bold")
            elif work is not None:
                n, is_decode = work
                ax.barh(row, 1, left=i, color=color, edgecolor="black", lw=0.5, hatch=None if is_decode else "//",
                        alpha=1.0 if is_decode else 0.6)
                if not is_decode:
                    ax.text(i + 0.5, row, str(n), ha="center", va="center", fontsize=7,
                            bbox={"facecolor": "white", "alpha": 0.85, "lw": 0, "pad": 1})
            elif arrival[name] <= i <= last[name]:  # arrived, not finished, not in this step: waiting
                ax.barh(row, 1, left=i, color=FREE_COLOR, edgecolor="gray", lw=0.3)
    ax.set_yticks(range(len(names)), [f"{name} ({p}+{o})" for _, name, p, o in BATCHING_REQUESTS])
    ax.invert_yaxis()
    ax.set_ylabel("request (prompt + output tokens)")
    ax.set_title("Continuous batching with the engine's Scheduler: the batch is re-formed at every step\n"
                 "solid = decode, hatched = prefill (its tokens), grey = waiting, "
                 "✕ = preempted (recompute: back to waiting, prefilled again later)", fontsize=9)
    used = [r.used_blocks for r in steps]
    ax2.step(range(len(steps) + 1), used + used[-1:], where="post", color="#4C72B0")
    ax2.axhline(BATCHING_POOL["num_blocks"], color="#C44E52", ls="--", lw=1)
    ax2.text(0.2, BATCHING_POOL["num_blocks"] - 0.4, f"pool: {BATCHING_POOL['num_blocks']} blocks of "
             f"{BATCHING_POOL['block_size']} tokens", va="top", fontsize=8, color="#C44E52")
    ax2.set_ylim(0, BATCHING_POOL["num_blocks"] + 1)
    ax2.set_ylabel("blocks in use")
    ax2.set_xlabel("step")
    ax2.set_xlim(0, len(steps))
    ax2.xaxis.set_major_locator(matplotlib.ticker.MultipleLocator(2))
    return [_save(fig, out, "continuous_batching")]


def _draw_steps(ax: plt.Axes, steps: list[list[tuple[str, int, bool]]], budget: int) -> None:
    """One bar per step: each scheduled request's tokens, decodes solid, prefill hatched; grey = budget left."""
    colors = {name: SEQ_COLORS[i] for i, (_, name, _, _) in enumerate(REQUESTS)}
    prompt_len = {name: p for _, name, p, _ in REQUESTS}
    prefilled = dict.fromkeys(prompt_len, 0)
    for row, work in enumerate(steps):
        x = 0
        for name, n, is_decode in work:
            if not is_decode:
                prefilled[name] += n
            ax.barh(row, n, left=x, color=colors[name], edgecolor="black", lw=0.6, hatch=None if is_decode else "//",
                    alpha=1.0 if is_decode else 0.75)
            label = name if is_decode else f"{name}: {n} ({prefilled[name]}/{prompt_len[name]})"
            ax.text(x + n / 2, row, label, ha="center", va="center", fontsize=8,
                    color="white" if is_decode else "black", fontweight="bold" if is_decode else None,
                    bbox=None if is_decode else {"facecolor": "white", "alpha": 0.85, "lw": 0, "pad": 1.5})
            x += n
        if x < budget:
            ax.barh(row, budget - x, left=x, color=FREE_COLOR, edgecolor="gray", lw=0.4)
    ax.set_yticks(range(len(steps)), [f"step {i}" for i in range(len(steps))])
    ax.invert_yaxis()
    ax.set_xlim(0, budget)


def _arrivals() -> str:
    return ", ".join(f"{name} ({p} prompt tokens) at step {t}" for t, name, p, _ in REQUESTS)


def fig_chunked_prefill(out: Path, quick: bool) -> list[Path]:
    budget = 32
    steps = scheduling_run(budget)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(steps) + 1.6), layout="constrained")
    _draw_steps(ax, steps, budget)
    ax.set_xlabel("tokens of the step (max_num_batched_tokens)")
    ax.set_title(f"Chunked prefill with max_num_batched_tokens={budget}: decodes first (solid), then prefill chunks "
                 f"(hatched)\narrivals: {_arrivals()}; grey = unused budget", fontsize=9)
    return [_save(fig, out, "chunked_prefill")]


def fig_scheduling_policies(out: Path, quick: bool) -> list[Path]:
    """The same arrivals under the two policies without chunking and under chunked prefill (stage 7)."""
    whole = WHOLE_PROMPT_BUDGET
    runs = [("without chunking, prefill first (vLLM v0): a step that admits a prompt carries no decode",
             scheduling_run(whole, 7, chunked=False, prefill_first=True), whole),
            ("without chunking, mixed (vLLM v1): the decodes first, then whole prompts in the same step",
             scheduling_run(whole, 7, chunked=False), whole),
            ("chunked prefill (stage 7): the decodes first, then chunks of what the budget has left",
             scheduling_run(32, 7), 32)]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 8.4), layout="constrained")
    for ax, (title, steps, budget) in zip(axes, runs):
        _draw_steps(ax, steps, budget)
        ax.set_xlim(0, whole)
        ax.set_title(f"{title} (max_num_batched_tokens={budget})", fontsize=9, loc="left")
    axes[-1].set_xlabel("tokens of the step")
    fig.suptitle(f"Who computes what in each step. Arrivals: {_arrivals()}.\nDecodes solid, prefill hatched "
                 "(tokens, then done/prompt); grey = unused budget", fontsize=9)
    return [_save(fig, out, "scheduling_policies")]


# --- (e) speculative decoding over the block table (stage 8) ------------------------------------------
@dataclass
class SpecStepRecord:
    start: int  # the position of the step's first row (the sequence's last token)
    drafts: int  # k: draft tokens scored in the step
    accepted: int  # ... of which the target kept
    blocks: list[int]  # the block table as the step ran (with the drafts' slots)
    kept: list[int]  # the block table after the rollback


def speculative_run(num_steps: int = 8, k: int = 4, block_size: int = 4, draft_layers: int = 3) -> list[SpecStepRecord]:
    """The real engine, greedy, on the default model with a draft made of its first draft_layers layers
    (`pagedref.bench.spec.shallow_draft`): the speculative steps of one request, as the scheduler ran them
    (its block table before and after update's rollback) and as the target judged the drafts."""
    import tempfile

    from pagedref import DEFAULT_MODEL, LLM
    from pagedref.bench.spec import shallow_draft

    records: list[SpecStepRecord] = []
    with tempfile.TemporaryDirectory(prefix="pagedref-figure-") as tmp:
        draft = shallow_draft(DEFAULT_MODEL, draft_layers, Path(tmp) / "draft")
        llm = LLM(DEFAULT_MODEL, device="cpu", block_size=block_size, num_kv_blocks=64, max_model_len=128,
                  speculative_config={"model": str(draft), "num_speculative_tokens": k})
        engine = llm.llm_engine
        text, ids = engine.process_prompt("# Stage 4")
        engine.add_request("a", {"prompt": text, "prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        seq = engine.requests["a"].seqs[0]
        while engine.has_unfinished_requests() and len(records) < num_steps:
            sched = engine.scheduler.schedule()
            entry = sched.scheduled[0]
            blocks = list(entry.block_ids)
            sampled = engine.runner.execute(sched)
            engine.scheduler.update(sched, sampled)
            if entry.num_draft_tokens:
                rows, drafts = sampled.spec[0].token_ids, entry.token_ids[1:]
                accepted = next((i for i, d in enumerate(drafts) if rows[i] != d), len(drafts))
                kept = list(engine.block_manager.block_ids(seq)) if not seq.is_finished else []
                records.append(SpecStepRecord(entry.num_computed_tokens, len(drafts), accepted, blocks, kept))
        llm.close()
    return records


def fig_speculative_decoding(out: Path, quick: bool) -> list[Path]:
    """Stage 8: each speculative step's slots over the block table: the last token, the accepted and the
    rejected drafts, the blocks the rollback returns to the pool."""
    bs, k = 4, 4
    steps = speculative_run(k=k, block_size=bs)
    first = min(r.start for r in steps) // bs  # the logical blocks shown: from the first step's block on
    last = max(len(r.blocks) for r in steps)
    colors = {"old": "#D9D9D9", "input": "#4C72B0", "accepted": "#55A868", "rejected": "#C44E52", "own": "#DD8452"}
    fig, ax = plt.subplots(figsize=(11, 0.75 * len(steps) + 1.9), layout="constrained")
    width = bs + 1
    for row, r in enumerate(steps):
        y = -row
        own = r.start + r.accepted + 1  # the target's own token (correction or bonus) joins after the step
        for i in range(first, len(r.blocks)):
            x = (i - first) * width
            returned = i >= len(r.kept)
            for slot in range(bs):
                p = i * bs + slot
                if p < r.start:
                    kind = "old"
                elif p == r.start:
                    kind = "input"
                elif p <= r.start + r.drafts:
                    kind = "accepted" if p - r.start <= r.accepted else "rejected"
                else:
                    kind = None
                ax.add_patch(Rectangle((x + slot, y - 0.35), 1, 0.7, facecolor=colors[kind] if kind else "white",
                                       edgecolor="black", lw=0.5, hatch="xx" if kind == "rejected" else None))
            if own // bs == i:
                ax.add_patch(Rectangle((x + own % bs + 0.2, y - 0.2), 0.6, 0.4, facecolor=colors["own"], lw=0))
            ax.text(x + bs / 2, y + 0.42, f"{'→ pool ' if returned else ''}#{r.blocks[i]}", ha="center", va="bottom",
                    fontsize=7, color="#C44E52" if returned else "dimgray")
        ax.text(-0.8, y, f"step {row + 1}\npositions {r.start}-{r.start + r.drafts}", ha="right", va="center", fontsize=7)
        emitted = r.accepted + 1
        ax.text((last - first) * width + 0.5, y, f"{r.accepted} of {r.drafts} drafts accepted + the target's own: "
                f"{emitted} token{'s' if emitted > 1 else ''}\nblock table {len(r.blocks)} → {len(r.kept)} blocks",
                va="center", fontsize=8)
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black", lw=0.5, hatch="xx" if n == "rejected" else None)
               for n, c in colors.items()]
    labels = ["computed before the step", "its last token (row 0)", "draft kept by the target",
              "draft rejected: slot rolled back", "the target's own token (next step's row 0)"]
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=5, fontsize=7, frameon=False)
    ax.set_xlim(-5, (last - first) * width + 17)
    ax.set_ylim(-len(steps) + 0.3, 1.1)
    ax.axis("off")
    accepted = sum(r.accepted for r in steps)
    ax.set_title(f"Speculative decoding over the block table (block_size={bs}; #n = physical block): the default model "
                 f"verifies k={k} drafts of its first 3 layers per step, greedy.\n{accepted} of {sum(r.drafts for r in steps)} "
                 f"drafts accepted in {len(steps)} steps; a block holding only rejected drafts goes back to the pool "
                 "(→ pool), and the next step writes over the rejected slots it keeps", fontsize=9, loc="left")
    return [_save(fig, out, "speculative_decoding")]


# GPU runs cannot be repeated here: their figures are drawn from the JSON documents the device runs wrote
# (`--json-out`), committed under docs/results/ with the command, GPU, date and commit inside them.
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
SERVE_RESULTS = RESULTS / "serve-2026-11-30-1000.json"
LATENCY_RESULTS = RESULTS / "latency-llama-3.1-8b-2026-11-30-poisson-seed1.json"
KERNEL_RESULTS = RESULTS / "kernel-2026-11-30.json"
ONLINE_RESULTS = RESULTS / "online-llama-3.1-8b-2026-12-01-process.json"


def _from_results(bench, results: Path, out: Path, name: str) -> list[Path]:
    import json

    if not results.is_file():
        raise FileNotFoundError(f"{results}: the saved device results this figure is drawn from are missing")
    path = out / f"{name}.png"
    bench.plot(json.loads(results.read_text()), path)
    return [path]


def fig_serve(out: Path, quick: bool) -> list[Path]:
    """`bench serve` on the H200: output tokens/s of every system at both model shapes."""
    from pagedref.bench import serve

    return _from_results(serve, SERVE_RESULTS, out, "serve")


def fig_latency(out: Path, quick: bool) -> list[Path]:
    """`bench latency` on the H200: ITL P50/P99 and throughput per token budget."""
    from pagedref.bench import latency

    return _from_results(latency, LATENCY_RESULTS, out, "latency")


def fig_online(out: Path, quick: bool) -> list[Path]:
    """`bench online` on the H200: TTFT, TPOT and ITL against the request rate, over HTTP."""
    from pagedref.bench import online

    return _from_results(online, ONLINE_RESULTS, out, "online")


def fig_kernel(out: Path, quick: bool) -> list[Path]:
    """`bench kernel` on the H200 (stage 5): the paged decode kernel's read bandwidth per shape, beside
    torch SDPA (cuDNN) on a contiguous cache and the device's measured copy bandwidth."""
    import json

    if not KERNEL_RESULTS.is_file():
        raise FileNotFoundError(f"{KERNEL_RESULTS}: the saved device results this figure is drawn from are missing")
    doc = json.loads(KERNEL_RESULTS.read_text())
    rows = doc["decode"]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4.4), layout="constrained")
    ax.bar([i - 0.2 for i in x], [r["sdpa_GBps"] for r in rows], 0.4, color="#8FB8DE",
           label=f"torch SDPA ({rows[0]['sdpa_backend']}), contiguous cache")
    ax.bar([i + 0.2 for i in x], [r["kernel_GBps"] for r in rows], 0.4, color="#4C72B0",
           label="pagedref decode kernel, paged cache (blocks in random order)")
    for i, r in zip(x, rows):
        ax.text(i + 0.2, r["kernel_GBps"] + 40, f"{r['kernel_GBps'] / r['sdpa_GBps']:.0%}", ha="center", fontsize=8)
    ax.axhline(doc["copy_GBps"], color="#C44E52", ls="--", lw=1, label=f"device copy, {doc['copy_GBps']:.0f} GB/s")
    ax.set_xticks(list(x), [f"{r['batch']} sequence{'s' if r['batch'] > 1 else ''}\n× {r['context']:,} tokens" for r in rows])
    ax.set_ylabel("K/V read bandwidth (GB/s)")
    ax.set_ylim(0, 1.12 * max(r["sdpa_GBps"] for r in rows))
    fig.legend(fontsize=8, loc="outside lower center", ncol=2)
    ax.set_title(f"Decode attention on {doc['gpu']} (bf16, 32 query / 8 KV heads, head_dim 128; commit "
                 f"{doc['commit']}, {doc['date']}); % = of SDPA", fontsize=9)
    return [_save(fig, out, "kernel")]


FIGURES: dict[str, Callable[[Path, bool], list[Path]]] = {  # name -> draws <name>.png (and <name>.md)
    "kv_memory": fig_kv_memory,
    "block_allocator": fig_block_allocator,
    "block_table": fig_block_table,
    "sharing": fig_sharing,
    "kernel": fig_kernel,
    "continuous_batching": fig_continuous_batching,
    "chunked_prefill": fig_chunked_prefill,
    "scheduling_policies": fig_scheduling_policies,
    "speculative_decoding": fig_speculative_decoding,
    "serve": fig_serve,
    "latency": fig_latency,
    "online": fig_online,
}


def generate(out: Path = DEFAULT_OUT, only: list[str] | None = None, quick: bool = False) -> list[Path]:
    """Draw the figures (all, or those named in `only`) into `out`; returns the files written.
    quick: the memory benchmark's shorter traces (for tests; the committed figures use the full ones)."""
    unknown = sorted(set(only or []) - set(FIGURES))
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}: choose from {sorted(FIGURES)}")
    out.mkdir(parents=True, exist_ok=True)
    return [path for name in (only or FIGURES) for path in FIGURES[name](out, quick)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedref.figures", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for the PNGs (default {DEFAULT_OUT})")
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"just these: {', '.join(FIGURES)}")
    parser.add_argument("--quick", action="store_true", help="the memory benchmark's shorter traces (tests)")
    args = parser.parse_args(argv)
    try:
        for path in generate(args.out, args.only, args.quick):
            print(path)
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
