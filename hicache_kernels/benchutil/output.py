"""What a benchmark run writes: run metadata and provenance, JSON and CSV files, text tables, byte sizes,
progress."""

from __future__ import annotations

import csv
import datetime as _dt
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
_HERE = Path(__file__).resolve()


def _git(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)


def source_commit(source: str | Path | None = None) -> tuple[str | None, str | None]:
    """The commit of the git checkout the file ``source`` (default: this package's) belongs to, and None;
    or None and why there is none.

    The commit is ``git rev-parse --short=12 HEAD``, with ``-dirty`` when the checkout's tracked files
    differ from it (``git status --porcelain --untracked-files=no``) or ``source`` itself is a new,
    untracked file. None: not in a git checkout (installed from a wheel), ``source`` ignored by the
    checkout around it (a package installed into a virtual environment inside a checkout: its commit is
    not that checkout's), or git missing or failing."""
    path = Path(source).resolve() if source else _HERE
    folder = path.parent
    try:
        out = _git(folder, "rev-parse", "--show-toplevel")
        if out.returncode != 0:
            why = (out.stderr.strip().splitlines() or ["git rev-parse failed"])[0]
            return None, f"not in a git checkout: {folder} ({why}; installed from a wheel or an sdist?)"
        top = out.stdout.strip()
        untracked = _git(folder, "ls-files", "--error-unmatch", "--", path.name).returncode != 0
        if untracked and _git(folder, "check-ignore", "-q", "--", path.name).returncode == 0:
            return None, f"{path} is ignored by the git checkout {top}: an installed copy, not its source"
        head = _git(folder, "rev-parse", "--short=12", "HEAD")
        if head.returncode != 0:
            return None, f"git rev-parse HEAD failed in {top}: {head.stderr.strip()}"
        status = _git(folder, "status", "--porcelain", "--untracked-files=no")
        if status.returncode != 0:
            return None, f"git status failed in {top}: {status.stderr.strip()}"
    except FileNotFoundError:
        return None, "git is not installed"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"git failed: {exc}"
    return head.stdout.strip() + ("-dirty" if untracked or status.stdout.strip() else ""), None


def git_commit(source: str | Path | None = None) -> str | None:
    """The checkout's commit (12 hex digits, ``-dirty`` with uncommitted changes), None outside git
    (:func:`source_commit`, without the reason)."""
    return source_commit(source)[0]


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def meminfo_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` field (``MemTotal``, ``Cached``, ...) in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_bytes() -> int | None:
    found = meminfo_bytes("MemTotal")
    if found is not None:
        return found
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def machine_facts() -> dict[str, Any]:
    """What the machine is, for a result's ``machine``: CPU model, logical CPUs (and those this process
    may run on), RAM, the current GPU's name (None without one) and how many, OS, Python and torch. The
    host name is recorded too but says nothing about the hardware."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "host": platform.node(),
        "arch": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "gpu": torch.cuda.get_device_name(torch.cuda.current_device()) if gpus else None,
        "gpus": gpus,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _module_file(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def provenance(module: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where a result came from, the same top-level keys in every benchmark's JSON: ``command`` (``python -m
    MODULE ARGS``, the arguments as given: ``argv``, else this process's), ``commit`` (:func:`source_commit`
    of the module's source; None with ``commit_unavailable`` saying why) and ``machine``
    (:func:`machine_facts`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    commit, why = source_commit(_module_file(module))
    out: dict[str, Any] = {"command": shlex.join(["python", "-m", module, *args]), "commit": commit}
    if commit is None:
        out["commit_unavailable"] = why
    out["machine"] = machine_facts()
    return out


def run_meta(tool: str, args: dict[str, Any]) -> dict[str, Any]:
    """Tags for every point of a run: GPU, driver, CUDA, versions, package, commit, time, arguments."""
    from .. import __version__
    from .._env import cuda_versions

    meta: dict[str, Any] = {
        "tool": tool,
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "package_version": __version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "host": platform.node(),
        "args": args,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    cv = cuda_versions()
    meta["driver"] = cv.get("driver")
    meta["driver_cuda"] = cv.get("driver_cuda")
    meta["extension_cuda"] = cv.get("extension_runtime")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        meta["gpu"] = p.name
        meta["gpu_cc"] = f"{p.major}.{p.minor}"
        meta["gpu_sms"] = p.multi_processor_count
    else:
        meta["gpu"] = None
    return meta


def write_json(path: str | Path, meta: dict[str, Any], points: list[dict[str, Any]], **extra: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "points": points, **extra}, indent=2, default=str) + "\n")


def write_csv(path: str | Path, meta: dict[str, Any], points: list[dict[str, Any]]) -> None:
    """One row per point; every row also carries the scalar run tags (gpu, driver, commit, ...)."""
    tags = {f"meta_{k}": v for k, v in meta.items() if not isinstance(v, (dict, list))}
    keys: list[str] = []
    for p in points:
        keys.extend(k for k in p if k not in keys)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + list(tags))
        w.writeheader()
        for p in points:
            w.writerow({**{k: p.get(k) for k in keys}, **tags})


def write_outputs(
    json_path: str | Path | None,
    csv_path: str | Path | None,
    meta: dict[str, Any],
    points: list[dict[str, Any]],
    **extra: Any,
) -> list[str]:
    """The run as JSON (``extra`` as top-level keys) and as CSV, each when its path is given; returns a
    ``wrote PATH`` line per file written."""
    written = []
    if json_path:
        write_json(json_path, meta, points, **extra)
        written.append(f"wrote {json_path}")
    if csv_path:
        write_csv(csv_path, meta, points)
        written.append(f"wrote {csv_path}")
    return written


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain text table: ``columns`` are (key, header) pairs; floats shown with 3 significant figures."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    body = [[cell(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, (_, h) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (_, h), w in zip(columns, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def format_bytes(n: int, decimals: int | None = None) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1: ``8 B``, ``4 KiB``, ``1.5 MiB``, ``1 GiB``
    (3 significant figures, no decimals for a whole number); with ``decimals``, always that many
    (``1.0 GiB``)."""
    if n < 1024:
        return f"{n} B"
    value, exp = float(n), 0
    while value >= 1024 and exp < len(_BINARY_UNITS):
        value, exp = value / 1024, exp + 1
    unit = _BINARY_UNITS[exp - 1]
    if decimals is not None:
        return f"{value:.{decimals}f} {unit}"
    return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, unless ``force``)."""

    def __init__(self, total: int, label: str, force: bool = False) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.label = label
        self.enabled = force or sys.stderr.isatty()

    def step(self, note: str = "") -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = int(width * self.done / self.total)
            sys.stderr.write(
                f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {note:<40}"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
