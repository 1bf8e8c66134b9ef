"""benchmarks/gpu_check.sh on CPU: the dry run starts every step of both stages with CPU stand-ins and
changes nothing outside its output folder, the budget stops steps from starting, bad options are refused,
and without a GPU the real run refuses."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hicache_kernels

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STAGE1 = ("build", "info", "gpu-smoke", "bench-core", "targets", "host-overhead", "bench-designs")
STAGE2 = ("gpu-tests", "sanitizer", "pcie-quick", "host-setup", "bench-quick", "serving-args", "bench-serving",
          "serving-longqa")  # fmt: skip
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the real script runs on a GPU machine")


def run_check(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           **(env or {})}  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=900)  # fmt: skip


def step_lines(summary: str) -> dict[str, str]:
    return {line.split()[0]: line for line in summary.splitlines() if line and line.split()[0] in STAGE1 + STAGE2}


# Folders other tests write while this module runs beside them under pytest-xdist: left out of the
# comparison there (run alone, the dry run is held to them too).
SHARED_CACHES = (".hypothesis", ".pytest_cache", ".ruff_cache") if os.environ.get("PYTEST_XDIST_WORKER") else ()


def outside_state() -> dict[str, object]:
    """What a dry run must leave as it is: the tree's files (each one's mtime, size, inode; not .git,
    virtual environments or __pycache__), ``git status --porcelain --ignored``, the installed package's
    files in site-packages (its dist-info, the editable install's .pth and finder) and ``pip freeze``."""
    skip = {".git", "__pycache__", *SHARED_CACHES}
    tree = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".venv")]  # .venv*: checked below
        for name in files:
            path = Path(folder, name)
            st = path.lstat()
            tree[str(path.relative_to(ROOT))] = (st.st_mtime_ns, st.st_size, st.st_ino)
    status = subprocess.run(["git", "status", "--porcelain", "--ignored"], capture_output=True, text=True, cwd=ROOT)
    status_lines = [
        line
        for line in status.stdout.splitlines()
        if "__pycache__" not in line and line[3:].rstrip("/") not in SHARED_CACHES
    ]
    try:
        dist = metadata.distribution("hicache-kernels")
        installed = {}
        files = [str(f) for f in dist.files or []]
        for f in [*files, *{Path(f).parts[0] for f in files} - {".."}]:  # and the top-level folders
            path = Path(dist.locate_file(f))
            st = path.lstat() if path.exists() else None
            installed[str(f)] = st and (st.st_mtime_ns, st.st_size, st.st_ino)
    except metadata.PackageNotFoundError:
        installed = None
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True)
    return {"tree": tree, "git status": status_lines, "installed": installed,
            "pip freeze": (freeze.returncode, freeze.stdout)}  # fmt: skip


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The whole dry run, once for this module's tests that read it: HOME, the XDG folders and TMPDIR
    point at empty folders outside its output folder, and what it must not change is recorded before and
    after."""
    tmp = tmp_path_factory.mktemp("gpu_check_dry_run")
    outside = {name: tmp / "outside" / name for name in ("home", "config", "cache", "data", "tmp")}
    for folder in outside.values():
        folder.mkdir(parents=True)
    env = {"HOME": str(outside["home"]), "XDG_CONFIG_HOME": str(outside["config"]),
           "XDG_CACHE_HOME": str(outside["cache"]), "XDG_DATA_HOME": str(outside["data"]),
           "TMPDIR": str(outside["tmp"]), "PYTHONUSERBASE": site.getuserbase()}  # fmt: skip
    # pip runs `rustc --version` for its user agent; with rustup's proxies on PATH and an empty HOME, the
    # proxy would write its settings there: rustup keeps its own folders
    for var, default in (("RUSTUP_HOME", ".rustup"), ("CARGO_HOME", ".cargo")):
        if var not in os.environ and (Path.home() / default).is_dir():
            env[var] = str(Path.home() / default)
    before = outside_state()
    out = tmp / "out"
    proc = run_check("--dry-run", str(out), cwd=tmp, env=env)
    after = outside_state()
    return SimpleNamespace(proc=proc, out=out, outside=outside, before=before, after=after)


@needs_cpu
@pytest.mark.build
def test_dry_run_starts_every_step(dry_run):
    out, proc = dry_run.out, dry_run.proc
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.endswith(summary), "the summary is not printed last"
    lines = step_lines(summary)
    assert set(lines) == set(STAGE1 + STAGE2), summary
    assert all(" ok " in line for line in lines.values()), summary
    assert "dry run" in summary and "sm_90" in summary
    log = (out / "gpu_check.log").read_text()
    assert "--collect-only" in log and "-m gpu_smoke" in log and "--targets-core" in log
    # The build step checked the real command (pip --dry-run) and compiled into OUT_DIR/dry-run, for sm_90
    # (or said loudly that this machine has no toolkit), installing nothing: info describes the package
    # installed before the run.
    assert "pip install --dry-run --disable-pip-version-check --no-build-isolation --no-deps -e ." in log
    assert "Would install hicache-kernels-" in log
    assert "for archs 90 (from HICACHE_CUDA_ARCHS)" in log or "WARNING: hicache_kernels._C was NOT compiled" in log
    assert "dry run: build checked: pip accepted the command and the compile passed; nothing was installed" in log
    assert "installs nothing and writes nothing outside" in summary
    assert not (out / "dry-run" / "build").exists()
    assert json.loads((out / "info.json").read_text())["build"] == hicache_kernels.build_info()
    assert json.loads((out / "bench_core.json").read_text())["mode"] == "cpu-functional-check"
    assert json.loads((out / "pcie.json").read_text())["mode"] == "no-gpu"
    assert json.loads((out / "host_setup.json").read_text())["bench"] == "hicache.bench.host_setup"
    assert "kernel / copy-engine ceiling" in summary  # the targets table (all n/a without points)
    # The GPU serving runs' own arguments were parsed (the CLI stops at the missing GPU: once for the
    # multi-turn run, once for long-context QA), and the CPU stand-ins' serving targets are read back
    # (n/a off a GPU).
    assert "--ffn 14336" in log and "--workload longqa --docs 12 --doc-len 8192" in log
    assert log.count("hicache.bench.serving: --device cuda: no CUDA device is visible") == 2
    assert "Serving target read from serving.json:" in summary and summary.rstrip().endswith("n/a")
    longqa = json.loads((out / "serving_longqa.json").read_text())
    assert longqa["workload"] == "longqa" and longqa["documents_kv_tokens"] >= 4 * longqa["device_slots"]
    assert "Serving target read from serving_longqa.json:" in summary
    # What one call of the device tool brings back (8 files at most): each stage alone stays within it
    # (a stage-2 call writes only its own files beside the log and the summary).
    names = {p.name for p in out.iterdir()} - {"dry-run"}  # the dry run's own folder
    stage1 = {"gpu_check.log", "summary.txt", "info.json", "bench_core.json", "host_overhead.json",
              "bench_designs.json"}  # fmt: skip
    assert stage1 <= names and len(names - stage1) + 2 <= 8 and len(stage1) <= 8, names


@needs_cpu
@pytest.mark.build
def test_dry_run_changes_nothing_outside_its_output_folder(dry_run):
    """The whole dry run leaves the tree, the installed package and the Python environment as they were
    (its build step installs nothing and builds into OUT_DIR/dry-run), and writes nothing into HOME, the
    XDG folders or TMPDIR: its temp files and caches go to OUT_DIR/dry-run."""
    assert dry_run.proc.returncode == 0, dry_run.proc.stdout + dry_run.proc.stderr
    before, after = dry_run.before["installed"], dry_run.after["installed"]
    assert (before is None) == (after is None), "the dry run installed or removed hicache-kernels"
    changed = sorted(f for f in (before or {}).keys() | (after or {}).keys() if before.get(f) != after.get(f))
    assert not changed, f"the dry run changed the installed package's files: {changed[:20]}"
    assert dry_run.after["pip freeze"] == dry_run.before["pip freeze"], "pip freeze"
    before, after = dry_run.before["tree"], dry_run.after["tree"]
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, f"the dry run changed files in the tree: {changed[:20]}"
    status_before, status_after = set(dry_run.before["git status"]), set(dry_run.after["git status"])
    assert status_after == status_before, (
        f"git status: new {status_after - status_before}, gone {status_before - status_after}"
    )
    for name, folder in dry_run.outside.items():
        assert not any(folder.iterdir()), f"the dry run wrote into {name}: {sorted(folder.rglob('*'))[:20]}"
    assert (dry_run.out / "dry-run" / "tmp").is_dir()


@needs_cpu
def test_budget_spent_means_steps_are_not_started(tmp_path):
    out = tmp_path / "out"
    proc = run_check("--dry-run", "--stage", "2", "--budget", "0", str(out), cwd=tmp_path)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = step_lines(summary)
    assert set(lines) == set(STAGE2), summary  # stage 2 only
    assert all("NOT RUN (budget spent)" in line for line in lines.values()), summary


@needs_cpu
@pytest.mark.build
def test_a_failing_step_fails_the_run_and_later_steps_still_run(tmp_path):
    # The dry run of stage 1 with a pytest that cannot collect (an unknown marker selects nothing: exit 5).
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *gpu_smoke*) exit 5;; esac\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(fake)}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--stage", "1", str(out)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=900)  # fmt: skip
    lines = step_lines((out / "summary.txt").read_text())
    assert proc.returncode == 1
    assert "FAILED(5)" in lines["gpu-smoke"]
    assert " ok " in lines["bench-core"]  # the steps after a failure still run


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stage", "3", "x"], "--stage must be 1, 2 or all"),
        (["--budget", "ten", "x"], "--budget must be whole seconds"),
        (["--fast", "x"], "unknown option --fast"),
        (["--only", "bench-servin", "x"], "--only: no step named bench-servin"),
        ([], "usage:"),
    ],
)
def test_bad_options_are_refused(tmp_path, args, message):
    proc = run_check(*args, cwd=tmp_path)
    assert proc.returncode == 2 or (not args and proc.returncode != 0)
    assert message in proc.stderr


@needs_cpu
def test_only_runs_the_named_steps(tmp_path):
    """--only: the named steps run, every other is listed as skipped; stage 2 on a machine whose
    extension is built does not build again."""
    out = tmp_path / "out"
    proc = run_check("--dry-run", "--stage", "2", "--only", "pcie-quick,bench-serving", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = step_lines((out / "summary.txt").read_text())
    assert set(lines) == set(STAGE2)
    for name, line in lines.items():
        assert (" ok " in line) == (name in ("pcie-quick", "bench-serving")), line
        assert ("SKIPPED (--only)" in line) == (name not in ("pcie-quick", "bench-serving")), line
    assert {p.name for p in out.iterdir()} == {"gpu_check.log", "summary.txt", "pcie.json", "serving.json", "dry-run"}


@needs_cpu
def test_without_a_gpu_the_real_run_refuses(tmp_path):
    proc = run_check(str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 1
    assert "no CUDA GPU visible" in proc.stdout


@needs_cpu
def test_dry_run_collects_the_client_tests_over_the_plugin(tmp_path, monkeypatch):
    """Stage 2's client-tests step: the upstream files in HICACHE_CLIENT_TESTS (here one written the way
    sgl-kernel's are) collect through hicache_kernels.compat.pytest_plugin, their SHA-256 logged; with
    none there the step is listed as skipped, not failed."""
    tests = tmp_path / "client-tests"
    tests.mkdir()
    (tests / "test_upstream_style.py").write_text(
        "import pytest\nfrom sgl_kernel.kvcacheio import transfer_kv_per_layer\nfrom sglang.srt.utils import is_hip\n"
        "pytestmark = pytest.mark.skipif(True, reason='test_kvcacheio segfaults on CUDA 13.x (sgl-kernel bug)')\n"
        "def test_one():\n    assert callable(transfer_kv_per_layer) and not is_hip()\n"
    )
    out = tmp_path / "out"
    monkeypatch.setenv("HICACHE_CLIENT_TESTS", str(tests))
    proc = run_check("--dry-run", "--stage", "2", "--only", "client-tests", str(out), cwd=tmp_path)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert any(line.startswith("client-tests") and " ok " in line for line in summary.splitlines()), summary
    log = (out / "gpu_check.log").read_text()
    assert "1 test collected" in log and "removed 1 CUDA 13 skip mark(s)" in log, log[-3000:]
    empty = tmp_path / "none"
    empty.mkdir()
    monkeypatch.setenv("HICACHE_CLIENT_TESTS", str(empty))
    proc = run_check("--dry-run", "--stage", "2", "--only", "client-tests", str(tmp_path / "out2"), cwd=tmp_path)
    assert proc.returncode == 0
    assert f"client-tests     SKIPPED (none in {empty})" in (tmp_path / "out2" / "summary.txt").read_text()
