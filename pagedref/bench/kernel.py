"""Kernel benchmark: paged decode attention against torch SDPA and against the copy roofline.

One idea: decode attention is a stream over the KV cache, so its yardstick is memory bandwidth.
For each (batch, context) we time our split-K kernels (v2 and its candidate tunings, v3 on the
tensor cores) reading K/V through block tables (blocks in random physical order), torch's
scaled_dot_product_attention on the same K/V laid out contiguously (the fastest SDPA backend
that runs), and a plain device-to-device copy, and report
effective bandwidth = K/V bytes read / time. Prefill (v1 on CUDA cores, v2 on the tensor cores, v3 on
Hopper's wgmma; v3 falls back to v2 off sm_90) is reported in TFLOP/s against SDPA causal, for whole
prompts and for a chunk after a cached context.
`--peers flashinfer` adds FlashInfer's paged decode (tensor cores) and prefill wrappers reading the
SAME pool (its "NHD" layout is pagedref's [num_blocks, block_size, num_kv_heads, head_dim]); a
peer that does not import is skipped with a note.

Invariant: every timing is the median of many CUDA-event-timed repetitions after warm-up, with the
work captured in a CUDA graph where possible (so Python launch overhead is not measured), over
enough buffer sets that the working set exceeds 3x the L2 cache; competitors of one shape are timed
in interleaved rounds; no number is asserted, only reported.
Usage: `python -m pagedref.bench kernel [--json [PATH]] [--variants] [--reps N] [--no-prefill] [--no-decode]
[--decode-shapes BxC ...] [--candidates NAME ...] [--peers flashinfer] [--prefill-schedules [NAME ...]]
[--skip-version 3] [--skip-prefill-version 1|2|3]`
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import math
import statistics
import sys
import warnings

import torch

from pagedref.bench.common import size_pair

DECODE_SHAPES = ((64, 4096), (256, 1024), (8, 32768), (32, 512), (256, 512), (1, 131072))  # (batch, context)

# (batch, query rows, context): whole causal prompts, and a chunk of 2048 rows after 6144 cached tokens
PREFILL_SHAPES = ((4, 2048, 2048), (1, 8192, 8192), (1, 2048, 8192), (16, 512, 512))
PREFILL_VERSIONS = (1, 2, 3)  # v1 on CUDA cores, v2 mma.sync (FA2), v3 wgmma on sm_90 (FA3; the default there)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
ROUNDS = 3  # interleaved timing rounds per comparison (see time_rounds)
PEERS = ("flashinfer",)  # other paged-attention libraries --peers can time on the same pool
PEER_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace


def decode_shape(text: str) -> tuple[int, int]:
    """'8x4096' -> (8, 4096): a --decode-shapes entry (sequences x context tokens)."""
    return size_pair(text, "SEQUENCESxCONTEXT", "8x4096")


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


def load_peers(names: list[str]) -> dict:
    """{name: module} of the requested peers that import; each that does not is skipped with a note."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.import_module(name)
        except Exception as e:  # not installed, or a broken install: either way no rows for it
            print(f"note: peer {name} is not importable ({type(e).__name__}: {e}); its rows are skipped",
                  file=sys.stderr)
    return found


def peer_calls(name: str, make) -> list | None:
    """make() -> the peer's calls for one shape, each run once here; None (with a note) if any fails, so a
    peer that cannot run a shape (a JIT compile error, an unsupported layout) costs its row, not the run."""
    try:
        calls = make()
        for call in calls:
            call()
        torch.cuda.synchronize()
        return calls
    except Exception as e:
        print(f"note: peer {name} failed on this shape ({type(e).__name__}: {e}); its row is skipped", file=sys.stderr)
        return None


