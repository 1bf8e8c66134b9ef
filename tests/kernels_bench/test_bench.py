"""The bench CLI and the timing harness, on CPU (a fake timer stands in for CUDA events)."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from provenancecheck import check_provenance

from hicache_kernels import bench, benchutil, targets
from hicache_kernels.backends import AutoBackend, BatchBackend, IOBackend
from hicache_kernels.bench import memory as bench_memory
from hicache_kernels.bench import sweep as bench_sweep


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
    argv = ["--quick", "--json", str(out), "--csv", str(tmp_path / "b.csv"), "--plot", str(tmp_path / "b.png"),
            "--tune-auto", str(tmp_path / "auto.json")]  # fmt: skip
    proc = cli(*argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bandwidth needs a CUDA GPU" in proc.stdout and "no GB/s" in proc.stdout
    # What it could not do is named, in one line (--quick's own interference and overlap are not).
    notice = [line for line in proc.stdout.splitlines() if "ignored without a GPU" in line]
    assert notice == ["bench: ignored without a GPU: --csv, --plot, --tune-auto (they need measured points)"]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["bench.json"]
    # targets reads the functional check as all n/a: not a miss, exit 0.
    proc = subprocess.run([sys.executable, "-m", "hicache_kernels.targets", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert "no-GPU functional check" in proc.stdout and proc.stdout.splitlines()[-1].startswith(
        "targets: 0 pass, 0 MISS, 12 n/a"
    )
    doc = json.loads(out.read_text())
    assert doc["mode"] == "cpu-functional-check" and doc["points"] == []
    assert bench.validate_bench_json(doc) == []
    check_provenance(doc, "hicache_kernels.bench", argv)
    assert doc["meta"]["link_theoretical_gbps"] is None and doc["meta"]["link_check"]["made"] is False
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
    assert len(main) == 3 * 2 * 3 * 7  # page sizes x layouts x ops x backends (two kernel designs, staged)
    for kernel in ("kernel", "kernel-bulk"):  # each kernel design's SM-budget sweep
        sweep = [p for p in quick if p.backend == kernel and p.sm_budget != 4]
        assert {p.sm_budget for p in sweep} == {1, 2, 8, 16} and {p.page_size for p in sweep} == {16}
    assert all(p.sm_budget is None for p in quick if p.backend in ("direct", "batch"))
    full = bench.plan_sweep(bench.parse_args(["--preset", "deepseek-v3", "--backends", "kernel,direct"]))
    assert {p.layout for p in full} == {"layer_first", "page_first", "page_first_direct"}  # MLA: no page_head
    assert {p.num_pages * p.page_size for p in full} == {4096}


def test_num_pages_sweep():
    specs = bench.plan_sweep(bench.parse_args(["--num-pages", "2,8", "--page-sizes", "16", "--layouts", "page_first",
                                               "--backends", "direct", "--directions", "load_all"]))  # fmt: skip
    assert [(s.num_pages, s.num_tokens) for s in specs] == [(2, 32), (8, 128)]


CUSTOM = ["--preset", "custom", "--layers", "2", "--kv-heads", "2", "--head-dim", "8"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backends", "dma"], "--backends: unknown 'dma'"),
        (["--backends", ""], "--backends: empty"),
        (["--directions", "sideways"], "--directions: unknown 'sideways'"),
        (["--layouts", "diagonal"], "--layouts: unknown 'diagonal'"),
        (["--preset", "gpt5"], "--preset: unknown 'gpt5'"),
        (["--preset", "all,llama3-8b"], "--preset: 'all' and 'custom' stand alone"),
        (["--preset", "custom", "--layers", "2"], "--preset custom needs --kv-heads --head-dim"),
        (["--layers", "2"], "--layers: describes a custom model; it needs --preset custom"),
        (["--dtype", "float16"], "--dtype: describes a custom model"),
        ([*CUSTOM[:-1], "0"], "--head-dim: expected an integer >= 1, got 0"),
        ([*CUSTOM, "--mla"], "--kv-heads: an MLA model (--mla) has one latent head; expected 1, got 2"),
        (["--preset", "deepseek-v3", "--layouts", "page_head"], "--layouts: deepseek-v3 is MLA"),
        (["--page-sizes", "0"], "--page-sizes: expected integers >= 1, got 0"),
        (["--page-sizes", "16,-4"], "--page-sizes: expected integers >= 1, got -4"),
        (["--page-sizes", "16,16"], "--page-sizes: 16 is given twice"),
        (["--page-sizes", "sixteen"], "--page-sizes: 'sixteen' is not an integer"),
        (["--page-sizes", ","], "--page-sizes: empty"),
        (["--num-pages", "8,0"], "--num-pages: expected integers >= 1, got 0"),
        (["--tokens", "0"], "--tokens: expected an integer >= 1, got 0"),
        (["--repeats", "0"], "--repeats: expected an integer >= 1, got 0"),
        (["--quick", "--repeats", "-1"], "--repeats: expected an integer >= 1, got -1"),
        (["--warmup", "-1"], "--warmup: expected an integer >= 0, got -1"),
        (["--sm-budget", "0"], "--sm-budget: expected an integer >= 1, got 0"),
        (["--sm-sweep", "1,0"], "--sm-sweep: expected integers >= 1, got 0"),
        (["--tune-auto", "--backends", "kernel,triton"], "--tune-auto: ranks auto's designs against each other"),
        (
            ["--tune-auto", "--backends", "staged,auto"],
            "--tune-auto: ranks auto's designs against each other: "
            "--backends needs two or more of kernel, kernel-bulk, staged, batch, direct, got staged,auto",
        ),  # fmt: skip
        (["--num-pages", str(10**12)], "--num-pages: up to 128,000,000,000,000 tokens a point"),
        (["--calls", "5"], "--calls: counts --host-overhead's calls; it needs --host-overhead"),
        (["--host-overhead", "--calls", "0"], "--calls: expected an integer >= 1, got 0"),
        (["--host-overhead", "--page-sizes", "16"], "--page-sizes: an option of the transfer sweep"),
        (["--host-overhead", "--refcheck"], "--refcheck: an option of the transfer sweep"),
        (["--host-overhead", "--quick"], "argument --quick: not allowed with argument --host-overhead"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_naming_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"python -m hicache_kernels.bench: error: {message}"), err


def test_bad_arguments_on_the_command_line_print_no_traceback():
    # --page-sizes 0 divided by zero; --num-pages 10**12 tried a 58 EiB allocation on a GPU.
    for argv in (["--page-sizes", "0"], ["--num-pages", str(10**12)], ["--preset", "gpt5"]):
        proc = cli(*argv)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and argv[0] in proc.stderr and "Traceback" not in proc.stderr


def test_the_memory_refusal_names_the_size(monkeypatch, capsys):
    """The estimate against this machine's RAM (MemTotal without a GPU): a run that fits passes, one
    that needs more is refused with both sizes."""
    small = [*CUSTOM, "--page-sizes", "1,16", "--backends", "direct"]
    args = bench.parse_args([*small, "--tokens", "64"])
    host, _ = bench.run_memory(args, bench.plan_sweep(args))
    monkeypatch.setattr(bench_memory, "host_memory", lambda field: host if field == "MemTotal" else None)
    bench.parse_args([*small, "--tokens", "64"])  # exactly fits
    with pytest.raises(SystemExit):
        bench.parse_args([*small, "--tokens", "65"])
    err = capsys.readouterr().err
    assert "--tokens: up to 65 tokens a point" in err and "of pinned host memory, more than the" in err
    assert benchutil.format_bytes(host, 1) in err


def test_run_memory_counts_what_the_sweep_allocates():
    """The estimate uses the sizes the run allocates: the Workload's pools and the largest ceiling."""
    args = bench.parse_args([*CUSTOM, "--tokens", "40", "--page-sizes", "3,16", "--backends", "direct"])
    specs = bench.plan_sweep(args)
    host, device = bench.run_memory(args, specs)
    tokens = max(s.num_tokens for s in specs)
    work = bench.Workload(specs[0].model, tokens, torch.device("cpu"), pin=False, page_sizes={3, 16})
    pools = work.dev_k.nbytes + work.dev_v.nbytes
    assert host == work.host_flat.nbytes == pools and device == pools + max(s.nbytes for s in specs)


