"""Stage 4 — sharing KV blocks: copy-on-write forks and prefix caching.

One idea: a block that several sequences need is stored once and counted by reference.
- **Fork + copy-on-write** (vLLM v0, the paper's mechanism): parallel samples and beams of one
  prompt start as forks that share *all* blocks. Full blocks never change, so they stay shared for
  good; the first append into a shared, partly filled last block copies it first.
- **Prefix caching** (vLLM v1): only *full* blocks are shared, found by a chained hash of
  (parent block's hash, this block's token ids), so equal prefixes of different requests map to the
  same blocks with no fork needed. A freed block keeps its hash and stays reusable on the free list, in
  LRU order, until the allocator hands it out again (and only then is it evicted from the cache).
  v1 moved to this design because it shares across requests and needs no copying: the only mutable
  block (the partial last one) is never shared.

A sequence can also shrink (`truncate`, speculative decoding's rollback of rejected draft tokens):
whole blocks past its new end lose its reference, and a kept partial block leaves the cache before
its tail can be overwritten.

A sequence's newest token may be appended before it is known (`None`: async scheduling appends the
slot of a token its step is still sampling); a block holding an unknown token is registered in the
prefix cache once `set_token` names it.

Invariants: every block's ref count == the number of block-table references to it; a block is free
exactly when its count is 0; a hash entry always points at a block holding exactly the hashed tokens;
when every sequence is freed, every block is free (nothing leaks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pagedref.memory.block_allocator import BlockAllocator, NoFreeBlocksError
from pagedref.memory.block_table import BlockTable, FreedSequenceError, MaxModelLenError, cdiv


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained block hash: equal hashes mean equal *prefixes*, not just equal blocks."""
    return hash((parent_hash, tuple(token_ids)))


