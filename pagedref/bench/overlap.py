"""`python -m pagedref.bench overlap`: does a decode layer's attention run beside its weight GEMMs for free?

One idea: at a few hundred sequences a decode layer is a compute-bound chain of GEMMs around one memory-bound
kernel, attention. Split by KV-head groups, the layer has work that may run side by side: attention of group i
needs only group i's q/k/v columns, and o is a sum over the groups' columns of its input, so attention of
group i can run beside q/k/v of group i + 1 and o of group i - 1 (on a second stream, joined at each step):

    serial       qkv -> attention -> o -> MLP
    pipeline g   qkv_0; [attn_0 | qkv_1]; [attn_1 | o_0]; ...; [attn_g-1 | o_g-2]; o_g-1 (added to o_0..); MLP

(Group i's q/k/v are rows of three ranges of the merged matrix; the benchmark takes row slices of the same
sizes, as a pipeline that ordered the merged rows by group would.) If the GPU could lend attention's idle tensor
cores to the GEMMs, the layer would take less than the sum.
Each variant is one CUDA graph over `layers` copies of the weights and pools (so nothing stays in L2), replayed
round and round for a sustained window (bench.telemetry: the clock settles under the power cap; NVML gives the
joules), the variants measured in interleaved rounds. The layer's small kernels (norms, RoPE, the K/V write)
are left out: they are the same in every variant.

Invariant: every variant computes the same layer on the same tensors. The groups' pools are the whole pool's KV
heads, copied apart, and their queries the matching query heads, so the groups' attention outputs are the
whole attention's, bit for bit (tests/test_bench_overlap_gpu.py); o summed over the groups equals o to
rounding. Only the order of the kernels and what runs beside what differ.

What it showed on an H200 (2026-12-04, docs/benchmarks.md): the pipelines were slower (two groups +5%, four
+13%) and took more energy: the serial layer already draws the 700-W cap on average (its time is its energy
over the cap), and the narrower GEMMs spend more joules for the same FLOPs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagedref.bench import telemetry
from pagedref.bench.common import SHAPES, add_output_flags, emit, environment, parse_or_replay, pyplot, save_figure
from pagedref.bench.gemm import projection_shapes
from pagedref.bench.kernel import BLOCK_SIZE, DTYPE, DecodeCase
from pagedref.kernels import gemm


class Layer:
    """One layer's weights ([N, K], a model's scale) and attention problem, and its kernels in each order."""

    def __init__(self, model_shape: str, batch: int, context: int, groups: list[int], seed: int):
        cfg = SHAPES[model_shape]
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.w = {name: torch.randn(n, k, generator=gen, device="cuda", dtype=DTYPE) / k**0.5
                  for name, (k, n) in projection_shapes(model_shape).items()}
        self.attention = DecodeCase(batch, context, seed, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                    cfg["head_dim"])
        self.groups = {g: [self.attention.head_group(i, g) for i in range(g)] for g in groups}

    def mlp(self, x: torch.Tensor, h: torch.Tensor) -> None:
        """gate/up with SiLU and down: on the project's Hopper GEMM where it runs (as weight_gemm="pagedref"),
        elsewhere cuBLAS's two GEMMs (the SiLU left out: the same in every variant)."""
        if gemm.supported(x, self.w["gate_up"]):
            gemm.silu_mul_linear(x, self.w["gate_up"])
            gemm.linear(h, self.w["down"])
        else:
            F.linear(x, self.w["gate_up"])
            F.linear(h, self.w["down"])

    def serial(self, x: torch.Tensor, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        F.linear(x, self.w["qkv"])
        self.attention.run()
        o = F.linear(attn, self.w["o"])
        self.mlp(x, h)
        return o

    def pipeline(self, groups: int, side: torch.cuda.Stream, x: torch.Tensor, attn: torch.Tensor,
                 h: torch.Tensor) -> torch.Tensor:
        """Step i: attention of group i on `side`, beside q/k/v of group i + 1 and o of group i - 1 here."""
        main = torch.cuda.current_stream()
        qkv_cols, o_cols = self.w["qkv"].shape[0] // groups, self.w["o"].shape[1] // groups
        F.linear(x, self.w["qkv"][:qkv_cols])
        o = None
        for i in range(groups + 1):
            if i < groups:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    self.groups[groups][i].run()
            if i + 1 < groups:
                F.linear(x, self.w["qkv"][(i + 1) * qkv_cols:(i + 2) * qkv_cols])
            if i >= 1:
                a, w = attn[:, (i - 1) * o_cols:i * o_cols], self.w["o"][:, (i - 1) * o_cols:i * o_cols]
                o = F.linear(a, w) if o is None else torch.addmm(o, a, w.t())
            if i < groups:
                main.wait_stream(side)
        self.mlp(x, h)
        return o


def variants(layers: list[Layer], groups: list[int], side: torch.cuda.Stream, x, attn, h) -> dict:
    """{name: fn running every layer once}: the serial layer, each pipeline, and each kernel alone."""
    out = {"serial": lambda: [ly.serial(x, attn, h) for ly in layers]}
    for g in groups:
        out[f"pipeline {g}"] = lambda g=g: [ly.pipeline(g, side, x, attn, h) for ly in layers]
    out["qkv alone"] = lambda: [F.linear(x, ly.w["qkv"]) for ly in layers]
    out["attention alone"] = lambda: [ly.attention.run() for ly in layers]
    out["o alone"] = lambda: [F.linear(attn, ly.w["o"]) for ly in layers]
    out["mlp alone"] = lambda: [ly.mlp(x, h) for ly in layers]
    return out


def bench(model_shape: str, batch: int, context: int, groups: list[int], num_layers: int, seconds: float,
          rounds: int, side_priority: int) -> dict[str, list[dict]]:
    """{variant: one entry a round}: µs and mJ a layer, the SM clock and power of its sustained window."""
    cfg = SHAPES[model_shape]
    layers = [Layer(model_shape, batch, context, groups, seed) for seed in range(num_layers)]
    x, attn, h = (0.1 * torch.randn(batch, width, device="cuda", dtype=DTYPE) for width in
                  (cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"], cfg["intermediate_size"]))
    side = torch.cuda.Stream(priority=side_priority)
    graphs = {}
    for name, fn in variants(layers, groups, side, x, attn, h).items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            fn()
    uuid = telemetry.device_uuid(torch.device("cuda"))
    res: dict[str, list[dict]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            per_call, joules, tele = telemetry.sustained([g.replay], seconds, uuid, sync=torch.cuda.synchronize)
            res[name].append({"us_per_layer": per_call * 1e6 / num_layers,
                              "mJ_per_layer": None if joules is None else joules * 1e3 / num_layers,
                              "sm_clock_mhz": tele and tele.sm_clock_mhz, "power_w": tele and tele.power_w})
    return res


def print_report(doc: dict[str, Any]) -> None:
    env, a = doc["environment"], doc["args"]
    print(f"overlap: {env.get('gpu', env['device'])}, torch {env['torch']}, commit {env['commit']}, {env['date']}")
    print(f"{a['model_shape']}: {a['batch']} sequences of {a['context']} tokens, {a['layers']} layers in turn, "
          f"{a['seconds']} s a variant and round, the attention stream at {a['side_priority']} priority")
    for name, runs in doc["results"].items():
        us = " / ".join(f"{r['us_per_layer']:.1f}" for r in runs)
        mj = " / ".join(f"{r['mJ_per_layer']:.1f}" for r in runs if r["mJ_per_layer"] is not None) or "-"
        mhz = " / ".join(f"{r['sm_clock_mhz']:.0f}" for r in runs if r["sm_clock_mhz"]) or "-"
        print(f"  {name:18s} {us:>17} µs a layer   {mj:>13} mJ a layer   SM {mhz} MHz")


def plot(doc: dict[str, Any], path: Path) -> None:
    """µs a layer per variant, its fastest round (bars)."""
    plt = pyplot()
    names = list(doc["results"])
    fig, ax = plt.subplots(figsize=(1.5 + 1.1 * len(names), 3.8))
    ax.bar(names, [min(r["us_per_layer"] for r in doc["results"][n]) for n in names], color="#4C72B0")
    ax.set_ylabel("µs a layer, sustained")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    a = doc["args"]
    ax.set_title(f"{a['model_shape']}, {a['batch']} sequences of {a['context']} tokens "
                 f"({doc['environment'].get('gpu', 'cpu')})", fontsize=9)
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedref.bench overlap", description=__doc__.split("\n")[0])
    ap.add_argument("--model-shape", default="llama-3.1-8b", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--batch", type=int, default=256, help="sequences decoding (the GEMMs' rows)")
    ap.add_argument("--context", type=int, default=208, help="tokens a sequence (a multiple of 16)")
    ap.add_argument("--groups", nargs="+", type=int, default=[2, 4], help="KV-head groups of each pipeline")
    ap.add_argument("--layers", type=int, default=4, help="copies of the layer, replayed in turn (past L2)")
    ap.add_argument("--seconds", type=float, default=1.5, help="sustained window per variant and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side-priority", choices=("default", "high"), default="default",
                    help="the attention stream's priority in the pipelines")
    add_output_flags(ap, "µs a layer per variant")
    args = parse_or_replay(ap, argv, print_report, plot)
    if args is None:
        return 0
    kv_heads = SHAPES[args.model_shape]["num_key_value_heads"]
    if args.context <= 0 or args.context % BLOCK_SIZE or args.batch <= 0 or args.layers <= 0 or args.rounds <= 0:
        ap.error(f"--context must be a positive multiple of {BLOCK_SIZE}; --batch, --layers, --rounds positive")
    if any(g < 2 or kv_heads % g for g in args.groups):
        ap.error(f"--groups must divide the model's {kv_heads} KV heads, each at least 2")
    if not torch.cuda.is_available():
        print("the overlap benchmark needs a CUDA GPU", file=sys.stderr)
        return 1
    priority = torch.cuda.Stream.priority_range()[1] if args.side_priority == "high" else 0
    keys = ("model_shape", "batch", "context", "groups", "layers", "seconds", "rounds", "side_priority")
    doc = {"benchmark": "overlap", "environment": environment("cuda"), "args": {k: getattr(args, k) for k in keys},
           "results": bench(args.model_shape, args.batch, args.context, args.groups, args.layers, args.seconds,
                            args.rounds, priority)}
    emit(doc, args, print_report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
