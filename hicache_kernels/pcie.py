"""``python -m hicache_kernels.pcie``: the host link itself, by copy engines and by SM-driven zero copy.

For each transfer size (4 KiB to 1 GiB by default) and each direction (host to device, device to host,
and both at once on two streams) it times one contiguous copy of that many bytes:

- ``copy_engine``: ``cudaMemcpyAsync`` through torch (``dst.copy_(src, non_blocking=True)``), with the
  host buffer pinned and pageable;
- ``kernel``: this package's transfer kernel reading or writing the pinned host buffer directly
  through its device alias (zero copy), with ``num_blocks`` = the SM budget (``--sm-counts``).

It also times small copies (8 B and 4 KiB by default) as latency, reads the PCIe link's generation and
width from NVML (and the theoretical per-direction bandwidth they imply), and samples NVML's PCIe
throughput counters in a background thread while every point runs. Every figure is the median (and
10th/90th percentiles) of ``--repeats`` timed calls with CUDA events after ``--warmup`` calls
(:func:`hicache_kernels.benchutil.measure`); each point's copy is checked byte for byte once after
timing (``--no-verify`` skips that).

Without a CUDA GPU it says so, with the reasons (torch, driver, NVML, extension), writes the JSON
(``"mode": "no-gpu"``, no points) when asked, and exits 0.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import _env, benchutil

METHODS = ("copy_engine", "kernel")
MEMORIES = ("pinned", "pageable")
DIRECTIONS = ("h2d", "d2h", "bidir")
KiB, MiB, GiB = 2**10, 2**20, 2**30

FULL_SIZES = tuple(4 * KiB * 4**k for k in range(11) if 4 * KiB * 4**k <= GiB)  # 4 KiB, 16 KiB, ..., 1 GiB
QUICK_SIZES = (64 * KiB, MiB, 16 * MiB, 256 * MiB)
FULL_SM_COUNTS = (1, 2, 4, 8, 16, 32)
QUICK_SM_COUNTS = (1, 4, 16)
LATENCY_SIZES = (8, 4 * KiB)
# Kernel chunk (one warp's unit of work) when --chunk-bytes is auto: enough chunks to give every warp of
# the grid one, but none smaller than MIN nor larger than MAX.
KERNEL_CHUNK_MIN, KERNEL_CHUNK_MAX = 512, 64 * KiB
# NVML reports PCIe throughput in KB/s over a ~20 ms window; taken as 1024-byte KB.
NVML_KB = 1024
NVML_WINDOW_S = 0.02

_SUFFIXES = {"": 1, "B": 1}
_SUFFIXES.update({f"{p}{s}": scale for p, scale in (("K", KiB), ("M", MiB), ("G", GiB)) for s in ("", "B", "IB")})


# ----------------------------------------------------------------------------------------------- sizes


def parse_size(text: str) -> int:
    """A byte count such as ``4096``, ``64K``, ``64KiB``, ``256M`` or ``1G`` (binary units).

    Raises
    ------
    ValueError
        When ``text`` is not a positive size.
    """
    s = text.strip().upper().replace(" ", "")
    digits = len(s) - len(s.lstrip("0123456789"))
    number, unit = s[:digits], s[digits:]
    if not number or unit not in _SUFFIXES or int(number) * _SUFFIXES[unit] <= 0:
        raise ValueError(f"expected a positive size such as 4096, 64K, 256M or 1G, got {text!r}")
    return int(number) * _SUFFIXES[unit]


def parse_sizes(text: str) -> list[int]:
    """A comma list of sizes (see :func:`parse_size`), sorted, duplicates removed."""
    sizes = sorted({parse_size(t) for t in text.split(",") if t.strip()})
    if not sizes:
        raise ValueError(f"expected a comma list of sizes, got {text!r}")
    return sizes


def format_bytes(n: int) -> str:
    """``8 B``, ``4 KiB``, ``1.5 MiB``, ``1 GiB``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


# ----------------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Sweep:
    """What one run measures, resolved from the arguments (``--quick`` defaults filled in)."""

    sizes: tuple[int, ...]
    sm_counts: tuple[int, ...]
    methods: tuple[str, ...]
    memories: tuple[str, ...]
    directions: tuple[str, ...]
    latency_sizes: tuple[int, ...]
    repeats: int
    warmup: int
    latency_repeats: int
    warps_per_block: int
    chunk_bytes: int | None  # None: auto (kernel_chunk_bytes)
    verify: bool

    @property
    def max_bytes(self) -> int:
        return max((*self.sizes, *self.latency_sizes), default=0)


