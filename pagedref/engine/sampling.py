"""Sampling: the sampler that turns logits into tokens, with `SamplingParams` (pagedref.engine.sampling_params).

One idea: a token is drawn from one row of logits using only that row, that request's parameters
and that sequence's own `torch.Generator`, so the choice never depends on what else is in the batch.
- greedy (temperature 0): argmax (the first maximum on ties, as llama2.c and transformers do);
- otherwise: logits / temperature → softmax → min_p, top_k, top_p masks → one draw by the
  "exponential race": argmax(p_i / E_i) with E_i ~ Exp(1) from the sequence's generator, which picks
  token i with probability p_i (vLLM's sampler does the same; it needs no normalisation and no sort).
- seed: the sequence's generator is seeded with `seed + index` (index = which of the n samples; vLLM
  v1's rule), so a seeded request gives the same tokens alone or in any batch; unseeded sequences get
  a seed from the engine's own random stream (`LLM(seed=...)`), so whole runs are reproducible too.
- logprobs are of the raw model distribution (log_softmax of the logits, before temperature and
  masks: vLLM's default), for the sampled token and, with logprobs=k, the k most likely ones.

On a GPU the `Sampler` batches for speed: rows with the same settings go through the softmax and masks
as one [rows, vocab] tensor (one kernel per op instead of one per row and op: those per-row launches
cost more than the math; on the CPU it keeps one row per batch, see `Sampler.rows_per_batch`). Every one of those ops works on each row on its own (elementwise, or along the
vocab dimension), so each row's result equals `sample_row` on that row alone, bit for bit; only the
random draws stay per sequence, from each sequence's own generator.

Invariant (CPU path): a request's tokens and logprobs are bit-identical whatever the batch (equal to
`sample_row` on its row alone); bad parameters are refused when SamplingParams is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedref.engine.sampling_params import BeamSearchParams, SamplingParams  # noqa: F401 (re-exported: their old home)
from pagedref.engine.sequence import Logprob, Sequence

@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # of the sampled token (when logprobs were asked)
    top_logprobs: dict[int, Logprob] | None = None  # sampled + top-k (when logprobs were asked)


@dataclass
class SamplerOutput:
    """One step's samples as `Scheduler.update` reads them: one entry per sampling sequence, in the order
    of `SchedulerOutput.sampling_seqs()` (the model runner's output has the same fields)."""

    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, Logprob]] | None] | None = None  # where the sequence asked for logprobs
    logits: list[torch.Tensor | None] | None = None  # [vocab] float32 on the CPU, where the sequence records them
    prompt_logprobs: list[tuple[Sequence, int, list[dict[int, Logprob]]]] | None = None  # (seq, first position, per token)
    spec: list | None = None  # speculative decoding: per speculating entry, its rows' tokens (`spec_decode.SpecTokens`)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits [vocab] (float32)."""
    if params.is_greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits / params.temperature, dim=-1)  # [vocab]
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the more likely tokens
        drop = mass_before >= params.top_p * sorted_probs.sum()  # already reached top_p without this one
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    race = torch.empty_like(probs).exponential_(generator=generator)  # E_i ~ Exp(1)
    return int((probs / race).argmax())


def row_logprobs(logits: torch.Tensor, token_id: int, k: int) -> tuple[float, dict[int, Logprob]]:
    """(logprob of token_id, {token: Logprob} for it and the k most likely) from one row [vocab]."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp[token_id]
    top = {}
    if k > 0:
        values, ids = torch.topk(lp, min(k, lp.shape[-1]))
        for rank, (t, v) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
            top[t] = Logprob(v, rank)
    if token_id not in top:
        top[token_id] = Logprob(float(chosen), int((lp > chosen).sum()) + 1)
    return float(chosen), top


def sampling_key(params: SamplingParams) -> tuple[float, float, int, float]:
    """Rows whose parameters share this key are sampled as one batch."""
    return params.temperature, params.min_p, params.top_k, params.top_p


def sample_rows(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator | None],
                race: torch.Tensor | None = None) -> torch.Tensor:
    """`sample_row` for several rows [rows, vocab] with the same (non-greedy) params, as whole-batch ops.
    Each op acts on every row separately, so row i gives what `sample_row(logits[i], params,
    generators[i])` gives. `race` (E ~ Exp(1), [rows, vocab]) may be drawn already (see Sampler)."""
    probs = processed_probs(logits, params)
    if race is None:
        race = torch.empty_like(probs)
        for row, generator in zip(race, generators):  # one stream per sequence: never batched
            row.exponential_(generator=generator)
    return (probs / race).argmax(-1)  # [rows] int64, on the logits' device (no host sync)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a (non-greedy) sample is drawn from, per row of logits [rows, vocab]: softmax at the
    temperature, then the min_p, top_k and top_p masks (left unnormalised: the race needs no sum). The
    sampler's own ops, so speculative decoding's rejection sampler holds the target (and a draft model)
    to exactly the distribution an ordinary step samples from."""
    probs = torch.softmax(logits / params.temperature, dim=-1)  # [rows, vocab]
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k, dim=-1).values[:, -1:]  # [rows, 1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # The total per row as sample_row takes it, a whole-tensor sum of the row: a sum over a dim of
        # the batch may add in another order (torch splits a long 1-D sum over threads), so another bit.
        total = torch.stack([row.sum() for row in sorted_probs]).unsqueeze(-1)  # [rows, 1]
        drop = mass_before >= params.top_p * total
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


