"""``--host-overhead``: host microseconds per call of each op, custom op and compat function, on a no-op backend.

Every row times one kind of call on fixed pools, 8 token slots (one page) per call: after warm-up,
``--calls`` calls each timed on the host's clock (:class:`~hicache_kernels.benchutil.HostTimer`),
reported as the median and 90th percentile in microseconds. The io-backend moves nothing
(:class:`NoopBackend`), so a row is the Python side alone: argument checks, the plan, the index
checks (``check_indices=True``; one device sync for CUDA indices) and dispatch.

Paths: ``eager`` (``ops.backup_layer`` ... ``ops.load_all_layers`` with the no-op backend object),
``custom_op`` (``torch.ops.hicache_kernels.backup`` / ``load``, which name their backend),
``compat`` (every ``hicache_kernels.compat.sgl_kernel`` function that fits the pool) and ``layerwise``
(``load_layer`` for every layer in turn, timed as one block, reported per layer). The custom op and
the compat functions reach their backend by name, so for the run the shared instances
``get_backend("direct")`` and ``get_backend("triton")`` answer with the no-op's ``prepare``/``run``
(:func:`routed_to`); every row checks that each call reached the no-op, and the run fails otherwise.

Pools: a small MHA (3 layers, 8 heads x 128), an MLA pool of 3 layers and deepseek-v3's (61 layers,
kv_dim 576), bfloat16, on the GPU when there is one (host pool pinned), else on the CPU. The targets
(:mod:`hicache_kernels.targets`) read the JSON.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .. import benchutil, layouts, targets
from ..backends import IOBackend, get_backend
from .config import DTYPES, HOST_WARMUP_FRACTION, HOST_WARMUP_MIN, PRESETS, ModelConfig

MODE = targets.HOST_OVERHEAD_MODE
POOLS = (ModelConfig("mha-3layer", 3, 8, 128), ModelConfig("mla-3layer", 3, 1, 576, mla=True), PRESETS["deepseek-v3"])
LAYOUT, PAGE_SIZE, SLOTS = "page_first_direct", 8, 8
DEVICE_SLOTS, HOST_SLOTS = 256, 512
EAGER_OPS = ("backup_layer", "backup_all_layers", "load_layer", "load_all_layers")
ROUTED_NAMES = ("direct", "triton")  # the names the custom op and the compat functions reach here
COLUMNS = [("path", "path"), ("op", "op"), ("pool", "pool"), ("num_layers", "layers"), ("check_indices", "check"),
           ("median_us", "median us"), ("p90_us", "p90 us")]  # fmt: skip


class NoopBackend(IOBackend):
    """An io-backend that moves nothing: ``prepare(plan)`` returns a callable that issues nothing, so a
    call through it costs only the Python side. ``prepared`` and ``issued`` count what reached it."""

    name = "noop"

    def __init__(self) -> None:
        self.prepared = 0
        self.issued = 0

    def prepare(self, plan: Any) -> Callable[[], None]:
        self.prepared += 1
        return self._issue

    def _issue(self) -> None:
        self.issued += 1


@contextmanager
def routed_to(noop: NoopBackend, names: tuple[str, ...] = ROUTED_NAMES) -> Iterator[None]:
    """For the block, the shared backends ``get_backend(name)`` returns answer ``prepare`` and ``run``
    with ``noop``'s, and the compat functions use ``triton`` (the one name they accept for pointer
    tables on CPU tensors); everything is put back afterwards."""
    from ..compat import sgl_kernel

    shared = [get_backend(name) for name in names]
    saved = [{k: vars(b)[k] for k in ("prepare", "run") if k in vars(b)} for b in shared]
    compat_backend = getattr(sgl_kernel, "_backend_name", "kernel")
    try:
        for b in shared:
            b.prepare, b.run = noop.prepare, noop.run
        sgl_kernel.use_backend("triton")
        yield
    finally:
        sgl_kernel.use_backend(compat_backend)
        for b, kept in zip(shared, saved, strict=True):
            vars(b).pop("prepare", None)
            vars(b).pop("run", None)
            vars(b).update(kept)


class Pools:
    """One model's pools: a stacked device pool, one host buffer viewed in each host layout, the per-layer
    tensors and address tables the compat functions take, and one page of slots on each side."""

    def __init__(self, model: ModelConfig, device: torch.device) -> None:
        self.model, self.device = model, device
        L, H, D, dtype = model.num_layers, model.head_num, model.head_dim, DTYPES[model.dtype]
        self.k = torch.empty(L, DEVICE_SLOTS, H, D, dtype=dtype, device=device)
        self.v = None if model.mla else torch.empty_like(self.k)
        n = model.num_kv * L * HOST_SLOTS * H * D
        self.host_flat = torch.empty(n, dtype=dtype, pin_memory=device.type == "cuda")
        self.dev_idx = torch.arange(SLOTS, dtype=torch.int64, device=device) + 5 * PAGE_SIZE
        self.host_idx = torch.arange(SLOTS, dtype=torch.int64, device=device) + 11 * PAGE_SIZE
        self.k_layers = list(self.k.unbind(0))
        self.v_layers = [] if self.v is None else list(self.v.unbind(0))
        self.item = H * D * dtype.itemsize

    def host(self, layout: str) -> torch.Tensor:
        m = self.model
        shape = layouts.host_shape(layout, mla=m.mla, num_layers=m.num_layers, num_slots=HOST_SLOTS,
                                   page_size=PAGE_SIZE, head_num=m.head_num, head_dim=m.head_dim)  # fmt: skip
        return self.host_flat.view(shape)

    def table(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Per-layer base addresses, as sgl-kernel's ``*_layers`` arguments (built once, like a caller's)."""
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=self.device)


