"""The `cuda` attention backend: the stage 5 kernels behind the backend interface.

One idea: one attention layer of one step is two launches: reshape_and_cache writes the step's new
K/V into their slots, then the decode kernel (every sequence brings one token) or the prefill kernel
(any mix of prompt chunks and decodes) reads each sequence's context through its block table. Given
the model's RoPE tables (`rope=`, `fuses_rope`), the first launch also rotates q and k on the way
(`kernels.fused.rotary_embedding_and_cache`, vLLM's rotary_embedding + reshape_and_cache in one).

Invariant: the value checks that need a host sync (block ids, context lengths, slots) run once per
step's metadata and pool size, not once per layer: every layer of a step shares one
`AttentionMetadata`, and the shapes, dtypes and devices, which cost nothing to check, are checked
on every call.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from pagedref import kernels
from pagedref.backends.metadata import AttentionMetadata
from pagedref.kernels import fused, validate


class CudaBackend:
    name = "cuda"
    fuses_rope = True  # forward takes rope=RotaryTables and rotates the unrotated q and k itself

    def __init__(self) -> None:
        self._checked: tuple[int, int] | None = None  # (id of the metadata, num_blocks) last checked
        self._checked_meta: AttentionMetadata | None = None  # held so its id is not reused
        self._unchecked = False  # inside `unchecked()`: a CUDA-graph capture

    @contextmanager
    def unchecked(self) -> Iterator[None]:
        """No value checks inside (they copy indices to the host, which a CUDA-graph capture cannot do):
        the caller checks every replayed step's metadata with `check_step` instead."""
        self._unchecked = True
        try:
            yield
        finally:
            self._unchecked = False

    def check_step(self, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The value checks `forward` makes once per step (block ids, context lengths, slots), for a step
        replayed from a CUDA graph, where no Python attention call is left to make them."""
        k_cache = kv_cache[0]
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        # check_ranges reads the pool's and the block tables' sizes only; no q here, so num_heads stands in as num_kv_heads
        shape = validate.AttentionShape(meta.num_seqs, num_kv_heads, num_kv_heads, head_dim, num_blocks, block_size,
                                        meta.block_tables.shape[1], k_cache.dtype)
        validate.check_ranges(shape, meta.block_tables, meta.context_lens, meta.max_context_len)
        validate.check_slot_values(meta.slot_mapping, num_blocks * block_size)

    def _needs_check(self, meta: AttentionMetadata, num_blocks: int) -> bool:
        key = (id(meta), num_blocks)
        if self._checked == key and self._checked_meta is meta:
            return False
        self._checked, self._checked_meta = key, meta
        return True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float, *,
                rope: fused.RotaryTables | None = None) -> torch.Tensor:
        """q [T, H, d], k/v [T, Hkv, d] (this step's tokens) -> [T, H, d]; writes k/v into kv_cache first.

        With rope, q and k come unrotated and may be strided views into one merged qkv row (the model's
        merged projection): k is rotated on its way into the pool (k itself is left unrotated), and q into
        the contiguous queries attention reads (in place when q is contiguous)."""
        k_cache, v_cache = kv_cache
        if meta.block_size != k_cache.shape[1]:
            raise ValueError(f"meta.block_size = {meta.block_size} but the pool's block_size is {k_cache.shape[1]}")
        check = not self._unchecked and self._needs_check(meta, k_cache.shape[0])
        if check and meta.is_decode_only and meta.num_tokens != meta.num_seqs:
            raise ValueError(f"max_query_len = 1 but {meta.num_tokens} tokens for {meta.num_seqs} sequences")
        if rope is None:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, check=check)
        else:
            # the pool's shape rules (block size, head_dim) as reshape_and_cache checks them; the layouts (token
            # strides allowed), slots (-1: padding, skipped) and positions are the fused kernel's own checks
            validate.check_cache(k_cache, v_cache)
            if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and (
                    k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]):
                raise ValueError(f"key {tuple(k.shape)} and value {tuple(v.shape)} must both be "
                                 f"[num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] to match k_cache")
            out = None if q.is_contiguous() else torch.empty(q.shape, dtype=q.dtype, device=q.device)
            q = fused.rotary_embedding_and_cache(q, k, v, k_cache, v_cache, meta.slot_mapping, rope, check=check,
                                                 out=out)
        if meta.is_decode_only:
            return kernels.paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                                  max_context_len=meta.max_context_len, check=check)
        return kernels.paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                     meta.query_start_loc, scale, max_query_len=meta.max_query_len,
                                     max_context_len=meta.max_context_len, check=check)

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor,
                    dst: torch.Tensor) -> None:
        """Copy-on-write: block dst[i] becomes a copy of block src[i] in every layer."""
        device = kv_caches[0][0].device if kv_caches else src.device
        kernels.copy_blocks(kv_caches, src.to(device, torch.int64).contiguous(), dst.to(device, torch.int64).contiguous())
