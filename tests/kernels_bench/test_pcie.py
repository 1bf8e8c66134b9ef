"""`python -m hicache_kernels.pcie`: sweep planning, per-point measurement with a fake timer, the NVML
sampler with a fake NVML, outputs and plot on CPU; the whole CLI on a GPU."""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from provenancecheck import check_provenance

from hicache_kernels import _env, benchutil, pcie
from hicache_kernels.pcie import GiB, KiB, MiB, PointSpec, Workload


def run_pcie(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache_kernels.pcie", *args], capture_output=True, text=True, timeout=timeout
    )


class FakeTimer:
    """Calls ``fn`` and returns the next of ``times_ms`` (cycling)."""

    def __init__(self, *times_ms: float) -> None:
        self.times_ms = times_ms or (2.0,)
        self.calls = 0

    def time_ms(self, fn) -> float:
        fn()
        t = self.times_ms[self.calls % len(self.times_ms)]
        self.calls += 1
        return t


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


def sweep_of(*argv: str) -> pcie.Sweep:
    return pcie.resolve_sweep(pcie.parse_args(list(argv)))


# ------------------------------------------------------------------------------------------------ CLI


def test_help_exits_0() -> None:
    proc = run_pcie("--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--sizes", "--max-size", "--sm-counts", "--quick", "--json", "--csv", "--plot", "--device"):
        assert flag in proc.stdout


def test_no_gpu_mode(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out_json, out_csv = tmp_path / "pcie.json", tmp_path / "pcie.csv"
    argv = ["--quick", "--json", str(out_json), "--csv", str(out_csv), "--plot", str(tmp_path / "p.png")]
    proc = run_pcie(*argv)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "need a CUDA GPU" in proc.stdout
    assert "nvml:" in proc.stdout and "driver:" in proc.stdout
    report = json.loads(out_json.read_text())
    assert set(report) >= {"meta", "points", "mode", "reasons"}
    assert report["points"] == [] and report["mode"] == "no-gpu"
    assert report["meta"]["tool"] == "pcie" and report["meta"]["args"]["quick"] is True
    check_provenance(report, "hicache_kernels.pcie", argv)
    assert all(isinstance(v, str) and v for v in report["reasons"].values())
    assert set(report["reasons"]) == {"torch", "nvml", "driver", "extension"}
    assert out_csv.exists()
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--sizes", "lots"], "--sizes"),
        (["--sizes", "1G", "--max-size", "1M"], "--max-size"),
        (["--sm-counts", "0,4"], "--sm-counts"),
        (["--methods", "dma"], "--methods"),
        (["--directions", "up"], "--directions"),
        (["--memory", "hbm"], "--memory"),
        (["--chunk-bytes", "-4"], "--chunk-bytes"),
        (["--warps-per-block", "33"], "--warps-per-block"),
    ],
)
def test_bad_arguments_name_the_flag(args: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        sweep_of(*args)
    assert pcie.main(args) == 2


def test_malformed_numbers_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        pcie.main(["--repeats", "many"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("python -m hicache_kernels.pcie: error: argument --repeats: invalid int value")


# ------------------------------------------------------------------------------------------ planning


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("8", 8),
        ("4096", 4096),
        ("64K", 64 * KiB),
        ("64kib", 64 * KiB),
        ("256M", 256 * MiB),
        ("1G", GiB),
        ("2GB", 2 * GiB),
    ],
)
def test_parse_size(text: str, n: int) -> None:
    assert pcie.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "0", "K", "1T", "-1", "1.5M"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="positive size"):
        pcie.parse_size(text)


def test_format_bytes() -> None:
    assert [pcie.format_bytes(n) for n in (8, 4 * KiB, 1536 * KiB, GiB)] == ["8 B", "4 KiB", "1.5 MiB", "1 GiB"]


