"""What every benchmark's result JSON records of its run (``hicache_kernels.benchutil.provenance``): the
command as given, the commit of the source it ran from, and the machine. Each benchmark's test calls
:func:`check_provenance` on the JSON it wrote."""

from __future__ import annotations

import importlib.util
import os
import platform
import shlex
import subprocess
from pathlib import Path
from typing import Any

import torch


def _git(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True)


def check_provenance(data: dict[str, Any], module: str, argv: list[str]) -> None:
    """``data`` (a result JSON) ran ``python -m module argv`` from this source tree, on this machine."""
    assert shlex.split(data["command"]) == ["python", "-m", module, *argv], data["command"]
    # The commit: this checkout's HEAD (the short hash git prints, 12 digits), marked when tracked files
    # differ; where the source is not in a git checkout (mutation_check's copy), None and why.
    folder = Path(importlib.util.find_spec(module).origin).parent
    head = _git(folder, "rev-parse", "--short=12", "HEAD")
    if head.returncode != 0:
        assert data["commit"] is None and "not in a git checkout" in data["commit_unavailable"], data["commit"]
    else:
        commit = data["commit"]
        assert isinstance(commit, str) and "commit_unavailable" not in data, data.get("commit_unavailable")
        assert commit.removesuffix("-dirty") == head.stdout.strip()
        assert commit.startswith(_git(folder, "rev-parse", "--short", "HEAD").stdout.strip())
        dirty = bool(_git(folder, "status", "--porcelain", "--untracked-files=no").stdout.strip())
        assert commit.endswith("-dirty") == dirty, (commit, dirty)
    m = data["machine"]
    assert m["cpus"] == os.cpu_count() and 1 <= m["cpus_usable"] <= m["cpus"]
    assert m["memory_bytes"] > 0 and m["arch"] == platform.machine() and m["cpu_model"]
    assert m["python"] == platform.python_version() and m["torch"] == torch.__version__
    assert (m["gpu"] is None) == (m["gpus"] == 0) == (not torch.cuda.is_available())
