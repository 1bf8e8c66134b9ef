"""benchutil.provenance, the command / commit / machine every benchmark's result JSON records: the commit
of the checkout a source file belongs to, marked dirty, or None and why (each benchmark's test checks its
own JSON with tests/provenancecheck.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hicache_kernels import benchutil

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A checkout with one committed module, and an ignored venv folder holding an installed copy of it."""
    r = tmp_path / "repo"
    (r / "pkg").mkdir(parents=True)
    (r / "pkg" / "mod.py").write_text("x = 1\n")
    (r / ".gitignore").write_text("venv/\n")
    git(r, "init", "-q")
    git(r, "add", ".")
    git(r, "commit", "-q", "-m", "one")
    (r / "venv" / "pkg").mkdir(parents=True)
    (r / "venv" / "pkg" / "mod.py").write_text("x = 1\n")
    return r


def test_commit_of_a_clean_then_changed_checkout(repo: Path) -> None:
    head = git(repo, "rev-parse", "--short=12", "HEAD")
    assert benchutil.source_commit(repo / "pkg" / "mod.py") == (head, None)
    (repo / "pkg" / "mod.py").write_text("x = 2\n")
    assert benchutil.source_commit(repo / "pkg" / "mod.py") == (f"{head}-dirty", None)
    git(repo, "checkout", "-q", "--", "pkg/mod.py")
    (repo / "pkg" / "new.py").write_text("y = 1\n")  # a new module, not yet added: not HEAD's code either
    assert benchutil.source_commit(repo / "pkg" / "new.py") == (f"{head}-dirty", None)
    assert benchutil.source_commit(repo / "pkg" / "mod.py") == (head, None)  # other untracked files: clean


def test_no_commit_outside_a_checkout_or_for_an_installed_copy(repo: Path, tmp_path: Path) -> None:
    wheel = tmp_path / "site-packages" / "pkg"
    wheel.mkdir(parents=True)
    (wheel / "mod.py").write_text("x = 1\n")
    commit, why = benchutil.source_commit(wheel / "mod.py")
    assert commit is None and why.startswith(f"not in a git checkout: {wheel}")
    # Installed into a virtual environment inside a checkout: that checkout's commit is not its source's.
    commit, why = benchutil.source_commit(repo / "venv" / "pkg" / "mod.py")
    assert commit is None and "is ignored by the git checkout" in why and "installed copy" in why


def test_provenance_says_why_there_is_no_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchutil.output, "source_commit", lambda source=None: (None, "not in a git checkout: x"))
    out = benchutil.provenance("hicache_kernels.bench", ["--quick", "--json", "a b.json"])
    assert out["command"] == "python -m hicache_kernels.bench --quick --json 'a b.json'"
    assert out["commit"] is None and out["commit_unavailable"] == "not in a git checkout: x"
    assert list(out) == ["command", "commit", "commit_unavailable", "machine"]


def test_machine_facts() -> None:
    m = benchutil.machine_facts()
    assert m["cpus"] == os.cpu_count() and m["memory_bytes"] > 2**20 and m["cpu_model"]
    assert m["torch"] == torch.__version__ and (m["gpu"] is None) == (not torch.cuda.is_available())