def test_full_sweep_plan() -> None:
    sweep = sweep_of()
    assert sweep.sizes == tuple(4 * KiB * 4**k for k in range(10)) and sweep.sizes[-1] == GiB
    assert sweep.sm_counts == (1, 2, 4, 8, 16, 32)
    assert (sweep.repeats, sweep.warmup, sweep.latency_repeats, sweep.verify) == (20, 3, 200, True)
    specs = pcie.plan_points(sweep)
    bw = [s for s in specs if s.kind == "bandwidth"]
    lat = [s for s in specs if s.kind == "latency"]
    assert specs == bw + lat  # bandwidth first
    # 3 directions x (copy engine pinned + pageable + kernel at 6 SM budgets) x 10 sizes
    assert len(bw) == 3 * (2 + 6) * 10
    assert len(set(bw)) == len(bw)
    assert {s.sm_budget for s in bw if s.method == "copy_engine"} == {None}
    assert {s.memory for s in bw if s.method == "kernel"} == {"pinned"}
    assert {s.sm_budget for s in bw if s.method == "kernel"} == set(sweep.sm_counts)
    assert {s.direction for s in bw} == {"h2d", "d2h", "bidir"}
    # latency: 8 B and 4 KiB, one direction at a time, copy engine per memory and the kernel on 1 block
    assert len(lat) == 2 * 2 * 3
    assert {s.nbytes for s in lat} == {8, 4 * KiB} and {s.direction for s in lat} == {"h2d", "d2h"}
    assert {s.sm_budget for s in lat if s.method == "kernel"} == {1}
    # run order: per direction, per configuration, sizes ascending
    first = bw[:10]
    assert [s.nbytes for s in first] == list(sweep.sizes)
    assert {(s.direction, s.method, s.memory) for s in first} == {("h2d", "copy_engine", "pinned")}


def test_quick_sweep_plan() -> None:
    sweep = sweep_of("--quick")
    assert sweep.sizes == (64 * KiB, MiB, 16 * MiB, 256 * MiB)
    assert sweep.sm_counts == (1, 4, 16)
    assert (sweep.repeats, sweep.warmup, sweep.latency_repeats) == (5, 1, 50)
    assert len([s for s in pcie.plan_points(sweep) if s.kind == "bandwidth"]) == 3 * (2 + 3) * 4
    # explicit flags win over --quick
    sweep = sweep_of("--quick", "--sizes", "4K,1M,4K", "--sm-counts", "2,1", "--repeats", "7", "--warmup", "0")
    assert sweep.sizes == (4 * KiB, MiB) and sweep.sm_counts == (1, 2) and (sweep.repeats, sweep.warmup) == (7, 0)
    assert sweep_of("--quick", "--max-size", "1M").sizes == (64 * KiB, MiB)
    assert sweep_of("--max-size", "64K").sizes == (4 * KiB, 16 * KiB, 64 * KiB)


def test_plan_filters() -> None:
    sweep = sweep_of("--quick", "--sizes", "1M")
    no_kernel = pcie.plan_points(sweep, kernel_ok=False)
    assert no_kernel and {s.method for s in no_kernel} == {"copy_engine"}
    pageable = pcie.plan_points(sweep_of("--sizes", "1M", "--memory", "pageable"))
    assert {(s.method, s.memory) for s in pageable} == {("copy_engine", "pageable")}
    kernel_only = pcie.plan_points(sweep_of("--sizes", "1M", "--methods", "kernel", "--directions", "bidir"))
    assert {(s.kind, s.method, s.direction) for s in kernel_only} == {("bandwidth", "kernel", "bidir")}
    assert not [s for s in pcie.plan_points(sweep_of("--sizes", "1M", "--no-latency")) if s.kind == "latency"]
    assert sweep_of("--no-latency", "--sizes", "1M").max_bytes == MiB
    assert sweep_of("--sizes", "4K").max_bytes == 4 * KiB  # latency sizes are 8 B and 4 KiB
    assert sweep_of("--chunk-bytes", "16K").chunk_bytes == 16 * KiB and sweep_of().chunk_bytes is None


@pytest.mark.parametrize(
    ("nbytes", "sm", "override", "chunk"),
    [
        (GiB, 32, None, 64 * KiB),  # clamped to 64 KiB
        (MiB, 32, None, 1024),  # 1 MiB over 1024 warps
        (64 * KiB, 16, None, 512),  # floor of 512 B
        (4 * KiB, 1, None, 512),
        (8, 1, None, 8),  # never more than the buffer
        (3 * MiB, 1, None, 64 * KiB),  # 3 MiB / 32 warps = 96 KiB -> 64 KiB, divides 3 MiB
        (96 * KiB, 1, None, 2 * KiB),  # 3 KiB per warp -> 2 KiB
        (MiB, 4, 16 * KiB, 16 * KiB),  # fixed
        (48 * KiB, 4, 32 * KiB, 16 * KiB),  # a fixed chunk that does not divide the buffer: gcd
    ],
)
def test_kernel_chunk_bytes(nbytes: int, sm: int, override: int | None, chunk: int) -> None:
    got = pcie.kernel_chunk_bytes(nbytes, sm, 32, override)
    assert got == chunk
    assert nbytes % got == 0


