"""The small per-token ops of a Llama layer as fused CUDA kernels (`cuda/fused_ops.cu`): check, pick, launch.

One idea: between a layer's matrix multiplies, torch spends ~40 launches on memory-bound work
(RMSNorm's six ops twice, RoPE's ten on q and on k, the residual adds, SiLU, the multiply, the K/V
copy). Fused as vLLM fuses them, a layer needs four: `fused_add_rms_norm` (the residual add and the
next norm), `silu_and_mul`, and `rotary_embedding_and_cache` (RoPE on q and k, the rotated K and V
written straight into their paged slots), plus `rms_norm` for the first layer's input. Each reads its
activations once and writes them once, and fewer launches also shrink what a CUDA graph replays.
`splitk_add_rms_norm` is `fused_add_rms_norm` reading a split-K GEMM's fp32 partials in place of x (the
down projection on `kernels.gemm`: its reduce, the residual add and the next norm in one launch).

Configs: one compiled module per dtype (`fused_config`); the sizes (hidden, head_dim, heads,
intermediate) are run-time arguments, so every head_dim the engine supports (and any later one)
is served without a new compile. The kernels come in vector widths of 1, 2, 4 and 8 elements
(`vec_width`), picked from the row length alone.

Invariant: a row's result depends only on that row and the shapes, never on the batch, the tensor
addresses or the stream: the vector width and the norm's CTA size (hence its reduction order) are
functions of the row length, so a token's bits are the same in any batch. Launches go on torch's
current stream (graph-capturable). Shapes, dtypes, devices and alignment are checked on every call;
the value checks that copy indices to the host (positions, slots) run only with check=True.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedref.kernels import build, launch, validate

FILE = "fused_ops.cu"
ROPE_THREADS = 128  # per token: rotations and value copies are independent, any block size gives the same bits
SILU_THREADS = 256
_MAX_GRID_Y = 65535


def fused_config(dtype: str) -> build.KernelConfig:
    """The one module of `cuda/fused_ops.cu` for a dtype ("float32", "float16", "bfloat16")."""
    if dtype not in build.DTYPE_CODES:
        raise ValueError(f"the fused kernels take {tuple(build.DTYPE_CODES)}, got {dtype!r}")
    return build.KernelConfig(FILE, (("PR_DTYPE", build.DTYPE_CODES[dtype]),))


def ci_configs() -> list[build.KernelConfig]:
    """What CI compiles of this file: every dtype."""
    return [fused_config(d) for d in build.DTYPE_CODES]


def vec_width(n: int, elem_size: int) -> int:
    """Elements per load for rows of n elements: the widest of 8, 4, 2, 1 that divides n within 16 bytes."""
    return next(w for w in (8, 4, 2, 1) if w * elem_size <= 16 and n % w == 0)


def norm_threads(hidden: int, width: int) -> int:
    """The RMSNorm CTA size: one vector per thread up to 1024 threads (a power of two, at least a warp).
    A function of the row length only, so the reduction order is too."""
    vectors = -(-hidden // width)
    return min(1024, max(32, 1 << (vectors - 1).bit_length()))


@dataclass(frozen=True)
class RotaryTables:
    """What `rotary_embedding_and_cache` needs to rotate a step's tokens: the model's fp32 cos/sin tables
    [rows, head_dim / 2] and each token's row, positions [T] int64 (None: row t of the tables is token t's)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None = None


# --- launching ---------------------------------------------------------------------------------------

def _launch(dtype: torch.dtype, name: str, device: torch.device, grid: tuple, block: int, args: tuple,
            pdl: bool = False) -> None:
    """Launch `name` of the dtype's module on torch's current stream of `device` (the attention launcher's)."""
    launch._launch(fused_config(validate.DTYPE_NAMES[dtype]), name, device, grid, args, threads=block, pdl=pdl)


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


# --- checks --------------------------------------------------------------------------------------------

def _check_rows(t, name: str, like: torch.Tensor | None = None, cols: int | None = None) -> None:
    """A contiguous [num_tokens, cols] activation (of like's dtype, device and shape when given); its
    alignment is checked at launch, against the vector width."""
    dtypes = (like.dtype,) if like is not None else validate.FLOAT_DTYPES
    _check_index(t, name, "[num_tokens, hidden]", 2, dtypes, like.device if like is not None else None)
    if like is not None and t.shape != like.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} != {tuple(like.shape)}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns, got shape {tuple(t.shape)}")


