"""The decode step's weight matmuls: cuBLAS as torch picks it, cuBLASLt, TunableOp, and pagedref's own.

One idea: a serving step at a few hundred sequences is bound by its weight GEMMs (docs/benchmarks.md,
"Where a decode step's time goes"), and torch hands them to cuBLAS. Before a GEMM of our own, measure
what the libraries already offer: each projection of a model shape at M = the step's rows, timed in a
CUDA graph in each mode, with bench kernel's timing (time_ms: enough buffer sets that the weights
do not stay in L2). TunableOp (torch.cuda.tunable) tunes every shape in the eager warm-up, over the
candidates cuBLASLt offers, and the tuned choice is captured like the others.

The pagedref mode times the project's Hopper GEMM (`pagedref.kernels.gemm`, sm_90 only) with each
weight's own tile, and `--tiles` times other tilings beside it. The row `gate_up_silu` is SwiGLU's first
half: the GEMM then `fused.silu_and_mul` in the library modes, one kernel (`gemm.silu_mul_linear`) in
pagedref's; the step sums the layer with it in place of gate_up.

Invariant: every mode times the same tensors and the same product (y = x W^T, nn.Linear's layout);
only the kernel differs.

    python -m pagedref.bench gemm --model-shape llama-3.1-8b --rows 128 256 512 --json gemm.json
    python -m pagedref.bench gemm --rows 256 --modes default --extra 4096x16896 4096x33792   # wave quantization
    python -m pagedref.bench gemm --rows 256 --modes default pagedref --tiles 128x1 224x1 256x2   # tilings side by side

--extra KxN adds shapes beside the model's: a library kernel's tiles fill whole waves of the SMs at some
N and not at others, and the TFLOP/s at N that do is what a GEMM of the model's own N could reach.
--l2-resident times one buffer set instead, so a weight that fits in L2 stays there from call to call:
beside the default run, what reading the weights from HBM costs in time and (with --sustain) in joules.
--weight-stream ROUNDS makes that comparison in one run: each round times every GEMM sustained with its
weights from HBM, then from L2, and the report gives the difference in joules a byte of weight, and the line
that difference makes over the --extra shapes (chosen to fit in L2): its slope is what one more byte
streamed from HBM costs, its intercept the part paid once a launch.

    python -m pagedref.bench gemm --rows 256 --modes default pagedref --extra 4096x2048 4096x2560 4096x3072 4096x3584 4096x4096 --weight-stream 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict

from pagedref.bench.common import SHAPES, environment, size_pair

MODES = ("default", "cublaslt", "tunable", "pagedref")
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's weight matmuls, in projection_shapes
FUSED_LAYER = ("qkv", "o", "gate_up_silu", "down")  # the same with silu(gate) * up after (or in) gate/up


def projection_shapes(model_shape: str) -> dict[str, tuple[int, int]]:
    """(K, N) of each of a layer's weight matmuls: the merged q/k/v and gate/up projections, o, down."""
    cfg = SHAPES[model_shape]
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}


def extra_shape(text: str) -> tuple[int, int]:
    """'4096x16896' -> (4096, 16896): an --extra entry (K x N of a weight)."""
    return size_pair(text, "KxN", "4096x16896")


