"""Stages 6–7 (and 8's drafts) — the scheduler: iteration-level batching (Orca, vLLM) within a token budget.

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

The step contract (vLLM v0's SequenceGroupMetadata, nano-vllm's schedule/postprocess): each step is
`schedule()` → `ModelRunner.execute(output)` → `update(output, sampled)`, and nothing else.
- `schedule()` returns a `SchedulerOutput`: per scheduled sequence (`ScheduledSequence`), its token
  slice, block table and slot mapping, as the block manager computed them (once), and who samples
  from its last row; plus the step's block copies. It counts the scheduled tokens as computed at
  once, and each token the step will sample as a *placeholder*, so the next step can be scheduled
  before that token is known (async scheduling: the runner reads it on the device).
- `update()` is the one writer of what the step produced: it appends the sampled tokens (resolving
  their placeholders), forks the n samples of a prompt after its prefill (copy-on-write), ranks beam
  search's rounds and forks the survivors, checks the stop rules, finishes and frees.
- With a `proposer` (stage 8, speculative decoding), pass 1 asks it for the decodes' drafts, which
  ride along within the budget and the free blocks (never a preemption); `update()` verifies them:
  it keeps the accepted drafts and the target's own next token, and truncates the rejected ones'
  slots (`spec_decode` says how).
A sequence whose step-N token is still in flight when step N+1 is scheduled decodes it in N+1 only
if that token is known to be an ordinary next token: never a prompt's first samples that fork
(n > 1) or a beam's candidates, and never past max_tokens or max_model_len. If the token turns out
to stop it (eos, a stop string), `update` finishes it then and drops what N+1 computed for it; its
blocks are freed at once (the GPU runs N+1 before any later step can reuse them).

Invariant: the scheduled tokens never exceed the budget; every scheduled sequence holds slots for
all of its scheduled tokens; a sequence is in exactly one of waiting, running, swapped (or finished),
except an idle beam whose blocks were taken back, which waits in no queue for its round's ranking;
`num_computed_tokens`, `num_placeholders`, the queues and the token lists are written here only.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagedref.engine import beam_search
from pagedref.engine.block_manager import BlockManager, ContiguousBlockManager
from pagedref.engine.config import SchedulerConfig
from pagedref.engine.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus
from pagedref.engine.stop_checker import StopChecker

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput", "ScheduledSequence", "SampledTokens"]


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step (vLLM v0's SequenceGroupMetadata), everything the runner needs."""

    seq: Sequence
    num_new_tokens: int  # its query rows in this step
    num_computed_tokens: int  # before the step: the position of its first new token
    token_ids: list[int]  # the new tokens (a placeholder's: 0, read from prev_sample_index's token on the device)
    block_ids: list[int]  # its block table (the block manager's list: read it before the next schedule())
    slot_mapping: list[int]  # one slot per new token, from the memory layer
    sample_seqs: list[Sequence]  # who samples from its last row ([]: a prefill chunk)
    prev_sample_index: int = -1  # >= 0: its input is the token sampled at this index of the step still in flight
    num_draft_tokens: int = 0  # > 0: speculative decoding, token_ids = [its last token, k drafts]; update() verifies
    draft_probs: torch.Tensor | None = None  # [k, vocab]: the distributions the drafts were drawn from (None: one-hot)

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """One step's work: which sequences compute which tokens where, and the block copies to make first."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)  # batch order
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def sampling_seqs(self) -> list[Sequence]:
        """Every sequence that samples in the step, in the order of the sampled tokens."""
        return list(itertools.chain.from_iterable([s.sample_seqs for s in self.scheduled]))


class SampledTokens(Protocol):
    """What `update` reads from `ModelRunner.execute` (a `pagedref.engine.sampling.SamplerOutput`, or the
    runner's output, whose fields wait for the device): one entry per sampling sequence, in order."""

    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, Logprob]] | None] | None  # where the sequence asked for logprobs
    logits: list[torch.Tensor | None] | None  # [vocab] float32 on the CPU, where the sequence records them
    prompt_logprobs: list[tuple[Sequence, int, list[dict[int, Logprob]]]] | None  # (seq, first position, per token)
    spec: list | None  # speculative decoding: per speculating entry, in batch order, its rows' tokens (`SpecTokens`)


