#!/usr/bin/env bash
# Re-measure the CPU figures the README quotes, on this machine, into benchmarks/results/.
#
#   bash benchmarks/cpu_figures.sh [--only NAME,...] [--date YYYY-MM-DD] [--list]
#
# Each step is one benchmark command; its JSON records the command, the commit and the machine. The
# files are named DATE_cpu-<N>core_<name>.json (N: this machine's cores), so a new run never
# overwrites an older one; the README then names the files it quotes and tests/package/test_readme_facts.py
# checks every figure against them. These are CPU figures: host-side code (the tree, the Python
# call path, the storage tier's file I/O, a small model served on CPU), never a GPU's.
#
# Needs: the project's environment (scripts/setup.sh), HICACHE_SGLANG_PATH for the tree comparison with
# SGLang's Rust core (scripts/fetch_sglang.sh prints it; the step is skipped without it), mooncake and
# nixl for their storage steps (HICACHE_MOONCAKE=1 / HICACHE_NIXL=1 at set-up; skipped without them).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DATE=$(date -u +%F)
ONLY=""
LIST=0
while [ $# -gt 0 ]; do
  case $1 in
    --only) ONLY=$2; shift ;;
    --date) DATE=$2; shift ;;
    --list) LIST=1 ;;
    *) echo "cpu_figures.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
R=benchmarks/results
TAG="${DATE}_cpu-$(nproc)core"
FAILED=0
STORE=$(mktemp -d /var/tmp/hicache-figures.XXXXXX)
trap 'rm -rf "$STORE"' EXIT

# fig NAME COMMAND...: run COMMAND (its --json target is $R/${TAG}_NAME.json) unless --only leaves it out.
fig() {
  local name=$1
  shift
  if [ $LIST = 1 ]; then echo "$name: $*"; return 0; fi
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 0; fi
  local t0=$SECONDS
  echo "=== $name: $*"
  if "$@" >"$STORE/$name.log" 2>&1; then
    echo "=== $name: ok in $((SECONDS - t0)) s -> $R/${TAG}_$name.json"
  else
    echo "=== $name: FAILED in $((SECONDS - t0)) s; its output:"
    tail -30 "$STORE/$name.log"
    FAILED=1
  fi
}
out() { echo "$R/${TAG}_$1.json"; }

fig host-overhead "$PY" -m hicache_kernels.bench --host-overhead --calls 500 --json "$(out host-overhead)"
fig tree "$PY" -m hicache.bench.tree --repeats 5 --json "$(out tree)"
fig tree-scale "$PY" -m hicache.bench.tree --scale --requests 1000 --json "$(out tree-scale)"
if [ -n "${HICACHE_SGLANG_PATH:-}" ] || [ $LIST = 1 ]; then
  fig tree-vs-sglang-0.5.23 "$PY" -m hicache.bench.tree --compare sglang-latest --repeats 9 --no-sglang \
    --json "$(out tree-vs-sglang-0.5.23)"
else
  echo "=== tree-vs-sglang-0.5.23: skipped: HICACHE_SGLANG_PATH is not set (bash scripts/fetch_sglang.sh DIR)"
fi
fig serving-multiturn "$PY" -m hicache.bench.serving --json "$(out serving-multiturn)"
fig serving-gpu-shape "$PY" -m hicache.bench.serving --fast --hidden 512 --heads 8 --kv-heads 2 --head-dim 64 \
  --ffn 1792 --layers 4 --page-size 16 --layout page_first_direct --clients 32 --rounds 4 --system-len 256 \
  --turn-len 128 --output-len 8 --max-parallel 4 --modes recompute device hierarchical --json "$(out serving-gpu-shape)"
fig serving-longqa "$PY" -m hicache.bench.serving --workload longqa --json "$(out serving-longqa)"
for layout in page_head page_first; do
  for group in 1 8; do
    fig "storage-prefetch-$layout-group$group" "$PY" -m hicache.bench.storage --presets llama3-8b --page-sizes 16 \
      --pages 1 --prefetch-hits 1 8 32 128 --prefetch-layout $layout --head-group $group --repeats 5 \
      --json "$(out "storage-prefetch-$layout-group$group")"
  done
done
fig host-setup-2gib "$PY" -m hicache.bench.host_setup --gib 2 --threads 1 2 --repeats 3 --json "$(out host-setup-2gib)"
[ $LIST = 1 ] && exit 0
echo "cpu_figures.sh: $([ $FAILED = 0 ] && echo 'every step passed' || echo 'a step FAILED')"
exit $FAILED
