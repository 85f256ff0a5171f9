"""Stage 8 — speculative decoding on paged blocks: guess k tokens cheaply, let the target check them at once.

One idea: a decode step reads every weight of the model to produce one token per sequence, so it costs
about the same for 1 query row as for k + 1. Speculative decoding (Leviathan et al., ICML 2023; Chen et
al., 2023) fills those rows: a cheap *proposer* guesses the next k tokens (the *draft*), the target model
scores the sequence's last token and the k drafts in one forward pass (k + 1 query rows over the paged
context: the prefill path, in the middle of decoding), and the longest prefix of drafts the target
agrees with is kept, plus one token of the target's own. Each step emits between 1 and k + 1 tokens.

- **Proposers** (`propose(seqs, num_tokens)` → a `Draft` per sequence, or None):
  - `NgramProposer`, prompt lookup (vLLM's "ngram"): the sequence's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) are searched earlier in its own text; the tokens that
    followed their latest earlier occurrence are the draft. Free, and right exactly when the output
    copies its input (edits, extraction, code).
  - `DraftModelProposer`: a smaller model with the same vocabulary runs k steps of its own, on its own
    paged KV pool and block tables, kept in step with the target's: before each proposal its table is
    truncated to the tokens the target kept, then it computes the few it lacks.
- **Verification** (`RejectionSampler`, in the model runner): row i of a speculating sequence is the
  target's distribution p_i for the token after draft i. Greedy: row i's token is argmax p_i. Sampling:
  draft d_i, drawn from q_i, is kept with probability min(1, p_i(d_i) / q_i(d_i)); if not, row i's token
  is drawn from the *residual* max(0, p_i - q_i), normalised (`verify_rows`). The last row draws its
  bonus token from p_k. Whatever q is, each emitted token then follows p exactly (modified rejection
  sampling); without the residual correction it would not (the tests show both).
- **Acceptance and rollback** (`Scheduler.update`): the emitted tokens are the rows' tokens up to and
  including the first that differs from its draft (a residual draw never equals the draft). The slots of
  the rejected drafts are given back: the block table is truncated (`KVCacheManager.truncate`), whole
  rejected blocks return to the allocator, and the draft model's table is truncated the same way.

Greedy speculation changes no token: row i's logits are computed over exactly the tokens a plain decode
would have at that position, row by row, so on the CPU they are the plain decode's bits.

Invariant: a speculating sequence's drafts are unknown tokens to the prefix cache until accepted (never
registered), and after `update` its block table holds exactly the slots of its computed tokens; with
greedy sampling the emitted tokens are the non-speculative ones, bit for bit on the CPU; with sampling
each emitted token follows the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import numpy as np
import torch

from pagedref.engine.sampling import make_generator, processed_probs
from pagedref.engine.scheduler import ScheduledSequence, SchedulerOutput
from pagedref.engine.sequence import Logprob, Sequence
from pagedref.memory.block_allocator import NoFreeBlocksError
from pagedref.memory.block_table import slot_range
from pagedref.memory.sharing import KVCacheManager


@dataclass
class Draft:
    """One sequence's proposal: k tokens, and for sampling the distributions they were drawn from."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [k, vocab], each row normalised; None: deterministic (q is one-hot)


@dataclass
class SpecTokens:
    """What the model runner hands `Scheduler.update` for one speculating sequence: a token per row."""

    token_ids: list[int]  # k + 1: row i's token (its draft where kept, else the residual's draw); the last, the bonus
    logprobs: list[tuple[float, dict[int, Logprob]]] | None = None  # per row, where the sequence asked
    logits: list[torch.Tensor] | None = None  # per row, [vocab] float32 on the CPU, where the sequence records them


class Proposer(Protocol):
    """What `Scheduler.proposer` is (None: no speculation): k, and two methods, `NgramProposer`'s and
    `DraftModelProposer`'s: `propose(seqs, num_tokens)` -> for each decoding sequence, in order, a `Draft`
    of at most num_tokens[i] tokens following its tokens, or None; `free(seq)`: the sequence finished,
    whatever the proposer holds for it goes."""

    num_speculative_tokens: int  # k: the most drafts a sequence gets per step


