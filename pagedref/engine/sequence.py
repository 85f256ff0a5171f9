"""A request and its sequences as the engine sees them, and the outputs handed back (vLLM's shapes).

One idea: a sequence is a list of token ids plus one number, `num_computed_tokens`, the tokens
whose K/V are already in the cache. Everything the scheduler decides follows from it: a sequence
with `num_tokens - num_computed_tokens` > 1 still has prompt to prefill (a chunk of it may be
scheduled); with exactly 1 it decodes (its last sampled token is the step's input); it samples a
new token in the step that brings `num_computed_tokens` up to `num_tokens`. Preemption by
recompute just sets `num_computed_tokens = 0`: the prompt *and* the generated tokens are prefilled
again later, and the sequence carries on as if nothing happened.

Invariant: 0 <= num_computed_tokens <= num_tokens, and a sequence that holds blocks in the device
pool holds exactly the slots of its first num_computed_tokens tokens (plus, during a step, the slots
of the tokens scheduled in it).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from pagedref.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
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
    params: "SamplingParams"
    index: int = 0  # which of the request's n samples (or which beam)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    generator: torch.Generator | None = None  # this sequence's own random stream (seed or engine seed)
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (when logprobs asked)
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token (when logprobs asked)
    logits: list[torch.Tensor] | None = None  # per generated token, [vocab] float32 (LLM(record_logits=True))
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    text: str | None = None  # set when a stop string cut the text; otherwise decoded on demand
    keep_blocks: bool = False  # beam search: a finished beam keeps its blocks until it is forked or dropped
    prompt_text: str | None = None  # the prompt decoded, once (stop strings are checked at every step)

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
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token is missing from the cache: prompt (or recompute) to prefill."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


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
    params: "SamplingParams"
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    forked: bool = False  # n > 1: the n sequences exist (forked after the prompt's prefill)

    @property
    def is_finished(self) -> bool:
        """All n sequences exist (n > 1: forked after the prefill) and all are finished."""
        return (self.params.n == 1 or self.forked) and all(s.is_finished for s in self.seqs)


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
