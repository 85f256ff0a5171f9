"""`SamplingParams` and `BeamSearchParams`: how to generate for one request (vLLM's names, defaults and meanings).

One idea: every parameter is checked when the object is built, so a bad request is refused with an
error naming the parameter before any work is scheduled; the engine and the sampler can then trust
them. (The sampler, which turns logits into tokens with them, is `pagedref.engine.sampling`.)

Invariant: a SamplingParams that exists is valid; greedy params (temperature 0) carry no masks.
"""

from __future__ import annotations

from dataclasses import dataclass

_SAMPLING_EPS = 1e-5  # vLLM: a temperature below this is greedy


def check_int(name: str, value, low: int | None = None, allow_none: bool = False) -> None:
    """value is an int (not a bool) of at least low (None too, where allowed), or an error naming it."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")


def _check_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


@dataclass
class SamplingParams:
    """How to generate for one prompt (vLLM's `SamplingParams`; defaults as in vLLM)."""

    n: int = 1  # independent samples of the prompt; they share its KV blocks (forked after prefill)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p
    top_k: int = -1  # keep the k most likely tokens (-1 = all)
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one's probability
    seed: int | None = None
    max_tokens: int | None = 16  # None = until max_model_len
    stop: str | list[str] | None = None  # stop strings: the text is cut before them
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None = none; 0 = the sampled token's; k = also the k most likely
    prompt_logprobs: int | None = None  # None = none; k: each prompt token's logprob (and the k most likely)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        check_int("n", self.n, 1)
        self.temperature = _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        self.top_p = _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        self.min_p = _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        check_int("max_tokens", self.max_tokens, 1, allow_none=True)
        check_int("seed", self.seed, allow_none=True)
        check_int("logprobs", self.logprobs, 0, allow_none=True)
        check_int("prompt_logprobs", self.prompt_logprobs, 0, allow_none=True)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            check_int("stop_token_ids entry", t, 0)
        if self.is_greedy:  # as vLLM: the masks mean nothing to an argmax
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS


@dataclass
class BeamSearchParams:
    """`LLM.beam_search` parameters (vLLM's `BeamSearchParams`). Beam search here is deterministic."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, 1)
        check_int("max_tokens", self.max_tokens, 1)
        if _check_number("temperature", self.temperature) != 0.0:
            raise ValueError(f"temperature must be 0 for beam search (it ranks by the model's logprobs), "
                             f"got {self.temperature}")
        self.length_penalty = _check_number("length_penalty", self.length_penalty)