# --------------------------------------------------------------------------------------- measurement


def test_measure_bandwidth_point_with_fake_timer() -> None:
    spec = PointSpec("bandwidth", "copy_engine", "pinned", "h2d", 4 * MiB, None)
    fn, timer = Counter(), FakeTimer(2.0)
    point = pcie.measure_point(spec, Workload(fn), timer=timer, repeats=5, warmup=2, theoretical_gbps=63.02)
    assert fn.n == 7 and timer.calls == 5
    assert point["median_ms"] == point["p10_ms"] == point["p90_ms"] == 2.0
    assert point["gbps"] == pytest.approx(4 * MiB / 2e-3 / 1e9)
    assert point["gbps"] == pytest.approx(benchutil.gbps(point["bytes"], point["median_ms"]))
    assert point["link_pct"] == pytest.approx(100 * point["gbps"] / 63.02)
    assert point["latency_us"] is None and point["h2d_gbps"] is None
    assert point["nvml_tx_gbps_max"] is None and point["nvml_rx_gbps_max"] is None and point["nvml_samples"] == 0
    assert point["verified"] is None and point["error"] is None
    for key in ("kind", "method", "memory", "direction", "bytes", "sm_budget", "theoretical_gbps"):
        assert key in point
    assert (point["kind"], point["method"], point["memory"], point["direction"]) == (
        "bandwidth", "copy_engine", "pinned", "h2d"
    )  # fmt: skip
    assert point["bytes"] == point["total_bytes"] == 4 * MiB
    assert point["sm_budget"] is None and point["theoretical_gbps"] == 63.02


def test_measure_quantiles_and_latency() -> None:
    spec = PointSpec("latency", "kernel", "pinned", "d2h", 8, 1)
    timer = FakeTimer(*[0.01 * (k + 1) for k in range(10)])  # 10..100 us
    point = pcie.measure_point(spec, Workload(Counter(), info={"chunk_bytes": 8}), timer=timer, repeats=10, warmup=0)
    assert point["latency_us"] == pytest.approx(55.0)
    assert point["latency_p10_us"] == pytest.approx(19.0) and point["latency_p90_us"] == pytest.approx(91.0)
    assert point["median_ms"] == pytest.approx(0.055) and point["repeats"] == 10
    assert point["gbps"] is None and point["link_pct"] is None
    assert point["chunk_bytes"] == 8 and point["sm_budget"] == 1


def test_measure_bidir_point() -> None:
    spec = PointSpec("bandwidth", "kernel", "pinned", "bidir", 8 * MiB, 4)
    per_dir = {"h2d": [100.0, 100.0] + [2.0] * 3, "d2h": [100.0, 100.0] + [1.0] * 3}  # warm-up times dropped
    wl = Workload(Counter(), direction_ms=lambda: per_dir)
    point = pcie.measure_point(spec, wl, timer=FakeTimer(2.0), repeats=3, warmup=2, theoretical_gbps=50.0)
    assert point["total_bytes"] == 16 * MiB
    assert point["gbps"] == pytest.approx(16 * MiB / 2e-3 / 1e9)
    assert point["h2d_median_ms"] == 2.0 and point["d2h_median_ms"] == 1.0
    assert point["h2d_gbps"] == pytest.approx(8 * MiB / 2e-3 / 1e9)
    assert point["d2h_gbps"] == pytest.approx(8 * MiB / 1e-3 / 1e9)
    assert point["link_pct"] == pytest.approx(100 * point["gbps"] / 100.0)  # twice the link for bidir


def test_measure_verify() -> None:
    spec = PointSpec("bandwidth", "copy_engine", "pageable", "d2h", MiB, None)
    ok = pcie.measure_point(spec, Workload(Counter(), verify=lambda: None), timer=FakeTimer(), repeats=1, warmup=0)
    assert ok["verified"] is True and ok["error"] is None
    bad = pcie.measure_point(
        spec, Workload(Counter(), verify=lambda: "d2h: differs"), timer=FakeTimer(), repeats=1, warmup=0
    )
    assert bad["verified"] is False and bad["error"] == "d2h: differs"


