"""When a sequence stops (vLLM's `StopChecker`), and the text its tokens add to the prompt's.

One idea: after each appended token, one function decides whether the sequence is done, by vLLM's
rules in vLLM's order: length (max_tokens, or max_model_len reached), eos unless ignore_eos, a stop
token id; then a stop string found in the text stops it too (even on its last allowed token) and
cuts the text. The text of a sequence is decoded after its prompt, as vLLM does, so a leading space
("▁he") is kept: " he". `Scheduler.update` calls the checker; nothing else finishes a sequence but
it and `abort_request`.

Invariant: the checker reads a sequence and writes only its `stop_reason` and cut `text`; the status it
returns is applied by the scheduler, which frees the sequence's blocks at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedref.engine.sequence import Sequence, SequenceStatus


def detokenize(tokenizer, seq: Sequence, num_tokens: int) -> str:
    """The text the sequence's output tokens (up to num_tokens tokens in all) add to its prompt's text.
    Decoded after the prompt, as vLLM does, so a leading space ("▁he") is kept: " he"."""
    skip = seq.params.skip_special_tokens
    if seq.prompt_text is None:  # the prompt never changes: decode it once, not at every step's stop check
        seq.prompt_text = tokenizer.decode(seq.token_ids[:seq.num_prompt_tokens], skip_special_tokens=skip)
    prompt = seq.prompt_text
    ids = seq.token_ids if num_tokens == len(seq.token_ids) else seq.token_ids[:num_tokens]  # (the stop checks': all)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    if full.startswith(prompt):
        return full[len(prompt):]
    return tokenizer.decode(seq.token_ids[seq.num_prompt_tokens:num_tokens], skip_special_tokens=skip)


def decode_output(tokenizer, seq: Sequence, num_tokens: int, status: SequenceStatus) -> str:
    """The text of the output as it stood (num_tokens, status) when it was reported."""
    if status is SequenceStatus.FINISHED_STOPPED and not seq.params.include_stop_str_in_output:
        num_tokens -= 1  # as vLLM: the eos / stop token is in token_ids, not in the text
    return detokenize(tokenizer, seq, num_tokens)


@dataclass
class StopChecker:
    """The stop rules of one engine: its max_model_len, its model's eos ids, its tokenizer (stop strings).
    The default checks max_tokens only (a scheduler driven by hand, without a model)."""

    max_model_len: int | None = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    tokenizer: Any = None

    def __call__(self, seq: Sequence) -> SequenceStatus | None:
        """The finished status the sequence's last token gives it, or None: it goes on."""
        p, token = seq.params, seq.token_ids[-1]
        status = None
        if ((self.max_model_len is not None and seq.num_tokens >= self.max_model_len)
                or (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens)):
            status = SequenceStatus.FINISHED_LENGTH_CAPPED
        elif not p.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        elif token in p.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if p.stop and self.tokenizer is not None:
            text = detokenize(self.tokenizer, seq, seq.num_tokens)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                at, stop = min(hits)
                seq.stop_reason = stop
                seq.text = text[:at + len(stop)] if p.include_stop_str_in_output else text[:at]
                return SequenceStatus.FINISHED_STOPPED
        return status

    def ends_by_length(self, seq: Sequence, num_more: int) -> bool:
        """Would num_more more tokens (counting those in flight) reach max_tokens or max_model_len? Known
        before they are sampled: the scheduler schedules no step past such a token."""
        p = seq.params
        n = seq.num_tokens + seq.num_placeholders + num_more
        return ((self.max_model_len is not None and n >= self.max_model_len)
                or (p.max_tokens is not None and n - seq.num_prompt_tokens >= p.max_tokens))

    def decode_token(self, token_id: int) -> str | None:
        """One token's text for a Logprob (special tokens kept), or None without a tokenizer."""
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)
