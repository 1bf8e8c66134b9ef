"""The timing harness: timers (CUDA events, host wall clock), warm-up then timed calls, statistics."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Timer(Protocol):
    """Times one call of ``fn`` in milliseconds (``prepare`` runs first, untimed).

    A timer that times a CUDA stream also has ``stream_context()``: a context manager making that
    stream current. :func:`measure` runs every call (prepare, warm-up, timed) inside it, so the work
    always lands on the stream whose events time it. A timer with no stream (the CPU fakes of the unit
    tests, :class:`HostTimer`) has nothing to enter and need not define it.
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


class HostTimer:
    """The host's wall time of one call of ``fn`` (``time.perf_counter_ns``), in milliseconds: what the
    calling thread spends issuing it, not what a device does afterwards (nothing is synchronised)."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock

    def time_ms(self, fn: Callable[[], Any]) -> float:
        clock = self.clock
        t0 = clock()
        fn()
        return (clock() - t0) * 1e-6


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