@dataclass
class _Step:
    """One `schedule()` call in progress: its output so far and the token budget it has left."""

    budget: int
    prev_index: dict[int, int] | None  # seq_id -> its token's index in the step in flight (async scheduling)
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    scheduled_ids: set[int] = field(default_factory=set)


class Scheduler:
    """The queues of sequences and the step contract's two writers: `schedule()` and `update()`.
    The engine (`LLMEngine`) calls only the methods below and reads only these attributes."""

    config: SchedulerConfig  # max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, preemption_mode, prefill_first
    block_manager: BlockManager | ContiguousBlockManager  # the engine reads the pool through it (stats, usage)
    stop_checker: StopChecker  # update's stop rules: the engine replaces it with its own (eos ids, stop strings)
    waiting: deque[Sequence]  # WAITING: new at the back, preempted by recompute at the front; served first come first
    running: list[Sequence]  # RUNNING, holding device blocks, in admission order (the last is the first victim)
    swapped: deque[Sequence]  # SWAPPED: preempted by swap, their K/V in the CPU pool; the oldest first
    in_flight: deque[SchedulerOutput]  # scheduled and not updated yet, oldest first (1 step; 2 with async scheduling)
    num_preemptions: int  # every preemption, by recompute or swap, and every idle beam whose blocks were taken back
    num_swap_outs: int  # ... of which by swap
    num_generated_tokens: int  # tokens update() appended (a beam's report of its candidates counts one)
    proposer: object | None  # speculative decoding (stage 8, `pagedref.engine.spec_decode`): drafts; None: off
    num_spec_drafts: int  # speculative steps of a sequence that update() verified
    num_draft_tokens: int  # ... their draft tokens
    num_accepted_tokens: int  # ... those the target kept

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager | ContiguousBlockManager,
                 stop_checker: StopChecker | None = None) -> None:
        """stop_checker: the engine's stop rules (max_model_len, eos ids, stop strings); by default max_tokens only."""
        self.config = config
        self.block_manager = block_manager
        self.stop_checker = stop_checker or StopChecker()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.in_flight: deque[SchedulerOutput] = deque()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_generated_tokens = 0
        self.proposer = None
        self.num_spec_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def add(self, seq: Sequence) -> None:
        """A new sequence joins the back of the waiting queue, WAITING."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Is any sequence waiting, running or swapped?"""
        return bool(self.waiting or self.running or self.swapped)

    # --- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's work: at most config.max_num_batched_tokens tokens (decodes count 1 each) and
        config.max_num_seqs sequences, in three passes (the module docstring says why):
        1. running, in admission order: every decode, then each partly prefilled prompt's next chunk.
           One that needs a block when none is free first takes back an idle beam's blocks, then preempts
           the most recently admitted running sequence not scheduled in this step (none: itself), by
           recompute (blocks freed, num_computed_tokens = 0, to the *front* of waiting) or by swap (blocks
           to the CPU pool, to swapped; recompute when the swap pool is full). Each goes to out.preempted.
        2. swapped, oldest first, back to running, unless this step preempted;
        3. waiting, first come first served (the first that does not fit stops the queue), unless this
           step preempted or a sequence is swapped out: its prompt minus its prefix-cache hit, cut to the
           budget left (chunked prefill) or whole or not at all (enable_chunked_prefill=False).
        With prefill_first, pass 3 runs first and a step that admits a prompt runs nothing else.
        Each scheduled sequence's num_computed_tokens (and placeholder) moves at once; a request's first
        admission sets its group's num_cached_tokens (the prefix cache's share of its prompt) and
        metrics.first_scheduled_time. A non-empty output joins in_flight until its update()."""
        prev = self.in_flight[-1] if self.in_flight else None  # async: its tokens are not known yet
        prev_index = {seq.seq_id: i for i, seq in enumerate(prev.sampling_seqs())} if prev is not None else None
        step = _Step(self.config.max_num_batched_tokens, prev_index)
        if self.config.prefill_first:  # vLLM v0 without chunking: new prompts first, in steps of their own
            self._schedule_waiting(step)  # (none while a sequence is swapped out: it comes back first)
            if not step.out.scheduled:  # else a prefill step: every running sequence waits for the next one
                self._schedule_running(step)
                self._schedule_swapped(step)
        else:
            self._schedule_running(step)
            self._schedule_swapped(step)
            self._schedule_waiting(step)
        if step.out.scheduled:
            self.in_flight.append(step.out)
        return step.out

    def _take(self, step: _Step, seq: Sequence, n: int, slots: list[int], draft=None) -> None:
        """Schedule n tokens of seq into their slots: its computed count and placeholders move now. With a
        draft (speculative decoding), n - 1 of them are its draft tokens: computed, but counted only once
        update() accepts them, and no placeholder (the step's tokens are verified, not sampled)."""
        start, tokens = seq.num_computed_tokens, seq.token_ids
        known, end = len(tokens), start + n
        entry = ScheduledSequence(seq, n, start, tokens[start:end], self.block_manager.block_ids(seq), slots, [])
        step.out.scheduled.append(entry)
        step.scheduled_ids.add(seq.seq_id)
        step.budget -= n
        if draft is not None:
            k = entry.num_draft_tokens = n - 1
            entry.token_ids = entry.token_ids + draft.token_ids[:k]
            entry.draft_probs = None if draft.probs is None else draft.probs[:k]
            seq.num_computed_tokens = known
            return
        if end > known:  # its last token is in flight: a decode whose input the runner reads on the device
            assert n == 1 and step.prev_index is not None, "only a decode can wait on a token in flight"
            entry.token_ids, entry.prev_sample_index = [0], step.prev_index[seq.seq_id]
        seq.num_computed_tokens = end
        if end == known + seq.num_placeholders:  # all known: its last row samples
            group = seq.group
            if group is None or (group.beam is None and (group.forked or group.params.n == 1)):  # an ordinary next token
                entry.sample_seqs = [seq]
                if not self.stop_checker.ends_by_length(seq, 1):
                    seq.num_placeholders += 1  # the next step may decode it before it is known (async scheduling)
            elif group.beam is None:  # n > 1: the prompt samples its n first tokens, and update forks it
                entry.sample_seqs = group.seqs
            else:  # a beam's candidates: known only when its round is ranked
                entry.sample_seqs = [seq]

    def _schedule_running(self, step: _Step) -> None:
        """1. Running: decodes first, then the next chunk of each partly prefilled prompt."""
        out = step.out
        decodes, prefills = [], []
        for seq in self.running:
            n = seq.num_uncomputed_tokens
            if n:  # (idle: nothing to compute until its token is decided)
                (prefills if n > 1 else decodes).append(seq)
        drafts = self._propose(decodes) if self.proposer is not None else {}
        running = SequenceStatus.RUNNING  # (an enum member's lookup costs as much as a call: once, not per sequence)
        for seq in decodes + prefills:
            if seq.status is not running:
                continue  # preempted above, as someone's victim
            if step.budget == 0 or len(out.scheduled) == self.config.max_num_seqs:
                break
            n = seq.num_uncomputed_tokens
            if n > step.budget:
                if not self.config.enable_chunked_prefill:
                    continue
                n = step.budget
            draft = drafts.get(seq.seq_id) if drafts else None
            if draft is not None:  # its drafts ride along if the budget and the free blocks have room (never a preemption)
                k = min(len(draft.token_ids), step.budget - n)
                if k > 0 and self.block_manager.can_append(seq, n + k):
                    n += k
                else:
                    draft = None
            # one call checks the room and takes it (None: the pool is short, nothing taken): then idle beams
            # give their blocks back first, else the newest running sequence not yet scheduled is preempted
            while (appended := self.block_manager.append_slots(seq, n)) is None:
                if self._reclaim_idle(step):
                    continue
                victim = self._pick_victim(seq, step.scheduled_ids)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                slots, copies = appended
                if copies:  # (a decode copies nothing, but at the first write into a shared partly filled block)
                    out.blocks_to_copy += copies
                self._take(step, seq, n, slots, draft)

    def _schedule_swapped(self, step: _Step) -> None:
        """2. Swapped, back in admission order; not in a step that swapped someone out."""
        out = step.out
        while self.swapped and not out.preempted and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, step.budget)
            if seq.is_prefill and not self.config.enable_chunked_prefill and n < seq.num_uncomputed_tokens:
                break
            while not self.block_manager.can_swap_in(seq, n) and self._reclaim_idle(step):
                pass
            if not self.block_manager.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += self.block_manager.swap_in(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            slots, copies = self.block_manager.append_slots(seq, n)
            out.blocks_to_copy += copies
            self._take(step, seq, n, slots)

    def _schedule_waiting(self, step: _Step) -> None:
        """3. Waiting, first come first served: the prompt minus its cached prefix, in what budget is left."""
        bm = self.block_manager
        while (self.waiting and not self.swapped and not step.out.preempted and step.budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            assert not seq.num_placeholders, "a waiting sequence's tokens are all known"
            hit = bm.lookup(seq)  # once per admission: reused by can_allocate and allocate
            n = seq.num_tokens - hit.num_tokens  # >= 1: the cache never covers the last token
            if n > step.budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = step.budget
            while not bm.can_allocate(seq, n, hit) and self._reclaim_idle(step):
                pass  # (freeing blocks evicts no cached one: the hit stays valid)
            if not bm.can_allocate(seq, n, hit):
                break
            self.waiting.popleft()
            seq.num_computed_tokens, slots = bm.allocate(seq, n, hit)
            group = seq.group
            if group is not None and group.num_cached_tokens is None:  # its first admission
                group.num_cached_tokens = seq.num_computed_tokens  # the prefix cache's share of the prompt
                group.metrics.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._take(step, seq, n, slots)

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
        if (self.config.preemption_mode == "swap" and seq.num_computed_tokens > 0 and not seq.is_idle
                and self.block_manager.can_swap_out(seq)):
            out.blocks_to_swap_out += self.block_manager.swap_out(seq)
            self.num_swap_outs += 1
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)  # victims come newest first: the oldest ends up in front
        else:  # recompute (also the fallback when the swap pool is full; an idle sequence has nothing to swap back for)
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def _reclaim_idle(self, step: _Step) -> bool:
        """Take back the blocks of the most recently admitted idle beam (one that has reported its round's
        candidates and waits for the ranking; never one whose token is in flight). It leaves the queues:
        its round's survivors fork it if it still holds blocks, else are recomputed from their tokens.
        Returns False when there is none."""
        in_flight = step.prev_index or {}
        for seq in reversed(self.running):
            if seq.is_idle and seq.seq_id not in in_flight and seq.seq_id not in step.scheduled_ids:
                self.running.remove(seq)
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING  # (in no queue: its group decides what follows it)
                self.num_preemptions += 1
                return True
        return False

    # --- after the step -------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: SampledTokens) -> list[SequenceGroup]:
        """Apply the step's sampled tokens (in the order of out.sampling_seqs()) to its sequences: the
        one writer of what a step produced (append, fork, stop rules, finish). Steps are updated in the
        order schedule() returned them (RuntimeError otherwise). Returns the requests that advanced, in
        batch order."""
        if not self.in_flight or self.in_flight[0] is not out:
            raise RuntimeError("update() takes the scheduled steps in the order schedule() returned them")
        self.in_flight.popleft()
        self._record_prompt_logprobs(sampled.prompt_logprobs)
        token_ids, logprobs, logits = sampled.token_ids, sampled.logprobs, sampled.logits
        advanced: dict[SequenceGroup, None] = {}  # (a group's n sequences advance it once)
        i = spec = 0
        for entry in out.scheduled:
            if entry.num_draft_tokens:  # speculative decoding: the target's verdict on the drafts
                self._verify(entry, sampled, spec)
                spec += 1
                if entry.seq.group is not None:
                    advanced[entry.seq.group] = None
                continue
            seqs, first = entry.sample_seqs, i
            i += len(seqs)
            parent = entry.seq
            if not seqs or parent.is_finished:  # a chunk; or stopped (aborted) while the step was in flight: dropped
                continue
            group = parent.group
            if group is not None and group.beam is not None:
                self._report_beam(group, parent, sampled, first)
            elif len(seqs) == 1:  # most entries: one sequence, its next token
                self._append(parent, token_ids[first], logprobs, logits, first)
            else:  # the prompt's prefill has sampled its n first tokens: n sequences from here
                self._fork_samples(group, parent)
                for j, seq in enumerate(seqs):
                    self._append(seq, token_ids[first + j], logprobs, logits, first + j)
            if group is not None:
                advanced[group] = None
        return list(advanced)

    def _record_prompt_logprobs(self, spans) -> None:
        """The prompt tokens' logprobs of the chunks just computed, into their requests (a position computed
        twice, after a preemption, keeps its first: the same bits on the CPU)."""
        for seq, first, tops in spans or ():
            group = seq.group
            if group is None or group.prompt_logprobs is None or seq.is_finished:
                continue
            for pos, top in enumerate(tops, start=first):
                if group.prompt_logprobs[pos] is None:
                    self._name_tokens(top)
                    group.prompt_logprobs[pos] = top

    def _append(self, seq: Sequence, token: int, logprobs: list | None, logits: list | None, i: int) -> None:
        """The sampled token (entry i of the step's) joins the sequence, in its placeholder if it had one;
        then the stop rules."""
        seq.token_ids.append(token)
        if seq.num_placeholders:
            seq.num_placeholders -= 1
            pos = len(seq.token_ids) - 1
            if seq.num_computed_tokens > pos and seq.status is SequenceStatus.RUNNING:  # its slot was given unknown
                self.block_manager.set_token(seq, pos)
        self._took(seq, logprobs, logits, i)

    def _took(self, seq: Sequence, logprobs: list, logits: list, i: int) -> bool:
        """A token just joined the sequence: count it, keep its logprobs and logits (entry i of the
        step's, when the request asked), then the stop rules. True if it finished the sequence."""
        self.num_generated_tokens += 1
        if seq.logprobs is not None:
            logprob, top = logprobs[i]
            self._name_tokens(top)
            seq.logprobs.append(top)
            seq.cumulative_logprob += logprob
        if seq.logits is not None:
            seq.logits.append(logits[i])
        status = self.stop_checker(seq)
        if status is not None:
            self.finish(seq, status)
        return status is not None

    # --- speculative decoding (stage 8: pagedref.engine.spec_decode) -------------------------------
    def _propose(self, decodes: list[Sequence]) -> dict:
        """Drafts for the decodes that may speculate: every token known (synchronous loop), an ordinary next
        token (not a beam's candidates, not the first samples a prompt of n > 1 forks into), at most
        num_speculative_tokens and never past max_tokens or max_model_len (the k drafts and the target's
        own token must fit). seq_id -> its Draft."""
        seqs, room = [], []
        k = self.proposer.num_speculative_tokens
        for seq in decodes:
            group = seq.group
            if seq.num_placeholders or (group is not None and (group.beam is not None or (group.n > 1 and not group.forked))):
                continue
            n = k
            while n and self.stop_checker.ends_by_length(seq, n):
                n -= 1
            if n:
                seqs.append(seq)
                room.append(n)
        drafts = self.proposer.propose(seqs, room) if seqs else []
        return {seq.seq_id: d for seq, d in zip(seqs, drafts) if d is not None and d.token_ids}

    def _verify(self, entry: ScheduledSequence, sampled: SampledTokens, j: int) -> None:
        """Accept the longest prefix of drafts whose rows chose them, then the next row's token (the
        correction, or the bonus after all k); roll the rejected drafts' slots back (the block table is
        truncated, whole blocks return to the pool). Tokens join one by one through the stop rules."""
        seq, result = entry.seq, sampled.spec[j]
        drafts, rows = entry.token_ids[1:], result.token_ids
        accepted = 0
        while accepted < len(drafts) and rows[accepted] == drafts[accepted]:
            accepted += 1
        self.num_spec_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        if seq.is_finished:  # aborted while the step ran: its blocks are gone already
            return
        known = len(seq.token_ids)
        self.block_manager.kv.truncate(seq.seq_id, known + accepted)  # keep: its last token and the accepted drafts
        for r, token in enumerate(rows[:accepted + 1]):
            seq.token_ids.append(token)
            if r < accepted:  # an accepted draft: its K/V are in the cache, and now it is a known token
                seq.num_computed_tokens += 1
                self.block_manager.set_token(seq, known + r)
            if self._took(seq, result.logprobs, result.logits, r):
                return

    def _name_tokens(self, top: dict[int, Logprob]) -> None:
        for token_id, lp in top.items():
            lp.decoded_token = self.stop_checker.decode_token(token_id)

    def _fork_samples(self, group: SequenceGroup, parent: Sequence) -> None:
        """n > 1: the other n - 1 sequences share every block of the prompt's (copy-on-write). If the
        parent's blocks were taken while its sample was in flight, they are recomputed from its tokens."""
        shares = parent.status is SequenceStatus.RUNNING
        for child in group.seqs[1:]:
            if shares:
                self.block_manager.fork(parent, child)
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
            else:
                self.add(child)
        group.forked = True

    def _report_beam(self, group: SequenceGroup, seq: Sequence, sampled: SampledTokens, i: int) -> None:
        """A beam's candidates for its round (its 2 x beam_width most likely next tokens). It stays idle
        until every live beam of the request has reported; then the round is ranked and the survivors fork."""
        state = group.beam
        if seq.seq_id in state.reports:  # recomputed after its blocks were taken back: its first report stands
            return
        _, top = sampled.logprobs[i]
        self._name_tokens(top)
        state.reports[seq.seq_id] = top
        self.num_generated_tokens += 1
        if len(state.reports) < len(state.live):
            return
        survivors = beam_search.rank_round(state, self.stop_checker.eos_token_ids, self.stop_checker.max_model_len)
        children = []
        for parent, token, top in survivors:
            child = parent.fork(len(children), parent.token_ids + [token])
            child.logprobs.append(top)
            child.cumulative_logprob += top[token].logprob
            if parent.status is SequenceStatus.RUNNING:  # share the parent's blocks (K/V of its tokens)
                self.block_manager.fork(parent, child)
                self.running.append(child)
            else:  # its blocks were taken back: recomputed from its tokens (the prefix cache holds most)
                child.num_computed_tokens = 0
                self.add(child)
            children.append(child)
        for parent in state.live:  # the children hold their own references now: drop the parents'
            self.finish(parent, SequenceStatus.FINISHED_STOPPED)
        state.live, state.reports = children, {}
        group.seqs = children or group.seqs

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """The sequence is done (or aborted): it leaves its queue and its blocks are freed now."""
        if seq.status is SequenceStatus.RUNNING:  # (a running sequence is in running: one scan, not two)
            self.running.remove(seq)
        else:  # waiting or swapped; or in no queue (an idle beam whose blocks were taken back)
            for queue in (self.waiting, self.swapped):
                if seq in queue:
                    queue.remove(seq)
                    break
        seq.status = status
        self.block_manager.free(seq)
        if self.proposer is not None:  # a draft model's blocks for it go too
            self.proposer.free(seq)

    # --- read-only views --------------------------------------------------------------------------
    def num_requests(self) -> dict[str, int]:
        """Requests by state: running (holding blocks), waiting, swapped (a request counts once, where its
        first sequence in that order is)."""
        seen: set[str] = set()
        counts = {}
        for name, queue in (("running", self.running), ("swapped", self.swapped), ("waiting", self.waiting)):
            ids = {seq.request_id for seq in queue} - seen
            counts[name] = len(ids)
            seen |= ids
        return counts
