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
decode kernel with this grid escapes. With `--energy SECONDS`, at each of those contexts and the largest batch, the
decode, the read and a copy of the same bytes each run round and round for that long (bench.telemetry.sustained):
their joules a byte, over the idle draw measured in the same call. Under the H200's 700-W cap a decode step's time
is its energy (docs/benchmarks.md), so what the decode spends beyond the read of its bytes is what its arithmetic and
schedule could still give the step.

What it showed on an H200 (2026-12-04, docs/benchmarks.md): the pool's 256-byte rows in random blocks read at
~4.4-4.5 TB/s in v3's pattern, ~1% more in whole rows, ~1% more again with the blocks in order; and shared memory
costs the stream: 4 CTAs an SM of 36 KB each read 6% slower than of 20 KB (L1 and shared memory share the SM's
256 KB, and L1 holds the lines of the loads in flight). Since 2026-12-05 each read asks for the carve-out decode
gets (`kv_read.carveout`): left to the driver, this kernel of few registers got shared memory for more CTAs than
decode runs, and read ~2% slower at 12 KB a CTA than it does with decode's L1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import numpy as np
import torch

from pagedref.bench import telemetry
from pagedref.bench.kernel import NUM_KV_HEADS, DecodeCase, copy_bandwidth, num_sets, prepare, time_rounds
from pagedref.kernels.kv_read import CTAS_PER_SM, MAX_SHARED_KB, PARTITION_SIZE, SM_SHARED_KB, kv_read


def read_fn(case: DecodeCase, pattern: str, shared_kb: int, block_tables: torch.Tensor, out: torch.Tensor,
            partition: int = PARTITION_SIZE):
    """A launch of kv_read over `case`'s pool, as `pattern` reads it, with `shared_kb` KB reserved per CTA and a CTA
    per KV head and `partition` tokens."""
    return lambda: kv_read(case.k_cache, case.v_cache, block_tables, out, pattern, shared_kb, partition)


