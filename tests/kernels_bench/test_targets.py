"""Target evaluation from a bench JSON (synthetic documents: pass, miss and not measured)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hicache_kernels import benchutil
from hicache_kernels.targets import evaluate


def point(backend, ms, *, op="load_all", direction="h2d", page=16, item=2048, sm=4, ceiling_ms=1.0, **extra):
    p = {"kind": "transfer", "model": "m", "backend": backend, "op": op, "direction": direction, "scope": "all",
         "layout": "page_first_direct", "page_size": page, "item_bytes": item, "median_ms": ms,
         "ratio_to_ceiling": ceiling_ms / ms, "sm_budget": None if backend in ("direct", "batch") else sm}  # fmt: skip
    p.update(extra)
    return p


def rows_by_target(doc):
    return {r["target"]: r for r in evaluate(doc)}


def bench_doc(points, **meta):
    """A bench JSON as the bench writes it: its run tags, and every field of a transfer point (the bytes,
    GB/s and ceiling consistent with each point's time and ratio)."""
    full = []
    for p in points:
        if p.get("kind") == "transfer":
            nbytes = 1 << 20
            gbps = nbytes / (p["median_ms"] * 1e-3) / 1e9
            p = {"num_pages": 8, "bytes": nbytes, "gbps": gbps, "ceiling_gbps": gbps / p["ratio_to_ceiling"], **p}
        full.append(p)
    return {"meta": {**benchutil.run_meta("bench", {}), **meta}, "points": full}


def targets_cli(tmp_path, doc, *args):
    path = tmp_path / "bench.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return subprocess.run([sys.executable, "-m", "hicache_kernels.targets", str(path), *args], capture_output=True,
                          text=True)  # fmt: skip


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
    assert [r["status"] for r in rows] == ["pass"] * 7 + ["n/a"] * 5, rows  # no host-overhead points
    by = {r["target"]: r for r in rows}
    assert by["kernel / copy-engine ceiling, h2d, items >= 512 B, <= 4 SMs"]["measured"] == 1 / 1.05


def test_misses_are_reported_with_the_worst_point():
    pts = [
        point("kernel", 1.0, page=1, kernel_over_direct=12.0, kernel_over_batch=1.5, item=1024),
        point("kernel", 2.0, page=64, kernel_over_direct=30.0, kernel_over_batch=1.0),  # ratio 0.5: the worst
        point("kernel", 1.0, page=64, sm=8),  # more than 4 SMs: does not count for target 1
        point("auto", 1.2, page=64),
        point("direct", 1.0, page=64),
        {"kind": "interference", "backend": "kernel", "slowdown": 0.09, "sm_budget": 4},
        {"kind": "interference", "backend": "kernel", "slowdown": 0.3, "sm_budget": 16},  # beyond target 1's SMs
        {"kind": "interference", "backend": "kernel", "slowdown": 0.04, "sm_budget": 1},
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
    inter = by["GEMM slowdown beside a kernel transfer, <= 4 SMs"]
    assert (inter["measured"], inter["status"], inter["worst_at"]) == (0.09, "MISS", "at 4 SMs")
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
    proc = targets_cli(tmp_path, bench_doc([point("kernel", 1.0)]))
    assert proc.returncode == 0 and "kernel / copy-engine ceiling" in proc.stdout and "pass" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "targets: 1 pass, 0 MISS, 11 n/a (not measured in this run, not a miss)"
    proc = targets_cli(tmp_path, bench_doc([point("kernel", 1.0)]), "--json")
    assert proc.returncode == 0 and len(json.loads(proc.stdout)) == 12


def test_cli_exits_1_when_a_target_is_missed(tmp_path):
    proc = targets_cli(tmp_path, bench_doc([point("kernel", 1.0), point("kernel", 2.0, page=64)]))  # 0.5 of ceiling
    assert proc.returncode == 1 and proc.stderr == "", proc.stdout + proc.stderr
    assert "MISS" in proc.stdout and proc.stdout.splitlines()[-1].startswith("targets: 0 pass, 1 MISS, 11 n/a")
    proc = targets_cli(tmp_path, bench_doc([point("kernel", 2.0)]), "--json")
    assert proc.returncode == 1 and [r["status"] for r in json.loads(proc.stdout)][:2] == ["n/a", "MISS"]


def pcie_json(tmp_path):
    """A real pcie JSON (its no-GPU run here) or, on a GPU machine, one with pcie's tags."""
    path = tmp_path / "pcie.json"
    if torch.cuda.is_available():
        benchutil.write_json(path, benchutil.run_meta("pcie", {}), [])
    else:
        proc = subprocess.run([sys.executable, "-m", "hicache_kernels.pcie", "--quick", "--json", str(path)],
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return path.read_text()


def malformed():
    doc = bench_doc([point("kernel", 1.0)])
    del doc["points"][0]["ratio_to_ceiling"]  # evaluate() read it: a KeyError traceback before
    return doc


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: "{}", "not a bench result (it has no meta.tool)"),
        (lambda tmp: "[]", "not a bench result (it has no meta.tool)"),
        (pcie_json, "not a bench result (meta.tool is 'pcie')"),
        (lambda tmp: '{"meta": {"tool": "bench"}, "points": []}', "not a well-formed bench result: meta: missing"),
        (lambda tmp: malformed(), "points[0].ratio_to_ceiling: expected float, got None"),
        (lambda tmp: {**bench_doc([]), "mode": "replay"}, "unknown bench mode 'replay'"),
        (lambda tmp: "{not json", "not JSON: Expecting property name"),
        (lambda tmp: b"\xff\xfe{}", "not a text file"),
        (lambda tmp: None, "No such file or directory"),
        (lambda tmp: tmp, "Is a directory"),
    ],
)
def test_cli_refuses_what_it_cannot_read_in_one_line(tmp_path, make, message):
    made = make(tmp_path)
    path = tmp_path / "bench.json"
    if made is tmp_path:
        path = tmp_path
    elif isinstance(made, bytes):
        path.write_bytes(made)
    elif made is not None:
        path.write_text(made if isinstance(made, str) else json.dumps(made))
    proc = subprocess.run([sys.executable, "-m", "hicache_kernels.targets", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"targets: {path}: "), proc.stderr
    assert message in proc.stderr, proc.stderr


def test_main_is_the_console_script_entry_point(tmp_path, capsys):
    from hicache_kernels import targets

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_doc([point("kernel", 2.0)])))
    assert targets.main([str(path)]) == targets.EXIT_MISS == 1
    with pytest.raises(SystemExit) as exit_:
        targets.main([])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "bench_json" in err