@dataclass(frozen=True)
class PointSpec:
    """One point: ``nbytes`` moved in each ``direction`` (``bidir``: that many each way, at once)."""

    kind: str  # bandwidth / latency
    method: str  # copy_engine / kernel
    memory: str  # pinned / pageable (kernel: pinned)
    direction: str  # h2d / d2h / bidir
    nbytes: int
    sm_budget: int | None  # kernel: num_blocks per direction; copy engine: None

    def label(self) -> str:
        sm = f" sm={self.sm_budget}" if self.sm_budget is not None else ""
        return f"{self.kind} {self.method} {self.memory} {self.direction} {format_bytes(self.nbytes)}{sm}"


def _csv_choice(text: str, choices: Iterable[str], flag: str) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in items if x not in choices]
    if bad or not items:
        raise ValueError(f"{flag}: expected a comma list of {', '.join(choices)}, got {text!r}")
    return items


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: expected a comma list of positive integers, got {text!r}")
    return values


def _flag(parse: Callable[[str], Any], text: str, flag: str) -> Any:
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def resolve_sweep(args: argparse.Namespace) -> Sweep:
    """The :class:`Sweep` the parsed arguments ask for.

    Explicit ``--sizes``, ``--sm-counts``, ``--repeats``, ``--warmup`` and ``--latency-repeats`` win over
    ``--quick``'s reduced defaults; ``--max-size`` drops larger sizes.

    Raises
    ------
    ValueError
        Naming the flag, when a value is malformed or nothing is left to measure.
    """
    max_size = _flag(parse_size, args.max_size, "--max-size")
    if args.sizes:
        sizes = _flag(parse_sizes, args.sizes, "--sizes")
    else:
        sizes = list(QUICK_SIZES if args.quick else FULL_SIZES)
    sizes = [s for s in sizes if s <= max_size]
    if not sizes:
        raise ValueError(f"--sizes/--max-size: no size left at or below --max-size {args.max_size}")
    sm_counts = _positive_ints(args.sm_counts, "--sm-counts") if args.sm_counts else None
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    latency_repeats = args.latency_repeats if args.latency_repeats is not None else (50 if args.quick else 200)
    if repeats < 1 or warmup < 0 or latency_repeats < 1:
        raise ValueError("--repeats/--latency-repeats must be >= 1 and --warmup >= 0")
    if not 1 <= args.warps_per_block <= 32:
        raise ValueError(f"--warps-per-block: expected 1..32, got {args.warps_per_block}")
    chunk = None if args.chunk_bytes in (None, "auto") else _flag(parse_size, args.chunk_bytes, "--chunk-bytes")
    return Sweep(
        sizes=tuple(sizes),
        sm_counts=sm_counts or (QUICK_SM_COUNTS if args.quick else FULL_SM_COUNTS),
        methods=_csv_choice(args.methods, METHODS, "--methods"),
        memories=_csv_choice(args.memory, MEMORIES, "--memory"),
        directions=_csv_choice(args.directions, DIRECTIONS, "--directions"),
        latency_sizes=() if args.no_latency else tuple(_flag(parse_sizes, args.latency_sizes, "--latency-sizes")),
        repeats=repeats,
        warmup=warmup,
        latency_repeats=latency_repeats,
        warps_per_block=args.warps_per_block,
        chunk_bytes=chunk,
        verify=not args.no_verify,
    )


def _configs(sweep: Sweep, kernel_ok: bool, sm_counts: Iterable[int]) -> list[tuple[str, str, int | None]]:
    """(method, memory, sm_budget) triples in run order."""
    out: list[tuple[str, str, int | None]] = []
    if "copy_engine" in sweep.methods:
        out += [("copy_engine", m, None) for m in sweep.memories]
    if "kernel" in sweep.methods and kernel_ok and "pinned" in sweep.memories:
        out += [("kernel", "pinned", sm) for sm in sm_counts]
    return out