def test_page_sizes_that_do_not_divide_128_run():
    # The pools were a multiple of 128 slots, which a page of 3 or 384 tokens does not divide.
    args = bench.parse_args([*CUSTOM, "--dtype", "float16", "--page-sizes", "3,384", "--tokens", "8",
                             "--layouts", "page_first_direct,page_head", "--backends", "direct,triton",
                             "--sm-sweep", ""])  # fmt: skip
    specs = bench.plan_sweep(args)
    points = bench.run_sweep(specs, device=torch.device("cpu"), timer=FakeTimer([1.0]), repeats=1, warmup=0,
                             tokens=max(s.num_tokens for s in specs), pin=False, refcheck=True)  # fmt: skip
    assert {p["page_size"] for p in points} == {3, 384} and all(p["refcheck"] for p in points)


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

    real = ops.build_plan

    def off_by_one(direction, k, v, host, d, h, **kw):  # moves the right data to the wrong host slots
        return real(direction, k, v, host, d, (h + 1) % 8, **kw)

    monkeypatch.setattr(ops, "build_plan", off_by_one)
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


def threshold(pts, sm_budget=4):
    return bench.tune_auto(pts, sm_budget)["kernel_max_fragment_bytes"]


def test_tune_auto_finds_the_crossover():
    pts = tune_points([(1, {"kernel": 1.0, "direct": 9.0}), (16, {"kernel": 1.0, "batch": 1.5}),
                       (64, {"kernel": 2.0, "batch": 1.8}), (128, {"kernel": 3.0, "direct": 2.5})])  # fmt: skip
    assert threshold(pts) == 64 * 1024


