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


@pytest.mark.parametrize("rate", [0.0, 4.0])
def test_clients_send_closed_loop_within_max_parallel(monkeypatch, rate):
    """The multi-turn clients: a turn is sent only after the answer to the client's previous one, with
    that answer in its prompt, and never more than --max-parallel requests are in flight."""
    import argparse
    import random

    from hicache.bench_serving import Clients, multiturn
    from hicache.engine import Engine, ModelConfig, TinyLM

    args = argparse.Namespace(vocab=64, system_len=6, turn_len=3, clients=5, rounds=3, rate=rate, output_len=2)
    turns, prompt_of = multiturn(args, random.Random(0))
    cfg = ModelConfig(num_layers=1, hidden=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn=16, vocab=64)
    model = TinyLM(cfg)
    t = [0.0]
    real = model.forward_batch

    def forward_batch(*a, **k):
        t[0] += 0.25
        return real(*a, **k)

    monkeypatch.setattr(model, "forward_batch", forward_batch)
    source = Clients(turns, prompt_of, max_parallel=2)
    results = Engine(model, cfg.pool(256, 2)).serve(
        source, max_running=4, clock=lambda: t[0], idle=lambda s: t.__setitem__(0, t[0] + s)
    )
    assert len(results) == len(turns) == 15
    by = {r.rid: r for r in results}
    sched = {(q.client, q.round): q.at for q in turns}
    for (c, k), r in by.items():
        assert r.arrival_s >= sched[(c, k)]
        if k:
            prev = by[(c, k - 1)]
            assert r.arrival_s >= prev.arrival_s + prev.total_s  # closed loop
            prompt = prompt_of(turns[0].__class__(0, k, c, None, 2), source.answers)
            assert r.device_hit + r.host_hit + r.computed == len(prompt)
            assert source.answers[(c, k - 1)] == prev.tokens
    spans = [(r.arrival_s, r.arrival_s + r.total_s) for r in results]
    for a, _ in spans:  # in flight at each send: the requests sent before and not finished by then
        assert sum(1 for x, y in spans if x <= a < y) <= 2
    assert max(sum(1 for x, y in spans if x <= a < y) for a, _ in spans) == 2
