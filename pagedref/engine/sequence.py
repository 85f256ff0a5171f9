"""A request and its sequences as the engine sees them, and the outputs handed back (vLLM's shapes).

One idea: a sequence is a list of token ids plus one number, `num_computed_tokens`, the tokens
whose K/V are in the cache or being computed by a step already scheduled. Everything the scheduler
decides follows from it: a sequence with more than one token to compute still has prompt to
prefill (a chunk of it may be scheduled); with exactly 1 it decodes (its last sampled token is the
step's input); it samples a new token in the step that brings `num_computed_tokens` up to its
tokens. Preemption by recompute just sets `num_computed_tokens = 0`: the prompt *and* the generated
tokens are prefilled again later, and the sequence carries on as if nothing happened.

A token a scheduled step will sample is counted at once as a *placeholder* (`num_placeholders`, vLLM
v1's output placeholders) until `Scheduler.update` appends the real one: so the next step can be
scheduled before it is known (async scheduling; the runner then reads it on the device). In the
synchronous loop every placeholder is resolved before the next `schedule()`. A sequence with nothing
to compute (0 tokens) is *idle*: its next token waits on a decision that is not its own (beam search
ranks the round's candidates) or is still in flight.

Only the Scheduler (and the Sequence's own methods) write this state: `schedule()` and `update()`.

Invariant: 0 <= num_computed_tokens <= num_tokens + num_placeholders, and a sequence that holds
blocks in the device pool holds exactly the slots of its first num_computed_tokens tokens.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pagedref.engine.sampling_params import BeamSearchParams, SamplingParams

_seq_ids = itertools.count()


def next_seq_id() -> int:
    """A sequence id unique in this process (the block manager keys its tables by it)."""
    return next(_seq_ids)


class SequenceStatus(enum.IntEnum):  # (int members: the update of every step looks them up, see is_finished)
    WAITING = enum.auto()  # holds no blocks: new, or preempted by recompute
    RUNNING = enum.auto()  # holds blocks in the device pool (prefilling or decoding)
    SWAPPED = enum.auto()  # preempted by swap: its blocks wait in the CPU swap pool
    FINISHED_STOPPED = enum.auto()  # eos, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens, or the sequence reached max_model_len
    FINISHED_ABORTED = enum.auto()  # abort_request

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Logprob:
    """One token's log-probability under the model (raw logits, before temperature/top-k/top-p)."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    index: int = 0  # which of the request's n samples (or which beam)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache, or computed by a step already scheduled
    num_placeholders: int = 0  # tokens sampled by scheduled steps, not yet appended (0 or 1; 2 with async scheduling)
    generator: torch.Generator | None = None  # this sequence's own random stream (seed or engine seed)
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (when logprobs asked)
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token (when logprobs asked)
    logits: list[torch.Tensor] | None = None  # per generated token, [vocab] float32 (LLM(record_logits=True))
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    text: str | None = None  # set when a stop string cut the text; otherwise decoded on demand
    prompt_text: str | None = None  # the prompt decoded, once (stop strings are checked at every step)
    group: "SequenceGroup | None" = field(default=None, repr=False)  # its request (None: a sequence on its own)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]  # a slice: a new list (outputs keep it as a snapshot)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens to compute: the known ones not computed yet, and the placeholder of a token in flight."""
        return len(self.token_ids) + self.num_placeholders - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token is missing from the cache: prompt (or recompute) to prefill."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_idle(self) -> bool:
        """Nothing to compute: its next token is a decision not its own (beam search) or still in flight."""
        return self.num_uncomputed_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def fork(self, index: int, token_ids: list[int] | None = None, generator: torch.Generator | None = None) -> "Sequence":
        """A new sequence of the same request with the same history (the n samples of a prompt, a beam's
        extension): tokens (token_ids, or a copy of this one's), computed count, logprobs and recorded
        logits. Its blocks are the block manager's business (`BlockManager.fork`)."""
        child = Sequence(next_seq_id(), self.request_id, list(self.token_ids if token_ids is None else token_ids),
                         self.num_prompt_tokens, self.params, index, self.status, self.num_computed_tokens,
                         generator=generator, cumulative_logprob=self.cumulative_logprob,
                         logprobs=None if self.logprobs is None else list(self.logprobs),
                         logits=None if self.logits is None else list(self.logits), prompt_text=self.prompt_text,
                         group=self.group)
        return child


@dataclass
class RequestMetrics:
    """Wall-clock times of one request (time.monotonic()), for latency benchmarks."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class SequenceGroup:
    """One request: its prompt, its parameters and its sequences (n samples, or the beams)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    seqs: list[Sequence] = field(default_factory=list)  # the n samples (made at once; forked after the prefill), or the live beams
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    forked: bool = False  # n > 1: the prompt's prefill has sampled, and the n sequences are forked off it
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token (first: None), when asked
    beam: Any = None  # beam search's state (`pagedref.engine.beam_search.BeamState`); None: sampling

    @property
    def n(self) -> int:
        return self.params.n if isinstance(self.params, SamplingParams) else 1

    @property
    def is_finished(self) -> bool:
        """Beam search: its last round is ranked. Otherwise all n sequences (forked after the prefill) are finished."""
        if self.beam is not None:
            return self.beam.done
        if self.params.n > 1 and not self.forked:  # (sampling: SamplingParams)
            return False
        for seq in self.seqs:  # (a loop, not all() over a generator: the engine asks every request each step)
            if not seq.status.is_finished:
                return False
        return True


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's `CompletionOutput`).

    `text` is decoded when first read (a step of the engine returns outputs of every request that
    advanced, and decoding them all each step would cost more than the step on a fast GPU).
    `logits` is pagedref's debugging hook: with `LLM(record_logits=True)` it is the [num_tokens, vocab]
    float32 logits that chose each token (the batch-invariance tests compare them bit for bit).
    """

    index: int
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logits: torch.Tensor | None = None
    _text: str | None = field(default=None, repr=False)
    _decode: Callable[[], str] | None = field(default=None, repr=False, compare=False)

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._decode() if self._decode is not None else ""
        return self._text

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"cumulative_logprob={self.cumulative_logprob}, finish_reason={self.finish_reason!r}, "
                f"stop_reason={self.stop_reason!r})")


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt, and `LLMEngine.step` per request that advanced."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens that were found in the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, {token: Logprob}, ...] when asked
