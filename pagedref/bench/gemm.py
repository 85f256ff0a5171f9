"""The decode step's weight matmuls as the libraries run them: cuBLAS as torch picks it, cuBLASLt, TunableOp.

One idea: a serving step at a few hundred sequences is bound by its weight GEMMs (docs/benchmarks.md,
"Where a decode step's time goes"), and torch hands them to cuBLAS. Before a GEMM of our own, measure
what the libraries already offer: each projection of a model shape at M = the step's rows, timed in a
CUDA graph in each mode, with bench kernel's timing (time_ms: enough buffer sets that the weights
do not stay in L2). TunableOp (torch.cuda.tunable) tunes every shape in the eager warm-up, over the
candidates cuBLASLt offers, and the tuned choice is captured like the others.

Invariant: every mode times the same tensors and the same call (torch.matmul(x, w.t()), the layout of
nn.Linear's y = x W^T); only the library's choice of kernel differs.

    python -m pagedref.bench gemm --model-shape llama-3.1-8b --rows 128 256 512 --json gemm.json
    python -m pagedref.bench gemm --rows 256 --modes default --extra 4096x16896 4096x33792   # wave quantization

--extra KxN adds shapes beside the model's: a library kernel's tiles fill whole waves of the SMs at some
N and not at others, and the TFLOP/s at N that do is what a GEMM of the model's own N could reach.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from pagedref.bench.common import SHAPES, environment, size_pair

MODES = ("default", "cublaslt", "tunable")
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's weight matmuls, in projection_shapes


def projection_shapes(model_shape: str) -> dict[str, tuple[int, int]]:
    """(K, N) of each of a layer's weight matmuls: the merged q/k/v and gate/up projections, o, down."""
    cfg = SHAPES[model_shape]
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}


def extra_shape(text: str) -> tuple[int, int]:
    """'4096x16896' -> (4096, 16896): an --extra entry (K x N of a weight)."""
    return size_pair(text, "KxN", "4096x16896")


def set_mode(mode: str) -> None:
    import torch

    torch.backends.cuda.preferred_blas_library("cublaslt" if mode == "cublaslt" else "cublas")
    tunable = torch.cuda.tunable
    tunable.enable(mode == "tunable")
    tunable.tuning_enable(mode == "tunable")
    if mode == "tunable":  # a fresh results file: tune now, never read an earlier run's choices
        tunable.set_filename(os.path.join(tempfile.mkdtemp(prefix="pagedref-tunableop-"), "results.csv"))


def bench_mode(mode: str, shapes: dict[str, tuple[int, int]], rows: list[int], reps: int) -> dict[str, float]:
    import torch

    from pagedref.bench.kernel import num_sets, time_ms

    set_mode(mode)
    out = {}
    for m in rows:
        for name, (k, n) in shapes.items():
            gen = torch.Generator(device="cuda").manual_seed(m + k + n)
            sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen),  # x
                     torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen),  # w
                     torch.empty(m, n, device="cuda", dtype=torch.bfloat16))  # y
                    for _ in range(num_sets(2 * (m * k + n * k + m * n)))]
            ms, _ = time_ms([lambda x=x, w=w, y=y: torch.matmul(x, w.t(), out=y) for x, w, y in sets], reps)
            out[f"{name}@{m}"] = ms * 1e3
    set_mode("default")
    return out


def print_report(res: dict) -> None:
    shapes, layers = res["shapes"], res["num_layers"]
    layer = [name for name in shapes if name in PROJECTIONS]  # the --extra shapes are not the model's
    print(f"{res['model_shape']} weight matmuls, bf16, graphed; µs (TFLOP/s); {'/'.join(res['modes'])}")
    for m in res["rows"]:
        cells = []
        for name, (k, n) in shapes.items():
            us = [res["us"][mode][f"{name}@{m}"] for mode in res["modes"]]
            cells.append(f"{name} " + " / ".join(f"{u:.1f} ({2 * m * k * n / u / 1e6:.0f})" for u in us))
        step = [sum(res["us"][mode][f"{name}@{m}"] for name in layer) * layers / 1e3 for mode in res["modes"]]
        print(f"  M={m:4d}: " + " | ".join(cells) + " | x" + f"{layers} layers: " + " / ".join(f"{s:.2f} ms" for s in step))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedref.bench gemm", description=__doc__.split("\n")[0])
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--rows", nargs="+", type=int, default=[128, 256, 512], help="M: the step's token rows")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--reps", type=int, default=50, help="timed calls per shape (median reported)")
    ap.add_argument("--extra", nargs="+", type=extra_shape, default=[], metavar="KxN",
                    help="more (K, N) weight shapes to time beside the model's projections")
    ap.add_argument("--json", help="also write the results as JSON to this path")
    args = ap.parse_args(argv)
    if min(args.rows) < 1 or args.reps < 1:
        ap.error("--rows and --reps must be positive")
    import torch

    if not torch.cuda.is_available():
        print("the GEMM benchmark needs a CUDA GPU", file=sys.stderr)
        return 1
    shapes = projection_shapes(args.model_shape) | {f"{k}x{n}": (k, n) for k, n in args.extra}
    res = {"command": "python -m pagedref.bench gemm " + " ".join(argv or []), **environment("cuda"),
           "model_shape": args.model_shape, "num_layers": SHAPES[args.model_shape]["num_hidden_layers"],
           "shapes": shapes, "rows": args.rows, "modes": args.modes,
           "us": {mode: bench_mode(mode, shapes, args.rows, args.reps) for mode in args.modes}}
    print_report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
