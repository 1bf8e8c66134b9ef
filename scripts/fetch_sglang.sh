#!/usr/bin/env bash
# SGLang 0.5.23 unpacked beside the project (not installed):
#
#   bash scripts/fetch_sglang.sh DIR                  # the radix-tree comparison (Python 3.11)
#   export HICACHE_SGLANG_PATH=DIR/sglang:DIR/deps
#
#   PYTHON=.venv-gpuimage/bin/python bash scripts/fetch_sglang.sh DIR --integration
#   export HICACHE_SGLANG_PATH=DIR/sglang:DIR/deps-py3.12   # (that interpreter's version)
#
# DIR/sglang holds the unpacked wheel (it bundles the Rust tree core, built for CPython 3.11; the rest
# is Python). DIR/deps holds the modules the tree comparison imports (hicache.bench.sglang.MODULES),
# installed with --target: nothing goes into the environment. --integration installs, into
# DIR/deps-pyX.Y for PYTHON's version, what SGLang's host pools and storage factory import as well
# (tests/integrations): among them torchvision, whose only Linux wheels on PyPI are CUDA builds that
# import with a CUDA build of torch (the GPU image's torch 2.11.0 here), so the integration tests run
# in CI's GPU-image environment. Needs pip and network access; about 350 MB (plus ~10 MB with
# --integration).
set -euo pipefail
DIR=${1:?usage: bash scripts/fetch_sglang.sh DIR [--integration]}
MODE=${2:-}
PY=${PYTHON:-python}
mkdir -p "$DIR"
if [ ! -d "$DIR/sglang/sglang" ]; then
  # The wheel is CPython 3.11 only; its Python modules import on newer versions too.
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_34_x86_64 sglang==0.5.23 -d "$DIR/wheel"
  "$PY" -m zipfile -e "$DIR"/wheel/sglang-0.5.23-*.whl "$DIR/sglang"
  rm -rf "$DIR/wheel"
fi
# shellcheck disable=SC2046
MODULES=$(PYTHONPATH=python "$PY" -c 'from hicache.bench.sglang import MODULES; print(MODULES)')
if [ "$MODE" = --integration ]; then
  VER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  # torchvision's release that matches the installed torch (2.N -> 0.(N + 15)).
  TV=$("$PY" -c 'import torch; v = torch.__version__.split("+")[0].split("."); print(f"0.{int(v[1]) + 15}.0")')
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-deps --upgrade --target "$DIR/deps-py$VER" $MODULES "torchvision==$TV" pillow \
    requests urllib3 idna certifi aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist
  echo "SGLang 0.5.23 is in $DIR: export HICACHE_SGLANG_PATH=$DIR/sglang:$DIR/deps-py$VER"
else
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-deps --upgrade --target "$DIR/deps" $MODULES
  echo "SGLang 0.5.23 is in $DIR: export HICACHE_SGLANG_PATH=$DIR/sglang:$DIR/deps"
fi
