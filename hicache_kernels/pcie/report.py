"""How a pcie run reads: the bandwidth and latency tables, peak lines, and the GB/s-vs-size plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import benchutil
from ..benchutil import format_bytes
from .planning import DIRECTIONS

# Which point a row is, first in both tables.
_POINT_COLUMNS = [("method", "method"), ("memory", "memory"), ("direction", "dir"), ("sm_budget", "SMs"),
                  ("size", "size")]  # fmt: skip
BANDWIDTH_COLUMNS = [
    *_POINT_COLUMNS,
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
    *_POINT_COLUMNS,
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
    bw = [p for p in points if p["kind"] == "bandwidth" and p.get("gbps")]
    if not bw:
        raise ValueError("no bandwidth points to plot")
    directions = [d for d in DIRECTIONS if any(p["direction"] == d for p in bw)]
    fig = benchutil.new_figure(figsize=(6 * len(directions), 4.8), layout="constrained")
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
    return benchutil.save_figure(fig, path)
