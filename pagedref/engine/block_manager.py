"""The engine's block manager: stages 2–4 (allocator, block tables, sharing) seen through Sequences.

One idea: the scheduler thinks in sequences and tokens ("can this sequence get 7 more slots?"),
the memory layer in blocks. `BlockManager` translates, and adds the one thing the memory layer does
not have: the CPU swap pool that preemption by swapping copies blocks into. It never touches K/V
tensors itself: every operation returns what the model runner needs from it, computed once, where
the memory layer computed it: the slot mapping of the tokens it gave slots to, and the block copies
to make before the step's forward (swap out, copy-on-write, swap in; in that order). A prompt is
looked up in the prefix cache once per admission (`lookup`, then `can_allocate` / `allocate` with it);
a running sequence grows in one call (`append_slots`, None when the pool is short), not a check and
then an append: every step makes that call for every decode.

`ContiguousBlockManager` is stage 1's baseline behind the same interface: each sequence reserves
max_model_len slots (rounded up to whole blocks) at admission, first fit in one arena of the same
KV budget, mapped onto consecutive physical blocks, so the same model runner, backends and kernels
serve both and the serving benchmark compares only the memory policy.

Invariant: a sequence in the device pool holds exactly the slots of the tokens it has computed or
is computing in this step; a swapped sequence holds CPU blocks with the K/V of its computed tokens
and no device block; when no sequence is left, every device and CPU block is free.
"""

from __future__ import annotations

from pagedref.engine.sequence import Sequence
from pagedref.memory.block_allocator import BlockAllocator, NoFreeBlocksError
from pagedref.memory.block_table import cdiv
from pagedref.memory.contiguous import ContiguousKVCache
from pagedref.memory.sharing import KVCacheManager, PrefixHit

# vLLM's admission watermark: a new request is admitted only if 1% of the pool stays free afterwards.
# On `bench serve`'s workload (500 requests, 4096 blocks) it cuts preemptions from 325 to 73 and the
# tokens recomputed after them from 50,948 to 13,102, for 6 more steps (1995 against 1989).
WATERMARK = 0.01