def test_tune_auto_when_the_kernel_always_wins_or_data_is_missing():
    pts = tune_points([(1, {"kernel": 1.0, "direct": 9.0}), (128, {"kernel": 1.0, "direct": 2.0})])
    assert threshold(pts) == 128 * 1024 + 1
    # A copy-engine win below a kernel win does not move the threshold down.
    pts = tune_points([(1, {"kernel": 2.0, "direct": 1.0}), (128, {"kernel": 1.0, "direct": 2.0})])
    assert threshold(pts) == 128 * 1024 + 1
    with pytest.raises(ValueError, match="points: no fragment size has two of kernel, kernel-bulk"):
        bench.tune_auto(tune_points([(1, {"kernel": 1.0})]), 4)
    # No kernel measured against a copy engine: the default threshold, beside the table.
    tuned = bench.tune_auto(tune_points([(1, {"staged": 1.0, "direct": 2.0})]), 4)
    assert tuned["kernel_max_fragment_bytes"] == AutoBackend.DEFAULTS["kernel_max_fragment_bytes"]


def design_points(rows, sm_budget=4):
    """Transfer points of every auto design: ``rows`` of (op, page size, {backend: ms}), 1 KiB items."""
    return [
        {"kind": "transfer", "model": "m", "op": op, "direction": bench.DIRECTIONS[op][0], "layout": "x",
         "page_size": page, "item_bytes": 1024, "num_pages": 8, "backend": b, "median_ms": ms,
         "sm_budget": sm_budget if b in ("kernel", "kernel-bulk", "auto") else None}
        for op, page, times in rows
        for b, ms in times.items()
    ]  # fmt: skip


EVERY = {"kernel": 5.0, "kernel-bulk": 5.0, "staged": 5.0, "batch": 5.0, "direct": 5.0}


def test_tune_auto_ranks_every_design_per_direction_and_bucket(tmp_path):
    pts = design_points([
        ("backup_all", 1, {**EVERY, "kernel": 1.0, "kernel-bulk": 2.0, "direct": 9.0}),  # 1 KiB
        ("backup_all", 16, {**EVERY, "kernel-bulk": 1.0, "kernel": 3.0, "staged": 4.0}),  # 16 KiB
        ("backup_all", 64, {**EVERY, "staged": 1.0, "batch": 2.0}),  # 64 KiB
        ("load_all", 1, {**EVERY, "batch": 1.0}),
        ("load_layer", 128, {**EVERY, "direct": 1.0, "auto": 0.5, "triton": 0.1}),  # not designs of auto's
    ])  # fmt: skip
    pts += design_points([("backup_all", 1, {"kernel": 0.1, "kernel-bulk": 0.1})], sm_budget=8)  # other budget
    tuned = bench.tune_auto(pts, 4)
    assert tuned["sm_budget"] == 4
    assert tuned["table"] == {
        "d2h": {"1024": ["kernel", "kernel-bulk", "staged", "batch", "direct"],
                "16384": ["kernel-bulk", "kernel", "staged", "batch", "direct"],
                "65536": ["staged", "batch", "kernel", "kernel-bulk", "direct"]},
        "h2d": {"1024": ["batch", "kernel", "kernel-bulk", "staged", "direct"],
                "131072": ["direct", "kernel", "kernel-bulk", "staged", "batch"]},
    }  # fmt: skip
    # What --tune-auto saves, read back, decides the same.
    path = AutoBackend(thresholds=tuned, path=tmp_path / "auto.json").save()
    loaded = AutoBackend(path=path)
    assert loaded.settings() == tuned and loaded.table["d2h"][16384][0] == "kernel-bulk"


def test_tune_auto_scores_a_bucket_over_its_transfers():
    """Two transfers in one bucket (page 16 and 31: both 16 KiB buckets): the geometric mean of each
    design's time over the fastest decides, not one transfer's winner."""
    pts = design_points([("backup_all", 16, {"kernel": 1.0, "batch": 1.5}),
                         ("backup_all", 31, {"kernel": 4.0, "batch": 1.0})])  # fmt: skip
    assert bench.tune_auto(pts, 4)["table"] == {"d2h": {"16384": ["batch", "kernel"]}}


def test_tune_auto_leaves_out_bulk_points_that_ran_the_register_kernel():
    pts = design_points([("backup_all", 16, {"kernel": 2.0, "kernel-bulk": 1.0, "direct": 3.0})])
    for p in pts:
        if p["backend"] == "kernel-bulk":
            p["kernel_design"] = "register"  # bulk copies unsupported on that GPU
    assert bench.tune_auto(pts, 4)["table"] == {"d2h": {"16384": ["kernel", "direct"]}}


@pytest.mark.parametrize("backends", ["kernel-bulk,staged", "kernel,direct", "staged,batch,triton"])
def test_tune_auto_accepts_runs_with_two_designs(backends):
    assert bench.parse_args(["--tune-auto", "--backends", backends]).tune_auto == ""


def test_tune_auto_checks_the_designs_auto_ranks():
    from hicache_kernels.backends import AUTO_DESIGNS
    from hicache_kernels.bench import args as bench_args

    assert bench_args.TUNED_DESIGNS == AUTO_DESIGNS


