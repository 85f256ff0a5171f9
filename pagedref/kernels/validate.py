"""Argument checks for the kernels: every mistake is caught in Python, with the argument named.

One idea: a CUDA kernel handed a wrong shape, dtype or block id does not fail, it reads or writes
someone else's memory. So every launcher checks its arguments first; a bad one raises TypeError or
ValueError saying which argument and what was expected.

Invariant: after `check_attention_args` and `check_ranges` pass, every address the attention
kernels form lies inside the tensors they were given: each block id a sequence uses is a physical
block of the pool, each context fits its block-table row, and the launch grid covers every
sequence. The checks work on CPU tensors too (only `require_cuda` insists on a GPU), so they are
tested without one. `check_ranges` copies the small index tensors to the host: one sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedref.kernels.splitk import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class AttentionShape:
    """The sizes one attention launch is compiled and gridded for."""

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    max_blocks: int  # columns of block_tables
    dtype: torch.dtype


def check_tensor(t, name: str, layout: str, ndim: int, dtypes: tuple, device: torch.device | None = None,
                 aligned: bool = True) -> None:
    """Type, rank, dtype, device, contiguity and (aligned) a 16-byte start of one argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other arguments are on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")
    if aligned and t.numel() and t.data_ptr() % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary (the kernels load 16 bytes at a time)")


