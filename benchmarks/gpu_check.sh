#!/usr/bin/env bash
# The whole GPU check, end to end, on a machine with an NVIDIA GPU and no network:
#   build the extension for the local arch -> info -> gpu tests -> gpu tests under compute-sanitizer
#   -> bench --quick -> pcie --quick -> targets, then a short summary printed last.
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#
# Writes into OUT_DIR (7 files): gpu_check.log (every step's output), info.json, bench.json,
# bench.png, pcie.json, pcie.png, summary.txt. Estimated at about 5 minutes on an H200 (not yet
# measured: no run so far); each step has its own time limit, so one hung step costs at most its
# limit and the rest still run. A failing step is recorded in the summary.
# Needs: python3 with torch (CUDA), triton, pybind11, ninja, nvidia-ml-py, pytest, hypothesis,
# matplotlib; nvcc under CUDA_HOME (default /usr/local/cuda); compute-sanitizer (optional).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
: >"$LOG"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PYTHONUNBUFFERED=1
declare -a STEPS=()

step() { # step NAME LIMIT_S COMMAND...: run with a time limit, log everything, record the outcome
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  local status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMEOUT"; elif [ $rc -ne 0 ]; then status="FAILED($rc)"; fi
  STEPS+=("$(printf '%-22s %-12s %4ss' "$name" "$status" $((SECONDS - t0)))")
  echo "=== $name: $status in $((SECONDS - t0))s" | tee -a "$LOG"
  return $rc
}

ARCH=$($PY -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())' 2>>"$LOG")
if [ -z "$ARCH" ]; then
  echo "no CUDA GPU visible to torch; see $LOG" | tee -a "$LOG"
  exit 1
fi
export HICACHE_CUDA_ARCHS=$ARCH
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

step build 180 $PY -m pip install --no-build-isolation --no-deps -e .
step info 30 sh -c "$PY -m hicache_kernels.info && $PY -m hicache_kernels.info --json >'$OUT/info.json'"
step gpu-tests 240 $PY -m pytest -q -rf -m gpu --maxfail=30 --timeout=60 -p no:cacheprovider tests
if command -v compute-sanitizer >/dev/null 2>&1; then
  step sanitizer 120 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider \
    tests/test_ops_gpu.py -k "kernel and bfloat16 and not compile and (page_first_direct or page_head)"
else
  STEPS+=("$(printf '%-22s %-12s' sanitizer 'SKIPPED (no compute-sanitizer)')")
fi
step bench-quick 240 $PY -m hicache_kernels.bench --quick --refcheck --json "$OUT/bench.json" --plot "$OUT/bench.png"
step pcie-quick 120 $PY -m hicache_kernels.pcie --quick --json "$OUT/pcie.json" --plot "$OUT/pcie.png"

{
  echo "GPU check: $($PY -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null), sm_$ARCH," \
    "commit $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  printf '%s\n' "${STEPS[@]}"
  if [ -s "$OUT/bench.json" ]; then
    echo
    $PY -m hicache_kernels.targets "$OUT/bench.json"
  fi
} | tee "$OUT/summary.txt"
