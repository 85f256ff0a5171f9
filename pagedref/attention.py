"""Standard attention in numpy: the one ground truth every stage of pagedref is compared against.

One idea: softmax(q·kᵀ · scale) · v for each query row, over exactly the keys that row may see.

Invariant (what makes "bit-level agreement" possible): the output of a query row depends only on
that row's query vector and the K/V rows it attends to, and is computed by the same numpy
operations, on arrays of the same shapes, in the same order, whatever else is in the batch, however
the prompt was chunked and wherever the K/V were stored. Every paged path in this project gathers
the K/V a row can see and calls `attend_row` on them, so it agrees with `attention` bit for bit by
construction, and the tests check it with exact equality.

Why a loop over rows and not one masked matrix product: a masked row sums exp() over padding zeros
as well, and a BLAS matrix product picks its blocking from the matrix shape. Both change the order of
the floating-point additions with the batch, and so change the last bits. A row computed on its own,
with elementwise products and numpy reductions, is added up in one fixed order.
"""

from __future__ import annotations

import numpy as np

_SUPPORTED = (np.float16, np.float32, np.float64)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """float16 is computed in float32 (as every GPU kernel does); float32 and float64 in themselves."""
    dtype = np.dtype(dtype)
    if dtype.type not in _SUPPORTED:
        raise TypeError(f"attention supports float16, float32 and float64, got {dtype}")
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def attend_row(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Attention of one query token over `ctx_len` keys, grouped-query heads.

    q: [num_heads, head_dim]; k, v: [ctx_len, num_kv_heads, head_dim] -> [num_heads, head_dim]
    (in the compute dtype). Query head h reads KV head h // (num_heads // num_kv_heads).
    """
    num_heads, head_dim = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    dt = compute_dtype(q.dtype)
    qg = q.astype(dt).reshape(num_kv_heads, group, 1, head_dim)  # [Hkv, G, 1, d]
    kh = k.astype(dt).transpose(1, 0, 2)[:, None]  # [Hkv, 1, L, d]
    vh = v.astype(dt).transpose(1, 0, 2)[:, None]  # [Hkv, 1, L, d]
    scores = (qg * kh).sum(-1) * dt.type(scale)  # [Hkv, G, L]
    scores = scores - scores.max(-1, keepdims=True)  # softmax is shift-invariant; exp never overflows
    e = np.exp(scores)
    p = e / e.sum(-1, keepdims=True)  # [Hkv, G, L]
    out = (p[..., None] * vh).sum(-2)  # [Hkv, G, d]
    return out.reshape(num_heads, head_dim)


def check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """Raise ValueError naming the argument whose shape is wrong."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_q_tokens, num_heads, head_dim], got shape {q.shape}")
    if k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [num_ctx_tokens, num_kv_heads, head_dim], got {k.shape} and {v.shape}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} != k head_dim {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads {q.shape[1]} must be a multiple of num_kv_heads {k.shape[1]}")


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float | None = None,
    q_start: int | None = None,
    causal: bool = True,
) -> np.ndarray:
    """Standard (causal, grouped-query) attention: the oracle.

    q: [num_q_tokens, num_heads, head_dim]; k, v: [num_ctx_tokens, num_kv_heads, head_dim].
    Query i sits at absolute position q_start + i and, when causal, sees keys 0 .. q_start + i.
    q_start defaults to num_ctx_tokens - num_q_tokens: the new tokens are the last ones of the
    context, as in a prefill (q_start = 0) or a chunk of new tokens after a cached prefix.
    Returns [num_q_tokens, num_heads, head_dim] in q's dtype (float16 is computed in float32).
    """
    check_shapes(q, k, v)
    num_q, num_heads, head_dim = q.shape
    num_ctx = k.shape[0]
    scale = head_dim**-0.5 if scale is None else scale
    q_start = num_ctx - num_q if q_start is None else q_start
    if causal and not 0 <= q_start <= num_ctx - num_q:
        raise ValueError(f"q_start={q_start} leaves query tokens without their keys (num_ctx={num_ctx}, num_q={num_q})")
    out = np.empty((num_q, num_heads, head_dim), dtype=q.dtype)
    for i in range(num_q):
        ctx_len = q_start + i + 1 if causal else num_ctx
        out[i] = attend_row(q[i], k[:ctx_len], v[:ctx_len], scale)
    return out
