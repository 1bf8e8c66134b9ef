#!/usr/bin/env bash
# One-command set-up on a fresh machine: a virtual environment in .venv with torch, Triton, the build
# tools, the test tools, and this package installed in editable mode with its CUDA extension built.
#
#   bash scripts/setup.sh
#
# Knobs (environment):
#   HICACHE_CUDA_ARCHS   archs to compile, e.g. "90" or "80;90;100;120" (default: see README)
#   HICACHE_SKIP_CUDA=1  skip the CUDA extension (the cache layer's host core is still built)
#   HICACHE_TORCH_SPEC   pip requirement for torch when .venv has none (default "torch")
#   HICACHE_TRITON_SPEC  pip requirement for triton when .venv has none (default "triton")
#   HICACHE_VENV         where the environment goes (default .venv); PYTHON: interpreter to create it
#   HICACHE_SYSTEM_SITE=1  let the venv see the interpreter's packages (reuse an installed CUDA torch)
#   HICACHE_MOONCAKE=1   also the Mooncake Store client (the storage tier's mooncake backend and its
#                        tests; a CPU machine also needs the libibverbs1 system library, installed here
#                        with apt-get when run as root)
#   HICACHE_NIXL=1       also NVIDIA NIXL (nixl-cu13, the [nixl] extra: the storage tier's nixl backend and
#                        its tests, over NIXL's POSIX plugin; no GPU needed)
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
# builds); the extension itself does not link torch, so any torch >= 2.4 works.
pip install -q --no-build-isolation -e ".[test]"
if [ "${HICACHE_MOONCAKE:-0}" = 1 ]; then
  if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get install -y -q libibverbs1 || { apt-get update -q && apt-get install -y -q libibverbs1; }; } >/dev/null 2>&1 ||
      echo "setup: could not install libibverbs1: the mooncake tests will skip, saying why"
  fi
  pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" ||
    echo "setup: could not install the Mooncake Store client: the mooncake tests will skip, saying why"
fi
if [ "${HICACHE_NIXL:-0}" = 1 ]; then
  pip install -q "nixl-cu13==1.5.1" || echo "setup: could not install NIXL: the nixl tests will skip, saying why"
fi
python -m hicache.info  # the kernel package's info and the cache layer's tree core
