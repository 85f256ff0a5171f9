"""GPU checks of the fused small-op kernels (`pagedref.kernels.fused`); skipped without a GPU.

Each kernel against a float64 oracle (fp32 <= 1e-5, fp16/bf16 <= 1e-2 norm-relative per row), in every
dtype and vector width; RoPE at every head_dim the engine serves and those issue 17 adds, with llama3
scaled tables, GQA, padding slots (-1) and a NaN pool (a stray write or a skipped one shows). Bitwise:
each row the same in any batch and on every run, the fused add equal to torch's add then the norm, a
CUDA graph's replay equal to the eager launch. The model: the fused CUDA forward within tolerance of the
unfused one, and bit for bit the pieces the piecewise graphs replay.

Run as a script it is also the device's driver (no pytest):
  python tests/test_fused_ops_gpu.py sanitize   every kernel and width once on small shapes (for compute-sanitizer)
  python tests/test_fused_ops_gpu.py bench      the small ops of an 8B decode step, fused against torch
"""

from __future__ import annotations

import statistics
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagedref.kernels import fused, gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")]

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = (8, 16, 32, 64, 80, 96, 112, 120, 128, 192, 256)  # the engine's, and issue 17's 112/120/192
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max over rows of ||got - want|| / ||want|| (rows: the first dimension), want in float64."""
    g, w = got.double().flatten(1), want.double().flatten(1)
    return float(((g - w).norm(dim=1) / w.norm(dim=1).clamp_min(1e-300)).max())


def tables(head_dim: int, rows: int = 4096, scaling: dict | None = LLAMA3, device="cuda"):
    """The model's own fp32 cos/sin tables [rows, head_dim / 2] (RotaryEmbedding, llama3 scaling by default)."""
    from pagedref.models.llama import RotaryEmbedding

    cfg = SimpleNamespace(max_position_embeddings=rows, head_dim=head_dim, rope_theta=500000.0, rope_scaling=scaling)
    rot = RotaryEmbedding(cfg).to(device)
    return rot.cos, rot.sin


# --- float64 oracles ---------------------------------------------------------------------------------

