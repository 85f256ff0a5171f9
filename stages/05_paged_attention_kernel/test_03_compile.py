"""Stage 5, step 3 (CPU): every kernel compiles with nvcc for Hopper, without a GPU.

The kernels are compiled at run time by CuPy's NVRTC with -D options (dtype, head_dim, block_size,
...). nvcc takes the same options, so compiling here proves the source is valid for those
configurations before any GPU sees it. (CI compiles the full list: .ci/compile_kernels.sh.)
"""

import shutil
import subprocess

import pytest

from pagedref.course import lesson
from pagedref.kernels import build as reference_build
from pagedref.kernels import splitk as reference_splitk


def representative_configs():
    # The list of configurations comes from the reference (it is collected before any test runs, and a
    # learner's unfinished package must not stop collection); the compile itself uses the lesson's build.
    build = reference_build
    dims = reference_splitk.SUPPORTED_HEAD_DIMS
    configs = [build.CACHE_OPS]
    for head_dim in dims:  # every head_dim in bf16, the dtype the benchmark uses
        configs += [build.decode_config("bfloat16", head_dim, 16, 4), build.prefill_config("bfloat16", head_dim, 16)]
    for dtype in ("float32", "float16"):  # every dtype
        configs += [build.decode_config(dtype, 128, 16, 4), build.prefill_config(dtype, 128, 16)]
    for block_size in (8, 32):  # every block size
        configs += [build.decode_config("float16", 64, block_size, 1), build.prefill_config("float16", 64, block_size)]
    configs += [build.decode_config("bfloat16", 128, 16, 4, build.DecodeTuning(async_copy=True))]  # the cp.async path
    return configs


CONFIGS = representative_configs()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.file + ":" + ",".join(f"{k}={v}" for k, v in c.defines[:4]))
def test_step23_kernel_compiles_for_sm90(config, tmp_path):
    build = lesson("pagedref.kernels.build")
    res = subprocess.run(build.nvcc_command(config, tmp_path / "k.ptx"), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "k.ptx").stat().st_size > 0
