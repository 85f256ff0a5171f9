"""Kernel benchmark: paged decode attention against torch SDPA and against the copy roofline.

One idea: decode attention is a stream over the KV cache, so its yardstick is memory bandwidth.
For each (batch, context) we time our split-K kernels (v2 and its candidate tunings, v3 on the
tensor cores) reading K/V through block tables (blocks in random physical order), torch's
scaled_dot_product_attention on the same K/V laid out contiguously (the fastest SDPA backend
that runs), and a plain device-to-device copy, and report
effective bandwidth = K/V bytes read / time. Prefill (v1 on CUDA cores, v2 on the tensor cores) is
reported in TFLOP/s against SDPA causal.

Invariant: every timing is the median of many CUDA-event-timed repetitions after warm-up, with the
work captured in a CUDA graph where possible (so Python launch overhead is not measured), over
enough buffer sets that the working set exceeds 3x the L2 cache (the decode shapes here are each
0.5-1 GB, so one set already streams from HBM); no number is asserted, only reported.
Usage: `python -m pagedref.bench kernel [--json [PATH]] [--variants] [--reps N] [--no-prefill]
[--skip-version 3] [--skip-prefill-version 2]`
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import warnings

import torch

DECODE_SHAPES = ((64, 4096), (256, 1024), (8, 32768), (1, 131072))  # (batch, context)
PREFILL_SHAPES = ((4, 2048), (1, 8192))  # (batch, prompt length)
PREFILL_VERSIONS = (1, 2)  # v1 on CUDA cores (the default), v2 on the tensor cores
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
ROUNDS = 3  # interleaved timing rounds per comparison (see time_rounds)


def prepare(fns, warmup: int = 5, graph: bool = True) -> tuple[list, bool]:
    """Warm `fns` up (one per buffer set), then capture each in a CUDA graph where possible -> (calls, graphed)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    if not graph:
        return list(fns), False
    try:
        graphs = []
        for fn in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            graphs.append(g)
        return [g.replay for g in graphs], True
    except Exception:  # a capture-unfriendly path: fall back to eager launches
        torch.cuda.synchronize()
        return list(fns), False


def measure(calls, reps: int) -> float:
    """Median milliseconds of one call over `reps` CUDA-event-timed calls, rotating over the buffer sets."""
    for fn in calls:
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_ms(fns, reps: int, warmup: int = 5, graph: bool = True) -> tuple[float, bool]:
    """Median milliseconds of one call, rotating over `fns` (one per buffer set). -> (ms, graphed)."""
    calls, graphed = prepare(fns, warmup, graph)
    return measure(calls, reps), graphed


def time_rounds(named_fns: dict, reps: int, rounds: int = ROUNDS) -> dict[str, tuple[float, bool]]:
    """{name: (ms, graphed)} for competing implementations, measured in interleaved rounds.

    Every name is prepared first, then each round measures every name once, in turn; a name's time is
    its fastest round's median. Timed one after the other instead, whichever ran first was measured
    up to 10% slow on the H200 (the same kernel: 85% of SDPA first, 95% later in the run), so the
    order of the list, not the kernel, decided the comparison."""
    prepared = {name: prepare(fns) for name, fns in named_fns.items()}
    best = {name: math.inf for name in named_fns}
    for _ in range(rounds):
        for name, (calls, _) in prepared.items():
            best[name] = min(best[name], measure(calls, reps))
    return {name: (best[name], prepared[name][1]) for name in named_fns}


def num_sets(bytes_per_set: int) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    return max(1, math.ceil(3 * l2 / bytes_per_set))


def copy_bandwidth(reps: int) -> tuple[float, str]:
    """GB/s of a 4 GiB device-to-device copy, counting bytes read plus bytes written: the best of an
    eager cudaMemcpy (SM copy kernels) and a graph-captured one (may run on a copy engine)."""
    n = 1 << 30  # float32 elements
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    best = {}
    for graph in (False, True):
        ms, graphed = time_ms([lambda: dst.copy_(src)], reps, graph=graph)
        best["graph" if graphed else "eager"] = 2 * 4 * n / ms / 1e6
    how = max(best, key=best.get)
    return best[how], f"torch copy_, {how}"


