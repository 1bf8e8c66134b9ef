"""The examples run as written: each in a subprocess, as a user would start it (on CPU, and on the
GPU when there is one); and the quickstart's own check really fails on wrong KV."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachedata import wrap_copies

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "hicache_quickstart.py"
HANG_S = 600  # a hang detector for the subprocess, not a speed limit


def run_quickstart(*args: str, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(QUICKSTART), *args],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def check_output(out: str, io_backend: str) -> None:
    assert f"io-backend: {io_backend}" in out
    for line in (
        "first request: device hit 0, host hit 0 of 256",
        "evicted 256 device slots",
        "second request: device hit 0, host hit 256",
        "after load-back: device hit 256, host hit 0",
        "tokens_written: 256",
        "tokens_loaded: 256",
        "load_backs: 1",
        "OK: the KV loaded back is what was written",
    ):
        assert line in out, (line, out)


@pytest.mark.parametrize("io_backend", ["direct", "triton"])
def test_quickstart_runs_on_cpu(io_backend):
    result = run_quickstart("--device", "cpu", "--io-backend", io_backend, TRITON_INTERPRET="1")
    check_output(result.stdout, io_backend)
    assert "cpu" in result.stdout and "pageable" in result.stdout


@pytest.mark.gpu
@pytest.mark.gpu_smoke
def test_quickstart_runs_on_the_gpu():
    result = run_quickstart()  # as written: picks cuda, a pinned host pool and the kernel backend
    check_output(result.stdout, "kernel")
    assert "cuda" in result.stdout and "pinned" in result.stdout


def test_quickstart_exits_nonzero_when_the_loaded_kv_differs(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("hicache_quickstart", QUICKSTART)
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)

    def corrupting(issue, call):
        issue()
        if call.layer_id == 2:
            call.binding.device_k[2, call.device_indices[:3]] += 1  # three tokens of layer 2's K land wrong

    wrap_copies(monkeypatch, "load_layer", corrupting)
    assert quickstart.main(["--device", "cpu", "--io-backend", "direct"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "layer 2 K: 3 of 256 tokens differ" in out and "OK:" not in out


def readme_block(heading: str) -> str:
    """The first ```python block after ``heading`` in README.md."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n", text.index(heading)) + len("```python\n")
    return text[start : text.index("```\n", start)]


def test_readme_cache_example_runs_as_written(tmp_path):
    script = tmp_path / "readme_cache_example.py"
    script.write_text(readme_block("## Cache layer"))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S,
                            cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "'load_backs': 1" in result.stdout and "'tokens_loaded': 256" in result.stdout, result.stdout