FELL_BACK = "the legacy default stream is refused by cudaMemcpyBatchAsync"


def test_a_batch_fallback_fails_kernel_over_batch_and_shows():
    pts = [
        point("kernel", 1.0, page=1, item=1024, kernel_over_direct=20.0, kernel_over_batch=3.0),
        point("batch", 3.0, page=1, item=1024, batch_fallback=FELL_BACK),
        point("direct", 20.0, page=1, item=1024),
    ]
    by = rows_by_target({"points": pts})
    row = by["kernel / batch, fragments <= 4 KiB"]
    assert row["status"] == "MISS" and (row["measured"], row["fallback"]) == (3.0, FELL_BACK)
    assert "batch fell back to direct" in row["worst_at"] and FELL_BACK in row["worst_at"]
    assert by["kernel / direct at page size 1"]["status"] == "pass"  # direct's figure is unaffected
    pts[1]["batch_fallback"] = None
    assert rows_by_target({"points": pts})["kernel / batch, fragments <= 4 KiB"]["status"] == "pass"


def test_a_batch_fallback_fails_auto_within_5_percent():
    def group(auto_fallback=None, batch_fallback=None):
        return [
            point("kernel", 1.0, page=64),
            point("batch", 1.5, page=64, batch_fallback=batch_fallback),
            point("auto", 1.0, page=64, batch_fallback=auto_fallback),
        ]

    name = "auto time / best backend's time"
    assert rows_by_target({"points": group()})[name]["status"] == "pass"
    for pts in (group(batch_fallback=FELL_BACK), group(auto_fallback=FELL_BACK)):
        row = rows_by_target({"points": pts})[name]
        assert row["status"] == "MISS" and row["fallback"] == FELL_BACK and FELL_BACK in row["worst_at"]


def test_points_of_different_page_counts_are_not_compared():
    pts = [
        point("auto", 30.0, page=16, num_pages=512),  # slower than direct at 8 pages, but moves 64x more
        point("direct", 29.0, page=16, num_pages=512),
        point("auto", 1.0, page=16, num_pages=8),
        point("direct", 0.5, page=16, num_pages=8),
    ]
    row = rows_by_target({"points": pts})["auto time / best backend's time"]
    assert row["measured"] == 2.0  # 1.0 / 0.5 at 8 pages; 30 / 29 at 512 pages; never 30 / 0.5


def test_a_run_whose_link_check_failed_is_refused(tmp_path):
    note = "copy-engine ceiling, h2d, 1048576 B: 80.00 GB/s is above the PCIe link's theoretical 63.02 GB/s"
    doc = bench_doc([point("kernel", 1.0)], link_check={"made": True, "passed": False, "note": note})
    with pytest.raises(ValueError, match="refused this run's figures: copy-engine ceiling"):
        evaluate(doc)
    proc = targets_cli(tmp_path, doc)
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.splitlines()) == 1 and note in proc.stderr
    for check in ({"made": False, "passed": None, "note": "not made: NVML unavailable"}, {"passed": True}):
        by = rows_by_target({"meta": {"link_check": check}, "points": [point("kernel", 1.0)]})
        assert by["kernel / copy-engine ceiling, h2d, items >= 512 B, <= 4 SMs"]["status"] == "pass"


# ---------------------------------------------------------------------------------------------- host overhead
def host_point(path, op, pool, layers, us, check=False, mla=True):
    """A host_overhead point as bench --host-overhead writes it (microseconds per call)."""
    return {"kind": "host_overhead", "path": path, "op": op, "pool": pool, "num_layers": layers, "mla": mla,
            "check_indices": None if path == "compat" else check, "median_us": us, "p90_us": us * 1.1,
            "calls": 100, "backend": "noop"}  # fmt: skip


