"""Measuring one pcie point: its workload, timing, verification, and the record it becomes; the sweep loop."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import benchutil
from .nvml import NvmlPcieSampler
from .planning import PointSpec, Sweep


@dataclass
class Workload:
    """What one point runs.

    ``fn`` issues the copy on the timed stream (asynchronously; the timer waits for it).
    ``direction_ms`` (bidir only) returns each direction's time of every call so far, in ms.
    ``verify`` clears the destination, copies once, waits, and returns None or what differed.
    ``info`` is merged into the point (e.g. the kernel's ``chunk_bytes``).
    """

    fn: Callable[[], Any]
    direction_ms: Callable[[], dict[str, list[float]]] | None = None
    verify: Callable[[], str | None] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _identity(spec: PointSpec) -> dict[str, Any]:
    """The fields that say which point a record is: what moved, how, and how many bytes (each way, and in all)."""
    return {
        "kind": spec.kind,
        "method": spec.method,
        "memory": spec.memory,
        "direction": spec.direction,
        "bytes": spec.nbytes,
        "total_bytes": spec.nbytes * (2 if spec.direction == "bidir" else 1),
        "sm_budget": spec.sm_budget,
    }


def _link_fields(gbps: float | None, direction: str, theoretical_gbps: float | None) -> dict[str, Any]:
    pct = None
    if gbps is not None and theoretical_gbps:
        pct = 100.0 * gbps / (theoretical_gbps * (2 if direction == "bidir" else 1))
    return {"theoretical_gbps": theoretical_gbps, "link_pct": pct}


def measure_point(
    spec: PointSpec,
    workload: Workload,
    *,
    timer: benchutil.Timer,
    repeats: int,
    warmup: int,
    sampler: NvmlPcieSampler | None = None,
    theoretical_gbps: float | None = None,
) -> dict[str, Any]:
    """Time one point and return it as a JSON-ready dict.

    Parameters
    ----------
    spec
        The point.
    workload
        Its copy (see :class:`Workload`).
    timer
        ``time_ms(fn)`` per call: :class:`~hicache_kernels.benchutil.CudaEventTimer` on a GPU.
    repeats, warmup
        Timed and untimed calls (:func:`~hicache_kernels.benchutil.measure`).
    sampler
        NVML PCIe counters sampled while the point runs (None: the nvml fields are None).
    theoretical_gbps
        The link's one-direction bandwidth, when known (for ``link_pct``).

    Returns
    -------
    dict
        ``kind``, ``method``, ``memory``, ``direction``, ``bytes`` (each way), ``total_bytes`` (``2 *
        bytes`` for bidir), ``sm_budget`` (None for copy engines), ``median_ms``/``p10_ms``/``p90_ms``/
        ``min_ms``/``max_ms``/``repeats`` (benchutil.Stats), ``gbps`` (``total_bytes`` over the median;
        None for latency points), ``latency_us``/``latency_p10_us``/``latency_p90_us`` (None for
        bandwidth points), ``h2d_gbps``/``d2h_gbps``/``h2d_median_ms``/``d2h_median_ms`` (each direction
        of a bidir point, timed on its own stream; else None), ``theoretical_gbps`` and ``link_pct``
        (``gbps`` as a percentage of the link, twice the link for bidir), ``nvml_tx_gbps_max``/
        ``nvml_rx_gbps_max``/``nvml_*_mean``/``nvml_samples`` (:meth:`NvmlPcieSampler.end`),
        ``workload.info`` (kernel: ``chunk_bytes``, ``warps_per_block``), ``verified`` (None when not
        checked) and ``error`` (None, or what the check found).
    """
    t0 = sampler.begin() if sampler is not None else 0.0
    stats = benchutil.measure(workload.fn, timer=timer, repeats=repeats, warmup=warmup)
    nv = sampler.end(t0) if sampler is not None else NvmlPcieSampler.empty_window()
    total = spec.nbytes * (2 if spec.direction == "bidir" else 1)
    bandwidth = spec.kind == "bandwidth"
    point: dict[str, Any] = {
        **_identity(spec),
        **stats.as_dict(),
        "gbps": benchutil.gbps(total, stats.median_ms) if bandwidth else None,
        "latency_us": None if bandwidth else stats.median_ms * 1e3,
        "latency_p10_us": None if bandwidth else stats.p10_ms * 1e3,
        "latency_p90_us": None if bandwidth else stats.p90_ms * 1e3,
        "h2d_gbps": None,
        "d2h_gbps": None,
        "h2d_median_ms": None,
        "d2h_median_ms": None,
    }
    if workload.direction_ms is not None:
        for d, times in workload.direction_ms().items():
            med = statistics.median(times[-repeats:])
            point[f"{d}_median_ms"] = med
            point[f"{d}_gbps"] = benchutil.gbps(spec.nbytes, med)
    point.update(_link_fields(point["gbps"], spec.direction, theoretical_gbps))
    point.update(nv)
    point.update(workload.info)
    point["verified"] = None
    point["error"] = None
    if workload.verify is not None:
        problem = workload.verify()
        point["verified"] = problem is None
        point["error"] = problem
    return point


def failed_point(spec: PointSpec, error: str, theoretical_gbps: float | None = None) -> dict[str, Any]:
    """The record of a point that could not be measured (same keys as a measured one where it matters)."""
    return {
        **_identity(spec),
        "median_ms": None,
        "p10_ms": None,
        "p90_ms": None,
        "gbps": None,
        "latency_us": None,
        **_link_fields(None, spec.direction, theoretical_gbps),
        **NvmlPcieSampler.empty_window(),
        "verified": None,
        "error": error,
    }


def run_sweep(
    specs: list[PointSpec],
    workload_for: Callable[[PointSpec], Workload],
    *,
    timer: benchutil.Timer,
    sweep: Sweep,
    sampler: NvmlPcieSampler | None = None,
    theoretical_gbps: float | None = None,
    progress: benchutil.Progress | None = None,
) -> list[dict[str, Any]]:
    """Measure every point in order; a point that raises is recorded with its ``error`` and the run goes on."""
    points = []
    for spec in specs:
        repeats = sweep.repeats if spec.kind == "bandwidth" else sweep.latency_repeats
        try:
            p = measure_point(
                spec,
                workload_for(spec),
                timer=timer,
                repeats=repeats,
                warmup=sweep.warmup,
                sampler=sampler,
                theoretical_gbps=theoretical_gbps,
            )
        except Exception as exc:  # a failed point must not lose the others (e.g. an allocation failure)
            p = failed_point(spec, f"{type(exc).__name__}: {exc}", theoretical_gbps)
        points.append(p)
        if progress is not None:
            progress.step(spec.label())
    return points
