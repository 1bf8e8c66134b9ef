"""Time what a new user waits for: a clean build, a rebuild for another arch, the test suite.

``python scripts/measure_build_and_tests.py --json PATH [--skip-tests]`` clones HEAD into a temporary
folder and, there:

1. builds a wheel for sm_90 from scratch (``pip wheel --no-deps --no-build-isolation``, the CUDA
   extension and the host core), timed;
2. builds it again for sm_80 in the same folder (the ``build/`` folder kept: only the arch-list
   translation unit and the kernels recompile), timed;

then, in this checkout, runs ``python -m pytest -q -n auto`` (the whole suite) and ``python -m pytest -q
-n auto -m "not slow and not build"`` (the quick selection), timed, with their pass/skip counts. Each
figure is the wall time of one run on this machine; a busy machine makes them longer. The JSON records
the command, the commit and the machine (as every benchmark's JSON: ``hicache_kernels.benchutil``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0,):
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout + proc.stderr


def _counts(output: str) -> dict[str, int]:
    last = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    pairs = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", last[-1] if last else "")
    return {k: int(v) for v, k in pairs}


def _provenance(argv: list[str]) -> dict[str, object]:
    """The benchmarks' record of where a result came from (hicache_kernels.benchutil)."""
    from hicache_kernels.benchutil.output import machine_facts, source_commit

    commit, why = source_commit(Path(__file__))
    out: dict[str, object] = {"command": shlex.join(["python", "scripts/measure_build_and_tests.py", *argv])}
    out["commit"] = commit
    if commit is None:
        out["commit_unavailable"] = why
    out["machine"] = machine_facts()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where the result goes")
    p.add_argument("--skip-tests", action="store_true", help="time the builds only")
    args = p.parse_args(argv)
    env = dict(os.environ, CUDA_HOME=os.environ.get("CUDA_HOME", "/usr/local/cuda"), MAX_JOBS=str(os.cpu_count() or 2))
    record: dict[str, object] = {
        **_provenance(sys.argv[1:] if argv is None else list(argv)),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(src)], check=True)
        wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", "."]
        clean, _ = _timed(wheel, src, dict(env, HICACHE_CUDA_ARCHS="90"))
        again, _ = _timed(wheel, src, dict(env, HICACHE_CUDA_ARCHS="80"))
        record["builds"] = {
            "clean_sm90_s": round(clean, 1),
            "rebuild_sm80_s": round(again, 1),
            "command": "HICACHE_CUDA_ARCHS=90 (then 80) " + " ".join(wheel[2:]).replace("-m pip", "pip"),
            "cpus": os.cpu_count(),
        }
        shutil.rmtree(src / "dist", ignore_errors=True)
    if not args.skip_tests:
        suites = {}
        for name, extra in (("full", []), ("quick", ["-m", "not slow and not build"])):
            cmd = [sys.executable, "-m", "pytest", "-q", "-n", "auto", "-p", "no:cacheprovider", *extra]
            seconds, out = _timed(cmd, ROOT, env)
            suites[name] = {"command": shlex.join(["python", *cmd[1:]]), "wall_s": round(seconds, 1), **_counts(out)}
        record["tests"] = suites
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
