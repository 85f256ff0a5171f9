"""Beam search on copy-on-write blocks (vLLM's `LLM.beam_search`: same algorithm, same outputs).

One idea: every beam is a sequence in the engine. Each round, every live beam computes its newest
token and reports the 2 × beam_width most likely next tokens (logprobs); the best beam_width
extensions of each prompt survive. A surviving extension is a *fork* of its parent beam: it shares
all the parent's blocks (no K/V copied, none recomputed), and only the partly filled last block is
copied, by copy-on-write, when the child writes its first token into it. Parents whose extensions
all lost are dropped and their blocks freed. Between rounds a beam holds its blocks while idle
(`Sequence.keep_blocks`); if the pool runs short the scheduler may take them back first, and the
child is then recomputed from its tokens (the prefix cache usually still has them).

Ranking, as vLLM (and transformers): score = cumulative logprob / len(tokens) ** length_penalty,
where tokens include the prompt and a final eos is not counted. A beam that emits eos (unless
ignore_eos) is complete; the result is the best beam_width of the complete and the still-live beams.

Invariant: between rounds, each live beam's K/V hold exactly its tokens but the last; after the
search every block it used is free again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedref.engine.sampling import BeamSearchParams, SamplingParams
from pagedref.engine.sequence import Logprob, Sequence, SequenceStatus


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


@dataclass
class _Instance:
    prompt: str | None
    prompt_len: int
    beams: list[tuple[BeamSearchSequence, Sequence | None]]  # live beams, the engine sequence computing each
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(engine, prompts: list[tuple[str | None, list[int]]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """prompts: (text, token ids) pairs, already checked by the engine."""
    eos = engine.eos_token_ids
    # One round = compute each beam's newest token and read its top 2 × beam_width logprobs.
    round_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
    key = lambda b: get_beam_search_score(b.tokens, b.cum_logprob, eos, params.length_penalty)  # noqa: E731
    instances = []
    for i, (text, ids) in enumerate(prompts):
        seq = _beam_sequence(engine, f"beam-{i}", ids, round_params)
        engine.scheduler.add(seq)
        instances.append(_Instance(text, len(ids), [(BeamSearchSequence(list(ids)), seq)]))

    for round_ in range(params.max_tokens):
        last_round = round_ == params.max_tokens - 1
        live = [seq for inst in instances for _, seq in inst.beams]
        if not live:
            break
        while not all(seq.is_finished for seq in live):
            engine.step()
        for inst in instances:
            candidates = []
            for beam, seq in inst.beams:
                top = seq.logprobs[-1]  # the 2 × beam_width most likely next tokens (and the argmax)
                for token, lp in top.items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + lp.logprob)
                    if token in eos and not params.ignore_eos:
                        new.finish_reason, new.stop_reason = "stop", None
                        inst.completed.append(new)
                    elif len(new.tokens) >= engine.max_model_len:
                        new.finish_reason = "length"
                        inst.completed.append(new)
                    else:
                        candidates.append((new, seq))
            survivors = sorted(candidates, key=lambda c: key(c[0]), reverse=True)[: params.beam_width]
            parents = [seq for _, seq in inst.beams]
            inst.beams = [(new, None if last_round else _fork_beam(engine, parent, new.tokens, round_params))
                          for new, parent in survivors]
            for parent in parents:  # forks hold their own references now: drop the parents'
                engine.scheduler.release(parent)

    outputs = []
    for inst in instances:
        for beam, _ in inst.beams:  # still live after max_tokens
            beam.finish_reason = "length"
        best = sorted(inst.completed + [b for b, _ in inst.beams], key=key, reverse=True)[: params.beam_width]
        for beam in best:
            beam.text = engine.tokenizer.decode(beam.tokens)
        outputs.append(BeamSearchOutput(best))
    return outputs


def _beam_sequence(engine, request_id: str, tokens: list[int], params: SamplingParams) -> Sequence:
    # All of its tokens count as "prompt": the round's one sample is its only output.
    seq = engine._new_sequence(request_id, tokens, params, index=0)
    seq.keep_blocks = True
    return seq


def _fork_beam(engine, parent: Sequence, tokens: list[int], params: SamplingParams) -> Sequence:
    """A running child sharing the parent's blocks (K/V of tokens[:-1]), or, if the scheduler took
    the idle parent's blocks back, a waiting child that will be recomputed."""
    child = _beam_sequence(engine, parent.request_id, tokens, params)
    if engine.block_manager.has_blocks(parent):
        engine.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        assert child.num_computed_tokens == len(tokens) - 1
        child.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(child)
    else:
        engine.scheduler.add(child)
    return child
