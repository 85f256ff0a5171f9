"""Split-K ("flash-decoding") arithmetic: cut a context into fixed partitions, softmax each, merge.

One idea: attention over a long context can be computed partition by partition. Partition p gives
its largest logit m_p, its exp-sum l_p = sum(exp(s - m_p)) and its own normalized output o_p; then
with M = max_p m_p and w_p = l_p * exp(m_p - M),  out = sum_p w_p * o_p / sum_p w_p  is exactly the
softmax attention over the whole context in real arithmetic. The decode kernel's CTAs each compute
one partition in parallel, and a small reduce kernel merges them.

Invariant: partitions are the fixed spans [p*P, (p+1)*P) of a sequence's own token positions, with
P = PARTITION_SIZE a constant never derived from the batch, so the arithmetic a sequence goes
through (and hence its bits) does not depend on what else is in the batch or where its blocks live.

This module holds the launch arithmetic the kernels share with Python (partition counts, how many
query heads one CTA serves) and numpy models of split-K that the stage 5 lesson checks against the
oracle: v2's (each partition's softmax, then the merge) and v3's trees (each warp's online softmax over
its own slabs; its states folded over a superpartition's partitions, then merged over the warps). The
models fix the trees, not the GPU's bits: the kernels sum inside an mma and round exp2 their own way.
It needs neither a GPU nor cupy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from pagedref.attention import attend_row, compute_dtype

PARTITION_SIZE = 512  # tokens per split-K partition: fixed, so results are batch-invariant
MMA_PARTITION_SIZE = 1024  # the same for the tensor-core kernel (v3): fastest on the H200 (docs/benchmarks.md)
NUM_THREADS = 128  # threads per CTA of every attention kernel
SLAB = 16  # v3: keys a warp computes at a time (the rows of one mma), slab i of a partition on warp i % MMA_WARPS
MMA_WARPS = 4  # v3: warps of a CTA, each with its own online softmax over its slabs
FOLD_SPAN = 4  # v3's folded tree: partitions of a superpartition (cuda/paged_attention.cu's FOLD_SPAN)
MAX_HEADS_PER_CTA = 8  # query heads of one GQA group served by one decode CTA (register budget)
PREFILL_ROWS = 16  # query rows per prefill CTA (4 warps x 4 rows)
SUPPORTED_HEAD_DIMS = (8, 16, 32, 64, 80, 96, 112, 120, 128, 192, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)


def num_partitions(context_len: int, partition_size: int = PARTITION_SIZE) -> int:
    """Partitions covering `context_len` tokens (the last one may be partial)."""
    if partition_size <= 0:
        raise ValueError(f"partition_size must be positive, got {partition_size}")
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    return -(-context_len // partition_size)


def partition_bounds(context_len: int, partition_size: int = PARTITION_SIZE) -> list[tuple[int, int]]:
    """[(start, end), ...] token spans of each partition of a context."""
    return [(p * partition_size, min((p + 1) * partition_size, context_len))
            for p in range(num_partitions(context_len, partition_size))]


def heads_per_cta(num_heads: int, num_kv_heads: int) -> int:
    """Query heads one decode CTA serves: the largest divisor of the GQA group size up to 8.

    All of them read the same KV head, so K/V are loaded once for the whole group; the cap keeps the
    per-thread query slices and accumulators in registers.
    """
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    return max(g for g in range(1, MAX_HEADS_PER_CTA + 1) if group % g == 0)


def elements_per_thread(heads: int) -> int:
    """Elements of a token's K/V row each decode thread holds: 16, or 8 when a CTA serves more than
    4 query heads (its query slices and accumulators, heads x elements floats, must stay in registers)."""
    return 16 if heads <= 4 else 8


def threads_per_token(head_dim: int, elem_size: int, heads: int) -> int:
    """Threads of a decode CTA that share one token's K/V row (a power of two, at most 32).

    Fewer threads per token means fewer shuffles to add each dot product up (the instruction cost
    that limited the kernel on an H200), more elements and registers per thread.
    """
    want = max(1, head_dim // elements_per_thread(heads))
    return min(32, 1 << (want - 1).bit_length())


def min_ctas_per_sm(elem_size: int, heads: int) -> int:
    """The occupancy hint for the decode kernel: 4 CTAs per SM (at most 128 registers a thread) for
    16-bit K/V, where that costs no spills; no hint for float32."""
    return 4 if elem_size == 2 and heads * elements_per_thread(heads) <= 64 else 1


# The tensor-core kernels (decode v3, prefill v2) take 16-bit K/V at vLLM's head sizes. v3's mma
# fragments cover 32-dim K pieces and 64-dim V bands, plus one narrower piece or band each of 16
# and 8 dims (80 = 64 + 16, 120 = 64 + 32 + 16 + 8); prefill v2 runs its mmas over head_dim
# rounded up to 16 (120 -> 128, zero-padded in shared memory). float32 and the small head dims run
# on CUDA cores (decode v2, prefill v1).
MMA_HEAD_DIMS = (64, 80, 96, 112, 120, 128, 192, 256)
# v3's __launch_bounds__ CTAs per SM: as many as fit with no register spill (ptxas -v)
MMA_MIN_CTAS_PER_SM = {64: 6, 80: 5, 96: 4, 112: 4, 120: 4, 128: 4, 192: 2, 256: 2}


def mma_supported(elem_size: int, head_dim: int) -> bool:
    """Whether the tensor-core kernels (decode v3, prefill v2) handle this element size and head_dim."""
    return elem_size == 2 and head_dim in MMA_HEAD_DIMS


def mma_padded_head_dim(head_dim: int) -> int:
    """The head dim prefill v2's mmas run over: head_dim rounded up to their k of 16 (120 -> 128)."""
    return -(-head_dim // 16) * 16


# Prefill v2, FlashAttention-2 on the tensor cores (same scope as v3: mma_supported): a CTA owns
# 64 query rows (4 warps x 16, the M of an mma) and walks the keys in tiles of prefill_mma_key_tile.
PREFILL_MMA_ROWS = 64


def prefill_mma_key_tile(head_dim: int) -> int:
    """Keys per tile of prefill v2: 64, or 32 above head_dim 128 (its accumulators fill the registers)."""
    return 64 if mma_padded_head_dim(head_dim) <= 128 else 32


def prefill_mma_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of prefill v2: K and V tiles, double-buffered, rows of the padded
    head dim plus 8 elements; above head_dim 128 also the CTA's query rows (held in registers below)."""
    dp = mma_padded_head_dim(head_dim)
    rows = 4 * prefill_mma_key_tile(head_dim) + (0 if dp <= 128 else PREFILL_MMA_ROWS)
    return rows * (dp + 8) * 2


def softmax_stats(q: np.ndarray, k: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Per query head: the largest logit m and the exp-sum l = sum(exp(logit - m)) over these keys.

    q: [num_heads, head_dim]; k: [n, num_kv_heads, head_dim] -> (m [num_heads], l [num_heads]).
    """
    logits = scaled_logits(q, k, scale)  # [H, n]
    m = logits.max(-1)
    return m, np.exp(logits - m[:, None]).sum(-1)


def scaled_logits(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """scale * q.k for every query head and key.

    q: [num_heads, head_dim]; k: [n, num_kv_heads, head_dim] -> [num_heads, n] (query head h reads KV head h // G).
    """
    num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    dt = compute_dtype(q.dtype)
    qg = q.astype(dt).reshape(num_kv_heads, num_heads // num_kv_heads, 1, head_dim)  # [Hkv, G, 1, d]
    logits = (qg * k.astype(dt).transpose(1, 0, 2)[:, None]).sum(-1) * dt.type(scale)  # [Hkv, G, n]
    return logits.reshape(num_heads, -1)


def merge_partials(o: np.ndarray, m: np.ndarray, l: np.ndarray) -> np.ndarray:
    """Merge partition results: o [P, H, d] (each normalized), m [P, H], l [P, H] -> [H, d].

    Each partition's softmax was taken relative to its own max m_p; rescaling its exp-sum by
    exp(m_p - M) puts every partition on the common max M, so the weights add up correctly.
    """
    M = m.max(0)  # [H]
    w = l * np.exp(m - M)  # [P, H]
    return (w[..., None] * o).sum(0) / w.sum(0)[:, None]


def split_k_attend_row(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                       partition_size: int = PARTITION_SIZE) -> np.ndarray:
    """One query token's attention computed partition by partition, then merged.

    q: [num_heads, head_dim]; k, v: [ctx_len, num_kv_heads, head_dim] -> [num_heads, head_dim].
    With a single partition this IS the oracle's arithmetic (same function, same bits); with more,
    the merge re-associates the sums, so the result agrees with the oracle only to rounding.
    """
    spans = partition_bounds(k.shape[0], partition_size)
    if len(spans) == 1:
        return attend_row(q, k, v, scale)
    o = np.stack([attend_row(q, k[a:b], v[a:b], scale) for a, b in spans])  # [P, H, d]
    stats = [softmax_stats(q, k[a:b], scale) for a, b in spans]
    m = np.stack([s[0] for s in stats])  # [P, H]
    l = np.stack([s[1] for s in stats])  # [P, H]
    return merge_partials(o, m, l).astype(o.dtype)


# --- v3's trees ---------------------------------------------------------------------------------------------------

@dataclass
class WarpState:
    """One warp's online softmax over the keys it has computed: the largest logit m [H], the exp-sum l [H] and the
    unnormalised p.V acc [H, d], both on that max. A warp that computed no key: m = -inf, l = 0, acc = 0."""

    m: np.ndarray
    l: np.ndarray
    acc: np.ndarray

    @property
    def empty(self) -> bool:
        """A warp that computed no key of its partition (its max is -inf for every head): it adds nothing."""
        return bool(np.isneginf(self.m).all())


def warp_states(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> list[WarpState]:
    """One partition's keys (k, v [n, num_kv_heads, head_dim], n <= its size) computed as v3's MMA_WARPS warps
    compute them: slab i (keys 16 i .. 16 i + 15) on warp i % MMA_WARPS, each warp's slabs in order, one
    online-softmax step a slab (new max, the state rescaled to it, the slab's terms added)."""
    dt = compute_dtype(q.dtype)
    num_heads, head_dim = q.shape
    states = [WarpState(np.full(num_heads, -np.inf, dt), np.zeros(num_heads, dt), np.zeros((num_heads, head_dim), dt))
              for _ in range(MMA_WARPS)]
    group = num_heads // k.shape[1]
    for i, a in enumerate(range(0, k.shape[0], SLAB)):
        st = states[i % MMA_WARPS]
        s = scaled_logits(q, k[a:a + SLAB], scale)  # [H, n]
        m = np.maximum(st.m, s.max(-1))
        f = np.exp(st.m - m)  # 0 on the warp's first slab
        p = np.exp(s - m[:, None])  # [H, n]
        vh = v[a:a + SLAB].astype(dt).transpose(1, 0, 2).repeat(group, axis=0)  # [H, n, d]
        st.m, st.l, st.acc = m, st.l * f + p.sum(-1), st.acc * f[:, None] + (p[..., None] * vh).sum(-2)
    return states


def fold_state(saved: WarpState, later: WarpState) -> WarpState:
    """The folded tree's one rule: a warp's state of a later partition folded into its state of the partitions
    before. M = max(m, m'); every sum becomes x' exp(m' - M) + x exp(m - M). A state with no key adds nothing."""
    if later.empty:
        return saved
    if saved.empty:
        return later
    m = np.maximum(saved.m, later.m)
    f_old, f_new = np.exp(saved.m - m), np.exp(later.m - m)
    return WarpState(m, later.l * f_new + saved.l * f_old, later.acc * f_new[:, None] + saved.acc * f_old[:, None])


def merge_warps(states: list[WarpState]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The warps' states merged in warp order, as the kernel's epilogue merges them.

    -> (o [H, d] normalised, m [H], l [H]): a partition's (or a superpartition's) share for merge_partials."""
    m = np.max([st.m for st in states], axis=0)  # a max is exact in any order
    l, acc = np.zeros_like(states[0].l), np.zeros_like(states[0].acc)
    for st in states:
        f = np.exp(st.m - m)  # 0 for a warp with no key
        l, acc = l + st.l * f, acc + st.acc * f[:, None]
    return acc / l[:, None], m, l


def folded_attend_row(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                      partition_size: int = MMA_PARTITION_SIZE, fold_span: int = FOLD_SPAN,
                      span: int | None = None) -> np.ndarray:
    """One query token's attention through v3's tree: partitions of `partition_size` keys, grouped in superpartitions
    of `fold_span`; in each, every warp's states folded over the partitions in order, then merged over the warps;
    the superpartitions merged as partitions are (merge_partials). fold_span=1 is the tree before the fold (each
    partition merged over its warps, then the partitions).

    `span` is the schedule, never a bit: FOLD_SPAN (the default) computes a superpartition as one CTA does, folding
    each partition into its warps' states as it ends; 1 computes each partition as its own CTA does, its raw warp
    states kept, and folds them afterwards as the fold reduce kernel does. The same folds in the same order.
    q: [num_heads, head_dim]; k, v: [ctx_len, num_kv_heads, head_dim] -> [num_heads, head_dim] (compute dtype).
    """
    if partition_size <= 0 or partition_size % (SLAB * MMA_WARPS):
        raise ValueError(f"partition_size must be a positive multiple of {SLAB * MMA_WARPS} (a warp's slabs must not "
                         f"straddle partitions), got {partition_size}")
    if fold_span < 1:
        raise ValueError(f"fold_span must be >= 1, got {fold_span}")
    if k.shape[0] == 0:
        raise ValueError("a decode row attends to at least one key (its own token's)")
    span = fold_span if span is None else span
    if span not in (1, fold_span):
        raise ValueError(f"span is a CTA's partitions: 1 or the superpartition's {fold_span}, got {span}")
    parts = partition_bounds(k.shape[0], partition_size)
    supers = [parts[i:i + fold_span] for i in range(0, len(parts), fold_span)]
    fold_warps = lambda saved, later: [fold_state(f, st) for f, st in zip(saved, later)]  # noqa: E731 (per warp)
    shares = []
    for sup in supers:
        # A CTA per superpartition: each partition's warp states folded in as the partition ends (a generator).
        states = (warp_states(q, k[a:b], v[a:b], scale) for a, b in sup)  # [partition][warp]
        if span == 1:  # one partition a CTA: every partition's warp states written as they are first
            states = list(states)
        shares.append(merge_warps(functools.reduce(fold_warps, states)))  # then the same folds, in partition order
    if len(shares) == 1:
        return shares[0][0]
    o, m, l = (np.stack(x) for x in zip(*shares))  # [S, H, d], [S, H], [S, H]
    return merge_partials(o, m, l)
