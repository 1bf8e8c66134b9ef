"""The build and what it ships.

The archs requested are exactly the archs embedded; without nvcc the package still builds, without the CUDA
extension but with the cache layer's host core (``hicache._core``, host compiler only), which serves the
compiled tree there; the wheel holds every package and module and the license, and is named for what it holds (a local
version label); the sdist holds everything building needs (headers included) and no tests, and a wheel
builds from it; a new arch list recompiles only what depends on it.

Each test copies the sources to a temporary folder and builds there with ``pip wheel`` (or the sdist
hook), as a user would. Proof of the archs comes from ``cuobjdump --list-elf`` / ``--list-ptx`` on the
``.so`` in the wheel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

import hicache_kernels
from hicache_kernels import _archs

from cudatools import CUDA_HOME, cuobjdump

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.build
VERSION = hicache_kernels.__version__
NVCC_FOUND = (CUDA_HOME / "bin" / "nvcc").exists()
needs_nvcc = pytest.mark.skipif(not NVCC_FOUND, reason=f"no nvcc under {CUDA_HOME}")
# The toolkit's CUDA version as the local version label spells it: "cu130" for CUDA 13.0.
CU = (
    "cu"
    + _archs.cuda_version_text(
        _archs.cudart_version_from_header((CUDA_HOME / "include" / "cuda_runtime_api.h").read_text())
    ).replace(".", "")
    if NVCC_FOUND
    else None
)
BUILD_OUTPUTS = shutil.ignore_patterns("*.so", "*.o", "_build_meta.json", "__pycache__")


def copy_sources(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, dst / name)
    for folder in ("csrc", "hicache_kernels", "python"):
        shutil.copytree(ROOT / folder, dst / folder, ignore=BUILD_OUTPUTS)
    return dst


def build_env(env_updates: dict[str, str | None]) -> dict[str, str]:
    drop = ("HICACHE_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST", "HICACHE_LOCAL_VERSION", "HICACHE_SKIP_CUDA")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    for key, value in env_updates.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def pip_wheel(src: Path, out: Path, env_updates: dict[str, str | None]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        env=build_env(env_updates),
    )


def build_wheel(tmp_path: Path, env_updates: dict[str, str | None], src: Path | None = None) -> tuple[Path, str]:
    src = src or copy_sources(tmp_path / "src")
    out = tmp_path / "dist"
    proc = pip_wheel(src, out, env_updates)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = out.glob("hicache_kernels-*.whl")
    return wheel, proc.stdout + proc.stderr


def version_of(wheel: Path) -> str:
    return wheel.name.split("-")[1]


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


def host_cores(wheel: Path) -> list[str]:
    """The wheel's ``hicache/_core*.so`` (the host core: in every wheel)."""
    with zipfile.ZipFile(wheel) as zf:
        return [n for n in zf.namelist() if re.fullmatch(r"hicache/_core\..*\.so", n)]


def fresh_venv(wheel: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``wheel`` installed by pip into a new venv: ``(its python, its site-packages)``. Torch and the other
    dependencies come from this interpreter's site-packages, added by a .pth file after the install, whose
    own .pth files, the editable install of this checkout among them, are not run."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([py, "-c", where], capture_output=True, text=True, check=True).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return py, site


def embedded(so: Path) -> tuple[set[str], set[str]]:
    elf = subprocess.run([cuobjdump(), "--list-elf", str(so)], capture_output=True, text=True).stdout
    ptx = subprocess.run([cuobjdump(), "--list-ptx", str(so)], capture_output=True, text=True).stdout
    return set(re.findall(r"\.(sm_\w+)\.cubin", elf)), set(re.findall(r"\.(sm_\w+)\.ptx", ptx))


def source_modules() -> set[str]:
    """Every file of the two packages as the wheel must hold it (hicache comes from python/hicache)."""
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "hicache_kernels").rglob("*.py")}
    files |= {str(p.relative_to(ROOT / "python")) for p in (ROOT / "python" / "hicache").rglob("*.py")}
    return files | {"hicache_kernels/py.typed"}


