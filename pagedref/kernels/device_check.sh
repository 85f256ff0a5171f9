#!/usr/bin/env bash
# Everything of stage 5 that needs a GPU, in one device call: the GPU tests, compute-sanitizer
# (memcheck and racecheck) over the self-check driver, and the kernel benchmark. Logs go to $OUT;
# a short summary is printed last. Usage, from the repo root on the GPU machine:
#   bash pagedref/kernels/device_check.sh [benchmark options, e.g. --variants]
# Environment: PYTEST_TIMEOUT, SANITIZER_TIMEOUT, BENCH_TIMEOUT (seconds), SANITIZER_TOOLS ("" skips).
set -u
OUT=${OUT:-/tmp/pagedref_device_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
summary=()

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)' | tee -a "$OUT/gpu.txt"

t0=$SECONDS
timeout "${PYTEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  stages/05_paged_attention_kernel tests/test_kernels_gpu.py >"$OUT/pytest.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)|Error|error" "$OUT/pytest.log" | head -n 40
summary+=("pytest: $(tail -n 1 "$OUT/pytest.log") (rc=$rc, $((SECONDS - t0)) s)")

for tool in ${SANITIZER_TOOLS-memcheck racecheck}; do
  t0=$SECONDS
  timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 99 \
    python3 -m pagedref.kernels.selfcheck >"$OUT/$tool.log" 2>&1
  rc=$?
  summary+=("$tool: $(grep -h 'SUMMARY' "$OUT/$tool.log" | tail -n 1); $(grep -h '^selfcheck' "$OUT/$tool.log") (rc=$rc, $((SECONDS - t0)) s)")
done

timeout "${BENCH_TIMEOUT:-300}" python3 -m pagedref.bench kernel --json "$OUT/bench.json" "$@" >"$OUT/bench.txt" 2>&1
summary+=("bench: rc=$?")
cat "$OUT/bench.txt" | tail -n 30
printf '%s\n' "${summary[@]}"