# --- n-gram (prompt lookup) ------------------------------------------------------------------------
def ngram_propose(token_ids: Seq[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: for n from max_n down to min_n, the last n tokens are searched earlier in token_ids;
    at the first n that occurs earlier, the k tokens that followed its *latest* earlier occurrence are the
    draft. A continuation that reaches the end of the text goes on with its own first tokens (an
    overlapping copy, as LZ77 copies): a repeating pattern repeats on. [] when no suffix of at least
    min_n tokens occurred before (or k is 0).

    ngram_propose([1, 2, 3, 9, 1, 2], k=2, min_n=1, max_n=3) == [3, 9]: "1 2" occurred at 0, then 3, 9;
    ngram_propose([5, 7, 5, 7], k=3, min_n=1, max_n=2) == [5, 7, 5]."""
    if k <= 0:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    num = len(tokens)
    max_n = min(max_n, num - 1)
    if max_n < max(min_n, 1):
        return []
    # Grow the match backwards instead of testing every n-gram: `ends` holds the earlier positions where
    # the last n tokens end too; each round keeps those whose token before also matches. One vector
    # compare per round over the few survivors (~10 us a sequence, not ~100 for sliding windows per n).
    ends = np.flatnonzero(tokens[:num - 1] == tokens[num - 1])
    n = 1
    while n < max_n and ends.size:
        longer = ends[ends >= n]  # room for one more token before the match
        longer = longer[tokens[longer - n] == tokens[num - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < min_n:
        return []
    start = int(ends[-1]) + 1  # the latest earlier occurrence, and what followed it
    copied = tokens[start:].tolist()
    while len(copied) < k:  # overlapping copy: start + i < num + i, so the token is always there
        copied.append(copied[len(copied) - (num - start)])
    return copied[:k]


@dataclass
class NgramProposer:
    """vLLM's "ngram" method: drafts looked up in each sequence's own prompt and output."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft | None]:
        """A draft of up to num_tokens[i] tokens per sequence, or None where its suffix never occurred before."""
        drafts: list[Draft | None] = []
        for seq, k in zip(seqs, num_tokens):
            ids = ngram_propose(seq.token_ids, k, self.prompt_lookup_min, self.prompt_lookup_max)
            drafts.append(Draft(ids) if ids else None)
        return drafts

    def free(self, seq: Sequence) -> None:
        """Nothing to free: the lookup keeps no state."""


# --- a draft model -------------------------------------------------------------------------------
@dataclass
class _DraftState:
    known: int  # the sequence's length when it was last proposed for: the draft's tokens before it are its own
    generator: torch.Generator | None = None  # the draft's random stream (sampling), derived from the sequence's


class DraftModelProposer:
    """vLLM's "draft_model" method: a smaller model with the target's vocabulary proposes k tokens by
    decoding k steps of its own, on its own paged KV pool (`runner`, a `ModelRunner` over the draft
    model) and its own block tables (`kv`, a stage 4 `KVCacheManager` keyed by the sequences' ids).

    Its cache is kept in step with the target's: before each proposal a sequence's draft table is
    truncated to the tokens the target kept (the drafts it rejected give their slots back, as in the
    target's table), then the draft computes the tokens it lacks (at least the sequence's last one, whose
    logits give the first draft token) and k - 1 more decode steps. A sequence that is not proposed for
    (finished, preempted) loses its draft blocks at the next proposal; one the draft pool cannot hold gets
    no draft (speculation is optional work: it never preempts anyone)."""

    runner: object  # a ModelRunner over the draft model: its KV pool, prepare() and run_model()
    num_speculative_tokens: int
    kv: KVCacheManager  # the draft's block tables over that pool, keyed by the sequences' ids (no prefix caching)

    def __init__(self, runner, num_blocks: int, num_speculative_tokens: int, max_model_len: int) -> None:
        """runner: a ModelRunner over the draft model whose pool holds num_blocks blocks."""
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.kv = KVCacheManager(num_blocks, runner.block_size, max_model_len, enable_prefix_caching=False)
        self.states: dict[int, _DraftState] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft | None]:
        """Up to num_tokens[i] draft tokens per sequence, from the draft model (greedy, or sampled with the
        sequence's parameters: then each draft comes with its distribution)."""
        wanted = {seq.seq_id for seq, k in zip(seqs, num_tokens) if k > 0}
        for seq_id in [s for s in self.states if s not in wanted]:  # finished, preempted, not decoding: forgotten
            self._forget(seq_id)
        # round j feeds each sequence what its draft cache lacks: first the catch-up, then its last draft token
        active: list[tuple[Sequence, int]] = []
        feeds: dict[int, tuple[int, list[int]] | None] = {}
        for seq, k in zip(seqs, num_tokens):
            feed = self._catch_up(seq) if k > 0 else None
            if feed is not None:
                active.append((seq, k))
                feeds[seq.seq_id] = feed
        tokens: dict[int, list[int]] = {seq.seq_id: [] for seq, _ in active}
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq, _ in active}
        for j in range(max((k for _, k in active), default=0)):
            batch = [(seq, k) for seq, k in active if k > j and feeds.get(seq.seq_id)]
            if not batch:
                break
            entries = [self._entry(seq, feeds[seq.seq_id]) for seq, _ in batch]
            rows = self._logits(entries)
            argmax = rows.argmax(-1).tolist()  # every greedy sequence's token, in one copy to the host
            for (seq, k), row, best in zip(batch, rows, argmax):
                token, q = (best, None) if seq.params.is_greedy else self._sample(seq, row)
                tokens[seq.seq_id].append(token)
                if q is not None:
                    probs[seq.seq_id].append(q)
                feeds[seq.seq_id] = None
                if j + 1 < k:  # the next round computes this draft token (the last one is never computed)
                    try:
                        self.kv.append_slots(seq.seq_id, [token])
                        feeds[seq.seq_id] = (self.kv.num_tokens(seq.seq_id) - 1, [token])
                    except NoFreeBlocksError:  # the draft pool is full: this draft ends here
                        pass
        drafts: list[Draft | None] = []
        for seq in seqs:
            ids = tokens.get(seq.seq_id)
            if not ids:
                drafts.append(None)
                continue
            q = probs[seq.seq_id]
            drafts.append(Draft(ids, torch.stack(q) if q else None))
            self.states[seq.seq_id].known = seq.num_tokens
        return drafts

    # --- the draft's cache, kept in step with the target's --------------------------------------
    def _catch_up(self, seq: Sequence) -> tuple[int, list[int]] | None:
        """Roll the sequence's draft table back to the tokens the target kept, then give slots to those it
        lacks (at least the last). Returns (their first position, the tokens), or None (and no draft state)
        if the draft pool cannot hold them."""
        num = seq.num_tokens
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = _DraftState(0, self._generator(seq))
        else:
            drafted = self.kv.seqs[seq.seq_id].token_ids
            valid = min(state.known, len(drafted))  # tokens before `known` were the sequence's own when drafted
            while valid < min(len(drafted), num - 1) and drafted[valid] == seq.token_ids[valid]:
                valid += 1  # the drafts the target accepted
            self.kv.truncate(seq.seq_id, min(valid, num - 1))  # the rejected ones give their slots back
        start = self.kv.num_tokens(seq.seq_id) if seq.seq_id in self.kv.seqs else 0
        try:
            if seq.seq_id not in self.kv.seqs:
                self.kv.allocate(seq.seq_id, seq.token_ids, num)
            else:
                self.kv.append_slots(seq.seq_id, seq.token_ids[start:num])
        except NoFreeBlocksError:
            self._forget(seq.seq_id)
            return None
        return start, seq.token_ids[start:num]

    def free(self, seq: Sequence) -> None:
        """The sequence finished: its draft blocks go back to the draft pool."""
        self._forget(seq.seq_id)

    def _forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
        if seq_id in self.kv.seqs:
            self.kv.free(seq_id)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """The draft's own random stream, derived from the sequence's seed: reproducible, and not a draw
        taken from the target's stream."""
        if seq.generator is None:
            return None
        return make_generator((seq.generator.initial_seed() * 1_000_003 + 12_345) % (1 << 63), self.runner.device)

    # --- one forward of the draft model ---------------------------------------------------------
    def _entry(self, seq: Sequence, feed: tuple[int, list[int]]) -> ScheduledSequence:
        start, ids = feed
        end = start + len(ids)
        table = self.kv.seqs[seq.seq_id].table
        return ScheduledSequence(seq, len(ids), start, list(ids), table.block_ids,
                                 slot_range(table.block_ids, start, end, table.block_size), [seq])

    def _logits(self, entries: list[ScheduledSequence]) -> torch.Tensor:
        """The draft model's logits [len(entries), vocab] at each entry's last row."""
        runner = self.runner
        out = SchedulerOutput(entries)
        step = runner.prepare(out)
        hidden = runner.run_model(step.input_ids, step.positions, step.meta, out, step.host_meta)
        rows = torch.tensor(step.sample_rows, dtype=torch.int64, device=hidden.device)
        return runner.model.compute_logits(hidden.index_select(0, rows))

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(draft token, its distribution q [vocab] normalised) for a sampling sequence, with its parameters."""
        params = seq.params
        q = processed_probs(logits[None], params)[0]
        q = q / q.sum()
        race = torch.empty_like(q).exponential_(generator=self.states[seq.seq_id].generator)
        return int((q / race).argmax()), q


# --- verification: modified rejection sampling ----------------------------------------------------
def verify_rows(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                uniforms: torch.Tensor, races: torch.Tensor, correction: bool = True) -> torch.Tensor:
    """One speculating sequence's k + 1 tokens, by modified rejection sampling (pure: the random draws
    are given). target_probs [k + 1, vocab] (rows normalised): p_i, the target's distribution for the
    token after draft i; draft_token_ids [k]; draft_probs [k, vocab] (q_i, normalised) or None for a
    deterministic proposal (q_i one-hot at the draft); uniforms [k] ~ U(0, 1); races [k + 1, vocab] ~ Exp(1)
    (a race draws token t with probability r_t / sum(r): the sampler's exponential race).

    Row i < k: the draft d_i is kept if uniforms[i] * q_i(d_i) < p_i(d_i) (probability min(1, p/q));
    otherwise the row's token is drawn from the residual max(0, p_i - q_i) (which is 0 at d_i). Row k:
    the bonus token, drawn from p_k. With correction=False the rejected rows draw from p_i instead: the
    bias the residual removes stays (tests/test_spec_decode_sampling.py measures both).
    Each row depends on its own inputs only, so rows of independent trials may be stacked (the tests do)."""
    k = draft_token_ids.shape[0]
    p, d = target_probs[:k], draft_token_ids[:, None]
    p_d = p.gather(1, d).squeeze(1)  # [k]
    if draft_probs is None:  # q is one-hot at the draft: accept with probability p(d), residual = p without d
        q_d = torch.ones_like(p_d)
        residual = p.scatter(1, d, 0.0)
    else:
        q_d = draft_probs.gather(1, d).squeeze(1)
        residual = (p - draft_probs).clamp_min(0.0)
    accept = uniforms * q_d < p_d
    if not correction:
        residual = p
    # no mass left only where p <= q everywhere, and then a rejection is impossible but for rounding
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    recovered = (residual / races[:k]).argmax(-1)
    bonus = (target_probs[k] / races[k]).argmax(-1, keepdim=True)
    return torch.cat([torch.where(accept, draft_token_ids, recovered), bonus])


@dataclass
class RejectionSampler:
    """The model runner's sampler for speculating sequences: their k + 1 rows' tokens [sum(k + 1)]. Greedy
    rows take their argmax (no arithmetic: the plain decode's token); sampling rows `verify_rows`, with
    p and q from the sampler's own `processed_probs` and the draws from the sequence's own generator
    (k uniforms, then k + 1 races, every step: a seeded request reproduces its run)."""

    correction: bool = True  # False only to show what the residual correction is for

    def __call__(self, logits: torch.Tensor, entries: list[ScheduledSequence], index=None) -> torch.Tensor:
        """logits [sum(k + 1), vocab]: each entry's k + 1 rows, in order. index(list) -> an int64 tensor on
        the logits' device (the runner passes one that copies from pinned memory)."""
        index = index or (lambda xs: torch.tensor(xs, dtype=torch.int64, device=logits.device))
        tokens = logits.argmax(-1)  # [rows]: every greedy row's token at once
        row = 0
        for e in entries:
            k = e.num_draft_tokens
            params = e.seq.params
            if not params.is_greedy:
                p = processed_probs(logits[row:row + k + 1], params)
                p = p / p.sum(-1, keepdim=True)
                g = e.seq.generator
                uniforms = torch.rand(k, generator=g, device=p.device, dtype=p.dtype)
                races = torch.empty_like(p).exponential_(generator=g)
                drafts = index(e.token_ids[1:])
                tokens[row:row + k + 1] = verify_rows(p, drafts, e.draft_probs, uniforms, races, self.correction)
            row += k + 1
        return tokens
