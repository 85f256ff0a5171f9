"""Stage 3 — the block table: a sequence's logical blocks mapped to physical ones, grown on demand.

One idea: a sequence sees its KV cache as consecutive logical blocks 0, 1, 2, ...; the block table
says where each one really is in the pool. Token at position p lives in logical block p // block_size,
offset p % block_size, so its physical *slot* is block_ids[p // block_size] * block_size + offset.
A new block is taken only when the last one is full: at most block_size - 1 slots are ever wasted.

This module is the one place the slot formula lives: `slot_range` (and `BlockTable.slot`); the block
manager hands the slots it returns to the scheduler, which passes them to the model runner.

The table can shrink too (`truncate`): speculative decoding (stage 8) gives back the slots of the draft
tokens the target rejected, and whole blocks past the new end return to the pool.

Invariant: len(block_ids) == ceil(num_tokens / block_size); reading the pool through the block table
gives back exactly the K/V that were written, in logical order, whatever the physical placement —
so paged attention equals the oracle bit for bit (it gathers the same rows and calls it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pagedref.attention import attention
from pagedref.memory.block_allocator import BlockAllocator, InvalidBlockError, NoFreeBlocksError


class MaxModelLenError(ValueError):
    """A sequence would grow past max_model_len."""


class FreedSequenceError(ValueError):
    """An operation on a block table whose blocks were already freed."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slot_range(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The slots of positions start..end-1 (block_ids[p // block_size] * block_size + p % block_size),
    one range per block touched: a chunk of 256 tokens is 16 ranges, not 256 divisions."""
    if end - start == 1:  # a decode, most calls of most steps: one slot, no range to build
        return [block_ids[start // block_size] * block_size + start % block_size]
    slots: list[int] = []
    for b in range(start // block_size, cdiv(end, block_size)):
        base = block_ids[b] * block_size - b * block_size  # slot of position p in block b = base + p
        slots.extend(range(base + max(start, b * block_size), base + min(end, (b + 1) * block_size)))
    return slots


@dataclass
class BlockTable:
    """One sequence's logical → physical block mapping.

    Errors: append_slots raises ValueError for a negative count, MaxModelLenError past max_model_len,
    stage 2's NoFreeBlocksError when the pool cannot supply its blocks, and FreedSequenceError after
    free(); each leaves the table and the pool unchanged. truncate raises ValueError for a count
    outside 0..num_tokens. free() twice raises FreedSequenceError.
    """

    allocator: BlockAllocator
    max_model_len: int | None = None
    block_ids: list[int] = field(default_factory=list)  # block_ids[logical] = physical
    num_tokens: int = 0  # tokens that have a slot
    freed: bool = False

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def num_new_blocks(self, num_new_tokens: int) -> int:
        """Blocks that appending num_new_tokens would take from the pool."""
        return max(0, cdiv(self.num_tokens + num_new_tokens, self.allocator.block_size) - len(self.block_ids))

    def slot(self, pos: int) -> int:
        """Physical slot of the token at logical position pos. Raises IndexError for a pos outside
        0..num_tokens-1 (a negative pos does not count from the end)."""
        if not 0 <= pos < self.num_tokens:
            raise IndexError(f"position {pos} is outside the sequence's {self.num_tokens} tokens")
        return self.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def append_slots(self, num_new_tokens: int) -> list[int]:
        """Give slots to the next num_new_tokens tokens (a prefill chunk, or 1 for a decode).

        Takes new blocks only when the last one fills up. All or nothing: if the pool cannot supply
        the blocks, NoFreeBlocksError is raised and the table is unchanged. Returns the slot mapping.
        """
        if self.freed:
            raise FreedSequenceError("cannot append to a sequence whose blocks were freed")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if self.max_model_len is not None and self.num_tokens + num_new_tokens > self.max_model_len:
            raise MaxModelLenError(
                f"appending {num_new_tokens} tokens to {self.num_tokens} would exceed max_model_len={self.max_model_len}"
            )
        room = len(self.block_ids) * self.allocator.block_size - self.num_tokens  # free slots in the last block
        need = self.num_new_blocks(num_new_tokens) if num_new_tokens > room else 0
        if need:  # (most decode steps fit in the last block: no block, no pool, no generator)
            if need > self.allocator.num_free:
                raise NoFreeBlocksError(f"need {need} more blocks, only {self.allocator.num_free} free")
            self.block_ids.extend(self.allocator.allocate() for _ in range(need))
        start = self.num_tokens
        self.num_tokens += num_new_tokens
        return slot_range(self.block_ids, start, self.num_tokens, self.allocator.block_size) if num_new_tokens else []

    def truncate(self, num_tokens: int) -> list[int]:
        """Shrink to the first num_tokens tokens (the inverse of append_slots: speculative decoding gives back
        the slots of rejected tokens). Whole blocks past the new end return to the allocator (one reference
        each, last first); a partly kept last block stays. Returns the blocks given back.

        Raises ValueError for a num_tokens outside 0..self.num_tokens and FreedSequenceError after free();
        each leaves the table and the pool unchanged."""
        if self.freed:
            raise FreedSequenceError("cannot truncate a sequence whose blocks were freed")
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}: give 0..{self.num_tokens}")
        keep = cdiv(num_tokens, self.allocator.block_size)
        dropped = self.block_ids[keep:]
        for block_id in reversed(dropped):
            self.allocator.free(block_id)
        del self.block_ids[keep:]
        self.num_tokens = num_tokens
        return dropped

    def free(self) -> None:
        """Return every block (one reference each). Last blocks first: under prefix caching the free
        list is LRU, so a sequence's tail — the part least likely to be shared — is evicted first."""
        if self.freed:
            raise FreedSequenceError("block table freed twice")
        for block_id in reversed(self.block_ids):
            self.allocator.free(block_id)
        self.block_ids = []
        self.freed = True


