"""`python -m pagedref.bench gather`: the read roofline of the paged K/V pool, access pattern by access pattern.

One idea: decode attention is a stream of K/V reads, so its ceiling is the speed at which the GPU reads the pool
in the kernel's own access pattern, with the kernel's own occupancy, and nothing else. `cuda/kv_read.cu` does
exactly that (a checksum of the bytes, no arithmetic): v3's per-lane loads, whole rows, or whole blocks, each with
a reservation of shared memory per CTA that the kernel never touches. Beside it, in the same run and on the same
pool, the default decode kernel: its share of its own pattern's roofline is what a better schedule could still
win. Invariant: every pattern reads every K/V byte of the batch once (pagedref.kernels.kv_read; its checksums say
which bytes: tests/test_bench_gather_gpu.py).

`--launch-constant CONTEXT ...` asks what a short context costs: at each context it times the default decode and the
read in v3's lanes with a CTA per KV head and context (so the same grid), at several batches, and fits each as
time = constant + bytes / rate. The constant is what a launch costs whatever its bytes; the read's is the part no
decode kernel with this grid escapes.

What it showed on an H200 (2026-12-04, docs/benchmarks.md): the pool's 256-byte rows in random blocks read at
~4.4-4.5 TB/s in v3's pattern, ~1% more in whole rows, ~1% more again with the blocks in order; and shared memory
costs the stream: 4 CTAs an SM of 36 KB each read 6% slower than of 20 KB (L1 and shared memory share the SM's
256 KB, and L1 holds the lines of the loads in flight).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import numpy as np
import torch

from pagedref.bench.kernel import NUM_KV_HEADS, DecodeCase, copy_bandwidth, time_rounds
from pagedref.kernels.kv_read import MAX_SHARED_KB, PARTITION_SIZE, kv_read


def read_fn(case: DecodeCase, pattern: str, shared_kb: int, block_tables: torch.Tensor, out: torch.Tensor):
    """A launch of kv_read over `case`'s pool, as `pattern` reads it, with `shared_kb` KB reserved per CTA."""
    return lambda: kv_read(case.k_cache, case.v_cache, block_tables, out, pattern, shared_kb)