def plan_points(sweep: Sweep, kernel_ok: bool = True) -> list[PointSpec]:
    """Every point of the run, in run order: bandwidth (per direction, method/memory/SM budget, size),
    then latency (per size and single direction: copy engine per memory, kernel with 1 block).

    Parameters
    ----------
    sweep
        The resolved arguments.
    kernel_ok
        False when the kernel method cannot run here (its points are left out).
    """
    points = [
        PointSpec("bandwidth", method, memory, d, size, sm)
        for d in sweep.directions
        for method, memory, sm in _configs(sweep, kernel_ok, sweep.sm_counts)
        for size in sweep.sizes
    ]
    points += [
        PointSpec("latency", method, memory, d, size, sm)
        for size in sweep.latency_sizes
        for d in sweep.directions
        if d != "bidir"
        for method, memory, sm in _configs(sweep, kernel_ok, (1,))
    ]
    return points


def kernel_chunk_bytes(nbytes: int, sm_budget: int, warps_per_block: int, override: int | None = None) -> int:
    """Bytes per slot when the kernel treats a buffer of ``nbytes`` as ``nbytes / chunk`` slots.

    Auto (``override`` None): the power of two that gives every warp of the grid one chunk, clamped to
    [512 B, 64 KiB] (one warp moves one chunk at a time, so fewer chunks than warps idles the rest),
    then to ``nbytes``. The result always divides ``nbytes`` (gcd with it).
    """
    if override is not None:
        chunk = override
    else:
        target = max(1, nbytes // max(1, sm_budget * warps_per_block))
        chunk = min(max(1 << (target.bit_length() - 1), KERNEL_CHUNK_MIN), KERNEL_CHUNK_MAX)
    return math.gcd(min(chunk, nbytes), nbytes)


# -------------------------------------------------------------------------------------- measurement


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
        "kind": spec.kind,
        "method": spec.method,
        "memory": spec.memory,
        "direction": spec.direction,
        "bytes": spec.nbytes,
        "total_bytes": total,
        "sm_budget": spec.sm_budget,
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
        "kind": spec.kind,
        "method": spec.method,
        "memory": spec.memory,
        "direction": spec.direction,
        "bytes": spec.nbytes,
        "total_bytes": spec.nbytes * (2 if spec.direction == "bidir" else 1),
        "sm_budget": spec.sm_budget,
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


# --------------------------------------------------------------------------------------------- NVML


class NvmlPcieSampler:
    """Samples NVML's PCIe TX and RX throughput counters in two background threads.

    Each ``nvmlDeviceGetPcieThroughput`` call measures a ~20 ms window and returns KB/s; a sample is
    kept with its start and end time. TX is what the GPU sends (device to host), RX what it receives.
    :meth:`begin`/:meth:`end` bracket a point: the samples whose window lies wholly inside it.

    Parameters
    ----------
    nvml
        The ``pynvml`` module (or a fake with ``nvmlDeviceGetPcieThroughput`` and the two constants).
    handle
        The NVML device handle.
    gap_s
        Pause between two samples of one counter.
    """

    def __init__(self, nvml: Any, handle: Any, gap_s: float = 0.001, clock: Callable[[], float] = time.monotonic):
        self.nvml = nvml
        self.handle = handle
        self.gap_s = gap_s
        self.clock = clock
        self.counters = {
            "tx": getattr(nvml, "NVML_PCIE_UTIL_TX_BYTES", 0),
            "rx": getattr(nvml, "NVML_PCIE_UTIL_RX_BYTES", 1),
        }
        self.samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in self.counters}
        self.errors: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _loop(self, name: str, counter: int) -> None:
        while not self._stop.is_set():
            t_a = self.clock()
            try:
                kbps = self.nvml.nvmlDeviceGetPcieThroughput(self.handle, counter)
            except Exception as exc:  # NVMLError_NotSupported etc.: stop this counter, keep the reason
                with self._lock:
                    self.errors[name] = f"{type(exc).__name__}: {exc}"
                return
            t_b = self.clock()
            with self._lock:
                self.samples[name].append((t_a, t_b, float(kbps) * NVML_KB / 1e9))
            self._stop.wait(self.gap_s)

    def start(self) -> NvmlPcieSampler:
        """Start both sampling threads (daemons); returns self."""
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._loop, args=(n, c), name=f"nvml-pcie-{n}", daemon=True)
            for n, c in self.counters.items()
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop and join the threads."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=1.0)

    def __enter__(self) -> NvmlPcieSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def begin(self) -> float:
        """Mark the start of a point."""
        return self.clock()

    @staticmethod
    def empty_window() -> dict[str, Any]:
        return {
            "nvml_tx_gbps_max": None,
            "nvml_rx_gbps_max": None,
            "nvml_tx_gbps_mean": None,
            "nvml_rx_gbps_mean": None,
            "nvml_samples": 0,
        }

    def end(self, t0: float) -> dict[str, Any]:
        """Max and mean TX/RX in GB/s over the samples wholly inside [t0, now] (None when there are none:
        a point shorter than NVML's ~20 ms window), and how many samples that was."""
        t1 = self.clock()
        out = self.empty_window()
        with self._lock:
            for name, samples in self.samples.items():
                vals = [v for a, b, v in samples if a >= t0 and b <= t1]
                if vals:
                    out[f"nvml_{name}_gbps_max"] = max(vals)
                    out[f"nvml_{name}_gbps_mean"] = statistics.fmean(vals)
                out["nvml_samples"] += len(vals)
        return out

    def summary(self) -> dict[str, Any]:
        """All samples of the run: count, max and mean per counter, the window and any errors."""
        out: dict[str, Any] = {"unit": "GB/s (NVML KB/s x 1024 / 1e9)", "window_s": NVML_WINDOW_S}
        with self._lock:
            for name, samples in self.samples.items():
                vals = [v for _, _, v in samples]
                out[f"{name}_samples"] = len(vals)
                out[f"{name}_gbps_max"] = max(vals) if vals else None
                out[f"{name}_gbps_mean"] = statistics.fmean(vals) if vals else None
            out["errors"] = dict(self.errors)
        return out