def tile_arg(text: str):
    """'224x1' -> GemmTile(224, 1): a --tiles entry, tile width x splits of K, then optionally sN for an
    N-stage ring (default: the deepest that fits) and c1 for no clusters ('96x1s6c1': each CTA copies its
    own B tile through 6 stages)."""
    from pagedref.kernels.build import GemmTile

    m = re.fullmatch(r"(\d+x\d+)(?:s(\d+))?(c1)?", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected BNxSPLITS[sSTAGES][c1], e.g. 224x1 or 96x1s8, got {text!r}")
    bn, splits = size_pair(m[1], "BNxSPLITS", "224x1")
    try:
        return GemmTile(bn, splits, int(m[2]) if m[2] else None, 1 if m[3] else 2)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def split_key(key: str) -> tuple[str, str, str]:
    """A result's key -> its parts: 'gate_up@256' -> ('gate_up', '256', ''), 'gate_up@256:64x1' (a --tiles
    tiling, tile_label's spelling after the rows) -> ('gate_up', '256', '64x1')."""
    name, _, at = key.partition("@")
    rows, _, tile = at.partition(":")
    return name, rows, tile


def tile_label(t) -> str:
    """GemmTile(96, 1, 6, 1) -> ':96x1s6c1', tile_arg's spelling (the defaults left out)."""
    from pagedref.kernels.build import gemm_max_stages

    return (f":{t.bn}x{t.splits}" + (f"s{t.stages}" if t.stages != gemm_max_stages(t.bn) else "")
            + ("c1" if t.cluster == 1 else ""))


def set_mode(mode: str) -> None:
    import torch

    torch.backends.cuda.preferred_blas_library("cublaslt" if mode == "cublaslt" else "cublas")
    tunable = torch.cuda.tunable
    tunable.enable(mode == "tunable")
    tunable.tuning_enable(mode == "tunable")
    if mode == "tunable":  # a fresh results file: tune now, never read an earlier run's choices
        tunable.set_filename(os.path.join(tempfile.mkdtemp(prefix="pagedref-tunableop-"), "results.csv"))


def buffer_sets(bytes_per_set: int, l2_resident: bool) -> int:
    """Buffer sets a shape is timed over: enough that the weights do not stay in L2 (bench.kernel.num_sets), or
    with l2_resident one, so that a weight that fits in L2 is read from there after the first call."""
    if l2_resident:
        return 1
    from pagedref.bench.kernel import num_sets

    return num_sets(bytes_per_set)


def bench_mode(mode: str, shapes: dict[str, tuple[int, int]], rows: list[int], reps: int,
               tiles: list | None = None, sustain_s: float = 0.0, sustained: dict | None = None,
               l2_resident: bool = False) -> dict[str, float]:
    """{"name@M": µs} of each shape in `mode` (pagedref: also "name@M:BNxS" for each of `tiles`). With sustain_s,
    each is also run round and round for that long and `sustained[key]` gets its µs, energy, power and clock
    there (bench.telemetry.sustained: the power-capped figures a long run sees). l2_resident: `buffer_sets`."""
    import torch

    from pagedref.bench import telemetry
    from pagedref.bench.kernel import measure, prepare

    set_mode(mode)
    out = {}
    for m in rows:
        for name, (k, n) in shapes.items():
            gen = torch.Generator(device="cuda").manual_seed(m + k + n)
            silu = name == "gate_up_silu"
            # A model's scales: unit activations (a norm's output), weights of std 1 / sqrt(k), so the products
            # are O(1). (Unscaled, gate/up's gates are ~N(0, k) and the SiLU's division leaves its fast path.)
            sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen),  # x
                     (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16),  # w
                     torch.empty(m, n, device="cuda", dtype=torch.bfloat16),  # y
                     torch.empty(m, n // 2, device="cuda", dtype=torch.bfloat16))  # silu(gate) * up
                    for _ in range(buffer_sets(2 * (m * k + n * k + m * n), l2_resident))]
            for label, call in calls(mode, silu, n, k, tiles):
                replays, _ = prepare([lambda x=x, w=w, y=y, h=h: call(x, w, y, h) for x, w, y, h in sets])
                out[f"{name}@{m}{label}"] = measure(replays, reps) * 1e3
                if sustain_s > 0 and sustained is not None:
                    sec, joules, tele = telemetry.sustained(replays, sustain_s, telemetry.device_uuid(torch.device("cuda")),
                                                            sync=torch.cuda.synchronize)
                    sustained[f"{name}@{m}{label}"] = {"us": sec * 1e6, "mj": joules and joules * 1e3,
                                                       **(asdict(tele) if tele else {})}
    set_mode("default")
    return out


def calls(mode: str, silu: bool, n: int, k: int, tiles: list | None):
    """[(label, call(x, w, y, h))] to time for one shape: the library's product (then silu_and_mul into h),
    or pagedref's GEMM with the weight's own tile ("") and with each of `tiles` that fits (":BNxS")."""
    import torch

    from pagedref.kernels import fused

    if mode != "pagedref":
        if silu:
            return [("", lambda x, w, y, h: fused.silu_and_mul(torch.matmul(x, w.t(), out=y), out=h))]
        return [("", lambda x, w, y, h: torch.matmul(x, w.t(), out=y))]
    from pagedref.kernels import gemm

    found = [("", None)] + [(tile_label(t), t) for t in tiles or [] if gemm.tile_fits(t, n, silu)]
    if silu:
        return [(label, lambda x, w, y, h, t=t: gemm.silu_mul_linear(x, w, out=h, tile=t)) for label, t in found]
    return [(label, lambda x, w, y, h, t=t: gemm.linear(x, w, out=y, tile=t)) for label, t in found]