def flashinfer_decode(fi, case: "DecodeCase"):
    """FlashInfer's tensor-core paged decode planned on `case`'s pool -> a call writing its output."""
    nb, last = case.pages()
    indptr = torch.arange(0, (case.batch + 1) * nb, nb, dtype=torch.int32, device="cuda")
    workspace = torch.zeros(PEER_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(indptr, case.block_tables.reshape(-1), last, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                 q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=HEAD_DIM**-0.5)
    out = torch.empty_like(case.q)
    return lambda: wrapper.run(case.q, (case.k_cache, case.v_cache), out=out)


def flashinfer_prefill(fi, case: "DecodeCase", q: torch.Tensor, query_len: int, out: torch.Tensor):
    """FlashInfer's causal paged prefill of q (each sequence's last query_len rows) on `case`'s pool."""
    nb, last = case.pages()
    qo_indptr = torch.arange(0, (case.batch + 1) * query_len, query_len, dtype=torch.int32, device="cuda")
    kv_indptr = torch.arange(0, (case.batch + 1) * nb, nb, dtype=torch.int32, device="cuda")
    workspace = torch.zeros(PEER_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(qo_indptr, kv_indptr, case.block_tables.reshape(-1), last, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                 BLOCK_SIZE, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=HEAD_DIM**-0.5)
    return lambda: wrapper.run(q, (case.k_cache, case.v_cache), out=out)


class DecodeCase:
    """One (batch, context) decode problem: a paged pool in random block order plus its contiguous copy.
    The heads are the benchmarks' (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM) unless given."""

    def __init__(self, batch: int, context: int, seed: int = 0, num_heads: int = NUM_HEADS,
                 num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        blocks_per_seq = -(-context // BLOCK_SIZE)  # a partial last block where context is not a multiple
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
        self.v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
        perm = torch.randperm(num_blocks, generator=gen, device="cuda")
        self.block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
        self.context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch, num_heads, head_dim, generator=gen, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.batch, self.context = batch, context

    @property
    def kv_bytes(self) -> int:
        """K and V bytes the batch's contexts hold: [batch, context, num_kv_heads, head_dim] each."""
        _, _, kv_heads, head_dim = self.k_cache.shape
        return 2 * self.batch * self.context * kv_heads * head_dim * self.k_cache.element_size()

    def pages(self) -> tuple[int, torch.Tensor]:
        """FlashInfer's view of the pool: blocks per sequence and each sequence's tokens in its last block."""
        nb = self.block_tables.shape[1]
        last = torch.full((self.batch,), self.context - (nb - 1) * BLOCK_SIZE, dtype=torch.int32, device="cuda")
        return nb, last

    def head_group(self, group: int, groups: int) -> "DecodeCase":
        """The same problem on KV-head group `group` of `groups` and its query heads, copied apart (same block
        tables): attention is per head, so its output is this case's output for those heads."""
        hkv, h = self.k_cache.shape[2] // groups, self.q.shape[1] // groups
        part = copy.copy(self)
        part.k_cache = self.k_cache[:, :, group * hkv:(group + 1) * hkv].contiguous()
        part.v_cache = self.v_cache[:, :, group * hkv:(group + 1) * hkv].contiguous()
        part.q = self.q[:, group * h:(group + 1) * h].contiguous()
        part.out = torch.empty_like(part.q)
        return part

    def contiguous_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as SDPA wants them: [batch, num_kv_heads, context, head_dim]."""
        def gather(cache):
            g = cache[self.block_tables.long()]  # [B, blocks, BLOCK_SIZE, Hkv, D]
            g = g.reshape(self.batch, -1, *cache.shape[2:])[:, :self.context]  # [B, context, Hkv, D]
            return g.transpose(1, 2).contiguous()
        return gather(self.k_cache), gather(self.v_cache)

    def run(self, **kw) -> torch.Tensor:
        from pagedref.kernels import paged_attention_decode

        return paged_attention_decode(self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                                      self.q.shape[-1] ** -0.5, max_context_len=self.context, out=self.out,
                                      check=False, **kw)


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


def bench_decode(batch: int, context: int, reps: int, skip_version: int | None = None,
                 candidates: list[str] | None = None, peers: dict | None = None) -> dict:
    """Every candidate tuning (or those named), every SDPA variant and each peer on one decode shape,
    timed side by side in rounds."""
    from pagedref.kernels.build import CANDIDATES

    first = DecodeCase(batch, context)
    cases = [first] + [DecodeCase(batch, context, seed=i) for i in range(1, num_sets(first.kv_bytes))]
    gb = first.kv_bytes / 1e9
    tunings = {name: t for name, t in CANDIDATES.items()
               if t.version != skip_version and (candidates is None or name in candidates or name == "default")}
    k, v = first.contiguous_kv()
    sdpa = sdpa_variants(first.q.unsqueeze(2), k, v, causal=False)  # q as [B, H, 1, D]
    named = {name: [lambda c=c, t=t: c.run(version=t.version, tuning=t) for c in cases] for name, t in tunings.items()}
    named.update({f"sdpa {name}": [fn] for name, fn in sdpa.items()})
    peer_fns = {}
    if peers and "flashinfer" in peers:
        fi = peers["flashinfer"]
        peer_fns["flashinfer"] = peer_calls("flashinfer", lambda: [flashinfer_decode(fi, c) for c in cases])
    peer_fns = {name: calls for name, calls in peer_fns.items() if calls}
    named.update({f"peer {name}": calls for name, calls in peer_fns.items()})
    timed = time_rounds(named, reps)
    sdpa_ms = {name: timed[f"sdpa {name}"][0] for name in sdpa}
    best = min(sdpa_ms, key=sdpa_ms.get)
    ref = sdpa[best]().squeeze(2).float()
    candidates, peer_rows = {}, {}
    for name, t in tunings.items():
        ms, graphed = timed[name]
        out = first.run(version=t.version, tuning=t).float()
        candidates[name] = {"ms": ms, "GBps": gb / ms * 1e3, "graphed": graphed,
                            "rel_err_vs_sdpa": ((out - ref).norm() / ref.norm()).item()}
    for name, calls in peer_fns.items():
        ms, graphed = timed[f"peer {name}"]
        out = calls[0]().float()
        peer_rows[name] = {"ms": ms, "GBps": gb / ms * 1e3, "graphed": graphed,
                           "rel_err_vs_sdpa": ((out - ref).norm() / ref.norm()).item()}
    return {"batch": batch, "context": context, "kv_GB": gb, "buffer_sets": len(cases), "rounds": ROUNDS,
            "kernel_ms": candidates["default"]["ms"], "kernel_GBps": candidates["default"]["GBps"],
            "candidates": candidates, "sdpa_backend": best, "sdpa_ms": sdpa_ms[best], "sdpa_all_ms": sdpa_ms,
            "sdpa_GBps": gb / sdpa_ms[best] * 1e3, "rel_err_vs_sdpa": candidates["default"]["rel_err_vs_sdpa"],
            "peers": peer_rows}


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


def bench_prefill(batch: int, query_len: int, context: int, reps: int, skip_versions: tuple | list = (),
                  peers: dict | None = None, schedules: tuple | list = ()) -> dict:
    """Causal prefill of `batch` sequences' last `query_len` rows over `context` tokens (a whole prompt
    when they are equal, else a chunk after a cached prefix): each prefill kernel version, SDPA (whole
    prompts only: its causal mask is the top-left one), each peer and each named v3 schedule
    (build.PREFILL_V3_SCHEDULES; its bits checked against the plain grid's with the same epilogue), on one pool."""
    from pagedref.kernels import paged_prefill
    from pagedref.kernels.build import PREFILL_V3_SCHEDULES, PrefillV3Schedule

    gen = torch.Generator(device="cuda").manual_seed(1)
    case = DecodeCase(batch, context)
    q = torch.randn(batch * query_len, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    qsl = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    versions = [v for v in PREFILL_VERSIONS if v not in skip_versions]

    def ours(version: int, schedule=None):
        paged_prefill(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, qsl, HEAD_DIM**-0.5,
                      max_query_len=query_len, max_context_len=context, out=out, check=False, version=version,
                      schedule=schedule)
    named = {f"v{version}": [lambda version=version: ours(version)] for version in versions}
    schedules = list(schedules) if 3 in versions else []
    named.update({f"v3 {name}": [lambda s=PREFILL_V3_SCHEDULES[name]: ours(3, s)] for name in schedules})
    sdpa = {}
    if query_len == context:
        k, v = case.contiguous_kv()
        sdpa = sdpa_variants(q.view(batch, query_len, NUM_HEADS, HEAD_DIM).transpose(1, 2), k, v, causal=True)
    named.update({f"sdpa {name}": [fn] for name, fn in sdpa.items()})
    peer_out = {name: torch.empty_like(q) for name in (peers or {})}
    if peers and "flashinfer" in peers:
        calls = peer_calls("flashinfer", lambda: [flashinfer_prefill(peers["flashinfer"], case, q, query_len,
                                                                     peer_out["flashinfer"])])
        if calls:
            named["peer flashinfer"] = calls
    peer_out = {name: o for name, o in peer_out.items() if f"peer {name}" in named}
    timed = time_rounds(named, reps)
    # causal (query row, key) pairs: each of a sequence's rows sees the cached prefix and the rows up to itself
    pairs = batch * (query_len * (context - query_len) + query_len * (query_len + 1) / 2)
    flops = 4 * NUM_HEADS * HEAD_DIM * pairs  # QK and PV, 2 flop per FMA
    res = {"batch": batch, "length": query_len, "context": context, "rounds": ROUNDS, "versions": {}, "peers": {}}
    if sdpa:
        sdpa_ms = {name: timed[f"sdpa {name}"][0] for name in sdpa}
        best = min(sdpa_ms, key=sdpa_ms.get)
        ref = sdpa[best]().transpose(1, 2).reshape(batch * query_len, NUM_HEADS, HEAD_DIM).float()
        res.update(sdpa_backend=best, sdpa_ms=sdpa_ms[best], sdpa_all_ms=sdpa_ms,
                   sdpa_TFLOPs=flops / sdpa_ms[best] / 1e9)
    else:  # error reference: our default kernel, where SDPA cannot run this mask
        ours(max(versions))
        ref = out.float().clone()
    res["error_reference"] = "sdpa" if sdpa else f"v{max(versions)}"

    def row(name: str, result: torch.Tensor) -> dict:
        ms, graphed = timed[name]
        return {"ms": ms, "TFLOPs": flops / ms / 1e9, "graphed": graphed,
                "rel_err": ((result.float() - ref).norm() / ref.norm()).item()}
    for version in versions:
        ours(version)
        res["versions"][version] = row(f"v{version}", out)
    if schedules:
        res["schedules"] = {}
        for name in schedules:
            s = PREFILL_V3_SCHEDULES[name]
            ours(3, PrefillV3Schedule(rcp_epilogue=s.rcp_epilogue))  # the plain grid, the same epilogue
            plain = out.clone()
            ours(3, s)
            res["schedules"][name] = row(f"v3 {name}", out) | {"same_bits_as_plain": bool(torch.equal(out, plain))}
    for name in peer_out:
        named[f"peer {name}"][0]()
        res["peers"][name] = row(f"peer {name}", peer_out[name])
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
        for name, peer in r.get("peers", {}).items():
            print(f"{'':>20} | {name}: {peer['ms'] * 1e3:.1f} us {peer['GBps']:.0f} GB/s"
                  f"{'' if peer['graphed'] else ' (eager)'}; ours at {r['kernel_GBps'] / peer['GBps']:.1%} of it; "
                  f"err vs SDPA {peer['rel_err_vs_sdpa']:.1e}")
    for r in res.get("variants", []):
        print(f"  (64, 4096) {r['variant']:<68} {r['ms'] * 1e3:>7.1f} us {r['GBps']:>5.0f} GB/s")
    if res.get("prefill"):
        print_prefill(res["prefill"])
    if res["decode"]:
        print_candidates(res)


def print_prefill(rows: list[dict]) -> None:
    print("prefill bf16 causal, same heads and pool: TFLOP/s = 4 * H * d * causal (row, key) pairs / time")
    for r in rows:
        sdpa = (f"SDPA {r['sdpa_backend']} {r['sdpa_ms'] * 1e3:.0f} us {r['sdpa_TFLOPs']:.0f} TFLOP/s"
                if "sdpa_ms" in r else "SDPA: - (a chunk after a cached prefix is not its causal mask)")
        print(f"  batch {r['batch']} x {r['length']} rows, context {r['context']}: {sdpa}")
        entries = [(f"ours v{v}", x) for v, x in r["versions"].items()] + list(r.get("peers", {}).items())
        for name, x in entries:
            share = f" | {x['TFLOPs'] / r['sdpa_TFLOPs']:.0%} of SDPA" if "sdpa_ms" in r else ""
            if name.startswith("ours"):
                share += "".join(f" | {x['TFLOPs'] / y['TFLOPs']:.0%} of {p}" for p, y in r.get("peers", {}).items())
            eager = " (eager)" if x.get("graphed") is False else ""
            print(f"    {name}: {x['ms'] * 1e3:.0f} us {x['TFLOPs']:.0f} TFLOP/s{eager}{share} | "
                  f"err vs {r['error_reference']} {x['rel_err']:.1e}")
        for name, x in r.get("schedules", {}).items():
            share = "".join(f" | {x['TFLOPs'] / y['TFLOPs']:.1%} of {p}" for p, y in r.get("peers", {}).items())
            print(f"    v3 {name}: {x['ms'] * 1e3:.1f} us {x['TFLOPs']:.0f} TFLOP/s{share} | "
                  f"{'same bits as the plain grid' if x['same_bits_as_plain'] else 'BITS DIFFER FROM THE PLAIN GRID'}")


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
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--decode-shapes", nargs="+", type=decode_shape, default=list(DECODE_SHAPES), metavar="BxC",
                    help="decode shapes to time, sequences x context (default: the six of the tables, "
                    "64x4096 256x1024 8x32768 32x512 256x512 1x131072)")
    ap.add_argument("--candidates", nargs="+", metavar="NAME", help="time only these decode tunings (and the "
                    "default, always); default: every one of build.CANDIDATES")
    ap.add_argument("--peers", nargs="+", choices=PEERS, default=[], help="also time these libraries' paged "
                    "kernels on the same pool (skipped with a note when they do not import)")
    ap.add_argument("--skip-version", type=int, choices=(3,), help="time no tuning of this decode kernel version "
                    "(device_check.sh passes 3 when v3 failed its self-check: a fault would end the whole run)")
    ap.add_argument("--prefill-schedules", nargs="*", metavar="NAME", help="also time these prefill v3 schedules "
                    "(build.PREFILL_V3_SCHEDULES; the flag alone: every one) and check their bits")
    ap.add_argument("--skip-prefill-version", type=int, choices=(1, 2, 3), action="append", default=[],
                    help="time no prefill of this version (repeatable; device_check.sh passes each version that "
                    "failed its self-check)")
    args = ap.parse_args(argv)
    from pagedref.kernels.build import CANDIDATES, PREFILL_V3_SCHEDULES

    unknown = sorted(set(args.candidates or []) - set(CANDIDATES))
    if unknown:
        ap.error(f"unknown candidate(s) {unknown}: choose from {sorted(CANDIDATES)}")
    if args.prefill_schedules is not None and not args.prefill_schedules:  # the flag alone
        args.prefill_schedules = list(PREFILL_V3_SCHEDULES)
    unknown = sorted(set(args.prefill_schedules or []) - set(PREFILL_V3_SCHEDULES))
    if unknown:
        ap.error(f"unknown prefill schedule(s) {unknown}: choose from {sorted(PREFILL_V3_SCHEDULES)}")
    peers = load_peers(args.peers)  # before the GPU check: a missing peer is a note wherever it runs
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
    res["peers"] = {name: getattr(mod, "__version__", "?") for name, mod in peers.items()}
    res["decode"] = [] if args.no_decode else [bench_decode(b, c, args.reps, args.skip_version, args.candidates, peers)
                                               for b, c in args.decode_shapes]
    if args.variants:
        res["variants"] = bench_variants(args.reps, args.skip_version)
    if not args.no_prefill:
        res["prefill"] = [bench_prefill(b, n, c, max(5, args.reps // 5), args.skip_prefill_version, peers,
                                        args.prefill_schedules or []) for b, n, c in PREFILL_SHAPES]
    if args.json:
        text = json.dumps(res, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    print_table(res)
    return 0
