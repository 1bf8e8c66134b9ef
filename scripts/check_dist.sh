#!/usr/bin/env bash
# The distributions as users get them (CI runs this after scripts/setup.sh):
#   1. `python -m build` on a copy of the tracked sources: the sdist, and the wheel built from it;
#   2. `auditwheel show`: the wheel meets exactly the manylinux policy README "Building" names;
#   3. the wheel, installed by pip with its dependencies into a fresh venv: every module of hicache_kernels
#      and hicache imports from there (run from outside the source tree), `pip check` is clean, the
#      version, build record and console scripts are right, `python -m hicache_kernels.info` runs, and
#      `pip uninstall` leaves nothing behind;
#   4. the sdist, installed by pip (isolated build) into a second fresh venv: the same checks;
#   5. the oldest setuptools pyproject.toml allows builds it the GPU machine's way (editable, no build
#      isolation) and writes the license into the metadata.
#
#   bash scripts/check_dist.sh
#
# Knobs: PYTHON (default .venv/bin/python: needs build, auditwheel, torch, triton; `pip install -e
# ".[test]"` brings the first two), HICACHE_CUDA_ARCHS (default 90), CUDA_HOME, MAX_JOBS.
# Needs nvcc, and pip must reach an index (or its cache) for setuptools and the build requirements;
# torch and triton are pinned to the versions PYTHON has, so pip takes them from its cache.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
# The policy wheels built on CI's machine (Debian 12: glibc 2.36, GCC 12) meet; see README "Building".
EXPECT_POLICY=manylinux_2_34_x86_64
export HICACHE_CUDA_ARCHS=${HICACHE_CUDA_ARCHS:-90} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-2}
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset HICACHE_SKIP_CUDA HICACHE_LOCAL_VERSION TORCH_CUDA_ARCH_LIST
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS
lap() { echo "--- check_dist: $1 ($((SECONDS - start)) s)"; }
fail() {
  echo "check_dist: FAILED: $*" >&2
  exit 1
}
# Run a noisy command with its output in a log, shown only when it fails.
quiet() {
  local log="$WORK/$1.log"
  shift
  "$@" >"$log" 2>&1 || {
    tail -n 60 "$log" >&2
    fail "$*"
  }
}
pip_in() { "$PY" -m pip --python "$1/bin/python" "${@:2}"; }
site_of() { "$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }

"$PY" -c "import build, auditwheel, torch, triton" 2>/dev/null ||
  fail "$PY needs build, auditwheel, torch and triton: run scripts/setup.sh (the [test] extra has build, auditwheel)"
TORCH=$("$PY" -c "import torch; print(torch.__version__)")
TRITON=$("$PY" -c "import triton; print(triton.__version__)")

# 1. sdist and wheel, from a copy of what git tracks (plus new files not ignored), so nothing built in
#    this checkout leaks in and nothing is written into it.
"$PY" - "$WORK/src" <<'EOF'
import os, shutil, subprocess, sys
from pathlib import Path

out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], check=True,
                     capture_output=True).stdout
for name in filter(None, out.split(b"\0")):
    path = Path(os.fsdecode(name))
    if path.is_file():  # a tracked file deleted in the work tree is not copied
        (Path(sys.argv[1]) / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, Path(sys.argv[1]) / path)