def bench(batch: int, context: int, patterns: list[str], shared_kbs: list[int], reps: int,
          partition: int = PARTITION_SIZE) -> dict:
    """GB/s of K/V read by each (pattern, shared KB, block order), a CTA per KV head and `partition` tokens, and by
    the default decode kernel, measured in interleaved rounds on one pool (bench.kernel.time_rounds)."""
    case = DecodeCase(batch, context)
    in_order = torch.arange(case.block_tables.numel(), dtype=torch.int32, device="cuda").view_as(case.block_tables)
    out = torch.zeros(case.batch, context // partition, NUM_KV_HEADS, dtype=torch.int32, device="cuda")
    fns = {"decode (default)": [case.run]}
    for pattern in patterns:
        for kb in shared_kbs:
            fns[f"{pattern}, {kb} KB shared a CTA"] = [read_fn(case, pattern, kb, case.block_tables, out, partition)]
        fns[f"{pattern}, blocks in order, {shared_kbs[0]} KB"] = [read_fn(case, pattern, shared_kbs[0], in_order, out,
                                                                           partition)]
    times = time_rounds(fns, reps)
    return {"batch": batch, "context": context, "partition": partition, "kv_GB": case.kv_bytes / 1e9,
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
            read = read_fn(case, "v3 lanes", 0, case.block_tables, out, context)
            times = time_rounds({"decode": [case.run], "read": [read]}, reps)
            points.append({"batch": batch, "kv_bytes": case.kv_bytes, "decode_us": times["decode"][0] * 1e3,
                           "read_us": times["read"][0] * 1e3})
        rows.append({"context": context, "points": points, "decode": fit(points, "decode_us"),
                     "read": fit(points, "read_us")})
    return rows


def idle_power(uuid: str | None, seconds: float = 1.5) -> float | None:
    """The GPU's mean draw in W over `seconds` of no work (NVML's energy counter), or None without one."""
    torch.cuda.synchronize()
    with telemetry.GpuSampler(uuid) as sampler:
        time.sleep(seconds)
    tele = sampler.result
    return tele.energy_j / tele.window_s if tele and tele.energy_j is not None and tele.window_s else None


def energy(contexts: list[int], batch: int, seconds: float, rounds: int = 2) -> dict:
    """Joules a byte of the default decode, the read of its bytes in v3's lanes (kv_read, a CTA per KV head and
    context), each graphed, and an eager torch copy of as many bytes (read once, written once), over enough pools
    that L2 serves no repeat, each run round and round for `seconds`, in `rounds` interleaved rounds; with the idle
    draw."""
    uuid = telemetry.device_uuid(torch.device("cuda"))
    res = {"batch": batch, "seconds": seconds, "idle_W": idle_power(uuid), "contexts": []}
    for context in contexts:
        cases = [DecodeCase(batch, context)]
        cases += [DecodeCase(batch, context, seed=i) for i in range(1, num_sets(cases[0].kv_bytes))]
        outs = [torch.zeros(batch, 1, NUM_KV_HEADS, dtype=torch.int32, device="cuda") for _ in cases]
        kv_bytes = cases[0].kv_bytes
        srcs = [torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device="cuda") for _ in cases]
        dsts = [torch.empty_like(s) for s in srcs]
        kinds = {"decode": [c.run for c in cases],
                 "read": [read_fn(c, "v3 lanes", 0, c.block_tables, o, context) for c, o in zip(cases, outs)],
                 "copy": [lambda s=s, d=d: d.copy_(s) for s, d in zip(srcs, dsts)]}
        # the copy eager: cudaMemcpy's SM kernels (graphed, a copy of 1 GB ran on the copy engines at ~2.8 TB/s)
        calls = {name: prepare(fns, graph=name != "copy")[0] for name, fns in kinds.items()}
        runs = {name: [] for name in kinds}
        for _ in range(rounds):
            for name, replays in calls.items():
                sec, joules, tele = telemetry.sustained(replays, seconds, uuid, sync=torch.cuda.synchronize)
                runs[name].append({"us": sec * 1e6, "mJ": joules and joules * 1e3,
                                   "W": tele.power_w if tele else None, "MHz": tele.sm_clock_mhz if tele else None,
                                   "capped": tele.power_capped_share if tele else None})
        res["contexts"].append({"context": context, "kv_bytes": kv_bytes, "pools": len(cases), "runs": runs})
        del cases, outs, srcs, dsts, kinds, calls  # the next context's pools replace these, not join them
        torch.cuda.empty_cache()
    return res


def picojoules_a_byte(run: dict, kv_bytes: int, idle_w: float | None) -> tuple[float | None, float | None]:
    """(pJ a K/V byte, pJ a byte over the idle draw) of one sustained run; None where there was no energy."""
    if run["mJ"] is None:
        return None, None
    total = run["mJ"] * 1e9 / kv_bytes
    return total, None if idle_w is None else (run["mJ"] - idle_w * run["us"] * 1e-3) * 1e9 / kv_bytes


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def print_energy(res: dict) -> None:
    idle = res["energy"]["idle_W"]
    print(f"sustained {res['energy']['seconds']} s each, {res['energy']['batch']} sequences; idle draw "
          + (f"{idle:.0f} W" if idle is not None else "unknown (no NVML)"))
    print("context | kind   | µs a call | mJ a call | W | SM MHz | capped | pJ a K/V byte (over idle)")
    for row in res["energy"]["contexts"]:
        for name, runs in row["runs"].items():
            for run in runs:
                total, above = picojoules_a_byte(run, row["kv_bytes"], idle)
                print(f"{row['context']:7d} | {name:6s} | {run['us']:9.1f} | {_fmt(run['mJ'], '9.2f')} | "
                      f"{_fmt(run['W'], '.0f')} | {_fmt(run['MHz'], '.0f')} | {_fmt(run['capped'], '.0%')} | "
                      f"{_fmt(total, '.0f')} ({_fmt(above, '.0f')})")


def print_patterns(res: dict) -> None:
    print(f"{res['gpu']}, {res['date']}: ({res['batch']}, {res['context']}), {res['kv_GB']:.2f} GB of K/V, a CTA per "
          f"KV head and {res['partition']} tokens; "
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
    ap.add_argument("--context", type=int, default=4096, help="tokens a sequence (a multiple of --partition)")
    ap.add_argument("--partition", type=int, default=PARTITION_SIZE,
                    help="tokens a CTA reads, a multiple of 128 (v3's partition by default; 4096: a CTA per folded "
                         "superpartition, the default decode's grid for a few long sequences)")
    ap.add_argument("--patterns", nargs="+", choices=list(KV_READ_PATTERNS), default=list(KV_READ_PATTERNS))
    ap.add_argument("--shared-kb", nargs="+", type=int, default=[0, 12, 20, 36, 54], metavar="KB",
                    help=f"shared memory reserved per CTA ({CTAS_PER_SM} CTAs an SM; at most {MAX_SHARED_KB} KB)")
    ap.add_argument("--launch-constant", nargs="+", type=int, metavar="CONTEXT",
                    help="instead: the constant a launch costs at these contexts (multiples of 16), decode beside the "
                         "read with a CTA per KV head and context, fitted over --batches")
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 128, 256, 512, 1024],
                    help="with --launch-constant: the batches fitted")
    ap.add_argument("--energy", type=float, metavar="SECONDS",
                    help="with --launch-constant: also the joules a byte of decode, the read and a copy, each run "
                         "round and round this long at each context and the largest batch")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="also write the results as JSON to this path")
    args = ap.parse_args(argv)
    if args.partition <= 0 or args.partition % 128 or args.context <= 0 or args.context % args.partition \
            or args.batch <= 0:
        ap.error("--partition must be a positive multiple of 128, --context a positive multiple of it, "
                 "--batch positive")
    if args.launch_constant and (any(c <= 0 or c % 16 for c in args.launch_constant) or len(set(args.batches)) < 2
                                 or min(args.batches) <= 0):
        ap.error("--launch-constant takes positive multiples of 16, fitted over at least two positive --batches")
    if args.energy is not None and (not args.launch_constant or args.energy <= 0):
        ap.error("--energy takes a positive number of seconds, with --launch-constant's contexts")
    if any(kb < 0 or kb > MAX_SHARED_KB for kb in args.shared_kb):
        ap.error(f"--shared-kb takes 0 to {MAX_SHARED_KB} KB ({CTAS_PER_SM} CTAs an SM share {SM_SHARED_KB} KB)")
    if not torch.cuda.is_available():
        print("the gather benchmark needs a CUDA GPU", file=sys.stderr)
        return 1
    res = {"command": "python -m pagedref.bench gather " + " ".join(argv or []),
           "gpu": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat()}
    res["copy_GBps"], res["copy_method"] = copy_bandwidth(args.reps)
    if args.launch_constant:
        res["launch_constant"] = launch_constant(args.launch_constant, args.batches, args.reps)
        if args.energy:
            res["energy"] = energy(args.launch_constant, max(args.batches), args.energy)
    else:
        res.update(bench(args.batch, args.context, args.patterns, args.shared_kb, args.reps, args.partition))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    (print_launch_constant if args.launch_constant else print_patterns)(res)
    if "energy" in res:
        print_energy(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
