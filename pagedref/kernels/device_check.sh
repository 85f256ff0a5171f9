#!/usr/bin/env bash
# Everything of stage 5 that needs a GPU, in one device call (a few minutes on an H200):
#   1. every kernel configuration CI compiles, compiled in parallel into CuPy's on-disk cache (the
#      later processes only load binaries instead of compiling ~200 modules one after another);
#   2. a plain run of the self-check driver, then the kernel benchmark alone on the GPU (first, so a
#      slow step after it cannot cost its numbers; decode v3 and prefill v2 are left out of it if
#      they failed the self-check);
#   3. the GPU tests and compute-sanitizer memcheck + racecheck over the self-check driver, side by
#      side (they check correctness only, so they may share the GPU).
# Everything ends by DEADLINE seconds after the start (default 570: one device call may run 600); the
# tests and sanitizers get whatever is left of it after the benchmark.
# Logs go to $OUT; a summary and the benchmark's tables are printed last. Usage, from the repo root
# on the GPU machine:
#   bash pagedref/kernels/device_check.sh [benchmark options, e.g. --variants]
# Environment: DEADLINE, PRECOMPILE_TIMEOUT, SELFCHECK_TIMEOUT, BENCH_TIMEOUT, PYTEST_TIMEOUT,
# SANITIZER_TIMEOUT (seconds), SANITIZER_TOOLS ("" skips), PYTEST_ARGS (more pytest arguments, e.g. "-k v3 -x").
# The tensor-core prefill (v2) alone, first time on a device (the selfcheck's "prefill v2" lines,
# then its GPU tests, then the prefill rows of the benchmark):
#   PYTEST_ARGS="-k prefill" bash pagedref/kernels/device_check.sh
set -u
OUT=${OUT:-/tmp/pagedref_device_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
summary=()

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)' | tee -a "$OUT/gpu.txt"

t0=$SECONDS
timeout "${PRECOMPILE_TIMEOUT:-100}" python3 -c \
  'from pagedref.kernels.build import precompile; print(f"{precompile()} configurations compiled")' \
  >"$OUT/precompile.log" 2>&1
rc=$?
summary+=("precompile: $(tail -n 1 "$OUT/precompile.log") (rc=$rc, $((SECONDS - t0)) s)")

# A quick self-check first: a kernel that faults would end the benchmark's process and every number
# in it, so a v3 that fails here is left out of the benchmark (the tests below say what is wrong).
t0=$SECONDS
timeout "${SELFCHECK_TIMEOUT:-60}" python3 -m pagedref.kernels.selfcheck >"$OUT/selfcheck.log" 2>&1
rc=$?
summary+=("selfcheck (no sanitizer): $(tail -n 1 "$OUT/selfcheck.log") (rc=$rc, $((SECONDS - t0)) s)")
skip=""
# A failing kernel leaves out its own rows: prefill v2 / v3 failures skip that prefill version, decode
# failures skip decode v3 (as before), and a self-check that died without its summary line skips all.
log="$OUT/selfcheck.log"
if [ $rc -ne 0 ]; then
  if grep -q "^FAIL decode" "$log" || ! grep -q "^selfcheck:" "$log"; then skip="--skip-version 3"; fi
  if grep -q "^FAIL prefill v2" "$log" || ! grep -q "^selfcheck:" "$log"; then skip="$skip --skip-prefill-version 2"; fi
  if grep -q "^FAIL prefill v3" "$log" || ! grep -q "^selfcheck:" "$log"; then skip="$skip --skip-prefill-version 3"; fi
fi

t0=$SECONDS
timeout "${BENCH_TIMEOUT:-200}" python3 -m pagedref.bench kernel --json "$OUT/bench.json" $skip "$@" \
  >"$OUT/bench.txt" 2>&1
summary+=("bench $skip: rc=$?, $((SECONDS - t0)) s")

left=$(( ${DEADLINE:-570} - SECONDS ))
if [ $left -lt 30 ]; then left=30; fi  # (timeout 0 would mean no limit at all)
t0=$SECONDS
names=(pytest)
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
timeout "${PYTEST_TIMEOUT:-$left}" python3 -m pytest -q -m gpu -p no:cacheprovider ${PYTEST_ARGS:-} \
  stages/05_paged_attention_kernel tests/test_kernels_gpu.py >"$OUT/pytest.log" 2>&1 &
pids=($!)
for tool in ${SANITIZER_TOOLS-memcheck racecheck}; do
  timeout "${SANITIZER_TIMEOUT:-$left}" compute-sanitizer --tool "$tool" --error-exitcode 99 \
    python3 -m pagedref.kernels.selfcheck >"$OUT/$tool.log" 2>&1 &
  pids+=($!)
  names+=("$tool")
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  name=${names[$i]}
  if [ "$name" = pytest ]; then
    summary+=("pytest: $(tail -n 1 "$OUT/pytest.log") (rc=$rc)")
  else
    summary+=("$name: $(grep -h 'SUMMARY' "$OUT/$name.log" | tail -n 1); $(grep -h '^selfcheck' "$OUT/$name.log") (rc=$rc)")
  fi
done
summary+=("tests and sanitizers, side by side: $((SECONDS - t0)) s")

grep -hE "^(FAILED|ERROR)|^FAIL |Error" "$OUT/pytest.log" "$OUT"/memcheck.log "$OUT"/racecheck.log 2>/dev/null | head -n 30
printf '%s\n' "${summary[@]}"
tail -n 40 "$OUT/bench.txt"