class DecodeCase:
    """One (batch, context) decode problem: a paged pool in random block order plus its contiguous copy."""

    def __init__(self, batch: int, context: int, seed: int = 0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        blocks_per_seq = context // BLOCK_SIZE
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
        self.v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
        perm = torch.randperm(num_blocks, generator=gen, device="cuda")
        self.block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
        self.context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.batch, self.context = batch, context
        self.kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * self.k_cache.element_size()

    def contiguous_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as SDPA wants them: [batch, num_kv_heads, context, head_dim]."""
        def gather(cache):
            g = cache[self.block_tables.long()]  # [B, blocks, BLOCK_SIZE, Hkv, D]
            return g.reshape(self.batch, self.context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        return gather(self.k_cache), gather(self.v_cache)

    def run(self, **kw) -> torch.Tensor:
        from pagedref.kernels import paged_attention_decode

        return paged_attention_decode(self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                                      HEAD_DIM**-0.5, max_context_len=self.context, out=self.out, check=False, **kw)


def sdpa_variants(q, k, v, causal: bool) -> dict:
    """{name: fn} for each SDPA backend x GQA handling (native enable_gqa, or K/V repeated) that runs here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    group = q.shape[1] // k.shape[1]
    repeated = None
    found = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in ("enable_gqa", "repeat_kv"):
            if gqa == "repeat_kv" and repeated is None:
                repeated = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
            args = (q, k, v) if gqa == "enable_gqa" else (q, *repeated)
            extra = {"enable_gqa": True} if gqa == "enable_gqa" else {}

            def fn(args=args, extra=extra, backend=backend):
                with sdpa_kernel([backend]):
                    return sdpa(*args, is_causal=causal, **extra)
            try:
                fn()
                torch.cuda.synchronize()
            except RuntimeError:
                continue
            found[f"{name}+{gqa}"] = fn
    return found


def bench_decode(batch: int, context: int, reps: int, skip_version: int | None = None) -> dict:
    """Every candidate tuning and every SDPA variant on one decode shape, timed side by side in rounds."""
    from pagedref.kernels.build import CANDIDATES

    first = DecodeCase(batch, context)
    cases = [first] + [DecodeCase(batch, context, seed=i) for i in range(1, num_sets(first.kv_bytes))]
    gb = first.kv_bytes / 1e9
    tunings = {name: t for name, t in CANDIDATES.items() if t.version != skip_version}
    k, v = first.contiguous_kv()
    sdpa = sdpa_variants(first.q.unsqueeze(2), k, v, causal=False)  # q as [B, H, 1, D]
    named = {name: [lambda c=c, t=t: c.run(version=t.version, tuning=t) for c in cases] for name, t in tunings.items()}
    named.update({f"sdpa {name}": [fn] for name, fn in sdpa.items()})
    timed = time_rounds(named, reps)
    sdpa_ms = {name: timed[f"sdpa {name}"][0] for name in sdpa}
    best = min(sdpa_ms, key=sdpa_ms.get)
    ref = sdpa[best]().squeeze(2).float()
    candidates = {}
    for name, t in tunings.items():
        ms, graphed = timed[name]
        out = first.run(version=t.version, tuning=t).float()
        candidates[name] = {"ms": ms, "GBps": gb / ms * 1e3, "graphed": graphed,
                            "rel_err_vs_sdpa": ((out - ref).norm() / ref.norm()).item()}
    return {"batch": batch, "context": context, "kv_GB": gb, "buffer_sets": len(cases), "rounds": ROUNDS,
            "kernel_ms": candidates["default"]["ms"], "kernel_GBps": candidates["default"]["GBps"],
            "candidates": candidates, "sdpa_backend": best, "sdpa_ms": sdpa_ms[best], "sdpa_all_ms": sdpa_ms,
            "sdpa_GBps": gb / sdpa_ms[best] * 1e3, "rel_err_vs_sdpa": candidates["default"]["rel_err_vs_sdpa"]}


def variants() -> list[tuple[str, object]]:
    """(label, tuning) of the design points --variants times beyond the candidates."""
    from pagedref.kernels.build import DecodeTuning, MmaTuning

    return [  # v2: DecodeTuning(partition_size, unroll, threads_per_token, min_ctas_per_sm)
        ("v2, 16 threads per token (one 16-byte load each), no occupancy hint", DecodeTuning(512, 4, 16, 1)),
        ("v2, 8 threads per token: half the shuffles, twice the registers", DecodeTuning(512, 2, 8, 1)),
        ("v2, the same capped at 128 registers (4 CTAs/SM) = v2 default", DecodeTuning(512, 2, 8, 4)),
        ("v3, 3 CTAs/SM (register cap 168) instead of 4", MmaTuning(min_ctas_per_sm=3)),
        ("v3, 256-token partitions", MmaTuning(partition_size=256)),
        ("v3, 2048-token partitions", MmaTuning(partition_size=2048)),
    ]


def bench_variants(reps: int, skip_version: int | None = None) -> list[dict]:
    """The design space at (64, 4096): partition size, pipeline depth, threads per token, occupancy, and v1."""
    case = DecodeCase(64, 4096)
    rows = []
    for label, tuning in variants():
        if tuning.version == skip_version:
            continue
        ms, _ = time_ms([lambda: case.run(version=tuning.version, tuning=tuning)], reps)
        rows.append({"variant": label, "ms": ms, "GBps": case.kv_bytes / ms / 1e6})
    ms, _ = time_ms([lambda: case.run(version=1)], max(3, reps // 10), warmup=1)
    rows.append({"variant": "v1 (one CTA per sequence and head)", "ms": ms, "GBps": case.kv_bytes / ms / 1e6})
    return rows


def bench_prefill(batch: int, length: int, reps: int, skip_version: int | None = None) -> dict:
    """Causal prefill of `batch` prompts of `length` tokens: each prefill kernel version and SDPA."""
    from pagedref.kernels import paged_prefill

    gen = torch.Generator(device="cuda").manual_seed(1)
    case = DecodeCase(batch, length)
    q = torch.randn(batch * length, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    qsl = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    k, v = case.contiguous_kv()
    qs = q.view(batch, length, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    sdpa = sdpa_variants(qs, k, v, causal=True)
    versions = [v for v in PREFILL_VERSIONS if v != skip_version]

    def ours(version: int):
        paged_prefill(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, qsl, HEAD_DIM**-0.5,
                      max_query_len=length, max_context_len=length, out=out, check=False, version=version)
    named = {f"v{version}": [lambda version=version: ours(version)] for version in versions}
    named.update({f"sdpa {name}": [fn] for name, fn in sdpa.items()})
    timed = time_rounds(named, reps)
    sdpa_ms = {name: timed[f"sdpa {name}"][0] for name in sdpa}
    best = min(sdpa_ms, key=sdpa_ms.get)
    ref = sdpa[best]().float()
    flops = 4 * batch * NUM_HEADS * HEAD_DIM * length * (length + 1) / 2  # causal: QK and PV, 2 flop/FMA
    res = {"batch": batch, "length": length, "rounds": ROUNDS, "sdpa_backend": best, "sdpa_ms": sdpa_ms[best],
           "sdpa_all_ms": sdpa_ms, "sdpa_TFLOPs": flops / sdpa_ms[best] / 1e9, "versions": {}}
    for version in versions:
        ms = timed[f"v{version}"][0]
        ours(version)
        err = ((out.view(batch, length, NUM_HEADS, HEAD_DIM).transpose(1, 2).float() - ref).norm() / ref.norm()).item()
        res["versions"][version] = {"ms": ms, "TFLOPs": flops / ms / 1e9, "rel_err_vs_sdpa": err}
    return res


def print_table(res: dict) -> None:
    print(f"\n{res['gpu']}, {res['date']}, torch {res['torch']}, cupy {res['cupy']}")
    print(f"device-to-device copy: {res['copy_GBps']:.0f} GB/s (read + written; {res['copy_method']})")
    print(f"decode bf16, {NUM_HEADS} q / {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}; "
          "GB/s = KV bytes read / time")
    print(f"{'batch':>5} {'context':>7} {'KV GB':>6} | {'ours us':>8} {'GB/s':>6} | {'SDPA us':>8} {'GB/s':>6} "
          f"{'backend':<22} | {'/SDPA':>6} {'/copy':>6} | {'err':>7}")
    for r in res["decode"]:
        print(f"{r['batch']:>5} {r['context']:>7} {r['kv_GB']:>6.2f} | {r['kernel_ms'] * 1e3:>8.1f} "
              f"{r['kernel_GBps']:>6.0f} | {r['sdpa_ms'] * 1e3:>8.1f} {r['sdpa_GBps']:>6.0f} {r['sdpa_backend']:<22} | "
              f"{r['kernel_GBps'] / r['sdpa_GBps']:>6.1%} {r['kernel_GBps'] / res['copy_GBps']:>6.1%} | "
              f"{r['rel_err_vs_sdpa']:>7.1e}")
    for r in res.get("variants", []):
        print(f"  (64, 4096) {r['variant']:<68} {r['ms'] * 1e3:>7.1f} us {r['GBps']:>5.0f} GB/s")
    if res.get("prefill"):
        print(f"prefill bf16 causal, same heads: TFLOP/s = 4 * B * H * d * L(L+1)/2 / time")
        for r in res["prefill"]:
            print(f"  batch {r['batch']} x {r['length']}: SDPA {r['sdpa_backend']} {r['sdpa_ms']:.2f} ms "
                  f"{r['sdpa_TFLOPs']:.1f} TFLOP/s")
            for version, v in r["versions"].items():
                print(f"    ours v{version}: {v['ms']:.2f} ms {v['TFLOPs']:.1f} TFLOP/s | "
                      f"{v['TFLOPs'] / r['sdpa_TFLOPs']:.1%} of SDPA | err {v['rel_err_vs_sdpa']:.1e}")
    print_candidates(res)


def print_candidates(res: dict) -> None:
    """The compact table: every candidate's GB/s, its share of SDPA's and of the copy's, per shape."""
    shapes = "".join(f"{'(%d, %d)' % (r['batch'], r['context']):>21}" for r in res["decode"])
    print(f"decode GB/s (/SDPA /copy){shapes}  max err vs SDPA")
    for name in res["decode"][0]["candidates"]:
        cells = [r["candidates"][name] | {"sdpa": r["sdpa_GBps"]} for r in res["decode"]]
        row = "".join(f"{c['GBps']:>9.0f} ({c['GBps'] / c['sdpa']:>4.0%} {c['GBps'] / res['copy_GBps']:>4.0%})"
                      for c in cells)
        print(f"  {name:<23}{row}  {max(c['rel_err_vs_sdpa'] for c in cells):.1e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedref.bench kernel", description=__doc__.split("\n")[0])
    ap.add_argument("--json", nargs="?", const="-", help="also write the results as JSON (to PATH, or stdout)")
    ap.add_argument("--reps", type=int, default=50, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--variants", action="store_true", help="also time partition sizes, unrolls and v1 at (64, 4096)")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--skip-version", type=int, choices=(3,), help="time no tuning of this decode kernel version "
                    "(device_check.sh passes 3 when v3 failed its self-check: a fault would end the whole run)")
    ap.add_argument("--skip-prefill-version", type=int, choices=(2,), help="time prefill v1 only (device_check.sh "
                    "passes 2 when prefill v2 failed its self-check)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("the kernel benchmark needs a CUDA GPU", file=sys.stderr)
        return 1
    import cupy

    # flash + enable_gqa is probed and refused for decode shapes; its UserWarning says so once per shape
    warnings.filterwarnings("ignore", message="For dense input, both fused kernels require")
    res = {"command": "python -m pagedref.bench kernel " + " ".join(argv or []),
           "gpu": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "cupy": cupy.__version__}
    res["copy_GBps"], res["copy_method"] = copy_bandwidth(args.reps)
    res["decode"] = [bench_decode(b, c, args.reps, args.skip_version) for b, c in DECODE_SHAPES]
    if args.variants:
        res["variants"] = bench_variants(args.reps, args.skip_version)
    if not args.no_prefill:
        res["prefill"] = [bench_prefill(b, n, max(5, args.reps // 5), args.skip_prefill_version)
                          for b, n in PREFILL_SHAPES]
    if args.json:
        text = json.dumps(res, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    print_table(res)
    return 0