@pytest.fixture(scope="module")
def sm90(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One sm_90 wheel, built from a copy of the sources (whose build folder stays for the rebuild test)."""
    if not NVCC_FOUND:
        pytest.skip(f"no nvcc under {CUDA_HOME}")
    tmp = tmp_path_factory.mktemp("sm90")
    src = copy_sources(tmp / "src")
    wheel, log = build_wheel(tmp, {"HICACHE_CUDA_ARCHS": "90", "CUDA_HOME": str(CUDA_HOME)}, src=src)
    return SimpleNamespace(src=src, wheel=wheel, log=log)


@needs_nvcc
@pytest.mark.parametrize(
    ("archs", "cubins", "ptx", "label"),
    [("90", {"sm_90"}, set(), "sm90"), ("8.0;9.0+PTX", {"sm_80", "sm_90"}, {"sm_90"}, "sm80.sm90ptx")],
)
def test_wheel_has_exactly_requested_archs(
    request: pytest.FixtureRequest, tmp_path: Path, archs: str, cubins: set[str], ptx: set[str], label: str
) -> None:
    if archs == "90":
        wheel = request.getfixturevalue("sm90").wheel
    else:
        wheel, _ = build_wheel(tmp_path, {"HICACHE_CUDA_ARCHS": archs, "CUDA_HOME": str(CUDA_HOME)})
    so, meta = extract(wheel, tmp_path)
    assert so is not None, "wheel has no compiled extension"
    assert embedded(so) == (cubins, ptx)
    # The wheel is named for what it holds, and its build record says the same.
    cuda_version = _archs.cudart_version_from_header((CUDA_HOME / "include" / "cuda_runtime_api.h").read_text())
    assert version_of(wheel) == f"{VERSION}+{CU}.{label}"
    assert meta == {
        "version": version_of(wheel),
        "cuda_built": True,
        "archs": ";".join(str(a) for a in _archs.parse_arch_list(archs)),
        "archs_source": "HICACHE_CUDA_ARCHS",
        "cuda_version": cuda_version,
        "min_driver_cuda_version": cuda_version // 1000 * 1000,
    }
    # The extension records its own archs; the package reports them through build_info().
    code = "import json, hicache_kernels as h; print(json.dumps(h.build_info()))"
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    proc = run_from(site, code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["cuda_built"] is True and info["version"] == version_of(wheel)
    assert info["cuda_version"] == cuda_version and info["min_driver_cuda_version"] == cuda_version // 1000 * 1000
    assert {a.removesuffix("+PTX") for a in info["archs"]} == {c.removeprefix("sm_") for c in cubins}
    assert {a.removesuffix("+PTX") for a in info["archs"] if a.endswith("+PTX")} == {p.removeprefix("sm_") for p in ptx}


@needs_nvcc
def test_torch_arch_list_is_the_fallback(tmp_path: Path) -> None:
    wheel, _ = build_wheel(tmp_path, {"TORCH_CUDA_ARCH_LIST": "8.6", "CUDA_HOME": str(CUDA_HOME)})
    so, meta = extract(wheel, tmp_path)
    assert so is not None and embedded(so) == ({"sm_86"}, set())
    assert meta["archs_source"] == "TORCH_CUDA_ARCH_LIST" and version_of(wheel) == f"{VERSION}+{CU}.sm86"


@needs_nvcc
def test_unsupported_arch_fails_the_build_loudly(tmp_path: Path) -> None:
    src = copy_sources(tmp_path / "src")
    proc = pip_wheel(src, tmp_path / "d", {"HICACHE_CUDA_ARCHS": "70", "CUDA_HOME": str(CUDA_HOME)})
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
    assert so is None and len(host_cores(wheel)) == 1  # no CUDA extension; the host core, built all the same
    assert version_of(wheel) == f"{VERSION}+cpu"
    assert meta == {"version": f"{VERSION}+cpu", "cuda_built": False, "skip_reason": reason}
    assert "building WITHOUT the CUDA extension" in log and "building the host core hicache._core" in log
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


# Run by the fresh venv's python from outside the source tree: a cache's default tree core, then the
# serving benchmark's quick run (the engine over the hierarchical cache) with every cache on the compiled
# core (HICACHE_TREE_CORE=compiled: a cache that cannot have it raises).
SERVE_QUICK = """
import json, os, sys
import torch
import hicache, hicache._core, hicache_kernels
from hicache import DeviceKVPool, HiRadixCache, HostKVPool
from hicache.bench.serving import main
from hicache_kernels._ext import extension_status

dev = DeviceKVPool(num_slots=64, num_layers=1, head_num=1, head_dim=2, dtype=torch.float32, device="cpu")
with HiRadixCache(dev, HostKVPool(dev, layout="page_first", ratio=2.0), io_backend="direct", threaded=False) as c:
    core = [c.tree_core, c.tree_core_reason]
os.environ["HICACHE_TREE_CORE"] = "compiled"
rc = main(["--quick", "--modes", "hierarchical", "--json", "serving.json"])
(res,) = json.load(open("serving.json"))["results"]
files = [m.__file__ for m in (hicache, hicache._core, hicache_kernels)]
out = {"core": core, "rc": rc, "files": files, "cuda": extension_status(), "result": res}
open("out.json", "w").write(json.dumps(out))
"""


def test_skip_cuda_wheel_serves_the_compiled_tree_core(tmp_path: Path) -> None:
    """HICACHE_SKIP_CUDA=1: the wheel has the host core and no CUDA extension; installed into a fresh venv
    the cache takes the compiled tree core there, and the engine serves the quick workload on it."""
    wheel, _ = build_wheel(tmp_path, {"HICACHE_SKIP_CUDA": "1"})
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert not [n for n in names if re.fullmatch(r"hicache_kernels/_C\..*\.so", n)], names
    (core,) = host_cores(wheel)
    assert "-linux_" in wheel.name  # a platform wheel: it holds a compiled module
    py, site = fresh_venv(wheel, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_TREE_CORE"}  # the default: auto
    proc = subprocess.run([py, "-c", SERVE_QUICK], capture_output=True, text=True, cwd=work, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = json.loads((work / "out.json").read_text())
    assert out["core"] == ["compiled", "hicache._core.RadixTree (HICACHE_TREE_CORE=auto)"]
    assert [Path(f).relative_to(site).as_posix() for f in out["files"]] == [
        "hicache/__init__.py",
        core,
        "hicache_kernels/__init__.py",
    ]
    assert out["cuda"] == [False, "the CUDA extension was not built: HICACHE_SKIP_CUDA is set"]
    res = out["result"]
    assert out["rc"] == 0 and res["mode"] == "hierarchical" and res["requests"] > 0
    assert res["device_hit_tokens"] > 0 and res["host_hit_tokens"] > 0  # both tiers served prefixes


def test_missing_host_compiler_fails_the_core_build_loudly(tmp_path: Path) -> None:
    src = copy_sources(tmp_path / "src")
    proc = pip_wheel(src, tmp_path / "d", {"HICACHE_SKIP_CUDA": "1", "CXX": "/nonexistent/c++"})
    assert proc.returncode != 0
    assert "no host C++ compiler: CXX='/nonexistent/c++' was not found" in proc.stdout + proc.stderr
    assert "host core hicache._core" in proc.stdout + proc.stderr


@pytest.mark.parametrize(("label", "version"), [("", VERSION), ("site.h200", f"{VERSION}+site.h200")])
def test_local_version_can_be_set_or_dropped(tmp_path: Path, label: str, version: str) -> None:
    wheel, _ = build_wheel(tmp_path, {"HICACHE_SKIP_CUDA": "1", "HICACHE_LOCAL_VERSION": label})
    assert version_of(wheel) == version and extract(wheel, tmp_path)[1]["version"] == version


def test_invalid_local_version_fails_the_build_loudly(tmp_path: Path) -> None:
    src = copy_sources(tmp_path / "src")
    proc = pip_wheel(src, tmp_path / "d", {"HICACHE_SKIP_CUDA": "1", "HICACHE_LOCAL_VERSION": "cu130-sm90"})
    assert proc.returncode != 0
    assert "HICACHE_LOCAL_VERSION='cu130-sm90' is not a PEP 440 local version label" in proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ what the wheel holds


def test_wheel_holds_every_module_and_the_license(sm90: SimpleNamespace) -> None:
    with zipfile.ZipFile(sm90.wheel) as zf:
        names = set(zf.namelist())
        dist_info = f"hicache_kernels-{version_of(sm90.wheel)}.dist-info"
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        licenses = [n for n in names if n.startswith(dist_info) and n.endswith("/LICENSE")]
        assert len(licenses) == 1, sorted(names)
        assert zf.read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
    missing = source_modules() - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    assert "hicache_kernels/compat/sgl_kernel.py" in names and len(host_cores(sm90.wheel)) == 1
    assert not [n for n in names if n.startswith("tests/")]
    assert re.search(r"^License(-Expression)?: Apache-2\.0$", metadata, re.MULTILINE), metadata
    assert (
        "Apache License" in (ROOT / "LICENSE").read_text()
        and "Version 2.0, January 2004" in (ROOT / "LICENSE").read_text()
    )


PUBLIC_MODULES = [
    "hicache_kernels",
    "hicache_kernels.compat",
    "hicache_kernels.compat.sgl_kernel",
    "hicache_kernels.ops",
    "hicache_kernels.backends",
    "hicache_kernels.bench",
    "hicache_kernels.pcie",
    "hicache_kernels.targets",
    "hicache_kernels.info",
    "hicache",
]


def test_every_public_module_imports_from_a_fresh_venv(sm90: SimpleNamespace, tmp_path: Path) -> None:
    """The wheel installed by pip into a new venv (:func:`fresh_venv`): every public module imports from
    there."""
    py, site = fresh_venv(sm90.wheel, tmp_path)
    venv = py.parent.parent
    code = (
        "import importlib, json, sys\n"
        "files = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}\n"
        "import hicache_kernels\n"
        "print(json.dumps({'files': files, 'build': hicache_kernels.build_info()}))\n"
    )
    proc = subprocess.run([py, "-c", code, *PUBLIC_MODULES], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    outside = {m: f for m, f in out["files"].items() if not f.startswith(str(site))}
    assert not outside, f"imported from outside the venv: {outside}"
    assert out["build"]["version"] == version_of(sm90.wheel) and out["build"]["archs"] == ["90"]
    for script in ("hicache-info", "hicache-bench", "hicache-pcie", "hicache-targets", "hicache-bench-serving",
                   "hicache-bench-tree", "hicache-bench-storage"):  # fmt: skip
        assert (venv / "bin" / script).exists(), script
    proc = subprocess.run([py, "-m", "hicache_kernels.info"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"hicache-kernels {VERSION} (built as {version_of(sm90.wheel)})")


# ------------------------------------------------------------------------------ the sdist


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist of a copy of the sources that also holds what a working tree has and an sdist must not:
    tests, a build record, compiled extensions. Built with an arch list set, which it must not carry."""
    tmp = tmp_path_factory.mktemp("sdist")
    src = copy_sources(tmp / "src")
    shutil.copytree(ROOT / "tests", src / "tests", ignore=BUILD_OUTPUTS)
    (src / "hicache_kernels" / "_build_meta.json").write_text('{"cuda_built": true}\n')
    (src / "hicache_kernels" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (src / "python" / "hicache" / "_core.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp / "dist")],
        capture_output=True,
        text=True,
        cwd=src,
        env=build_env({"HICACHE_CUDA_ARCHS": "90"}),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return tmp / "dist" / proc.stdout.strip().splitlines()[-1]


def test_sdist_holds_what_building_needs_and_no_tests(sdist: Path) -> None:
    assert sdist.name == f"hicache_kernels-{VERSION}.tar.gz"  # no local label: an sdist is for any arch list
    top = f"hicache_kernels-{VERSION}/"
    with tarfile.open(sdist) as tf:
        names = {m.name.removeprefix(top) for m in tf.getmembers() if m.isfile()}
    needed = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    needed |= {"setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"}
    needed |= {n if n.startswith("hicache_kernels/") else f"python/{n}" for n in source_modules()}
    assert {"csrc/copy_engine.h", "csrc/common.cuh", "csrc/transfer.cuh", "csrc/host/radix_tree.h"} <= needed
    missing = needed - names
    assert not missing, f"not in the sdist: {sorted(missing)}"
    unwanted = sorted(n for n in names if n.startswith("tests/") or n.endswith((".so", "_build_meta.json")))
    assert not unwanted, f"in the sdist but must not be: {unwanted}"


@needs_nvcc
def test_wheel_builds_from_the_sdist(sdist: Path, tmp_path: Path) -> None:
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp_path / "unpacked", filter="data")
    (src,) = (tmp_path / "unpacked").iterdir()
    wheel, _ = build_wheel(tmp_path, {"HICACHE_CUDA_ARCHS": "90", "CUDA_HOME": str(CUDA_HOME)}, src=src)
    so, meta = extract(wheel, tmp_path)
    assert so is not None and embedded(so) == ({"sm_90"}, set())
    assert version_of(wheel) == meta["version"] == f"{VERSION}+{CU}.sm90"


# ------------------------------------------------------------------------------ incremental builds


@needs_nvcc
def test_new_arch_list_recompiles_only_arch_dependent_units(sm90: SimpleNamespace, tmp_path: Path) -> None:
    """The pybind11 bindings (the slowest unit) and other host-only C++ do not depend on the arch list:
    building the same tree again for another arch leaves their objects, and the host core's, as they were."""
    (build_dir,) = (sm90.src / "build").glob("temp.*/hicache_C")
    (core_dir,) = (sm90.src / "build").glob("temp.*/hicache_core")
    before = {o.name: o.stat().st_mtime_ns for o in build_dir.glob("*.o")}
    core_before = {o.name: o.stat().st_mtime_ns for o in core_dir.glob("*.o")}
    assert {"bindings.cpp.o", "errors.cpp.o", "transfer.cu.o"} <= set(before), before
    assert set(core_before) == {"bindings.cpp.o", "radix_tree.cpp.o"}, core_before
    wheel, _ = build_wheel(tmp_path, {"HICACHE_CUDA_ARCHS": "80", "CUDA_HOME": str(CUDA_HOME)}, src=sm90.src)
    assert {o.name: o.stat().st_mtime_ns for o in core_dir.glob("*.o")} == core_before
    after = {o.name: o.stat().st_mtime_ns for o in build_dir.glob("*.o")}
    rebuilt = {name for name in before if after[name] != before[name]}
    assert not rebuilt & {"bindings.cpp.o", "errors.cpp.o"}, f"recompiled for a new arch list: {sorted(rebuilt)}"
    assert rebuilt == {"build_facts.cpp.o"} | {n for n in before if n.endswith(".cu.o")}
    so, meta = extract(wheel, tmp_path)
    assert so is not None and embedded(so) == ({"sm_80"}, set())
    assert meta["archs"] == "80" and version_of(wheel) == f"{VERSION}+{CU}.sm80"
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    proc = run_from(site, "import hicache_kernels as h; print(h.build_info()['archs'])", tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "['80']", proc.stderr
