"""The serving benchmark runs every mode on one request stream and writes JSON; the hit rates order as
the tiers promise (times are the benchmark's business: no timed assertions here)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from provenancecheck import check_provenance

from hicache.bench.serving import MODES, main, parse_args, pool_sizes
from hicache.serving.workloads import longqa


@pytest.mark.parametrize("workload", ["multiturn", "longqa"])
def test_bench_serving_quick(tmp_path, workload):
    out = tmp_path / "serving.json"
    args = ["--quick", "--workload", workload, "--json", str(out), "--plot", str(tmp_path / "s.png")]
    assert main(args) == 0
    data = json.loads(out.read_text())
    if workload == "multiturn":  # --quick: the device pool holds a quarter of the working set
        assert data["device_slots"] <= data["working_set_tokens"] // 4 + 4
        assert data["documents_kv_tokens"] is None
    else:  # ... and of the documents' KV
        assert data["documents_kv_tokens"] >= 4 * data["device_slots"]
        assert data["documents_kv_over_device_pool"] == data["documents_kv_tokens"] / data["device_slots"]
    res = {r["mode"]: r for r in data["results"]}
    assert list(res) == list(MODES)
    n = len(res["recompute"]["rows"])
    for r in res.values():
        assert r["requests"] == n and r["ttft_p50_s"] > 0 and r["throughput_tokens_per_s"] > 0
        assert r["device_hit_tokens"] + r["host_hit_tokens"] + r["computed_tokens"] == r["prompt_tokens"]
    assert res["recompute"]["device_hit_rate"] == res["recompute"]["host_hit_rate"] == 0
    assert res["device"]["host_hit_rate"] == 0
    if workload == "multiturn":  # longqa: a document is evicted before its next question, hits are rare
        assert res["device"]["device_hit_rate"] > 0
    hier = res["hierarchical"]
    assert hier["device_hit_rate"] + hier["host_hit_rate"] >= res["device"]["device_hit_rate"]
    assert (tmp_path / "s.png").stat().st_size > 0
    assert data["target"]["status"] == "n/a" and data["target"]["measured"] > 0  # a CPU run: the ratio only
    assert data["cpu_ordering"]["hit_rate_above_device_only"] is True
    check_provenance(data, "hicache.bench.serving", args)


@pytest.mark.parametrize(
    "model",
    [["--mla", "--indexer-dim", "8", "--recurrent-dim", "8"], ["--recurrent-dim", "8", "--layout", "page_head"],
     ["--sliding-window", "6", "--full-every", "2"],
     ["--sliding-window", "6", "--window-pool", "0.75", "--layout", "page_head"],
     ["--recurrent-dim", "8", "--recurrent-only", "--layout", "page_head"]],
    ids=["mla-indexer-recurrent", "recurrent", "sliding-window", "window-pool", "recurrent-layer"],
)  # fmt: skip
def test_bench_serving_hybrid_models(tmp_path, model):
    """The hybrid models through every mode they can run: each mode's answers equal recompute's (the
    benchmark checks), hits on the host tier."""
    out = tmp_path / "serving.json"
    assert main(["--quick", "--json", str(out), *model]) == 0
    data = json.loads(out.read_text())
    res = {r["mode"]: r for r in data["results"]}
    assert all(r["answers_equal_recompute"] for r in res.values())
    assert res["hierarchical"]["host_hit_rate"] > 0
    if "--window-pool" in model:  # the windowed layers' K/V: three quarters of the slots, not all of them
        assert res["hierarchical"]["device_kv_bytes"] < res["recompute"]["device_kv_bytes"]


def test_bench_serving_refusals(capsys):
    with pytest.raises(SystemExit):
        main(["--device-fraction", "0"])
    assert "--device-fraction" in capsys.readouterr().err
    for bad, what in ((["--recurrent-dim", "6", "--mla"], "--recurrent-dim: expected a multiple of --page-size"),
                      (["--recurrent-dim", "8"], "--indexer-dim, --recurrent-dim: the storage mode"),
                      (["--sliding-window", "4", "--mla"], "--sliding-window: served with MHA/GQA layers only"),
                      (["--full-every", "0"], "--full-every: expected >= 1"),
                      (["--recurrent-only"], "--recurrent-only: needs --recurrent-dim"),
                      (["--window-pool", "0.5", "--modes", "device"], "--window-pool: expected a fraction"),
                      (["--sliding-window", "6", "--window-pool", "0.5"], "--window-pool: the storage")):  # fmt: skip
        with pytest.raises(SystemExit):
            main(bad)
        assert what in capsys.readouterr().err, bad
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

    from hicache.serving.engine import Engine, ModelConfig, TinyLM
    from hicache.serving.workloads import Clients, multiturn

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


def test_serving_target_and_cpu_ordering():
    """The target row: pass / MISS only on a GPU with the working set at least 4x the device pool; the
    ratio is reported either way; n/a without both modes."""
    from hicache.bench.serving import cpu_ordering, serving_target

    def res(mode, p50, dev=0.0, host=0.0):
        return {"mode": mode, "ttft_p50_s": p50, "device_hit_rate": dev, "host_hit_rate": host}

    runs = [res("recompute", 4.0), res("device", 2.0, 0.4), res("hierarchical", 0.9, 0.4, 0.3)]
    assert serving_target(runs, 0.25, True)["status"] == "pass"
    assert serving_target(runs, 0.25, True)["measured"] == pytest.approx(0.45)
    assert serving_target(runs, 0.3, True)["status"] == "n/a"  # the pool is more than a quarter
    cpu = serving_target(runs, 0.25, False)
    assert cpu["status"] == "n/a" and cpu["measured"] == pytest.approx(0.45) and "GPU" in cpu["note"]
    runs[2]["ttft_p50_s"] = 1.1
    assert serving_target(runs, 0.25, True)["status"] == "MISS"
    assert serving_target(runs[:1], 0.25, True) | {"target": ""} == {"target": "", "measured": None,
                                                                     "threshold": 0.5, "status": "n/a"}  # fmt: skip
    assert cpu_ordering(runs) == {"hit_rate_above_device_only": True, "ttft_p50_below_recompute": True}
    runs[2]["ttft_p50_s"], runs[2]["host_hit_rate"] = 5.0, 0.0
    assert cpu_ordering(runs) == {"hit_rate_above_device_only": False, "ttft_p50_below_recompute": False}
    assert cpu_ordering(runs[:2]) == {"hit_rate_above_device_only": None, "ttft_p50_below_recompute": None}


@pytest.mark.parametrize("io_backend", ["direct", "staged", "triton"])
@pytest.mark.parametrize("workload", ["multiturn", "longqa"])
def test_every_mode_answers_as_recompute(tmp_path, workload, io_backend):
    """The quick workloads through every mode with each io-backend usable on CPU (Triton under its
    interpreter): the exact model's answers are the same in every mode, turn by turn, whatever tier
    each prompt came from."""
    out = tmp_path / "serving.json"
    argv = ["--quick", "--workload", workload, "--io-backend", io_backend, "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    res = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    want = {(r["client"], r["round"]): r["answer"] for r in res["recompute"]["rows"]}
    assert len(want) == (32 if workload == "multiturn" else 20) and all(len(a) == 4 for a in want.values())
    for mode in MODES[1:]:
        got = {(r["client"], r["round"]): r["answer"] for r in res[mode]["rows"]}
        assert got == want, mode
    assert res["hierarchical"]["host_hit_tokens"] > 0
    if workload == "longqa":  # the documents come back from the host pool, and from the store below it
        assert res["storage"]["storage_hit_tokens"] > 0
        assert res["hierarchical"]["host_hit_rate"] > res["device"]["device_hit_rate"]


@pytest.mark.parametrize("argv", [[], ["--quick"]])
@pytest.mark.parametrize("seed", range(12))
def test_longqa_shape(argv, seed):
    """The long-context workload as run (default and --quick): several documents whose KV is at least 4x
    the device pool and fits the host pool with everything else; each asked about several times, the
    questions interleaved across them (never one document twice in a row); a turn's round counts the
    questions on its document before it."""
    a = parse_args(["--workload", "longqa", "--seed", str(seed), *argv])
    turns, prompt_of = longqa(a, random.Random(a.seed))
    sizes = pool_sizes(a, turns, prompt_of)
    assert sizes.documents_kv == a.docs * a.doc_len >= 4 * sizes.device_slots
    assert sizes.host_ratio * sizes.device_slots >= sizes.working_set
    docs: dict[tuple[int, ...], int] = {}
    order = [docs.setdefault(tuple(t.prompt[: a.doc_len]), len(docs)) for t in turns]
    assert len(docs) == a.docs >= 8 and len(turns) == a.questions
    assert all(len(t.prompt) == a.doc_len + a.turn_len and prompt_of(t, {}) == t.prompt for t in turns)
    assert [t.client for t in turns] == list(range(a.questions))
    assert all(x != y for x, y in zip(order, order[1:], strict=False)), order
    per_doc = Counter(order)
    assert min(per_doc.values()) >= 2 and max(per_doc.values()) - min(per_doc.values()) <= 1
    seen: Counter[int] = Counter()
    for t, d in zip(turns, order, strict=True):
        assert t.round == seen[d]
        seen[d] += 1


def test_longqa_is_deterministic_per_seed():
    a = parse_args(["--workload", "longqa", "--quick", "--rate", "4"])

    def stream(seed):
        return [(t.at, t.round, t.client, t.prompt) for t in longqa(a, random.Random(seed))[0]]

    assert stream(3) == stream(3)
    assert stream(3) != stream(4)
    ats = [x[0] for x in stream(3)]
    assert ats == sorted(ats) and ats[0] > 0  # Poisson arrivals at --rate
