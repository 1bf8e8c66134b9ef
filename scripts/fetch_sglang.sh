#!/usr/bin/env bash
# SGLang 0.5.23 unpacked beside the project (not installed), for the radix-tree comparison
# (python -m hicache.bench.tree --compare sglang-latest) and its test:
#
#   bash scripts/fetch_sglang.sh DIR
#   export HICACHE_SGLANG_PATH=DIR/sglang:DIR/deps
#
# DIR/sglang holds the unpacked wheel (it bundles the Rust tree core), DIR/deps the modules it imports
# (hicache.bench.sglang.MODULES), installed with --target: nothing goes into the environment. Needs the
# Python the wheel is built for (3.11) with pip, and network access; about 350 MB.
set -euo pipefail
DIR=${1:?usage: bash scripts/fetch_sglang.sh DIR}
PY=${PYTHON:-python}
mkdir -p "$DIR"
if [ ! -d "$DIR/sglang/sglang" ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: sglang==0.5.23 -d "$DIR/wheel"
  "$PY" -m zipfile -e "$DIR"/wheel/sglang-0.5.23-*.whl "$DIR/sglang"
  rm -rf "$DIR/wheel"
fi
# shellcheck disable=SC2046
"$PY" -m pip install -q --no-deps --upgrade --target "$DIR/deps" $("$PY" -c 'from hicache.bench.sglang import MODULES; print(MODULES)')
echo "SGLang 0.5.23 is in $DIR: export HICACHE_SGLANG_PATH=$DIR/sglang:$DIR/deps"