def test_auto_points_run_both_kernel_designs_on_the_points_budget():
    spec = next(s for s in custom_specs("auto") if s.sm_budget is not None)
    spec = dataclasses.replace(spec, sm_budget=2)
    auto = bench_sweep._backend_object(spec)
    # 2 SMs' worth: 8 register CTAs of 8 warps, 2 bulk CTAs
    assert (auto.kernel.num_blocks, auto.kernel.warps_per_block) == (8, 8)
    assert (auto.kernel_bulk.num_blocks, auto.kernel_bulk.design) == (2, "bulk")


def test_full_sweep_covers_sm_budgets_1_to_8_for_both_kernel_designs():
    specs = bench.plan_sweep(bench.parse_args([]))
    for kernel in ("kernel", "kernel-bulk"):
        for op in bench.DIRECTIONS:
            assert {1, 2, 4, 8} <= {p.sm_budget for p in specs if p.backend == kernel and p.direction == op}


def test_validate_bench_json_reports_problems():
    good = {"kind": "transfer", "model": "m", "backend": "kernel", "op": "backup_all", "direction": "d2h",
            "scope": "all", "layout": "page_first", "page_size": 1, "item_bytes": 256, "num_pages": 4, "bytes": 1000,
            "median_ms": 1.0, "gbps": 1e-3, "ceiling_gbps": 2e-3, "ratio_to_ceiling": 0.5, "sm_budget": 4,
            "kernel_over_direct": None, "kernel_over_batch": 2.0}  # fmt: skip
    others = [{"kind": "interference", "backend": "kernel", "slowdown": 0.01},
              {"kind": "overlap", "overlap_ratio": 1.01, "transfer_le_compute": True}]  # fmt: skip
    meta = benchutil.run_meta("bench", {})
    assert bench.validate_bench_json({"meta": meta, "points": [good, *others]}) == []
    bad = [
        {**good, "gbps": 5.0},
        {**good, "direction": "up"},
        {**good, "op": "load_all"},  # an h2d op on a d2h point
        {**good, "op": "sideways"},
        {**good, "backend": "direct", "sm_budget": 4},
        {**good, "sm_budget": "4"},
        {**good, "page_size": "1"},
        {**good, "page_size": True},
        {**good, "ratio_to_ceiling": None},  # targets reads these: a KeyError or TypeError there before
        {k: v for k, v in good.items() if k != "model"},
        {**good, "kernel_over_batch": "2x"},
        {**good, "kind": "gemm"},
        {**others[0], "slowdown": None},
        {**others[1], "transfer_le_compute": 1},
        "a point",
    ]
    for p in bad:
        assert bench.validate_bench_json({"meta": meta, "points": [p]}), p
    assert bench.validate_bench_json({"points": []})
    assert bench.validate_bench_json({"meta": {}, "points": []})
    # Not even the top level of a bench JSON: problems, not exceptions.
    for doc in ([], "bench", None, {"meta": meta, "rows": []}, {"meta": [], "points": []}, {"meta": meta, "points": 1}):
        assert bench.validate_bench_json(doc), doc


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
    argv = ["--preset", "custom", "--layers", "4", "--kv-heads", "2", "--head-dim", "128", "--page-sizes", "1,16",
            "--tokens", "256", "--layouts", "page_first_direct", "--repeats", "3", "--warmup", "1",
            "--sm-sweep", "1,2", "--json", str(out)]  # fmt: skip
    proc = cli(*argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert bench.validate_bench_json(doc) == []
    check_provenance(doc, "hicache_kernels.bench", argv)
    assert doc["machine"]["gpu"] == doc["meta"]["gpu"]
    transfer = [p for p in doc["points"] if p["kind"] == "transfer"]
    assert transfer and all(p["gbps"] > 0 and p["ceiling_gbps"] > 0 for p in transfer)
    for p in transfer:
        assert p["ratio_to_ceiling"] == pytest.approx(p["gbps"] / p["ceiling_gbps"])
    assert doc["meta"]["gpu"]
    check, link = doc["meta"]["link_check"], doc["meta"]["link_theoretical_gbps"]
    assert check["passed"] is (True if check["made"] else None) and check["made"] is (link is not None)
    if link is not None:
        assert all(p["ceiling_gbps"] <= link * (1 + bench.LINK_TOLERANCE) for p in transfer)


# ---------------------------------------------------------------------------------------------- streams
class FakeCuda:
    """torch.cuda's current stream, stream context and events, for CPU: streams are plain names, and
    every event record notes the stream it was recorded on."""

    def __init__(self) -> None:
        self.current = "default"
        self.records: list[str] = []

    def stream(self, s):
        @contextlib.contextmanager
        def context():
            prev, self.current = self.current, s
            try:
                yield
            finally:
                self.current = prev

        return context()

    def current_stream(self, device=None):
        return self.current

    elapsed_ms = 1.0  # what every timed call measures

    def Event(self, enable_timing=False):  # noqa: N802 - torch.cuda.Event's name
        cuda = self

        class Event:
            def record(self, stream=None):
                cuda.records.append(stream)

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return cuda.elapsed_ms

        return Event()


@pytest.fixture
def fake_cuda(monkeypatch):
    cuda = FakeCuda()
    for name in ("stream", "current_stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    return cuda


def test_event_timer_runs_prepare_warmup_and_timed_calls_on_its_stream(fake_cuda):
    seen = []
    timer = benchutil.CudaEventTimer("side")
    stats = benchutil.measure(lambda: seen.append(("fn", fake_cuda.current)), timer=timer, repeats=3, warmup=2,
                              prepare=lambda: seen.append(("prepare", fake_cuda.current)))  # fmt: skip
    assert stats.median_ms == 1.0 and len(seen) == 10
    assert {s for _, s in seen} == {"side"} and set(fake_cuda.records) == {"side"}
    assert fake_cuda.current == "default"  # restored afterwards
    # Called on its own, not through measure(), the timer still runs fn on its stream.
    assert timer.time_ms(lambda: seen.append(("direct call", fake_cuda.current))) == 1.0
    assert seen[-1] == ("direct call", "side") and fake_cuda.current == "default"


class StreamSpy(IOBackend):
    """Wraps a point's real backend: notes the stream current when a copy is prepared (a plan without a
    stream of its own takes the current one then) and at each issue, and the plan's own stream."""

    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen

    def prepare(self, plan):
        self.seen.append((torch.cuda.current_stream(), plan.stream))
        copy = self.inner.prepare(plan)

        def issue() -> None:
            self.seen.append((torch.cuda.current_stream(), plan.stream))
            copy()

        return issue

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def spy_on_streams(monkeypatch) -> list:
    """(current stream, plan's stream) at every prepare and issue of every point (StreamSpy) and at
    every ceiling copy (its plan's stream: None)."""
    seen = []
    real_backend, real_ceiling = bench_sweep._backend_object, bench_sweep.ceiling_fn
    monkeypatch.setattr(bench_sweep, "_backend_object", lambda spec: StreamSpy(real_backend(spec), seen))

    def ceiling(*args, **kwargs):
        copy = real_ceiling(*args, **kwargs)
        return lambda: (seen.append((torch.cuda.current_stream(), None)), copy())

    monkeypatch.setattr(bench_sweep, "ceiling_fn", ceiling)
    return seen


def test_every_point_and_its_ceiling_run_on_the_timer_stream(fake_cuda, monkeypatch):
    seen = spy_on_streams(monkeypatch)
    specs = custom_specs("direct,batch")
    points = bench.run_sweep(specs, device=torch.device("cpu"), timer=benchutil.CudaEventTimer("side"),
                             repeats=2, warmup=1, tokens=8, pin=False, refcheck=True)  # fmt: skip
    assert len(points) == len(specs) and all(p["refcheck"] for p in points)
    # Every call (warm-up, timed, refcheck; points and ceilings) ran with the timer's stream current,
    # and no plan named a stream of its own.
    assert len(seen) > 4 * len(specs) and set(seen) == {("side", None)}
    assert set(fake_cuda.records) == {"side"}


# ---------------------------------------------------------------------------------------------- link check
def test_link_violation_allows_the_tolerance_and_no_more():
    link = 63.02  # PCIe Gen5 x16, per direction
    assert bench.link_violation("ceiling", 55.0, link) is None
    assert bench.link_violation("ceiling", link * (1 + bench.LINK_TOLERANCE) - 1e-9, link) is None
    problem = bench.link_violation("copy-engine ceiling, h2d", 70.0, link)
    assert problem and "70.00 GB/s" in problem and "63.02" in problem and "timing error" in problem
    assert bench.link_violation("ceiling", 1e6, None) is None  # unknown link: nothing to compare with


def test_run_sweep_refuses_a_ceiling_or_a_point_above_the_link():
    specs = [s for s in custom_specs("direct") if (s.page_size, s.direction, s.layout) == (1, "load_all", "page_first")]
    nbytes = specs[0].nbytes
    kw = dict(device=torch.device("cpu"), repeats=1, warmup=0, tokens=8, pin=False)
    # 1 ms per call: nbytes / 1e6 GB/s. A link just above that passes; one below refuses the ceiling.
    gbps = nbytes / 1e6
    assert len(bench.run_sweep(specs, timer=FakeTimer([1.0]), link_gbps=gbps, **kw)) == 1
    with pytest.raises(bench.LinkCheckError, match="copy-engine ceiling, h2d") as err:
        bench.run_sweep(specs, timer=FakeTimer([1.0]), link_gbps=gbps / 2, **kw)
    assert err.value.points == []
    # The ceiling (timed first) at 1 ms is within the link, the point at 0.25 ms is not.
    with pytest.raises(bench.LinkCheckError, match="direct load_all") as err:
        bench.run_sweep(specs, timer=FakeTimer([1.0, 0.25]), link_gbps=gbps * 2, **kw)
    assert [p["gbps"] for p in err.value.points] == [pytest.approx(4 * gbps)]


def test_link_check_meta_says_whether_the_check_was_made():
    skipped = bench.link_check_meta(None, "NVML unavailable: no driver")
    assert (skipped["made"], skipped["passed"]) == (False, None) and "not made" in skipped["note"]
    assert "NVML unavailable" in skipped["note"]
    assert bench.link_check_meta(63.02, "ok")["passed"] is True
    failed = bench.link_check_meta(63.02, "ok", "ceiling: 80 GB/s is above ...")
    assert (failed["made"], failed["passed"]) == (True, False) and failed["note"].startswith("ceiling")


class FakeNvml:
    """The NVML calls pcie.py's link reading makes (a Gen5 x16 link that idles at Gen1)."""

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802 - NVML's names
        return uuid

    def nvmlDeviceGetHandleByIndex(self, index):  # noqa: N802
        return index

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):  # noqa: N802
        return 1

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):  # noqa: N802
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):  # noqa: N802
        return 16

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):  # noqa: N802
        return 16