def require_cuda(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor for the CUDA kernels, got device {t.device}")


def check_cache(k_cache, v_cache, dtype=None, device=None) -> None:
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_tensor(k_cache, "k_cache", layout, 4, (dtype,) if dtype else FLOAT_DTYPES, device)
    check_tensor(v_cache, "v_cache", layout, 4, (k_cache.dtype,), k_cache.device)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.shape[1] not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size (k_cache.shape[1]) must be one of {SUPPORTED_BLOCK_SIZES}, got {k_cache.shape[1]}")
    if k_cache.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim (k_cache.shape[3]) must be one of {SUPPORTED_HEAD_DIMS}, got {k_cache.shape[3]}")


def check_attention_args(q, k_cache, v_cache, block_tables, context_lens) -> AttentionShape:
    """Shapes, dtypes, devices and contiguity of an attention launch (no sync)."""
    check_tensor(q, "q", "[num_tokens, num_heads, head_dim]", 3, FLOAT_DTYPES)
    check_cache(k_cache, v_cache, q.dtype, q.device)
    check_tensor(context_lens, "context_lens", "[num_seqs]", 1, (torch.int32,), q.device)
    check_tensor(block_tables, "block_tables", "[num_seqs, max_blocks_per_seq]", 2, (torch.int32,), q.device)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != k_cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q num_heads {num_heads} must be a multiple of k_cache num_kv_heads {num_kv_heads}")
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but context_lens has {context_lens.shape[0]} sequences")
    return AttentionShape(context_lens.shape[0], num_heads, num_kv_heads, head_dim, num_blocks, block_size,
                          block_tables.shape[1], q.dtype)


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


def check_ranges(shape: AttentionShape, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 max_context_len: int, query_start_loc: torch.Tensor | None = None,
                 num_tokens: int | None = None, max_query_len: int | None = None) -> None:
    """Every value the kernels index with: context lengths, used block ids, query offsets (one sync)."""
    cl = _host(context_lens).astype(np.int64)
    bt = _host(block_tables)
    bs = shape.block_size
    for s in np.flatnonzero(cl < 1)[:1]:
        raise ValueError(f"context_lens[{s}] = {cl[s]}: every sequence needs at least one token")
    for s in np.flatnonzero(cl > shape.max_blocks * bs)[:1]:
        raise ValueError(f"context_lens[{s}] = {cl[s]} needs {-(-cl[s] // bs)} blocks but block_tables "
                         f"has only {shape.max_blocks} columns")
    if len(cl) and max_context_len < cl.max():
        s = int(cl.argmax())
        raise ValueError(f"max_context_len = {max_context_len} is smaller than context_lens[{s}] = {cl[s]}")
    used = np.arange(shape.max_blocks)[None, :] < (-(-cl // bs))[:, None]  # [S, max_blocks]
    bad = used & ((bt < 0) | (bt >= shape.num_blocks))
    if bad.any():
        s, i = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"block_tables[{s}, {i}] = {bt[s, i]} is not a physical block of k_cache "
                         f"(num_blocks = {shape.num_blocks}); sequence {s} uses its first {-(-cl[s] // bs)} entries")
    if query_start_loc is None:
        return
    qsl = _host(query_start_loc).astype(np.int64)
    if qsl.shape != (shape.num_seqs + 1,) or qsl[0] != 0 or qsl[-1] != num_tokens:
        raise ValueError(f"query_start_loc must be [num_seqs + 1] = [{shape.num_seqs + 1}] running from 0 to "
                         f"num_tokens = {num_tokens}, got {qsl.tolist()[:8]}{'...' if len(qsl) > 8 else ''}")
    qlen = np.diff(qsl)
    for s in np.flatnonzero(qlen < 1)[:1]:
        raise ValueError(f"query_start_loc gives sequence {s} {qlen[s]} query rows: each needs at least one")
    for s in np.flatnonzero(qlen > cl)[:1]:
        raise ValueError(f"sequence {s} has {qlen[s]} query rows but context_lens[{s}] = {cl[s]}: "
                         f"the new tokens are part of the context")
    if max_query_len is not None and max_query_len < qlen.max():
        s = int(qlen.argmax())
        raise ValueError(f"max_query_len = {max_query_len} is smaller than sequence {s}'s {qlen[s]} query rows")


def check_query_start_loc(query_start_loc, num_seqs: int, device) -> None:
    check_tensor(query_start_loc, "query_start_loc", "[num_seqs + 1]", 1, (torch.int32,), device)
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, got {query_start_loc.shape[0]}")


def check_out(out, like: torch.Tensor) -> None:
    check_tensor(out, "out", "shaped like q", like.dim(), (like.dtype,), like.device)
    if out.shape != like.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != q shape {tuple(like.shape)}")


def check_cache_write(key, value, k_cache, v_cache, slot_mapping, check_slots: bool = True) -> None:
    """reshape_and_cache: new rows match the pool, and every slot is a distinct slot of the pool."""
    check_cache(k_cache, v_cache)
    layout = "[num_tokens, num_kv_heads, head_dim]"
    check_tensor(key, "key", layout, 3, (k_cache.dtype,), k_cache.device)
    check_tensor(value, "value", layout, 3, (k_cache.dtype,), k_cache.device)
    check_tensor(slot_mapping, "slot_mapping", "[num_tokens]", 1, (torch.int64,), k_cache.device)
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
                         f"[num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] to match k_cache")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    if check_slots:
        check_slot_values(slot_mapping, k_cache.shape[0] * k_cache.shape[1])


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot is a slot of the pool, and none is written twice in one step (one sync)."""
    slots = _host(slot_mapping)
    for t in np.flatnonzero((slots < 0) | (slots >= num_slots))[:1]:
        raise ValueError(f"slot_mapping[{t}] = {slots[t]} is outside the pool's {num_slots} slots")
    uniq, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"slot_mapping writes slot {uniq[counts > 1][0]} twice in one step")


def check_block_copies(kv_caches, src, dst, check_ids: bool = True) -> None:
    """copy_blocks: same-shaped pools in every layer, distinct in-range dst blocks, none also a src."""
    if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
        raise ValueError("kv_caches must be a non-empty list of (k_cache, v_cache) pairs, one per layer")
    k0 = kv_caches[0][0]
    for layer, pair in enumerate(kv_caches):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"kv_caches[{layer}] must be a (k_cache, v_cache) pair")
        check_cache(*pair, dtype=k0.dtype if layer else None, device=k0.device if layer else None)
        if pair[0].shape != k0.shape:
            raise ValueError(f"kv_caches[{layer}] pool shape {tuple(pair[0].shape)} != layer 0's {tuple(k0.shape)}")
    for name, t in (("src", src), ("dst", dst)):
        check_tensor(t, name, "[num_copies] block ids", 1, (torch.int64,), k0.device)
    if src.shape != dst.shape:
        raise ValueError(f"src has {src.shape[0]} blocks but dst has {dst.shape[0]}")
    if not check_ids:
        return
    s, d = _host(src), _host(dst)
    for name, ids in (("src", s), ("dst", d)):
        for i in np.flatnonzero((ids < 0) | (ids >= k0.shape[0]))[:1]:
            raise ValueError(f"{name}[{i}] = {ids[i]} is not a physical block (num_blocks = {k0.shape[0]})")
    if len(np.unique(d)) != len(d):
        raise ValueError("dst repeats a block: two copies would write it in one launch")
    both = np.intersect1d(s, d)
    if len(both):
        raise ValueError(f"block {both[0]} is both a src and a dst: a copy would read what another writes")