class PrefixCachingAllocator(BlockAllocator):
    """A block allocator whose full blocks can be found again by hash, even after they are freed.

    A cached block is findable whether it is held or free; it leaves the cache (all three maps) the
    moment allocate() hands it out for new contents, and only then.
    """

    cached: dict[int, int]  # block hash -> the physical block holding it (one block per hash)
    block_hash: dict[int, int]  # physical block -> its hash, while cached (cached[block_hash[b]] == b)
    block_tokens: dict[int, tuple[int, ...]]  # physical block -> the tokens it holds, while cached

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(num_blocks, block_size)
        self.cached: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}
        self.block_tokens: dict[int, tuple[int, ...]] = {}

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash, free or held."""
        return len(self.cached)

    def allocate(self) -> int:
        """Stage 2's allocate (the block free the longest), evicting the block from the cache."""
        block_id = super().allocate()
        self._evict(block_id)  # handed out again: its old contents are about to be overwritten
        return block_id

    def _evict(self, block_id: int) -> None:
        h = self.block_hash.pop(block_id, None)
        if h is not None:
            del self.cached[h]
            del self.block_tokens[block_id]

    def register(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> None:
        """A block just became full: make it findable. The first block with a hash keeps the entry: a
        later block with the same hash (the same prefix computed twice) stays unregistered, and a block
        already cached keeps its first hash."""
        if block_hash not in self.cached and block_id not in self.block_hash:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash
            self.block_tokens[block_id] = tuple(token_ids)

    def acquire(self, block_id: int) -> None:
        """Hold a cached block found by hash: off the free list if nobody held it, else share it."""
        if self.is_free(block_id):
            self.take(block_id)
        else:
            self.incref(block_id)


@dataclass
class PrefixHit:
    """A new sequence's cached prefix, found by `KVCacheManager.lookup`: valid until the pool's next
    allocation (which may evict one of its blocks), so one admission looks its prompt up once."""

    blocks: list[int]  # physical blocks of its first full blocks, in order
    hashes: list[int]  # their chained hashes
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


@dataclass
class SequenceBlocks:
    """One sequence's blocks and the tokens whose slots they hold."""

    table: BlockTable
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hash of each full block, in order


class KVCacheManager:
    """Block tables for many sequences over one pool, with forks (copy-on-write) and prefix caching.

    Errors: a block_size below 1 raises ValueError naming it (the allocator's). A call about a sequence
    that is not live (never allocated, or freed) raises FreedSequenceError; growing a sequence past
    max_model_len raises MaxModelLenError, and a pool too small for a call, NoFreeBlocksError. Every
    refused call changes nothing: no block taken or copied, no cache entry, no query counted.
    """

    allocator: PrefixCachingAllocator  # the pool: ref counts, free list, prefix cache
    block_size: int
    max_model_len: int | None  # None: no limit
    enable_prefix_caching: bool  # False: lookups find nothing and no block is registered
    seqs: dict[int, SequenceBlocks]  # the live sequences: allocate and fork add one, free removes it
    prefix_queries: int  # full prompt blocks looked up by the allocates that succeeded (hit rate's denominator)
    prefix_hits: int  # ... and found in the cache

    def __init__(self, num_blocks: int, block_size: int = 16, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True) -> None:
        self.allocator = PrefixCachingAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.seqs: dict[int, SequenceBlocks] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    # --- queries --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """The allocator's free blocks (cached ones included: a cached, unused block is free)."""
        return self.allocator.num_free

    def _get(self, seq_id: int) -> SequenceBlocks:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise FreedSequenceError(f"sequence {seq_id} has no blocks (never allocated, or already freed)") from None

    def block_ids(self, seq_id: int) -> list[int]:
        """The sequence's block table: physical blocks in logical order."""
        return self._get(seq_id).table.block_ids

    def num_tokens(self, seq_id: int) -> int:
        """The sequence's tokens that have a slot."""
        return self._get(seq_id).table.num_tokens

    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """Cached blocks for the longest run of full prompt blocks, stopping before the last token:
        that token must still be computed, to get the logits that sample the first new token. Only
        whole blocks among the first len(token_ids) - 1 tokens count, so a prompt that fills its last
        block exactly recomputes that whole block."""
        hit, parent = PrefixHit([], [], self.block_size), None
        if not self.enable_prefix_caching:
            return hit
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs])
            block_id = self.allocator.cached.get(parent)
            if block_id is None:
                break
            hit.blocks.append(block_id)
            hit.hashes.append(parent)
        return hit

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of a new prompt's tokens are already in the cache (a multiple of block_size)."""
        return self.lookup(token_ids).num_tokens

    def can_allocate(self, token_ids: Sequence[int], num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Would allocate(seq, token_ids, num_new_tokens) succeed now? Counts the blocks for the new
        tokens (capped, as allocate caps them) and the cached hits on the free list (taking one uses a
        free block). hit: its lookup, if made already."""
        hits = (hit or self.lookup(token_ids)).blocks
        num_new_tokens = min(num_new_tokens, len(token_ids) - len(hits) * self.block_size)
        need = cdiv(len(hits) * self.block_size + num_new_tokens, self.block_size) - len(hits)
        free_hits = sum(1 for b in hits if self.allocator.is_free(b))  # taking these uses free blocks too
        return need + free_hits <= self.allocator.num_free

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Free blocks that appending num_new_tokens would use: the new blocks, plus 1 for a pending
        copy-on-write (num_new_tokens > 0 and the last block is partly filled and shared)."""
        sb = self._get(seq_id)
        return sb.table.num_new_blocks(num_new_tokens) + int(num_new_tokens > 0 and self._needs_copy(sb))

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        """Would append_slots with num_new_tokens tokens succeed now? (blocks_needed <= free blocks)"""
        return self.blocks_needed(seq_id, num_new_tokens) <= self.allocator.num_free

    # --- operations -----------------------------------------------------------------------------
    def allocate(self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int = 0,
                 hit: PrefixHit | None = None) -> tuple[int, list[int]]:
        """Admit a sequence: reuse its cached prefix blocks, then give slots to its next num_new_tokens
        prompt tokens, token_ids[num_cached_tokens : num_cached_tokens + num_new_tokens] (so the count is
        capped at the uncached rest of the prompt: pass len(token_ids) to prefill it all). All or
        nothing: ValueError for a live seq_id or a negative count, MaxModelLenError for a prompt longer
        than max_model_len, NoFreeBlocksError when the pool cannot supply the blocks (then no cached block
        is taken and no query is counted). Returns (num_cached_tokens, slot mapping of the new tokens).
        hit: the sequence's `lookup`, if made already since the pool's last allocation."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        self._check_len(len(token_ids), 0)  # before any block is taken: all or nothing
        hit = hit or self.lookup(token_ids)
        if not self.can_allocate(token_ids, num_new_tokens, hit):
            raise NoFreeBlocksError(f"not enough free blocks to admit sequence {seq_id}")
        hits = hit.blocks
        if self.enable_prefix_caching:
            self.prefix_queries += (len(token_ids) - 1) // self.block_size
            self.prefix_hits += len(hits)
        for block_id in hits:
            self.allocator.acquire(block_id)
        num_cached = len(hits) * self.block_size
        table = BlockTable(self.allocator, self.max_model_len, list(hits), num_cached)
        self.seqs[seq_id] = SequenceBlocks(table, list(token_ids[:num_cached]), list(hit.hashes))
        slots = self.append_slots(seq_id, token_ids[num_cached:num_cached + num_new_tokens])[0]
        return num_cached, slots

    def _check_len(self, num_tokens: int, num_new_tokens: int) -> None:
        if self.max_model_len is not None and num_tokens + num_new_tokens > self.max_model_len:
            raise MaxModelLenError(f"sequence would grow to {num_tokens + num_new_tokens} tokens, "
                                   f"past max_model_len={self.max_model_len}")

    def _needs_copy(self, sb: SequenceBlocks) -> bool:
        t = sb.table
        # (ref_counts read directly: the table's own block ids are valid, no need to check them per step)
        return t.num_tokens % self.block_size != 0 and self.allocator.ref_counts[t.block_ids[-1]] > 1

    def append_slots(self, seq_id: int, token_ids: Sequence[int | None]) -> tuple[list[int], list[tuple[int, int]]]:
        """Give slots to new tokens of a sequence. Returns (slot mapping, copies), where copies are the
        (src, dst) block pairs the KV cache must copy *before* this step writes: copy-on-write.
        A token may be None, not known yet (see `set_token`)."""
        sb = self._get(seq_id)
        table, n = sb.table, len(token_ids)
        copies = []
        if n and self._needs_copy(sb):  # the copy takes a block too: check everything before it (all or nothing)
            self._check_len(table.num_tokens, n)
            need = table.num_new_blocks(n) + 1  # blocks_needed(), without looking the sequence up again
            if need > self.allocator.num_free:
                raise NoFreeBlocksError(f"sequence {seq_id} needs {need} blocks, {self.allocator.num_free} free")
            src = table.block_ids[-1]
            dst = self.allocator.allocate()
            self.allocator.free(src)  # one holder fewer; the others keep the original
            table.block_ids[-1] = dst
            copies.append((src, dst))
        slots = table.append_slots(n)  # (all or nothing on its own: max_model_len, then the pool)
        sb.token_ids.extend(token_ids)
        self._register_full_blocks(sb)
        return slots, copies

    def set_token(self, seq_id: int, pos: int, token_id: int) -> None:
        """The token at pos, appended unknown (None), is known now: its block may become findable."""
        sb = self._get(seq_id)
        if sb.token_ids[pos] is not None:
            raise ValueError(f"sequence {seq_id}'s token at position {pos} is known already")
        sb.token_ids[pos] = token_id
        self._register_full_blocks(sb)

    def _register_full_blocks(self, sb: SequenceBlocks) -> None:
        bs = self.block_size
        while len(sb.block_hashes) < sb.table.num_tokens // bs:
            i = len(sb.block_hashes)
            parent = sb.block_hashes[-1] if sb.block_hashes else None
            tokens = sb.token_ids[i * bs:(i + 1) * bs]
            if tokens[-1] is None:  # its last token is still being sampled: registered by set_token
                break
            h = hash_block_tokens(parent, tokens)
            sb.block_hashes.append(h)
            if self.enable_prefix_caching:
                self.allocator.register(sb.table.block_ids[i], h, tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (parallel sampling, beam search): no block is
        taken. Raises ValueError if the child is live, FreedSequenceError if the parent is not."""
        if child_id in self.seqs:
            raise ValueError(f"cannot fork into sequence {child_id}: it already has blocks")
        try:
            parent = self._get(parent_id)
        except FreedSequenceError:
            raise FreedSequenceError(f"cannot fork sequence {parent_id}: it has no blocks (freed?)") from None
        for block_id in parent.table.block_ids:
            self.allocator.incref(block_id)
        table = BlockTable(self.allocator, self.max_model_len, list(parent.table.block_ids), parent.table.num_tokens)
        self.seqs[child_id] = SequenceBlocks(table, list(parent.token_ids), list(parent.block_hashes))

    def truncate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Keep only the sequence's first num_tokens tokens (speculative decoding rolls back the slots of
        rejected draft tokens): the references to whole blocks past the new end are dropped (a block another
        sequence shares stays held by it; a cached full block stays findable on the free list), and the
        hashes of blocks no longer full are forgotten. A kept, partly filled last block that was cached leaves
        the cache: once its other holders (if any) let go, this sequence writes its tail in place. (While it
        is shared, the next append copies it first, like any shared partial block.) Returns the blocks whose
        reference was dropped. ValueError for a count outside 0..num_tokens (nothing changes)."""
        sb = self._get(seq_id)
        table = sb.table
        if not 0 <= num_tokens <= table.num_tokens:  # before anything changes: all or nothing
            raise ValueError(f"cannot truncate sequence {seq_id}'s {table.num_tokens} tokens to {num_tokens}")
        dropped = table.truncate(num_tokens)
        del sb.token_ids[num_tokens:]
        del sb.block_hashes[num_tokens // self.block_size:]
        if num_tokens % self.block_size:
            last = table.block_ids[-1]
            if last in self.allocator.block_hash:
                self.allocator._evict(last)
        return dropped

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references and remove it from seqs; blocks nobody else holds return to
        the free list (cached full blocks stay findable there until reused). Freeing twice raises
        FreedSequenceError."""
        sb = self._get(seq_id)
        sb.table.free()
        del self.seqs[seq_id]

    # --- accounting -----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """The pool's counters and two rates, exactly these keys: num_blocks, num_free_blocks,
        num_used_blocks, num_shared_blocks (2+ holders), num_cached_blocks (findable by hash, held or
        free); token_state_fraction = the used blocks' slots holding a token of some sequence /
        (num_used_blocks * block_size), a shared block counted once (0.0 when nothing is used);
        prefix_cache_hit_rate = prefix_hits / prefix_queries (0.0 before any query), where each allocate
        that succeeds with prefix caching on queries the (len(token_ids) - 1) // block_size full blocks a
        lookup may use and hits those it finds."""
        filled: dict[int, int] = {}
        for sb in self.seqs.values():
            t = sb.table
            for i, block_id in enumerate(t.block_ids):
                n = min(self.block_size, t.num_tokens - i * self.block_size)
                filled[block_id] = max(filled.get(block_id, 0), n)
        used = self.allocator.num_used
        return {
            "num_blocks": self.allocator.num_total,
            "num_free_blocks": self.allocator.num_free,
            "num_used_blocks": used,
            "num_shared_blocks": self.allocator.num_shared,
            "num_cached_blocks": self.allocator.num_cached,
            "token_state_fraction": sum(filled.values()) / (used * self.block_size) if used else 0.0,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError, naming the broken invariant, if any is broken: each table holds
        ceil(num_tokens / block_size) blocks and its sequence len(token_ids) == num_tokens tokens; each
        block's ref count equals its block-table references; a block is on the free list exactly when
        its count is 0; free + used == total; cached and block_hash agree; a cached block a sequence
        holds carries that sequence's tokens. Returns None when all hold (tests call it)."""
        refs = [0] * self.allocator.num_total
        for sb in self.seqs.values():
            assert len(sb.table.block_ids) == cdiv(sb.table.num_tokens, self.block_size), \
                f"a table holds {len(sb.table.block_ids)} blocks for {sb.table.num_tokens} tokens"
            assert len(sb.token_ids) == sb.table.num_tokens, \
                f"a sequence knows {len(sb.token_ids)} tokens, its table {sb.table.num_tokens}"
            for block_id in sb.table.block_ids:
                refs[block_id] += 1
        for block_id, count in enumerate(refs):
            assert self.allocator.ref_counts[block_id] == count, f"block {block_id}: ref count != references"
            assert (count == 0) == (block_id in self.allocator.free_list), f"block {block_id}: free list disagrees"
        assert self.allocator.num_free + self.allocator.num_used == self.allocator.num_total, "free + used != total"
        for h, block_id in self.allocator.cached.items():
            assert self.allocator.block_hash.get(block_id) == h, f"cache entry {h} -> block {block_id}, whose hash differs"
        assert len(self.allocator.block_hash) == len(self.allocator.cached), "block_hash holds blocks the cache does not"
        for sb in self.seqs.values():  # every cached block a sequence holds carries that sequence's tokens
            for i, block_id in enumerate(sb.table.block_ids[: len(sb.block_hashes)]):
                tokens = self.allocator.block_tokens.get(block_id)
                if tokens is not None:
                    assert tokens == tuple(sb.token_ids[i * self.block_size:(i + 1) * self.block_size]), \
                        f"cached block {block_id} holds other tokens than sequence's block {i}"
