"""Weight GEMMs on Hopper (`cuda/gemm_hopper.cu`): y = x W^T for a decode step, tiles chosen per weight.

One idea: at a serving batch the step's time is its weight GEMMs, and cuBLAS's tiles fill the GPU's SMs
unevenly at the model's widths (`python -m pagedref.bench gemm`). This launcher runs the project's own
warp-specialised wgmma kernel, TMA copies into a ring of shared-memory stages, with a tile width and a
split of K chosen from the weight's shape (`gemm_tile`), and can fuse SwiGLU's silu(gate) * up into the
gate/up GEMM's epilogue (`silu_mul_linear`). The epilogue stages the tile in shared memory and writes it
with one bulk tensor store (a third TMA descriptor, the output's). Measured on an H200 (docs/benchmarks.md,
2026-12-02) it runs the 8B step's plain GEMMs at cuBLAS's speed, and gate/up with SiLU fused 10% faster than
cuBLAS then `silu_and_mul`; `LLM(weight_gemm="pagedref")` runs gate/up and down on it (opt-in: prefill's
larger row counts are slower here than on cuBLAS, whose kernel is chosen for them).

Invariant: a row's output depends only on that row and the weight: the split of K, the one choice that
changes the sums, is a function of (N, K) and the device's SM count, never of M, so the bits of a token's
row are the same in any batch (cuBLAS picks its kernel from M). The tile's width and cluster change only
the schedule (tested bit for bit), so they could follow M; today they are the weight's too. Against a
float64 product each element is within fp32 accumulation error plus one rounding to 16 bits. Launches go on
torch's current stream (graph-capturable).

The TMA descriptors (CUtensorMap, 128 bytes) are encoded on the host by the driver
(cuTensorMapEncodeTiled) and passed by value, so a captured graph holds them; the kernel is launched
through the driver's cuLaunchKernelEx (kernels.driver) for the same reason (CuPy passes no 128-byte arguments).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from pagedref.kernels import build, driver, fused, launch, validate
from pagedref.kernels.build import GEMM_BK as BK
from pagedref.kernels.build import GEMM_BM as BM
from pagedref.kernels.build import GEMM_WIDTHS as WIDTHS
from pagedref.kernels.build import GemmTile, gemm_config, gemm_shared_bytes

CAPABILITY = (9, 0)
THREADS = 384
REDUCE_THREADS = 256


@functools.lru_cache(maxsize=None)
def gemm_tile(n: int, k: int, num_sms: int = 132, silu_mul: bool = False) -> GemmTile:
    """The tiling of an [n, k] weight (silu_mul: the merged [gate | up] weight, n = 2 I), from its shape and
    the SM count alone: the CTAs of a 256-row batch (two row tiles) should fill whole waves; then a width of
    at least 96 (64 wide lost at down: 62.0 against 49.9 µs at 128 x 2), then fewer splits, then wider. Each
    split keeps at least 16 k-steps; the SiLU epilogue takes no split. The fastest measured at the 8B shapes
    (bench gemm --tiles, H200): q/k/v 96 x 1, o 128 x 2 (64 x 1 the same), gate/up 224 x 1, down 128 x 2."""
    best, best_key = None, None
    cols = n // 2 if silu_mul else n
    for bn in WIDTHS:
        width = bn // 2 if silu_mul else bn
        if cols % width:
            continue
        for splits in (1,) if silu_mul else (1, 2, 3, 4):
            if splits > 1 and k // BK < 16 * splits:
                break
            ctas = 2 * (cols // width) * splits
            fill = ctas / (-(-ctas // num_sms) * num_sms)  # the share of the waves' SM slots in use
            key = (round(fill, 2), bn >= 96, -splits, bn)
            if best_key is None or key > best_key:
                best, best_key = GemmTile(bn, splits), key
    if best is None:
        raise ValueError(f"no tile of {WIDTHS} divides a weight of {n} rows (silu_mul={silu_mul})")
    return best


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs here: an sm_90 device, 16-bit x [M, K] and weight [N, K] of one
    dtype, K a multiple of 64 and N of some tile width, rows 16-byte aligned (TMA's rule)."""
    if not (x.is_cuda and weight.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype):
        return False
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[1] % BK:
        return False
    if x.stride(1) != 1 or weight.stride(1) != 1 or (x.stride(0) * 2) % 16 or (weight.stride(0) * 2) % 16:
        return False
    if x.data_ptr() % 16 or weight.data_ptr() % 16 or weight.shape[0] % 64:
        return False
    return torch.cuda.get_device_capability(x.device) == CAPABILITY


# --- the driver: TMA descriptors and the launch -------------------------------------------------------

def _matrix_map(t: torch.Tensor, box_rows: int) -> driver.TmaMap:
    """An operand [rows, K], read in 128-byte swizzled boxes of 64 columns (one swizzle row) x box_rows rows."""
    return driver.tensor_map(t.data_ptr(), (t.shape[1], t.shape[0]), (t.stride(0) * t.element_size(),), (BK, box_rows),
                             validate.DTYPE_NAMES[t.dtype], driver.SWIZZLE_128B)


def _output_map(t: torch.Tensor, box_cols: int) -> driver.TmaMap:
    """The output, C [M, N] or the split-K partials [splits, M, N], as [splits][M][N] written in boxes of
    box_cols x BM x 1 (no swizzle: the epilogue stages its tile row-major); rows past M are not written."""
    t3 = t if t.dim() == 3 else t.unsqueeze(0)
    splits, rows, cols = t3.shape
    size = t.element_size()
    return driver.tensor_map(t.data_ptr(), (cols, rows, splits), (cols * size, rows * cols * size), (box_cols, BM, 1),
                             validate.DTYPE_NAMES[t.dtype], 0)


