"""Stages 6–7 — the scheduler: iteration-level batching (Orca, vLLM) within a token budget.

One idea: the batch is re-formed at *every* step (one forward pass), not once per batch of requests.
A request joins as soon as there is room for it, leaves the step it finishes, and its blocks go back
at once. Each step, `schedule()` spends a budget of `max_num_batched_tokens` tokens and at most
`max_num_seqs` sequences:

1. running sequences, oldest first: every decode (1 token each), then the next chunk of each
   partly prefilled prompt. A sequence that needs a block when none is free first takes back the
   blocks of idle beams (beam search), then *preempts* the most recently admitted running sequence
   not yet scheduled in this step (or, if there is none, itself):
   - recompute (default, vLLM v1): its blocks are freed and it goes back to the front of the
     waiting queue; later its prompt *and* generated tokens are prefilled again (the prefix cache
     usually still holds most of them);
   - swap (vLLM v0): its blocks are copied to the CPU swap pool and copied back later (recompute
     when the swap pool is full).
   No request is ever dropped.
2. swapped sequences, oldest first, if nothing was preempted in this step (no ping-pong);
3. waiting sequences, first come first served (a request that does not fit stops the queue), if
   nothing was preempted in this step and no sequence is swapped out: their prompt minus what the
   prefix cache holds, in one chunk of whatever budget is left (chunked prefill, stage 7), or whole
   or not at all (chunking disabled).

`prefill_first=True` (with chunking disabled) is vLLM v0's policy instead, and nano-vllm's: pass 3
runs first (unless a sequence is swapped out), and a step that admits any prompt carries prompts
only; passes 1 and 2 run only in steps that admit none. Running sequences then wait for every
prefill step in a row, which is the inter-token stall chunked prefill was made to remove; the latency
benchmark measures it beside the mixed policy above.

Why never preempt a sequence already scheduled in this step: its new tokens' slots, and the
prefix-cache entries of blocks they fill, exist from the moment they are allocated, and another
sequence admitted later in the same step may already have been handed those blocks as cache hits
(safe, because each layer writes the whole step's K/V before any row reads). Freeing them would
hand out blocks whose K/V will never be written.

Invariant: the scheduled tokens never exceed the budget; every scheduled sequence holds slots for
all of its scheduled tokens; a sequence is in exactly one of waiting, running, swapped (or finished).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedref.engine.block_manager import BlockManager, ContiguousBlockManager
from pagedref.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    prefill_first: bool = False  # vLLM v0's policy without chunking: a step admits prompts or decodes, never both


@dataclass
class SchedulerOutput:
    """One step's work: which sequences compute how many tokens, and the block copies to make first."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, num new tokens), batch order
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class _Step:
    """One `schedule()` call in progress: its output so far and the token budget it has left."""

    budget: int
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    scheduled_ids: set[int] = field(default_factory=set)

    def take(self, seq: Sequence, n: int) -> None:
        self.out.scheduled.append((seq, n))
        self.scheduled_ids.add(seq.seq_id)
        self.budget -= n


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager | ContiguousBlockManager) -> None:
        if config.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {config.preemption_mode!r}")
        if config.prefill_first and config.enable_chunked_prefill:
            raise ValueError("prefill_first is vLLM v0's policy without chunked prefill: "
                             "set enable_chunked_prefill=False (chunked prefill schedules decodes first)")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()  # new, or preempted by recompute (at the front)
        self.running: list[Sequence] = []  # hold device blocks; in admission order
        self.swapped: deque[Sequence] = deque()  # preempted by swap, oldest first
        self.paused: list[Sequence] = []  # finished beams that keep their blocks until beam search forks them
        self.num_preemptions = 0
        self.num_swap_outs = 0  # preemptions that swapped (the others recomputed)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _Step(self.config.max_num_batched_tokens)
        if self.config.prefill_first:  # vLLM v0 without chunking: new prompts first, in steps of their own
            self._schedule_waiting(step)  # (none while a sequence is swapped out: it comes back first)
            if step.out.scheduled:
                return step.out  # a prefill step: every running sequence waits for the next one
            self._schedule_running(step)
            self._schedule_swapped(step)
            return step.out
        self._schedule_running(step)
        self._schedule_swapped(step)
        self._schedule_waiting(step)
        return step.out

    def _schedule_running(self, step: _Step) -> None:
        """1. Running: decodes first, then the next chunk of each partly prefilled prompt."""
        out = step.out
        decodes, prefills = [], []
        for seq in self.running:
            (prefills if seq.is_prefill else decodes).append(seq)
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted above, as someone's victim
            if step.budget == 0 or len(out.scheduled) == self.config.max_num_seqs:
                break
            n = seq.num_uncomputed_tokens
            if n > step.budget:
                if not self.config.enable_chunked_prefill:
                    continue
                n = step.budget
            while not self.block_manager.can_append(seq, n):
                if self.paused:  # idle beams give their blocks back first
                    self._drop_paused()
                    continue
                victim = self._pick_victim(seq, step.scheduled_ids)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.blocks_to_copy += self.block_manager.append_slots(seq, n)
                step.take(seq, n)

    def _schedule_swapped(self, step: _Step) -> None:
        """2. Swapped, back in admission order; not in a step that swapped someone out."""
        out = step.out
        while self.swapped and not out.preempted and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, step.budget)
            if seq.is_prefill and not self.config.enable_chunked_prefill and n < seq.num_uncomputed_tokens:
                break
            while not self.block_manager.can_swap_in(seq, n) and self.paused:
                self._drop_paused()
            if not self.block_manager.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += self.block_manager.swap_in(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.blocks_to_copy += self.block_manager.append_slots(seq, n)
            step.take(seq, n)

    def _schedule_waiting(self, step: _Step) -> None:
        """3. Waiting, first come first served: the prompt minus its cached prefix, in what budget is left."""
        while (self.waiting and not self.swapped and not step.out.preempted and step.budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            num_cached = self.block_manager.num_cached_tokens(seq)
            n = seq.num_tokens - num_cached  # >= 1: the cache never covers the last token
            if n > step.budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = step.budget
            while not self.block_manager.can_allocate(seq, n) and self.paused:
                self._drop_paused()
            if not self.block_manager.can_allocate(seq, n):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = self.block_manager.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            step.take(seq, n)

    def _pick_victim(self, seq: Sequence, scheduled_ids: set[int]) -> Sequence:
        """The most recently admitted running sequence not scheduled this step; else the requester itself."""
        for victim in reversed(self.running):
            if victim is not seq and victim.seq_id not in scheduled_ids:
                return victim
        return seq

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        out.preempted.append(seq)
        self.num_preemptions += 1
        self.running.remove(seq)
        if (self.config.preemption_mode == "swap" and seq.num_computed_tokens > 0
                and self.block_manager.can_swap_out(seq)):
            out.blocks_to_swap_out += self.block_manager.swap_out(seq)
            self.num_swap_outs += 1
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)  # victims come newest first: the oldest ends up in front
        else:  # recompute (also the fallback when the swap pool is full)
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def _drop_paused(self) -> None:
        """An idle beam (finished its round, waiting to be forked) gives its blocks back; beam search
        then recomputes its children from their tokens. Never scheduled, so always safe to free."""
        seq = self.paused.pop()
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        self.num_preemptions += 1

    # --- after the step -------------------------------------------------------------------------
    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """The sequence is done (or aborted): it leaves its queue and its blocks are freed now,
        unless it is a beam waiting to be forked."""
        seq.status = status
        for queue in (self.running, self.waiting, self.swapped, self.paused):
            if seq in queue:
                queue.remove(seq)
        if seq.keep_blocks and status is not SequenceStatus.FINISHED_ABORTED and self.block_manager.has_blocks(seq):
            self.paused.append(seq)
        else:
            self.block_manager.free(seq)

    def release(self, seq: Sequence) -> None:
        """Beam search is done with a paused beam: free its blocks."""
        if seq in self.paused:
            self.paused.remove(seq)
        self.block_manager.free(seq)
