"""benchmarks/gpu_check.sh on CPU: the dry run starts every step of both stages with CPU stand-ins, the
budget stops steps from starting, bad options are refused, and without a GPU the real run refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STAGE1 = ("build", "info", "gpu-smoke", "bench-core", "targets", "host-overhead", "bench-designs")
STAGE2 = ("gpu-tests", "sanitizer", "pcie-quick", "host-setup", "bench-quick", "serving-args", "bench-serving",
          "serving-longqa")  # fmt: skip
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the real script runs on a GPU machine")


def run_check(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=900)  # fmt: skip


def step_lines(summary: str) -> dict[str, str]:
    return {line.split()[0]: line for line in summary.splitlines() if line and line.split()[0] in STAGE1 + STAGE2}


@needs_cpu
@pytest.mark.build
def test_dry_run_starts_every_step(tmp_path):
    out = tmp_path / "out"
    proc = run_check("--dry-run", str(out), cwd=tmp_path)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.endswith(summary), "the summary is not printed last"
    lines = step_lines(summary)
    assert set(lines) == set(STAGE1 + STAGE2), summary
    assert all(" ok " in line for line in lines.values()), summary
    assert "dry run" in summary and "sm_90" in summary
    log = (out / "gpu_check.log").read_text()
    assert "--collect-only" in log and "-m gpu_smoke" in log and "--targets-core" in log
    assert json.loads((out / "info.json").read_text())["build"]["archs"] == ["90"]
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
    names = {p.name for p in out.iterdir()}
    stage1 = {"gpu_check.log", "summary.txt", "info.json", "bench_core.json", "host_overhead.json",
              "bench_designs.json"}  # fmt: skip
    assert stage1 <= names and len(names - stage1) + 2 <= 8 and len(stage1) <= 8, names


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
    assert {p.name for p in out.iterdir()} == {"gpu_check.log", "summary.txt", "pcie.json", "serving.json"}


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
