"""The transfer sweep: model-shaped pools, each point's callables, its copy-engine ceiling, the timed run."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .. import benchutil, layouts
from .config import (
    COPY_ENGINE_BACKENDS,
    DIRECTIONS,
    DTYPES,
    KERNEL_BACKENDS,
    KERNEL_BULK,
    LINK_TOLERANCE,
    UNBUDGETED_BACKENDS,
    ModelConfig,
    PointSpec,
)


class Workload:
    """Pools for one model, reused across points: a stacked device pool and one pinned host buffer
    viewed in each layout's shape (pinning once, not per point)."""

    def __init__(
        self,
        model: ModelConfig,
        tokens: int,
        device: torch.device,
        pin: bool,
        headroom: int = 4,
        fill: bool = False,
        page_sizes: Iterable[int] = (),
    ) -> None:
        self.model = model
        self.device = device
        dtype = DTYPES[model.dtype]
        self.slots = self.num_slots(tokens, page_sizes, headroom)
        self.dev_k = torch.empty(
            model.num_layers, self.slots, model.head_num, model.head_dim, dtype=dtype, device=device
        )
        self.dev_v = None if model.mla else torch.empty_like(self.dev_k)
        n = model.num_kv * model.num_layers * self.slots * model.head_num * model.head_dim
        # Contents do not matter for timing: left uninitialised unless results are checked (--refcheck),
        # where random bytes make a misplaced copy show.
        self.host_flat = torch.empty(n, dtype=dtype, pin_memory=pin)
        if fill:
            for t in (self.dev_k, self.dev_v, self.host_flat):
                if t is not None:
                    t.view(torch.uint8).random_(0, 256)

    @staticmethod
    def num_slots(tokens: int, page_sizes: Iterable[int] = (), headroom: int = 4) -> int:
        """Token slots of each pool: ``headroom`` x ``tokens`` plus 512 so random pages have room, rounded
        up to a multiple of 128 and of every page size (a layout's host shape holds whole pages)."""
        unit = math.lcm(128, *page_sizes)
        return -(-(headroom * tokens + 512) // unit) * unit

    def host(self, layout: str, page_size: int) -> torch.Tensor:
        shape = layouts.host_shape(
            layout, mla=self.model.mla, num_layers=self.model.num_layers, num_slots=self.slots, page_size=page_size,
            head_num=self.model.head_num, head_dim=self.model.head_dim,
        )  # fmt: skip
        return self.host_flat.view(shape)

    def indices(self, page_size: int, num_pages: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Random distinct pages on each side (a random token permutation when page_size is 1)."""
        pages = self.slots // page_size
        off = torch.arange(page_size)
        d = (torch.randperm(pages, generator=gen)[:num_pages, None] * page_size + off).reshape(-1)
        h = (torch.randperm(pages, generator=gen)[:num_pages, None] * page_size + off).reshape(-1)
        return d, h


def _backend_object(spec: PointSpec):
    from ..backends import AutoBackend, KernelBackend, get_backend

    if spec.backend == "kernel":
        return KernelBackend.for_sm_budget(spec.sm_budget)
    if spec.backend == KERNEL_BULK:
        return KernelBackend.for_sm_budget(spec.sm_budget, design="bulk")
    if spec.backend == "auto":  # its settings (decision table) from the user's file, its kernels on the point's SMs
        auto = AutoBackend()
        auto.kernel = KernelBackend.for_sm_budget(spec.sm_budget)
        auto.kernel_bulk = KernelBackend.for_sm_budget(spec.sm_budget, design="bulk")
        return auto
    return get_backend(spec.backend)


@dataclass
class PointWork:
    """One point's callables. ``prepare`` (untimed) draws fresh indices and builds the plan; ``run``
    executes it on the current stream; ``check`` compares the last run's destination with its source.
    ``fallbacks`` and ``choices`` collect, over every run, why a batch run fell back to direct and
    which backend auto chose."""

    prepare: Callable[[], None]
    run: Callable[[], None]
    check: Callable[[], bool]
    nbytes: int
    fallbacks: set[str]
    choices: set[str]


def transfer_fn(spec: PointSpec, work: Workload, gen: torch.Generator) -> PointWork:
    """The callables of one point. Copy-engine backends get host indices (they plan on the host); the
    others get device indices, as a scheduler holding them on the GPU would pass. Nothing here names a
    stream: everything is issued on the stream current when it is called, which the harness makes the
    timer's (:func:`hicache_kernels.benchutil.measure`)."""
    from .. import ops

    direction, scope = DIRECTIONS[spec.direction]
    host = work.host(spec.layout, spec.page_size)
    backend = _backend_object(spec)
    on_host = spec.backend in UNBUDGETED_BACKENDS or work.device.type == "cpu"
    state: dict[str, Any] = {}
    fallbacks: set[str] = set()
    choices: set[str] = set()

    def prepare() -> None:
        d, h = work.indices(spec.page_size, spec.num_pages, gen)
        if not on_host:
            d, h = d.to(work.device), h.to(work.device)  # synchronous (pageable source): done before timing
        state["d"], state["h"] = d, h
        # What ops.transfer does before the backend runs (validation, geometry, address tables), done
        # untimed. stream=None: the plan runs on whichever stream is current when run() is called.
        plan = ops.build_plan(
            direction, work.dev_k, work.dev_v, host, d, h, layout=spec.layout, page_size=spec.page_size,
            layer_id=0 if scope == "layer" else None, check_indices=False, stream=None,
        )  # fmt: skip
        # The backend's own host-side work (fragment planning and pointer arrays for the copy engines,
        # descriptors and pinned aliases for the kernel) is done here too: run() only issues the copy.
        state["copy"] = backend.prepare(plan)

    def check() -> bool:
        """The last run's destination slots hold its source slots' bytes (plain indexing)."""
        from ..reference import host_items

        d, h = state["d"].cpu(), state["h"].cpu()
        pools = [work.dev_k] if work.dev_v is None else [work.dev_k, work.dev_v]
        for kv, pool in enumerate(pools):
            for layer in [0] if scope == "layer" else range(spec.model.num_layers):
                dev = pool[layer][d.to(pool.device)].cpu().view(torch.uint8)
                hst = host_items(host, spec.layout, spec.page_size, layer, h, None if work.dev_v is None else kv)
                if not torch.equal(dev, hst):
                    return False
        return True

    def run() -> None:
        state["copy"]()
        # After the copies are issued (a few attribute reads): BatchBackend resets last_fallback on
        # every call, so each run's is collected here, or a fallback in any but the last run is lost.
        if spec.backend == KERNEL_BULK:  # the design that ran: bulk, or the register kernel where bulk cannot
            choices.add(backend.last_design)
        if spec.backend == "auto":
            choices.add(backend.last_choice)
            batch = backend.batch if backend.last_choice == "batch" else None
        else:
            batch = backend if spec.backend == "batch" else None
        if batch is not None and batch.last_fallback is not None:
            fallbacks.add(batch.last_fallback)

    return PointWork(prepare, run, check, spec.nbytes, fallbacks, choices)


def ceiling_fn(nbytes: int, direction: str, work: Workload, scratch: dict[str, torch.Tensor]) -> Callable[[], None]:
    """One contiguous pinned copy of ``nbytes`` in ``direction``, on the current stream (the timer's,
    like every point's): the copy-engine ceiling."""
    host = work.host_flat.view(torch.uint8)[:nbytes]
    if "dev" not in scratch or scratch["dev"].numel() < nbytes:
        scratch["dev"] = torch.empty(nbytes, dtype=torch.uint8, device=work.device)
    dev = scratch["dev"][:nbytes]
    if direction == "d2h":
        return lambda: host.copy_(dev, non_blocking=True)
    return lambda: dev.copy_(host, non_blocking=True)


class LinkCheckError(RuntimeError):
    """A ceiling or point measured faster than the PCIe link allows; ``points`` are those measured so far."""

    def __init__(self, message: str, points: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.points = points


def link_violation(what: str, gbps: float, link_gbps: float | None) -> str | None:
    """Why ``gbps`` cannot be a real measurement over a link of ``link_gbps`` (None: it can, or the
    link is unknown)."""
    if link_gbps is None or gbps <= link_gbps * (1 + LINK_TOLERANCE):
        return None
    return (f"{what}: {gbps:.2f} GB/s is above the PCIe link's theoretical {link_gbps:.2f} GB/s per direction "
            f"(+{LINK_TOLERANCE:.0%} tolerance): a timing error, not a fast link")  # fmt: skip


def run_sweep(
    specs: list[PointSpec],
    *,
    device: torch.device,
    timer: benchutil.Timer,
    repeats: int,
    warmup: int,
    seed: int = 0,
    tokens: int = 4096,
    progress: benchutil.Progress | None = None,
    pin: bool = True,
    refcheck: bool = False,
    link_gbps: float | None = None,
) -> list[dict[str, Any]]:
    """Measure every spec; returns the points (see module docstring for the fields). Every call runs
    on the timer's stream. With ``link_gbps`` (the link's theoretical one-direction GB/s), raises
    :class:`LinkCheckError` as soon as a ceiling or a point exceeds it (see :data:`LINK_TOLERANCE`)."""
    gen = torch.Generator().manual_seed(seed)
    work: dict[str, Workload] = {}
    ceilings: dict[tuple[str, int], benchutil.Stats] = {}
    scratch: dict[str, torch.Tensor] = {}
    points: list[dict[str, Any]] = []

    def refuse(what: str, gbps: float) -> None:
        problem = link_violation(what, gbps, link_gbps)
        if problem is not None:
            raise LinkCheckError(problem, points)

    page_sizes = {s.page_size for s in specs}
    for spec in specs:
        if spec.model.name not in work:
            # One model's pools at a time (run_memory counts on it): drop every reference to the last
            # model's before allocating, the last point's callables included.
            w = pw = None
            work.clear()
            scratch.clear()
            work[spec.model.name] = Workload(spec.model, tokens, device, pin, fill=refcheck, page_sizes=page_sizes)
        w = work[spec.model.name]
        direction, scope = DIRECTIONS[spec.direction]
        pw = transfer_fn(spec, w, gen)
        nbytes = pw.nbytes
        key = (direction, nbytes)
        if key not in ceilings:
            ceilings[key] = benchutil.measure(ceiling_fn(nbytes, direction, w, scratch), timer=timer,
                                              repeats=repeats, warmup=warmup)  # fmt: skip
            refuse(f"copy-engine ceiling, {direction}, {nbytes} B", benchutil.gbps(nbytes, ceilings[key].median_ms))
        ceiling = ceilings[key]
        stats = benchutil.measure(pw.run, timer=timer, repeats=repeats, warmup=warmup, prepare=pw.prepare)
        point = {
            "kind": "transfer",
            "model": spec.model.name,
            "backend": spec.backend,
            "direction": direction,
            "scope": scope,
            "op": spec.direction,
            "layout": spec.layout,
            "page_size": spec.page_size,
            "item_bytes": spec.model.item_bytes,
            "num_pages": spec.num_pages,
            "tokens": spec.num_tokens,
            "bytes": nbytes,
            **stats.as_dict(),
            "gbps": benchutil.gbps(nbytes, stats.median_ms),
            "ceiling_median_ms": ceiling.median_ms,
            "ceiling_gbps": benchutil.gbps(nbytes, ceiling.median_ms),
            "sm_budget": spec.sm_budget,
        }
        point["ratio_to_ceiling"] = point["gbps"] / point["ceiling_gbps"]
        if refcheck:  # one more run on fresh indices, on the timer's stream, then compare what landed
            with benchutil.issuing(timer):
                pw.prepare()
                pw.run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            point["refcheck"] = pw.check()
        if spec.backend == "auto":
            point["auto_choice"] = ",".join(sorted(pw.choices)) or None
        if spec.backend == KERNEL_BULK:
            point["kernel_design"] = ",".join(sorted(pw.choices)) or None
        if spec.backend in ("batch", "auto"):  # every run's fallback, warm-up and refcheck included
            point["batch_fallback"] = "; ".join(sorted(pw.fallbacks)) or None
        points.append(point)
        refuse(f"{spec.backend} {spec.direction} {spec.layout} page {spec.page_size}", point["gbps"])
        if progress:
            progress.step(f"{spec.backend} {spec.direction} p{spec.page_size} {spec.layout}")
    add_ratios(points)
    return points


def add_ratios(points: list[dict[str, Any]]) -> None:
    """kernel / direct and kernel / batch speedups (median time ratios) on kernel points, each against
    the same transfer (model, op, layout, page size and number of pages)."""
    index = {}
    for p in points:
        if p.get("kind") == "transfer":
            index[(p["model"], p["backend"], p["op"], p["layout"], p["page_size"], p.get("num_pages"))] = p
    for p in points:
        if p.get("kind") != "transfer" or p["backend"] != "kernel":
            continue
        for other in ("direct", "batch"):
            q = index.get((p["model"], other, p["op"], p["layout"], p["page_size"], p.get("num_pages")))
            p[f"kernel_over_{other}"] = q["median_ms"] / p["median_ms"] if q and p["median_ms"] > 0 else None


def _tuning_groups(points: list[dict[str, Any]], sm_budget: int) -> dict[tuple, dict[str, float]]:
    """Median ms per design of auto's, per measured transfer (model, op, layout, page size, item size,
    pages): the kernel designs only at ``sm_budget``, and ``kernel-bulk`` only where bulk copies ran
    (``kernel_design``; on other GPUs it measured the register kernel)."""
    from ..backends import AUTO_DESIGNS

    groups: dict[tuple, dict[str, float]] = {}
    for p in points:
        b = p.get("backend")
        if p.get("kind") != "transfer" or b not in AUTO_DESIGNS:
            continue
        if b in KERNEL_BACKENDS and p["sm_budget"] != sm_budget:
            continue
        if b == KERNEL_BULK and p.get("kernel_design", "bulk") != "bulk":
            continue
        key = (p["model"], p["op"], p["layout"], p["page_size"], p["item_bytes"], p.get("num_pages"))
        groups.setdefault(key, {})[b] = p["median_ms"]
    return groups


def _threshold(groups: dict[tuple, dict[str, float]]) -> int:
    """The single threshold (auto's rule for a direction without a table): the smallest fragment size
    from which a copy engine beats the kernel at every larger measured size, in every op and layout;
    one byte past the largest fragment measured if the kernel always wins; the default without data."""
    by_frag: dict[int, list[bool]] = {}
    for (_, _, _, page, item, _), times in groups.items():
        ce = [times[b] for b in COPY_ENGINE_BACKENDS if b in times]
        if "kernel" in times and ce:
            by_frag.setdefault(item * page, []).append(min(ce) < times["kernel"])
    if not by_frag:
        from ..backends import AutoBackend

        return AutoBackend.DEFAULTS["kernel_max_fragment_bytes"]
    sizes = sorted(by_frag)
    threshold = sizes[-1] + 1
    for size in reversed(sizes):  # walk down while copy engines win at this size and all above it
        if not all(by_frag[size]):
            break
        threshold = size
    return threshold


def tune_auto(points: list[dict[str, Any]], sm_budget: int) -> dict[str, Any]:
    """``auto``'s settings from measured points (what :class:`~hicache_kernels.backends.AutoBackend`
    takes as ``thresholds=`` and saves): per direction and fragment-size bucket (item x page bytes
    rounded down to a power of two), the designs of ``auto`` ranked fastest first, the kernel designs
    measured with ``sm_budget`` blocks. A design's score in a bucket is the geometric mean, over the
    transfers measured there (model, op, layout, page size, pages), of its time over the fastest
    design's (1 where it won), taken over the transfers it was measured in; ties keep
    :data:`~hicache_kernels.backends.AUTO_DESIGNS`' order. A bucket needs two designs measured in one
    transfer. Also the single ``kernel_max_fragment_bytes`` threshold (kernel vs copy engines).
    ValueError when no bucket has two designs measured."""
    from ..backends import AUTO_DESIGNS as designs
    from ..backends import fragment_bucket

    groups = _tuning_groups(points, sm_budget)
    slowdowns: dict[tuple[str, int], dict[str, list[float]]] = {}
    for (_, op, _, page, item, _), times in groups.items():
        if len(times) < 2:
            continue
        best = min(times.values())
        cell = slowdowns.setdefault((DIRECTIONS[op][0], fragment_bucket(item * page)), {})
        for b, ms in times.items():
            cell.setdefault(b, []).append(math.log(ms / best) if best > 0 else (0.0 if ms == best else math.inf))
    if not slowdowns:
        raise ValueError(f"points: no fragment size has two of {', '.join(designs)} measured in one transfer "
                         f"(kernel designs at {sm_budget} SMs)")  # fmt: skip
    table: dict[str, dict[str, list[str]]] = {}
    for (direction, bucket), cell in sorted(slowdowns.items()):
        ranking = sorted(cell, key=lambda b: (sum(cell[b]) / len(cell[b]), designs.index(b)))
        table.setdefault(direction, {})[str(bucket)] = ranking
    return {"kernel_max_fragment_bytes": _threshold(groups), "sm_budget": sm_budget, "table": table}
