"""CPU checks of the Hopper weight GEMM's launcher (`pagedref.kernels.gemm`, `cuda/gemm_hopper.cu`), no GPU needed:
the tile rule, what CI compiles, the shared-memory budget, the benchmark's tile spelling, and nvcc's view of
the source (it compiles for sm_90a, without spills, at every width)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from pagedref.bench.gemm import tile_arg, tile_label
from pagedref.kernels import build, gemm
from pagedref.kernels.build import GEMM_WIDTHS, GemmTile, gemm_config, gemm_max_stages, gemm_shared_bytes

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}  # (N, K) of the 8B layer's weights


def test_the_8b_weights_take_the_tiles_measured_fastest():
    assert gemm.gemm_tile(*SHAPES_8B["qkv"]) == GemmTile(96, 1)
    assert gemm.gemm_tile(*SHAPES_8B["o"]) == GemmTile(128, 2)
    assert gemm.gemm_tile(*SHAPES_8B["down"]) == GemmTile(128, 2)
    assert gemm.gemm_tile(28672, 4096, silu_mul=True) == GemmTile(224, 1)


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096), (3072, 2048),
                                  (128256, 4096), (512, 64)])
def test_a_tile_divides_its_weight_and_keeps_16_k_steps_a_split(n, k):
    for silu in (False, True):
        t = gemm.gemm_tile(n, k, silu_mul=silu)
        assert (n // 2) % (t.bn // 2) == 0 if silu else n % t.bn == 0
        assert t.splits == 1 or k // build.GEMM_BK >= 16 * t.splits
        assert not silu or t.splits == 1, "the SiLU epilogue rounds the whole sum: no split of K"


def test_the_tile_depends_on_the_weight_and_the_device_only():
    # No batch size enters the rule: its signature has none, and the same weight always gets the same tile.
    code = gemm.gemm_tile.__wrapped__.__code__
    assert "m" not in code.co_varnames[:code.co_argcount]
    assert gemm.gemm_tile(6144, 4096, num_sms=132) == gemm.gemm_tile(6144, 4096, num_sms=132)


def test_a_tile_that_divides_nothing_is_refused():
    with pytest.raises(ValueError, match="divides"):
        gemm.gemm_tile(100, 4096)
    with pytest.raises(ValueError, match="tile width"):
        GemmTile(80)
    with pytest.raises(ValueError, match="stages"):
        GemmTile(256, stages=5)  # 5 x 48 KB does not fit in 227 KB


def test_which_tiles_fit_a_weight():
    # One rule for the launcher and for bench gemm's --tiles: the width divides N; fused, each half-width
    # divides gate and up, and K is not split.
    assert gemm.tile_fits(GemmTile(128), 6144) and not gemm.tile_fits(GemmTile(128), 6208)
    assert gemm.tile_fits(GemmTile(224), 28672, silu_mul=True)  # 112 divides 14336
    assert not gemm.tile_fits(GemmTile(128, 2), 28672, silu_mul=True)
    assert not gemm.tile_fits(GemmTile(256), 384, silu_mul=True)  # 128 does not divide 192
    assert all(gemm.tile_fits(gemm.gemm_tile(n, k), n) for n, k in ((6144, 4096), (4096, 14336), (1024, 4096)))


@pytest.mark.parametrize("bn", GEMM_WIDTHS)
def test_the_deepest_ring_fits_in_shared_memory(bn):
    s = gemm_max_stages(bn)
    assert GemmTile(bn).stages == s and gemm_shared_bytes(GemmTile(bn)) <= 227 * 1024
    assert s == 8 or build._gemm_shared_bytes(bn, s + 1) > 227 * 1024, "a deeper ring would have fit"


def test_ci_compiles_every_width_plain_and_fused():
    configs = build.ci_configs()
    for dtype in ("bfloat16", "float16"):
        for bn in GEMM_WIDTHS:
            for silu in (False, True):
                assert gemm_config(dtype, GemmTile(bn), silu) in configs
    cfg = gemm_config("bfloat16", GemmTile(224), True)
    assert cfg.arch == "sm_90a" and "-DGEMM_SILU_MUL=1" in cfg.options() and "-DGEMM_CLUSTER=2" in cfg.options()
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gemm_config("float32", GemmTile(128))


def test_bench_tiles_are_spelled_both_ways():
    assert tile_arg("224x1") == GemmTile(224, 1)
    assert tile_arg("96x1s6c1") == GemmTile(96, 1, 6, 1)
    for text in ("224x1", "128x2s4", "96x1s6c1", "64x1c1"):
        assert tile_label(tile_arg(text)) == ":" + text
    with pytest.raises(Exception, match="BNxSPLITS"):
        tile_arg("224")
    with pytest.raises(Exception, match="tile width"):
        tile_arg("80x1")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("bn", [96, 224, 256])
def test_nvcc_compiles_it_without_spills(bn, tmp_path):
    cfg = gemm_config("bfloat16", GemmTile(bn), silu_mul=bn == 224)
    out = subprocess.run(["nvcc", f"-arch={cfg.arch}", "-cubin", "-Xptxas", "-v", *cfg.options(), str(cfg.source),
                          "-o", str(tmp_path / "g.cubin")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    assert spills and all(s == "0" for s in spills), out.stderr