def nvml_for_device(index: int, uuid: str | None = None) -> tuple[Any | None, Any | None, str]:
    """``(nvml, handle, "ok")`` for a CUDA device, or ``(None, None, reason)``."""
    nvml, reason = _env._nvml()
    if nvml is None:
        return None, None, reason
    try:
        return nvml, _env._nvml_handle(nvml, index, uuid), "ok"
    except Exception as exc:
        return None, None, f"NVML has no handle for device {index}: {type(exc).__name__}: {exc}"


def link_facts(nvml: Any | None, handle: Any, reason: str = "ok") -> dict[str, Any]:
    """The PCIe link as NVML reports it now (generation, width, theoretical GB/s), or its ``error``."""
    if nvml is None:
        return asdict(_env.PcieLink(error=reason))
    return asdict(_env._pcie(nvml, handle))


def theoretical_of(link: dict[str, Any]) -> float | None:
    """The link's theoretical one-direction GB/s: at its max generation/width (links train down when
    idle, so the current one read before a run often says Gen1), else the current one."""
    return link.get("max_gbps") or link.get("current_gbps")


# ------------------------------------------------------------------------------------- the GPU side


def kernel_unavailable(device_index: int) -> str | None:
    """Why this package's kernel cannot run on the device, or None."""
    from ._ext import cuda_runtime_status, load_extension

    ok, reason = cuda_runtime_status()  # built, importable, and a driver new enough for its runtime
    if not ok:
        return reason
    try:
        load_extension().kernel_image_versions(device_index)
    except RuntimeError as exc:
        return str(exc)
    return None


def _fill_pattern(t: torch.Tensor, device: torch.device, salt: int) -> None:
    """Fill a uint8 buffer (CPU or CUDA) with a position-dependent pattern, 64 MiB at a time."""
    step = 64 * MiB
    flat = t.view(-1)
    for start in range(0, flat.numel(), step):
        end = min(start + step, flat.numel())
        vals = (torch.arange(start, end, device=device, dtype=torch.int64) * 131 + salt) % 251
        flat[start:end].copy_(vals.to(torch.uint8))
    torch.cuda.synchronize(device)


