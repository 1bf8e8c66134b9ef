#!/usr/bin/env bash
# The build step of `gpu_check.sh --dry-run`: the real build step's command checked without installing
# anything, without writing into the source tree and without touching the Python environment.
#
#   bash benchmarks/dry_build.sh SCRATCH_DIR PYTHON -m pip install ARGS...   (the real step's command)
#
# 1. pip runs that very command with --dry-run added: it parses the flags and has the build backend
#    prepare the editable install's metadata (setup.py runs: the toolkit under CUDA_HOME and the arch
#    list are looked up, and the version pip would install names them, e.g. 0.1.0+cu130.sm90). Nothing
#    is installed.
# 2. setup.py build_ext compiles both extensions (the host core with the host C++ compiler; the CUDA
#    extension with nvcc for HICACHE_CUDA_ARCHS) through the real build's ninja files and flags, into
#    SCRATCH_DIR/build, which is removed afterwards: nothing is installed or copied into the tree.
# No toolkit here (no nvcc under CUDA_HOME) is a loud warning, not a failure: the CPU machine is not the
# GPU machine, and on this one the real build would skip the CUDA extension too.
# The installed package stays as it was: the steps after this one use it.
# Exit status: 1 when pip refuses the command or the compile fails, 2 on a bad call.
set -uo pipefail
SCRATCH=${1:?usage: bash benchmarks/dry_build.sh SCRATCH_DIR PYTHON -m pip install ARGS...}
shift
PY=()  # the interpreter's words: those before "-m pip"
DRY=() # the command with --dry-run after "install"
for a in "$@"; do
  DRY+=("$a")
  [ "$a" = install ] && DRY+=(--dry-run --disable-pip-version-check)
done
for a in "$@"; do
  [ "$a" = -m ] && break
  PY+=("$a")
done
if [ ${#DRY[@]} = $# ] || [ ${#PY[@]} = $# ]; then
  echo "dry_build.sh: expected PYTHON -m pip install ARGS..., got: $*" >&2
  exit 2
fi
cd "$(dirname "$0")/.." || exit 2
BUILD=$SCRATCH/build
PREFIX=$("${PY[@]}" -c 'import sys; print(sys.prefix)')
echo "dry run: the real build step runs: $*"
echo "dry run: NOT run here: nothing is installed into $PREFIX and nothing is built into $PWD"
echo "--- 1/2: pip checks the command, installing nothing: ${DRY[*]}"
if ! "${DRY[@]}"; then
  echo "dry run: build: FAILED: pip refused the build step's command (above)"
  exit 1
fi
echo "--- 2/2: both extensions compiled into $BUILD (not installed; removed after)"
rm -rf "$BUILD"
"${PY[@]}" setup.py build_ext --build-lib "$BUILD/lib" --build-temp "$BUILD/temp"
rc=$?
META=$BUILD/lib/hicache_kernels/_build_meta.json
if [ $rc -ne 0 ] || [ ! -s "$META" ]; then
  rm -rf "$BUILD"
  echo "dry run: build: FAILED: the compile failed (above; exit $rc); the real build runs the same compile"
  exit 1
fi
"${PY[@]}" -c 'import json, os, sys
m = json.load(open(sys.argv[1]))
if m["cuda_built"]:
    print("dry run: compiled hicache._core and hicache_kernels._C (CUDA %s, archs %s, version %s)"
          % (m["cuda_version"], m["archs"], m["version"]))
else:
    print("dry run: WARNING: hicache_kernels._C was NOT compiled: %s. Only hicache._core was; the GPU machine "
          "needs nvcc under CUDA_HOME (here %s), or its build skips the CUDA extension too"
          % (m.get("skip_reason"), os.environ.get("CUDA_HOME", "unset")))' "$META"
rm -rf "$BUILD"
if ! "${PY[@]}" -c 'import hicache, hicache_kernels' 2>/dev/null; then
  echo "dry run: WARNING: hicache-kernels is not installed in $PREFIX: the steps after this one need it" \
    "(bash scripts/setup.sh installs it; the dry run does not)"
fi
echo "dry run: build checked: pip accepted the command and the compile passed; nothing was installed," \
  "the source tree and $PREFIX are untouched (the steps after this use the package installed before)"