def norm_oracle(z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    z = z.double()
    return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def silu_oracle(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


def rope_oracle(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated by the tokens' rows cos, sin [T, d/2] (the fp32 tables, widened), float64."""
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# --- RMSNorm -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [63, 64, 172, 2048, 4096, 8192])  # widths 1 (fp32 63), 2/4 and 8; 1024 threads
def test_rms_norm_against_float64(dtype, hidden):
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    x = (3 * torch.randn(37, hidden, device="cuda", generator=gen)).to(dtype)
    w = (1 + 0.3 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
    out = fused.rms_norm(x, w, 1e-5, out=torch.full_like(x, float("nan")))
    assert rel_err(out, norm_oracle(x, w, 1e-5)) <= TOL[dtype]
    x2 = x.clone()
    assert fused.rms_norm(x2, w, 1e-5, out=x2) is x2 and torch.equal(x2, out)  # in place: the same bits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [63, 172, 4096])
def test_fused_add_rms_norm_is_torch_add_then_the_norm(dtype, hidden):
    gen = torch.Generator(device="cuda").manual_seed(hidden + 1)
    x = torch.randn(29, hidden, device="cuda", generator=gen).to(dtype)
    r = (4 * torch.randn(29, hidden, device="cuda", generator=gen)).to(dtype)
    w = torch.randn(hidden, device="cuda", generator=gen).to(dtype)
    z = x + r  # torch's rounded sum
    out, res = fused.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    assert torch.equal(res, z), "residual_out is the rounded sum"
    assert rel_err(out, norm_oracle(z, w, 1e-6)) <= TOL[dtype]
    assert torch.equal(out, fused.rms_norm(z, w, 1e-6)), "the norm of the rounded sum, as rms_norm computes it"
    # out of place: the inputs are not written
    x0, r0 = x.clone(), r.clone()
    out2, res2 = fused.fused_add_rms_norm(x, r, w, 1e-6, out=torch.empty_like(x), residual_out=torch.empty_like(x))
    assert torch.equal(x, x0) and torch.equal(r, r0) and torch.equal(out2, out) and torch.equal(res2, res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("hidden", [63, 172, 4096])
def test_splitk_add_rms_norm_is_the_reduce_then_fused_add_rms_norm(dtype, splits, hidden):
    # x is a split-K GEMM's fp32 partials: summed in split order in fp32, rounded once (the GEMM's reduce).
    gen = torch.Generator(device="cuda").manual_seed(hidden + splits)
    partial = torch.randn(splits, 29, hidden, device="cuda", generator=gen)
    r = (4 * torch.randn(29, hidden, device="cuda", generator=gen)).to(dtype)
    w = torch.randn(hidden, device="cuda", generator=gen).to(dtype)
    y = partial[0].clone()
    for z in range(1, splits):
        y += partial[z]
    want, want_res = fused.fused_add_rms_norm(y.to(dtype), r.clone(), w, 1e-6)
    res = r.clone()
    out, res_out = fused.splitk_add_rms_norm(partial, res, w, 1e-6, out=torch.full_like(r, float("nan")))
    assert res_out is res and torch.equal(res, want_res), "residual_out is the rounded sum, in place"
    assert torch.equal(out, want), "the norm of the rounded sum, as fused_add_rms_norm computes it"
    r0 = r.clone()
    out2, res2 = fused.splitk_add_rms_norm(partial, r, w, 1e-6, residual_out=torch.empty_like(r))
    assert torch.equal(r, r0) and torch.equal(out2, want) and torch.equal(res2, want_res), "out of place"


# --- SiLU and multiply ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [7, 172, 512, 14336])
def test_silu_and_mul_against_float64(dtype, n):
    gen = torch.Generator(device="cuda").manual_seed(n)
    gate_up = (4 * torch.randn(33, 2 * n, device="cuda", generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -1e-3])  # the tails: silu -> -0 and -> x
    merged = fused.silu_and_mul(gate_up)
    gate, up = gate_up[:, :n].contiguous(), gate_up[:, n:].contiguous()
    assert rel_err(merged, silu_oracle(gate, up)) <= TOL[dtype]
    assert torch.isfinite(merged).all()
    assert torch.equal(fused.silu_mul(gate, up), merged), "one gate_up row or two tensors: the same bits"


# --- RoPE and the K/V write -------------------------------------------------------------------------

def rope_problem(dtype, head_dim, num_heads=8, num_kv_heads=2, tokens=45, block_size=16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cos, sin = tables(head_dim)
    q = torch.randn(tokens, num_heads, head_dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    positions = torch.randint(0, cos.shape[0], (tokens,), device="cuda", generator=gen)
    num_blocks = -(-tokens // block_size) + 3
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:tokens]
    slots[[3, 17]] = -1  # padding rows
    cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    return SimpleNamespace(q=q, k=k, v=v, cos=cos, sin=sin, positions=positions, slots=slots, k_cache=cache,
                           v_cache=cache.clone())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_rope_and_cache_against_float64(dtype, head_dim):
    p = rope_problem(dtype, head_dim, seed=head_dim)
    q0, k0 = p.q.clone(), p.k.clone()
    rope = fused.RotaryTables(p.cos, p.sin, p.positions)
    fused.rotary_embedding_and_cache(p.q, p.k, p.v, p.k_cache, p.v_cache, p.slots, rope)
    cos, sin = p.cos[p.positions], p.sin[p.positions]
    assert rel_err(p.q, rope_oracle(q0, cos, sin)) <= TOL[dtype]
    assert torch.equal(p.k, k0), "k itself is left unrotated"
    real = p.slots >= 0
    flat_k, flat_v = p.k_cache.flatten(0, 1), p.v_cache.flatten(0, 1)  # [slots, Hkv, d]
    assert rel_err(flat_k[p.slots[real]], rope_oracle(k0, cos, sin)[real]) <= TOL[dtype]
    assert torch.equal(flat_v[p.slots[real]], p.v[real])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool, device="cuda")
    written[p.slots[real]] = True
    assert flat_k[~written].isnan().all() and flat_v[~written].isnan().all(), "padding and other slots untouched"
    # RoPE alone, and with the tokens' rows of the tables gathered: the same bits as on the way to the pool
    q1, k1 = fused.rotary_embedding(q0.clone(), k0.clone(), fused.RotaryTables(cos.contiguous(), sin.contiguous()))
    assert torch.equal(q1, p.q) and torch.equal(k1[real], flat_k[p.slots[real]])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(1, 1), (4, 4), (7, 1), (32, 8)])
def test_rope_grouped_query_shapes_and_unscaled_tables(num_heads, num_kv_heads):
    p = rope_problem(torch.bfloat16, 128, num_heads, num_kv_heads, tokens=20, seed=num_heads)
    cos, sin = tables(128, rows=512, scaling=None)
    positions = p.positions % 512
    q0, k0 = p.q.clone(), p.k.clone()
    fused.rotary_embedding_and_cache(p.q, p.k, p.v, p.k_cache, p.v_cache, p.slots, fused.RotaryTables(cos, sin, positions))
    real = p.slots >= 0
    assert rel_err(p.q, rope_oracle(q0, cos[positions], sin[positions])) <= 1e-2
    got_k = p.k_cache.flatten(0, 1)[p.slots[real]]
    assert rel_err(got_k, rope_oracle(k0, cos[positions], sin[positions])[real]) <= 1e-2


def test_rope_reads_a_merged_qkv_row():
    t, h, hkv, d = 9, 4, 2, 64
    qkv = torch.randn(t, (h + 2 * hkv) * d, device="cuda")
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=1)
    q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
    cos, sin = tables(d, rows=t)
    q_want, k_want = rope_oracle(q, cos, sin), rope_oracle(k, cos, sin)
    fused.rotary_embedding(q, k, fused.RotaryTables(cos, sin))
    assert rel_err(q, q_want) <= 1e-5 and rel_err(k, k_want) <= 1e-5
    assert torch.equal(v, qkv[:, (h + hkv) * d :].view(t, hkv, d)), "v untouched"


def test_rope_and_cache_from_a_merged_qkv_row_into_contiguous_queries():
    # the backend's call on the merged projection's output: q, k, v strided views of one row, the rotated q
    # into a new contiguous tensor; the same bits as the in-place call on contiguous copies
    p = rope_problem(torch.bfloat16, 128, num_heads=8, num_kv_heads=2, tokens=33, seed=7)
    qkv = torch.cat((p.q.flatten(1), p.k.flatten(1), p.v.flatten(1)), dim=1)  # [T, (8 + 2 + 2) * 128]
    q, k, v = (t.view(33, -1, 128) for t in qkv.split((8 * 128, 2 * 128, 2 * 128), dim=1))
    assert not q.is_contiguous()
    rope = fused.RotaryTables(p.cos, p.sin, p.positions)
    k_cache, v_cache = p.k_cache.clone(), p.v_cache.clone()
    before = qkv.clone()
    out = torch.empty_like(p.q)
    got = fused.rotary_embedding_and_cache(q, k, v, k_cache, v_cache, p.slots, rope, out=out)
    assert got is out
    assert torch.equal(qkv, before), "with out=, the merged row is only read"
    want = fused.rotary_embedding_and_cache(p.q, p.k, p.v, p.k_cache, p.v_cache, p.slots, rope)
    assert torch.equal(out, want)
    for got, want in ((k_cache, p.k_cache), (v_cache, p.v_cache)):  # the same slots written, the same bits
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(ValueError, match="out shape"):
        fused.rotary_embedding_and_cache(q, k, v, k_cache, v_cache, p.slots, rope, out=torch.empty_like(p.q[:, :4]))


# --- bitwise: batch invariance, determinism, CUDA graphs ------------------------------------------------

def run_all(x, r, w, gate, up, q, k, v, k_cache, v_cache, slots, rope):
    """Every kernel once, out of place where it can be: what each row's result is."""
    n = fused.rms_norm(x, w, 1e-5)
    a, s = fused.fused_add_rms_norm(x, r, w, 1e-5, out=torch.empty_like(x), residual_out=torch.empty_like(x))
    m = fused.silu_mul(gate, up)
    q = q.clone()
    fused.rotary_embedding_and_cache(q, k, v, k_cache, v_cache, slots, rope, check=False)
    return n, a, s, m, q, k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]


def small_step(dtype, tokens=64, hidden=4096, inter=1024, h=8, hkv=2, d=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).to(dtype)  # noqa: E731
    cos, sin = tables(d)
    cache = torch.zeros(tokens // 16 + 2, 16, hkv, d, dtype=dtype, device="cuda")
    return dict(x=rn(tokens, hidden), r=rn(tokens, hidden), w=rn(hidden), gate=rn(tokens, inter), up=rn(tokens, inter),
                q=rn(tokens, h, d), k=rn(tokens, hkv, d), v=rn(tokens, hkv, d), k_cache=cache, v_cache=cache.clone(),
                slots=torch.randperm(cache.shape[0] * 16, device="cuda", generator=gen)[:tokens],
                rope=fused.RotaryTables(cos, sin, torch.randint(0, 4096, (tokens,), device="cuda", generator=gen)))


def rows_of(args: dict, rows: slice) -> dict:
    out = {key: (val[rows].contiguous() if key in ("x", "r", "gate", "up", "q", "k", "v", "slots") else val)
           for key, val in args.items()}
    out["rope"] = fused.RotaryTables(args["rope"].cos, args["rope"].sin, args["rope"].positions[rows].contiguous())
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_the_same_in_any_batch_and_on_every_run(dtype):
    args = small_step(dtype)
    full = run_all(**args)
    again = run_all(**args)
    assert all(torch.equal(a, b) for a, b in zip(full, again)), "deterministic"
    for rows in (slice(5, 21), slice(63, 64)):
        sub = run_all(**rows_of(args, rows))
        assert all(torch.equal(a[rows], b) for a, b in zip(full, sub)), f"rows {rows} alone differ from the batch"


def test_the_kernels_replay_from_a_cuda_graph():
    args = small_step(torch.bfloat16, seed=1)
    static = {key: (val.clone() if isinstance(val, torch.Tensor) else val) for key, val in args.items()}
    run_all(**static)  # warm-up outside the graph: modules loaded
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run_all(**static)
    fresh = small_step(torch.bfloat16, seed=2)  # new inputs into the static buffers
    for key in ("x", "r", "gate", "up", "q", "k", "v"):
        static[key].copy_(fresh[key])
    static["rope"].positions.copy_(fresh["rope"].positions)
    graph.replay()
    torch.cuda.synchronize()
    want = run_all(**{**static, "k_cache": torch.zeros_like(static["k_cache"]), "v_cache": torch.zeros_like(static["v_cache"])})
    assert all(torch.equal(a, b) for a, b in zip(outs, want))


# --- the model on CUDA -------------------------------------------------------------------------------

class Unfusing:
    """The cuda backend without `fuses_rope`: the model runs its pieces (layer_in / layer_out / final_norm),
    as the piecewise CUDA graphs replay them."""

    def __init__(self, backend):
        self.backend = backend

    def forward(self, *args):
        return self.backend.forward(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny-llama3-hd64", "tiny-qwen2-hd128", "stories260K"])
def test_the_fused_model_forward(name, dtype):
    from helpers import greedy_generate, model_path, read_reference
    from pagedref.backends import get_backend
    from pagedref.models import load_model

    model = load_model(model_path(name), device="cuda", dtype=dtype, batch_invariant=False)
    if name == "stories260K":
        prompts = [c["prompt_ids"] for c in read_reference(name, "llama2c_reference.json")["cases"]]
    else:
        prompts = [c["prompt_ids"][:100] for c in read_reference(name, "hf_reference.json")["cases"]]
    kw = dict(max_new_tokens=6, chunk_size=32)  # chunked prefill next to decodes
    backend = get_backend("cuda")
    model.model.fused_kernels = False
    unfused = greedy_generate(model, prompts, backend=backend, **kw)
    model.model.fused_kernels = True
    whole = greedy_generate(model, prompts, backend=backend, **kw)
    pieces = greedy_generate(model, prompts, backend=Unfusing(backend), **kw)
    for got, want in zip(whole[1], pieces[1]):
        assert torch.equal(got, want), "the fused forward and its pieces: the same bits"
    if dtype == torch.float32:
        assert whole[0] == unfused[0]
        assert max((a - b).abs().max().item() for a, b in zip(whole[1], unfused[1])) <= 1e-4
        return
    # bf16: the first token's logits (before a near-tie can fork the runs) against the float32 model's;
    # the fused path rounds less often (RoPE and SiLU-times-up once each), so it is no further from them
    ref = load_model(model_path(name), device="cuda", dtype=torch.float32, batch_invariant=False)
    ref.model.fused_kernels = False
    ref_logits = greedy_generate(ref, prompts, backend=get_backend("cuda"), **{**kw, "max_new_tokens": 1})[1]
    err_fused = max(rel_err(a[:1], r) for a, r in zip(whole[1], ref_logits))
    err_unfused = max(rel_err(a[:1], r) for a, r in zip(unfused[1], ref_logits))
    print(f"{name} bf16 first logits vs float32: fused {err_fused:.2e}, unfused {err_unfused:.2e}")
    assert err_fused <= 2 * err_unfused + 1e-3


@pytest.mark.parametrize("name", ["tiny-llama3-hd64", "tiny-qwen2-hd128"])  # qwen2: q/k/v biases merged too
def test_the_merged_projections_match_the_separate_ones(name):
    from helpers import greedy_generate, model_path, read_reference
    from pagedref.backends import get_backend
    from pagedref.models import load_model

    merged = load_model(model_path(name), device="cuda", dtype=torch.float32, batch_invariant=False)
    separate = load_model(model_path(name), device="cuda", dtype=torch.float32, batch_invariant=True)
    separate.batch_invariant = False  # loaded per-row, so not merged; now the same batched path
    assert merged.merged and not separate.merged
    attn = merged.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr(), "q_proj is a view of the merged rows"
    prompts = [c["prompt_ids"][:100] for c in read_reference(name, "hf_reference.json")["cases"]]
    kw = dict(max_new_tokens=6, chunk_size=32, backend=get_backend("cuda"))
    got, want = greedy_generate(merged, prompts, **kw), greedy_generate(separate, prompts, **kw)
    assert got[0] == want[0]
    assert max((a - b).abs().max().item() for a, b in zip(got[1], want[1])) <= 1e-4


# --- the device driver ---------------------------------------------------------------------------------

def sanitize() -> None:
    """Every kernel in every vector width once, on small shapes, with its result checked (under
    compute-sanitizer memcheck / racecheck on the device)."""
    cases = 0
    for dtype in DTYPES:
        for hidden in (63, 66, 68, 72, 4096):  # fp32 widths 1, 2, 4; 16-bit 1, 2, 4, 8
            x = torch.randn(5, hidden, device="cuda").to(dtype)
            r, w = torch.randn_like(x), torch.randn(hidden, device="cuda").to(dtype)
            assert rel_err(fused.rms_norm(x, w, 1e-5), norm_oracle(x, w, 1e-5)) <= TOL[dtype]
            out, res = fused.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
            assert torch.equal(res, x + r) and rel_err(out, norm_oracle(x + r, w, 1e-5)) <= TOL[dtype]
            partial = torch.randn(2, 5, hidden, device="cuda")
            got = fused.splitk_add_rms_norm(partial, r.clone(), w, 1e-5)[0]
            summed = (partial[0] + partial[1]).to(dtype)
            assert torch.equal(got, fused.fused_add_rms_norm(summed, r.clone(), w, 1e-5)[0])
            gu = torch.randn(5, 2 * hidden, device="cuda").to(dtype)
            assert rel_err(fused.silu_and_mul(gu), silu_oracle(gu[:, :hidden], gu[:, hidden:])) <= TOL[dtype]
            cases += 4
        for head_dim in (6, 8, 12, 32, 128):  # rope widths 1 (half 3), 2 (half 6), 4 (half 4), 8 / 4
            p = rope_problem(dtype, head_dim, num_heads=3, num_kv_heads=1, tokens=21, seed=head_dim)
            q0, k0 = p.q.clone(), p.k.clone()
            fused.rotary_embedding_and_cache(p.q, p.k, p.v, p.k_cache, p.v_cache, p.slots,
                                             fused.RotaryTables(p.cos, p.sin, p.positions))
            cos, sin = p.cos[p.positions], p.sin[p.positions]
            assert rel_err(p.q, rope_oracle(q0, cos, sin)) <= TOL[dtype]
            fused.rotary_embedding(q0, k0, fused.RotaryTables(cos.contiguous(), sin.contiguous()))
            assert torch.equal(q0, p.q)
            # from a merged [q | k | v] row (strided views) into a contiguous out, as the backend calls it
            qkv = torch.cat((q0.flatten(1), p.k.flatten(1), p.v.flatten(1)), dim=1)
            q, k, v = (t.view(21, -1, head_dim) for t in qkv.split((3 * head_dim, head_dim, head_dim), dim=1))
            out = fused.rotary_embedding_and_cache(q, k, v, p.k_cache, p.v_cache, p.slots,
                                                   fused.RotaryTables(cos.contiguous(), sin.contiguous()),
                                                   out=torch.empty_like(q0))
            assert rel_err(out, rope_oracle(q0, cos, sin)) <= TOL[dtype]
            cases += 3
    torch.cuda.synchronize()
    print(f"fused selfcheck: {cases} cases ok")


@torch.no_grad()
def bench(layers: int = 32, tokens: int = 256, hidden: int = 4096, heads: int = 32, kv_heads: int = 8,
          head_dim: int = 128, inter: int = 14336, dtype: torch.dtype = torch.bfloat16, replays: int = 30) -> None:
    """The small ops of one decode step at the Llama-3.1-8B shape (32 layers, 256 sequences), fused against
    the torch ops the model ran before, each as one CUDA graph over all layers' own buffers (so nothing
    stays in L2 between layers); median of `replays` replays, CUDA events."""
    from pagedref import kernels
    from pagedref.models.llama import RMSNorm, apply_rope

    dev, e = "cuda", torch.empty((), dtype=dtype).element_size()
    rn = lambda *shape: torch.randn(*shape, device=dev).to(dtype)  # noqa: E731
    cos, sin = tables(head_dim, rows=8192)
    positions = torch.randint(0, 8192, (tokens,), device=dev)
    num_blocks = tokens // 16 * 4
    L = [dict(x=rn(tokens, hidden), o=rn(tokens, hidden), d=rn(tokens, hidden), q=rn(tokens, heads, head_dim),
              k=rn(tokens, kv_heads, head_dim), v=rn(tokens, kv_heads, head_dim), g=rn(tokens, inter),
              u=rn(tokens, inter), a=rn(tokens, inter), kc=rn(num_blocks, 16, kv_heads, head_dim),
              vc=rn(num_blocks, 16, kv_heads, head_dim), slots=torch.randperm(num_blocks * 16, device=dev)[:tokens])
         for _ in range(layers)]
    norms = [RMSNorm(hidden, 1e-5, dtype).to(dev) for _ in range(2)]
    rope = fused.RotaryTables(cos, sin, positions)

    def torch_ops():  # what LlamaModel ran on CUDA before: RMSNorm, apply_rope, reshape_and_cache, adds, silu * up
        c, s = cos.index_select(0, positions), sin.index_select(0, positions)
        for b in L:
            norms[0](b["x"])
            q, k = apply_rope(b["q"], c, s), apply_rope(b["k"], c, s)
            kernels.reshape_and_cache(k, b["v"], b["kc"], b["vc"], b["slots"], check=False)
            x = b["x"] + b["o"]
            norms[1](x)
            F.silu(b["g"]) * b["u"]
            x + b["d"]

    def fused_ops():  # forward_fused: the add before each norm fused into it, RoPE into the cache write
        for i, b in enumerate(L):
            if i == 0:
                fused.rms_norm(b["x"], norms[0].weight, 1e-5)
            else:
                fused.fused_add_rms_norm(L[i - 1]["d"], b["x"], norms[0].weight, 1e-5)
            fused.rotary_embedding_and_cache(b["q"], b["k"], b["v"], b["kc"], b["vc"], b["slots"], rope, check=False)
            fused.fused_add_rms_norm(b["o"], b["x"], norms[1].weight, 1e-5)
            fused.silu_mul(b["g"], b["u"], out=b["a"])

    one = {  # each fused kernel alone over all layers, and its bytes (each activation read once, written once)
        "fused_add_rms_norm": (lambda: [fused.fused_add_rms_norm(b["o"], b["x"], norms[1].weight, 1e-5) for b in L],
                               4 * tokens * hidden * e + hidden * e),
        "rms_norm": (lambda: [fused.rms_norm(b["x"], norms[0].weight, 1e-5, out=b["o"]) for b in L],
                     2 * tokens * hidden * e + hidden * e),
        "rotary_embedding_and_cache": (
            lambda: [fused.rotary_embedding_and_cache(b["q"], b["k"], b["v"], b["kc"], b["vc"], b["slots"], rope,
                                                      check=False) for b in L],
            tokens * head_dim * e * (2 * heads + 4 * kv_heads) + tokens * head_dim * 4 + 16 * tokens),
        "silu_mul": (lambda: [fused.silu_mul(b["g"], b["u"], out=b["a"]) for b in L], 3 * tokens * inter * e),
        "reshape_and_cache (unfused, for scale)": (
            lambda: [kernels.reshape_and_cache(b["k"], b["v"], b["kc"], b["vc"], b["slots"], check=False) for b in L],
            4 * tokens * kv_heads * head_dim * e),
    }

    def graph_ms(fn) -> float:
        fn()  # warm-up: modules compiled and loaded, allocator primed
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def launches(fn) -> int:
        from torch.profiler import ProfilerActivity, profile

        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            return sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)
        except Exception as exc:  # a profiler that cannot start must not cost the timings
            print(f"(kernel count unavailable: {exc})")
            return -1

    src, dst = (torch.empty(1 << 28, dtype=torch.float32, device=dev) for _ in range(2))  # 1 GiB each
    copy_ms = graph_ms(lambda: dst.copy_(src))
    bw = 2 * 4 * src.numel() / copy_ms / 1e9  # TB/s: read + write
    print(f"shape: {layers} layers, {tokens} tokens, hidden {hidden}, heads {heads}/{kv_heads}, head_dim {head_dim}, "
          f"intermediate {inter}, {dtype}; {torch.cuda.get_device_name()}")
    print(f"copy bandwidth (1 GiB device-to-device copy_): {bw:.2f} TB/s")
    t_torch, t_fused = graph_ms(torch_ops), graph_ms(fused_ops)
    n_torch, n_fused = launches(torch_ops), launches(fused_ops)
    per_layer = (one["fused_add_rms_norm"][1] * 2 + one["rotary_embedding_and_cache"][1] + one["silu_mul"][1])
    print(f"small ops of one decode step, torch (before): {t_torch:.3f} ms, {n_torch} kernels")
    print(f"small ops of one decode step, fused (after):  {t_fused:.3f} ms, {n_fused} kernels; "
          f"{layers * per_layer / 1e6:.0f} MB moved at least = {layers * per_layer / t_fused / 1e9:.2f} TB/s "
          f"({layers * per_layer / t_fused / 1e9 / bw:.0%} of copy), speed-up {t_torch / t_fused:.2f}x")
    for name, (fn, nbytes) in one.items():
        ms = graph_ms(fn)
        print(f"  {name:40s} {1e3 * ms / layers:7.2f} us/layer  {nbytes / 1e6:6.2f} MB  "
              f"{nbytes * layers / ms / 1e9:5.2f} TB/s ({nbytes * layers / ms / 1e9 / bw:.0%} of copy)")


if __name__ == "__main__":
    {"sanitize": sanitize, "bench": bench}[sys.argv[1]]()
