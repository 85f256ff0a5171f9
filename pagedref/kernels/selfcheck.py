"""A small run of every kernel with its answer checked: the driver compute-sanitizer runs.

One idea: memcheck and racecheck slow a program down a hundredfold, so they get one launch of each
kernel on small sizes that still reach every code path (several partitions and a partial one, a
partial prefill tile, GQA, each dtype, decode v1, v2 and v3 with every candidate tuning (and v3's
in-kernel merge over more partitions than its shared-memory chunk), prefill
v1, v2 and v3 (v3: wgmma, on sm_90 devices), every block size, every kind of head_dim v3 and prefill v2 take: multiples of 64, and
80, 96, 112, 120, 192 with their partial pieces and padding, both pool writes) and nothing else.

Invariant: exits non-zero if any result is wrong, so a clean sanitizer report over a failing run
cannot pass for success. Usage: `python -m pagedref.kernels.selfcheck [--head-dims 112,120,192] [--only "prefill v3" ...]`
(only the attention runs at those head dims / with one of those labels, and no pool writes: a short sanitizer
pass over them).
"""

from __future__ import annotations

import argparse
import sys

import torch

from pagedref import kernels
from pagedref.kernels import testing

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


# Prefill v3's schedules beside the launcher's (launch.prefill_v3_schedule: persistent rcp tma on
# selfcheck's contexts), at bfloat16 / 128 / 16 (build.PREFILL_V3_SCHEDULES).
V3_SCHEDULES = ("plain", "persistent", "rcp bt", "persistent rcp bt", "rcp tma", "persistent rcp tma")


def run_prefill(p: testing.PagedProblem, **kw) -> torch.Tensor:
    return kernels.paged_prefill(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.query_start_loc,
                                 p.scale, **kw)


def run_decode(p: testing.PagedProblem, **kw) -> torch.Tensor:
    return kernels.paged_attention_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, **kw)


