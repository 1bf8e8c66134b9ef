"""Shared benchmark plumbing: timing with CUDA events, statistics, run metadata, output writers.

Every figure the CLIs print comes from :func:`measure`: warm-up calls, then ``repeats`` timed calls,
each timed by a :class:`Timer` (CUDA events on the GPU; a fake in the unit tests), reported as the
median and quantiles. Nothing is extrapolated.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch


class Timer(Protocol):
    """Times one call of ``fn`` in milliseconds (``prepare`` runs first, untimed).

    A timer that times a CUDA stream also has ``stream_context()``: a context manager making that
    stream current. :func:`measure` runs every call (prepare, warm-up, timed) inside it, so the work
    always lands on the stream whose events time it. A timer with no stream (the CPU fakes of the unit
    tests) has nothing to enter and need not define it.
    """

    def time_ms(self, fn: Callable[[], Any]) -> float: ...


class CudaEventTimer:
    """CUDA events around ``fn`` on ``stream`` (default: the current stream); waits for the end event.

    ``fn`` runs with ``stream`` made current, so anything it issues on the current stream is what the
    events time: a point cannot be timed on one stream while its work runs on another unless ``fn``
    names another stream itself (which the bench's points never do).
    """

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream
        # Reused across calls (each call waits for its end event first): creating an event is a host
        # call that would otherwise sit between fn's work and the end record.
        self._events: tuple[Any, Any] | None = None

    def stream_context(self) -> AbstractContextManager[Any]:
        """``stream`` made current for the block (nothing to do when timing the current stream)."""
        return nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def time_ms(self, fn: Callable[[], Any]) -> float:
        # Entered before the start record and left after the end record: switching streams costs host
        # time, which must not fall between the two events.
        with self.stream_context():
            stream = torch.cuda.current_stream()
            if self._events is None:
                self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                self._events[1].record(stream)  # torch creates an event at its first record: do it here
            start, end = self._events
            start.record(stream)
            fn()
            end.record(stream)
        end.synchronize()
        return start.elapsed_time(end)


def issuing(timer: Timer) -> AbstractContextManager[Any]:
    """The context every call measured by ``timer`` runs in: its stream made current (see :class:`Timer`)."""
    context = getattr(timer, "stream_context", None)
    return nullcontext() if context is None else context()


@dataclass(frozen=True)
class Stats:
    """Milliseconds over the timed repeats."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    repeats: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "median_ms": self.median_ms,
            "p10_ms": self.p10_ms,
            "p90_ms": self.p90_ms,
            "min_ms": self.min_ms,
            "max_ms": self.max_ms,
            "repeats": self.repeats,
        }


def summarize(times_ms: Sequence[float]) -> Stats:
    """Median, 10th/90th percentiles (inclusive method), min and max of ``times_ms``."""
    if not times_ms:
        raise ValueError("times_ms: expected at least one measurement")
    xs = sorted(float(t) for t in times_ms)
    if len(xs) == 1:
        p10 = p90 = xs[0]
    else:
        q = statistics.quantiles(xs, n=10, method="inclusive")
        p10, p90 = q[0], q[-1]
    return Stats(statistics.median(xs), p10, p90, xs[0], xs[-1], len(xs))


def measure(
    fn: Callable[[], Any],
    *,
    timer: Timer,
    repeats: int,
    warmup: int = 2,
    prepare: Callable[[], Any] | None = None,
) -> Stats:
    """Run ``prepare`` (untimed) and ``fn`` ``warmup`` times, then ``repeats`` timed times, all on the
    timer's stream (:func:`issuing`): a warm-up or a prepared index copy on another stream would be
    unordered with the timed work (PyTorch's side streams do not wait for the legacy default stream)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats/warmup: expected repeats >= 1 and warmup >= 0, got {repeats}/{warmup}")
    times = []
    with issuing(timer):
        for _ in range(warmup):
            if prepare:
                prepare()
            fn()
        for _ in range(repeats):
            if prepare:
                prepare()
            times.append(timer.time_ms(fn))
    return summarize(times)


def gbps(nbytes: int, ms: float) -> float:
    """Decimal GB/s (1e9 bytes per second)."""
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("inf")


def git_commit(root: Path | None = None) -> str | None:
    root = root or Path(__file__).resolve().parents[1]
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
    from . import __version__
    from ._env import cuda_versions

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