class LinkBench:
    """Buffers and copies for one CUDA device: what :func:`run_sweep` needs from a GPU.

    Device ``dev_src`` (device-to-host source) and ``dev_dst``; per host memory kind a source
    ``host_src`` (host-to-device) and a destination ``host_dst``. Sources hold a pattern and are never
    written, so a destination cleared then copied into must equal its source.
    """

    def __init__(self, device: torch.device, sweep: Sweep, kernel: bool) -> None:
        self.device = device
        self.sweep = sweep
        n = sweep.max_bytes
        self.dev_src = torch.empty(n, dtype=torch.uint8, device=device)
        self.dev_dst = torch.zeros(n, dtype=torch.uint8, device=device)
        _fill_pattern(self.dev_src, device, 7)
        self.host_src: dict[str, torch.Tensor] = {}
        self.host_dst: dict[str, torch.Tensor] = {}
        memories = set(sweep.memories) | ({"pinned"} if kernel else set())
        for mem in memories:
            pin = mem == "pinned"
            self.host_src[mem] = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
            self.host_dst[mem] = torch.zeros(n, dtype=torch.uint8, pin_memory=pin)  # zeros: pages touched
            _fill_pattern(self.host_src[mem], device, 11)
        self.side_streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self.ext = None
        self.alias: dict[str, int] = {}
        if kernel:
            from ._ext import load_extension

            self.ext = load_extension()
            # The device alias of pinned memory: equal to the host address under UVA on Linux x86, not
            # everywhere; always ask.
            self.alias = {
                "src": self.ext.host_device_pointer(self.host_src["pinned"].data_ptr()),
                "dst": self.ext.host_device_pointer(self.host_dst["pinned"].data_ptr()),
            }
        self._arange: dict[int, torch.Tensor] = {}

    def _ends(self, memory: str, direction: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if direction == "h2d":
            return self.host_src[memory][:n], self.dev_dst[:n]
        return self.dev_src[:n], self.host_dst[memory][:n]

    def _indices(self, n: int) -> torch.Tensor:
        if n not in self._arange:
            self._arange[n] = torch.arange(n, dtype=torch.int64, device=self.device)
        return self._arange[n]

    def issuer(
        self, spec: PointSpec, direction: str, stream: torch.cuda.Stream | None = None
    ) -> tuple[Callable[[], None], dict[str, Any]]:
        """A callable that issues one ``direction`` copy of ``spec.nbytes`` on ``stream`` (None: the stream
        current now, without switching streams per call: that would add to the latency), and point info."""
        src, dst = self._ends(spec.memory, direction, spec.nbytes)
        if spec.method == "copy_engine":
            if stream is None:
                return (lambda: dst.copy_(src, non_blocking=True)), {}

            def copy() -> None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)

            return copy, {}
        if self.ext is None or spec.sm_budget is None:
            raise RuntimeError(f"{spec.label()}: the kernel method needs the extension and an SM budget")
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        wpb = self.sweep.warps_per_block
        chunk = kernel_chunk_bytes(spec.nbytes, spec.sm_budget, wpb, self.sweep.chunk_bytes)
        slots = spec.nbytes // chunk
        src_base = self.alias["src"] if direction == "h2d" else src.data_ptr()
        dst_base = dst.data_ptr() if direction == "h2d" else self.alias["dst"]
        # One layer, one kv, page_size 1: slot i is bytes [i * chunk, (i + 1) * chunk) of the buffer.
        src_desc = (src_base, 1, 0, 0, chunk, 0, 0, 1, slots)
        dst_desc = (dst_base, 1, 0, 0, chunk, 0, 0, 1, slots)
        idx = self._indices(slots).data_ptr()
        handle, ext, blocks = stream.cuda_stream, self.ext, spec.sm_budget

        def launch() -> None:
            ext.transfer(
                src_desc, False, dst_desc, False, idx, idx, slots, 0, 1, 1, 1, chunk, 0, blocks, wpb, 0, handle
            )

        return launch, {"chunk_bytes": chunk, "warps_per_block": wpb}

    def _check(self, memory: str, direction: str, n: int) -> str | None:
        src, dst = self._ends(memory, direction, n)
        if torch.equal(src.to(self.device), dst.to(self.device)):
            return None
        return f"{direction}: destination differs from source after one copy of {n} bytes"

    def workload(self, spec: PointSpec) -> Workload:
        """The :class:`Workload` of a point: single directions on the current stream; ``bidir`` as h2d on
        one side stream and d2h on another, both forked from and joined back to the current stream."""
        main = torch.cuda.current_stream(self.device)
        directions = ("h2d", "d2h") if spec.direction == "bidir" else (spec.direction,)

        def verify() -> str | None:
            for d in directions:
                self._ends(spec.memory, d, spec.nbytes)[1].zero_()
            torch.cuda.synchronize(self.device)
            run()
            torch.cuda.synchronize(self.device)
            problems = [p for d in directions if (p := self._check(spec.memory, d, spec.nbytes))]
            return "; ".join(problems) or None

        if spec.direction != "bidir":
            run, info = self.issuer(spec, spec.direction)
            return Workload(run, verify=verify if self.sweep.verify else None, info=info)

        s_h2d, s_d2h = self.side_streams
        h2d, info = self.issuer(spec, "h2d", s_h2d)
        d2h, _ = self.issuer(spec, "d2h", s_d2h)
        events: list[tuple[torch.cuda.Event, ...]] = []

        def run() -> None:
            ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(4))
            s_h2d.wait_stream(main)
            s_d2h.wait_stream(main)
            ev[0].record(s_h2d)
            h2d()
            ev[1].record(s_h2d)
            ev[2].record(s_d2h)
            d2h()
            ev[3].record(s_d2h)
            main.wait_stream(s_h2d)
            main.wait_stream(s_d2h)
            events.append(ev)

        def direction_ms() -> dict[str, list[float]]:
            torch.cuda.synchronize(self.device)
            return {
                "h2d": [e[0].elapsed_time(e[1]) for e in events],
                "d2h": [e[2].elapsed_time(e[3]) for e in events],
            }

        return Workload(run, direction_ms=direction_ms, verify=verify if self.sweep.verify else None, info=info)


