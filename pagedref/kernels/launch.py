"""Launching the CUDA kernels on torch tensors: check, pick the compiled variant, launch, return.

One idea: the kernels read and write torch's own memory. A launcher passes each tensor's device
pointer (zero-copy: nothing is converted or moved; a raw pointer also sidesteps CuPy having no
bfloat16 dtype) and launches on torch's current stream, so the kernel is ordered with the torch
work around it exactly as a torch op would be.

Invariant: no launch happens before its arguments passed `validate` (shapes, dtypes, devices,
contiguity always; the value ranges, one host sync, unless the caller already checked them and
passes check=False). The decode grid depends on max_context_len only through the number of
partitions, never the partition size, so a sequence's result does not depend on its batch.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from pagedref.kernels import build, driver, validate
from pagedref.kernels.splitk import (NUM_THREADS, PREFILL_MMA_ROWS, PREFILL_ROWS, heads_per_cta, mma_supported,
                                     num_partitions, prefill_mma_shared_bytes)

_WARPS_PER_CTA = NUM_THREADS // 32  # the reduce kernel: a warp per 32 dims of a (sequence, head) row
_DEFAULT_SMEM_LIMIT = 48 * 1024  # a block's static + dynamic shared memory past this needs the kernel's opt-in
_MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
PREFILL_VERSIONS = (1, 2, 3)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


class _StreamHandle:
    """A CUDA stream handle under the CUDA stream protocol (`__cuda_stream__`: version 0, the handle)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


@functools.lru_cache(maxsize=None)
def _external_stream(ptr: int, device: int):
    """CuPy's view of torch's stream `ptr` (it does not own it): through the CUDA stream protocol
    (`Stream.from_external`, CuPy 14), or `ExternalStream` on a CuPy without it (which CuPy's docs say may
    be deprecated)."""
    import cupy

    with cupy.cuda.Device(device):
        if hasattr(cupy.cuda.Stream, "from_external"):
            return cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        return cupy.cuda.ExternalStream(ptr)


def _launch(config: build.KernelConfig, name: str, device: torch.device, grid: tuple, args: tuple,
            shared_mem: int = 0, threads: int = NUM_THREADS, pdl: bool = False, carveout: int | None = None) -> None:
    """Launch `name` of `config` on torch's current stream of `device`: through CuPy, or through the driver
    (kernels.driver) for what CuPy does not pass: a programmatic dependent launch (pdl), a shared-memory
    carve-out preference of this launch's own (carveout, a percentage), or an argument that is a ctypes value
    rather than a numpy scalar (the GEMM's 128-byte TMA descriptors)."""
    import cupy

    kernel = build.function(config, name)
    opt_in_shared_memory(kernel, shared_mem)
    torch_stream = torch.cuda.current_stream(device).cuda_stream
    if pdl or carveout is not None or not all(isinstance(a, np.generic) for a in args):
        with cupy.cuda.Device(device.index):
            driver.launch(kernel, grid, threads, args, torch_stream, shared_mem=shared_mem, pdl=pdl, carveout=carveout)
        return
    stream = _external_stream(torch_stream, device.index)
    with cupy.cuda.Device(device.index), stream:
        kernel(grid, (threads,), args, shared_mem=shared_mem)


def opt_in_shared_memory(kernel, shared_mem: int) -> None:
    """Let `kernel` (a CuPy RawKernel) launch with `shared_mem` bytes of dynamic shared memory. Without an
    opt-in a block may use 48 KB, static and dynamic together; past that the kernel's attribute
    (cudaFuncAttributeMaxDynamicSharedMemorySize) must allow the dynamic part. So the test is on the sum: a
    kernel with 40 KB of static memory launched with 16 KB dynamic needs it as much as one with 64 KB dynamic."""
    if shared_mem and kernel.shared_size_bytes + shared_mem > _DEFAULT_SMEM_LIMIT \
            and kernel.max_dynamic_shared_size_bytes < shared_mem:
        kernel.max_dynamic_shared_size_bytes = shared_mem


