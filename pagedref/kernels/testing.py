"""Random paged-attention problems and their float64 oracle, shared by the kernel tests and the self-check.

One idea: a kernel that reads K/V through block tables is tested on a pool where every slot no
sequence owns holds NaN and every sequence's blocks sit at random physical places; the expected
output comes from the numpy oracle in float64 on the logically ordered K/V. A wrong index then
shows as a wrong value or a NaN, never as a lucky zero.

Invariant: `problem.k_seq[s]` / `v_seq[s]` are exactly (bit for bit, widened to float64) the K/V
the pool holds for sequence s in token order, so `oracle(problem)` is the ground truth whatever the
pool's layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedref.memory.block_table import cdiv


@dataclass
class PagedProblem:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], NaN where unowned
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 padded
    context_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    k_seq: list[np.ndarray]  # per sequence [context_len, num_kv_heads, head_dim] float64
    v_seq: list[np.ndarray]
    scale: float

    @property
    def query_lens(self) -> list[int]:
        return torch.diff(self.query_start_loc.cpu()).tolist()

    @property
    def max_context_len(self) -> int:
        return int(self.context_lens.max())

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)


def make_problem(context_lens: list[int], query_lens: list[int] | None = None, *, num_heads: int = 4,
                 num_kv_heads: int = 2, head_dim: int = 64, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cuda", seed: int = 0,
                 spare_blocks: int = 3, extra_columns: int = 2) -> PagedProblem:
    """Sequences with the given context lengths (and query rows: 1 each by default, i.e. decode)."""
    query_lens = query_lens or [1] * len(context_lens)
    gen = torch.Generator().manual_seed(seed)
    need = [cdiv(c, block_size) for c in context_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # physical places, shuffled
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(context_lens), max(need) + extra_columns), -1, dtype=torch.int32)
    k_seq, v_seq, nxt = [], [], 0
    for s, ctx in enumerate(context_lens):
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        for i in range(need[s]):
            pb = perm[nxt]
            nxt += 1
            block_tables[s, i] = pb
            a, b = i * block_size, min((i + 1) * block_size, ctx)
            k_cache[pb, : b - a] = k[a:b]
            v_cache[pb, : b - a] = v[a:b]
        k_seq.append(k.double().numpy())
        v_seq.append(v.double().numpy())
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return PagedProblem(to(q), to(k_cache), to(v_cache), to(block_tables), to(torch.tensor(context_lens, dtype=torch.int32)),
                        to(qsl), k_seq, v_seq, head_dim**-0.5)


def permute_blocks(p: PagedProblem, seed: int = 1) -> PagedProblem:
    """The same problem with every physical block moved to a new place (block tables follow)."""
    num_blocks = p.k_cache.shape[0]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(p.k_cache.device)
    k_cache, v_cache = torch.empty_like(p.k_cache), torch.empty_like(p.v_cache)
    k_cache[perm], v_cache[perm] = p.k_cache, p.v_cache  # block b now lives at perm[b]
    bt = p.block_tables.long()
    moved = torch.where(bt >= 0, perm[bt.clamp(min=0)], bt).to(torch.int32)
    return replace(p, k_cache=k_cache, v_cache=v_cache, block_tables=moved)


def select(p: PagedProblem, seqs: list[int]) -> PagedProblem:
    """A batch of some of the sequences, in the given order, over the same pool."""
    qsl = p.query_start_loc.tolist()
    rows = torch.cat([torch.arange(qsl[s], qsl[s + 1]) for s in seqs]).to(p.q.device)
    lens = [qsl[s + 1] - qsl[s] for s in seqs]
    idx = torch.tensor(seqs, device=p.q.device)
    new_qsl = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device=p.q.device)
    return replace(p, q=p.q[rows].contiguous(), block_tables=p.block_tables[idx].contiguous(),
                   context_lens=p.context_lens[idx].contiguous(), query_start_loc=new_qsl,
                   k_seq=[p.k_seq[s] for s in seqs], v_seq=[p.v_seq[s] for s in seqs])


def seq_rows(p: PagedProblem, s: int) -> slice:
    qsl = p.query_start_loc.tolist()
    return slice(qsl[s], qsl[s + 1])


def oracle(p: PagedProblem) -> np.ndarray:
    """The float64 oracle output [num_tokens, num_heads, head_dim] (query rows are each context's last):
    standard causal attention per sequence (causal_attention)."""
    q64 = p.q.double().cpu().numpy()
    out = np.empty_like(q64)
    for s, (k, v) in enumerate(zip(p.k_seq, p.v_seq)):
        rows = seq_rows(p, s)
        out[rows] = causal_attention(q64[rows], k, v, p.scale)
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, rows_per_step: int = 512) -> np.ndarray:
    """pagedref.attention.attention for one sequence whose query rows are its context's last ones, in
    float64, vectorised over rows (a few hundred at a time) instead of a Python loop over them: the same
    values to a few ulps of float64 (test_kernels_cpu checks it), and 8k rows in a second, not 20.
    q: [n, num_heads, head_dim]; k, v: [ctx, num_kv_heads, head_dim] -> [n, num_heads, head_dim]."""
    n, num_heads, _ = q.shape
    ctx, group = k.shape[0], num_heads // k.shape[1]
    out = np.empty_like(q)
    for r0 in range(0, n, rows_per_step):
        r1 = min(r0 + rows_per_step, n)
        pos = ctx - n + np.arange(r0, r1)  # the rows' positions; row i sees keys 0 .. pos[i]
        see = int(pos[-1]) + 1
        future = np.arange(see)[None, :] > pos[:, None]  # [rows, see]
        for h in range(num_heads):
            kh, vh = k[:see, h // group], v[:see, h // group]  # [see, head_dim]
            scores = q[r0:r1, h] @ kh.T * scale  # [rows, see]
            scores[future] = -np.inf
            w = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[r0:r1, h] = (w @ vh) / w.sum(axis=1, keepdims=True)
    return out


def max_rel_err(out: torch.Tensor, ref: np.ndarray, p: PagedProblem) -> float:
    """max over sequences of ||out_s - ref_s|| / ||ref_s|| (norm-relative, per sequence)."""
    got = out.double().cpu().numpy()
    errs = []
    for s in range(len(p.k_seq)):
        r = seq_rows(p, s)
        errs.append(np.linalg.norm(got[r] - ref[r]) / np.linalg.norm(ref[r]))
    return float(max(errs))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), the test of every invariance claim."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))
