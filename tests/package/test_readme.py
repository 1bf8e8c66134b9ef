"""The README's engine example runs as written, from a clean subprocess, and shows the host hit it
promises (a conversation evicted to the host comes back without recomputing)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_engine_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    code = [b for b in blocks if "from hicache.serving.engine import" in b]
    assert len(code) == 1, "the README's engine example is missing"
    script = tmp_path / "example.py"
    script.write_text(code[0])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    # 100 prompt tokens + 7 fed-back answer tokens = 107, of which 26 whole pages (104) were cached.
    assert proc.stdout.strip() == "turn 2 device hit 0 host hit 104 computed 7"