EOF
quiet build "$PY" -m build --no-isolation --outdir "$WORK/dist" "$WORK/src"
SDIST=$(ls "$WORK"/dist/*.tar.gz)
WHEEL=$(ls "$WORK"/dist/*.whl)
VERSION=$(basename "$WHEEL" | cut -d- -f2)
echo "check_dist: built $(basename "$SDIST") and $(basename "$WHEEL")"
lap "sdist and wheel (python -m build)"

# 2. manylinux policy.
POLICY=$("$PY" -m auditwheel show --json "$WHEEL" |
  "$PY" -c "import json, sys; print(json.load(sys.stdin)['overall_tag'])")
echo "check_dist: auditwheel: the wheel is consistent with $POLICY"
[ "$POLICY" = "$EXPECT_POLICY" ] ||
  fail "auditwheel says $POLICY, README and this script say $EXPECT_POLICY: update both or fix the build"
lap "auditwheel"

# Imports every module of both packages from the venv's own site-packages (from outside the source
# tree), and checks the version and the build record.
check_venv() {
  local venv=$1
  (cd "$WORK" && "$venv/bin/python" - "$VERSION" "$HICACHE_CUDA_ARCHS" <<'EOF'
import importlib, importlib.metadata, pkgutil, sys, sysconfig

version, archs = sys.argv[1], sys.argv[2]
site = sysconfig.get_paths()["purelib"]
named = ["hicache_kernels", "hicache_kernels.compat", "hicache_kernels.compat.sgl_kernel", "hicache_kernels.ops",
         "hicache_kernels.backends", "hicache_kernels.bench", "hicache_kernels.pcie", "hicache_kernels.targets",
         "hicache_kernels.info", "hicache"]
modules = set(named)
for top in ("hicache_kernels", "hicache"):
    modules.update(m.name for m in pkgutil.walk_packages(importlib.import_module(top).__path__, top + "."))
# Adapters that run inside a serving framework import it; without it they say so, naming it.
CLIENTS = {"hicache.integrations.sglang": "sglang", "hicache.integrations.vllm": "vllm"}
outside, needs_client = {}, []
for n in sorted(modules):
    try:
        f = importlib.import_module(n).__file__
    except ModuleNotFoundError as exc:
        if CLIENTS.get(n) != exc.name:
            raise
        needs_client.append(n)
        continue
    if not f.startswith(site):
        outside[n] = f
assert not outside, f"imported from outside {site}: {outside}"
assert needs_client == sorted(CLIENTS), needs_client  # none is missing from the wheel
import hicache_kernels
from hicache_kernels._archs import parse_arch_list

b = hicache_kernels.build_info()
assert b["version"] == importlib.metadata.version("hicache-kernels") == version, (b["version"], version)
assert b["cuda_built"] and b["archs"] == [str(a) for a in parse_arch_list(archs)], b
print(f"check_dist: {len(modules)} modules import from {site}; version {version}, archs {b['archs']}")
EOF
  ) || fail "imports from $venv"
  # The SGLang kernel switch's .pth file: installed, inert without HICACHE_SGL_KERNEL, on with it = 1.
  [ -f "$(site_of "$venv")/hicache_kernels_sgl.pth" ] || fail "$venv has no hicache_kernels_sgl.pth"
  (cd "$WORK" && env -u HICACHE_SGL_KERNEL "$venv/bin/python" -c \
    "import sys; sys.exit('hicache_kernels' in sys.modules)") || fail "the .pth file imports without the switch"
  (cd "$WORK" && HICACHE_SGL_KERNEL=1 "$venv/bin/python" -c \
    "import sys; sys.exit(not sys.modules['hicache_kernels.compat.sglang_switch'].status()['on'])") ||
    fail "HICACHE_SGL_KERNEL=1 did not turn the switch on in $venv"
  for script in hicache-info hicache-bench hicache-pcie hicache-targets hicache-bench-serving hicache-bench-tree \
    hicache-bench-storage; do
    [ -x "$venv/bin/$script" ] || fail "$venv/bin/$script was not installed"
  done
  (cd "$WORK" && "$venv/bin/hicache-info") || fail "hicache-info in $venv"
  # The model served over the cache, from the installed package alone (seconds).
  (cd "$WORK" && "$venv/bin/hicache-bench-serving" --quick --modes recompute hierarchical --json serving.json \
    >/dev/null) || fail "hicache-bench-serving in $venv"
  pip_in "$venv" check || fail "pip check in $venv"
}

# 3. The wheel, with its dependencies resolved by pip (torch and triton pinned to PYTHON's versions).
VA=$WORK/venv-wheel
"$PY" -m venv --without-pip "$VA"
quiet install-wheel pip_in "$VA" install "${WHEEL}[triton]" "torch==$TORCH" "triton==$TRITON"
check_venv "$VA"
SITE_A=$(site_of "$VA")
quiet uninstall pip_in "$VA" uninstall -y hicache-kernels
left=$(cd "$SITE_A" && ls -d hicache* 2>/dev/null || true)
[ -z "$left" ] || fail "pip uninstall left behind in $SITE_A: $left"
lap "wheel installed into a fresh venv"

# 4. The sdist, built by pip in an isolated environment from build-system.requires; its dependencies
#    come from the first venv (now without hicache-kernels) through a .pth file.
VB=$WORK/venv-sdist
"$PY" -m venv --without-pip "$VB"
echo "$SITE_A" >"$(site_of "$VB")/zz_deps.pth"
quiet install-sdist pip_in "$VB" install --no-deps "$SDIST"
check_venv "$VB"
lap "sdist installed into a fresh venv"

# 5. The oldest setuptools allowed, as the GPU machine builds: editable, without build isolation.
FLOOR=$(sed -n 's/.*"setuptools>=\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$FLOOR" ] || fail "no setuptools>= floor in pyproject.toml's build-system.requires"
VC=$WORK/venv-setuptools$FLOOR
"$PY" -m venv --without-pip "$VC"
quiet install-floor pip_in "$VC" install "setuptools==$FLOOR" wheel pybind11 ninja
mkdir "$WORK/unpacked" && tar -xzf "$SDIST" -C "$WORK/unpacked"
quiet editable-floor pip_in "$VC" install --no-build-isolation --no-deps -e "$WORK"/unpacked/*/
echo "$SITE_A" >"$(site_of "$VC")/zz_deps.pth"
(cd "$WORK" && "$VC/bin/python" - "$FLOOR" "$VERSION" <<'EOF'
import importlib.metadata, sys

import setuptools

import hicache_kernels
import hicache_kernels.compat.sgl_kernel

floor, version = sys.argv[1], sys.argv[2]
assert setuptools.__version__.split(".")[:1] == floor.split(".")[:1], setuptools.__version__
meta = importlib.metadata.metadata("hicache-kernels")
assert meta["Version"] == hicache_kernels.build_info()["version"] == version, (meta["Version"], version)
assert "Apache-2.0" in (meta.get("License-Expression"), meta.get("License")), meta.items()
print(f"check_dist: setuptools {setuptools.__version__}: editable install of {version}, License: Apache-2.0")
EOF
) || fail "the editable install with setuptools $FLOOR"
lap "setuptools $FLOOR (editable, no build isolation)"
echo "check_dist: OK in $((SECONDS - start)) s"