def stream_cost(runs: dict[str, list[dict]], shapes: dict[str, tuple[int, int]], fit: list[str]) -> dict:
    """What reading its weights from HBM costs each GEMM, from --weight-stream's rounds: runs["hbm"] and runs["l2"]
    each a list of rounds, a round {mode: {"name@M": {"mj": joules a call x 1e3, ...}}} (bench_mode's sustained).
    -> {mode: {"shapes": {key: weight bytes, mean mJ from HBM and from L2 over the rounds, their difference, and
    that over the weight's bytes in pJ}, "lines": {M (or "M:BNxS" for a --tiles tiling): the least-squares line
    difference = fixed_mj + pj_per_byte x bytes over the `fit` shapes at M}}}. Keys without an energy figure (no
    NVML counter) are left out."""
    import numpy as np

    out = {}
    for mode in runs["hbm"][0]:
        rows = {}
        for key in runs["hbm"][0][mode]:
            hbm = [r[mode][key]["mj"] for r in runs["hbm"]]
            l2 = [r[mode][key]["mj"] for r in runs["l2"]]
            if None in hbm + l2:
                continue
            k, n = shapes[split_key(key)[0]]
            weight_bytes = 2 * k * n  # 16-bit
            hbm_mj, l2_mj = float(np.mean(hbm)), float(np.mean(l2))
            rows[key] = {"weight_bytes": weight_bytes, "hbm_mj": hbm_mj, "l2_mj": l2_mj, "diff_mj": hbm_mj - l2_mj,
                         "pj_per_byte": (hbm_mj - l2_mj) * 1e9 / weight_bytes}
        lines = {}
        for m in sorted({key.partition("@")[2] for key in rows}):  # what follows the name: "256", or "256:64x1"
            names = [name for name in fit if f"{name}@{m}" in rows]  # the fitted shapes that have figures
            points = [rows[f"{name}@{m}"] for name in names]
            if len({p["weight_bytes"] for p in points}) >= 2:  # a line needs two sizes
                slope, fixed = np.polyfit([p["weight_bytes"] for p in points], [p["diff_mj"] for p in points], 1)
                lines[m] = {"fixed_mj": float(fixed), "pj_per_byte": float(slope) * 1e9, "shapes": names}
        out[mode] = {"shapes": rows, "lines": lines}
    return out


def print_stream(cost: dict, rounds: int) -> None:
    """--weight-stream's report: each GEMM's mJ a call from HBM and from L2 (means over the rounds), the difference
    in pJ a byte of weight, and the line over the fitted shapes (the margin: what one more byte costs)."""
    print(f"the weights' stream: sustained mJ a call with the weights from HBM / from L2, mean of {rounds} rounds")
    for mode, figures in cost.items():
        for key, f in figures["shapes"].items():
            print(f"  {mode} {key}: {f['weight_bytes'] / 1e6:.1f} MB, {f['hbm_mj']:.2f} / {f['l2_mj']:.2f} mJ, "
                  f"difference {f['diff_mj']:.2f} mJ = {f['pj_per_byte']:.0f} pJ a byte")
        for m, line in figures["lines"].items():  # m: "256", or "256:64x1" for a --tiles tiling
            rows, _, tile = m.partition(":")
            print(f"  {mode} at {rows} rows{f', tile {tile}' if tile else ''}, over {' '.join(line['shapes'])}: "
                  f"{line['pj_per_byte']:.0f} pJ a byte at the margin, {line['fixed_mj']:.2f} mJ a launch")


def print_report(res: dict) -> None:
    shapes, layers = res["shapes"], res["num_layers"]
    print(f"{res['model_shape']} weight matmuls, bf16, graphed; µs (TFLOP/s); {'/'.join(res['modes'])}"
          + ("; one buffer set (weights that fit stay in L2)" if res.get("l2_resident") else ""))
    for m in res["rows"]:
        cells = []
        for name, (k, n) in shapes.items():
            us = [res["us"][mode][f"{name}@{m}"] for mode in res["modes"]]
            cells.append(f"{name} " + " / ".join(f"{u:.1f} ({2 * m * k * n / u / 1e6:.0f})" for u in us))
        print(f"  M={m:4d}: " + " | ".join(cells))
        for layer in (PROJECTIONS, FUSED_LAYER) if "gate_up_silu" in shapes else (PROJECTIONS,):
            step = [sum(res["us"][mode][f"{name}@{m}"] for name in layer) * layers / 1e3 for mode in res["modes"]]
            print(f"    x {layers} layers of {' + '.join(layer)}: " + " / ".join(f"{s:.2f} ms" for s in step))
        for key in res["us"].get("pagedref", {}):
            name, rows, tile = split_key(key)
            if rows != str(m) or not tile:  # only the --tiles tilings at these rows
                continue
            k, n = shapes[name]
            us = res["us"]["pagedref"][key]
            print(f"    pagedref {key}: {us:.1f} µs ({2 * m * k * n / us / 1e6:.0f} TFLOP/s)")


