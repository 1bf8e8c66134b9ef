"""scripts/fetch_client_tests.py --check: says which of the clients' tests (benchmarks/client_tests.json)
are in a folder, with each present file's SHA-256 and each missing file's source, and exits 1 while
any is missing. Downloads are not tried here (CI has no route to GitHub)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "fetch_client_tests.py"
MANIFEST = json.loads((ROOT / "benchmarks" / "client_tests.json").read_text())


def check(folder: Path) -> tuple[int, str]:
    cmd = [sys.executable, str(SCRIPT), "--check", "--dir", str(folder)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def test_missing_files_are_named_with_their_source(tmp_path):
    rc, out = check(tmp_path)
    assert rc == 1
    for entry in MANIFEST["files"]:
        assert f"{entry['name']}: MISSING" in out
    assert "raw.githubusercontent.com/sgl-project/sglang/" in out and "read_file id 70623478958" in out


def test_present_files_are_reported_with_their_sha256(tmp_path):
    digests = {}
    for i, entry in enumerate(MANIFEST["files"]):
        data = f"# stand-in {i}\n".encode()
        (tmp_path / entry["name"]).write_bytes(data)
        digests[entry["name"]] = hashlib.sha256(data).hexdigest()
    rc, out = check(tmp_path)
    assert rc == 0, out
    for name, digest in digests.items():
        assert f"{name}: present, sha256 {digest}" in out
