#!/usr/bin/env bash
# Compile every CUDA kernel of cuda/ with nvcc (then NVRTC's front end), for every configuration the package
# instantiates (each dtype x head_dim x block_size, each heads-per-CTA), so a kernel that does not compile fails
# CI on a machine without a GPU. The configuration list comes from pagedref.kernels.build.print_ci_configs()
# (the same -D options CuPy's NVRTC gets at run time). Skips, successfully, if nvcc is absent.
# To a cubin, not PTX: ptxas then runs too, and it is ptxas that refuses a kernel over a limit of the
# target (48 KB of static shared memory, registers), as the driver would on the GPU. A v3 decode module at
# 8 heads and 2048-token partitions compiled to PTX here and failed only on the device (2026-12-01).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null; then
  echo "compile_kernels: nvcc not found, skipping"
  exit 0
fi
ARCH=${ARCH:-sm_90}
JOBS=${JOBS:-$(nproc)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -c "from pagedref.kernels.build import print_ci_configs; print_ci_configs()" >"$tmp/configs"
echo "compile_kernels: $(wc -l <"$tmp/configs") configurations, nvcc -arch=$ARCH -cubin, $JOBS jobs"
# Each line: FILE [-arch=TARGET] [-DNAME=VALUE ...]: a config that names its own target (prefill v3:
# sm_90a, for wgmma and setmaxnreg) is compiled for it instead of $ARCH. Any failing nvcc fails the
# script (xargs exits non-zero).
compile() {
  local n=$1 file=$2 arch=$ARCH
  shift 2
  case "${1:-}" in -arch=*) arch=${1#-arch=}; shift ;; esac
  nvcc -arch="$arch" -std=c++17 -cubin -Icuda "$@" "cuda/$file" -o "$tmp/k$n.cubin" \
    || { echo "FAILED: nvcc -arch=$arch -std=c++17 -cubin -Icuda $* cuda/$file" >&2; exit 255; }
}
export -f compile
export ARCH tmp
awk '{print NR, $0}' "$tmp/configs" | xargs -d '\n' -P "$JOBS" -n 1 bash -c 'compile $0'
echo "compile_kernels: all configurations compiled"
# And through NVRTC's front end, as the GPU machine compiles them (CuPy's options; sm_90a: build._arch_cubin's):
# NVRTC refuses some code that nvcc takes. libnvrtc: the nvidia-cuda-nvrtc wheel (.ci/run installs it).
python3 .ci/nvrtc_check.py
