#!/usr/bin/env bash
# The GPU check in two stages, sized for a short loan of a GPU machine (no network there):
#
#   stage 1 (must fit 5 minutes on an H200): build for the local arch -> info -> the gpu_smoke tests
#           -> the bench points that decide targets 1-3 (bench --targets-core) -> targets
#           -> host overhead per call (bench --host-overhead; CPU-side, seconds)
#           -> the data-path designs side by side (register kernel, bulk-staging kernel, staged copy
#              engines, direct, batch at page 16, SM budgets 1-8: bench_designs.json), if time is left
#   stage 2 (while the budget lasts): every gpu test (per-test time limit) -> the clients' own transfer
#           tests over the SGLang kernel switch (sgl-kernel's test_kvcacheio.py, SGLang's
#           test_hicache_direct_loadback.py: benchmarks/client_tests.json; they are not committed here, so
#           put them in .client-tests/ first with scripts/fetch_client_tests.py and carry that folder; the
#           step is listed as skipped when they are absent) -> compute-sanitizer
#           memcheck on the smoke set -> pcie --quick -> host pool set-up (16 GiB pinned: populate and
#           cudaHostRegister seconds by thread count) -> bench --quick (interference, overlap, auto)
#           -> the serving benchmark on the GPU (hicache.bench.serving: TTFT per mode, 8B-like layers):
#              multi-turn, then long-context QA (several documents whose KV is 4x the device pool)
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--stage 1|2|all] [--only STEP,...] [--budget SECONDS] OUT_DIR
#
# --only: run just the named steps of the stage(s) (e.g. --stage 2 --only bench-serving when little
# time is left); the others are listed as skipped. Stage 2 builds first when the extension is not built
# (a fresh machine), and skips that step otherwise.
#
# Every step has its own time limit, clipped to what is left of --budget (default 480 s of wall time
# for the whole script); a step that would start with less than 20 s left is not started. Results go
# to OUT_DIR as they are made, and summary.txt is rewritten after every step, so a run cut short still
# leaves what finished. Files: gpu_check.log (every step's output), summary.txt; stage 1: info.json,
# bench_core.json, host_overhead.json, bench_designs.json; stage 2: bench_quick.json, pcie.json,
# host_setup.json, serving.json, serving_longqa.json. The device tool brings back 8 files a call: run the stages in separate calls. The summary ends with the targets
# read from each bench JSON (host overhead: targets 7-11, shown, not a failed step).
#
# --dry-run: on a CPU machine, run every step's command with CPU stand-ins (sm_90 assumed; pytest steps
# collect instead of running; the bench and pcie CLIs take their no-GPU paths, --host-overhead times CPU
# pools; compute-sanitizer is only looked up), so a wrong flag, a missing marker, tool or package
# shows before GPU time is spent. A dry run changes nothing outside OUT_DIR: its build step installs
# nothing and builds nothing into the tree (benchmarks/dry_build.sh: pip checks the real command with
# --dry-run, and both extensions compile into OUT_DIR/dry-run/build, removed after; the steps after it
# use the package as installed before, e.g. by scripts/setup.sh), and its temp files and caches
# (TMPDIR, XDG_CACHE_HOME, Triton's, and Hypothesis's, which pytest's collection writes) and auto's
# table (HICACHE_AUTO_CONFIG) are in OUT_DIR/dry-run. A real run builds and installs the package
# editable (pip install -e .), and its pytest steps keep Hypothesis's files in the tree's .hypothesis/.
# Exit status: 0 when every step that ran passed (in a dry run: when every step would start).
#
# Needs: python3 with torch (CUDA), triton, pybind11, ninja, nvidia-ml-py, pytest, pytest-timeout,
# hypothesis; nvcc under CUDA_HOME (default /usr/local/cuda); compute-sanitizer (optional).
set -uo pipefail
DRY=0
STAGE=all
BUDGET=480
ONLY=
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --stage) STAGE=${2:?--stage needs 1, 2 or all}; shift ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    --only) ONLY=${2:?--only needs step names, comma-separated}; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
OUT=${1:?usage: bash benchmarks/gpu_check.sh [--dry-run] [--stage 1|2|all] [--budget SECONDS] OUT_DIR}
case $STAGE in 1 | 2 | all) ;; *) echo "gpu_check.sh: --stage must be 1, 2 or all, got $STAGE" >&2; exit 2 ;; esac
case $BUDGET in '' | *[!0-9]*) echo "gpu_check.sh: --budget must be whole seconds, got $BUDGET" >&2; exit 2 ;; esac
ALL_STEPS=",build,info,gpu-smoke,bench-core,targets,host-overhead,bench-designs,gpu-tests,client-tests,sanitizer,pcie-quick,\
host-setup,bench-quick,serving-args,bench-serving,serving-longqa,"
for s in ${ONLY//,/ }; do
  [[ $ALL_STEPS == *",$s,"* ]] || { echo "gpu_check.sh: --only: no step named $s (steps:${ALL_STEPS//,/ })" >&2; exit 2; }
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.txt"
: >"$LOG"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PYTHONUNBUFFERED=1
START=$SECONDS
FAILED=0
NOTE=
declare -a STEPS=()

if [ $DRY = 1 ]; then
  ARCH=${HICACHE_CUDA_ARCHS:-90}
  GPU_NAME="dry run on $(hostname) (no GPU; CPU stand-ins)"
else
  ARCH=$($PY -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())' 2>>"$LOG")
  if [ -z "$ARCH" ]; then
    echo "no CUDA GPU visible to torch; see $LOG (use --dry-run on a CPU machine)" | tee -a "$LOG"
    exit 1
  fi
  GPU_NAME=$($PY -c 'import torch; print(torch.cuda.get_device_name())' 2>>"$LOG")
fi
export HICACHE_CUDA_ARCHS=$ARCH
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
DIRTY=$(git diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')
HEADER="GPU check: $GPU_NAME, sm_$ARCH, commit $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)$DIRTY,\
 stage $STAGE, budget ${BUDGET}s, started $(date -u +%Y-%m-%dT%H:%M:%SZ)"

write_summary() {
  {
    echo "$HEADER"
    [ -n "$NOTE" ] && echo "$NOTE"
    printf '%s\n' "${STEPS[@]}"
    echo "elapsed $((SECONDS - START))s of ${BUDGET}s"
  } >"$SUMMARY"
}

# step NAME LIMIT_S COMMAND...: run with a time limit clipped to the budget, log everything, record it.
step() {
  local name=$1 limit=$2
  shift 2
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
    STEPS+=("$(printf '%-16s %-22s' "$name" 'SKIPPED (--only)')")
    return 0
  fi
  local left=$((BUDGET - (SECONDS - START)))
  if [ $left -lt 20 ]; then
    STEPS+=("$(printf '%-16s %-22s' "$name" 'NOT RUN (budget spent)')")
    echo "=== $name: not run, ${left}s of the budget left" | tee -a "$LOG"
    write_summary
    return 0
  fi
  [ "$limit" -gt $((left - 5)) ] && limit=$((left - 5))
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  local status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=TIMEOUT; elif [ $rc -ne 0 ]; then status="FAILED($rc)"; fi
  [ $rc -ne 0 ] && FAILED=1
  STEPS+=("$(printf '%-16s %-22s %4ss' "$name" "$status" $((SECONDS - t0)))")
  echo "=== $name: $status in $((SECONDS - t0))s" | tee -a "$LOG"
  write_summary
  return 0
}

# The build step: the package built for ARCH and installed editable into $PY's environment. A dry run
# checks that command instead (benchmarks/dry_build.sh), and keeps its own files in OUT_DIR/dry-run.
BUILD=($PY -m pip install --no-build-isolation --no-deps -e .)
if [ $DRY = 1 ]; then
  SCRATCH=$OUT/dry-run
  mkdir -p "$SCRATCH/tmp"
  export TMPDIR=$SCRATCH/tmp XDG_CACHE_HOME=$SCRATCH/cache TRITON_CACHE_DIR=$SCRATCH/triton \
    HYPOTHESIS_STORAGE_DIRECTORY=$SCRATCH/hypothesis HICACHE_AUTO_CONFIG=$SCRATCH/auto.json
  BUILD=(bash benchmarks/dry_build.sh "$SCRATCH" "${BUILD[@]}")
  NOTE="dry run: installs nothing and writes nothing outside $OUT (the build step: pip install --dry-run and a\
 scratch build in $SCRATCH, removed after)"
  echo "=== $NOTE" | tee -a "$LOG"
fi

# In a dry run pytest only collects (a marker or file that selects nothing exits 5 and fails the step).
PYTEST=($PY -m pytest -q -p no:cacheprovider)
[ $DRY = 1 ] && PYTEST+=(--collect-only)
SMOKE=(-m gpu_smoke tests)

if [ "$STAGE" != 2 ]; then
  step build 180 "${BUILD[@]}"
  step info 30 sh -c "$PY -m hicache.info && $PY -m hicache.info --json >'$OUT/info.json'"
  step gpu-smoke 150 "${PYTEST[@]}" -rf --timeout=60 "${SMOKE[@]}"
  step bench-core 120 $PY -m hicache_kernels.bench --targets-core --refcheck --json "$OUT/bench_core.json"
  step targets 20 $PY -m hicache_kernels.targets "$OUT/bench_core.json"
  step host-overhead 60 $PY -m hicache_kernels.bench --host-overhead --calls 500 --json "$OUT/host_overhead.json"
  step bench-designs 90 $PY -m hicache_kernels.bench --backends kernel,kernel-bulk,staged,direct,batch \
    --page-sizes 16 --layouts page_first_direct --tokens 2048 --sm-sweep 1,2,4,8 --repeats 5 --warmup 2 \
    --refcheck --json "$OUT/bench_designs.json"
fi
if [ "$STAGE" != 1 ]; then
  if [ "$STAGE" = 2 ] && ! $PY -c 'import sys, hicache_kernels as h; sys.exit(0 if h.build_info()["cuda_built"] else 1)' \
    >>"$LOG" 2>&1; then
    step build 180 "${BUILD[@]}"  # a fresh machine: stage 1 built elsewhere
  fi
  step gpu-tests 240 "${PYTEST[@]}" -rf -m gpu --maxfail=30 --timeout=60 tests
  # sgl-kernel's and SGLang's own tests, their transfers bound to hicache_kernels.compat by the switch and
  # the plugin (which also lifts sgl-kernel's CUDA 13 skip); the log records each file's SHA-256
  CLIENT_DIR=${HICACHE_CLIENT_TESTS:-.client-tests}
  if ls "$CLIENT_DIR"/test_*.py >/dev/null 2>&1; then
    step client-tests 150 sh -c "$PY scripts/fetch_client_tests.py --check --dir '$CLIENT_DIR';
      HICACHE_SGL_KERNEL=1 ${PYTEST[*]} -rfs -p hicache_kernels.compat.pytest_plugin --timeout=120 '$CLIENT_DIR'"
  else
    STEPS+=("$(printf '%-16s %-22s' client-tests "SKIPPED (none in $CLIENT_DIR)")")
    echo "=== client-tests: no test files in $CLIENT_DIR (python scripts/fetch_client_tests.py)" | tee -a "$LOG"
  fi
  if [ $DRY = 1 ]; then
    if command -v compute-sanitizer >/dev/null 2>&1; then SAN=found; else SAN="not found here"; fi
    step sanitizer 60 sh -c "echo 'compute-sanitizer: $SAN (dry run: the test selection is collected)' &&
      ${PYTEST[*]} ${SMOKE[*]} -k 'kernel or triton'"
  elif command -v compute-sanitizer >/dev/null 2>&1; then
    step sanitizer 150 compute-sanitizer --tool memcheck --error-exitcode 9 "${PYTEST[@]}" "${SMOKE[@]}" \
      -k "kernel or triton"
  else
    STEPS+=("$(printf '%-16s %-22s' sanitizer 'SKIPPED (no compute-sanitizer)')")
  fi
  step pcie-quick 120 $PY -m hicache_kernels.pcie --quick --json "$OUT/pcie.json"
  if [ $DRY = 1 ]; then SETUP=(--gib 0.0625 --no-pin); else SETUP=(--gib 16 --pin); fi
  step host-setup 60 $PY -m hicache.bench.host_setup "${SETUP[@]}" --threads 1 8 --repeats 1 --json "$OUT/host_setup.json"
  step bench-quick 240 $PY -m hicache_kernels.bench --quick --refcheck --json "$OUT/bench_quick.json"
  # 8B-like layers (4 of them), bf16, the kernel io-backend; working set 4x the device pool; 32
  # closed-loop clients, 4 requests in flight: a conversation's history goes cold between its turns
  SERVE=(--device cuda --fast --dtype bfloat16 --layers 4 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128
    --ffn 14336 --vocab 32000 --page-size 16 --layout page_first_direct --io-backend kernel --clients 32
    --rounds 4 --max-parallel 4 --system-len 1024 --turn-len 512 --output-len 16
    --modes recompute device hierarchical)
  # Long-context QA, the same layers: 12 documents of 8192 tokens, 48 questions interleaved over them
  # (4 each), 4 in flight; the device pool a quarter of the documents' KV, so a document is evicted
  # before its next question and only the host tier keeps it
  LONGQA=(--device cuda --fast --dtype bfloat16 --layers 4 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128
    --ffn 14336 --vocab 32000 --page-size 16 --layout page_first_direct --io-backend kernel --workload longqa
    --docs 12 --doc-len 8192 --questions 48 --turn-len 64 --output-len 16 --max-parallel 4
    --modes recompute device hierarchical)
  if [ $DRY = 1 ]; then  # the GPU runs' arguments are checked (the CLI stops at "no CUDA device"), then
    # the CPU stand-ins run: the same CLI, small and exact
    step serving-args 60 sh -c "for args in '${SERVE[*]}' '${LONGQA[*]}'; do
      out=\$($PY -m hicache.bench.serving \$args 2>&1); echo \"\$out\";
      echo \"\$out\" | grep -q 'no CUDA device is visible' || exit 1; done"
    SERVE=(--quick)
    LONGQA=(--quick --workload longqa)
  fi
  step bench-serving 180 $PY -m hicache.bench.serving "${SERVE[@]}" --json "$OUT/serving.json"
  step serving-longqa 150 $PY -m hicache.bench.serving "${LONGQA[@]}" --json "$OUT/serving_longqa.json"
fi
write_summary
{
  cat "$SUMMARY"
  for f in bench_core host_overhead bench_designs bench_quick; do
    if [ -s "$OUT/$f.json" ]; then
      echo
      echo "Targets read from $f.json:"
      $PY -m hicache_kernels.targets "$OUT/$f.json"
    fi
  done
  for f in serving serving_longqa; do
    if [ -s "$OUT/$f.json" ]; then
      echo
      $PY -c 'import json, os, sys; t = json.load(open(sys.argv[1]))["target"]; m = t["measured"]
print("Serving target read from %s: %s: %s (<= %s): %s" % (os.path.basename(sys.argv[1]), t["target"],
      "-" if m is None else "%.3f" % m, t["threshold"], t["status"]))' "$OUT/$f.json"
    fi
  done
} | tee "$SUMMARY.tmp"
mv "$SUMMARY.tmp" "$SUMMARY"
exit $FAILED