def _ops() -> Any:
    """:mod:`hicache_kernels.ops`, imported when first needed (it registers the custom ops)."""
    return importlib.import_module("hicache_kernels.ops")


def eager_calls(p: Pools, noop: NoopBackend, check: bool) -> list[tuple[str, Callable[[], None]]]:
    ops = _ops()
    host = p.host(LAYOUT)
    calls = []
    for op in EAGER_OPS:
        kw = {"layout": LAYOUT, "page_size": PAGE_SIZE, "backend": noop, "check_indices": check}
        if op.endswith("_layer"):
            kw["layer_id"] = 0
        calls.append((op, functools.partial(getattr(ops, op), p.k, p.v, host, p.dev_idx, p.host_idx, **kw)))
    return calls


def custom_op_calls(p: Pools, check: bool) -> list[tuple[str, Callable[[], None]]]:
    _ops()  # registers torch.ops.hicache_kernels
    host, v = p.host(LAYOUT), [] if p.v is None else [p.v]
    calls = []
    for name, op in (("backup", torch.ops.hicache_kernels.backup), ("load", torch.ops.hicache_kernels.load)):
        for scope, layer in (("layer", 0), ("all_layers", -1)):
            calls.append((f"{name}_{scope}", functools.partial(op, [p.k], v, host, p.dev_idx, p.host_idx, LAYOUT,
                                                               PAGE_SIZE, layer, "direct", check)))  # fmt: skip
    return calls


#: The compat module's names that are not timed: no transfer (the backend switch, the error classes, an
#: address query), or a transfer that does not go through an io-backend (the row-range copy issues its
#: copy-engine copies itself, so the no-op backend cannot stand in for it).
COMPAT_NOT_TIMED = frozenset({
    "use_backend", "ArgumentError", "ArgumentTypeError", "get_device_accessible_ptr",
    "transfer_embedding_ranges_direct",
})  # fmt: skip


