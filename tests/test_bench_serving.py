"""The serving benchmark runs every mode on one request stream and writes JSON; the hit rates order as
the tiers promise (times are the benchmark's business: no timed assertions here)."""

from __future__ import annotations

import json

import pytest

from hicache.bench_serving import MODES, main


@pytest.mark.parametrize("workload", ["multiturn", "longqa"])
def test_bench_serving_quick(tmp_path, workload):
    out = tmp_path / "serving.json"
    args = ["--quick", "--workload", workload, "--json", str(out), "--plot", str(tmp_path / "s.png")]
    assert main(args) == 0
    data = json.loads(out.read_text())
    if workload == "multiturn":  # --quick: the device pool holds a quarter of the working set
        assert data["device_slots"] <= data["working_set_tokens"] // 4 + 4
    res = {r["mode"]: r for r in data["results"]}
    assert list(res) == list(MODES)
    n = len(res["recompute"]["rows"])
    for r in res.values():
        assert r["requests"] == n and r["ttft_p50_s"] > 0 and r["throughput_tokens_per_s"] > 0
        assert r["device_hit_tokens"] + r["host_hit_tokens"] + r["computed_tokens"] == r["prompt_tokens"]
    assert res["recompute"]["device_hit_rate"] == res["recompute"]["host_hit_rate"] == 0
    assert res["device"]["host_hit_rate"] == 0 < res["device"]["device_hit_rate"]
    hier = res["hierarchical"]
    assert hier["device_hit_rate"] + hier["host_hit_rate"] >= res["device"]["device_hit_rate"]
    assert (tmp_path / "s.png").stat().st_size > 0


def test_bench_serving_refusals(capsys):
    with pytest.raises(SystemExit):
        main(["--device-fraction", "0"])
    assert "--device-fraction" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert main(["--quick", "--device", "cuda"]) == 2
        assert "no CUDA device is visible" in capsys.readouterr().err


def test_bench_serving_batches(tmp_path):
    out = tmp_path / "serving.json"
    assert main(["--quick", "--max-parallel", "3", "--modes", "recompute", "hierarchical", "--json", str(out)]) == 0
    rows = {r["mode"]: r["rows"] for r in json.loads(out.read_text())["results"]}
    assert max(r["batch"] for r in rows["hierarchical"]) == 3
