"""Target evaluation from a bench JSON (synthetic documents: pass, miss and not measured)."""

from __future__ import annotations

import json
import subprocess
import sys

from hicache_kernels.targets import evaluate


def point(backend, ms, *, op="load_all", direction="h2d", page=16, item=2048, sm=4, ceiling_ms=1.0, **extra):
    p = {"kind": "transfer", "model": "m", "backend": backend, "op": op, "direction": direction, "scope": "all",
         "layout": "page_first_direct", "page_size": page, "item_bytes": item, "median_ms": ms,
         "ratio_to_ceiling": ceiling_ms / ms, "sm_budget": None if backend in ("direct", "batch") else sm}  # fmt: skip
    p.update(extra)
    return p


def rows_by_target(doc):
    return {r["target"]: r for r in evaluate(doc)}


def test_all_targets_pass():
    pts = []
    for direction, op in (("h2d", "load_all"), ("d2h", "backup_all")):
        for page in (1, 16):
            pts += [
                point("kernel", 1.05, op=op, direction=direction, page=page, item=1024, kernel_over_direct=20.0,
                      kernel_over_batch=3.0),
                point("direct", 21.0, op=op, direction=direction, page=page, item=1024),
                point("batch", 3.15, op=op, direction=direction, page=page, item=1024),
                point("auto", 1.06, op=op, direction=direction, page=page, item=1024),
            ]  # fmt: skip
    pts.append({"kind": "interference", "backend": "kernel", "slowdown": 0.02})
    pts.append({"kind": "overlap", "overlap_ratio": 1.01, "transfer_le_compute": True})
    rows = evaluate({"points": pts})
    assert [r["status"] for r in rows] == ["pass"] * 7, rows
    by = {r["target"]: r for r in rows}
    assert by["kernel / copy-engine ceiling, h2d, items >= 512 B, <= 4 SMs"]["measured"] == 1 / 1.05


def test_misses_are_reported_with_the_worst_point():
    pts = [
        point("kernel", 1.0, page=1, kernel_over_direct=12.0, kernel_over_batch=1.5, item=1024),
        point("kernel", 2.0, page=64, kernel_over_direct=30.0, kernel_over_batch=1.0),  # ratio 0.5: the worst
        point("kernel", 1.0, page=64, sm=8),  # more than 4 SMs: does not count for target 1
        point("auto", 1.2, page=64),
        point("direct", 1.0, page=64),
        {"kind": "interference", "backend": "kernel", "slowdown": 0.09},
        {"kind": "interference", "backend": "direct", "slowdown": 0.5},  # only the kernel's counts
        {"kind": "overlap", "overlap_ratio": 1.3, "transfer_le_compute": True},
    ]
    by = rows_by_target({"points": pts})
    t1 = by["kernel / copy-engine ceiling, h2d, items >= 512 B, <= 4 SMs"]
    assert (t1["status"], t1["measured"]) == ("MISS", 0.5) and "page 64" in t1["worst_at"]
    assert by["kernel / copy-engine ceiling, d2h, items >= 512 B, <= 4 SMs"]["status"] == "n/a"
    assert by["kernel / direct at page size 1"]["status"] == "pass"
    batch = by["kernel / batch, fragments <= 4 KiB"]
    assert (batch["status"], batch["measured"]) == ("MISS", 1.5)  # 1 KiB item x page 1; page 64 is too large
    assert by["auto time / best backend's time"]["measured"] == 1.2
    assert by["GEMM slowdown beside a kernel transfer"]["measured"] == 0.09
    assert by["overlapped load / compute-only"]["status"] == "MISS"


def test_small_items_and_slow_transfers_are_outside_the_targets():
    pts = [
        point("kernel", 5.0, item=256),
        {"kind": "overlap", "overlap_ratio": 1.5, "transfer_le_compute": False},
    ]
    by = rows_by_target({"points": pts})
    assert by["kernel / copy-engine ceiling, h2d, items >= 512 B, <= 4 SMs"]["status"] == "n/a"
    over = by["overlapped load / compute-only"]
    assert over["status"] == "n/a" and "does not apply" in over["worst_at"]


def test_cli(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {}, "points": [point("kernel", 1.0)]}))
    proc = subprocess.run([sys.executable, "-m", "hicache_kernels.targets", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0 and "kernel / copy-engine ceiling" in proc.stdout and "pass" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "hicache_kernels.targets", str(path), "--json"], capture_output=True,
                          text=True)  # fmt: skip
    assert len(json.loads(proc.stdout)) == 7
