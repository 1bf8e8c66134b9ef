"""``python -m hicache_kernels.bench --host-overhead`` on CPU pools: every row, its JSON and targets, the
no-op backend's routing (timing itself is never judged here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from provenancecheck import check_provenance

from hicache_kernels import bench, benchutil, targets
from hicache_kernels.bench import host_overhead


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hicache_kernels.bench", *args], capture_output=True, text=True)


def test_host_timer_reads_the_clock_around_the_call_only():
    ticks = iter([1_000, 251_000])  # ns: before and after fn
    calls = []
    timer = benchutil.HostTimer(clock=lambda: next(ticks))
    assert timer.time_ms(lambda: calls.append(1)) == pytest.approx(0.25) and calls == [1]
    assert benchutil.issuing(timer).__enter__() is None  # no stream to enter


def test_host_overhead_mode_writes_every_op_and_targets_reads_it(tmp_path):
    """The mode on CPU pools: a row per op, custom op, compat function and layer-wise load, for every
    pool and index-checking mode, in a bench JSON that targets accepts (timing is not judged here)."""
    from hicache_kernels.compat import sgl_kernel

    out = tmp_path / "host.json"
    argv = ["--host-overhead", "--calls", "20", "--json", str(out), "--csv", str(tmp_path / "host.csv")]
    proc = cli(*argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "layer-wise load of deepseek-v3 (61 layers):" in proc.stdout
    doc = json.loads(out.read_text())
    check_provenance(doc, "hicache_kernels.bench", argv)
    assert doc["mode"] == targets.HOST_OVERHEAD_MODE and doc["meta"]["tool"] == "bench"
    assert doc["host_overhead"]["backend"] == "noop" and bench.validate_bench_json(doc) == []
    pts = doc["points"]
    assert {p["kind"] for p in pts} == {"host_overhead"}
    # 20 timed calls a row; the layer-wise rows time max(10, 20 / 10) blocks of every layer's load.
    assert {p["calls"] for p in pts if p["path"] != "layerwise"} == {20}
    assert {p["calls"] for p in pts if p["path"] == "layerwise"} == {10}
    pools = {"mha-3layer": 3, "mla-3layer": 3, "deepseek-v3": 61}
    assert {(p["pool"], p["num_layers"]) for p in pts} == set(pools.items())
    ops = ("backup_layer", "backup_all_layers", "load_layer", "load_all_layers")
    for path in ("eager", "custom_op"):
        got = {(p["op"], p["pool"], p["check_indices"]) for p in pts if p["path"] == path}
        assert got == {(op, pool, check) for op in ops for pool in pools for check in (False, True)}, path
    layerwise = {(p["pool"], p["check_indices"], p["calls_per_sample"]) for p in pts if p["path"] == "layerwise"}
    assert layerwise == {(pool, check, n) for pool, n in pools.items() for check in (False, True)}
    compat = {p["op"] for p in pts if p["path"] == "compat"}
    assert compat == set(sgl_kernel.__all__) - host_overhead.COMPAT_NOT_TIMED
    assert all(p["median_us"] > 0 and p["p90_us"] >= p["median_us"] for p in pts)
    proc = subprocess.run([sys.executable, "-m", "hicache_kernels.targets", str(out), "--json"], capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode in (0, 1) and proc.stderr == "", proc.stdout + proc.stderr  # pass or MISS: not judged here
    rows = json.loads(proc.stdout)
    assert [r["status"] == "n/a" for r in rows] == [True] * 7 + [False] * 5
    assert proc.returncode == (1 if any(r["status"] == "MISS" for r in rows) else 0)


def test_host_overhead_calls_reach_the_noop_backend_and_routing_is_undone():
    from hicache_kernels.backends import get_backend
    from hicache_kernels.compat import sgl_kernel

    shared = [get_backend(name) for name in host_overhead.ROUTED_NAMES]
    points = host_overhead.measure_host_overhead(3, torch.device("cpu"))  # raises NotRoutedError otherwise
    assert points and all(p["backend"] == "noop" for p in points)
    # The shared backends are themselves again, and compat is back on its own backend.
    assert all("prepare" not in vars(b) and "run" not in vars(b) for b in shared)
    assert sgl_kernel._backend_name == "kernel"


def test_host_overhead_refuses_a_call_that_misses_the_noop_backend():
    noop = host_overhead.NoopBackend()
    with pytest.raises(host_overhead.NotRoutedError, match="prepared 0 and issued 0 copies .* expected 13"):
        host_overhead.time_row(lambda: None, noop, 3, 1, "a call that copies nothing")
    # One that prepares but never issues is refused too.
    with pytest.raises(host_overhead.NotRoutedError, match="prepared 13 and issued 0"):
        host_overhead.time_row(lambda: noop.prepare(None), noop, 3, 1, "a plan never issued")


@pytest.mark.gpu
def test_host_overhead_on_cuda_pools():
    """On a GPU the pools, indices and address tables are CUDA tensors (host pool pinned), and every
    call still reaches the no-op backend."""
    points = host_overhead.measure_host_overhead(5, torch.device("cuda", torch.cuda.current_device()))
    assert {p["device"] for p in points} == {"cuda"}
    assert bench.validate_bench_json({"meta": benchutil.run_meta("bench", {}), "points": points}) == []