def test_run_sweep_keeps_going_after_a_failure() -> None:
    sweep = sweep_of("--sizes", "64K,1M", "--sm-counts", "1", "--repeats", "3", "--warmup", "1")
    specs = pcie.plan_points(sweep)
    broken = specs[1]
    calls: dict[PointSpec, Counter] = {}

    def workload_for(spec: PointSpec) -> Workload:
        if spec == broken:
            raise RuntimeError("cudaErrorMemoryAllocation")
        calls[spec] = Counter()
        return Workload(calls[spec])

    progress = benchutil.Progress(len(specs), "test")
    points = pcie.run_sweep(specs, workload_for, timer=FakeTimer(0.5), sweep=sweep, progress=progress)
    assert progress.done == len(specs) == len(points)
    assert points[1]["error"] == "RuntimeError: cudaErrorMemoryAllocation" and points[1]["gbps"] is None
    assert all(p["error"] is None for i, p in enumerate(points) if i != 1)
    for spec, p in zip(specs, points, strict=True):
        assert (p["kind"], p["method"], p["memory"], p["direction"], p["bytes"], p["sm_budget"]) == (
            spec.kind, spec.method, spec.memory, spec.direction, spec.nbytes, spec.sm_budget
        )  # fmt: skip
        if spec != broken:
            # latency points use --latency-repeats (default 200), bandwidth points --repeats
            assert calls[spec].n == sweep.warmup + (sweep.repeats if spec.kind == "bandwidth" else 200)
    assert {p["kind"] for p in points} == {"bandwidth", "latency"}
    text = pcie.format_points(points)
    assert "bandwidth:" in text and "latency:" in text and "cudaErrorMemoryAllocation" in text
    assert "median us" in text and "GB/s" in text
    peaks = pcie.peak_summary(points)
    assert any("peak kernel pinned bidir" in line for line in peaks)


# ---------------------------------------------------------------------------------------------- NVML


class FakeNvml(types.SimpleNamespace):
    """A Gen5 x16 link (idling at Gen1) whose PCIe counters read fixed KB/s."""

    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1

    def __init__(self, tx_kbps: int = 1_000_000, rx_kbps: int = 2_000_000, fail: bool = False) -> None:
        def throughput(handle: object, counter: int) -> int:
            if fail:
                raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
            time.sleep(0.001)
            return tx_kbps if counter == 0 else rx_kbps

        super().__init__(
            nvmlDeviceGetHandleByIndex=lambda i: ("h", i),
            nvmlDeviceGetHandleByUUID=lambda u: ("h", 0),
            nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 1,
            nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 5,
            nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16,
            nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
            nvmlDeviceGetPcieThroughput=throughput,
        )


def test_nvml_link_and_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_env, "_nvml", lambda: (FakeNvml(), "ok"))
    nvml, handle, reason = pcie.nvml_for_device(0, "GPU-1234")
    assert reason == "ok" and handle == ("h", 0)
    link = pcie.link_facts(nvml, handle)
    assert (link["current_generation"], link["max_generation"], link["max_width"]) == (1, 5, 16)
    assert pcie.theoretical_of(link) == pytest.approx(63.02, abs=0.01)  # the max link, not the idle Gen1
    with pcie.NvmlPcieSampler(nvml, handle) as sampler:
        t0 = sampler.begin()
        time.sleep(0.1)
        window = sampler.end(t0)
    assert window["nvml_samples"] >= 4
    assert window["nvml_tx_gbps_max"] == pytest.approx(1_000_000 * 1024 / 1e9)
    assert window["nvml_rx_gbps_max"] == pytest.approx(2_000_000 * 1024 / 1e9)
    assert window["nvml_tx_gbps_mean"] == pytest.approx(window["nvml_tx_gbps_max"])
    summary = sampler.summary()
    assert summary["tx_samples"] > 0 and summary["rx_samples"] > 0 and summary["errors"] == {}
    assert summary["rx_gbps_max"] == pytest.approx(2.048)
    assert all(not t.is_alive() for t in sampler._threads)