def check_attention(head_dims: set[int] | None = None, only: str | list[str] | None = None) -> list[str]:
    """Every run's error against the oracle -> its failures; `head_dims` keeps only the runs at those,
    `only` the runs whose label starts with it, or with one of them (e.g. "prefill v3")."""
    from pagedref.kernels.build import CANDIDATES, MmaTuning

    runs = []  # (label, problem, launch)
    for dtype, head_dim, block_size in ((torch.float32, 64, 16), (torch.float16, 8, 8), (torch.bfloat16, 128, 32)):
        kw = dict(num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype)
        pre = testing.make_problem([1, 530, 1100], [1, 5, 20], **kw)  # partial tiles, several key tiles
        dec = testing.make_problem([1, 530, 1100], **kw)  # 1, 2 and 3 partitions, two of them partial
        label = f"{dtype} head_dim={head_dim}"
        runs += [(f"prefill v{v} {label}", pre, lambda p=pre, v=v: run_prefill(p, version=v)) for v in (1, 2)]
        runs += [(f"decode v{v} {label}", dec, lambda p=dec, v=v: run_decode(p, version=v)) for v in (1, 2, 3)]
        if dtype != torch.float32:
            runs += [(f"decode {name} {label}", dec, lambda p=dec, t=t: run_decode(p, version=t.version, tuning=t))
                     for name, t in CANDIDATES.items()]
    # v3's in-kernel merge over more partitions than its shared-memory chunk of 32: 34 partitions of 512.
    merge = MmaTuning(partition_size=512, merge_in_kernel=True, fold=False)
    dec = testing.make_problem([1, 1100, 17000], num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    runs += [("decode v3 merge in kernel, p512, 34 partitions", dec,
              lambda p=dec: run_decode(p, version=3, tuning=merge))]
    # The reduce kernel launched after v3 ends (the default launches it as v3's programmatic dependent: resident
    # under v3's last CTAs, it waits for v3 in the kernel).
    no_pdl = MmaTuning(partition_size=512, pdl=False)
    runs += [("decode v3 no pdl, p512, 34 partitions", dec, lambda p=dec: run_decode(p, version=3, tuning=no_pdl))]
    # The folded tree: a CTA per superpartition (folded in its slab loop; superpartition partials past one) or
    # per partition (warp-state partials the reduce kernel folds), launched as v3's programmatic dependent or after.
    # The unfolded tree's spans: 2 or 4 partitions a CTA, merged in the CTA for a context of up to that many,
    # partials and the reduce past it (full spans and a partial last one).
    for name, t in (("folded span 4", MmaTuning(partition_size=512, span=4)),
                    ("folded span 1", MmaTuning(partition_size=512, span=1)),
                    ("folded span 2 (raw)", MmaTuning(partition_size=512, span=2)),
                    ("folded span 4 no pdl", MmaTuning(partition_size=512, span=4, pdl=False)),
                    ("span 2", MmaTuning(partition_size=512, span=2, fold=False)),
                    ("span 4", MmaTuning(partition_size=512, span=4, fold=False)),
                    ("span 4 no pdl", MmaTuning(partition_size=512, span=4, pdl=False, fold=False))):
        runs += [(f"decode v3 {name}, p512, 34 partitions", dec, lambda p=dec, t=t: run_decode(p, version=3, tuning=t))]
    # v3's other shapes: block_size 8 (a 16-token slab spans two blocks), head_dim 64 and 256, 3 and
    # 8 query heads per CTA (empty mma columns; all eight used).
    for dtype, head_dim, block_size, num_heads in ((torch.float16, 64, 8, 6), (torch.bfloat16, 256, 16, 16)):
        dec = testing.make_problem([1, 530, 1100], num_heads=num_heads, num_kv_heads=2, head_dim=head_dim,
                                   block_size=block_size, dtype=dtype)
        runs += [(f"decode v3 {dtype} head_dim={head_dim}", dec, lambda p=dec: run_decode(p, version=3))]
    # Prefill v2's shapes: head_dim 64 and 256 (32-key tiles, the query in shared memory), block
    # sizes 8 and 16; 150 rows = two full 64-row tiles and a partial one; a chunk after cached context.
    for dtype, head_dim, block_size in ((torch.float16, 64, 8), (torch.bfloat16, 256, 16), (torch.float16, 128, 16)):
        pre = testing.make_problem([150, 530, 7], [150, 90, 7], num_heads=6, num_kv_heads=2, head_dim=head_dim,
                                   block_size=block_size, dtype=dtype)
        runs += [(f"prefill v2 {dtype} head_dim={head_dim} block_size={block_size}", pre,
                  lambda p=pre: run_prefill(p, version=2))]
    # Prefill v3 (wgmma, sm_90 only: elsewhere these run v2): head_dim 64 (4 KV stages) and 128 (3),
    # block sizes 8, 16 and 32; 150 rows = a full 128-row CTA and one whose second consumer warpgroup
    # has no rows; 530 and 1100 keys wrap the stage ring; 300 rows after 800 cached tokens.
    for dtype, head_dim, block_size in ((torch.bfloat16, 128, 16), (torch.float16, 64, 8), (torch.float16, 128, 32)):
        pre = testing.make_problem([150, 530, 7, 1100], [150, 90, 7, 300], num_heads=8, num_kv_heads=2,
                                   head_dim=head_dim, block_size=block_size, dtype=dtype)
        runs += [(f"prefill v3 {dtype} head_dim={head_dim} block_size={block_size}", pre,
                  lambda p=pre: run_prefill(p, version=3))]
    # Its other schedules, on more work items than an H200 has SMs (a persistent CTA walks several).
    from pagedref.kernels.build import PREFILL_V3_SCHEDULES

    # (256 and 1024 end on a key tile's last key: the TMA schedules gather their last tile by boxes too.)
    pre = testing.make_problem([1100, 530, 150, 7, 300, 256, 1024] * 2, [300, 90, 150, 7, 300, 256, 40] * 2,
                               num_heads=16, num_kv_heads=4, head_dim=128, block_size=16, dtype=torch.bfloat16)
    runs += [(f"prefill v3 schedule {name}", pre, lambda p=pre, s=PREFILL_V3_SCHEDULES[name]: run_prefill(
        p, version=3, schedule=s)) for name in V3_SCHEDULES]
    # vLLM's other head sizes: v3's partial K pieces and V bands (80: 16 + 16; 96: 32; 112: 16 + 32 +
    # 16; 120: 16 + 8 and 32 + 16 + 8; 192: three whole bands at 2 CTAs/SM), prefill v2's padding to
    # 128 (120) and its query in shared memory (192); float32 on CUDA cores at 120.
    for dtype, head_dim, block_size, num_heads in ((torch.float16, 80, 8, 6), (torch.bfloat16, 96, 32, 16),
                                                   (torch.float16, 112, 16, 8), (torch.bfloat16, 120, 8, 6),
                                                   (torch.float16, 192, 32, 16), (torch.float32, 120, 16, 8)):
        kw = dict(num_heads=num_heads, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype)
        dec = testing.make_problem([1, 530, 1100], **kw)
        pre = testing.make_problem([150, 530, 7], [150, 90, 7], **kw)
        v = 3 if dtype != torch.float32 else 2
        runs += [(f"decode v{v} {dtype} head_dim={head_dim}", dec, lambda p=dec, v=v: run_decode(p, version=v)),
                 (f"prefill v{v - 1} {dtype} head_dim={head_dim}", pre,
                  lambda p=pre, v=v: run_prefill(p, version=v - 1))]
    if head_dims is not None:
        runs = [r for r in runs if r[1].q.shape[-1] in head_dims]
    if only is not None:
        runs = [r for r in runs if r[0].startswith((only,) if isinstance(only, str) else tuple(only))]
    if not runs:  # a sanitizer's clean report over no launch at all must not pass for a clean kernel
        return [f"no attention run matches head_dims={sorted(head_dims) if head_dims else None}, only={only!r}"]
    print(f"selfcheck: {len(runs)} attention runs")
    failures = []
    for label, p, run in runs:
        err = testing.max_rel_err(run(), testing.oracle(p), p)
        if not err <= TOL[p.q.dtype]:
            failures.append(f"{label}: norm-relative error {err:.2e}")
    return failures


def check_cache_ops() -> list[str]:
    failures = []
    pools = [(torch.randn(6, 16, 2, 8, device="cuda"), torch.randn(6, 16, 2, 8, device="cuda")) for _ in range(2)]
    expect = [(k.clone(), v.clone()) for k, v in pools]
    key, value = torch.randn(3, 2, 8, device="cuda"), torch.randn(3, 2, 8, device="cuda")
    slots = torch.tensor([5, 17, 90], device="cuda")
    kernels.reshape_and_cache(key, value, *pools[0], slots)
    expect[0][0].view(-1, 2, 8)[slots], expect[0][1].view(-1, 2, 8)[slots] = key, value
    src, dst = torch.tensor([0, 3], device="cuda"), torch.tensor([4, 1], device="cuda")
    kernels.copy_blocks(pools, src, dst)
    for k, v in expect:
        k[dst], v[dst] = k[src], v[src]
    if not all(testing.same_bits(a, b) for pa, pb in zip(pools, expect) for a, b in zip(pa, pb)):
        failures.append("reshape_and_cache / copy_blocks: pool differs from the expected copy")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedref.kernels.selfcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--head-dims", type=lambda s: {int(x) for x in s.split(",")},
                    help="comma-separated head dims: only the attention runs at these")
    ap.add_argument("--only", action="append", help="only the attention runs whose label starts with this (e.g. "
                    "'prefill v3'; repeatable: with any of them)")
    args = ap.parse_args(argv)
    failures = check_attention(args.head_dims, args.only)
    failures += check_cache_ops() if args.head_dims is None and args.only is None else []
    torch.cuda.synchronize()
    for f in failures:
        print("FAIL", f)
    print("selfcheck:", "ok" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
