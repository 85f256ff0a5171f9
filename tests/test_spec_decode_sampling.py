"""Speculative decoding's rejection sampler (pagedref/engine/spec_decode.py): the emitted tokens follow the
target's distribution, whatever the draft's (Leviathan et al. 2023, Chen et al. 2023), and they do not
when the residual correction is removed.

The test: a small vocabulary (8 tokens), a target distribution p and a draft distribution q that differ a
lot. N = 200,000 independent trials, each a row of `verify_rows` (rows are independent by construction):
a draft token drawn from q, kept or replaced by the rule. The emitted tokens' counts are compared with
N * p by Pearson's chi-square test with 7 degrees of freedom; the test passes at significance 0.001 (the
p-value must be above it), with a draft model's q and with prompt lookup's deterministic drafts (q one-hot).
With the correction removed (a rejected row draws from p instead of max(0, p - q)), the same test
rejects the hypothesis with a p-value below 1e-12: the draft's bias stays.
"""

from __future__ import annotations

import torch

from pagedref.engine.sampling import SamplingParams
from pagedref.engine.scheduler import ScheduledSequence
from pagedref.engine.sequence import Sequence
from pagedref.engine.spec_decode import RejectionSampler, verify_rows

N = 200_000
SIGNIFICANCE = 1e-3
P = torch.tensor([0.30, 0.02, 0.15, 0.08, 0.20, 0.05, 0.12, 0.08], dtype=torch.float64)  # the target
Q = torch.tensor([0.05, 0.30, 0.05, 0.25, 0.05, 0.20, 0.05, 0.05], dtype=torch.float64)  # a poor draft


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs: P(chi2 with len - 1 degrees of freedom >= the statistic)."""
    expected = counts.sum() * probs
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def emitted_counts(draft_probs: torch.Tensor | None, correction: bool, seed: int = 0) -> torch.Tensor:
    """N trials of one verified row: draft ~ q (or a fixed token, for a deterministic proposal)."""
    g = torch.Generator().manual_seed(seed)
    q = Q if draft_probs is None else draft_probs
    drafts = torch.multinomial(q, N, replacement=True, generator=g)  # [N]
    uniforms = torch.rand(N, generator=g, dtype=torch.float64)
    races = torch.empty(N + 1, len(P), dtype=torch.float64).exponential_(generator=g)
    target = P.expand(N + 1, -1)
    per_row_q = None if draft_probs is None else draft_probs.expand(N, -1)
    tokens = verify_rows(target, drafts, per_row_q, uniforms, races, correction)[:N]  # the bonus row is not a trial
    return torch.bincount(tokens, minlength=len(P)).to(torch.float64)


def test_emitted_tokens_follow_the_target_with_a_draft_models_q():
    counts = emitted_counts(Q, correction=True)
    p_value = chi_square_p_value(counts, P)
    assert p_value > SIGNIFICANCE, f"chi-square p-value {p_value:.3g}: the emitted tokens do not follow p ({counts})"


def test_emitted_tokens_follow_the_target_with_deterministic_drafts():
    # prompt lookup's drafts come from the text, not from a distribution: q is one-hot at each draft (here
    # the drafts vary from row to row, drawn from Q only to make them varied)
    counts = emitted_counts(None, correction=True, seed=1)
    p_value = chi_square_p_value(counts, P)
    assert p_value > SIGNIFICANCE, f"chi-square p-value {p_value:.3g}: the emitted tokens do not follow p ({counts})"


def test_without_the_correction_the_test_fails():
    for draft_probs in (Q, None):
        counts = emitted_counts(draft_probs, correction=False, seed=2)
        p_value = chi_square_p_value(counts, P)
        assert p_value < 1e-12, f"without the residual the draft's bias must show: p-value {p_value:.3g}"


def test_the_chi_square_test_itself_accepts_p_and_rejects_q():
    g = torch.Generator().manual_seed(3)
    from_p = torch.bincount(torch.multinomial(P, N, replacement=True, generator=g), minlength=len(P)).double()
    assert chi_square_p_value(from_p, P) > SIGNIFICANCE
    assert chi_square_p_value(from_p, Q) < 1e-12


def test_a_rejected_row_never_emits_its_draft_and_a_sure_draft_is_always_kept():
    g = torch.Generator().manual_seed(4)
    k = 1000
    drafts = torch.multinomial(Q, k, replacement=True, generator=g)
    uniforms = torch.rand(k, generator=g, dtype=torch.float64)
    races = torch.empty(k + 1, len(P), dtype=torch.float64).exponential_(generator=g)
    tokens = verify_rows(P.expand(k + 1, -1), drafts, Q.expand(k, -1), uniforms, races)[:k]
    accepted = tokens == drafts
    ratio = (P[drafts] / Q[drafts]).clamp(max=1)
    assert accepted[ratio == 1].all(), "a draft the target likes at least as much as the draft model is always kept"
    assert (uniforms[~accepted] * Q[drafts[~accepted]] >= P[drafts[~accepted]]).all(), \
        "a row emits another token than its draft only when the draft was rejected"
    # greedy-like target: all mass on one token; a draft of it is always kept, any other always replaced by it
    one_hot = torch.zeros(len(P), dtype=torch.float64)
    one_hot[2] = 1.0
    tokens = verify_rows(one_hot.expand(k + 1, -1), drafts, None, uniforms, races)
    assert (tokens == 2).all()


def test_the_rejection_sampler_reads_each_sequences_own_generator_and_is_reproducible():
    vocab, k = 8, 3
    logits = torch.log(P.float()).expand(2 * (k + 1), -1).contiguous()

    def entry(seed: int | None) -> ScheduledSequence:
        params = SamplingParams(temperature=1.0) if seed is not None else SamplingParams(temperature=0.0)
        seq = Sequence(seed or 0, "r", [1, 2, 3], 3, params,
                       generator=None if seed is None else torch.Generator().manual_seed(seed))
        e = ScheduledSequence(seq, k + 1, 2, [3, 4, 5, 6], [0], [2, 3, 4, 5], [])
        e.num_draft_tokens = k
        return e

    sampler = RejectionSampler()
    first = sampler(logits, [entry(7), entry(None)])
    again = sampler(logits, [entry(7), entry(None)])
    assert torch.equal(first, again), "the same seed gives the same rows"
    assert first[k + 1:].tolist() == [0] * (k + 1), "a greedy sequence's rows take their argmax"
    assert first.shape == (2 * (k + 1),) and int(first.max()) < vocab