def host_points(eager=4.0, compat=3.0, custom=12.0, per_layer=5.0, deep_factor=1.2, checked=40.0):
    """The rows of a host-overhead run: a 3-layer MHA and MLA pool and deepseek-v3's 61-layer MLA one;
    the 61-layer pool's calls take ``deep_factor`` times the 3-layer MLA pool's; index-checked calls
    take ``checked`` us."""
    pts = []
    for pool, layers, mla in (("mha-3layer", 3, False), ("mla-3layer", 3, True), ("deepseek-v3", 61, True)):
        f = deep_factor if layers == 61 else 1.0
        for op in ("backup_layer", "load_all_layers"):
            pts.append(host_point("eager", op, pool, layers, eager * f, mla=mla))
            pts.append(host_point("custom_op", op, pool, layers, custom * f, mla=mla))
            pts.append(host_point("eager", op, pool, layers, checked, check=True, mla=mla))
        pts.append(host_point("compat", "transfer_kv_direct", pool, layers, compat * f, mla=mla))
        pts.append(host_point("layerwise", f"load_layer x {layers}", pool, layers, per_layer, mla=mla))
    return pts


HOST_ROWS = ("host us per eager op call, check_indices=False", "host us per compat call",
             "host us per custom-op call, check_indices=False",
             "layer-wise load of a 61-layer pool, host us per layer, check_indices=False",
             "host time, 61-layer / 3-layer pool (eager, custom op, compat)")  # fmt: skip


def test_host_overhead_targets_pass():
    rows = evaluate({"points": host_points()})
    assert [r["status"] for r in rows] == ["n/a"] * 7 + ["pass"] * 5, rows
    by = {r["target"]: r for r in rows}
    assert tuple(by)[7:] == HOST_ROWS
    eager = by[HOST_ROWS[0]]
    assert eager["measured"] == pytest.approx(4.8) and "deepseek-v3 (61 layers)" in eager["worst_at"]
    assert by[HOST_ROWS[3]]["measured"] == 5.0  # only the 61-layer pool's layer-wise load counts
    assert by[HOST_ROWS[4]]["measured"] == pytest.approx(1.2)  # 61 layers over 3, MLA pools only


@pytest.mark.parametrize(
    ("kw", "row", "measured"),
    [
        ({"eager": 10.5}, HOST_ROWS[0], 10.5 * 1.2),
        ({"compat": 9.0}, HOST_ROWS[1], 9.0 * 1.2),
        ({"custom": 21.0}, HOST_ROWS[2], 21.0 * 1.2),
        ({"per_layer": 26.0}, HOST_ROWS[3], 26.0),
        ({"deep_factor": 2.0}, HOST_ROWS[4], 2.0),
    ],
)
def test_host_overhead_targets_miss(kw, row, measured):
    by = rows_by_target({"points": host_points(**kw)})
    assert (by[row]["status"], by[row]["measured"]) == ("MISS", pytest.approx(measured)), by[row]
    assert [r["status"] for t, r in by.items() if t in HOST_ROWS and t != row] == ["pass"] * 4
    assert "deepseek-v3 (61 layers)" in by[row]["worst_at"]


def test_host_overhead_targets_judge_unchecked_calls_only():
    """check_indices=True calls (on a GPU: a device sync) are reported, not judged; a slow 3-layer
    layer-wise load is not the 61-layer target's."""
    pts = host_points(checked=500.0)
    pts.append(host_point("layerwise", "load_layer x 3", "mla-3layer", 3, 100.0))
    assert [r["status"] for r in evaluate({"points": pts})][7:] == ["pass"] * 5
    # A 61-layer pool whose index-checked calls grow with the layers still fails "not growing".
    pts.append(host_point("eager", "load_layer", "deepseek-v3", 61, 90.0, check=True))
    pts.append(host_point("eager", "load_layer", "mla-3layer", 3, 30.0, check=True))
    growth = rows_by_target({"points": pts})[HOST_ROWS[4]]
    assert (growth["status"], growth["measured"]) == ("MISS", 3.0) and "check_indices=True" in growth["worst_at"]


def test_host_overhead_json_through_the_cli(tmp_path):
    doc = {**bench_doc(host_points()), "mode": "host-overhead"}
    proc = targets_cli(tmp_path, doc)
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert "is a bench --host-overhead run" in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("targets: 5 pass, 0 MISS, 7 n/a")
    doc = {**bench_doc(host_points(custom=40.0)), "mode": "host-overhead"}
    proc = targets_cli(tmp_path, doc)
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1].startswith("targets: 4 pass, 1 MISS, 7 n/a")
    broken = {**bench_doc(host_points()), "mode": "host-overhead"}
    del broken["points"][0]["median_us"]
    proc = targets_cli(tmp_path, broken)
    assert proc.returncode == 2 and "points[0].median_us: expected float, got None" in proc.stderr
