"""GPU checks of the Hopper weight GEMM (`pagedref.kernels.gemm`, `cuda/gemm_hopper.cu`); skipped without an sm_90 GPU.

Against a float64 product: every tile width, split and dtype, M from 1 to past two row tiles (the tail
rows of a tile are TMA's zeros). Bitwise: a row's output the same in any batch (sub-batches, a permuted
batch, rows of a larger NaN-padded buffer), on every run and in a CUDA graph's replay; the SiLU-fused
gate/up equal to the GEMM then `fused.silu_and_mul`, and down with the next norm (`linear_add_rms_norm`)
equal to the GEMM then `fused.fused_add_rms_norm`. Errors: shapes the kernel does not take are refused
with the reason.

Run as a script it is also the device's sanitizer driver (no pytest): `python tests/test_gemm_gpu.py sanitize`
runs every tile width, a split, the fused epilogue and the reduce fused into the norm once on small shapes.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from pagedref.kernels import fused, gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not gpu_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU and cupy")]

from pagedref.kernels import gemm  # noqa: E402  (after the skip: imports cupy lazily anyway)
from pagedref.kernels.build import GEMM_WIDTHS, GemmTile  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]


def operands(m: int, n: int, k: int, dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    w = (torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5).to(dtype)
    return x, w


def oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the elements, relative to the largest |want| (the outputs are O(1))."""
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bn", GEMM_WIDTHS)
@pytest.mark.parametrize("m", [1, 64, 200, 300])
def test_linear_matches_float64(bn, m, dtype):
    n, k = 2 * bn, 1024
    x, w = operands(m, n, k, dtype, seed=bn + m)
    got = gemm.linear(x, w, tile=GemmTile(bn))
    assert got.shape == (m, n) and got.dtype == dtype
    # fp32 accumulation, one rounding to 16 bits: within a few units of the output's last place.
    assert max_err(got, oracle(x, w)) < (4e-3 if dtype == torch.bfloat16 else 1e-3), f"bn={bn} m={m}"


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("bn", GEMM_WIDTHS)
def test_the_epilogue_waits_for_both_warpgroups_last_products(bn, silu):
    # The epilogue stages its tile in the ring's first bytes. With stages + 1 k-steps the last products read
    # stage 0, so a warpgroup that wrote its rows while the other's last wgmmas still read that stage would
    # corrupt them (found so: bn 192 and 224 at K = 1024 before the barrier).
    tile = GemmTile(bn)
    k = 64 * (tile.stages + 1)
    x, w = operands(200, 2 * bn, k, torch.bfloat16, seed=bn + k)
    if silu:
        got = gemm.silu_mul_linear(x, w, tile=tile)
        assert torch.equal(got, fused.silu_and_mul(gemm.linear(x, w, tile=tile)))
    else:
        assert max_err(gemm.linear(x, w, tile=tile), oracle(x, w)) < 4e-3, f"bn={bn} k={k}"


@pytest.mark.parametrize("splits", [2, 3, 4])
def test_split_k_matches_float64_and_is_fixed(splits):
    x, w = operands(256, 512, 4096, torch.bfloat16, seed=splits)
    got = gemm.linear(x, w, tile=GemmTile(128, splits))
    assert max_err(got, oracle(x, w)) < 4e-3
    assert torch.equal(got, gemm.linear(x, w, tile=GemmTile(128, splits))), "split-K must give the same bits every run"


@pytest.mark.parametrize("tile", [GemmTile(128), GemmTile(224), GemmTile(256, 2)])
def test_a_row_is_the_same_bits_in_any_batch(tile):
    n = 2 * tile.bn
    x, w = operands(300, n, 2048, torch.bfloat16, seed=tile.bn)
    full = gemm.linear(x, w, tile=tile)
    for m in (1, 5, 129, 256):
        assert torch.equal(gemm.linear(x[:m].contiguous(), w, tile=tile), full[:m]), f"rows of a batch of {m}"
    perm = torch.randperm(300, device="cuda")
    assert torch.equal(gemm.linear(x[perm].contiguous(), w, tile=tile), full[perm]), "a permuted batch"