# ------------------------------------------------------------------------------------------- output

BANDWIDTH_COLUMNS = [
    ("method", "method"),
    ("memory", "memory"),
    ("direction", "dir"),
    ("sm_budget", "SMs"),
    ("size", "size"),
    ("median_ms", "median ms"),
    ("gbps", "GB/s"),
    ("h2d_gbps", "h2d GB/s"),
    ("d2h_gbps", "d2h GB/s"),
    ("link_pct", "% link"),
    ("nvml_tx_gbps_max", "NVML tx"),
    ("nvml_rx_gbps_max", "NVML rx"),
    ("error", "error"),
]
LATENCY_COLUMNS = [
    ("method", "method"),
    ("memory", "memory"),
    ("direction", "dir"),
    ("sm_budget", "SMs"),
    ("size", "size"),
    ("latency_us", "median us"),
    ("latency_p10_us", "p10 us"),
    ("latency_p90_us", "p90 us"),
    ("error", "error"),
]


def format_points(points: list[dict[str, Any]]) -> str:
    """The bandwidth and latency tables (benchutil.format_table)."""
    out = []
    for kind, columns in (("bandwidth", BANDWIDTH_COLUMNS), ("latency", LATENCY_COLUMNS)):
        rows = [{**p, "size": format_bytes(p["bytes"])} for p in points if p["kind"] == kind]
        if not rows:
            continue
        if not any(r.get("error") for r in rows):
            columns = [c for c in columns if c[0] != "error"]
        out.append(f"{kind}:\n" + benchutil.format_table(rows, columns))
    return "\n\n".join(out)


def peak_summary(points: list[dict[str, Any]]) -> list[str]:
    """One line per (method, memory, direction): the best GB/s and where it was reached."""
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for p in points:
        if p["kind"] != "bandwidth" or not p.get("gbps"):
            continue
        key = (p["method"], p["memory"], p["direction"])
        if key not in best or p["gbps"] > best[key]["gbps"]:
            best[key] = p
    lines = []
    for (method, memory, direction), p in best.items():
        sm = f", {p['sm_budget']} SMs" if p["sm_budget"] is not None else ""
        pct = f" ({p['link_pct']:.0f}% of the link)" if p.get("link_pct") is not None else ""
        lines.append(
            f"  peak {method} {memory} {direction}: {p['gbps']:.1f} GB/s{pct} at {format_bytes(p['bytes'])}{sm}"
        )
    return lines


class PlotUnavailableError(RuntimeError):
    """``--plot`` was asked for but matplotlib does not import."""


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError(
            f"--plot needs matplotlib, which does not import ({exc}): pip install matplotlib"
        ) from exc
    return Figure