def test_nvml_sampler_inside_measure_point(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(tx_kbps=500_000, rx_kbps=40_000_000)
    spec = PointSpec("bandwidth", "copy_engine", "pinned", "h2d", 64 * MiB, None)

    def slow() -> None:
        time.sleep(0.01)

    with pcie.NvmlPcieSampler(nvml, "h") as sampler:
        point = pcie.measure_point(spec, Workload(slow), timer=FakeTimer(), repeats=5, warmup=1, sampler=sampler)
    assert point["nvml_samples"] > 0
    assert point["nvml_rx_gbps_max"] == pytest.approx(40.96) and point["nvml_tx_gbps_max"] == pytest.approx(0.512)


def test_nvml_sampler_window_is_strict() -> None:
    """Only samples whose whole window lies inside [begin, end] count."""
    now = [10.0]
    sampler = pcie.NvmlPcieSampler(FakeNvml(), "h", clock=lambda: now[0])
    sampler.samples["tx"] += [(9.99, 10.01, 5.0), (10.02, 10.04, 1.0), (10.05, 10.07, 3.0), (10.09, 10.11, 9.0)]
    sampler.samples["rx"] += [(10.03, 10.05, 2.0)]
    t0 = sampler.begin()
    now[0] = 10.1
    w = sampler.end(t0)
    assert (w["nvml_tx_gbps_max"], w["nvml_tx_gbps_mean"]) == (3.0, 2.0)
    assert (w["nvml_rx_gbps_max"], w["nvml_samples"]) == (2.0, 3)


def test_nvml_counter_errors_become_reasons() -> None:
    with pcie.NvmlPcieSampler(FakeNvml(fail=True), "h") as sampler:
        t0 = sampler.begin()
        time.sleep(0.02)
        window = sampler.end(t0)
    assert window == pcie.NvmlPcieSampler.empty_window()
    assert set(sampler.errors) == {"tx", "rx"} and "NOT_SUPPORTED" in sampler.errors["tx"]
    assert sampler.summary()["tx_gbps_max"] is None


def test_nvml_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_env, "_nvml", lambda: (None, "NVML unavailable: NVMLError_LibraryNotFound"))
    nvml, handle, reason = pcie.nvml_for_device(0)
    assert nvml is None and handle is None and "LibraryNotFound" in reason
    link = pcie.link_facts(nvml, handle, reason)
    assert link["error"] == reason and pcie.theoretical_of(link) is None

    def no_handle(i: int) -> object:
        raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")

    fake = FakeNvml()
    fake.nvmlDeviceGetHandleByIndex = no_handle
    monkeypatch.setattr(_env, "_nvml", lambda: (fake, "ok"))
    nvml, _, reason = pcie.nvml_for_device(3)
    assert nvml is None and "device 3" in reason and "INVALID_ARGUMENT" in reason


# ------------------------------------------------------------------------------------------- outputs


def fake_points() -> list[dict]:
    sweep = sweep_of("--sizes", "64K,1M,16M", "--sm-counts", "1,4", "--repeats", "3", "--warmup", "0")
    timer = FakeTimer(0.5, 0.25, 1.0)
    return pcie.run_sweep(
        pcie.plan_points(sweep), lambda s: Workload(Counter()), timer=timer, sweep=sweep, theoretical_gbps=63.02
    )