class PagedKVCache:
    """The K/V pools of one layer, read and written through block tables (numpy, the CPU oracle)."""

    k: np.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim], `fill` (NaN) where nothing was written
    v: np.ndarray  # the same, for V

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=np.float32, fill: float = np.nan) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Unused slots hold NaN: a read of a slot nobody wrote poisons the result instead of hiding.
        self.k = np.full(shape, fill, dtype=dtype)  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.v = np.full(shape, fill, dtype=dtype)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def write(self, slot_mapping: Sequence[int], k: np.ndarray, v: np.ndarray) -> None:
        """Scatter new tokens' K/V [n, num_kv_heads, head_dim] into their slots (slot s is row s of the
        pool flattened to [num_blocks * block_size, ...]). Raises stage 2's InvalidBlockError for a slot
        outside the pool, negative ones included, before writing anything."""
        slots = np.asarray(slot_mapping, dtype=np.int64)
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_blocks * self.block_size):
            raise InvalidBlockError(f"slot mapping points outside the pool of {self.num_blocks * self.block_size} slots")
        self.k.reshape(-1, *self.k.shape[2:])[slots] = k
        self.v.reshape(-1, *self.v.shape[2:])[slots] = v

    def gather(self, block_ids: Sequence[int], context_len: int) -> tuple[np.ndarray, np.ndarray]:
        """The first context_len tokens' K/V in logical order: [context_len, num_kv_heads, head_dim].
        Raises stage 2's InvalidBlockError for a block id outside the pool (negative ones included),
        and ValueError when the blocks given cannot hold context_len tokens."""
        ids = np.asarray(block_ids[: cdiv(context_len, self.block_size)], dtype=np.int64)
        if len(ids) * self.block_size < context_len:
            raise ValueError(f"{len(ids)} blocks of {self.block_size} cannot hold {context_len} tokens")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = int(ids[(ids < 0) | (ids >= self.num_blocks)][0])
            raise InvalidBlockError(f"block table points at block {bad}, outside the pool of {self.num_blocks} blocks")
        k = self.k[ids].reshape(-1, *self.k.shape[2:])[:context_len]
        v = self.v[ids].reshape(-1, *self.v.shape[2:])[:context_len]
        return k, v


def paged_attention(q: np.ndarray, cache: PagedKVCache, block_ids: Sequence[int], context_len: int,
                    scale: float | None = None) -> np.ndarray:
    """Attention of a sequence's newest q tokens [num_q, num_heads, head_dim] over its context, read
    through its block table. Bit-identical to `attention` on the same K/V stored contiguously."""
    k, v = cache.gather(block_ids, context_len)
    return attention(q, k, v, scale=scale)
