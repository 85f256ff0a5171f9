"""Kernel sources and their compiled modules: one compile per (file, compile-time parameters).

One idea: the CUDA sources in `cuda/` are specialised with -D macros (dtype, head_dim, block_size,
heads per CTA, partition size) and compiled at run time by CuPy's NVRTC; each distinct
`KernelConfig` is compiled once per process (and CuPy keeps the binary in its on-disk cache).

Invariant: the options a config produces are the same for NVRTC here and for nvcc in CI
(`nvcc_command`), so a kernel that CI compiled is the kernel that runs. `print_ci_configs()`
lists the configs CI compiles, one line each, for `.ci/compile_kernels.sh`; on a GPU machine
`precompile()` compiles them all in parallel processes into CuPy's on-disk cache, so the test and
benchmark processes after it only load binaries (pagedref/kernels/device_check.sh does).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from pagedref.kernels.splitk import (FOLD_SPAN, MMA_HEAD_DIMS, MMA_MIN_CTAS_PER_SM, MMA_PARTITION_SIZE, PARTITION_SIZE,
                                     SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS, min_ctas_per_sm, mma_supported, threads_per_token)

CUDA_DIR = Path(os.environ.get("PAGEDREF_CUDA_DIR", Path(__file__).resolve().parents[2] / "cuda"))
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
ELEM_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KernelConfig:
    file: str  # a file of cuda/
    defines: tuple[tuple[str, int], ...] = ()
    arch: str | None = None  # a target the source needs (prefill v3: "sm_90a"); None: the device's own

    def options(self) -> tuple[str, ...]:
        return ("-std=c++17", f"-I{CUDA_DIR}", *(f"-D{k}={v}" for k, v in self.defines))

    @property
    def source(self) -> Path:
        return CUDA_DIR / self.file


@dataclass(frozen=True)
class DecodeTuning:
    """The decode kernel's fixed design constants. Benchmarks vary them; nothing else may: a
    partition size chosen from the batch would make results depend on the batch. Only
    partition_size and threads_per_token change the arithmetic (and so the bits); the others
    change only how the same operations are scheduled."""

    version: ClassVar[int] = 2  # the decode kernel these constants are for
    partition_size: int = PARTITION_SIZE
    unroll: int = 2  # tokens per software-pipeline step per thread
    threads_per_token: int | None = None  # None: splitk.threads_per_token's rule
    min_ctas_per_sm: int | None = None  # __launch_bounds__ occupancy hint; None: splitk.min_ctas_per_sm
    async_copy: bool = False  # stage K/V through a cp.async ring in shared memory instead of registers
    stages: int = 4  # depth of that ring


MAX_SPAN = FOLD_SPAN  # partitions one v3 CTA may compute in turn: at most one superpartition of the folded tree


@dataclass(frozen=True)
class MmaTuning:
    """The tensor-core decode kernel's (v3) fixed design constants, under the same rule: only
    partition_size and fold (the merge's tree) change the arithmetic; the others (load hints, prefetch, where and
    when the merge runs, the span) only the schedule."""

    version: ClassVar[int] = 3
    partition_size: int = MMA_PARTITION_SIZE
    min_ctas_per_sm: int | None = None  # __launch_bounds__ hint; None: splitk.MMA_MIN_CTAS_PER_SM[head_dim]
    load_hint: bool = False  # K/V loads skip L1 and ask L2 for whole 256-byte rows
    evict_first: bool = False  # K/V loads skip L1 and are the first lines L2 evicts (not with load_hint)
    prefetch: bool = False  # each warp asks L2 for its slab after next (costs ~6 registers: take 3 CTAs per SM)
    merge_in_kernel: bool = False  # the last partition CTA to finish merges (no reduce launch); same bits
    pdl: bool = True  # the reduce kernel launches under v3's last CTAs and waits for it in-kernel (sm_90 only); same bits
    small_grid_prefetch: bool = True  # a grid of at most one CTA per SM runs small_grid_schedule's build; same bits
    span: int | None = None  # partitions per CTA, computed in turn (None: span_schedule's rule from the grid); same bits
    max_span: int = MAX_SPAN  # span slots compiled in (SPAN_SLOTS; 1: the build without spans); same bits
    # The folded tree (the default): partitions in superpartitions of MAX_SPAN, each warp's partition states folded
    # in order, then merged over the warps (cuda/paged_attention.cu, write_folded). Other bits than fold=False, where
    # each partition is merged over its warps first; both are fixed by the sequence alone.
    fold: bool = True
    # The folded tree may run RAW_SPAN partitions a CTA (span_schedule's RAW_WAVES band, or span=2), each one's warp
    # states written for the fold reduce as a CTA of one partition writes them (the RAW_SPAN build): same bits.
    raw_span: bool = True


def decode_config(dtype: str, head_dim: int, block_size: int, heads_per_cta: int,
                  tuning: DecodeTuning | MmaTuning = DecodeTuning()) -> KernelConfig:
    if isinstance(tuning, MmaTuning):
        return mma_decode_config(dtype, head_dim, block_size, heads_per_cta, tuning)
    tpt = tuning.threads_per_token or threads_per_token(head_dim, ELEM_SIZE[dtype], heads_per_cta)
    min_ctas = tuning.min_ctas_per_sm or min_ctas_per_sm(ELEM_SIZE[dtype], heads_per_cta)
    return KernelConfig("paged_attention.cu", (
        ("PR_DTYPE", DTYPE_CODES[dtype]), ("HEAD_DIM", head_dim), ("BLOCK_SIZE", block_size),
        ("HEADS_PER_CTA", heads_per_cta), ("PARTITION_SIZE", tuning.partition_size), ("UNROLL", tuning.unroll),
        ("THREADS_PER_TOKEN", tpt), ("MIN_CTAS_PER_SM", min_ctas), ("ASYNC_COPY", int(tuning.async_copy)),
        ("STAGES", tuning.stages)))


def mma_decode_config(dtype: str, head_dim: int, block_size: int, heads_per_cta: int,
                      tuning: MmaTuning = MmaTuning()) -> KernelConfig:
    if not mma_supported(ELEM_SIZE[dtype], head_dim):
        raise ValueError(f"the tensor-core decode kernel (v3) takes float16/bfloat16 K/V with head_dim in "
                         f"{MMA_HEAD_DIMS}, got {dtype} with head_dim {head_dim}")
    if tuning.fold and tuning.merge_in_kernel:
        raise ValueError("the in-kernel merge merges partitions: it takes MmaTuning(fold=False)")
    min_ctas = mma_ctas_per_sm(tuning, head_dim)
    slots = span_slots(head_dim, heads_per_cta, block_size, tuning)
    raw = has_raw_spans(tuning, slots)
    return KernelConfig("paged_attention.cu", (
        ("PR_DTYPE", DTYPE_CODES[dtype]), ("HEAD_DIM", head_dim), ("BLOCK_SIZE", block_size),
        ("HEADS_PER_CTA", heads_per_cta), ("PARTITION_SIZE", tuning.partition_size), ("MIN_CTAS_PER_SM", min_ctas),
        ("KV_LOAD_HINT", int(tuning.load_hint)), ("KV_PREFETCH", int(tuning.prefetch)), ("DECODE_MMA", 1),
        ("SPAN_SLOTS", slots),
        *((("KV_EVICT_FIRST", 1),) if tuning.evict_first else ()), *((("SPAN_FOLD", 1),) if tuning.fold else ()),
        *((("MERGE_IN_KERNEL", 1),) if tuning.merge_in_kernel else ()), *((("PDL", 1),) if tuning.pdl else ()),
        *((("RAW_SPAN", 1),) if raw else ())))


def mma_ctas_per_sm(tuning: MmaTuning, head_dim: int) -> int:
    """v3's CTAs per SM: its register budget (__launch_bounds__'s MIN_CTAS_PER_SM), and so one wave of its grid."""
    return tuning.min_ctas_per_sm or MMA_MIN_CTAS_PER_SM[head_dim]


SPAN_SHARED_BYTES = 40 << 10  # static shared memory the span's per-warp states may take (48 KB in all)
SPAN_FILL = 0.9  # a span is taken only while the grid keeps at least this share of the GPU's CTA slots busy
# The folded tree takes a CTA per superpartition where one partition a CTA would be a grid of at least this many
# waves (num_groups * max_parts CTAs over the GPU's slots, MMA_MIN_CTAS_PER_SM an SM): FOLD_WAVES_WHOLE where one
# superpartition holds every context (max_parts <= MAX_SPAN: its CTAs write the output, one partition a CTA needs the
# fold reduce after it), FOLD_WAVES where a reduce follows either way. Measured at head_dim 128 (span_schedule).
FOLD_WAVES = 1.9
FOLD_WAVES_WHOLE = 1.2
# Raw spans (MmaTuning.raw_span): where one partition a CTA would run more than one wave and at most RAW_WAVES (its
# second wave at most half full), a CTA computes RAW_SPAN partitions in turn, writing each one's warp states for the
# fold reduce: half the CTAs, in one wave, the same partials. Measured at head_dim 128 (span_schedule).
RAW_WAVES = 1.5
RAW_SPAN = 2


def has_raw_spans(tuning: MmaTuning, slots: int) -> bool:
    """Whether spans of RAW_SPAN exist for this v3 build: raw_span, the folded tree, and its span build (`slots`,
    span_slots, is MAX_SPAN: not where the loop's fold would spill). The one rule of the config and the schedule."""
    return tuning.raw_span and tuning.fold and slots == MAX_SPAN


# Head dims where v3's folded superpartition build (its fold inside the slab loop) spills at its occupancy
# (MMA_MIN_CTAS_PER_SM; nvcc's report, tests/test_kernels_cpu.py): they run one partition a CTA.
FOLD_SPILLS = (64, 120)


def span_slots(head_dim: int, heads_per_cta: int, block_size: int, tuning: MmaTuning = MmaTuning()) -> int:
    """Partitions a v3 CTA can compute in turn: each keeps its 4 warps' unnormalized p.V (4 x heads x head_dim
    floats) in shared memory until the CTA merges them, so the span is what fits SPAN_SHARED_BYTES, at most
    MAX_SPAN (4 at head_dim 128 with 4 heads a CTA: 32 KB). 1 (the kernel saves its state after the slab
    loop, as before spans) with the in-kernel merge (its counters count partition CTAs), and where saving a
    partition's state inside the loop would spill at the occupancy MMA_MIN_CTAS_PER_SM asks: more than 4
    heads a CTA, or blocks smaller than a slab (a slab's rows then need a block number each); nvcc's
    report, tests/test_kernels_cpu.py. The folded tree (fold=True) keeps one folded state a warp whatever the
    span, so its span is MAX_SPAN (one whole superpartition) wherever the loop's fold does not spill."""
    if tuning.merge_in_kernel or heads_per_cta > 4 or block_size < 16:
        return 1
    if tuning.fold:  # one folded state a warp whatever the span: the whole superpartition, or one partition
        return 1 if head_dim in FOLD_SPILLS else min(MAX_SPAN, tuning.max_span)
    return max(1, min(MAX_SPAN, tuning.max_span, SPAN_SHARED_BYTES // (4 * heads_per_cta * head_dim * 4)))


def span_schedule(tuning: MmaTuning, head_dim: int, heads_per_cta: int, block_size: int, num_groups: int,
                  max_parts: int, num_sms: int) -> int:
    """How many of a sequence's fixed partitions one v3 CTA computes in turn, for a launch of `num_groups`
    (sequence, head group) pairs whose longest context has `max_parts` partitions (launch.paged_attention_decode
    asks): its grid has num_groups * ceil(max_parts / span) CTAs.

    A span long enough to hold a whole context (2 or 4 >= max_parts) lets each CTA merge its partitions itself,
    so no partials are written and no reduce kernel follows the grid; the rule takes the shortest such span
    while the grid still fills SPAN_FILL of the GPU's CTA slots (at least one CTA per SM), and 1 otherwise.
    Measured on an H200 (2026-12-03, docs/benchmarks.md): at 64 x 4096 tokens (4 partitions) span 4 streams
    1-2% faster than one partition a CTA; where a span cannot hold the context (8 x 32768) a span of 4 was 2%
    slower (512 long CTAs in one wave end unevenly, where 2048 short ones balance), so there it stays 1. A
    schedule, never a bit: the partitions are the same fixed spans of the sequence, each merged over its warps
    in warp order, and a CTA holding a whole context merges them with the reduce kernel's operations in its
    order (tests/test_kernels_gpu.py holds every span to the reduce kernel's bits). `tuning.span` forces it
    (benchmark candidates), capped by span_slots.

    The folded tree (the default, fold=True) has two spans: MAX_SPAN, a CTA per superpartition (its warps fold
    its partitions in the slab loop), where a grid of one partition a CTA would run FOLD_WAVES waves or more
    (FOLD_WAVES_WHOLE where one superpartition holds every context); otherwise 1, a CTA per partition, whose warps'
    states the fold reduce kernel folds.
    Measured on an H200 (2026-12-04, docs/benchmarks.md): the superpartition CTAs read 1-2% faster than the
    unfolded tree at 512 CTAs ((64, 4096), (8, 32768)) and at 256 ((1, 131072), (16, 8192) level), and are
    2-3x slower at 8-64 CTAs, where one partition a CTA runs. Between, counted in one-partition CTAs (528 a wave
    at head_dim 128 on 132 SMs): where one superpartition holds the context (no reduce after it) one partition a
    CTA wins while its grid fits one wave ((16, 4096) by 12%, (20, 3072) by 14%, (24, 2048) by 1%: 512, 480, 384
    CTAs), they are level at 576 ((18, 4096)) and the superpartitions win from 640 ((20, 4096) +0.5%, (24, 4096)
    +2%, (28, 4096) +7%); where a reduce follows either way, one partition a CTA wins up to 768 ((3, 32768),
    (12, 8192), (6, 16384) by 2-3%), they are level at 896 ((7, 16384)) and the superpartitions win at 1024
    ((4, 32768) +3%). The same bits either way (tests/test_kernels_gpu.py).

    Raw spans (raw_span, the default): where one partition a CTA would run more than one wave and at most
    RAW_WAVES, a CTA computes RAW_SPAN partitions and writes each one's warp states as a CTA of one partition does,
    so the fold reduce folds the same states: the bits of span 1, in one wave of CTAs twice as long instead of a
    full wave and a tail. Measured on an H200 against the rule without it (2026-12-05, docs/benchmarks.md; 528
    CTAs a wave): +17% at 1.09 waves ((9, 8192), (18, 4096), (36, 2048)), +13% at 1.21, +5% at 1.33, +1-3% at
    1.45 ((12, 8192), (24, 4096)); -6% at 0.97 (one wave already), -6 to -10% at 1.58, -5% at 1.70, -3% at 1.82."""
    slots = span_slots(head_dim, heads_per_cta, block_size, tuning)
    per_sm = mma_ctas_per_sm(tuning, head_dim)
    if tuning.fold:  # a CTA per superpartition, or per partition (the reduce kernel folds): the same bits
        raw = has_raw_spans(tuning, slots) and max_parts > 1  # and a context has partitions to split
        if tuning.span is not None:
            if tuning.span == RAW_SPAN:
                return RAW_SPAN if raw else 1
            return MAX_SPAN if tuning.span >= MAX_SPAN and slots == MAX_SPAN else 1
        waves = num_groups * max_parts / (num_sms * per_sm)
        if raw and 1 < waves <= RAW_WAVES:  # a second wave at most half full: one wave of CTAs twice as long
            return RAW_SPAN
        whole = max_parts <= MAX_SPAN  # one superpartition holds every context: no reduce after it
        fills = waves >= (FOLD_WAVES_WHOLE if whole else FOLD_WAVES)
        return MAX_SPAN if max_parts > 1 and slots == MAX_SPAN and fills else 1
    if tuning.span is not None:
        return max(1, min(tuning.span, slots))
    fill = max(num_sms, SPAN_FILL * per_sm * num_sms)
    if max_parts == 1 or num_groups < fill:  # nothing to merge, or a grid of one CTA a context leaves SMs idle
        return 1
    return next((span for span in (2, 4) if max_parts <= span <= slots), 1)


def span_build(tuning: MmaTuning, span: int) -> MmaTuning:
    """The v3 build a launch of `span` partitions a CTA runs (launch.paged_attention_decode asks). One partition
    a CTA runs the build without span slots (SPAN_SLOTS=1): its slab loop has no partition ends to test and its
    state is saved after the loop, and it has no slots' shared memory taking L1's room (32 KB at head_dim 128:
    `python -m pagedref.bench gather`). It streamed 1-4% faster than the span build at the same grids (H200,
    2026-12-04, docs/benchmarks.md). Spans of RAW_SPAN run the raw-span build (its loop saves each partition's
    states, folds none), any other span the span build. A build, never a bit: every span is held to its bits
    (tests/test_kernels_gpu.py)."""
    if span == 1:
        tuning = dataclasses.replace(tuning, max_span=1)
    return tuning if span == RAW_SPAN or not tuning.fold else dataclasses.replace(tuning, raw_span=False)


SMALL_GRID_HEAD_DIMS = (128,)  # where small_grid_schedule applies (measured there)


def small_grid_schedule(tuning: MmaTuning, head_dim: int, num_ctas: int, num_sms: int) -> MmaTuning:
    """v3's schedule for a launch of `num_ctas` CTAs on `num_sms` SMs (launch.paged_attention_decode asks).

    A grid of at most one CTA per SM (a few long sequences: 1-4 of 4096 tokens are 32-128 CTAs at 32 / 8
    heads) leaves each SM's registers to one CTA, so the build that also asks L2 for each warp's slab after
    next (`prefetch`, ~6 more registers: 3 CTAs per SM) costs no occupancy, and it streams 12-16% faster there
    (H200, 2026-12-02, docs/benchmarks.md); once the grid fills the GPU it loses 4-40%, so larger grids keep
    the tuning they came with. A schedule: the same bits either way, so a sequence's result still does not
    depend on its batch (tests/test_kernels_gpu.py crosses the threshold). `small_grid_prefetch=False` in
    the tuning turns it off (a benchmark candidate)."""
    if (not tuning.small_grid_prefetch or tuning.prefetch or head_dim not in SMALL_GRID_HEAD_DIMS
            or num_ctas > num_sms):
        return tuning
    return dataclasses.replace(tuning, prefetch=True, min_ctas_per_sm=3)


# Candidate tunings the benchmark times at every shape and the GPU tests check (16-bit K/V, head_dim
# 128: the cp.async rings of a float32 build can exceed 48 KB of static shared memory). Default first;
# each tuning's `version` says which kernel it tunes.
CANDIDATES: dict[str, DecodeTuning | MmaTuning] = {
    "default": MmaTuning(),  # v3 on the tensor cores, 1024-token partitions: what the engine runs
    "v2 registers": DecodeTuning(),  # v2's default (and the fallback for float32 and other head dims)
    "v2 registers p1024": DecodeTuning(partition_size=1024),
    "v2 async u2 tpt16": DecodeTuning(unroll=2, threads_per_token=16, min_ctas_per_sm=6, async_copy=True),
    "v2 async u4 tpt16": DecodeTuning(unroll=4, threads_per_token=16, min_ctas_per_sm=5, async_copy=True),
    "v2 async u1 tpt8": DecodeTuning(unroll=1, threads_per_token=8, min_ctas_per_sm=5, async_copy=True),
    "v2 async u2 tpt16 p1024": DecodeTuning(partition_size=1024, unroll=2, threads_per_token=16, min_ctas_per_sm=6,
                                            async_copy=True),
    "v2 async u1 tpt8 p1024": DecodeTuning(partition_size=1024, unroll=1, threads_per_token=8, min_ctas_per_sm=4,
                                           async_copy=True),
    "v3 mma p512": MmaTuning(partition_size=512),
    "v3 mma hint": MmaTuning(load_hint=True),
    "v3 mma p512 hint": MmaTuning(partition_size=512, load_hint=True),
    "v3 mma prefetch": MmaTuning(prefetch=True, min_ctas_per_sm=3),  # 134 registers: 4 CTAs would spill
    "v3 mma p512 prefetch": MmaTuning(partition_size=512, prefetch=True, min_ctas_per_sm=3),
    "v3 mma p2048": MmaTuning(partition_size=2048),
    # the last partition CTA merges (no reduce launch): same bits as the same partitions merged by the reduce kernel
    "v3 mma merge in kernel": MmaTuning(merge_in_kernel=True, fold=False),
    "v3 mma p2048 merge in kernel": MmaTuning(partition_size=2048, merge_in_kernel=True, fold=False),
    "v3 mma p4096 merge in kernel": MmaTuning(partition_size=4096, merge_in_kernel=True, fold=False),
    "v3 mma no pdl": MmaTuning(pdl=False),  # the reduce launched after v3 ends (the default before 2026-12-04)
    # the default without small_grid_schedule's prefetch build at grids of at most one CTA per SM (the same bits)
    "v3 mma no small-grid prefetch": MmaTuning(small_grid_prefetch=False),
    # K/V lines first out of L2: the block numbers and the partials the reduce kernel reads back stay in it
    "v3 mma evict first": MmaTuning(evict_first=True),
    # a CTA per partition (the reduce kernel folds), and a CTA per superpartition (4 partitions folded in it)
    "v3 mma span1": MmaTuning(span=1),
    "v3 mma span4": MmaTuning(span=4),
    # 2 partitions a CTA, each one's warp states written for the fold reduce (the default's in RAW_WAVES' band): forced;
    # and the default without it (its rule before 2026-12-05)
    "v3 mma rawspan2": MmaTuning(span=2),
    "v3 mma no rawspan": MmaTuning(raw_span=False),
    # the tree before 2026-12-04: each partition merged over its warps, spans of 1, 2 or 4 partitions a CTA in
    # shared-memory slots (other bits)
    "v3 mma unfolded": MmaTuning(fold=False),
    "v3 mma unfolded span1": MmaTuning(fold=False, span=1),
}


# Prefill v3 (cuda/paged_prefill_hopper.cu): FlashAttention-3 on Hopper's own instructions (wgmma,
# setmaxnreg: the sm_90a target), so only on compute capability 9.0, for 16-bit Q/K/V at these head
# dims. A CTA is a producer warpgroup and two consumer warpgroups of 64 query rows each; key tiles
# of 128 keys flow through a ring of KV stages in shared memory.
PREFILL_V3_ARCH = "sm_90a"
PREFILL_V3_CAPABILITY = (9, 0)
PREFILL_V3_HEAD_DIMS = (64, 128)
PREFILL_V3_THREADS = 384
PREFILL_V3_ROWS = 128  # query rows per CTA
PREFILL_V3_KEY_TILE = 128


def prefill_v3_supported(elem_size: int, head_dim: int, capability: tuple[int, int] | None) -> bool:
    """Whether prefill v3 runs here: 16-bit Q/K/V, head_dim 64 or 128, an sm_90 device (H100 / H200)."""
    return elem_size == 2 and head_dim in PREFILL_V3_HEAD_DIMS and capability == PREFILL_V3_CAPABILITY


def prefill_v3_stages(head_dim: int) -> int:
    """KV stages of prefill v3's ring: as many as fit in 227 KB beside the query tile (3 at 128, 4 at 64;
    at 128, 3 ran 4-6% faster than 2 on an H200)."""
    return 3 if head_dim > 64 else 4


def prefill_v3_shared_bytes(head_dim: int, stages: int | None = None) -> int:
    """Dynamic shared memory of prefill v3: the query tile, `stages` K and V tiles, 1 KB of alignment
    slack (the swizzle atoms start on 1024-byte boundaries), two mbarriers per stage and one for Q."""
    stages = stages or prefill_v3_stages(head_dim)
    return (PREFILL_V3_ROWS + 2 * stages * PREFILL_V3_KEY_TILE) * head_dim * 2 + 1024 + 16 * stages + 16


@dataclass(frozen=True)
class PrefillV3Schedule:
    """Prefill v3's compile-time knobs (cuda/paged_prefill_hopper.cu's header). persistent and bt_shfl
    change the order of work only, never a row's arithmetic; rcp_epilogue changes the epilogue's
    arithmetic (O * (1 / l) instead of O / l), the same for every row, so two schedules with the same
    rcp_epilogue give the same bits."""

    persistent: bool = False  # at most one CTA per SM walks the work items (snake order)
    rcp_epilogue: bool = False  # one division per row, then products
    bt_shfl: bool = False  # the producer loads a tile's block-table entries once per lane and shuffles them
    tma: bool = False  # whole key tiles by TMA, one box per block (the launch passes the pool's descriptors)


# Prefill v3's schedules the benchmark times side by side (`bench kernel --prefill-schedules`) and CI
# compiles at bfloat16 / 16 (each head dim).
PREFILL_V3_SCHEDULES: dict[str, PrefillV3Schedule] = {
    "plain": PrefillV3Schedule(),
    "rcp": PrefillV3Schedule(rcp_epilogue=True),
    "rcp bt": PrefillV3Schedule(rcp_epilogue=True, bt_shfl=True),
    "persistent": PrefillV3Schedule(persistent=True),
    "persistent rcp": PrefillV3Schedule(persistent=True, rcp_epilogue=True),
    "persistent rcp bt": PrefillV3Schedule(persistent=True, rcp_epilogue=True, bt_shfl=True),
    "rcp tma": PrefillV3Schedule(rcp_epilogue=True, tma=True),
    "persistent rcp tma": PrefillV3Schedule(persistent=True, rcp_epilogue=True, tma=True),
}


def prefill_config(dtype: str, head_dim: int, block_size: int, version: int = 1,
                   stages: int | None = None, schedule: PrefillV3Schedule = PrefillV3Schedule()) -> KernelConfig:
    """Prefill v1 (CUDA cores, every shape), v2 (tensor cores: -DPREFILL_MMA=1, mma_supported only) or
    v3 (sm_90a: PREFILL_V3_HEAD_DIMS, 16-bit; `stages` of its KV ring, None: prefill_v3_stages;
    `schedule`'s knobs). Stages change the schedule only, never the arithmetic."""
    if version not in (1, 2, 3):
        raise ValueError(f"prefill version must be 1, 2 or 3, got {version}")
    defines = (("PR_DTYPE", DTYPE_CODES[dtype]), ("HEAD_DIM", head_dim), ("BLOCK_SIZE", block_size))
    if version == 1:
        return KernelConfig("paged_prefill.cu", defines)
    if version == 3:
        if ELEM_SIZE[dtype] != 2 or head_dim not in PREFILL_V3_HEAD_DIMS:
            raise ValueError(f"prefill v3 takes float16/bfloat16 with head_dim in {PREFILL_V3_HEAD_DIMS}, got "
                             f"{dtype} with head_dim {head_dim}")
        if schedule.tma and schedule.bt_shfl:
            raise ValueError("prefill v3's tma schedule loads each block-table entry once per tile: no bt_shfl")
        stages = stages or prefill_v3_stages(head_dim)
        # The persistent producer's item loop spills under 40 registers: 56 + 2 x 224 (setmaxnreg's budget).
        knobs = (("V3_PERSISTENT", int(schedule.persistent)), ("V3_RCP_EPILOGUE", int(schedule.rcp_epilogue)),
                 ("V3_BT_SHFL", int(schedule.bt_shfl)), ("V3_TMA", int(schedule.tma)),
                 ("V3_PRODUCER_REGS", 56 if schedule.persistent else 40))
        return KernelConfig("paged_prefill_hopper.cu",
                            (*defines, ("KV_STAGES", stages), *knobs), PREFILL_V3_ARCH)
    if not mma_supported(ELEM_SIZE[dtype], head_dim):
        raise ValueError(f"the tensor-core prefill kernel (v2) takes float16/bfloat16 with head_dim in "
                         f"{MMA_HEAD_DIMS}, got {dtype} with head_dim {head_dim}")
    return KernelConfig("paged_prefill.cu", (*defines, ("PREFILL_MMA", 1)))


# The weight GEMM (cuda/gemm_hopper.cu, launched by pagedref.kernels.gemm): sm_90a, 16-bit; a CTA is a TMA
# producer warpgroup and two wgmma consumer warpgroups of 64 rows each, over k-steps of 64.
GEMM_BM, GEMM_BK = 128, 64
GEMM_WIDTHS = (64, 96, 128, 192, 224, 256)  # the tile widths the kernel spells out (wgmma m64nBNk16)


@dataclass(frozen=True)
class GemmTile:
    """A weight's tiling: bn output columns per CTA (for silu_mul_linear: bn / 2 gate and bn / 2 up
    rows), K cut into `splits` fixed spans (their fp32 sums added in order), `stages` deep ring, `cluster`
    row tiles sharing each B tile (TMA multicast). Only splits changes the arithmetic: bn, stages and
    cluster change the schedule, not a bit (tests/test_gemm_gpu.py; measured on an H200)."""

    bn: int
    splits: int = 1
    stages: int | None = None  # None: as many as fit in shared memory (gemm_max_stages), at most 8
    cluster: int = 2

    def __post_init__(self):
        if self.bn not in GEMM_WIDTHS:
            raise ValueError(f"tile width bn must be one of {GEMM_WIDTHS}, got {self.bn}")
        if self.stages is None:
            object.__setattr__(self, "stages", gemm_max_stages(self.bn))
        low, high = gemm_min_stages(self.bn), gemm_max_stages(self.bn)
        if not 1 <= self.splits <= 8 or not low <= self.stages <= high or self.cluster not in (1, 2):
            raise ValueError(f"splits must be 1..8, stages {low}..{high} (what fits at bn = {self.bn}) "
                             f"and cluster 1 or 2, got {self.splits}, {self.stages} and {self.cluster}")


def gemm_shared_bytes(tile: GemmTile) -> int:
    """Dynamic shared memory: `stages` x (GEMM_BM + bn rows of 128 bytes), 1 KB of alignment slack, the mbarriers."""
    return _gemm_shared_bytes(tile.bn, tile.stages)


def _gemm_shared_bytes(bn: int, stages: int) -> int:
    return stages * (GEMM_BM + bn) * GEMM_BK * 2 + 1024 + 16 * stages


def gemm_min_stages(bn: int) -> int:
    """The shallowest ring that holds the epilogue's tile: GEMM_BM x bn fp32 partials (split-K; the 16-bit
    output is half that), staged in the ring before the bulk tensor store."""
    return max(2, -(-GEMM_BM * bn * 4 // ((GEMM_BM + bn) * GEMM_BK * 2)))


def gemm_max_stages(bn: int, limit: int = 227 * 1024) -> int:
    """The deepest ring that fits in an H200's 227 KB of shared memory per block, at most 8 (measured: the
    narrow tiles need depth: o at bn 64 took 29.1 µs with 4 stages, 23.8 with 8; bench gemm, H200)."""
    return max(s for s in range(2, 9) if _gemm_shared_bytes(bn, s) <= limit)


def gemm_config(dtype: str, tile: GemmTile, silu_mul: bool = False) -> KernelConfig:
    """The GEMM's module for a dtype and tile (silu_mul: SwiGLU's gate/up with silu(gate) * up in the epilogue)."""
    if ELEM_SIZE[dtype] != 2:
        raise ValueError(f"the Hopper GEMM takes float16 or bfloat16, got {dtype}")
    return KernelConfig("gemm_hopper.cu", (("PR_DTYPE", DTYPE_CODES[dtype]), ("GEMM_BN", tile.bn),
                                           ("GEMM_STAGES", tile.stages), ("GEMM_SILU_MUL", int(silu_mul)),
                                           ("GEMM_CLUSTER", tile.cluster)),
                        PREFILL_V3_ARCH)


CACHE_OPS = KernelConfig("cache_ops.cu")
KV_READ_PATTERNS = {"v3 lanes": 0, "whole rows": 1, "whole blocks": 2}  # cuda/kv_read.cu (bench gather)


def kv_read_config(pattern: str, partition_size: int = MMA_PARTITION_SIZE) -> KernelConfig:
    return KernelConfig("kv_read.cu", (("HEAD_DIM", 128), ("BLOCK_SIZE", 16), ("PARTITION_SIZE", partition_size),
                                       ("PATTERN", KV_READ_PATTERNS[pattern])))


def ci_configs() -> list[KernelConfig]:
    """What CI compiles: every dtype x head_dim x block_size (and decode v3 / prefill v2 / v3 where they apply), every
    heads-per-CTA at bf16/128/16, every candidate tuning, and what small_grid_schedule makes of each v3 one."""
    grid = itertools.product(DTYPE_CODES, SUPPORTED_HEAD_DIMS, SUPPORTED_BLOCK_SIZES)
    configs = [CACHE_OPS]
    for dtype, head_dim, block_size in grid:
        configs += [decode_config(dtype, head_dim, block_size, 4), prefill_config(dtype, head_dim, block_size)]
    # v3's builds (span_build): the span build, the raw-span build (the default tuning's own) and one partition a CTA
    configs += [mma_decode_config(dtype, head_dim, block_size, 4, span_build(MmaTuning(), span))
                for dtype in ("float16", "bfloat16") for head_dim in MMA_HEAD_DIMS for block_size in SUPPORTED_BLOCK_SIZES
                for span in (MAX_SPAN, RAW_SPAN)]
    configs += [prefill_config(dtype, head_dim, block_size, version=2) for dtype in ("float16", "bfloat16")
                for head_dim in MMA_HEAD_DIMS for block_size in SUPPORTED_BLOCK_SIZES]
    # v3: the plain grid and the launcher's two schedules (launch.prefill_v3_schedule), every shape.
    v3_schedules = (PrefillV3Schedule(), PREFILL_V3_SCHEDULES["persistent rcp tma"], PREFILL_V3_SCHEDULES["rcp tma"])
    configs += [prefill_config(dtype, head_dim, block_size, version=3, schedule=s) for dtype in ("float16", "bfloat16")
                for head_dim in PREFILL_V3_HEAD_DIMS for block_size in SUPPORTED_BLOCK_SIZES for s in v3_schedules]
    # v3's build for one partition a CTA (span_build) and its small-grid build (small_grid_schedule: a grid that
    # small has one partition a CTA) wherever the default v3 runs
    one = span_build(MmaTuning(), 1)
    small = small_grid_schedule(one, SMALL_GRID_HEAD_DIMS[0], num_ctas=1, num_sms=1)
    configs += [mma_decode_config(dtype, head_dim, block_size, 4, one) for dtype in ("float16", "bfloat16")
                for head_dim in MMA_HEAD_DIMS for block_size in SUPPORTED_BLOCK_SIZES]
    configs += [mma_decode_config(dtype, head_dim, block_size, 4, small) for dtype in ("float16", "bfloat16")
                for head_dim in SMALL_GRID_HEAD_DIMS for block_size in SUPPORTED_BLOCK_SIZES]
    configs += [decode_config("bfloat16", 128, 16, g, t) for g in (1, 2, 3, 5, 6, 7, 8)
                for t in (DecodeTuning(), MmaTuning(), one, small)]
    configs += [decode_config(dtype, 128, 16, 4, t) for dtype in ("float16", "bfloat16") for t in CANDIDATES.values()]
    configs += [decode_config(dtype, 128, 16, 4, small_grid_schedule(span_build(t, span), 128, num_ctas=1, num_sms=1))
                for dtype in ("float16", "bfloat16") for t in CANDIDATES.values() if t.version == 3
                for span in (1, RAW_SPAN, MAX_SPAN)]
    configs += [decode_config(dtype, 128, 16, 4, span_build(t, 1)) for dtype in ("float16", "bfloat16")
                for t in CANDIDATES.values() if t.version == 3]
    configs += [prefill_config("bfloat16", head_dim, 16, 3, schedule=s) for head_dim in PREFILL_V3_HEAD_DIMS
                for s in PREFILL_V3_SCHEDULES.values()]
    configs += [KernelConfig("fused_ops.cu", (("PR_DTYPE", code),)) for code in DTYPE_CODES.values()]  # kernels.fused
    configs += [kv_read_config(p) for p in KV_READ_PATTERNS]  # bench gather
    configs += [kv_read_config("v3 lanes", n) for n in (208, 4096)]  # its short contexts and superpartitions
    configs += [gemm_config(d, GemmTile(bn), silu) for d in ("bfloat16", "float16") for bn in GEMM_WIDTHS
                for silu in (False, True)]  # kernels.gemm
    return list(dict.fromkeys(configs))  # each once, in order


def nvcc_command(config: KernelConfig, output: Path | str, arch: str = "sm_90") -> list[str]:
    return ["nvcc", f"-arch={config.arch or arch}", "--ptx", *config.options(), str(config.source), "-o", str(output)]


@functools.lru_cache(maxsize=None)
def module(config: KernelConfig):
    """The compiled cupy.RawModule of a config (compiled on first use, then cached)."""
    import cupy

    if config.arch:
        return cupy.RawModule(path=str(_arch_cubin(config)))
    return cupy.RawModule(code=config.source.read_text() + _headers_stamp(), options=config.options())


def _arch_options(config: KernelConfig) -> tuple[str, ...]:
    """NVRTC's options for a config with its own target (-ftz as CuPy compiles; .ci/nvrtc_check.py reads them)."""
    return (*config.options(), f"--gpu-architecture={config.arch}", "-ftz=true")


def _arch_cubin(config: KernelConfig) -> Path:
    """A config with its own target, compiled by NVRTC to a cubin in CuPy's cache directory (compiled
    once per source, options and NVRTC version) -> its path. CuPy's RawModule always appends the
    device's own target (-arch=sm_90), which has no wgmma or setmaxnreg: sm_90a is a separate target."""
    from cupy.cuda import nvrtc

    source = config.source.read_text() + _headers_stamp()
    options = _arch_options(config)
    key = hashlib.sha256("\0".join((source, *options, str(nvrtc.getVersion()))).encode()).hexdigest()[:32]
    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    path = cache / f"pagedref_{config.file.split('.')[0]}_{key}.cubin"
    if path.exists():
        return path
    prog = nvrtc.createProgram(source, config.file, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on {config.file} {' '.join(options)}:\n{nvrtc.getProgramLog(prog)}") from e
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    os.replace(tmp, path)  # atomic: a concurrent reader sees no file or the whole file
    return path


@functools.lru_cache(maxsize=None)
def _headers_stamp() -> str:
    """A comment naming the digest of cuda/*.cuh. CuPy's on-disk cache keys a binary by the source
    text and the options only, not by the headers it includes: without this line an edited header
    would keep loading the binary built from the old one."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(CUDA_DIR.glob("*.cuh")))).hexdigest()
    return f"\n// cuda/*.cuh sha256 {digest}\n"


@functools.lru_cache(maxsize=None)
def function(config: KernelConfig, name: str):
    return module(config).get_function(name)


def print_ci_configs() -> None:
    """One line per CI configuration: FILE [-arch=TARGET] -DNAME=VALUE ... (read by .ci/compile_kernels.sh;
    -arch only where the config needs its own target)."""
    for cfg in ci_configs():
        arch = (f"-arch={cfg.arch}",) if cfg.arch else ()
        sys.stdout.write(" ".join((cfg.file, *arch, *cfg.options()[2:])) + "\n")


def _compile(config: KernelConfig) -> None:
    """Compile one config: CuPy compiles the module and keeps the binary in its on-disk cache. (Not by
    fetching a kernel by name: a file may name its kernels through a macro.) A config with its own target
    is only compiled (its cubin loads on that target's devices alone)."""
    if config.arch:
        _arch_cubin(config)
    else:
        module(config).compile()


def precompile(configs: list[KernelConfig] | None = None, jobs: int | None = None) -> int:
    """Compile `configs` (default: every CI configuration) in `jobs` spawned processes -> how many.

    Each process holds its own CUDA context (CuPy compiles for the device it sees); CuPy's on-disk
    cache (CUPY_CACHE_DIR, ~/.cupy/kernel_cache) is what the later processes share."""
    configs = ci_configs() if configs is None else configs
    with ProcessPoolExecutor(jobs or os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile, configs, chunksize=2))
    return len(configs)