def test_json_and_csv_outputs(tmp_path: Path) -> None:
    points = fake_points()
    args = pcie.parse_args(["--json", str(tmp_path / "out/p.json"), "--csv", str(tmp_path / "out/p.csv")])
    meta = benchutil.run_meta("pcie", vars(args))
    written = benchutil.write_outputs(args.json, args.csv, meta, points, mode="gpu", link={"max_gbps": 63.02})
    assert len(written) == 2
    report = json.loads((tmp_path / "out/p.json").read_text())
    assert report["mode"] == "gpu" and report["meta"]["tool"] == "pcie" and len(report["points"]) == len(points)
    for p in report["points"]:
        assert {"kind", "method", "memory", "direction", "bytes", "sm_budget", "median_ms", "p10_ms", "p90_ms",
                "gbps", "latency_us", "nvml_tx_gbps_max", "nvml_rx_gbps_max", "theoretical_gbps"} <= set(p)  # fmt: skip
        assert (p["gbps"] is None) == (p["kind"] == "latency")
    with open(tmp_path / "out/p.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(points)
    assert {"gbps", "latency_us", "direction", "sm_budget", "meta_tool"} <= set(rows[0])
    assert rows[0]["meta_tool"] == "pcie"
    assert float(rows[0]["gbps"]) == pytest.approx(points[0]["gbps"])


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = pcie.write_plot(fake_points(), tmp_path / "plots" / "pcie.png", theoretical_gbps=63.02)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no bandwidth points"):
        pcie.write_plot([p for p in fake_points() if p["kind"] == "latency"], tmp_path / "x.png")


def test_plot_without_matplotlib_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(pcie.PlotUnavailableError, match="pip install matplotlib"):
        pcie.write_plot(fake_points(), tmp_path / "p.png")


class FakeBench:
    """Stands in for LinkBench: every point's copy is a counter."""

    made: list[FakeBench] = []

    def __init__(self, device: torch.device, sweep: pcie.Sweep, kernel: bool) -> None:
        self.kernel = kernel
        FakeBench.made.append(self)

    def workload(self, spec: PointSpec) -> Workload:
        return Workload(Counter(), verify=lambda: None, info={"chunk_bytes": 512} if spec.method == "kernel" else {})


@pytest.mark.parametrize("kernel_reason", [None, "the CUDA extension was not built: test"])
def test_main_gpu_path_with_fakes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], kernel_reason: str | None
) -> None:
    """main()'s GPU orchestration (link facts, kernel skip note, sweep, sampler, outputs) with the CUDA
    pieces faked; the real buffers and copies (LinkBench) are covered by the gpu test."""
    props = types.SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, major=9, minor=0, uuid="1234")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(benchutil, "CudaEventTimer", lambda stream=None: FakeTimer(0.25))
    monkeypatch.setattr(pcie.gpu, "LinkBench", FakeBench)
    monkeypatch.setattr(pcie.gpu, "kernel_unavailable", lambda i: kernel_reason)
    monkeypatch.setattr(_env, "_nvml", lambda: (FakeNvml(), "ok"))
    FakeBench.made.clear()
    out = tmp_path / "p.json"
    argv = ["--sizes", "1M,16M", "--sm-counts", "1,4", "--repeats", "2", "--latency-repeats", "3", "--json", str(out)]
    assert pcie.main(argv) == 0
    text = capsys.readouterr().out
    assert "NVIDIA H200" in text and "Gen1 x16 now, max Gen5 x16: 63.02 GB/s" in text
    assert "bandwidth:" in text and "latency:" in text and "peak copy_engine pinned h2d" in text
    report = json.loads(out.read_text())
    assert report["mode"] == "gpu" and report["theoretical_gbps"] == pytest.approx(63.02)
    assert report["device"]["name"] == "NVIDIA H200" and report["meta"]["gpu"] == "NVIDIA H200"
    check_provenance(report, "hicache_kernels.pcie", argv)
    assert report["machine"]["gpu"] == "NVIDIA H200" and report["machine"]["gpus"] == 1
    assert report["nvml"]["available"] is True and "tx_samples" in report["nvml"]
    points = report["points"]
    kernel_points = [p for p in points if p["method"] == "kernel"]
    if kernel_reason:
        assert not kernel_points and FakeBench.made[-1].kernel is False
        assert any(kernel_reason in n for n in report["notes"]) and "kernel method skipped" in text
    else:
        assert kernel_points and FakeBench.made[-1].kernel is True and report["notes"] == []
        assert all(p["chunk_bytes"] == 512 for p in kernel_points)
    assert all(p["verified"] is True and p["theoretical_gbps"] == pytest.approx(63.02) for p in points)
    bw = [p for p in points if p["kind"] == "bandwidth"]
    assert all(p["median_ms"] == 0.25 and p["gbps"] == pytest.approx(p["total_bytes"] / 0.25e-3 / 1e9) for p in bw)


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_pcie_cli_on_gpu(tmp_path: Path) -> None:
    out = tmp_path / "pcie.json"
    argv = ["--quick", "--sizes", "64K,4M", "--sm-counts", "1,4", "--latency-repeats", "20", "--json", str(out),
            "--csv", str(tmp_path / "pcie.csv")]  # fmt: skip
    proc = run_pcie(*argv, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "gpu"
    check_provenance(report, "hicache_kernels.pcie", argv)
    points = report["points"]
    bw = [p for p in points if p["kind"] == "bandwidth"]
    lat = [p for p in points if p["kind"] == "latency"]
    assert len(bw) >= 3 * 2 * 2 and len(lat) >= 2 * 2 * 2
    for p in points:
        assert p["error"] is None, p
        assert p["verified"] is True, p
    assert all(p["gbps"] > 0 and p["median_ms"] > 0 for p in bw)
    assert all(p["latency_us"] > 0 for p in lat)
    assert all(p["h2d_gbps"] > 0 and p["d2h_gbps"] > 0 for p in bw if p["direction"] == "bidir")
    from hicache_kernels._ext import extension_status

    if extension_status()[0] and not any("kernel method skipped" in n for n in report["notes"]):
        assert {p["sm_budget"] for p in bw if p["method"] == "kernel"} == {1, 4}
    if report["link"].get("error") is None:
        assert report["theoretical_gbps"] > 0
        assert all(p["theoretical_gbps"] == report["theoretical_gbps"] for p in points)