class Sampler:
    """Samples one token per sequence from its row of the step's logits."""

    def rows_per_batch(self, logits: torch.Tensor) -> int:
        """How many rows one batched op takes. A GPU: all of them (per-row kernel launches, ~10 per row,
        cost more than the math). The CPU: one. There the ops are math-bound and one row's temporaries
        stay in cache; measured at 256 rows x 32000: whole batches ran up to 1.5x slower than row by
        row, chunks of 2-8 rows no faster."""
        return max(1, logits.shape[0]) if logits.device.type != "cpu" else 1

    def __call__(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> list[SampleResult]:
        """logits [R, vocab] float32; seqs[i] samples from logits[rows[i]] (several sequences may share
        a row: the n samples of a prompt, right after its prefill)."""
        tokens = self.sample_tokens(logits, rows, seqs).tolist()
        results = [SampleResult(token) for token in tokens]
        for row, seq, result in zip(rows, seqs, results):
            if seq.params.logprobs is not None:
                result.logprob, result.top_logprobs = row_logprobs(logits[row], result.token_id, seq.params.logprobs)
        return results

    def sample_tokens(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
                      index=None) -> torch.Tensor:
        """The tokens [len(seqs)] int64, on the logits' device, with no host sync on the way (so a step's
        tokens can stay on the GPU for the next step while the host schedules it: async scheduling).
        index(list) -> an int64 tensor on the logits' device (the runner passes one that copies from
        pinned memory without a sync; by default torch.tensor)."""
        if not seqs:  # a step of prefill chunks only: nobody samples
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        index = index or (lambda xs: torch.tensor(xs, dtype=torch.int64, device=logits.device))
        greedy = [seq.params.is_greedy for seq in seqs]
        if all(greedy):  # argmax involves no arithmetic: the batched argmax equals the per-row ones exactly
            argmax = logits.argmax(-1)
            return argmax if rows == list(range(logits.shape[0])) else argmax[index(rows)]
        tokens = torch.zeros(len(seqs), dtype=torch.int64, device=logits.device)
        if any(greedy):
            picked = [i for i, g in enumerate(greedy) if g]
            tokens[index(picked)] = logits.argmax(-1)[index([rows[i] for i in picked])]
        groups: dict[tuple, list[int]] = {}  # sampling key -> indices into seqs, in batch order
        for i, seq in enumerate(seqs):
            if not greedy[i]:
                groups.setdefault(sampling_key(seq.params), []).append(i)
        races = self._draw_in_batch_order(logits, groups, seqs)
        step = self.rows_per_batch(logits)
        for key, members in groups.items():
            for start in range(0, len(members), step):
                chunk = members[start:start + step]
                x = logits.index_select(0, index([rows[i] for i in chunk]))  # [chunk rows, vocab]
                race = races[key][start:start + step] if races else None  # None: drawn in sample_rows
                drawn = sample_rows(x, seqs[chunk[0]].params, [seqs[i].generator for i in chunk], race)
                tokens[index(chunk)] = drawn
        return tokens

    @staticmethod
    def _draw_in_batch_order(logits: torch.Tensor, groups: dict[tuple, list[int]],
                             seqs: list[Sequence]) -> dict[tuple, torch.Tensor] | None:
        """A sequence without its own generator draws from torch's global one, where the order of the
        draws matters: then draw every race now, in batch order, as one row at a time would. (The
        engine gives every sampling sequence a generator, so it never comes here: None.)"""
        if all(seqs[i].generator is not None for members in groups.values() for i in members):
            return None
        races = {key: torch.empty((len(members), logits.shape[-1]), dtype=logits.dtype, device=logits.device)
                 for key, members in groups.items()}
        where = {i: (key, j) for key, members in groups.items() for j, i in enumerate(members)}
        for i in sorted(where):
            key, j = where[i]
            races[key][j].exponential_(generator=seqs[i].generator)
        return races
