#!/usr/bin/env bash
# One-command set-up on a fresh machine: a virtual environment in .venv with torch, Triton, the build
# tools, the test tools, and this package installed in editable mode with its CUDA extension built.
#
#   bash scripts/setup.sh
#
# Knobs (environment):
#   HICACHE_CUDA_ARCHS   archs to compile, e.g. "90" or "80;90;100;120" (default: see README)
#   HICACHE_SKIP_CUDA=1  skip the CUDA extension (pure-Python install)
#   HICACHE_TORCH_SPEC   pip requirement for torch when .venv has none (default "torch")
#   HICACHE_TRITON_SPEC  pip requirement for triton when .venv has none (default "triton")
#   HICACHE_VENV         where the environment goes (default .venv); PYTHON: interpreter to create it
#   HICACHE_SYSTEM_SITE=1  let the venv see the interpreter's packages (reuse an installed CUDA torch)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HICACHE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  if [ "${HICACHE_SYSTEM_SITE:-0}" = 1 ]; then
    "${PYTHON:-python3}" -m venv --system-site-packages "$VENV"
  else
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip "setuptools>=64" wheel pybind11 ninja
python -c "import torch" 2>/dev/null || pip install -q "${HICACHE_TORCH_SPEC:-torch}"
python -c "import triton" 2>/dev/null || pip install -q "${HICACHE_TRITON_SPEC:-triton}"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
# --no-build-isolation: build against the tools installed above (also how a GPU box without network
# builds); the extension itself does not link torch, so any torch works.
pip install -q --no-build-isolation -e ".[test]"
python -m hicache_kernels.info