def bench(batch: int, context: int, patterns: list[str], shared_kbs: list[int], reps: int) -> dict:
    """GB/s of K/V read by each (pattern, shared KB, block order), and by the default decode kernel, measured in
    interleaved rounds on one pool (bench.kernel.time_rounds)."""
    case = DecodeCase(batch, context)
    in_order = torch.arange(case.block_tables.numel(), dtype=torch.int32, device="cuda").view_as(case.block_tables)
    out = torch.zeros(case.batch, context // PARTITION_SIZE, NUM_KV_HEADS, dtype=torch.int32, device="cuda")
    fns = {"decode (default)": [case.run]}
    for pattern in patterns:
        for kb in shared_kbs:
            fns[f"{pattern}, {kb} KB shared a CTA"] = [read_fn(case, pattern, kb, case.block_tables, out)]
        fns[f"{pattern}, blocks in order, {shared_kbs[0]} KB"] = [read_fn(case, pattern, shared_kbs[0], in_order, out)]
    times = time_rounds(fns, reps)
    return {"batch": batch, "context": context, "kv_GB": case.kv_bytes / 1e9,
            "GBps": {name: case.kv_bytes / ms / 1e6 for name, (ms, _) in times.items()}}


def fit(points: list[dict], key: str) -> dict:
    """Least squares of each point's time (its `key`, in µs) on its K/V bytes: the constant (µs) and the rate (GB/s)."""
    gb = np.array([p["kv_bytes"] for p in points]) / 1e9
    us_per_gb, constant = np.polyfit(gb, np.array([p[key] for p in points]), 1)
    return {"constant_us": float(constant), "GBps": float(1e6 / us_per_gb)}


def launch_constant(contexts: list[int], batches: list[int], reps: int) -> list[dict]:
    """Per context: the default decode and kv_read ("v3 lanes", a CTA per KV head and context), timed in interleaved
    rounds at each batch on one pool, and each one's fit (constant + bytes / rate)."""
    rows = []
    for context in contexts:
        points = []
        for batch in batches:
            case = DecodeCase(batch, context)
            out = torch.zeros(batch, 1, NUM_KV_HEADS, dtype=torch.int32, device="cuda")
            read = lambda c=case, o=out: kv_read(c.k_cache, c.v_cache, c.block_tables, o, "v3 lanes", 0, c.context)  # noqa: E731
            times = time_rounds({"decode": [case.run], "read": [read]}, reps)
            points.append({"batch": batch, "kv_bytes": case.kv_bytes, "decode_us": times["decode"][0] * 1e3,
                           "read_us": times["read"][0] * 1e3})
        rows.append({"context": context, "points": points, "decode": fit(points, "decode_us"),
                     "read": fit(points, "read_us")})
    return rows


def print_patterns(res: dict) -> None:
    print(f"{res['gpu']}, {res['date']}: ({res['batch']}, {res['context']}), {res['kv_GB']:.2f} GB of K/V; "
          f"copy {res['copy_GBps']:.0f} GB/s (read + written)")
    for name, gbps in res["GBps"].items():
        print(f"  {name:45s} {gbps:7.0f} GB/s  {gbps / res['copy_GBps']:6.1%} of the copy")


def print_launch_constant(res: dict) -> None:
    print(f"{res['gpu']}, {res['date']}: copy {res['copy_GBps']:.0f} GB/s (read + written)")
    print("context | read: constant, rate | decode: constant, rate | µs read / decode at each batch")
    for r in res["launch_constant"]:
        at = "  ".join(f"{p['batch']}: {p['read_us']:.1f} / {p['decode_us']:.1f}" for p in r["points"])
        print(f"{r['context']:7d} | {r['read']['constant_us']:5.1f} µs, {r['read']['GBps']:5.0f} GB/s | "
              f"{r['decode']['constant_us']:5.1f} µs, {r['decode']['GBps']:5.0f} GB/s | {at}")


def main(argv: list[str] | None = None) -> int:
    from pagedref.kernels.build import KV_READ_PATTERNS

    ap = argparse.ArgumentParser(prog="python -m pagedref.bench gather", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096, help="tokens a sequence (a multiple of 1024)")
    ap.add_argument("--patterns", nargs="+", choices=list(KV_READ_PATTERNS), default=list(KV_READ_PATTERNS))
    ap.add_argument("--shared-kb", nargs="+", type=int, default=[0, 12, 20, 36, 54], metavar="KB",
                    help="shared memory reserved per CTA (4 CTAs an SM; at most 56 KB)")
    ap.add_argument("--launch-constant", nargs="+", type=int, metavar="CONTEXT",
                    help="instead: the constant a launch costs at these contexts (multiples of 16), decode beside the "
                         "read with a CTA per KV head and context, fitted over --batches")
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 128, 256, 512, 1024],
                    help="with --launch-constant: the batches fitted")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="also write the results as JSON to this path")
    args = ap.parse_args(argv)
    if args.context % PARTITION_SIZE or args.context <= 0 or args.batch <= 0:
        ap.error(f"--context must be a positive multiple of {PARTITION_SIZE} and --batch positive")
    if args.launch_constant and (any(c <= 0 or c % 16 for c in args.launch_constant) or len(set(args.batches)) < 2
                                 or min(args.batches) <= 0):
        ap.error("--launch-constant takes positive multiples of 16, fitted over at least two positive --batches")
    if any(kb < 0 or kb > MAX_SHARED_KB for kb in args.shared_kb):
        ap.error(f"--shared-kb takes 0 to {MAX_SHARED_KB} KB (4 CTAs of 128 threads an SM share 228 KB)")
    if not torch.cuda.is_available():
        print("the gather benchmark needs a CUDA GPU", file=sys.stderr)
        return 1
    res = {"command": "python -m pagedref.bench gather " + " ".join(argv or []),
           "gpu": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat()}
    res["copy_GBps"], res["copy_method"] = copy_bandwidth(args.reps)
    if args.launch_constant:
        res["launch_constant"] = launch_constant(args.launch_constant, args.batches, args.reps)
    else:
        res.update(bench(args.batch, args.context, args.patterns, args.shared_kb, args.reps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    (print_launch_constant if args.launch_constant else print_patterns)(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
