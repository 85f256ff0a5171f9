"""The reference attention backend: paged attention on the CPU, bit-identical to the numpy oracle.

One idea: write the step's new K/V into their slots, then gather each sequence's context through its
block table and hand its query rows to the oracle itself (`pagedref.attention.attention`, which
attends each row over exactly the keys it may see).

Invariant: each output row equals `pagedref.attention.attention` on the same sequence's contiguous
K/V, bit for bit, whatever the other sequences in the step, the chunking of the prompt, or where the
blocks lie in the pool (slots no block table points at are never read, so they may hold anything).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedref.attention import attention
from pagedref.backends.metadata import AttentionMetadata
from pagedref.memory.block_table import cdiv


class ReferenceBackend:
    name = "reference"

    def forward(
        self,
        q: torch.Tensor,  # [T, H, d]
        k: torch.Tensor,  # [T, Hkv, d]: the step's new keys, written to meta.slot_mapping first
        v: torch.Tensor,  # [T, Hkv, d]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, Hkv, d]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, d], q's dtype and device
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_blocks, block_size = k_cache.shape[:2]
        if block_size != meta.block_size:
            raise ValueError(f"KV cache block_size {block_size} != metadata block_size {meta.block_size}")
        q_np = _numpy(q)
        out = np.empty(q_np.shape, dtype=q_np.dtype)  # like the oracle: rows cast to q's dtype on assignment
        starts = meta.query_start_loc.tolist()
        context_lens = meta.context_lens.tolist()
        block_tables = meta.block_tables.cpu()
        for s, ctx_len in enumerate(context_lens):
            start, end = starts[s], starts[s + 1]
            table = block_table_of(block_tables, s, ctx_len, block_size, num_blocks)
            # The sequence's context, in logical order: [ctx_len, Hkv, d]; its query rows are the last ones.
            # index_select, not k_cache[table]: that advanced indexing took ~16 ms against ~3 µs on a busy
            # 2-core CPU (its intra-op threads wait on each other when other processes hold the cores).
            table = table.to(k_cache.device)
            k_seq = _numpy(k_cache.index_select(0, table).flatten(0, 1)[:ctx_len])
            v_seq = _numpy(v_cache.index_select(0, table).flatten(0, 1)[:ctx_len])
            out[start:end] = attention(q_np[start:end], k_seq, v_seq, scale=scale)
        return torch.from_numpy(out).to(device=q.device, dtype=q.dtype)

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole physical blocks src[i] -> dst[i] in every layer's K and V pools (copy-on-write)."""
        if src.shape != dst.shape or src.dim() != 1:
            raise ValueError(f"src and dst must be 1-D and of equal length, got {tuple(src.shape)} and {tuple(dst.shape)}")
        for k_cache, v_cache in kv_caches:
            num_blocks = k_cache.shape[0]
            for ids, what in ((src, "source"), (dst, "destination")):
                bad = ids[(ids < 0) | (ids >= num_blocks)]
                if bad.numel():
                    raise ValueError(f"copy_blocks {what} block {int(bad[0])} is outside the pool of {num_blocks} blocks")
            s, d = src.to(k_cache.device, torch.int64), dst.to(k_cache.device, torch.int64)
            k_cache.index_copy_(0, d, k_cache.index_select(0, s))  # the gather copies first: src and dst may overlap
            v_cache.index_copy_(0, d, v_cache.index_select(0, s))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, d] -> slot_mapping[t] of the pools [num_blocks, block_size, Hkv, d] (slot = block * block_size + offset)."""
    if k_cache.dtype != k.dtype:
        raise ValueError(f"KV cache dtype {k_cache.dtype} != the model's key dtype {k.dtype}")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel() != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} slots for {k.shape[0]} new tokens")
    bad = slot_mapping[(slot_mapping < 0) | (slot_mapping >= num_slots)]
    if bad.numel():
        raise ValueError(f"slot {int(bad[0])} is outside the pool of {num_slots} slots")
    slots = slot_mapping.to(k_cache.device, torch.int64)
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slots, k)  # the flat view shares the pool's storage
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slots, v)


def block_table_of(block_tables: torch.Tensor, s: int, ctx_len: int, block_size: int, num_blocks: int) -> torch.Tensor:
    """The physical blocks holding sequence s's first ctx_len tokens, checked to lie in the pool."""
    needed = cdiv(ctx_len, block_size)
    if needed > block_tables.shape[1]:
        raise ValueError(f"sequence {s} has {ctx_len} tokens ({needed} blocks) but its block table has {block_tables.shape[1]} entries")
    table = block_tables[s, :needed].to(torch.int64)  # on the CPU: block_tables was moved there once
    bad = table[(table < 0) | (table >= num_blocks)]
    if bad.numel():
        raise ValueError(f"block table of sequence {s} points at block {int(bad[0])} outside the pool of {num_blocks} blocks")
    return table


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU numpy view (or copy) of t; bfloat16, which numpy lacks, becomes float32 (exactly)."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