@pytest.fixture
def gpu_main(monkeypatch, fake_cuda):
    """bench.main's GPU path on CPU: CUDA events and streams faked (fake_cuda), NVML faked (a Gen5 x16
    link), the pools on the CPU, and the kernel replaced by direct (the CUDA kernels cannot run here)."""
    from types import SimpleNamespace

    from hicache_kernels import _env
    from hicache_kernels.backends import DirectBackend

    props = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, uuid="1234")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: "side")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (GPU_FREE_BYTES, 141 << 30))
    monkeypatch.setattr(_env, "_nvml", lambda: (FakeNvml(), "ok"))
    real_sweep, real_backend = bench_sweep.run_sweep, bench_sweep._backend_object
    cpu = {"device": torch.device("cpu"), "pin": False}
    monkeypatch.setattr(bench_sweep, "run_sweep", lambda specs, **kw: real_sweep(specs, **{**kw, **cpu}))
    monkeypatch.setattr(bench_sweep, "_backend_object",
                        lambda spec: DirectBackend() if spec.backend == "kernel" else real_backend(spec))  # fmt: skip
    return fake_cuda


GPU_FREE_BYTES = 140 << 30  # what the faked H200 reports free (gpu_main)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sm-budget", "133"], "--sm-budget: 133 SMs, but this GPU has 132"),
        (["--sm-sweep", "1,2,200"], "--sm-sweep: 200 SMs, but this GPU has 132"),
        (["--tokens", str(1 << 20)], "GiB of GPU memory, more than the 140.0 GiB free"),
    ],
)
def test_a_gpu_bounds_sm_budgets_and_device_memory(gpu_main, monkeypatch, argv, message, capsys):
    monkeypatch.setattr(bench_memory, "host_memory", lambda field: 1 << 50, raising=False)  # only the GPU refuses here
    bench.parse_args(["--sm-budget", "132", "--sm-sweep", "1,132"])  # every SM is allowed
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_a_gpu_run_checks_for_matplotlib_before_measuring(gpu_main, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit):
        bench.main([*CORE_CUSTOM, "--plot", "out.png"])
    assert "--plot: needs matplotlib" in capsys.readouterr().err and gpu_main.records == []  # nothing timed


