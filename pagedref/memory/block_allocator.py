"""Stage 2 — the block allocator: KV memory cut into fixed-size blocks, handed out from a free list.

One idea: every sequence's KV cache is made of equal blocks of `block_size` token slots, so any free
block fits any request and there is no external fragmentation. A block may be held by several
sequences at once (forks, shared prefixes); its reference count says by how many.

Invariant: num_free + num_used == num_total; a block is on the free list exactly when its reference
count is 0; allocate and free are O(1).

The free list is an insertion-ordered dict used as a queue: `allocate` takes the block that has been
free the longest (stage 4's prefix cache relies on that LRU order to keep recently freed, still
reusable blocks alive as long as possible), and `take` removes a given free block in O(1).
"""

from __future__ import annotations

from collections import OrderedDict


class BlockAllocatorError(Exception):
    """Base class of the allocator's errors."""


class NoFreeBlocksError(BlockAllocatorError):
    """The pool is exhausted: the caller must wait, preempt or evict."""


class DoubleFreeError(BlockAllocatorError):
    """A block whose reference count is already 0 was freed again."""


class InvalidBlockError(BlockAllocatorError):
    """A block id outside the pool, or an operation on a block nobody holds."""


class BlockAllocator:
    """Fixed-size physical blocks with reference counts and an O(1) free list.

    allocate, take, incref and free are O(1): none of them scans ref_counts or the free list (stage 2's
    tests count the entries of both that each one reads). Errors: a num_blocks or block_size that is
    not a positive int raises ValueError naming it; a block id outside 0..num_blocks-1, or not an int,
    raises InvalidBlockError. Each error's message names the block (allocate's, the pool's size). A
    refused call changes nothing.
    """

    num_blocks: int
    block_size: int  # token slots per block
    ref_counts: list[int]  # ref_counts[block] = its holders; 0 exactly when the block is on the free list
    free_list: OrderedDict[int, None]  # the free blocks, longest-free first: O(1) pop of the head, append, delete

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_list: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # --- counters -------------------------------------------------------------------------------
    @property
    def num_total(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_list)

    @property
    def num_shared(self) -> int:
        """Blocks held by more than one sequence."""
        return sum(1 for c in self.ref_counts if c > 1)

    # --- operations -----------------------------------------------------------------------------
    def _check(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(f"block id {block_id!r} is outside the pool of {self.num_blocks} blocks")

    def allocate(self) -> int:
        """Pop the longest-free block (the head of the free list); its reference count becomes 1.
        Raises NoFreeBlocksError when every block is held."""
        if not self.free_list:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks of {self.block_size} slots are in use")
        block_id, _ = self.free_list.popitem(last=False)
        self.ref_counts[block_id] = 1
        return block_id

    def take(self, block_id: int) -> None:
        """Take one particular free block (a prefix-cache hit on a freed block): count 0 → 1.
        Raises InvalidBlockError if the block is held."""
        self._check(block_id)
        if self.ref_counts[block_id] != 0:
            raise InvalidBlockError(f"block {block_id} is not free (ref count {self.ref_counts[block_id]})")
        del self.free_list[block_id]
        self.ref_counts[block_id] = 1

    def incref(self, block_id: int) -> None:
        """One more holder of a block that is already held (fork, shared prefix). Raises
        InvalidBlockError for a free block: nobody holds it, so there is nothing to share."""
        self._check(block_id)
        if self.ref_counts[block_id] == 0:
            raise InvalidBlockError(f"cannot share block {block_id}: nobody holds it")
        self.ref_counts[block_id] += 1

    def free(self, block_id: int) -> bool:
        """Drop one reference; at 0 the block goes to the back of the free list. Returns True then.
        Raises DoubleFreeError for a block whose count is already 0 (a double free, or a block never
        allocated)."""
        self._check(block_id)
        if self.ref_counts[block_id] == 0:
            raise DoubleFreeError(f"block {block_id} is already free (double free)")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_list[block_id] = None
            return True
        return False

    def ref_count(self, block_id: int) -> int:
        """The block's number of holders."""
        self._check(block_id)
        return self.ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        """Whether the block is on the free list (its count is 0)."""
        self._check(block_id)
        return self.ref_counts[block_id] == 0
