"""What a bench run reports: the JSON schema and its validation, the table, the plot, the link check."""

from __future__ import annotations

from typing import Any

import torch

from .. import benchutil
from .config import DIRECTIONS, LINK_TOLERANCE, UNBUDGETED_BACKENDS

TRANSFER_FIELDS = {
    "model": str, "backend": str, "op": str, "direction": str, "scope": str, "layout": str, "page_size": int,
    "item_bytes": int, "num_pages": int, "bytes": int, "median_ms": float, "gbps": float, "ceiling_gbps": float,
    "ratio_to_ceiling": float,
}  # fmt: skip
# The paths --host-overhead times (hicache_kernels.bench.host_overhead).
HOST_OVERHEAD_PATHS = ("eager", "custom_op", "compat", "layerwise")
# Fields of the other kinds that hicache_kernels.targets reads.
POINT_FIELDS = {
    "transfer": TRANSFER_FIELDS,
    "interference": {"backend": str, "slowdown": float},
    "overlap": {"overlap_ratio": float, "transfer_le_compute": bool},
    "host_overhead": {"path": str, "op": str, "pool": str, "num_layers": int, "median_us": float, "p90_us": float,
                      "calls": int},
}  # fmt: skip
OPTIONAL_FIELDS = {"kernel_over_direct": float, "kernel_over_batch": float, "batch_fallback": str}  # or null


def _is(value: Any, typ: type) -> bool:
    """``isinstance`` where a JSON true/false is not a number."""
    return isinstance(value, typ) and (typ is bool or not isinstance(value, bool))


def validate_bench_json(doc: Any) -> list[str]:
    """Problems with a bench JSON document (empty when it is well formed): what the bench writes and
    every field :mod:`hicache_kernels.targets` reads."""
    if not isinstance(doc, dict) or not {"meta", "points"} <= set(doc):
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        return [f"top level: expected an object with keys meta and points, got {got}"]
    if not isinstance(doc["meta"], dict) or not isinstance(doc["points"], list):
        return ["top level: expected meta to be an object and points a list"]
    errors = []
    for key in ("tool", "time_utc", "package_version", "git_commit", "torch", "gpu", "driver"):
        if key not in doc["meta"]:
            errors.append(f"meta: missing {key!r}")
    for i, p in enumerate(doc["points"]):
        kind = p.get("kind") if isinstance(p, dict) else None
        if kind not in POINT_FIELDS:
            errors.append(f"points[{i}]: expected an object of kind {', '.join(POINT_FIELDS)}, got {p!r:.80}")
            continue
        for key, typ in POINT_FIELDS[kind].items():
            if not _is(p.get(key), typ):
                errors.append(f"points[{i}].{key}: expected {typ.__name__}, got {p.get(key)!r}")
        for key, typ in OPTIONAL_FIELDS.items():
            if p.get(key) is not None and not _is(p[key], typ):
                errors.append(f"points[{i}].{key}: expected {typ.__name__} or null, got {p[key]!r}")
        if kind == "host_overhead":
            errors += _host_overhead_problems(i, p)
        if kind != "transfer":
            continue
        if p.get("direction") not in ("d2h", "h2d") or p.get("scope") not in ("layer", "all"):
            errors.append(f"points[{i}]: direction/scope {p.get('direction')}/{p.get('scope')}")
        if DIRECTIONS.get(p.get("op")) not in (None, (p.get("direction"), p.get("scope"))):
            errors.append(f"points[{i}].op: {p['op']} is not {p.get('direction')}/{p.get('scope')}")
        elif p.get("op") not in DIRECTIONS:
            errors.append(f"points[{i}].op: expected one of {', '.join(DIRECTIONS)}, got {p.get('op')!r}")
        sm = p.get("sm_budget", "missing")
        if sm is not None and (p.get("backend") in UNBUDGETED_BACKENDS or not _is(sm, int)):
            errors.append(f"points[{i}].sm_budget: expected null for copy-engine backends, an int otherwise")
        timed = all(_is(p.get(k), t) for k, t in (("gbps", float), ("median_ms", float), ("bytes", int)))
        if timed and p["median_ms"] > 0:
            expect = p["bytes"] / (p["median_ms"] * 1e-3) / 1e9
            if abs(p["gbps"] - expect) > 1e-6 * max(1.0, expect):
                errors.append(f"points[{i}].gbps: {p['gbps']} inconsistent with bytes/median_ms ({expect})")
    return errors