def write_plot(points: list[dict[str, Any]], path: str | Path, theoretical_gbps: float | None = None) -> Path:
    """GB/s vs transfer size, one panel per direction, one line per method/memory/SM budget, and the
    link's theoretical bandwidth (twice it for ``bidir``) as a dashed horizontal line.

    Raises
    ------
    PlotUnavailableError
        matplotlib is not installed (the message names ``pip install matplotlib``).
    ValueError
        No bandwidth point has a GB/s figure.
    """
    figure_cls = _figure_class()
    bw = [p for p in points if p["kind"] == "bandwidth" and p.get("gbps")]
    if not bw:
        raise ValueError("no bandwidth points to plot")
    directions = [d for d in DIRECTIONS if any(p["direction"] == d for p in bw)]
    fig = figure_cls(figsize=(6 * len(directions), 4.8), layout="constrained")
    axes = fig.subplots(1, len(directions), squeeze=False, sharey=True)[0]
    for ax, d in zip(axes, directions, strict=True):
        series: dict[tuple[str, str, int | None], list[dict[str, Any]]] = {}
        for p in bw:
            if p["direction"] == d:
                series.setdefault((p["method"], p["memory"], p["sm_budget"]), []).append(p)
        for (method, memory, sm), pts in series.items():
            pts.sort(key=lambda p: p["bytes"])
            label = f"{method} {memory}" + (f" {sm} SMs" if sm is not None else "")
            style = "-" if method == "copy_engine" else "--"
            ax.plot([p["bytes"] for p in pts], [p["gbps"] for p in pts], style, marker="o", ms=3, label=label)
        if theoretical_gbps:
            scale = 2 if d == "bidir" else 1
            ax.axhline(theoretical_gbps * scale, color="k", ls=":", label=f"link {theoretical_gbps * scale:.1f} GB/s")
        sizes = sorted({p["bytes"] for p in bw})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_bytes(s).replace(" ", "") for s in sizes], rotation=45, fontsize=7)
        ax.set_xlabel("transfer size" + (" (each way)" if d == "bidir" else ""))
        ax.set_title({"h2d": "host to device", "d2h": "device to host", "bidir": "both at once (sum)"}[d])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return Path(path)


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hicache_kernels.pcie", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", help="comma list of transfer sizes (4096, 64K, 256M, 1G); default 4K..1G by 4x")
    p.add_argument("--max-size", default="1G", help="drop sizes above this (default 1G)")
    p.add_argument("--sm-counts", help="kernel SM budgets (num_blocks) to sweep; default 1,2,4,8,16,32")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of copy_engine, kernel")
    p.add_argument("--memory", default=",".join(MEMORIES), help="host memory for copy engines: pinned, pageable")
    p.add_argument("--directions", default=",".join(DIRECTIONS), help="comma list of h2d, d2h, bidir")
    p.add_argument("--repeats", type=int, help="timed calls per bandwidth point (default 20; --quick 5)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 3; --quick 1)")
    p.add_argument(
        "--latency-sizes",
        default=",".join(map(str, LATENCY_SIZES)),
        help="small copies timed as latency (default 8,4096)",
    )
    p.add_argument("--latency-repeats", type=int, help="timed calls per latency point (default 200; --quick 50)")
    p.add_argument("--no-latency", action="store_true", help="skip the latency points")
    p.add_argument("--warps-per-block", type=int, default=32, help="kernel warps per block (default 32)")
    p.add_argument("--chunk-bytes", default="auto", help="kernel bytes per slot, or auto (one chunk per warp)")
    p.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte check of each point's copy")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--quick", action="store_true", help="sizes 64K,1M,16M,256M, SM counts 1,4,16, fewer repeats")
    p.add_argument("--json", metavar="PATH", help="write the run's tags and every point as JSON")
    p.add_argument("--csv", metavar="PATH", help="write every point as CSV")
    p.add_argument("--plot", metavar="PATH.png", help="plot GB/s vs size (needs matplotlib)")
    return p.parse_args(argv)


def _status_lines() -> tuple[list[str], dict[str, Any]]:
    """Why there is no usable GPU: torch, driver, NVML and extension reasons, as text and as data."""
    from ._ext import extension_status

    _, torch_reason = _env._torch_cuda()
    _, nvml_reason = _env._nvml()
    cv = _env.cuda_versions()
    ext_ok, ext_reason = extension_status()
    reasons = {
        "torch": torch_reason,
        "nvml": nvml_reason,
        "driver": cv.get("driver_error") or f"driver {cv.get('driver')} (CUDA {cv.get('driver_cuda')})",
        "extension": "imports" if ext_ok else ext_reason,
    }
    lines = [f"  {k}: {v}" for k, v in reasons.items()]
    return lines, reasons