def compat_calls(p: Pools) -> list[tuple[str, Callable[[], None]]]:
    """Every sgl-kernel function that fits the pool (the ``_mla`` ones on MLA pools), as sgl-kernel's
    callers pass them: loads per layer from the host, backups of every layer to it."""
    from ..compat import sgl_kernel as sk

    L, item, d, h, page = p.model.num_layers, p.item, p.dev_idx, p.host_idx, PAGE_SIZE
    dim = L * item  # a page-first slot: every layer's item
    lf, pf, pfd = p.host("layer_first"), p.host("page_first"), p.host("page_first_direct")
    k0 = p.k_layers[0]
    if p.model.mla:
        host_layers = list(lf.unbind(0))
        dev_tab, host_tab = p.table(p.k_layers), p.table(host_layers)
        calls = {
            "transfer_kv_per_layer_mla": (sk.transfer_kv_per_layer_mla, lf[0], k0, h, d, item),
            "transfer_kv_per_layer_mla_pf_lf": (sk.transfer_kv_per_layer_mla_pf_lf, pf, k0, h, d, 0, item, dim),
            "transfer_kv_all_layer_mla": (sk.transfer_kv_all_layer_mla, dev_tab, host_tab, d, h, item, L),
            "transfer_kv_all_layer_mla_lf_pf": (sk.transfer_kv_all_layer_mla_lf_pf, dev_tab, pf, d, h, item, dim, L),
            "transfer_kv_direct": (sk.transfer_kv_direct, p.k_layers, host_layers, d, h, page),
            "transfer_kv_all_layer_direct_lf_pf": (sk.transfer_kv_all_layer_direct_lf_pf, p.k_layers, [pfd], d, h,
                                                   page),
            "transfer_kv_per_layer_direct_pf_lf": (sk.transfer_kv_per_layer_direct_pf_lf, [pfd], [k0], h, d, 0, page),
            # SGLang's Mamba state transfers have the MLA page-first shape: one item per slot and layer
            "transfer_kv_mamba_pf_lf": (sk.transfer_kv_mamba_pf_lf, pf, k0, h, d, 0, item, dim),
            "transfer_kv_mamba_lf_pf": (sk.transfer_kv_mamba_lf_pf, dev_tab, pf, d, h, item, dim, L),
        }  # fmt: skip
    else:
        ph, v0, H = p.host("page_head"), p.v_layers[0], p.model.head_num
        host_k, host_v = list(lf[0].unbind(0)), list(lf[1].unbind(0))
        k_tab, v_tab, hk_tab, hv_tab = (p.table(t) for t in (p.k_layers, p.v_layers, host_k, host_v))
        dev_layers = p.k_layers + p.v_layers
        calls = {
            "transfer_kv_per_layer": (sk.transfer_kv_per_layer, lf[0, 0], k0, lf[1, 0], v0, h, d, item),
            "transfer_kv_per_layer_pf_lf": (sk.transfer_kv_per_layer_pf_lf, pf[0], k0, pf[1], v0, h, d, 0, item, dim),
            "transfer_kv_per_layer_ph_lf": (sk.transfer_kv_per_layer_ph_lf, ph[0], k0, ph[1], v0, h, d, 0, item, dim,
                                            page, H),
            "transfer_kv_all_layer": (sk.transfer_kv_all_layer, k_tab, hk_tab, v_tab, hv_tab, d, h, item, L),
            "transfer_kv_all_layer_lf_pf": (sk.transfer_kv_all_layer_lf_pf, k_tab, pf[0], v_tab, pf[1], d, h, item, dim,
                                            L),
            "transfer_kv_all_layer_lf_ph": (sk.transfer_kv_all_layer_lf_ph, k_tab, ph[0], v_tab, ph[1], d, h, item, dim,
                                            L, page, H),
            "transfer_kv_direct": (sk.transfer_kv_direct, dev_layers, host_k + host_v, d, h, page),
            "transfer_kv_all_layer_direct_lf_pf": (sk.transfer_kv_all_layer_direct_lf_pf, dev_layers, [pfd[0], pfd[1]],
                                                   d, h, page),
            "transfer_kv_per_layer_direct_pf_lf": (sk.transfer_kv_per_layer_direct_pf_lf, [pfd[0], pfd[1]], [k0, v0],
                                                   h, d, 0, page),
        }  # fmt: skip
    return [(name, functools.partial(fn, *args)) for name, (fn, *args) in calls.items()]


def layerwise_call(p: Pools, noop: NoopBackend, check: bool) -> Callable[[], None]:
    """``load_layer`` of every layer in turn, as a layer-by-layer load issues them."""
    ops = _ops()
    host, kw = p.host(LAYOUT), {"layout": LAYOUT, "page_size": PAGE_SIZE, "backend": noop, "check_indices": check}

    def load_every_layer() -> None:
        for layer in range(p.model.num_layers):
            ops.load_layer(p.k, p.v, host, p.dev_idx, p.host_idx, layer_id=layer, **kw)

    return load_every_layer


class NotRoutedError(RuntimeError):
    """A timed call did not reach the no-op backend: its figure would include a real copy, or none."""