CORE_CUSTOM = ["--targets-core", "--preset", "custom", "--layers", "2", "--kv-heads", "2", "--head-dim", "128",
               "--dtype", "float16", "--tokens", "16", "--repeats", "1", "--warmup", "0"]  # fmt: skip


def test_main_on_a_gpu_checks_the_link_and_writes_what_targets_reads(gpu_main, tmp_path):
    out = tmp_path / "core.json"
    assert bench.main([*CORE_CUSTOM, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["link_theoretical_gbps"] == pytest.approx(63.02) and doc["meta"]["link_check"]["passed"]
    assert bench.validate_bench_json(doc) == []
    assert {p.get("batch_fallback") for p in doc["points"] if p["backend"] == "batch"} == {None}
    assert set(gpu_main.records) == {"side"}
    proc = subprocess.run([sys.executable, "-m", "hicache_kernels.targets", str(out), "--json"], capture_output=True,
                          text=True)  # fmt: skip
    rows = json.loads(proc.stdout)
    assert [r["status"] != "n/a" for r in rows] == [True] * 4 + [False] * 8  # targets 1 (both ways), 2, 3


def test_main_on_a_gpu_refuses_a_ceiling_above_the_link(gpu_main, tmp_path, capsys):
    gpu_main.elapsed_ms = 1e-6  # every copy "takes" a nanosecond: far above any link
    out = tmp_path / "core.json"
    assert bench.main([*CORE_CUSTOM, "--json", str(out)]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench: refused: copy-engine ceiling") and "63.02" in err
    check = json.loads(out.read_text())["meta"]["link_check"]
    assert (check["made"], check["passed"]) == (True, False) and "timing error" in check["note"]
    proc = subprocess.run([sys.executable, "-m", "hicache_kernels.targets", str(out)], capture_output=True, text=True)
    assert proc.returncode == 2 and "refused" in proc.stderr


@pytest.mark.parametrize("nvml", [(FakeNvml(), "ok"), (None, "nvidia-ml-py is not installed")])
def test_link_bandwidth_reads_nvml_through_pcie(monkeypatch, nvml):
    from types import SimpleNamespace

    from hicache_kernels import _env

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="1234"))
    monkeypatch.setattr(_env, "_nvml", lambda: nvml)
    gbps, link = bench.link_bandwidth()
    if nvml[0] is None:
        assert gbps is None and link["error"] == "nvidia-ml-py is not installed"
    else:
        assert gbps == pytest.approx(63.02) and link["max_generation"] == 5  # max, not the idle Gen1


# ---------------------------------------------------------------------------------------------- fallbacks
class FirstRunFallsBack(BatchBackend):
    """BatchBackend on CPU tensors, whose first run reports a fallback as the GPU path would."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _prepare(self, plan):
        copy = super()._prepare(plan)

        def run() -> None:
            copy()  # resets last_fallback, as every real run does
            if self.calls == 0:
                self.last_fallback = "cudaMemcpyBatchAsync returned cudaErrorNotSupported"
            self.calls += 1

        return run


class AutoPicksBatch(AutoBackend):
    def __init__(self) -> None:
        super().__init__(thresholds={})
        self.batch = FirstRunFallsBack()

    def decide(self, plan):
        return "batch", "the test says so"


@pytest.mark.parametrize(("backend", "make"), [("batch", FirstRunFallsBack), ("auto", AutoPicksBatch)])
def test_a_fallback_in_any_run_marks_the_point(monkeypatch, backend, make):
    monkeypatch.setattr(bench_sweep, "_backend_object", lambda spec: make())
    specs = [s for s in custom_specs(backend) if s.page_size == 1 and s.direction == "load_all"]
    points = bench.run_sweep(specs, device=torch.device("cpu"), timer=FakeTimer([1.0]), repeats=3, warmup=1,
                             tokens=8, pin=False)  # fmt: skip
    # Only the first (warm-up) run fell back; the last three did not.
    assert [p["batch_fallback"] for p in points] == ["cudaMemcpyBatchAsync returned cudaErrorNotSupported"] * 2
    if backend == "auto":
        assert {p["auto_choice"] for p in points} == {"batch"}


def test_points_without_a_fallback_say_none():
    points = bench.run_sweep(custom_specs("batch,auto"), device=torch.device("cpu"), timer=FakeTimer([1.0]),
                             repeats=2, warmup=1, tokens=8, pin=False)  # fmt: skip
    assert {p["batch_fallback"] for p in points} == {None}
    assert {p["auto_choice"] for p in points if p["backend"] == "auto"} == {"direct"}  # CPU tensors


def test_ratios_compare_only_the_same_number_of_pages():
    points = [
        {"kind": "transfer", "model": "m", "backend": b, "op": "load_all", "layout": "x", "page_size": 1,
         "num_pages": n, "median_ms": t}
        for b, n, t in (("kernel", 8, 1.0), ("direct", 8, 4.0), ("kernel", 512, 2.0), ("direct", 512, 40.0))
    ]  # fmt: skip
    bench.add_ratios(points)
    assert [p.get("kernel_over_direct") for p in points if p["backend"] == "kernel"] == [4.0, 20.0]


def test_tune_auto_keeps_page_counts_apart():
    pts = [
        {"kind": "transfer", "model": "m", "op": "load_all", "layout": "x", "page_size": 16, "item_bytes": 1024,
         "num_pages": n, "backend": b, "median_ms": ms, "sm_budget": None if b == "batch" else 4}
        for n, b, ms in ((8, "kernel", 1.0), (8, "batch", 2.0), (512, "kernel", 3.0), (512, "batch", 2.0))
    ]  # fmt: skip
    # The kernel wins at 8 pages: copy engines do not win at every measurement of 16 KiB fragments.
    assert threshold(pts) == 16 * 1024 + 1


# ---------------------------------------------------------------------------------------------- --targets-core
def fabricated_points(specs):
    """Points as run_sweep would write them, with the kernel fast enough to pass every target."""
    ms = {"kernel": 1.0, "direct": 20.0, "batch": 3.0}
    points = [
        {"kind": "transfer", "model": s.model.name, "backend": s.backend, "op": s.direction,
         "direction": bench.DIRECTIONS[s.direction][0], "scope": bench.DIRECTIONS[s.direction][1],
         "layout": s.layout, "page_size": s.page_size, "item_bytes": s.model.item_bytes, "num_pages": s.num_pages,
         "median_ms": ms[s.backend], "ratio_to_ceiling": 0.95 / ms[s.backend], "sm_budget": s.sm_budget}
        for s in specs
    ]  # fmt: skip
    bench.add_ratios(points)
    return points


@pytest.mark.parametrize("preset", ["llama3-8b", "deepseek-v3"])
def test_targets_core_plan_is_exactly_what_targets_1_to_3_read(preset):
    specs = bench.plan_sweep(bench.parse_args(["--targets-core", "--preset", preset]))
    model = bench.PRESETS[preset]
    pages, ops, lays = (1, 4, 16, 64, 128), set(bench.DIRECTIONS), {"page_first_direct", "layer_first"}
    got = {(s.backend, s.direction, s.layout, s.page_size, s.sm_budget) for s in specs}
    want = {("kernel", o, lo, p, targets.T1_MAX_SMS) for o in ops for lo in lays for p in pages}
    want |= {("direct", o, lo, 1, None) for o in ops for lo in lays}
    want |= {("batch", o, lo, p, None) for o in ops for lo in lays for p in pages if model.item_bytes * p <= 4096}
    assert got == want and len(specs) == len(want)
    rows = targets.evaluate({"points": fabricated_points(specs)})
    assert [r["status"] for r in rows] == ["pass"] * 4 + ["n/a"] * 8, rows  # targets 1 (both ways), 2, 3
    # Every kernel page size counts for target 1: a slow one shows.
    slow = fabricated_points(specs)
    for p in slow:
        if p["backend"] == "kernel" and p["page_size"] == 128 and p["direction"] == "d2h":
            p["ratio_to_ceiling"] = 0.5
    t1 = targets.evaluate({"points": slow})[0]
    assert t1["status"] == "MISS" and "page 128" in t1["worst_at"]


def test_targets_core_help_quotes_the_current_estimate():
    args = bench.parse_args(["--targets-core"])
    estimate = bench.estimate_s(bench.plan_sweep(args), args.repeats, args.warmup)
    assert round(estimate) == bench.CORE_ESTIMATE_S
    assert estimate < 90
    proc = cli("--help")
    assert f"estimated ~{bench.CORE_ESTIMATE_S} s of GPU time" in " ".join(proc.stdout.split())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--head-dim", "64"], "below target 1's 512 B"),  # 2 heads x 64 x fp16 = 256 B
        (["--head-dim", "2048"], "target 3's 4096 B"),  # 8 KiB items: no fragment is small enough
    ],
)
def test_targets_core_refuses_models_that_cannot_decide_its_targets(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--targets-core", "--preset", "custom", "--layers", "2", "--kv-heads", "2",
                          "--dtype", "float16", *argv])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and message in err


def test_targets_core_and_quick_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--targets-core", "--quick"])
    assert "not allowed with" in capsys.readouterr().err


def test_estimate_counts_bytes_and_copy_engine_fragments():
    model = bench.ModelConfig("m", num_layers=2, head_num=1, head_dim=512)  # 1 KiB items
    kernel = bench.PointSpec(model, "kernel", "load_all", "page_first_direct", 4, 10, 4)
    direct = bench.PointSpec(model, "direct", "load_all", "page_first_direct", 4, 10, None)
    assert kernel.nbytes == 40 * 2 * 2 * 1024 and bench.copy_engine_fragments(direct) == 10 * 2 * 2
    one = kernel.nbytes / (bench.ESTIMATE_GBPS * 1e9)
    assert bench.estimate_s([kernel], repeats=3, warmup=1) == pytest.approx(4 * one + 4 * one)  # + its ceiling
    frag_s = 40 * bench.ESTIMATE_US_PER_FRAGMENT * 1e-6
    assert bench.estimate_s([kernel, direct], repeats=3, warmup=1) == pytest.approx(12 * one + 4 * frag_s)


@pytest.mark.gpu
def test_points_and_ceilings_run_on_the_timer_stream_on_gpu(monkeypatch):
    seen = spy_on_streams(monkeypatch)
    side = torch.cuda.Stream()
    specs = custom_specs("kernel,direct,batch")
    points = bench.run_sweep(specs, device=torch.device("cuda"), timer=benchutil.CudaEventTimer(side), repeats=2,
                             warmup=1, tokens=8, refcheck=True)  # fmt: skip
    assert all(p["refcheck"] for p in points)
    assert {(s.cuda_stream, plan_stream) for s, plan_stream in seen} == {(side.cuda_stream, None)}
    assert torch.cuda.current_stream().cuda_stream != side.cuda_stream  # restored


def test_format_tuned_names_every_bucket_in_order():
    from hicache_kernels.bench import results

    tuned = {"kernel_max_fragment_bytes": 65536, "sm_budget": 4,
             "table": {"h2d": {"1048576": ["staged", "kernel"], "512": ["kernel", "kernel-bulk", "direct"]},
                       "d2h": {"4096": ["kernel-bulk", "batch"]}}}  # fmt: skip
    assert results.format_tuned(tuned) == [
        "auto: designs ranked per direction and fragment size (kernel designs at 4 SMs):",
        "  d2h  fragments >=    4 KiB: kernel-bulk > batch",
        "  h2d  fragments >=    512 B: kernel > kernel-bulk > direct",
        "  h2d  fragments >=    1 MiB: staged > kernel",
        "  kernel_max_fragment_bytes: 65536",
    ]


def test_interference_budgets():
    import argparse

    from hicache_kernels.bench.interference import interference_budgets

    assert interference_budgets(argparse.Namespace(sm_budget=4, sm_sweep="1,2,4,8")) == [1, 2, 4, 8]
    assert interference_budgets(argparse.Namespace(sm_budget=3, sm_sweep="")) == [3]
