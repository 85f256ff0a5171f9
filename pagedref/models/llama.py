"""The Llama family (Llama 2/3, Mistral, Qwen2) in plain torch, with its attention read through a paged KV cache.

One idea: a decoder-only transformer is a stack of per-token operations (RMSNorm, linear layers,
RoPE, SwiGLU, residual adds) around one operation that mixes tokens, attention. Only attention
needs the KV cache, so only attention goes through the backend (`pagedref.backends`), which writes
each new token's K/V into its slot and reads every sequence's context through its block table.

Batch invariance (the CPU numerics contract, `batch_invariant=True`): a request's logits must not
depend on which other tokens share the step (continuous batching), on how its prompt was chunked
(chunked prefill) or on whether it was preempted and recomputed. A batched matrix product breaks
that: BLAS chooses its blocking, and so the order of its floating-point additions, from the matrix
shape, so `F.linear` on N rows differs in the last bits from `F.linear` on each row (measured on
this CPU). So in this mode every per-token operation, from the norms and linear layers through
RoPE, the activations and residual adds to the logits, is applied to each token's row on its own
(shape [1, ...]) by `map_rows`: a row is computed by the same kernels on the same shapes whatever
the batch, so bit for bit the same; and on one intra-op thread (`one_thread`), so that neither the
process's thread setting nor a busy CPU can change or slow it. Attention is already per-row by
construction (the reference backend calls the oracle's `attend_row` on exactly the keys a row can
see). RoPE's cos/sin tables are computed once at load time, so a position's rotation is a table
lookup, never a batch-shaped computation. With `batch_invariant=False` (the GPU path) the same
operations run batched: fast, and invariant only up to rounding. On CUDA the per-token work between
the matrix multiplies runs on fused kernels (`pagedref.kernels.fused`: the residual add with the norm
after it, SiLU with the multiply, RoPE inside the backend's K/V write), four launches a layer instead
of ~40; `fused_kernels = False` keeps the torch ops (benchmarks compare the two).

Tensor parallelism (`tp`, a `pagedref.distributed.TPGroup`; docs/tensor_parallel.md): q/k/v and
gate/up are column-parallel layers (each rank computes its own heads and MLP columns), o and down
row-parallel ones (each rank a partial sum, all-reduced), each loaded by name, and only its own
slice (`loader.load_weights`). A rank attends with its own query heads over its own KV heads, so its
KV cache holds only those heads, under the block table every rank shares. The embedding, the norms
and lm_head are replicated. In the per-row mode the all-reduce runs per row too (it sits inside the
row function), so a row's result still does not depend on the batch. With one rank (the default)
every layer is exactly the nn.Linear it was.

Merged projections (CUDA only, `merge_projections`, as vLLM's QKVParallelLinear and
MergedColumnParallelLinear): once loaded, a layer's q/k/v rows are one matrix and its gate/up rows
another, the separate layers views into them (their names and shards unchanged), so the batched path
runs 4 GEMMs a layer instead of 7; silu_and_mul reads the [gate | up] row and the backend's RoPE + K/V
write reads q, k and v straight out of the [q | k | v] row.

Weight GEMMs (CUDA only, `set_weight_gemm`, off by default): the named projections of the fused path
(q/k/v, o, gate/up with SiLU in its epilogue, down, lm_head) run on the project's Hopper GEMM
(`pagedref.kernels.gemm`) instead of cuBLAS. Its tiling is a function of the weight alone, so a row's
bits do not depend on the batch; cuBLAS picks its kernel from the row count.

Invariant: for the same weights, `model(...)` followed by `compute_logits` equals Hugging Face
transformers' forward pass to float32 rounding (tested to 1e-4 against `hf_reference.json`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedref.backends.metadata import AttentionMetadata
from pagedref.distributed.layers import ColumnParallelLinear, RowParallelLinear
from pagedref.distributed.parallel import TPGroup, check_tensor_parallel_size
from pagedref.kernels import fused, gemm
from pagedref.models.config import ModelConfig

WEIGHT_GEMM_OPS = ("qkv", "o", "gate_up", "down", "lm_head")  # what set_weight_gemm can put on kernels.gemm


def map_rows(fn: Callable, *rows: torch.Tensor, per_row: bool = True):
    """fn(*rows), computed one token row at a time when per_row (so no result depends on the batch).

    Every tensor in `rows` has the token dimension first; fn returns a tensor or a tuple of tensors,
    each with the token dimension first.
    """
    if not per_row or rows[0].shape[0] <= 1:  # one row (or none) already is its own batch
        return fn(*rows)
    outs = [fn(*(t[i : i + 1] for t in rows)) for i in range(rows[0].shape[0])]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


@contextmanager
def one_thread(enabled: bool) -> Iterator[None]:
    """Run torch on one intra-op thread while `enabled` (the per-row path), then restore the setting.

    Single rows are far too small to gain from intra-op threads, and on a busy CPU those threads wait
    on each other: on 2 shared cores the per-row path ran 25x slower with 2 threads than with 1 (measured).
    One thread also keeps a row's result independent of the process's thread setting.
    """
    threads = torch.get_num_threads()
    if not enabled or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 rotation frequencies, as transformers computes them for each rope_type."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":  # positions / factor == frequencies / factor
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position's rotation angles, tabulated once: [max_position_embeddings, head_dim / 2]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(config.max_position_embeddings, config.head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty_like(self.cos), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        if self.cos.is_meta:  # built on the meta device: `LlamaForCausalLM.materialize` fills them later
            return
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(positions, rope_inv_freq(self.config))  # [max_pos, d/2], float32 as in transformers
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)  # [T, d/2] each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, d] by its positions' angles, in HF's half-split layout.

    transformers' `x * cos + rotate_half(x) * sin` with rotate_half(x) = [-x2, x1] written out per half:
    dimension i pairs with i + d/2 (not 2i with 2i+1, as in llama2.c / GPT-J's interleaved layout).
    """
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]  # [T, 1, d/2]: same angle for every head
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # the statistics in float32 whatever the model dtype, as transformers does
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None,
              residual_out: torch.Tensor | None = None) -> torch.Tensor:
        """The same norm as one CUDA kernel (`kernels.fused`): of x, or of x + residual, the sum written to
        residual_out (default: residual, in place). x itself becomes the output when residual is given."""
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps)
        return fused.fused_add_rms_norm(x, residual, self.weight, self.eps, residual_out=residual_out)[0]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, tp: TPGroup = TPGroup()):
        super().__init__()
        # Heads held by this rank: its num_heads / tp query heads and the num_kv_heads / tp KV heads they
        # read (rank r's query heads are the r-th slice, and so are the KV heads of their groups).
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = config.num_key_value_heads // tp.size
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden, d = config.hidden_size, self.head_dim
        q_size, kv_size = config.num_attention_heads * d, config.num_key_value_heads * d  # over all ranks
        # Column-parallel (split by output rows, i.e. by heads): separate q, k, v so each loads by its own name.
        self.q_proj = ColumnParallelLinear(hidden, q_size, config.attention_bias, dtype, tp)
        self.k_proj = ColumnParallelLinear(hidden, kv_size, config.attention_bias, dtype, tp)
        self.v_proj = ColumnParallelLinear(hidden, kv_size, config.attention_bias, dtype, tp)
        # Row-parallel (split by input columns, all-reduced after).
        self.o_proj = RowParallelLinear(q_size, hidden, config.o_proj_bias, dtype, tp)
        # This rank's q, k and v rows in one matrix [(H + 2 Hkv) d, hidden] once `merge_projections` ran.
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.weight_gemm: frozenset[str] = frozenset()  # of "qkv", "o": on kernels.gemm (set_weight_gemm)

    def merge_projections(self) -> None:
        """One q/k/v matrix (vLLM's QKVParallelLinear): q_proj, k_proj and v_proj become views of its rows, so
        the checkpoint's names still load them and no weight is held twice; `project` then runs one GEMM."""
        self.qkv_weight = merge_rows(self.q_proj, self.k_proj, self.v_proj, "weight")
        self.qkv_bias = merge_rows(self.q_proj, self.k_proj, self.v_proj, "bias")

    def project(self, x: torch.Tensor):
        """x [T, hidden] -> q [T, H, d], k [T, Hkv, d] (not yet rotated), v [T, Hkv, d]. Merged, they are
        views into one [T, (H + 2 Hkv) d] row each (token stride (H + 2 Hkv) d)."""
        if self.qkv_weight is not None:
            return self.split_heads(self.qkv_rows(x))
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def qkv_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, (H + 2 Hkv) d], each token's q | k | v (unrotated): one GEMM when merged."""
        if self.qkv_weight is not None:
            return linear(x, self.qkv_weight, self.qkv_bias, "qkv" in self.weight_gemm)
        return torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)

    def o(self, attn: torch.Tensor) -> torch.Tensor:
        """The output projection of attn [T, H * d] (o_proj; one rank: on kernels.gemm when set)."""
        if self.o_proj.tp.size == 1:
            return linear(attn, self.o_proj.weight, self.o_proj.bias, "o" in self.weight_gemm)
        return self.o_proj(attn)

    def split_heads(self, qkv: torch.Tensor):
        """[T, (H + 2 Hkv) d] rows -> q [T, H, d], k, v [T, Hkv, d], views into them."""
        t, h, hkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split((h * d, hkv * d, hkv * d), dim=-1)
        return q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] -> q [T, H, d], k [T, Hkv, d] (both rotated), v [T, Hkv, d]."""
        q, k, v = self.project(x)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def merge_rows(a: nn.Linear, b: nn.Linear, c: nn.Linear | None, name: str) -> torch.Tensor | None:
    """The layers' `name` parameters (weight or bias) concatenated by output rows into one new tensor, each
    parameter re-pointed at its rows of it (a view: the old storage is freed). None when they have none."""
    layers = [m for m in (a, b, c) if m is not None]
    params = [getattr(m, name) for m in layers]
    if params[0] is None:
        return None
    merged = torch.cat([p.detach() for p in params])
    first = 0
    for p in params:
        p.data = merged[first : first + p.shape[0]]
        first += p.shape[0]
    return merged


def runs_on_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wanted: bool) -> bool:
    """Whether a projection asked onto the Hopper GEMM runs there: no bias, an sm_90 GPU, 16-bit operands of
    its shapes (kernels.gemm.supported); otherwise it stays F.linear."""
    return wanted and bias is None and gemm.supported(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, on_gemm: bool) -> torch.Tensor:
    """F.linear, or with on_gemm the Hopper GEMM (kernels.gemm.linear) where it runs (runs_on_gemm)."""
    if runs_on_gemm(x, weight, bias, on_gemm):
        return gemm.linear(x, weight)
    return F.linear(x, weight, bias)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, tp: TPGroup = TPGroup()):
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = ColumnParallelLinear(hidden, inter, bias, dtype, tp)
        self.up_proj = ColumnParallelLinear(hidden, inter, bias, dtype, tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias, dtype, tp)
        # This rank's gate rows then its up rows [2 I / tp, hidden] once `merge_projections` ran.
        self.register_buffer("gate_up_weight", None, persistent=False)
        self.register_buffer("gate_up_bias", None, persistent=False)
        self.weight_gemm: frozenset[str] = frozenset()  # of "gate_up", "down": on kernels.gemm (set_weight_gemm)

    def merge_projections(self) -> None:
        """One gate/up matrix (vLLM's MergedColumnParallelLinear), gate_proj and up_proj views of its rows:
        one GEMM gives each token's [gate | up] row, which `fused.silu_and_mul` reads as it is."""
        self.gate_up_weight = merge_rows(self.gate_proj, self.up_proj, None, "weight")
        self.gate_up_bias = merge_rows(self.gate_proj, self.up_proj, None, "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The same with silu(gate) * up as one CUDA kernel: its own, or (gate_up on kernels.gemm) the GEMM's
        epilogue, the same bits as that GEMM then silu_and_mul."""
        return self._down(self._silu_mul_fused(x))

    def fused_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """norm.fused(self.fused(x), residual): the MLP, its output added to the residual stream (in place)
        and the next norm taken, bit for bit. With down on kernels.gemm, split over K, its reduce is the
        norm's first pass (`gemm.linear_add_rms_norm`): one launch fewer a layer, down's output never stored."""
        h = self._silu_mul_fused(x)
        if self._down_on_gemm(h):
            return gemm.linear_add_rms_norm(h, self.down_proj.weight, residual, norm.weight, norm.eps)
        return norm.fused(self.down_proj(h), residual)  # not on the GEMM (checked just above)

    def _down(self, h: torch.Tensor) -> torch.Tensor:
        return gemm.linear(h, self.down_proj.weight) if self._down_on_gemm(h) else self.down_proj(h)

    def _down_on_gemm(self, h: torch.Tensor) -> bool:
        """Whether down runs on kernels.gemm: asked for, one rank (a TP rank's partial sum goes to all_reduce
        through down_proj), and runs_on_gemm's conditions."""
        w, b = self.down_proj.weight, self.down_proj.bias
        return self.down_proj.tp.size == 1 and runs_on_gemm(h, w, b, "down" in self.weight_gemm)

    def _silu_mul_fused(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x) [T, I] on the fused kernels."""
        if self.gate_up_weight is None:
            return fused.silu_mul(self.gate_proj(x), self.up_proj(x))
        w, b = self.gate_up_weight, self.gate_up_bias
        if runs_on_gemm(x, w, b, "gate_up" in self.weight_gemm):
            return gemm.silu_mul_linear(x, w)
        return fused.silu_and_mul(F.linear(x, w, b))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. Split in two around attention, the one step that needs the other tokens."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, tp: TPGroup = TPGroup()):
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, tp)
        self.mlp = LlamaMLP(config, dtype, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def attn_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Residual stream x [T, hidden] -> this layer's q [T, H, d], k, v [T, Hkv, d]."""
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def attn_out_and_mlp(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream x [T, hidden] and attention output [T, H, d] -> the next residual stream."""
        x = x + self.self_attn.o_proj(attn.flatten(1))
        return x + self.mlp(self.post_attention_layernorm(x))

    # The same two halves on the fused CUDA kernels (`kernels.fused`): the same operations and roundings,
    # four launches of per-token work instead of ~40 (the norms' sums are associated differently).
    def attn_in_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """attn_in: cos, sin [T, d/2] are the tokens' own rows of the tables."""
        q, k, v = self.self_attn.project(self.input_layernorm.fused(x))
        fused.rotary_embedding(q, k, fused.RotaryTables(cos, sin))
        return q, k, v

    def attn_out_and_mlp_fused(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn_out_and_mlp; x is not written (the new residual stream is a new tensor)."""
        h = self.self_attn.o(attn.flatten(1))
        residual = torch.empty_like(x)
        h = self.post_attention_layernorm.fused(h, x, residual_out=residual)  # residual = x + h; h = its norm
        return residual.add_(self.mlp.fused(h))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, batch_invariant: bool = True,
                 tp: TPGroup = TPGroup()):
        super().__init__()
        self.batch_invariant = batch_invariant
        # On CUDA (not batch-invariant), the per-token work runs on the fused kernels unless this is False
        # (benchmarks set it to time the unfused torch ops). The CPU path never uses them.
        self.fused_kernels = True
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, backend) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers (one (k, v) pair per layer)")
        if self.uses_fused(input_ids) and getattr(backend, "fuses_rope", False):
            return self.forward_fused(input_ids, positions, kv_caches, meta, backend)
        with one_thread(self.batch_invariant):
            x, cos, sin = self.embed(input_ids, positions)
            for i, kv_cache in enumerate(kv_caches):
                q, k, v = self.layer_in(i, x, cos, sin)
                attn = backend.forward(q, k, v, kv_cache, meta, self.layers[i].self_attn.scale)  # [T, H, d]
                x = self.layer_out(i, x, attn)
            return self.final_norm(x)

    def uses_fused(self, t: torch.Tensor) -> bool:
        """Whether the per-token work on t's device runs on the fused CUDA kernels."""
        return self.fused_kernels and t.is_cuda and not self.batch_invariant

    def forward_fused(self, input_ids, positions, kv_caches, meta: AttentionMetadata, backend) -> torch.Tensor:
        """The forward as vLLM runs it on a GPU: each residual add is fused into the norm after it (the
        MLP's output is added by the next layer's input norm, the last one by the final norm), and RoPE
        into the attention backend's K/V write. Four launches of per-token work per layer; the same
        numbers as the pieces below (each norm reads the rounded sum), which the piecewise graphs replay."""
        rope = fused.RotaryTables(self.rotary.cos, self.rotary.sin, positions)  # the backend rotates q and k
        x = self.embed_tokens(input_ids)  # [T, hidden] the residual stream, updated in place
        h = self.layers[0].input_layernorm.fused(x)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            attn = layer.self_attn
            q, k, v = attn.project(h)
            out = backend.forward(q, k, v, kv_cache, meta, attn.scale, rope=rope)  # [T, H, d]
            h = attn.o(out.flatten(1))
            h = layer.post_attention_layernorm.fused(h, x)  # x += attention; h = norm(x)
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h = layer.mlp.fused_add_norm(h, x, next_norm)  # x += mlp; h = next_norm(x)
        return h

    # The forward in its pieces: everything but attention works on each token row alone, which is what
    # lets `pagedref.engine.cuda_graph` capture the pieces between two attention calls for a padded batch.
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """[T] ids and positions -> residual stream x [T, hidden], RoPE cos, sin [T, d/2] (table lookups)."""
        cos, sin = self.rotary(positions)
        return self.embed_tokens(input_ids), cos, sin

    def layer_in(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i before attention: x [T, hidden] -> q [T, H, d], k, v [T, Hkv, d]."""
        if self.uses_fused(x):
            return self.layers[i].attn_in_fused(x, cos, sin)
        return map_rows(self.layers[i].attn_in, x, cos, sin, per_row=self.batch_invariant)

    def layer_out(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Layer i after attention: x [T, hidden], attn [T, H, d] -> the next residual stream [T, hidden]."""
        if self.uses_fused(x):
            return self.layers[i].attn_out_and_mlp_fused(x, attn)
        return map_rows(self.layers[i].attn_out_and_mlp, x, attn, per_row=self.batch_invariant)

    def layer_qkv(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i before attention on the fused path, RoPE left to the backend's K/V write (as in
        `forward_fused`): x [T, hidden] -> [T, (H + 2 Hkv) d] rows of unrotated q | k | v."""
        if not self.uses_fused(x):
            raise ValueError("layer_qkv is the fused CUDA path's (q and k unrotated); use layer_in")
        return self.layers[i].self_attn.qkv_rows(self.layers[i].input_layernorm.fused(x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_fused(x):
            return self.norm.fused(x)
        return map_rows(self.norm, x, per_row=self.batch_invariant)

    def merge_projections(self) -> None:
        """Every layer's q/k/v and gate/up in one matrix each (see `LlamaForCausalLM.merge_projections`)."""
        for layer in self.layers:
            layer.self_attn.merge_projections()
            layer.mlp.merge_projections()


class LlamaForCausalLM(nn.Module):
    """Llama, Mistral and Qwen2 (they differ only in config: biases, tying, rope) with HF's parameter names.

    `config` is always the whole model's; with `tp` of N ranks this module holds one rank's shard.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, batch_invariant: bool = True,
                 tp: TPGroup = TPGroup()):
        super().__init__()
        check_tensor_parallel_size(config, tp.size)
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, dtype, batch_invariant, tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.lm_head_on_gemm = False  # set_weight_gemm
        self.tie_weights()

    @property
    def batch_invariant(self) -> bool:
        return self.model.batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, value: bool) -> None:
        self.model.batch_invariant = value

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:  # logits = hidden @ embeddingᵀ: one matrix, one parameter
            self.lm_head.weight = self.model.embed_tokens.weight

    def merge_projections(self) -> "LlamaForCausalLM":
        """Merge each layer's q/k/v projections into one matrix and its gate/up ones into another, as vLLM's
        QKVParallelLinear and MergedColumnParallelLinear do (after loading: the separate layers become views
        of the merged rows and keep their names). A decode step then runs 4 GEMMs a layer instead of 7, and
        the wider ones fill the GPU better. Under tensor parallelism each rank merges its own shards (its
        heads, its MLP columns). The merged GEMM rounds like the separate ones only up to cuBLAS's choice of
        algorithm for the wider shape, so the CPU path, bit-exact against its oracles, never merges
        (`load_model` merges on CUDA only)."""
        self.model.merge_projections()
        return self

    def set_weight_gemm(self, ops) -> "LlamaForCausalLM":
        """Run these projections of the CUDA fused path (WEIGHT_GEMM_OPS) on the project's Hopper GEMM
        (kernels.gemm) instead of cuBLAS; () for none. Before any CUDA graph is captured: a graph replays
        the kernels it was captured with. Each falls back to F.linear where the GEMM does not run (a bias,
        not sm_90, a shape it does not take; o and down under tensor parallelism)."""
        ops = frozenset(ops)
        unknown = sorted(ops - set(WEIGHT_GEMM_OPS))
        if unknown:
            raise ValueError(f"weight GEMM ops {unknown} are not among {', '.join(WEIGHT_GEMM_OPS)}")
        for layer in self.model.layers:
            layer.self_attn.weight_gemm = ops & {"qkv", "o"}
            layer.mlp.weight_gemm = ops & {"gate_up", "down"}
        self.lm_head_on_gemm = "lm_head" in ops
        return self

    @property
    def merged(self) -> bool:
        return self.model.layers[0].self_attn.qkv_weight is not None

    def materialize(self, device: torch.device | str) -> "LlamaForCausalLM":
        """Give a model built on the meta device (no init work) real, uninitialised storage on `device`."""
        self.to_empty(device=device)
        self.tie_weights()  # to_empty gives the shared parameter two separate copies: share it again
        self.model.rotary.reset_tables()  # the tables were never computed on meta
        return self

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64: the step's new tokens, all sequences concatenated
        positions: torch.Tensor,  # [T] int64: each token's position in its sequence
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, each [num_blocks, block_size, Hkv, d]
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:
        """The step's final hidden states [T, hidden] (after the final norm); pass rows to compute_logits."""
        return self.model(input_ids, positions, kv_caches, meta, backend)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (lm_head in the model dtype, as transformers).
        float32=False leaves them in the model dtype, for a caller that reads only their argmax: widening to
        float32 is exact and keeps the order, so it cannot change an argmax (at 256 rows x 128k it costs a copy
        of ~0.1 ms on an H200)."""
        if self.lm_head_on_gemm and not self.batch_invariant:
            logits = linear(hidden, self.lm_head.weight, self.lm_head.bias, True)
        else:
            with one_thread(self.batch_invariant):
                logits = map_rows(self.lm_head, hidden, per_row=self.batch_invariant)
        return logits.float() if float32 else logits

    def forward_train(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal LM forward without any cache, for training: input_ids [B, T] -> logits [B, T, vocab] float32.

        Batched matrix products and torch's scaled_dot_product_attention; gradients flow (no no_grad).
        """
        b, t = input_ids.shape
        m = self.model
        positions = torch.arange(t, device=input_ids.device).repeat(b)  # [B*T]
        cos, sin = m.rotary(positions)
        x = m.embed_tokens(input_ids.flatten())  # [B*T, hidden]
        for layer in m.layers:
            q, k, v = layer.attn_in(x, cos, sin)  # [B*T, H, d], [B*T, Hkv, d] x2
            attn = causal_attention(q.view(b, t, *q.shape[1:]), k.view(b, t, *k.shape[1:]), v.view(b, t, *v.shape[1:]))
            x = layer.attn_out_and_mlp(x, attn.reshape(b * t, *q.shape[1:]))
        return self.lm_head(m.norm(x)).float().view(b, t, -1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, d], k/v [B, T, Hkv, d] -> [B, T, H, d]: causal grouped-query attention with torch SDPA."""
    group = q.shape[2] // k.shape[2]
    # Query head h reads KV head h // group: repeat each KV head `group` times, adjacent (HF's repeat_kv).
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)