def print_sustained(res: dict) -> None:
    """The --sustain figures: each GEMM's µs, energy a call, mean power and SM clock when run round and round."""
    for mode, figures in res.get("sustained", {}).items():
        for key, f in figures.items():
            name, rows, _ = split_key(key)
            m = int(rows)
            k, n = res["shapes"][name]
            mj = f.get("mj")
            print(f"  sustained {mode} {key}: {f['us']:.1f} µs" + (
                f", {mj:.2f} mJ ({mj * 1e-3 / (2 * m * k * n) * 1e12:.2f} pJ/FLOP), {mj / f['us'] * 1e3:.0f} W" if mj else "")
                + (f", SM {f['sm_clock_mhz']:.0f} MHz, power-capped {f['power_capped_share']:.0%}" if "sm_clock_mhz" in f else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedref.bench gemm", description=__doc__.split("\n")[0])
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--rows", nargs="+", type=int, default=[128, 256, 512], help="M: the step's token rows")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--reps", type=int, default=50, help="timed calls per shape (median reported)")
    ap.add_argument("--extra", nargs="+", type=extra_shape, default=[], metavar="KxN",
                    help="more (K, N) weight shapes to time beside the model's projections")
    ap.add_argument("--tiles", nargs="+", type=tile_arg, default=[], metavar="BNxSPLITS",
                    help="pagedref mode: also time these tilings of every shape they divide")
    ap.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                    help="also run each GEMM round and round this long: its µs, energy and clock under the power cap")
    ap.add_argument("--l2-resident", action="store_true",
                    help="time one buffer set: weights that fit in L2 stay there (what HBM costs, beside a default run)")
    ap.add_argument("--weight-stream", type=int, default=0, metavar="ROUNDS",
                    help="time every GEMM sustained from HBM and from L2 in turn, ROUNDS times: what streaming a byte costs")
    ap.add_argument("--json", help="also write the results as JSON to this path")
    args = ap.parse_args(argv)
    if min(args.rows) < 1 or args.reps < 1 or args.sustain < 0:
        ap.error("--rows and --reps must be positive, --sustain at least 0")
    if args.weight_stream < 0:
        ap.error("--weight-stream at least 0 (rounds of HBM then L2)")
    if args.weight_stream and args.l2_resident:
        ap.error("--weight-stream times both ways itself: leave out --l2-resident")
    import torch

    if not torch.cuda.is_available():
        print("the GEMM benchmark needs a CUDA GPU", file=sys.stderr)
        return 1
    shapes = projection_shapes(args.model_shape)
    shapes |= {"gate_up_silu": shapes["gate_up"]} | {f"{k}x{n}": (k, n) for k, n in args.extra}
    res = {"command": "python -m pagedref.bench gemm " + " ".join(argv or []), **environment("cuda"),
           "model_shape": args.model_shape, "num_layers": SHAPES[args.model_shape]["num_hidden_layers"],
           "shapes": shapes, "rows": args.rows, "modes": args.modes, "l2_resident": args.l2_resident,
           "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size}

    def every_mode(sustain_s: float, l2_resident: bool) -> tuple[dict, dict]:
        """One pass over the modes: ({mode: {key: µs}}, {mode: {key: sustained figures}})."""
        figures = {mode: {} for mode in args.modes}
        us = {mode: bench_mode(mode, shapes, args.rows, args.reps, args.tiles, sustain_s, figures[mode], l2_resident)
              for mode in args.modes}
        return us, figures

    if args.weight_stream:
        sustain = args.sustain or 1.5
        runs = {"hbm": [], "l2": []}
        for i in range(args.weight_stream):
            for where in runs:  # HBM, then L2, in every round: the clock's drift falls on both alike
                us, figures = every_mode(sustain, where == "l2")
                runs[where].append(figures)
                if i == 0 and where == "hbm":  # the first round from HBM is also the plain run's report
                    res["us"], res["sustained"] = us, figures
        res["weight_stream"] = {"rounds": runs, "cost": stream_cost(runs, shapes, [f"{k}x{n}" for k, n in args.extra])}
    else:
        res["us"], res["sustained"] = every_mode(args.sustain, args.l2_resident)
    print_report(res)
    print_sustained(res)
    if args.weight_stream:
        print_stream(res["weight_stream"]["cost"], args.weight_stream)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
