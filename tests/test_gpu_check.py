"""benchmarks/gpu_check.sh on CPU: with a stand-in python that claims an sm_90 GPU, every step runs
(GPU tests skip, bench and pcie take their no-GPU paths), and the summary and files appear."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.build


@pytest.mark.skipif(torch.cuda.is_available(), reason="the real script runs on a GPU machine")
def test_gpu_check_script_runs_every_step(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        "  *get_device_capability*) echo 90; exit 0;;\n"
        "  *get_device_name*) echo 'stand-in GPU'; exit 0;;\n"
        "esac\n"
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(fake), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=900)  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert proc.stdout.endswith(summary), "the summary is not printed last"
    for name in ("build", "info", "gpu-tests", "bench-quick", "pcie-quick"):
        assert f"{name} " in summary and "TIMEOUT" not in summary
    assert "stand-in GPU, sm_90" in summary
    lines = {line.split()[0]: line for line in summary.splitlines() if line and line.split()[0] in
             ("build", "info", "gpu-tests", "bench-quick", "pcie-quick")}  # fmt: skip
    assert all(" ok " in line for line in lines.values()), summary
    assert json.loads((out / "info.json").read_text())["build"]["archs"] == ["90"]
    assert json.loads((out / "bench.json").read_text())["mode"] == "cpu-functional-check"
    assert json.loads((out / "pcie.json").read_text())["mode"] == "no-gpu"
    assert "kernel / copy-engine ceiling" in summary  # the targets table (all n/a without points)
    assert len(list(out.iterdir())) <= 8  # what the device tool can bring back