@pytest.mark.parametrize("silu", [False, True])
def test_clusters_change_the_schedule_not_the_bits(silu):
    x, w = operands(200, 448, 1024, torch.bfloat16)
    call = gemm.silu_mul_linear if silu else gemm.linear
    assert torch.equal(call(x, w, tile=GemmTile(224, cluster=2)), call(x, w, tile=GemmTile(224, cluster=1)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_tile_width_changes_the_schedule_not_the_bits(dtype):
    # Each output element is its k-steps' wgmma products summed in k order, whatever the tile's width:
    # so a width may be chosen from the row count (a decode step's 256 rows, a prefill's thousands) and a
    # row keep its bits. The split of K does change them (other partial sums): it is the weight's alone.
    n = 5376  # a multiple of every width
    x, w = operands(300, n, 1024, dtype)
    ref = gemm.linear(x, w, tile=GemmTile(128))
    for bn in GEMM_WIDTHS:
        assert torch.equal(gemm.linear(x, w, tile=GemmTile(bn)), ref), f"width {bn} changed the bits"
    assert not torch.equal(gemm.linear(x, w, tile=GemmTile(128, 2)), ref), "a split of K reassociates the sums"


def test_rows_past_m_are_never_read():
    x, w = operands(100, 256, 1024, torch.bfloat16)
    buf = torch.full((256, 1024), float("nan"), device="cuda", dtype=torch.bfloat16)
    buf[:100] = x
    got = gemm.linear(buf[:100], w, tile=GemmTile(128))
    assert torch.isfinite(got).all() and torch.equal(got, gemm.linear(x, w, tile=GemmTile(128)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bn", [128, 192, 224, 256])
def test_silu_mul_linear_is_the_gemm_then_silu_and_mul(bn, dtype):
    inter = 2 * (bn // 2)
    x, gate_up = operands(200, 2 * inter, 1024, dtype, seed=bn)
    got = gemm.silu_mul_linear(x, gate_up, tile=GemmTile(bn))
    assert got.shape == (200, inter)
    ref = fused.silu_and_mul(gemm.linear(x, gate_up, tile=GemmTile(bn)))
    assert torch.equal(got, ref), "silu(gate) * up fused into the epilogue must round like the two kernels"
    g = oracle(x, gate_up)
    want = torch.nn.functional.silu(g[:, :inter]) * g[:, inter:]
    assert max_err(got, want) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 130, 256, 300])
@pytest.mark.parametrize("tile", [GemmTile(128), GemmTile(128, 2), GemmTile(64, 3), GemmTile(256, 4)])
def test_linear_add_rms_norm_is_the_gemm_then_fused_add_rms_norm(tile, m, dtype):
    """down, the residual add and the next norm: with a split of K the reduce is the norm's first pass
    (fused.splitk_add_rms_norm); the output and the residual stream are the two kernels' bits."""
    n, k = 512, 4096  # 64 k-steps: up to 4 splits of at least 16
    x, w = operands(m, n, k, dtype, seed=m + tile.splits)
    gen = torch.Generator(device="cuda").manual_seed(m)
    residual = (4 * torch.randn(m, n, device="cuda", generator=gen)).to(dtype)
    norm_w = (1 + 0.3 * torch.randn(n, device="cuda", generator=gen)).to(dtype)
    want_res = residual.clone()
    want = fused.fused_add_rms_norm(gemm.linear(x, w, tile=tile), want_res, norm_w, 1e-5)[0]
    got_res = residual.clone()
    got = gemm.linear_add_rms_norm(x, w, got_res, norm_w, 1e-5, tile=tile)
    assert torch.equal(got_res, want_res), f"{tile}: residual += down(x) must round as the reduce then the add"
    assert torch.equal(got, want), f"{tile}: the norm of the new residual must be fused_add_rms_norm's"


def test_linear_add_rms_norm_at_the_8b_down_shape_and_in_a_graph():
    """The 8B step's down (14336 -> 4096, its own tile, split over K) at 256 rows, eager and replayed."""
    x, w = operands(256, 4096, 14336, torch.bfloat16)
    assert gemm.gemm_tile(4096, 14336, torch.cuda.get_device_properties(0).multi_processor_count).splits > 1
    residual = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    want_res = residual.clone()
    want = fused.fused_add_rms_norm(gemm.linear(x, w), want_res, norm_w, 1e-5)[0]
    res = residual.clone()
    assert torch.equal(gemm.linear_add_rms_norm(x, w, res, norm_w, 1e-5), want) and torch.equal(res, want_res)
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        out = gemm.linear_add_rms_norm(x, w, res, norm_w, 1e-5)
    res.copy_(residual)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(res, want_res)


@pytest.mark.parametrize("bn", [128, 224, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fast_division_is_exact_for_every_16_bit_gate(dtype, bn):
    """The epilogue divides a / (1 + exp(-a)) by `/`'s own fast path and redoes a thread's row with `/` when
    a gate leaves that path's exact range. Every finite 16-bit value is a gate here, once: x is the identity
    (row t = e_t), so gate[t, i] = W_gate[i, t] exactly (one non-zero product per sum)."""
    rows = 128
    step = math.lcm(bn // 2, 32)  # whole tiles of bn / 2 columns, and 2 I a multiple of 64 (kernels.gemm.supported)
    inter = -(-(2**16 // rows) // step) * step  # >= 512 gate columns
    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).to(torch.float32)
    gates = torch.where(torch.isfinite(gates), gates, torch.zeros(()))  # an inf times 0 would poison a column
    gates = torch.cat((gates, torch.zeros(rows * inter - len(gates))))
    gen = torch.Generator().manual_seed(bn)
    w = torch.zeros(2 * inter, rows, dtype=dtype)
    w[:inter] = gates.view(rows, inter).t().to(dtype)  # gate row i, column t: gate (t, i)
    w[inter:] = (torch.randn(inter, rows, generator=gen) * 4).to(dtype)  # up: either sign
    x, w = torch.eye(rows, dtype=dtype).cuda(), w.cuda()
    got = gemm.silu_mul_linear(x, w, tile=GemmTile(bn))
    want = fused.silu_and_mul(gemm.linear(x, w, tile=GemmTile(bn)))
    wrong = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert len(wrong) == 0, (f"{len(wrong)} outputs differ from silu_and_mul's, the first at gate "
                             f"{float(w[wrong[0, 1], wrong[0, 0]])}: the fast division is not `/` there")
    assert (gates < -20).any(), "gates the fast path leaves to `/` are in the test too"


def test_model_shapes_take_their_own_tiles():
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    for n, k, silu in ((6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        xs = x if k == 4096 else torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
        got = gemm.silu_mul_linear(xs, w) if silu else gemm.linear(xs, w)
        g = oracle(xs, w)
        want = torch.nn.functional.silu(g[:, :n // 2]) * g[:, n // 2:] if silu else g
        assert max_err(got, want) < 1e-2, (n, k, silu, gemm.gemm_tile(n, k, silu_mul=silu))


def test_graph_replay_equals_eager():
    x, w = operands(256, 1024, 4096, torch.bfloat16)
    out = torch.empty(256, 1024, device="cuda", dtype=torch.bfloat16)
    eager = gemm.linear(x, w, tile=GemmTile(128, 2))
    g = torch.cuda.CUDAGraph()
    gemm.linear(x, w, out=out, tile=GemmTile(128, 2))  # compiled and warmed outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        gemm.linear(x, w, out=out, tile=GemmTile(128, 2))
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_bad_shapes_are_refused_with_the_reason():
    x, w = operands(8, 256, 1024, torch.bfloat16)
    with pytest.raises(ValueError, match="K a multiple of 64"):
        gemm.linear(x[:, :1000].contiguous(), w[:, :1000].contiguous())
    with pytest.raises(ValueError, match="does not divide"):
        gemm.linear(x, w[:192].contiguous(), tile=GemmTile(128))
    with pytest.raises(ValueError, match="float16/bfloat16"):
        gemm.linear(x.float(), w.float())
    with pytest.raises(ValueError, match="tile width"):
        GemmTile(100)


def test_bench_gemm_weight_stream_runs_both_ways_on_the_gpu(tmp_path):
    import json

    from pagedref.bench import gemm as bench_gemm

    out = tmp_path / "stream.json"
    assert bench_gemm.main(["--model-shape", "llama-3.2-1b", "--rows", "64", "--modes", "default", "pagedref",
                            "--reps", "3", "--extra", "2048x1024", "2048x2048", "--weight-stream", "1",
                            "--sustain", "0.05", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rounds = res["weight_stream"]["rounds"]
    for where in ("hbm", "l2"):
        (figures,) = rounds[where]
        assert set(figures) == {"default", "pagedref"} and all(f["us"] > 0 for f in figures["pagedref"].values())
    assert rounds["hbm"][0] == res["sustained"], "the first round from HBM is the plain report's"
    if rounds["hbm"][0]["default"]["o@64"]["mj"] is not None:  # NVML's energy counter is there
        assert res["weight_stream"]["cost"]["pagedref"]["lines"]["64"]["shapes"] == ["2048x1024", "2048x2048"]


def sanitize() -> None:
    """Every width once, a split and the fused epilogue, on small shapes (under compute-sanitizer)."""
    for bn in GEMM_WIDTHS:
        x, w = operands(130, 2 * bn, 256, torch.bfloat16, seed=bn)
        for cluster in (1, 2):
            gemm.linear(x, w, tile=GemmTile(bn, cluster=cluster))
            gemm.silu_mul_linear(x, w, tile=GemmTile(bn, cluster=cluster))
    x, w = operands(130, 256, 2048, torch.bfloat16)
    gemm.linear(x, w, tile=GemmTile(128, 2))
    residual = torch.randn(130, 256, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    gemm.linear_add_rms_norm(x, w, residual, norm_w, 1e-5, tile=GemmTile(128, 2))  # the reduce in the norm
    torch.cuda.synchronize()
    print("gemm sanitize: ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["sanitize"]:
        sanitize()
    else:
        sys.exit(f"usage: {sys.argv[0]} sanitize")
