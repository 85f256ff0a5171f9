"""CPU checks of the fused small-op kernels (`pagedref.kernels.fused`, `cuda/fused_ops.cu`), no GPU needed.

- the kernels compile with nvcc for every dtype (as CI compiles them), with no spills, and export every
  name the launchers ask for; CI's configuration list includes them;
- the launch rules: the vector width and the norm's CTA size follow from the row length alone;
- every launcher's argument errors, which come before the device check;
- the model's use of them: on the CPU they are never called, and with torch stand-ins that have the
  kernels' stated semantics, the fused forward (the residual adds deferred into the next norm, RoPE
  inside the backend's K/V write) gives the unfused forward's bits and the pieces' bits: the data
  flow is right, whatever the kernels' rounding.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from helpers import greedy_generate, model_path, read_reference
from pagedref.backends import get_backend
from pagedref.backends.metadata import AttentionMetadata
from pagedref.backends.reference import ReferenceBackend
from pagedref.kernels import build, fused, gemm
from pagedref.models import load_model
from pagedref.models.llama import LlamaModel

KERNELS = ("rms_norm", "fused_add_rms_norm", "splitk_add_rms_norm", "silu_and_mul", "rotary_embedding_and_cache")


# --- compiling ---------------------------------------------------------------------------------------

def test_ci_compiles_every_dtype_of_the_fused_kernels():
    assert fused.ci_configs() == [fused.fused_config(d) for d in ("float32", "float16", "bfloat16")]
    assert all(c in build.ci_configs() for c in fused.ci_configs())
    assert fused.fused_config("bfloat16").options()[-1] == "-DPR_DTYPE=2"
    with pytest.raises(ValueError, match="float8"):
        fused.fused_config("float8")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_nvcc_compiles_every_kernel_without_spilling(dtype, tmp_path):
    config = fused.fused_config(dtype)
    cmd = ["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", *config.options(), str(config.source),
           "-o", str(tmp_path / "k.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    entries = set(re.findall(r"Compiling entry function '(\w+)'", res.stderr))
    widths = (1, 2, 4) if dtype == "float32" else (1, 2, 4, 8)  # 16 bytes at most per load
    assert entries == {f"{k}_w{w}" for k in KERNELS for w in widths}
    assert res.stderr.count("0 bytes spill stores, 0 bytes spill loads") == len(entries), res.stderr


# --- launch rules ------------------------------------------------------------------------------------

@pytest.mark.parametrize("elem_size", [2, 4])
@pytest.mark.parametrize("n", [1, 4, 6, 8, 40, 60, 64, 172, 4096, 14336])
def test_vector_width_is_the_widest_that_divides_the_row_within_16_bytes(n, elem_size):
    w = fused.vec_width(n, elem_size)
    assert n % w == 0 and w * elem_size <= 16
    if w < 8:  # the next width up does not divide the row or does not fit
        assert n % (2 * w) or 2 * w * elem_size > 16
    assert fused.vec_width(4096, 2) == 8 and fused.vec_width(60, 2) == 4 and fused.vec_width(4096, 4) == 4


@pytest.mark.parametrize("hidden", [8, 64, 172, 2048, 4096, 8192, 16384])
def test_the_norm_cta_is_a_power_of_two_from_the_row_length(hidden):
    w = fused.vec_width(hidden, 2)
    threads = fused.norm_threads(hidden, w)
    assert threads & (threads - 1) == 0 and 32 <= threads <= 1024
    assert threads >= min(1024, hidden // w)  # one vector per thread while a CTA can hold them
    assert fused.norm_threads(4096, 8) == 512 and fused.norm_threads(64, 4) == 32


# --- argument checks (on CPU tensors: everything but the device is checked first) ---------------------

def test_norm_argument_errors():
    x, w = torch.randn(3, 64), torch.ones(64)
    with pytest.raises(ValueError, match="2-D"):
        fused.rms_norm(x[0], w, 1e-5)
    with pytest.raises(ValueError, match="weight has 32"):
        fused.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(TypeError, match="weight must have dtype torch.float32"):
        fused.rms_norm(x, w.half(), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        fused.rms_norm(torch.randn(64, 3).t(), w, 1e-5)
    with pytest.raises(ValueError, match=r"residual shape \(2, 64\)"):
        fused.fused_add_rms_norm(x, x[:2].clone(), w, 1e-5)
    with pytest.raises(ValueError, match="different tensors"):
        r = x.clone()
        fused.fused_add_rms_norm(x, r, w, 1e-5, out=r)
    with pytest.raises(ValueError, match="CUDA"):
        fused.rms_norm(x, w, 1e-5)
    with pytest.raises(ValueError, match="CUDA"):
        fused.fused_add_rms_norm(x, x.clone(), w, 1e-5)


def test_splitk_add_rms_norm_argument_errors():
    r, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    partial = torch.randn(2, 3, 64)
    for bad, error, match in ((partial[0], ValueError, "partial must be 3-D"),
                              (partial.half(), TypeError, "partial must have dtype torch.float32"),
                              (partial.transpose(1, 2).contiguous().transpose(1, 2), ValueError, "contiguous"),
                              (torch.randn(2, 4, 64), ValueError, r"must be \[splits >= 1, 3, 64\]"),
                              (torch.randn(2, 3, 32), ValueError, r"must be \[splits >= 1, 3, 64\]"),
                              (torch.randn(0, 3, 64), ValueError, r"must be \[splits >= 1, 3, 64\]")):
        with pytest.raises(error, match=match):
            fused.splitk_add_rms_norm(bad, r, w, 1e-5)
    with pytest.raises(ValueError, match="weight has 32"):
        fused.splitk_add_rms_norm(partial, r, w[:32], 1e-5)
    with pytest.raises(ValueError, match="different tensors"):
        fused.splitk_add_rms_norm(partial, r, w, 1e-5, out=r)
    with pytest.raises(ValueError, match=r"out shape \(2, 64\)"):
        fused.splitk_add_rms_norm(partial, r, w, 1e-5, out=r[:2].clone())
    with pytest.raises(ValueError, match="CUDA"):
        fused.splitk_add_rms_norm(partial, r, w, 1e-5)


def test_silu_argument_errors():
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        fused.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"up shape \(2, 6\)"):
        fused.silu_mul(torch.randn(2, 8), torch.randn(2, 6))
    with pytest.raises(ValueError, match="out must be"):
        fused.silu_and_mul(torch.randn(2, 8), out=torch.empty(3, 4))
    with pytest.raises(ValueError, match="4 columns"):
        fused.silu_and_mul(torch.randn(2, 8), out=torch.empty(2, 8))
    with pytest.raises(ValueError, match="CUDA"):
        fused.silu_and_mul(torch.randn(2, 8))


def _rope_args(tokens=3, heads=4, kv_heads=2, head_dim=16, blocks=4, block_size=8, rows=32):
    q = torch.randn(tokens, heads, head_dim)
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    cache = torch.zeros(blocks, block_size, kv_heads, head_dim)
    tables = fused.RotaryTables(torch.randn(rows, head_dim // 2), torch.randn(rows, head_dim // 2),
                                torch.arange(tokens, dtype=torch.int64) + 5)
    return q, k, v, cache, cache.clone(), torch.tensor([3, -1, 17]), tables


def test_rope_argument_errors():
    q, k, v, kc, vc, slots, tables = _rope_args()
    call = lambda **kw: fused.rotary_embedding_and_cache(**{**dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc,  # noqa: E731
                                                                     slot_mapping=slots, tables=tables), **kw})
    with pytest.raises(ValueError, match="head_dim 8 != q head_dim 16"):
        call(k=k[..., :8].contiguous())
    with pytest.raises(ValueError, match="must hold each token's heads contiguously"):
        call(q=q.transpose(0, 1))
    with pytest.raises(ValueError, match="v shape"):
        call(v=v[:, :1].contiguous())
    with pytest.raises(ValueError, match="k_cache"):
        call(k_cache=kc[..., :1, :].contiguous(), v_cache=vc[..., :1, :].contiguous())
    with pytest.raises(ValueError, match="2 slots for 3 tokens"):
        call(slot_mapping=slots[:2].clone())
    with pytest.raises(TypeError, match="cos must have dtype torch.float32"):
        call(tables=fused.RotaryTables(tables.cos.double(), tables.sin, tables.positions))
    with pytest.raises(ValueError, match="4 columns, head_dim 16 needs 8"):
        call(tables=fused.RotaryTables(tables.cos[:, :4].contiguous(), tables.sin[:, :4].contiguous(), tables.positions))
    with pytest.raises(ValueError, match="own rows: 32 rows for 3 tokens"):
        call(tables=fused.RotaryTables(tables.cos, tables.sin))
    with pytest.raises(ValueError, match=r"positions\[1\] = 32 is outside"):
        call(tables=fused.RotaryTables(tables.cos, tables.sin, torch.tensor([0, 32, 1])))
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = -2 is neither -1"):
        call(slot_mapping=torch.tensor([-2, 0, 1]))
    with pytest.raises(ValueError, match="32 slots"):
        call(slot_mapping=torch.tensor([0, 32, 1]))
    with pytest.raises(ValueError, match="slot 4 twice"):
        call(slot_mapping=torch.tensor([4, -1, 4]))
    with pytest.raises(ValueError, match="head_dim must be even"):
        fused.rotary_embedding(q[..., :15].contiguous(), k[..., :15].contiguous(),
                               fused.RotaryTables(tables.cos[:, :7].contiguous(), tables.sin[:, :7].contiguous(),
                                                  tables.positions))
    with pytest.raises(ValueError, match="CUDA"):
        call()  # everything right but the device; -1 is padding, allowed
    with pytest.raises(ValueError, match="CUDA"):
        call(tables=fused.RotaryTables(tables.cos, tables.sin, torch.tensor([0, 99, 1])), check=False)  # values unchecked
    with pytest.raises(ValueError, match="CUDA"):
        fused.rotary_embedding(q, k, tables)


def test_a_merged_qkv_row_is_accepted_and_a_misaligned_one_refused():
    t, heads, kv_heads, d = 3, 4, 2, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    tables = fused.RotaryTables(torch.randn(t, d // 2), torch.randn(t, d // 2))
    with pytest.raises(ValueError, match="CUDA"):  # token stride > heads * d: fine
        fused.rotary_embedding(q, k, tables)
    shifted = torch.randn(t * heads * d + 1)[1:].view(t, heads, d)  # 4 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="16-byte boundaries"):
        fused.rotary_embedding(shifted, k, tables)


def test_the_cuda_backend_with_rope_still_checks_the_pool_first():
    q, k, v, kc, vc, slots, tables = _rope_args(block_size=16)
    meta = AttentionMetadata(torch.tensor([3, 4, 17]), torch.arange(4, dtype=torch.int32),
                             torch.ones(3, dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int32), 1, 1, 16)
    backend = get_backend("cuda")
    assert backend.fuses_rope
    with pytest.raises(ValueError, match="CUDA"):
        backend.forward(q, k, v, (kc, vc), meta, 0.25, rope=tables)
    with pytest.raises(ValueError, match="key"):
        backend.forward(q, k[:, :1].contiguous(), v[:, :1].contiguous(), (kc, vc), meta, 0.25, rope=tables)


# --- the model's use of the kernels --------------------------------------------------------------------

def test_the_cpu_path_never_calls_the_fused_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a fused kernel was called on the CPU path")

    for name in ("rms_norm", "fused_add_rms_norm", "silu_mul", "silu_and_mul", "rotary_embedding",
                 "rotary_embedding_and_cache"):
        monkeypatch.setattr(fused, name, refuse)
    model = load_model(model_path("tiny-llama3-hd64"))
    assert not model.model.uses_fused(torch.zeros(1))
    model.batch_invariant = False  # the batched path too
    assert not model.model.uses_fused(torch.zeros(1))
    prompts = [c["prompt_ids"][:20] for c in read_reference("tiny-llama3-hd64", "hf_reference.json")["cases"]]
    greedy_generate(model, prompts, 3)


# Torch stand-ins with each kernel's stated semantics (cuda/fused_ops.cu's header), for the data flow.
def _norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_norm(x, weight, eps, *, out=None):
    y = _norm(x, weight, eps)
    return y if out is None else out.copy_(y)


def _fused_add_rms_norm(x, residual, weight, eps, *, out=None, residual_out=None):
    out = x if out is None else out
    residual_out = residual if residual_out is None else residual_out
    residual_out.copy_(x + residual)
    out.copy_(_norm(residual_out, weight, eps))
    return out, residual_out


def _silu_mul(gate, up, *, out=None):
    y = (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return y if out is None else out.copy_(y)


def _silu_and_mul(x, *, out=None):
    return _silu_mul(*x.chunk(2, dim=-1), out=out)


def _rotate(x, cos, sin):  # x [T, heads, d], cos/sin [T, d/2] float32 -> rotated, one rounding
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _rows(tables):
    if tables.positions is None:
        return tables.cos, tables.sin
    return tables.cos[tables.positions], tables.sin[tables.positions]


def _rotary_embedding(q, k, tables, *, check=True):
    cos, sin = _rows(tables)
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))
    return q, k


class FusingReference(ReferenceBackend):
    """The reference backend taking unrotated q, k and the tables, as the cuda backend does with rope=."""

    fuses_rope = True

    def __init__(self):
        self.calls_with_rope = 0

    def forward(self, q, k, v, kv_cache, meta, scale, *, rope=None):
        if rope is not None:
            self.calls_with_rope += 1
            cos, sin = _rows(rope)
            q.copy_(_rotate(q, cos, sin))
            k = _rotate(k, cos, sin)  # what goes into the pool; the caller's k is left unrotated
        return super().forward(q, k, v, kv_cache, meta, scale)


@pytest.fixture
def stand_ins(monkeypatch):
    """kernels.fused replaced by the stand-ins, and the fused path taken on the CPU."""
    for name, fn in (("rms_norm", _rms_norm), ("fused_add_rms_norm", _fused_add_rms_norm), ("silu_mul", _silu_mul),
                     ("silu_and_mul", _silu_and_mul), ("rotary_embedding", _rotary_embedding)):
        monkeypatch.setattr(fused, name, fn)
    monkeypatch.setattr(LlamaModel, "uses_fused", lambda self, t: self.fused_kernels and not self.batch_invariant)


@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
@pytest.mark.parametrize("name", ["tiny-llama3-hd64", "tiny-qwen2-hd128", "tiny-mistral-hd32", "stories260K"])
def test_the_fused_data_flow_gives_the_unfused_bits(stand_ins, name, merged):
    # float32: the stand-ins round exactly as the torch ops they replace, so any difference would be the
    # data flow's (a residual added twice or not at all, the wrong norm's weight, RoPE on the wrong rows).
    # Merged (the GPU's q/k/v and gate/up matrices), both runs use the merged GEMMs: the q, k, v views of
    # one row reach the backend's RoPE, and silu_and_mul reads [gate | up] rows.
    model = load_model(model_path(name))
    model.batch_invariant = False  # the GPU's batched path, here on the CPU
    if merged:
        model.merge_projections()
    if name == "stories260K":
        prompts = [c["prompt_ids"] for c in read_reference(name, "llama2c_reference.json")["cases"]]
    else:
        prompts = [c["prompt_ids"][:40] for c in read_reference(name, "hf_reference.json")["cases"]]
    kw = dict(max_new_tokens=4, chunk_size=16)  # chunked prefill mixed with decodes
    model.model.fused_kernels = False
    unfused = greedy_generate(model, prompts, **kw)
    model.model.fused_kernels = True
    backend = FusingReference()
    whole = greedy_generate(model, prompts, backend=backend, **kw)  # forward_fused: RoPE in the backend
    assert backend.calls_with_rope > 0
    pieces = greedy_generate(model, prompts, **kw)  # the plain backend: layer_in / layer_out / final_norm
    for run in (whole, pieces):
        assert run[0] == unfused[0]
        for got, want in zip(run[1], unfused[1]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
def test_down_on_the_weight_gemm_adds_into_the_next_norm_with_the_same_bits(stand_ins, monkeypatch, merged):
    # With down on kernels.gemm, forward_fused hands the next norm to the GEMM (gemm.linear_add_rms_norm:
    # its split-K reduce is that norm's first pass). With stand-ins of the GEMM calls' stated semantics, the
    # forward still gives the unfused bits: the MLP's output is added to the residual stream exactly once,
    # under the next layer's input norm (the final norm after the last layer).
    calls = {"linear_add_rms_norm": 0}

    def linear_add_rms_norm(x, w, residual, norm_weight, eps):
        calls["linear_add_rms_norm"] += 1
        return _fused_add_rms_norm(F.linear(x, w), residual, norm_weight, eps)[0]

    monkeypatch.setattr(gemm, "supported", lambda x, w: True)
    monkeypatch.setattr(gemm, "linear", lambda x, w: F.linear(x, w))
    monkeypatch.setattr(gemm, "silu_mul_linear", lambda x, w: _silu_and_mul(F.linear(x, w)))
    monkeypatch.setattr(gemm, "linear_add_rms_norm", linear_add_rms_norm)
    model = load_model(model_path("tiny-llama3-hd64"))
    model.batch_invariant = False
    if merged:
        model.merge_projections()
    prompts = [c["prompt_ids"][:40] for c in read_reference("tiny-llama3-hd64", "hf_reference.json")["cases"]]
    kw = dict(max_new_tokens=4, chunk_size=16)
    model.model.fused_kernels = False
    unfused = greedy_generate(model, prompts, **kw)
    model.model.fused_kernels = True
    model.set_weight_gemm({"gate_up", "down"})
    fused_run = greedy_generate(model, prompts, backend=FusingReference(), **kw)
    assert calls["linear_add_rms_norm"] > 0
    assert fused_run[0] == unfused[0]
    for got, want in zip(fused_run[1], unfused[1]):
        assert torch.equal(got, want)
