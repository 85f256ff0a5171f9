"""SamplingParams and the sampler on synthetic logits: validation, the masks, the draw, logprobs, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from pagedref.engine.sampling import (BeamSearchParams, Sampler, SamplingParams, make_generator, row_logprobs,
                                      sample_row)
from pagedref.engine.sequence import Sequence

LOGITS = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1]))  # token probabilities, as logits


@pytest.mark.parametrize("kwargs, name", [
    (dict(n=0), "n"), (dict(n=-1), "n"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=-1), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
])
def test_bad_sampling_params_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, name", [(dict(n=1.5), "n"), (dict(temperature="hot"), "temperature"),
                                          (dict(seed=1.0), "seed"), (dict(max_tokens=True), "max_tokens")])
def test_sampling_params_of_the_wrong_type_are_refused_by_name(kwargs, name):
    with pytest.raises(TypeError, match=name):
        SamplingParams(**kwargs)


def test_defaults_are_vllms_and_greedy_ignores_the_masks():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.seed) == (1, 1.0, 1.0, -1, 0.0, 16, None)
    g = SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.2)
    assert g.is_greedy and (g.top_k, g.top_p, g.min_p) == (-1, 1.0, 0.0)
    assert SamplingParams(stop="x").stop == ["x"]


def test_bad_beam_search_params_are_refused_by_name():
    for kwargs, name in [(dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
                         (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature")]:
        with pytest.raises(ValueError, match=name):
            BeamSearchParams(**kwargs)


def test_greedy_is_the_argmax_and_the_first_one_on_ties():
    assert sample_row(LOGITS, SamplingParams(temperature=0), None) == 1
    tie = torch.tensor([0.0, 2.0, 1.0, 2.0])
    assert sample_row(tie, SamplingParams(temperature=0), None) == 1


def draws(params: SamplingParams, n: int = 4000, seed: int = 0) -> list[int]:
    g = make_generator(seed, "cpu")
    return [sample_row(LOGITS, params, g) for _ in range(n)]


def frequencies(tokens: list[int]) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(len(LOGITS))]


def test_the_exponential_race_draws_each_token_with_its_probability():
    freq = frequencies(draws(SamplingParams(temperature=1.0), n=20000))
    for f, p in zip(freq, LOGITS.exp().tolist()):
        assert abs(f - p) < 0.015, f"frequency {f} for probability {p}"


def test_temperature_sharpens_or_flattens():
    sharp = frequencies(draws(SamplingParams(temperature=0.25)))
    flat = frequencies(draws(SamplingParams(temperature=4.0)))
    assert sharp[1] > 0.6 and max(flat) - min(flat) < 0.15


def test_top_k_keeps_the_k_most_likely():
    assert set(draws(SamplingParams(top_k=2))) == {1, 2}
    assert set(draws(SamplingParams(top_k=1, temperature=2.0))) == {1}


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    assert set(draws(SamplingParams(top_p=0.7))) == {1, 2}  # 0.4 + 0.3 reaches 0.7
    assert set(draws(SamplingParams(top_p=0.71))) == {1, 2, 3}
    assert set(draws(SamplingParams(top_p=0.1))) == {1}  # the top token is always kept


def test_min_p_drops_tokens_far_less_likely_than_the_top_one():
    assert set(draws(SamplingParams(min_p=0.3))) == {1, 2, 3}  # 0.15 >= 0.3 * 0.4, 0.1 is not
    assert set(draws(SamplingParams(min_p=1.0))) == {1}


def test_logprobs_are_the_raw_log_softmax_with_ranks():
    x = torch.randn(50, generator=torch.Generator().manual_seed(0))
    lp = torch.log_softmax(x, -1)
    token = int(lp.argsort()[10])  # an unlikely token: rank 40
    chosen, top = row_logprobs(x, token, 3)
    assert chosen == float(lp[token])
    assert list(top)[:3] == lp.topk(3).indices.tolist() and [v.rank for v in top.values()] == [1, 2, 3, 40]
    assert top[token].logprob == chosen and math.isclose(sum(math.exp(v) for v in lp.tolist()), 1.0, rel_tol=1e-5)


def seq(seq_id: int, params: SamplingParams) -> Sequence:
    s = Sequence(seq_id, str(seq_id), [1], 1, params)
    s.generator = make_generator(params.seed, "cpu")
    return s


def test_a_seeded_sequence_draws_the_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=42, logprobs=1)
    logits = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    sampler = Sampler()
    s = seq(0, params)
    alone = [sampler(logits[i:i + 1], [0], [s])[0].token_id for i in range(8)]  # 8 steps on its own
    s = seq(0, params)
    for i in range(8):  # the same sequence, now with 7 other rows and sequences around it
        others = [seq(k, SamplingParams(temperature=1.0, seed=k)) for k in range(1, 8)]
        order = [*range(i), *range(i + 1, 8)]
        rows = [i] + order
        results = sampler(logits, rows, [s] + others)
        assert results[0].token_id == alone[i]


def test_batched_sampler_equals_sample_row_bit_for_bit():
    """The GPU batches rows that share their settings; each row must still draw exactly what it would alone."""
    sampler = Sampler()
    sampler.rows_per_batch = lambda logits: logits.shape[0]  # force the GPU's batching on the CPU
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01)
    seqs = [seq(i, SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, seed=i)) for i in range(6)]
    got = [r.token_id for r in sampler(logits, list(range(6)), seqs)]
    assert got == [sample_row(logits[i], params, make_generator(i, "cpu")) for i in range(6)]