def _check_index(t, name: str, layout: str, ndim: int, dtypes: tuple | torch.dtype, device) -> None:
    """validate.check_tensor without its 16-byte start: these kernels need only their vector width's
    alignment (`_check_aligned`), and slots, positions and the cos/sin tables are read one element at a
    time, so a slice of a larger tensor (a batch's rows) is fine."""
    validate.check_tensor(t, name, layout, ndim, dtypes if isinstance(dtypes, tuple) else (dtypes,), device, aligned=False)


def _check_weight(weight, x: torch.Tensor) -> None:
    _check_index(weight, "weight", "[hidden]", 1, x.dtype, x.device)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[0]} elements for rows of {x.shape[1]}")


def _check_heads(t, name: str, dtype, device, num_tokens: int | None = None, head_dim: int | None = None) -> None:
    """[num_tokens, heads, head_dim] with heads and dimensions contiguous; the token stride may be larger
    (a view into a merged qkv row)."""
    layout = "[num_tokens, heads, head_dim]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in ((dtype,) if dtype else validate.FLOAT_DTYPES):
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other arguments are on {device}")
    tokens, heads, dims = t.shape
    if (tokens > 1 and t.stride(0) < heads * dims) or (heads > 1 and t.stride(1) != dims) or (dims > 1 and t.stride(2) != 1):
        raise ValueError(f"{name} must hold each token's heads contiguously, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    if num_tokens is not None and t.shape[0] != num_tokens:
        raise ValueError(f"{name} has {t.shape[0]} tokens, q has {num_tokens}")
    if head_dim is not None and t.shape[2] != head_dim:
        raise ValueError(f"{name} head_dim {t.shape[2]} != q head_dim {head_dim}")


def _check_aligned(width: int, **tensors) -> None:
    """Each tensor's start and token stride on a `width`-element boundary (the kernels' vector loads)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.data_ptr() % (width * t.element_size()) or (t.dim() > 1 and t.shape[0] > 1 and t.stride(0) % width):
            raise ValueError(f"{name} must start and have its rows on {width * t.element_size()}-byte boundaries "
                             f"(vectors of {width} elements), got address {t.data_ptr():#x}, strides {t.stride()}")


def _check_tables(tables: RotaryTables, num_tokens: int, head_dim: int, device, check_values: bool) -> None:
    for name, t in (("cos", tables.cos), ("sin", tables.sin)):
        _check_index(t, name, "[rows, head_dim / 2] float32", 2, torch.float32, device)
        if t.shape[1] != head_dim // 2:
            raise ValueError(f"{name} has {t.shape[1]} columns, head_dim {head_dim} needs {head_dim // 2}")
    if tables.sin.shape != tables.cos.shape:
        raise ValueError(f"sin shape {tuple(tables.sin.shape)} != cos shape {tuple(tables.cos.shape)}")
    rows = tables.cos.shape[0]
    if tables.positions is None:
        if rows != num_tokens:
            raise ValueError(f"without positions, cos/sin are the tokens' own rows: {rows} rows for {num_tokens} tokens")
        return
    _check_index(tables.positions, "positions", "[num_tokens] int64", 1, torch.int64, device)
    if tables.positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {tables.positions.shape[0]} entries for {num_tokens} tokens")
    if check_values and num_tokens:
        pos = tables.positions.detach().to("cpu").numpy()
        for t in np.flatnonzero((pos < 0) | (pos >= rows))[:1]:
            raise ValueError(f"positions[{t}] = {pos[t]} is outside the cos/sin tables' {rows} rows")


def _check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot is -1 (padding: not written) or a slot of the pool, none written twice (one sync)."""
    slots = slot_mapping.detach().to("cpu").numpy()
    for t in np.flatnonzero((slots < -1) | (slots >= num_slots))[:1]:
        raise ValueError(f"slot_mapping[{t}] = {slots[t]} is neither -1 (padding) nor one of the pool's {num_slots} slots")
    uniq, counts = np.unique(slots[slots >= 0], return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"slot_mapping writes slot {uniq[counts > 1][0]} twice in one step")


# --- RMSNorm -----------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hidden] -> weight * round(x * rsqrt(mean(x²) + eps)) [T, hidden] (transformers' RMSNorm).
    out may be x itself."""
    _check_rows(x, "x")
    _check_weight(weight, x)
    out = torch.empty_like(x) if out is None else out
    _check_rows(out, "out", like=x)
    validate.require_cuda(x, "x")
    _norm("rms_norm", x, dict(out=out, x=x), weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """z = x + residual (rounded); residual_out = z; out = RMSNorm(z) -> (out, residual_out).

    x, residual [T, hidden]. By default in place as vLLM's: out is x, residual_out is residual."""
    _check_rows(x, "x")
    _check_rows(residual, "residual", like=x)
    _check_weight(weight, x)
    out, residual_out = _add_norm_outputs(residual, x if out is None else out, residual_out)
    validate.require_cuda(x, "x")
    _norm("fused_add_rms_norm", x, dict(out=out, x=x, residual=residual, residual_out=residual_out), weight, eps)
    return out, residual_out


def splitk_add_rms_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                        out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                        pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm whose x is a split-K GEMM's fp32 partials [splits, T, hidden] (`kernels.gemm`),
    summed in split order and rounded once: z = round(sum(partial)) + residual (rounded); residual_out = z;
    out = RMSNorm(z) -> (out, residual_out), bit for bit the GEMM's reduce then `fused_add_rms_norm`.
    residual_out defaults to residual (in place), out to a new tensor. pdl: launched under the GEMM's tail,
    waiting for its end in the kernel (a programmatic dependent launch, as the GEMM's own reduce)."""
    _check_rows(residual, "residual")
    _check_index(partial, "partial", "[splits, num_tokens, hidden]", 3, torch.float32, residual.device)
    if partial.shape[0] < 1 or partial.shape[1:] != residual.shape:
        raise ValueError(f"partial has shape {tuple(partial.shape)}, residual {tuple(residual.shape)}: it must be "
                         f"[splits >= 1, {', '.join(map(str, residual.shape))}]")
    _check_weight(weight, residual)
    out, residual_out = _add_norm_outputs(residual, torch.empty_like(residual) if out is None else out, residual_out)
    validate.require_cuda(residual, "residual")
    splits, num_tokens, hidden = partial.shape
    width = vec_width(hidden, residual.element_size())
    _check_aligned(width, partial=partial, out=out, residual=residual, residual_out=residual_out, weight=weight)
    if num_tokens:
        _launch(residual.dtype, f"splitk_add_rms_norm_w{width}", residual.device, (num_tokens,),
                norm_threads(hidden, width),
                (_ptr(out), _ptr(partial), np.int32(splits), np.int64(num_tokens * hidden), _ptr(residual),
                 _ptr(residual_out), _ptr(weight), np.int64(hidden), np.int32(hidden), np.float32(eps)), pdl=pdl)
    return out, residual_out


def _add_norm_outputs(residual: torch.Tensor, out: torch.Tensor,
                      residual_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, residual_out), residual_out defaulting to residual (in place): rows like residual's, and two
    different tensors (a row's sum and its norm are both kept)."""
    residual_out = residual if residual_out is None else residual_out
    _check_rows(out, "out", like=residual)
    _check_rows(residual_out, "residual_out", like=residual)
    if out.numel() and out.data_ptr() == residual_out.data_ptr():
        raise ValueError("out and residual_out must be different tensors")
    return out, residual_out


def _norm(name: str, x: torch.Tensor, rows: dict, weight: torch.Tensor, eps: float) -> None:
    """Launch `name` over the row tensors `rows` (in the kernel's argument order)."""
    num_tokens, hidden = x.shape
    width = vec_width(hidden, x.element_size())
    _check_aligned(width, weight=weight, **rows)
    if num_tokens == 0:
        return
    _launch(x.dtype, f"{name}_w{width}", x.device, (num_tokens,), norm_threads(hidden, width),
            (*map(_ptr, rows.values()), _ptr(weight), np.int64(hidden), np.int32(hidden), np.float32(eps)))


# --- SiLU and multiply -------------------------------------------------------------------------------

def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's silu_and_mul: x [T, 2 * I] (gate | up, one gate_up row) -> silu(gate) * up [T, I]."""
    _check_rows(x, "x")
    if x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * intermediate] (gate | up), got {x.shape[1]} columns")
    n = x.shape[1] // 2
    return _silu(x, x[:, :n], x[:, n:], x.stride(0), n, out)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up, gate and up [T, I] (separate projections) -> [T, I]."""
    _check_rows(gate, "gate")
    _check_rows(up, "up", like=gate)
    return _silu(gate, gate, up, gate.stride(0), gate.shape[1], out)


def _silu(like: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, in_stride: int, n: int,
          out: torch.Tensor | None) -> torch.Tensor:
    num_tokens = like.shape[0]
    out = like.new_empty((num_tokens, n)) if out is None else out
    _check_rows(out, "out", like=None, cols=n)
    if out.dtype != like.dtype or out.device != like.device or out.shape[0] != num_tokens:
        raise ValueError(f"out must be [{num_tokens}, {n}] {like.dtype} on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    validate.require_cuda(like, "gate")
    width = vec_width(n, like.element_size())
    _check_aligned(width, gate=gate, up=up, out=out)  # (the up half of a gate_up row starts n elements in)
    chunks = -(-n // (width * SILU_THREADS))
    if num_tokens == 0 or n == 0:
        return out
    if chunks > _MAX_GRID_Y:
        raise ValueError(f"rows of {n} elements need {chunks} CTAs each; at most {_MAX_GRID_Y} are supported")
    _launch(like.dtype, f"silu_and_mul_w{width}", like.device, (num_tokens, chunks), SILU_THREADS,
            (_ptr(out), _ptr(gate), _ptr(up), np.int64(out.stride(0)), np.int64(in_stride), np.int64(in_stride),
             np.int32(n)))
    return out


# --- RoPE, and RoPE with the K/V write ---------------------------------------------------------------

def rotary_embedding(q: torch.Tensor, k: torch.Tensor, tables: RotaryTables, *,
                     check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in place (transformers' rotate-half layout) on q [T, H, d] and k [T, Hkv, d] -> (q, k)."""
    _rope(q, q, k, None, None, None, None, tables, check, write_k=True)
    return q, k


def rotary_embedding_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, slot_mapping: torch.Tensor, tables: RotaryTables, *,
                               check: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE on q and on k on its way to the pool: rotated k and v [T, Hkv, d] go to their slots of
    k/v_cache [num_blocks, block_size, Hkv, d] (a slot of -1 is padding: nothing is written). k itself is
    left as it was. The rotated q [T, H, d] goes to out (default: q itself, in place), which is returned:
    q, k and v may be strided views into one merged qkv row and out the contiguous queries attention
    reads. check=True also checks slots and positions (one host sync)."""
    out = q if out is None else out
    _rope(out, q, k, v, k_cache, v_cache, slot_mapping, tables, check, write_k=False)
    return out


def _rope(q_out, q, k, v, k_cache, v_cache, slot_mapping, tables: RotaryTables, check: bool, write_k: bool) -> None:
    _check_heads(q, "q", None, None)
    num_tokens, num_heads, head_dim = q.shape
    if q_out is not q:
        _check_heads(q_out, "out", q.dtype, q.device, num_tokens, head_dim)
        if q_out.shape != q.shape:
            raise ValueError(f"out shape {tuple(q_out.shape)} != q shape {tuple(q.shape)}")
    _check_heads(k, "k", q.dtype, q.device, num_tokens, head_dim)
    if head_dim % 2:
        raise ValueError(f"RoPE pairs dimension i with i + head_dim / 2: head_dim must be even, got {head_dim}")
    num_kv_heads = k.shape[1]
    if v is not None:
        _check_heads(v, "v", q.dtype, q.device, num_tokens, head_dim)
        if v.shape != k.shape:
            raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
        layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
        validate.check_tensor(k_cache, "k_cache", layout, 4, (q.dtype,), q.device)
        validate.check_tensor(v_cache, "v_cache", layout, 4, (q.dtype,), q.device)
        if v_cache.shape != k_cache.shape or k_cache.shape[2:] != k.shape[1:]:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                             f"[num_blocks, block_size, {num_kv_heads}, {head_dim}] to match k")
        _check_index(slot_mapping, "slot_mapping", "[num_tokens] int64", 1, torch.int64, q.device)
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    _check_tables(tables, num_tokens, head_dim, q.device, check)
    width = vec_width(head_dim // 2, q.element_size())
    _check_aligned(width, q=q, k=k, v=v, out=q_out)
    if check and v is not None:
        _check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    validate.require_cuda(q, "q")
    if num_tokens == 0:
        return
    stride = lambda t: np.int64(t.stride(0) if t is not None else 0)  # noqa: E731
    _launch(q.dtype, f"rotary_embedding_and_cache_w{width}", q.device, (num_tokens,), ROPE_THREADS,
            (_ptr(q_out), _ptr(q), _ptr(k), _ptr(v), stride(q_out), stride(q), stride(k), stride(v), _ptr(k_cache),
             _ptr(v_cache), _ptr(slot_mapping), _ptr(tables.positions), _ptr(tables.cos), _ptr(tables.sin),
             np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim), np.int32(write_k)))
