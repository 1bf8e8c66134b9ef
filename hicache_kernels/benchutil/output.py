"""What a benchmark run writes: run metadata, JSON and CSV files, text tables, byte sizes, progress."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def git_commit(root: Path | None = None) -> str | None:
    """The checkout's commit (12 hex digits, ``-dirty`` with uncommitted changes), None outside git."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


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