def time_row(fn: Callable[[], None], noop: NoopBackend, calls: int, per_call: int, what: str) -> benchutil.Stats:
    """Stats (ms) of ``calls`` timed calls of ``fn`` after warm-up; NotRoutedError unless each call
    prepared and issued exactly ``per_call`` copies on ``noop``."""
    warmup = max(HOST_WARMUP_MIN, calls // HOST_WARMUP_FRACTION)
    before = (noop.prepared, noop.issued)
    stats = benchutil.measure(fn, timer=benchutil.HostTimer(), repeats=calls, warmup=warmup)
    expected = (calls + warmup) * per_call
    got = (noop.prepared - before[0], noop.issued - before[1])
    if got != (expected, expected):
        raise NotRoutedError(f"{what}: {calls + warmup} calls prepared {got[0]} and issued {got[1]} copies on the "
                             f"no-op backend, expected {expected} of each: the call does not reach it "
                             "(see hicache_kernels.bench.host_overhead.routed_to)")  # fmt: skip
    return stats


def point(path: str, op: str, p: Pools, check: bool | None, stats: benchutil.Stats, per: int = 1) -> dict[str, Any]:
    """A ``host_overhead`` point; ``per`` > 1: ``stats`` timed blocks of that many calls, reported per call."""
    us = 1e3 / per
    return {
        "kind": "host_overhead", "path": path, "op": op, "pool": p.model.name, "num_layers": p.model.num_layers,
        "mla": p.model.mla, "item_bytes": p.model.item_bytes, "layout": LAYOUT, "page_size": PAGE_SIZE,
        "slots": SLOTS, "check_indices": check, "backend": NoopBackend.name, "device": p.device.type,
        "median_us": stats.median_ms * us, "p10_us": stats.p10_ms * us, "p90_us": stats.p90_ms * us,
        "min_us": stats.min_ms * us, "max_us": stats.max_ms * us, "calls": stats.repeats, "calls_per_sample": per,
    }  # fmt: skip


def measure_host_overhead(calls: int, device: torch.device, progress: benchutil.Progress | None = None) -> list[dict]:
    """Every row (see module docstring), in table order."""
    noop, points = NoopBackend(), []
    with routed_to(noop):
        for model in POOLS:
            p = Pools(model, device)
            for check in (False, True):
                for op, fn in eager_calls(p, noop, check):
                    points.append(point("eager", op, p, check, time_row(fn, noop, calls, 1, f"{op} {model.name}")))
                for op, fn in custom_op_calls(p, check):
                    stats = time_row(fn, noop, calls, 1, f"custom op {op} {model.name}")
                    points.append(point("custom_op", op, p, check, stats))
                L, blocks = model.num_layers, max(HOST_WARMUP_MIN, calls // HOST_WARMUP_FRACTION)
                stats = time_row(layerwise_call(p, noop, check), noop, blocks, L, f"layer-wise load {model.name}")
                points.append(point("layerwise", f"load_layer x {L}", p, check, stats, per=L))
            for op, fn in compat_calls(p):
                points.append(point("compat", op, p, None, time_row(fn, noop, calls, 1, f"{op} {model.name}")))
            if progress is not None:
                progress.step(model.name)
    return points


def run(args: argparse.Namespace, meta: dict[str, Any], prov: dict[str, Any] | None = None) -> int:
    """``python -m hicache_kernels.bench --host-overhead``: measure, print the table, write the outputs (the
    JSON with ``prov``'s keys at its top level: :func:`~hicache_kernels.benchutil.provenance`)."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    where = "CUDA pools, pinned host pools" if on_gpu else "no GPU: CPU pools (the same Python side; no device sync)"
    print(f"bench --host-overhead: {args.calls} timed calls per row on a no-op io-backend, {SLOTS} slots a call, "
          f"{LAYOUT} page {PAGE_SIZE}; {where}")  # fmt: skip
    progress = benchutil.Progress(len(POOLS), "host overhead")
    try:
        points = measure_host_overhead(args.calls, device, progress)
    except NotRoutedError as exc:
        progress.close()
        print(f"bench: --host-overhead: {exc}", file=sys.stderr)
        return 1
    progress.close()
    print(benchutil.format_table(points, COLUMNS))
    for p in points:
        if p["path"] == "layerwise" and p["check_indices"] is False:
            print(f"layer-wise load of {p['pool']} ({p['num_layers']} layers): {p['median_us']:.1f} us of host time "
                  f"per layer (median; p90 {p['p90_us']:.1f} us)")  # fmt: skip
    settings = {"backend": NoopBackend.name, "layout": LAYOUT, "page_size": PAGE_SIZE, "slots": SLOTS,
                "device_slots": DEVICE_SLOTS, "host_slots": HOST_SLOTS, "device": device.type,
                "timer": "time.perf_counter_ns per call (layerwise: per block of num_layers calls)"}  # fmt: skip
    extra = {"mode": MODE, "host_overhead": settings, **(prov or {})}
    for line in benchutil.write_outputs(args.json, args.csv, meta, points, **extra):
        print(line)
    return 0