class BlockManager:
    """Paged KV blocks for sequences (prefix caching, forks with copy-on-write) and a CPU swap pool.
    Admission keeps `watermark` (a share of the pool, vLLM's 1%) free for the running sequences.
    A sequence is known by its seq_id: its memory-layer sequence (kv.seqs) and its CPU table."""

    kv: KVCacheManager  # stage 4's manager over the device pool: block tables, forks, prefix cache
    block_size: int
    num_blocks: int  # device blocks
    watermark_blocks: int  # int(watermark * num_blocks), rounded down as vLLM does: 0 below 100 blocks at 1%
    cpu: BlockAllocator | None  # the swap pool (num_cpu_blocks blocks), None when num_cpu_blocks == 0
    cpu_tables: dict[int, list[int]]  # a swapped sequence's seq_id -> its CPU blocks, in logical order

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, watermark: float = WATERMARK) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_prefix_caching)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)  # vLLM's: int(0.01 * num_gpu_blocks)
        self.cpu = BlockAllocator(num_cpu_blocks, block_size) if num_cpu_blocks > 0 else None
        self.cpu_tables: dict[int, list[int]] = {}

    # --- admission ------------------------------------------------------------------------------
    def lookup(self, seq: Sequence) -> PrefixHit:
        """The prefix cache's blocks for a sequence without blocks (hit.num_tokens of its tokens): valid for
        `can_allocate` / `allocate` until the pool's next allocation. An empty hit for a sequence that asks for
        its prompt's logprobs: each prompt token must be computed to give its own (vLLM v1 skips the cache too)."""
        if seq.params.prompt_logprobs is not None:
            return PrefixHit([], [], self.block_size)
        return self.kv.lookup(seq.token_ids)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Could the sequence be admitted with its cached prefix plus num_new_tokens more tokens, leaving the
        watermark's blocks free for the running sequences to grow into? (Admitting into the last free
        blocks only preempts someone a few steps later, and recomputes its tokens.) Exactly: stage 4's
        can_allocate, and, unless no device block is in use, num_free_blocks - ceil(num_new_tokens /
        block_size) >= watermark_blocks. An idle pool admits whatever fits: the watermark must never keep
        a request out for good."""
        if not self.kv.can_allocate(seq.token_ids, num_new_tokens, hit):
            return False
        held = self.kv.allocator.num_used > 0
        return not held or self.kv.num_free_blocks - cdiv(num_new_tokens, self.block_size) >= self.watermark_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> tuple[int, list[int]]:
        """Admit: reuse the cached prefix, give slots to the next num_new_tokens.
        Returns (cached tokens, slot mapping of the new tokens)."""
        return self.kv.allocate(seq.seq_id, seq.token_ids, num_new_tokens, hit)

    # --- growth ---------------------------------------------------------------------------------
    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Stage 4's can_append: are there blocks for num_new_tokens more, a pending copy-on-write included?
        (No watermark: it only holds back admissions.)"""
        return self.kv.can_append(seq.seq_id, num_new_tokens)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> tuple[list[int], list[tuple[int, int]]] | None:
        """Slots for the sequence's next num_new_tokens tokens (the last may be a placeholder, not known yet).
        Returns (their slot mapping, copy-on-write (src, dst) pairs), or None when the pool is short: then
        nothing changed, and the scheduler frees blocks (preempts) and asks again. Checking and appending
        are one call (vLLM's allocate_slots): asking can_append first would walk the same path twice for
        every decode, and most decodes take no block and copy nothing."""
        start = seq.num_computed_tokens  # (the invariant: it holds the slots of its computed tokens, and no more)
        tokens = seq.token_ids[start:start + num_new_tokens]
        if len(tokens) < num_new_tokens:  # a token its step in flight is still sampling (async scheduling)
            tokens = tokens + [None] * (num_new_tokens - len(tokens))
        try:
            return self.kv.append_slots(seq.seq_id, tokens)
        except NoFreeBlocksError:  # (stage 4's append is all or nothing: the pool and the table are unchanged)
            return None

    def set_token(self, seq: Sequence, pos: int) -> None:
        """Its token at pos, which had a slot before it was known, is known now (for the prefix cache)."""
        self.kv.set_token(seq.seq_id, pos, seq.token_ids[pos])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all the parent's blocks (n > 1 samples, beam search)."""
        self.kv.fork(parent.seq_id, child.seq_id)

    def has_blocks(self, seq: Sequence) -> bool:
        """Does it hold device blocks (admitted or swapped in, and not freed, preempted or swapped out)?"""
        return seq.seq_id in self.kv.seqs

    def block_ids(self, seq: Sequence) -> list[int]:
        """Its block table: device blocks in logical order (the memory layer's list, not a copy)."""
        return self.kv.seqs[seq.seq_id].table.block_ids  # (KeyError: it holds none; every step asks it per sequence)

    def free(self, seq: Sequence) -> None:
        """Give back everything the sequence holds, on the device or in the swap pool (if it holds
        nothing, nothing happens: a waiting sequence can be finished)."""
        if seq.seq_id in self.kv.seqs:
            self.kv.free(seq.seq_id)
        for block in self.cpu_tables.pop(seq.seq_id, []):
            self.cpu.free(block)

    # --- swapping (preemption_mode="swap") -------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        """Is there a swap pool with a free CPU block for each of its device blocks?"""
        return self.cpu is not None and len(self.kv.block_ids(seq.seq_id)) <= self.cpu.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to the CPU pool: a CPU block for each device block, in logical order;
        its device blocks are freed at once. Returns the (device block, CPU block) copies."""
        device_blocks = self.kv.block_ids(seq.seq_id)
        cpu_blocks = [self.cpu.allocate() for _ in device_blocks]
        self.kv.free(seq.seq_id)  # freed now, copied out first thing in this step: nobody writes before
        self.cpu_tables[seq.seq_id] = cpu_blocks
        return list(zip(device_blocks, cpu_blocks))

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for the swapped tokens back on the device (less the blocks the prefix cache still holds),
        plus num_new_tokens more?"""
        c = seq.num_computed_tokens
        hit = self.kv.lookup(seq.token_ids[:c])
        need = cdiv(c + num_new_tokens, self.block_size) - len(hit.blocks)
        free_hits = sum(1 for b in hit.blocks if self.kv.allocator.is_free(b))  # taking these uses free blocks too
        return need + free_hits <= self.kv.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back. Returns (CPU block, device block) copies. Full blocks the
        prefix cache still holds are reused instead of copied."""
        c = seq.num_computed_tokens
        hit = self.kv.lookup(seq.token_ids[:c])
        num_cached, _ = self.kv.allocate(seq.seq_id, seq.token_ids[:c], c - hit.num_tokens, hit)
        cpu_blocks = self.cpu_tables.pop(seq.seq_id)
        device_blocks = self.kv.block_ids(seq.seq_id)
        copies = [(cpu_blocks[i], device_blocks[i]) for i in range(num_cached // self.block_size, len(device_blocks))]
        # The CPU blocks can be reused at once: swap-ins are scheduled after every swap-out of the
        # step, and the runner copies out before it copies in.
        for block in cpu_blocks:
            self.cpu.free(block)
        return copies

    # --- accounting -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Free device blocks (cached ones included, as in stage 4)."""
        return self.kv.num_free_blocks

    def live_usage(self) -> tuple[float, int, int]:
        """(share of used KV memory holding token states, used blocks, block references saved by sharing),
        cheaply enough to measure at every step (set operations instead of per-block Python loops).
        A shared block is either full for every holder or, right after a fork, equally filled for all."""
        bs = self.block_size
        used = self.kv.allocator.num_used
        refs = sum(len(sb.table.block_ids) for sb in self.kv.seqs.values())
        if refs == used:  # no block held twice: every sequence's tokens lie in blocks of its own (O(sequences))
            filled = sum(sb.table.num_tokens for sb in self.kv.seqs.values())
            return (filled / (used * bs) if used else 0.0), used, 0
        full: set[int] = set()  # otherwise count each shared block once (O(blocks))
        partial: dict[int, int] = {}
        for sb in self.kv.seqs.values():
            ids, n = sb.table.block_ids, sb.table.num_tokens
            full.update(ids[:n // bs])
            if n % bs:
                partial[ids[n // bs]] = n % bs
        filled = len(full) * bs + sum(fill for block, fill in partial.items() if block not in full)
        return (filled / (used * bs) if used else 0.0), used, refs - used

    def stats(self) -> dict[str, float]:
        """Stage 4's stats() keys, plus num_swapped_blocks: the CPU blocks the swapped sequences hold."""
        s = self.kv.stats()
        s["num_swapped_blocks"] = sum(len(b) for b in self.cpu_tables.values())
        return s

    def all_free(self) -> bool:
        """Nothing held: every device block is free (cached ones included) and the swap pool is empty."""
        return self.kv.num_free_blocks == self.num_blocks and not self.kv.seqs and not self.cpu_tables and (
            self.cpu is None or self.cpu.num_used == 0)

    def check_invariants(self) -> None:
        """Stage 4's invariants of the device pool, and the swap pool's: the CPU blocks of the swapped
        sequences are distinct and are exactly its used blocks. AssertionError when one is broken."""
        self.kv.check_invariants()
        if self.cpu is not None:
            held = sorted(b for blocks in self.cpu_tables.values() for b in blocks)
            assert len(held) == len(set(held)) == self.cpu.num_used, "swap pool: held blocks != used blocks"


class ContiguousBlockManager:
    """Stage 1's baseline behind the BlockManager interface: a max-length reservation per sequence.
    Each admitted sequence reserves cdiv(max_model_len, block_size) whole blocks, first fit, in one
    ContiguousKVCache arena of num_blocks * block_size slots (stage 1), so a reservation always holds its
    sequence's next token: never a preemption, no prefix cache, no sharing, no swapping. ValueError when
    the pool cannot hold one reservation."""

    block_size: int
    num_blocks: int
    blocks_per_seq: int  # one reservation: cdiv(max_model_len, block_size) blocks
    arena: ContiguousKVCache  # stage 1's cache, its reservations keyed by seq_id (max_model_len: a reservation)

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks_per_seq = cdiv(max_model_len, block_size)  # reservations stay block-aligned
        if self.blocks_per_seq > num_blocks:
            raise ValueError(f"KV pool of {num_blocks} blocks cannot hold one reservation of max_model_len={max_model_len}")
        self.arena = ContiguousKVCache(num_blocks * block_size, self.blocks_per_seq * block_size)

    def lookup(self, seq: Sequence) -> PrefixHit:
        """An empty hit: a reservation is private, nothing is cached."""
        return PrefixHit([], [], self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Is there a hole for one whole reservation (first fit)?"""
        return self.arena.find_hole(self.arena.max_model_len) is not None

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> tuple[int, list[int]]:
        """Reserve, and give the reservation's first slots to num_new_tokens. Returns (0, their slots)."""
        self.arena.admit(seq.seq_id)
        return 0, list(self.arena.append(seq.seq_id, num_tokens=num_new_tokens))  # the reservation's own slots

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Do num_new_tokens more fit in its reservation? (Always, below max_model_len.)"""
        r = self.arena.reservations[seq.seq_id]
        return r.num_tokens + num_new_tokens <= r.capacity  # always, below max_model_len: never preempts

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> tuple[list[int], list[tuple[int, int]]] | None:
        """The reservation's next slots; never a copy, never None (a reservation always has room)."""
        return list(self.arena.append(seq.seq_id, num_tokens=num_new_tokens)), []

    def set_token(self, seq: Sequence, pos: int) -> None:
        """Nothing to do: nothing is cached by content."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """ValueError: a reservation cannot be shared."""
        raise ValueError("kv_cache='contiguous' (the stage 1 baseline) cannot share blocks: use kv_cache='paged'")

    def has_blocks(self, seq: Sequence) -> bool:
        """Does it hold a reservation?"""
        return seq.seq_id in self.arena.reservations

    def block_ids(self, seq: Sequence) -> list[int]:
        """The consecutive blocks of its reservation that its tokens occupy so far."""
        r = self.arena.reservations[seq.seq_id]
        first = r.start // self.block_size
        return list(range(first, first + cdiv(r.num_tokens, self.block_size)))

    def free(self, seq: Sequence) -> None:
        """Release its reservation, if it holds one."""
        if seq.seq_id in self.arena.reservations:
            self.arena.release(seq.seq_id)

    def can_swap_out(self, seq: Sequence) -> bool:
        """False: there is no swap pool (preemption would recompute; a reservation never needs it)."""
        return False

    @property
    def num_free_blocks(self) -> int:
        """Blocks no reservation holds (stage 1's free slots // block_size)."""
        return self.arena.usage().free // self.block_size

    def live_usage(self) -> tuple[float, int, int]:
        """(stage 1's token_state_fraction, reserved blocks, 0)."""
        u = self.arena.usage()
        return u.token_state_fraction, (u.total - u.free) // self.block_size, 0

    def stats(self) -> dict[str, float]:
        """BlockManager.stats()'s keys: the reserved blocks are used, nothing is shared, cached or swapped."""
        u = self.arena.usage()
        reserved_blocks = (u.total - u.free) // self.block_size
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_blocks - reserved_blocks,
            "num_used_blocks": reserved_blocks,
            "num_shared_blocks": 0,
            "num_cached_blocks": 0,
            "token_state_fraction": u.token_state_fraction,
            "prefix_cache_hit_rate": 0.0,
            "num_swapped_blocks": 0,
        }

    def all_free(self) -> bool:
        """No reservation left."""
        return not self.arena.reservations

    def check_invariants(self) -> None:
        """Stage 1's accounting adds up (token states + reserved + internal fragmentation + free == total)."""
        u = self.arena.usage()
        assert u.token_states + u.reserved + u.internal_fragmentation + u.free == u.total