# --- the public calls ---------------------------------------------------------------------------------

def tile_fits(tile: GemmTile, n: int, silu_mul: bool = False) -> bool:
    """Whether `tile` can compute an [n, K] weight: its width divides N (silu_mul: its half-width divides
    each of gate and up, n = 2 I, and the fused epilogue takes no split of K)."""
    if silu_mul:
        return n % 2 == 0 and (n // 2) % (tile.bn // 2) == 0 and tile.splits == 1
    return n % tile.bn == 0


def linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
           tile: GemmTile | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype (F.linear without bias). `tile` is for
    benchmarks; None: gemm_tile(N, K), the weight's own."""
    return _gemm(x, weight, out, tile, silu_mul=False)


def silu_mul_linear(x: torch.Tensor, gate_up: torch.Tensor, *, out: torch.Tensor | None = None,
                    tile: GemmTile | None = None) -> torch.Tensor:
    """SwiGLU's first half in one kernel: x [M, K], gate_up [2 I, K] (gate rows, then up rows) ->
    silu(x gate^T) * (x up^T) [M, I], bit for bit `fused.silu_and_mul(linear(x, gate_up))`."""
    return _gemm(x, gate_up, out, tile, silu_mul=True)


def linear_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, *, tile: GemmTile | None = None) -> torch.Tensor:
    """The down projection and what follows it in a decode layer: y = x weight^T, residual += y (rounded,
    in place), -> RMSNorm(residual) [M, N] with norm_weight; bit for bit `fused.fused_add_rms_norm(linear(x,
    weight), residual, norm_weight, eps)`. Split over K, the split-K reduce is that norm's own first pass
    (`fused.splitk_add_rms_norm`): one launch fewer, and y never goes to memory."""
    out, partial, _ = _gemm_tn(x, weight, None, tile, silu_mul=False, name="gemm.linear_add_rms_norm")
    if partial is None:
        return fused.fused_add_rms_norm(out, residual, norm_weight, eps)[0]  # out is y, then the norm (in place)
    return fused.splitk_add_rms_norm(partial, residual, norm_weight, eps, out=out, pdl=True)[0]  # under gemm_tn's tail


def _gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, tile: GemmTile | None,
          silu_mul: bool) -> torch.Tensor:
    """Launch the GEMM and, split over K, the reduce of its fp32 partials into out."""
    out, partial, config = _gemm_tn(x, weight, out, tile, silu_mul,
                                    "gemm.silu_mul_linear" if silu_mul else "gemm.linear")
    if partial is not None:
        count = partial.shape[1] * partial.shape[2]
        launch._launch(config, "gemm_splitk_reduce", x.device, (-(-count // 4 // REDUCE_THREADS),),
                       (launch._ptr(out), launch._ptr(partial), np.int32(partial.shape[0]), np.int64(count)),
                       threads=REDUCE_THREADS, pdl=True)  # launched under gemm_tn's tail; waits for it
    return out


def _gemm_tn(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, tile: GemmTile | None,
             silu_mul: bool, name: str) -> tuple[torch.Tensor, torch.Tensor | None, build.KernelConfig]:
    """Check, pick the tile, launch gemm_tn -> (out, None, its config), or split over K (out, its fp32
    partials [splits, M, N], its config), out then still to be written from them."""
    validate.require_cuda(x, "x")
    if not supported(x, weight):
        raise ValueError(f"{name}: needs an sm_90 GPU, float16/bfloat16 x [M, K] and weight [N, K] of one dtype, "
                         f"K a multiple of {BK}, N of 64, 16-byte aligned rows; got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    tile = tile or gemm_tile(n, k, _num_sms(x.device), silu_mul=silu_mul)
    if not tile_fits(tile, n, silu_mul):
        raise ValueError(f"{name}: tile width {tile.bn} does not divide a weight of {n} rows"
                         + (f" into gate and up halves of {tile.bn // 2}, with no split of K (split {tile.splits})"
                            if silu_mul else ""))
    cols = n // 2 if silu_mul else n  # the output's columns: I, or N
    out = _output(out, (m, cols), x)
    config = gemm_config(validate.DTYPE_NAMES[x.dtype], tile, silu_mul=silu_mul)
    if m == 0:
        return out, None, config
    partial = torch.empty((tile.splits, m, n), dtype=torch.float32, device=x.device) if tile.splits > 1 else None
    width = tile.bn // 2 if silu_mul else tile.bn  # the output columns of one tile
    args = (_matrix_map(x, BM), _matrix_map(weight, tile.bn // 2),
            _output_map(out if partial is None else partial, width), ctypes.c_int(m), ctypes.c_int(k // BK),
            ctypes.c_int(cols if silu_mul else 0))
    launch._launch(config, "gemm_tn", x.device, (_row_tiles(m, tile), cols // width, tile.splits), args,
                   shared_mem=gemm_shared_bytes(tile), threads=THREADS)
    return out, partial, config


def _row_tiles(m: int, tile: GemmTile) -> int:
    """Row tiles of BM, padded to whole clusters (a tile past M computes zeros and stores nothing)."""
    return -(-m // (BM * tile.cluster)) * tile.cluster


def _output(out: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if (tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous()
            or out.data_ptr() % 16):
        raise ValueError(f"out must be a contiguous, 16-byte aligned {shape} {x.dtype} tensor on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
