"""The build: archs requested are exactly the archs embedded; without nvcc the package still builds.

Each test copies the sources to a temporary folder and runs ``pip wheel`` there, as a user would.
Proof of the archs comes from ``cuobjdump --list-elf`` / ``--list-ptx`` on the ``.so`` in the wheel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cudatools import CUDA_HOME, cuobjdump

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.build


def copy_sources(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    for folder in ("csrc", "hicache_kernels", "python"):
        shutil.copytree(
            ROOT / folder, dst / folder, ignore=shutil.ignore_patterns("*.so", "_build_meta.json", "__pycache__")
        )
    return dst


def build_wheel(tmp_path: Path, env_updates: dict[str, str | None]) -> tuple[Path, str]:
    src = copy_sources(tmp_path / "src")
    out = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k not in ("HICACHE_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST")}
    for key, value in env_updates.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = out.glob("hicache_kernels-*.whl")
    return wheel, proc.stdout + proc.stderr


def run_from(site: Path, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` importing the package from ``site`` alone: ``-S`` skips site-packages, so the
    editable install of this checkout cannot shadow the wheel under test."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, cwd=cwd)


def extract(wheel: Path, tmp_path: Path) -> tuple[Path | None, dict]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "hicache_kernels/__init__.py" in names and "hicache/__init__.py" in names
        meta = json.loads(zf.read("hicache_kernels/_build_meta.json"))
        sos = [n for n in names if re.fullmatch(r"hicache_kernels/_C\..*\.so", n)]
        if not sos:
            return None, meta
        (so,) = sos
        zf.extract(so, tmp_path / "unzipped")
    return tmp_path / "unzipped" / so, meta


def embedded(so: Path) -> tuple[set[str], set[str]]:
    elf = subprocess.run([cuobjdump(), "--list-elf", str(so)], capture_output=True, text=True).stdout
    ptx = subprocess.run([cuobjdump(), "--list-ptx", str(so)], capture_output=True, text=True).stdout
    return set(re.findall(r"\.(sm_\w+)\.cubin", elf)), set(re.findall(r"\.(sm_\w+)\.ptx", ptx))


needs_nvcc = pytest.mark.skipif(not (CUDA_HOME / "bin" / "nvcc").exists(), reason=f"no nvcc under {CUDA_HOME}")


@needs_nvcc
@pytest.mark.parametrize(
    ("archs", "cubins", "ptx"),
    [("90", {"sm_90"}, set()), ("8.0;9.0+PTX", {"sm_80", "sm_90"}, {"sm_90"})],
)
def test_wheel_has_exactly_requested_archs(tmp_path: Path, archs: str, cubins: set[str], ptx: set[str]) -> None:
    wheel, log = build_wheel(tmp_path, {"HICACHE_CUDA_ARCHS": archs, "CUDA_HOME": str(CUDA_HOME)})
    so, meta = extract(wheel, tmp_path)
    assert so is not None, "wheel has no compiled extension"
    assert embedded(so) == (cubins, ptx)
    assert meta["cuda_built"] is True and meta["archs_source"] == "HICACHE_CUDA_ARCHS"
    # The extension records its own archs; the package reports them through build_info().
    code = "import json, hicache_kernels as h; print(json.dumps(h.build_info()))"
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    proc = run_from(site, code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["cuda_built"] is True
    assert {a.removesuffix("+PTX") for a in info["archs"]} == {c.removeprefix("sm_") for c in cubins}
    assert {a.removesuffix("+PTX") for a in info["archs"] if a.endswith("+PTX")} == {p.removeprefix("sm_") for p in ptx}


@needs_nvcc
def test_torch_arch_list_is_the_fallback(tmp_path: Path) -> None:
    wheel, _ = build_wheel(tmp_path, {"TORCH_CUDA_ARCH_LIST": "8.6", "CUDA_HOME": str(CUDA_HOME)})
    so, meta = extract(wheel, tmp_path)
    assert so is not None and embedded(so) == ({"sm_86"}, set())
    assert meta["archs_source"] == "TORCH_CUDA_ARCH_LIST"


@needs_nvcc
def test_unsupported_arch_fails_the_build_loudly(tmp_path: Path) -> None:
    src = copy_sources(tmp_path / "src")
    env = {**os.environ, "HICACHE_CUDA_ARCHS": "70", "CUDA_HOME": str(CUDA_HOME)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-w",
            str(tmp_path / "d"),
            str(src),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode != 0
    assert "'70'" in proc.stdout + proc.stderr and "not supported by this nvcc" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"HICACHE_SKIP_CUDA": "1"}, "HICACHE_SKIP_CUDA is set"),
        (
            {"CUDA_HOME": "/nonexistent-cuda", "CUDA_PATH": None},
            "CUDA_HOME=/nonexistent-cuda is set but /nonexistent-cuda/bin/nvcc does not exist",
        ),
    ],
)
def test_pure_python_build_without_nvcc(tmp_path: Path, env: dict[str, str | None], reason: str) -> None:
    wheel, log = build_wheel(tmp_path, env)
    so, meta = extract(wheel, tmp_path)
    assert so is None
    assert meta == {"cuda_built": False, "skip_reason": reason}
    assert "building WITHOUT the CUDA extension" in log
    # Installed from that wheel, the package imports, reports why, and the kernel path raises clearly.
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    code = (
        "import hicache_kernels as h\n"
        "from hicache_kernels._ext import load_extension\n"
        "print(h.build_info()['skip_reason'])\n"
        "try:\n    load_extension()\nexcept h.BackendUnavailableError as e:\n    print('raised:', e)\n"
    )
    proc = run_from(site, code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [reason, f"raised: the CUDA extension was not built: {reason}"]