def _write_outputs(
    args: argparse.Namespace, meta: dict[str, Any], points: list[dict[str, Any]], **extra: Any
) -> list[str]:
    written = []
    if args.json:
        benchutil.write_json(args.json, meta, points, **extra)
        written.append(f"wrote {args.json}")
    if args.csv:
        benchutil.write_csv(args.csv, meta, points)
        written.append(f"wrote {args.csv}")
    return written


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (or report why it cannot run) and write the outputs; returns the exit status."""
    args = parse_args(argv)
    try:
        sweep = resolve_sweep(args)
    except ValueError as exc:
        print(f"pcie: {exc}", file=sys.stderr)
        return 2

    if not torch.cuda.is_available():
        lines, reasons = _status_lines()
        print("pcie: host-link bandwidth and latency need a CUDA GPU; none is usable here, nothing measured.")
        print("\n".join(lines))
        meta = benchutil.run_meta("pcie", vars(args))
        for line in _write_outputs(args, meta, [], mode="no-gpu", reasons=reasons):
            print(line)
        if args.plot:
            print(f"pcie: --plot {args.plot}: nothing to plot without a GPU")
        return 0

    if not 0 <= args.device < torch.cuda.device_count():
        print(f"pcie: --device {args.device}: {torch.cuda.device_count()} CUDA device(s) visible", file=sys.stderr)
        return 2
    if args.plot:
        try:
            _figure_class()
        except PlotUnavailableError as exc:
            print(f"pcie: {exc}", file=sys.stderr)
            return 2
    torch.cuda.set_device(args.device)
    device = torch.device("cuda", args.device)
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "") or None

    notes: list[str] = []
    kernel_reason = kernel_unavailable(args.device) if "kernel" in sweep.methods else None
    if kernel_reason:
        notes.append(f"kernel method skipped: {kernel_reason}")
    nvml, handle, nvml_reason = nvml_for_device(args.device, uuid)
    link = link_facts(nvml, handle, nvml_reason)
    theoretical = theoretical_of(link)
    if nvml is None:
        notes.append(f"NVML: {nvml_reason} (no link facts, no throughput counters)")
    specs = plan_points(sweep, kernel_ok=kernel_reason is None)
    print(f"pcie: {props.name} (device {args.device}, {props.multi_processor_count} SMs), {len(specs)} points")
    if link.get("error"):
        print(f"  PCIe link: unknown ({link['error']})")
    else:
        print(
            f"  PCIe link: Gen{link['current_generation']} x{link['current_width']} now, max "
            f"Gen{link['max_generation']} x{link['max_width']}: {theoretical} GB/s per direction (theoretical)"
        )
    for note in notes:
        print(f"  {note}")
    if not specs:
        print("pcie: nothing left to measure with these --methods/--memory on this machine", file=sys.stderr)
        return 1

    meta = benchutil.run_meta("pcie", vars(args))
    try:
        bench = LinkBench(device, sweep, kernel=any(s.method == "kernel" for s in specs))
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        print(
            f"pcie: could not set up buffers of {format_bytes(sweep.max_bytes)} (device, pinned and pageable host): "
            f"{type(exc).__name__}: {exc}; try a smaller --max-size",
            file=sys.stderr,
        )
        return 1
    sampler = NvmlPcieSampler(nvml, handle) if nvml is not None else None
    progress = benchutil.Progress(len(specs), "pcie")
    main_stream = torch.cuda.Stream(device)
    try:
        if sampler is not None:
            sampler.start()
        with torch.cuda.stream(main_stream):
            points = run_sweep(
                specs,
                bench.workload,
                timer=benchutil.CudaEventTimer(main_stream),
                sweep=sweep,
                sampler=sampler,
                theoretical_gbps=theoretical,
                progress=progress,
            )
    finally:
        if sampler is not None:
            sampler.stop()
        progress.close()
    link_after = link_facts(nvml, handle, nvml_reason)

    print(format_points(points))
    print("\n".join(peak_summary(points)))
    if sampler is not None and sampler.errors:
        print(f"  NVML throughput counters: {sampler.errors}")
    failed = [p for p in points if p.get("error")]
    if failed:
        print(f"pcie: {len(failed)} point(s) failed; see the error column")
    extra = {
        "mode": "gpu",
        "device": {"index": args.device, "name": props.name, "sm_count": props.multi_processor_count, "uuid": uuid},
        "link": link,
        "link_after": link_after,
        "theoretical_gbps": theoretical,
        "nvml": {"available": nvml is not None, "reason": nvml_reason}
        | (sampler.summary() if sampler is not None else {}),
        "notes": notes,
    }
    for line in _write_outputs(args, meta, points, **extra):
        print(line)
    if args.plot:
        try:
            print(f"wrote {write_plot(points, args.plot, theoretical)}")
        except ValueError as exc:
            print(f"pcie: --plot: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
