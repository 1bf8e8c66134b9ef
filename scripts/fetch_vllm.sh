#!/usr/bin/env bash
# vLLM 0.34.0's Python code unpacked beside the project (not installed), for the integration tests of
# hicache.integrations.vllm (tests/integrations/test_vllm_tier.py):
#
#   bash scripts/fetch_vllm.sh DIR
#   export HICACHE_VLLM_PATH=DIR/vllm:DIR/deps-pyX.Y      # (the version of PYTHON, default python)
#
# Only the wheel's .py files are unpacked (its compiled CUDA kernels are not needed by the tiering
# manager, its CPU primary tier or the tier factory, which run in vLLM's scheduler process); vLLM then
# logs that vllm._C does not import, which is expected here. DIR/deps-pyX.Y holds, installed with
# --target and --no-deps, only the modules that vllm.v1.kv_offload.tiering imports (vLLM's full
# requirement list is far larger: torch 2.14, flashinfer, ...); the project's torch is used. Needs pip
# and network access; about 25 MB of vLLM and 210 MB of modules (transformers is most of it).
set -euo pipefail
DIR=${1:?usage: bash scripts/fetch_vllm.sh DIR}
PY=${PYTHON:-python}
mkdir -p "$DIR"
if [ ! -f "$DIR/vllm/vllm/v1/kv_offload/tiering/base.py" ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 vllm==0.34.0 -d "$DIR/wheel"
  "$PY" - "$DIR" <<'PYEOF'
import glob, sys, zipfile
out = sys.argv[1] + "/vllm"
(wheel,) = glob.glob(sys.argv[1] + "/wheel/vllm-0.34.0-*.whl")
with zipfile.ZipFile(wheel) as z:
    z.extractall(out, [n for n in z.namelist() if n.endswith(".py") or n.endswith(".json") or ".dist-info/" in n])
PYEOF
  rm -rf "$DIR/wheel"
fi
VER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
# What vllm.v1.kv_offload.tiering (spec, manager, factory) imports, at versions vLLM 0.34.0 accepts.
"$PY" -m pip install -q --no-deps --upgrade --target "$DIR/deps-py$VER" \
  msgspec regex psutil pyzmq "pydantic>=2.12" pydantic_core typing_inspection annotated_types \
  "transformers>=5.16.1,<5.23" "huggingface_hub>=2.0" tqdm httpx2 httpcore2 truststore h11 pyyaml \
  "safetensors>=0.8" "tokenizers>=0.23.3" pybase64 cachetools cbor2 cloudpickle uvloop py-cpuinfo \
  "prometheus_client>=0.18" "llguidance>=1.7,<1.8" xgrammar==0.2.8 apache-tvm-ffi==0.1.11
echo "vLLM 0.34.0 is in $DIR: export HICACHE_VLLM_PATH=$DIR/vllm:$DIR/deps-py$VER"
