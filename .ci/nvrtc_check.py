"""Every CI kernel configuration through NVRTC's front end, the compiler that builds the kernels on the GPU.

Why beside nvcc: nvcc compiles a file as a whole program and accepts host code, and NVRTC compiles device
code only. A `constexpr` helper without `__host__ __device__`, for one, passes nvcc; NVRTC takes it only with
`--device-as-default-execution-space`, which CuPy's RawModule adds and the sm_90a path (build._arch_cubin)
does not. Such a GEMM passed CI's nvcc step and failed on the device (2026-12-02). `--fdevice-syntax-only`
stops after the front end (ptxas already ran on nvcc's cubins), so all configurations take seconds.

Usage: python3 .ci/nvrtc_check.py. libnvrtc comes from the nvidia-cuda-nvrtc wheel (nvidia/cu*/lib) or the
CUDA toolkit beside nvcc. Exit status 1 on the first refused configuration, with NVRTC's log; 2 without libnvrtc.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedref.kernels import build

# What CuPy's RawModule adds to a module's own options (cupy/cuda/compiler.py, NVRTC >= 12), for an H200 (sm_90).
CUPY_OPTIONS = ("--device-as-default-execution-space", "--gpu-architecture=sm_90", "-ftz=true")


def find_libnvrtc() -> str | None:
    """The newest libnvrtc of an installed nvidia-cuda-nvrtc wheel, else of the toolkit that holds nvcc."""
    found = []
    try:
        import nvidia  # the namespace package of NVIDIA's wheels

        for base in nvidia.__path__:
            found += glob.glob(os.path.join(base, "cu*", "lib", "libnvrtc.so.*"))
    except ImportError:
        pass
    if not found and shutil.which("nvcc"):
        toolkit = Path(os.path.realpath(shutil.which("nvcc"))).parents[1]
        found = glob.glob(str(toolkit / "lib64" / "libnvrtc.so.*"))
    found = [f for f in found if "builtins" not in Path(f).name and "alt" not in Path(f).name]
    return sorted(found)[-1] if found else None


def refusal(lib: ctypes.CDLL, config: build.KernelConfig) -> str | None:
    """NVRTC's log if its front end refuses `config` as the GPU machine compiles it, else None."""
    options = (*(build._arch_options(config) if config.arch else (*config.options(), *CUPY_OPTIONS)),
               "--fdevice-syntax-only")
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), config.source.read_bytes(), config.file.encode(), 0, None, None):
        return f"nvrtcCreateProgram failed for {config.file}"
    try:
        if not lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*map(str.encode, options))):
            return None
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        return f"NVRTC refused {config.file} {' '.join(options)}:\n{log.value.decode(errors='replace')}"
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main() -> int:
    path = find_libnvrtc()
    if path is None:
        print("nvrtc_check: no libnvrtc: pip install nvidia-cuda-nvrtc (or a CUDA toolkit beside nvcc)", file=sys.stderr)
        return 2
    lib = ctypes.CDLL(path)
    configs = build.ci_configs()
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # NVRTC runs outside the GIL (ctypes releases it)
        for log in pool.map(lambda config: refusal(lib, config), configs):
            if log:
                print(log, file=sys.stderr)
                return 1
    print(f"nvrtc_check: all {len(configs)} configurations pass NVRTC's front end ({Path(path).name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
