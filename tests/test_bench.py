"""The bench CLI and the timing harness, on CPU (a fake timer stands in for CUDA events)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from hicache_kernels import bench, benchutil


class FakeTimer:
    """Calls ``fn`` (so the work really runs) and reports the next scripted duration."""

    def __init__(self, times_ms):
        self.times = list(times_ms)
        self.calls = 0

    def time_ms(self, fn):
        fn()
        t = self.times[self.calls % len(self.times)]
        self.calls += 1
        return t


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hicache_kernels.bench", *args], capture_output=True, text=True)


def test_help():
    proc = cli("--help")
    assert proc.returncode == 0 and "--quick" in proc.stdout and "--sm-sweep" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-GPU mode")
def test_no_gpu_mode_runs_the_functional_check(tmp_path):
    out = tmp_path / "bench.json"
    proc = cli("--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bandwidth needs a CUDA GPU" in proc.stdout and "no GB/s" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["mode"] == "cpu-functional-check" and doc["points"] == []
    assert bench.validate_bench_json(doc) == []
    checks = doc["functional_check"]
    assert {c["backend"] for c in checks} == {"direct", "batch", "auto", "triton"}
    assert all(c["ok"] for c in checks) and len(checks) == 4 * 7 * 3


def test_measure_uses_warmup_prepare_and_quantiles():
    calls = {"prepare": 0, "fn": 0}
    timer = FakeTimer([5.0, 1.0, 3.0, 2.0, 4.0])
    stats = benchutil.measure(
        lambda: calls.__setitem__("fn", calls["fn"] + 1), timer=timer, repeats=5, warmup=2,
        prepare=lambda: calls.__setitem__("prepare", calls["prepare"] + 1),
    )  # fmt: skip
    assert calls == {"prepare": 7, "fn": 7} and timer.calls == 5
    assert (stats.median_ms, stats.min_ms, stats.max_ms, stats.repeats) == (3.0, 1.0, 5.0, 5)
    assert stats.p10_ms == pytest.approx(1.4) and stats.p90_ms == pytest.approx(4.6)


def test_summarize_edge_cases():
    assert benchutil.summarize([2.0]).p90_ms == 2.0
    with pytest.raises(ValueError, match="times_ms"):
        benchutil.summarize([])
    with pytest.raises(ValueError, match="repeats"):
        benchutil.measure(lambda: None, timer=FakeTimer([1.0]), repeats=0)
    assert benchutil.gbps(2_000_000_000, 1000.0) == pytest.approx(2.0)


def test_plan_sweep_quick_and_full():
    quick = bench.plan_sweep(bench.parse_args(["--quick"]))
    main = [p for p in quick if p.sm_budget in (None, 4)]
    assert len(main) == 3 * 2 * 3 * 5  # page sizes x layouts x ops x backends
    sweep = [p for p in quick if p.backend == "kernel" and p.sm_budget != 4]
    assert {p.sm_budget for p in sweep} == {1, 2, 8, 16} and {p.page_size for p in sweep} == {16}
    assert all(p.sm_budget is None for p in quick if p.backend in ("direct", "batch"))
    full = bench.plan_sweep(bench.parse_args(["--preset", "deepseek-v3", "--backends", "kernel,direct"]))
    assert {p.layout for p in full} == {"layer_first", "page_first", "page_first_direct"}  # MLA: no page_head
    assert {p.num_pages * p.page_size for p in full} == {4096}


def test_num_pages_sweep():
    specs = bench.plan_sweep(bench.parse_args(["--num-pages", "2,8", "--page-sizes", "16", "--layouts", "page_first",
                                               "--backends", "direct", "--directions", "load_all"]))  # fmt: skip
    assert [(s.num_pages, s.num_tokens) for s in specs] == [(2, 32), (8, 128)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backends", "dma"], "--backends"),
        (["--directions", "sideways"], "--directions"),
        (["--preset", "gpt5"], "--preset"),
        (["--preset", "custom", "--layers", "2"], "--kv-heads"),
    ],
)
def test_bad_arguments(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench.plan_sweep(bench.parse_args(argv))


def custom_specs(backends):
    args = bench.parse_args(["--preset", "custom", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                             "--dtype", "float16", "--page-sizes", "1,4", "--tokens", "8", "--layouts",
                             "page_first,page_head", "--backends", backends, "--sm-sweep", ""])  # fmt: skip
    return bench.plan_sweep(args)


def test_run_sweep_on_cpu_with_a_fake_timer():
    specs = custom_specs("direct,batch")
    timer = FakeTimer([2.0])
    points = bench.run_sweep(specs, device=torch.device("cpu"), timer=timer, repeats=3, warmup=1, tokens=8,
                             pin=False)  # fmt: skip
    assert len(points) == len(specs) == 2 * 2 * 3 * 2
    doc = {"meta": benchutil.run_meta("bench", {}), "points": points}
    assert bench.validate_bench_json(doc) == []
    p = next(p for p in points if p["op"] == "load_all" and p["layout"] == "page_head" and p["page_size"] == 4)
    assert p["bytes"] == 8 * 2 * 2 * (2 * 8 * 2)  # tokens x layers x K/V x item bytes
    assert p["median_ms"] == 2.0 and p["gbps"] == pytest.approx(p["bytes"] / 2e-3 / 1e9)
    assert p["ratio_to_ceiling"] == pytest.approx(1.0)  # the fake timer times the ceiling alike
    assert p["scope"] == "all" and p["direction"] == "h2d" and p["sm_budget"] is None


@pytest.mark.parametrize("backends", ["direct,batch", "triton"])
def test_refcheck_verifies_every_point(backends):
    specs = custom_specs(backends)
    points = bench.run_sweep(specs, device=torch.device("cpu"), timer=FakeTimer([1.0]), repeats=1, warmup=0,
                             tokens=8, pin=False, refcheck=True)  # fmt: skip
    assert [p["refcheck"] for p in points] == [True] * len(specs)


def test_refcheck_catches_a_wrong_copy(monkeypatch):
    from hicache_kernels import ops

    real = ops.transfer

    def off_by_one(direction, k, v, host, d, h, **kw):  # moves the right data to the wrong host slots
        real(direction, k, v, host, d, (h + 1) % 8, **kw)

    monkeypatch.setattr(ops, "transfer", off_by_one)
    specs = [s for s in custom_specs("direct") if s.page_size == 1]
    points = bench.run_sweep(specs, device=torch.device("cpu"), timer=FakeTimer([1.0]), repeats=1, warmup=0,
                             tokens=8, pin=False, refcheck=True)  # fmt: skip
    assert not any(p["refcheck"] for p in points)


def test_kernel_ratios_match_times():
    points = [
        {"kind": "transfer", "model": "m", "backend": b, "op": "load_all", "layout": "x", "page_size": 1,
         "median_ms": t}
        for b, t in (("kernel", 1.0), ("direct", 12.0), ("batch", 3.0))
    ]  # fmt: skip
    bench.add_ratios(points)
    assert points[0]["kernel_over_direct"] == 12.0 and points[0]["kernel_over_batch"] == 3.0


def tune_points(rows):
    return [
        {"kind": "transfer", "model": "m", "op": "load_all", "layout": "x", "page_size": page, "item_bytes": 1024,
         "backend": b, "median_ms": ms, "sm_budget": None if b in ("direct", "batch") else 4}
        for page, times in rows
        for b, ms in times.items()
    ]  # fmt: skip


def test_tune_auto_finds_the_crossover():
    pts = tune_points([(1, {"kernel": 1.0, "direct": 9.0}), (16, {"kernel": 1.0, "batch": 1.5}),
                       (64, {"kernel": 2.0, "batch": 1.8}), (128, {"kernel": 3.0, "direct": 2.5})])  # fmt: skip
    assert bench.tune_auto(pts, 4) == {"kernel_max_fragment_bytes": 64 * 1024}


def test_tune_auto_when_the_kernel_always_wins_or_data_is_missing():
    pts = tune_points([(1, {"kernel": 1.0, "direct": 9.0}), (128, {"kernel": 1.0, "direct": 2.0})])
    assert bench.tune_auto(pts, 4) == {"kernel_max_fragment_bytes": 128 * 1024 + 1}
    # A copy-engine win below a kernel win does not move the threshold down.
    pts = tune_points([(1, {"kernel": 2.0, "direct": 1.0}), (128, {"kernel": 1.0, "direct": 2.0})])
    assert bench.tune_auto(pts, 4) == {"kernel_max_fragment_bytes": 128 * 1024 + 1}
    with pytest.raises(ValueError, match="points"):
        bench.tune_auto(tune_points([(1, {"kernel": 1.0})]), 4)


def test_validate_bench_json_reports_problems():
    good = {"kind": "transfer", "backend": "kernel", "direction": "d2h", "scope": "all", "layout": "page_first",
            "page_size": 1, "item_bytes": 256, "num_pages": 4, "bytes": 1000, "median_ms": 1.0, "gbps": 1e-3,
            "ceiling_gbps": 2e-3, "sm_budget": 4}  # fmt: skip
    meta = benchutil.run_meta("bench", {})
    assert bench.validate_bench_json({"meta": meta, "points": [good]}) == []
    bad = [
        {**good, "gbps": 5.0},
        {**good, "direction": "up"},
        {**good, "backend": "direct", "sm_budget": 4},
        {**good, "page_size": "1"},
    ]
    for p in bad:
        assert bench.validate_bench_json({"meta": meta, "points": [p]}), p
    assert bench.validate_bench_json({"points": []})
    assert bench.validate_bench_json({"meta": {}, "points": []})


def test_outputs(tmp_path):
    specs = custom_specs("direct")
    points = bench.run_sweep(specs, device=torch.device("cpu"), timer=FakeTimer([1.0, 2.0]), repeats=2, warmup=0,
                             tokens=8, pin=False)  # fmt: skip
    meta = benchutil.run_meta("bench", {"quick": False})
    benchutil.write_json(tmp_path / "b.json", meta, points)
    benchutil.write_csv(tmp_path / "b.csv", meta, points)
    assert json.loads((tmp_path / "b.json").read_text())["points"] == json.loads(json.dumps(points))
    rows = list(csv.DictReader(open(tmp_path / "b.csv")))
    assert len(rows) == len(points) and rows[0]["meta_tool"] == "bench" and "gbps" in rows[0]
    table = benchutil.format_table(points, bench.TABLE)
    assert table.splitlines()[0].split()[:3] == ["model", "op", "layout"] and len(table.splitlines()) == 1 + len(points)
    pytest.importorskip("matplotlib")
    bench.plot(str(tmp_path / "b.png"), points)
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar(capsys):
    bar = benchutil.Progress(2, "bench", force=True)
    bar.step("a")
    bar.step("b")
    bar.close()
    err = capsys.readouterr().err
    assert "2/2" in err and "#" * 30 in err


@pytest.mark.gpu
def test_quick_bench_on_gpu_writes_sane_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = cli("--preset", "custom", "--layers", "4", "--kv-heads", "2", "--head-dim", "128", "--page-sizes", "1,16",
               "--tokens", "256", "--layouts", "page_first_direct", "--repeats", "3", "--warmup", "1",
               "--sm-sweep", "1,2", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert bench.validate_bench_json(doc) == []
    transfer = [p for p in doc["points"] if p["kind"] == "transfer"]
    assert transfer and all(p["gbps"] > 0 and p["ceiling_gbps"] > 0 for p in transfer)
    for p in transfer:
        assert p["ratio_to_ceiling"] == pytest.approx(p["gbps"] / p["ceiling_gbps"])
    assert doc["meta"]["gpu"]
