"""Beam search on copy-on-write blocks (vLLM's `LLM.beam_search`: same algorithm, same outputs).

One idea: every beam is a sequence in the engine, and a request of beam search goes through the same
step contract as any other. Each round, every live beam computes its newest token and reports the
2 × beam_width most likely next tokens (its logprobs); when every live beam of the request has
reported, `Scheduler.update` ranks them (`rank_round`) and the best beam_width extensions survive.
A surviving extension is a *fork* of its parent beam: it shares all the parent's blocks (no K/V
copied, none recomputed), and only the partly filled last block is copied, by copy-on-write, when the
child writes its first token into it. Parents are then freed. Between its report and the ranking a
beam is idle (nothing to compute) and keeps its blocks; if the pool runs short the scheduler takes
them back first, and its children are then recomputed from their tokens (the prefix cache usually
still has them).

Ranking, as vLLM (and transformers): score = cumulative logprob / len(tokens) ** length_penalty,
where tokens include the prompt and a final eos is not counted. A beam that emits eos (unless
ignore_eos) is complete; the result is the best beam_width of the complete and the still-live beams.

Invariant: between rounds, each live beam's K/V hold exactly its tokens but the last; after the
search every block it used is free again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedref.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedref.engine.sequence import Logprob, RequestOutput, Sequence


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_ids, length_penalty: float = 1.0) -> float:
    seq_len = len(tokens)
    if tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)


def round_params(params: BeamSearchParams) -> SamplingParams:
    """What every beam of a search samples with: greedy, and its 2 × beam_width most likely next tokens."""
    return SamplingParams(temperature=0.0, max_tokens=None, logprobs=2 * params.beam_width, ignore_eos=True)


@dataclass
class BeamState:
    """One request's search: its live beams (engine sequences, best first), their reports this round,
    the beams already complete, and, once done, the result."""

    params: BeamSearchParams
    live: list[Sequence]
    reports: dict[int, dict[int, Logprob]] = field(default_factory=dict)  # seq_id -> its candidates this round
    completed: list[BeamSearchSequence] = field(default_factory=list)
    round: int = 0
    done: bool = False
    results: list[BeamSearchSequence] = field(default_factory=list)  # best first, once done


def rank_round(state: BeamState, eos_token_ids, max_model_len: int | None) -> list[tuple[Sequence, int, dict[int, Logprob]]]:
    """Rank the round every live beam has reported: the survivors (parent, token, its candidates) to fork,
    best first; none, and state.done with the results, when the search ends here."""
    params = state.params
    key = lambda b: get_beam_search_score(b.tokens, b.cum_logprob, eos_token_ids, params.length_penalty)  # noqa: E731
    candidates = []
    for seq in state.live:
        top = state.reports[seq.seq_id]
        for token, lp in top.items():
            new = BeamSearchSequence(seq.token_ids + [token], seq.logprobs + [top], seq.cumulative_logprob + lp.logprob)
            if token in eos_token_ids and not params.ignore_eos:
                new.finish_reason, new.stop_reason = "stop", None
                state.completed.append(new)
            elif max_model_len is not None and len(new.tokens) >= max_model_len:
                new.finish_reason = "length"
                state.completed.append(new)
            else:
                candidates.append((new, seq, token, top))
    survivors = sorted(candidates, key=lambda c: key(c[0]), reverse=True)[: params.beam_width]
    state.round += 1
    if survivors and state.round < params.max_tokens:
        return [(seq, token, top) for _, seq, token, top in survivors]
    for new, *_ in survivors:  # still live after max_tokens
        new.finish_reason = "length"
    state.results = sorted(state.completed + [new for new, *_ in survivors], key=key, reverse=True)[: params.beam_width]
    state.done = True
    return []


def to_output(request: RequestOutput, tokenizer) -> BeamSearchOutput:
    """The BeamSearchOutput of a finished beam-search request's RequestOutput (one completion per beam)."""
    sequences = []
    for c in request.outputs:
        tokens = request.prompt_token_ids + c.token_ids
        sequences.append(BeamSearchSequence(tokens, c.logprobs, c.cumulative_logprob, tokenizer.decode(tokens),
                                            c.finish_reason, c.stop_reason))
    return BeamSearchOutput(sequences)


def beam_search(engine, prompts: list[tuple[str | None, list[int]]], params: BeamSearchParams,
                request_prefix: str = "beam") -> list[BeamSearchOutput]:
    """Every prompt ((text, token ids) pairs, already checked by the engine) searched to the end through
    the engine's public loop (`add_request`, `step`)."""
    ids = [f"{request_prefix}-{i}" for i in range(len(prompts))]
    for rid, (text, token_ids) in zip(ids, prompts):
        engine.add_request(rid, {"prompt": text, "prompt_token_ids": token_ids}, params)
    done: dict[str, RequestOutput] = {}
    while len(done) < len(ids):
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"beam search requests {sorted(set(ids) - done.keys())} were aborted before they finished")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [to_output(done[rid], engine.tokenizer) for rid in ids]