def _host_overhead_problems(i: int, p: dict[str, Any]) -> list[str]:
    errors = []
    if p.get("path") not in HOST_OVERHEAD_PATHS:
        errors.append(f"points[{i}].path: expected one of {', '.join(HOST_OVERHEAD_PATHS)}, got {p.get('path')!r}")
    check = p.get("check_indices", "missing")
    if check is not None and not _is(check, bool):
        errors.append(f"points[{i}].check_indices: expected true, false or null, got {check!r}")
    if _is(p.get("median_us"), float) and _is(p.get("p90_us"), float) and p["p90_us"] < p["median_us"]:
        errors.append(f"points[{i}].p90_us: {p['p90_us']} is below median_us {p['median_us']}")
    return errors


def plot(path: str, points: list[dict[str, Any]], sm_budget: int | None = None) -> None:
    """GB/s vs page size per backend, one panel per (model, op, layout), the ceiling dashed. Kernel
    points are those of ``sm_budget`` (the main sweep's) when given."""
    transfer = [p for p in points if p.get("kind") == "transfer"]
    panels = sorted({(p["model"], p["op"], p["layout"]) for p in transfer})
    if not panels:
        raise SystemExit("--plot: no transfer points to plot")
    try:
        fig = benchutil.new_figure(figsize=(7, 3.2 * len(panels)))
    except benchutil.PlotUnavailableError as exc:
        raise SystemExit(str(exc)) from exc
    axes = fig.subplots(len(panels), 1, squeeze=False)
    for ax, (model, op, layout) in zip(axes[:, 0], panels, strict=True):
        sel = [p for p in transfer if (p["model"], p["op"], p["layout"]) == (model, op, layout)]
        for backend in sorted({p["backend"] for p in sel}):
            pts = [p for p in sel if p["backend"] == backend]
            if backend == "kernel" and sm_budget is not None:
                pts = [p for p in pts if p["sm_budget"] == sm_budget]
            pts.sort(key=lambda p: p["page_size"])
            if pts:
                ax.plot([p["page_size"] for p in pts], [p["gbps"] for p in pts], marker="o", label=backend)
        ceil = sorted(sel, key=lambda p: p["page_size"])
        ax.plot([p["page_size"] for p in ceil], [p["ceiling_gbps"] for p in ceil], "k--", label="copy-engine ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page size (tokens)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{model}: {op}, {layout}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    benchutil.save_figure(fig, path)


TABLE = [
    ("model", "model"), ("op", "op"), ("layout", "layout"), ("page_size", "page"), ("backend", "backend"),
    ("sm_budget", "SMs"), ("median_ms", "ms"), ("gbps", "GB/s"), ("ceiling_gbps", "ceil"),
    ("ratio_to_ceiling", "/ceil"), ("kernel_over_direct", "k/direct"), ("kernel_over_batch", "k/batch"),
]  # fmt: skip


def link_bandwidth() -> tuple[float | None, dict[str, Any]]:
    """The current GPU's PCIe link as NVML reports it: its theoretical one-direction GB/s (None when
    NVML cannot say) and the link facts (``error`` says why not)."""
    return benchutil.device_link(torch.cuda.current_device())


def link_check_meta(link_gbps: float | None, why_not: str, problem: str | None = None) -> dict[str, Any]:
    """``meta.link_check``: whether every ceiling and point was checked against the link, and how it went."""
    check = {"made": link_gbps is not None, "passed": None, "tolerance": LINK_TOLERANCE}
    if link_gbps is None:
        return {**check, "note": f"not made: the link's theoretical bandwidth is unknown ({why_not})"}
    if problem is not None:
        return {**check, "passed": False, "note": problem}
    limit = link_gbps * (1 + LINK_TOLERANCE)
    return {**check, "passed": True, "note": f"every ceiling and point <= {limit:.2f} GB/s"}


def format_tuned(tuned: dict) -> list[str]:
    """``bench --tune-auto``'s result as lines: per direction, each fragment-size bucket's designs
    fastest first, then the single kernel-vs-copy-engine threshold."""
    lines = [f"auto: designs ranked per direction and fragment size (kernel designs at {tuned.get('sm_budget')} SMs):"]
    for direction, buckets in sorted(tuned.get("table", {}).items()):
        for bucket, ranking in sorted(buckets.items(), key=lambda kv: int(kv[0])):
            lines.append(f"  {direction}  fragments >= {_size(int(bucket)):>8}: {' > '.join(ranking)}")
    lines.append(f"  kernel_max_fragment_bytes: {tuned.get('kernel_max_fragment_bytes')}")
    return lines


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