def _dtype_name(t: torch.Tensor) -> str:
    return validate.DTYPE_NAMES[t.dtype]


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                           max_context_len: int | None = None, out: torch.Tensor | None = None,
                           version: int = 3, tuning: build.DecodeTuning | build.MmaTuning | None = None,
                           check: bool = True) -> torch.Tensor:
    """Decode attention: row s of q is sequence s's one new token -> [num_seqs, num_heads, head_dim].

    q [num_seqs, num_heads, head_dim]; k/v_cache [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables [num_seqs, max_blocks] int32; context_lens [num_seqs] int32.
    version 1 is the textbook kernel, 2 the split-K one, 3 split-K on the tensor cores (float16 /
    bfloat16 at vLLM's head sizes, splitk.MMA_HEAD_DIMS; float32 or a smaller head_dim runs version
    2 with its default tuning: a choice made from the model's shapes, never from the batch). `tuning` holds
    the kernel's fixed design constants (a DecodeTuning for versions 1 and 2, an MmaTuning for 3;
    None: the default), exposed for benchmark experiments only: never chosen from the batch.
    """
    shape = validate.check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    if q.shape[0] != shape.num_seqs:
        raise ValueError(f"decode takes one query row per sequence: q has {q.shape[0]} rows for {shape.num_seqs} sequences")
    version, tuning = _decode_kernel(version, tuning, q.element_size(), shape.head_dim)
    validate.require_cuda(q, "q")
    if version == 3 and tuning.pdl and _capability(q.device) < (9, 0):
        tuning = dataclasses.replace(tuning, pdl=False)  # sm_90's; a schedule: the same bits without it
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if shape.num_seqs else 0
    if check:
        validate.check_ranges(shape, block_tables, context_lens, max_context_len)
    if out is None:
        out = torch.empty_like(q)
    else:
        validate.check_out(out, q)
    if shape.num_seqs == 0:
        return out
    max_parts = num_partitions(max_context_len, tuning.partition_size)
    if max_parts > _MAX_GRID_YZ:
        raise ValueError(f"max_context_len = {max_context_len} needs {max_parts} partitions; at most "
                         f"{_MAX_GRID_YZ} are supported")
    if shape.num_seqs > _MAX_GRID_YZ:
        raise ValueError(f"{shape.num_seqs} sequences in one decode launch; at most {_MAX_GRID_YZ} are supported")
    hpc = heads_per_cta(shape.num_heads, shape.num_kv_heads) if version >= 2 else 1
    span = 1  # partitions per CTA
    if version == 3:  # schedules chosen from the grid: never a bit of the result
        span = build.span_schedule(tuning, shape.head_dim, hpc, shape.block_size,
                                   shape.num_heads // hpc * shape.num_seqs, max_parts, _num_sms(q.device))
        tuning = build.span_build(tuning, span)
    grid = (shape.num_heads // hpc, -(-max_parts // span), shape.num_seqs)
    if version == 3:
        tuning = build.small_grid_schedule(tuning, shape.head_dim, grid[0] * grid[1] * grid[2], _num_sms(q.device))
    config = build.decode_config(_dtype_name(q), shape.head_dim, shape.block_size, hpc, tuning)
    common = (_ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(context_lens), np.int32(shape.max_blocks),
              np.int32(shape.num_heads), np.int32(shape.num_kv_heads))
    if version == 1:
        _launch(config, "paged_attention_v1", q.device, (shape.num_seqs, shape.num_heads),
                (_ptr(out), _ptr(q), *common, np.float32(scale)))
        return out
    f32 = dict(dtype=torch.float32, device=q.device)
    # The folded tree with one partition a CTA (or raw spans of 2): each CTA writes its warps' states of each of its
    # partitions, which the fold reduce folds.
    fold_partials = version == 3 and tuning.fold and span < build.MAX_SPAN and max_parts > 1
    # The partials: [rows, max_parts] (x head_dim for tmp_out); with fold_partials [rows, max_parts, warps].
    rows = shape.num_seqs * shape.num_heads * (_WARPS_PER_CTA if fold_partials else 1)
    tmp_out = torch.empty(rows * max_parts * shape.head_dim, **f32)
    max_logits = torch.empty(rows * max_parts, **f32)
    exp_sums = torch.empty_like(max_logits)
    merge_in_kernel = version == 3 and tuning.merge_in_kernel and max_parts > 1
    v3_args = ()  # v3 takes its merge counters (null when the reduce kernel merges) and its span last
    if version == 3:
        v3_args = (_ptr(_merge_counters(q.device, shape.num_seqs * (shape.num_heads // hpc))) if merge_in_kernel
                   else np.uint64(0), np.int32(span))
    _launch(config, f"paged_attention_v{version}", q.device, grid,
            (_ptr(out), _ptr(tmp_out), _ptr(max_logits), _ptr(exp_sums), _ptr(q), *common,
             np.int32(max_parts), np.float32(scale), *v3_args))
    slices = shape.num_heads * -(-shape.head_dim // 32)  # of 32 dims, a sequence's rows' (REDUCE_SLICES each)
    if fold_partials:  # a CTA per slice
        _launch(config, "paged_attention_fold_reduce", q.device, (shape.num_seqs, slices),
                (_ptr(out), _ptr(tmp_out), _ptr(max_logits), _ptr(exp_sums), _ptr(context_lens),
                 np.int32(shape.num_heads), np.int32(max_parts)), pdl=tuning.pdl)
    elif max_parts > span and not merge_in_kernel:  # some context has partitions in more than one CTA: a warp a slice
        _launch(config, "paged_attention_reduce", q.device, (shape.num_seqs, -(-slices // _WARPS_PER_CTA)),
                (_ptr(out), _ptr(tmp_out), _ptr(max_logits), _ptr(exp_sums), _ptr(context_lens),
                 np.int32(shape.num_heads), np.int32(max_parts), np.int32(span)), pdl=version == 3 and tuning.pdl)
    return out


_MERGE_COUNTERS: dict[int, torch.Tensor] = {}  # device index -> int32 counters, zeros between launches
_RETIRED_COUNTERS: list[torch.Tensor] = []  # outgrown buffers and those made in a capture: graphs may replay them


def _merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counters, zero, for v3's in-kernel merge (one per (sequence, head group)).

    The kernel puts each counter it used back to zero, so one buffer per device serves every launch and
    every graph replay, provided no two of them run at once (one stream: the engine's; a graph replays on
    it too). A buffer grows outside graph capture; a capture that needs more captures its own zeroed
    buffer. None is ever freed: a captured graph may replay it, and a buffer freed during a capture could
    be handed to a later allocation of the same capture."""
    buf = _MERGE_COUNTERS.get(device.index)
    if buf is not None and buf.numel() >= n:
        return buf
    new = torch.zeros(max(n, 1024, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.int32, device=device)
    if torch.cuda.is_current_stream_capturing():
        _RETIRED_COUNTERS.append(new)
    else:
        if buf is not None:
            _RETIRED_COUNTERS.append(buf)
        _MERGE_COUNTERS[device.index] = new
    return new


def _decode_kernel(version: int, tuning, elem_size: int, head_dim: int):
    """(version, tuning) to run: the defaults filled in, v3 -> v2 where v3 does not apply."""
    tunings = {1: build.DecodeTuning, 2: build.DecodeTuning, 3: build.MmaTuning}
    if version not in tunings:
        raise ValueError(f"version must be 1, 2 or 3, got {version}")
    if tuning is None:
        tuning = tunings[version]()
    if not isinstance(tuning, tunings[version]):
        raise TypeError(f"version {version} takes a {tunings[version].__name__} as tuning, got {type(tuning).__name__}")
    if version == 3 and not mma_supported(elem_size, head_dim):
        return 2, build.DecodeTuning()
    return version, tuning


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                  max_query_len: int | None = None, max_context_len: int | None = None,
                  out: torch.Tensor | None = None, version: int | None = None,
                  schedule: build.PrefillV3Schedule | None = None, check: bool = True) -> torch.Tensor:
    """Prefill / chunked prefill: each sequence's query rows attend causally to its context.

    q [num_tokens, num_heads, head_dim]; query_start_loc [num_seqs + 1] int32; the rows of sequence
    s are its last query_len context tokens (their K/V already written) -> [num_tokens, num_heads, head_dim].
    version 1 runs on CUDA cores (every dtype and head_dim), 2 on the tensor cores (float16 /
    bfloat16 at vLLM's head sizes, splitk.MMA_HEAD_DIMS), 3 on Hopper's wgmma (float16 / bfloat16 at
    head_dim 64 or 128 on an sm_90 device); a version that does not apply runs the next one down, and
    None (the default) asks for the fastest: 3 -> 2 -> 1, a choice made from the model's shapes and
    the device, never from the batch. `schedule` (v3 only) picks v3's compile-time knobs (benchmark
    experiments); None: prefill_v3_schedule's choice, which never changes a bit.
    """
    shape = validate.check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    if version not in (None, *PREFILL_VERSIONS):
        raise ValueError(f"prefill version must be 1, 2 or 3 (None: the fastest that applies), got {version}")
    validate.require_cuda(q, "q")
    version = _prefill_version(version or 3, q.element_size(), shape.head_dim, _capability(q.device))
    validate.check_query_start_loc(query_start_loc, shape.num_seqs, q.device)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if shape.num_seqs else 0
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if shape.num_seqs else 0
    if check:
        validate.check_ranges(shape, block_tables, context_lens, max_context_len, query_start_loc,
                              q.shape[0], max_query_len)
    if out is None:
        out = torch.empty_like(q)
    else:
        validate.check_out(out, q)
    if shape.num_seqs == 0 or q.shape[0] == 0:
        return out
    # The version's kernel, query rows per CTA, threads per CTA and dynamic shared memory.
    if version == 3:
        name, rows, threads = "paged_prefill_v3", build.PREFILL_V3_ROWS, build.PREFILL_V3_THREADS
        smem = build.prefill_v3_shared_bytes(shape.head_dim)
    elif version == 2:
        name, rows, threads = "paged_prefill_v2", PREFILL_MMA_ROWS, NUM_THREADS
        smem = prefill_mma_shared_bytes(shape.head_dim)
    else:
        name, rows, threads = "paged_prefill", PREFILL_ROWS, NUM_THREADS
        smem = 4 * (PREFILL_ROWS * shape.head_dim + 32 * (shape.head_dim + 4))
    if max_query_len > _MAX_GRID_YZ * rows:
        raise ValueError(f"max_query_len = {max_query_len} is above the {_MAX_GRID_YZ * rows} one launch covers")
    q_tiles = -(-max_query_len // rows)
    grid, extra = (shape.num_seqs, shape.num_heads, q_tiles), ()
    if version == 3:  # v3 also takes num_seqs and q_tiles (its persistent grid numbers the work items with them)
        schedule = schedule or prefill_v3_schedule(max_context_len)
        extra = (np.int32(shape.num_seqs), np.int32(q_tiles))
        if schedule.tma:
            extra += (_pool_map(k_cache), _pool_map(v_cache))
        if schedule.persistent:
            grid = (min(shape.num_seqs * shape.num_heads * q_tiles, _num_sms(q.device)), 1, 1)
    config = build.prefill_config(_dtype_name(q), shape.head_dim, shape.block_size, version,
                                  schedule=schedule or build.PrefillV3Schedule())
    _launch(config, name, q.device, grid,
            (_ptr(out), _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(context_lens),
             _ptr(query_start_loc), np.int32(shape.max_blocks), np.int32(shape.num_heads),
             np.int32(shape.num_kv_heads), np.float32(scale), *extra), shared_mem=smem, threads=threads)
    return out


def _pool_map(cache: torch.Tensor) -> driver.TmaMap:
    """A KV pool [num_blocks, block_size, num_kv_heads, head_dim] as TMA sees it: [slots][num_kv_heads *
    head_dim], read in boxes of one block's rows by 64 dims (128 bytes: the 128-byte swizzle's row). The
    16-byte start TMA needs is validate's rule for every pool already."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    row = num_kv_heads * head_dim
    return driver.tensor_map(cache.data_ptr(), (row, num_blocks * block_size), (row * cache.element_size(),),
                             (64, block_size), _dtype_name(cache), driver.SWIZZLE_128B)


PREFILL_V3_PERSISTENT_MAX_CONTEXT = 2048  # prefill_v3_schedule: the persistent grid up to this context


def prefill_v3_schedule(max_context_len: int) -> build.PrefillV3Schedule:
    """Prefill v3's schedule for a launch whose longest context is `max_context_len`. Every choice gathers
    whole key tiles by TMA (H200, bf16, 32 / 8 heads, head_dim 128, same pool as FlashInfer, 2026-12-03, us
    at 16 x 512 / 4 x 2048 / 1 x 8192 / chunk 2048 @ 8192: cp.async rows 142 / 341 / 1088 / 480, TMA boxes
    141 / 316 / 968 / 415, FlashInfer 136 / 306 / 995 / 450). Then the persistent grid (141 / 316 / 1017 /
    446) against the plain one (168 / 325 / 968 / 415): work items of at most 16 key tiles gain from a CTA
    that loads the next item's Q and first tile under its last ones; long items lose. Both take the same
    epilogue (rcp_epilogue), so the choice never changes a bit: a row's result depends only on its position
    and the key-tile grid, whatever else the batch holds (a GPU test crosses the threshold)."""
    if max_context_len <= PREFILL_V3_PERSISTENT_MAX_CONTEXT:
        return build.PrefillV3Schedule(persistent=True, rcp_epilogue=True, tma=True)
    return build.PrefillV3Schedule(rcp_epilogue=True, tma=True)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _prefill_version(version: int, elem_size: int, head_dim: int, capability: tuple[int, int] | None = None) -> int:
    """The prefill kernel to run: v3 -> v2 where wgmma does not apply (dtype, head_dim, or a device
    other than sm_90: `capability`, None for none known), v2 -> v1 where the tensor-core kernel does not."""
    if version not in PREFILL_VERSIONS:
        raise ValueError(f"prefill version must be 1, 2 or 3, got {version}")
    if version == 3 and build.prefill_v3_supported(elem_size, head_dim, capability):
        return 3
    return 2 if version >= 2 and mma_supported(elem_size, head_dim) else 1


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, *, check: bool = True) -> None:
    """Write new K/V rows [num_tokens, num_kv_heads, head_dim] into their slots of the pool."""
    validate.check_cache_write(key, value, k_cache, v_cache, slot_mapping, check_slots=check)
    validate.require_cuda(k_cache, "k_cache")
    if key.shape[0] == 0:
        return
    row_words = key[0].numel() * key.element_size() // 16
    _launch(build.CACHE_OPS, "reshape_and_cache", k_cache.device, (key.shape[0],),
            (_ptr(key), _ptr(value), _ptr(k_cache), _ptr(v_cache), _ptr(slot_mapping), np.int32(row_words)))


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor, *,
                check: bool = True) -> None:
    """Copy-on-write: in every layer's pool, block dst[i] becomes a copy of block src[i]."""
    validate.check_block_copies(kv_caches, src, dst, check_ids=check)
    device = kv_caches[0][0].device
    validate.require_cuda(kv_caches[0][0], "kv_caches")
    if src.shape[0] == 0:
        return
    if src.shape[0] > _MAX_GRID_YZ:
        raise ValueError(f"{src.shape[0]} block copies in one call; at most {_MAX_GRID_YZ} are supported")
    k0 = kv_caches[0][0]
    block_words = k0[0].numel() * k0.element_size() // 16
    key_ptrs = torch.tensor([k.data_ptr() for k, _ in kv_caches], dtype=torch.int64).to(device)
    value_ptrs = torch.tensor([v.data_ptr() for _, v in kv_caches], dtype=torch.int64).to(device)
    mapping = torch.stack([src, dst], dim=1).contiguous()  # [num_pairs, 2]
    _launch(build.CACHE_OPS, "copy_blocks", device, (len(kv_caches), src.shape[0]),
            (_ptr(key_ptrs), _ptr(value_ptrs), _ptr(mapping), np.int32(block_words)))
