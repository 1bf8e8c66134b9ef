"""The radix-tree benchmark runs, writes valid JSON, and its hit rate is the workload's real one."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from provenancecheck import check_provenance

from hicache.bench.tree import Workload, main, make_requests
from hicache.tree.core import choose_core, compiled_core_status

TINY = ["--conversations", "6", "--turns", "3", "--system-prompts", "2", "--system-len", "40",
        "--question-len", "12", "--answer-len", "20", "--repeats", "2", "--page-sizes", "1", "4"]  # fmt: skip


def reference_hits(requests: list[list[int]], page_size: int) -> int:
    """Tokens each request shares (page-aligned) with the longest-matching earlier request."""
    hits = 0
    for i, req in enumerate(requests):
        best = 0
        for prev in requests[:i]:
            prev = prev[: len(prev) - len(prev) % page_size]
            n = 0
            while n < min(len(req), len(prev)) and req[n] == prev[n]:
                n += 1
            best = max(best, n - n % page_size)
        hits += best
    return hits


def test_bench_tree_writes_json_with_the_workloads_hit_rate(tmp_path):
    out = tmp_path / "tree.json"
    argv = [*TINY, "--no-sglang", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["bench"] == "hicache.bench.tree" and data["sglang_version"] is None
    check_provenance(data, "hicache.bench.tree", argv)
    w = Workload(0, 6, 3, 2, 40, 12, 20)
    requests = make_requests(w)
    assert data["workload"]["requests"] == len(requests) == 18
    total = sum(len(r) for r in requests)
    assert data["workload"]["tokens"] == total
    assert [row["page_size"] for row in data["results"]] == [1, 4]
    compiled, _ = compiled_core_status()
    assert data["tree_cores"] == (["compiled", "python"] if compiled else ["python"])
    for row in data["results"]:
        assert row["tree_core"] == data["tree_cores"][0]
        runs = [row["hicache"], row["hicache_array"], *([row["hicache_python"]] if compiled else [])]
        assert ("hicache_python" in row) == compiled
        for h in runs:  # both cores, lists and array('q') prompts: the workload's exact hit rate
            assert h["requests_per_s"] > 0 and len(h["times_s"]) == 2 and "sglang" not in row
            assert h["hit_rate"] == reference_hits(requests, row["page_size"]) / total


def test_bench_tree_slot_cycle(tmp_path, capsys):
    """The slot bookkeeping timing: one row per size, leaves the pools balanced (a second run of the
    same cycle would fail on a leaked or wrongly stated slot); bad sizes refused."""
    from hicache.bench.tree import slot_cycle

    rows = slot_cycle([16, 64], cycles=3, repeats=2)
    assert [(r["slots"], r["page_size"]) for r in rows] == [(16, 16), (64, 16)]
    assert all(r["us_per_cycle"] > 0 for r in rows)
    out = tmp_path / "tree.json"
    assert main([*TINY, "--no-sglang", "--tree-core", "python", "--slot-sizes", "32", "--json", str(out)]) == 0
    assert [r["slots"] for r in json.loads(out.read_text())["slot_cycle"]] == [32]
    with pytest.raises(SystemExit):
        main([*TINY, "--slot-sizes", "20"])
    assert "--slot-sizes: expected multiples of 16" in capsys.readouterr().err


def test_bench_tree_one_core(tmp_path):
    out = tmp_path / "tree.json"
    assert main([*TINY, "--no-sglang", "--tree-core", "python", "--page-sizes", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["tree_cores"] == ["python"]
    (row,) = data["results"]
    assert row["tree_core"] == "python" and "hicache_python" not in row


def test_workload_is_seeded_and_multi_turn():
    w = Workload(seed=3, conversations=4, turns=3, system_prompts=2, system_len=16, question_len=8, answer_len=8)
    a, b = make_requests(w), make_requests(w)
    assert a == b and len(a) == 12
    assert make_requests(Workload(seed=4, conversations=4, turns=3, system_len=16)) != a
    # Each request extends an earlier one of its conversation (or starts from a system prompt).
    starts = {tuple(r[:16]) for r in a}
    assert len(starts) <= 2


# ---------------------------------------------------------------- --scale (hicache.bench.scale)
@pytest.mark.parametrize("core", ["both", "python"])
def test_scale_quick_writes_json_with_the_schema_fields(core, tmp_path, capsys):
    """The quick scale run: every size filled to a full host pool, the device pool full (most requests
    evict), copies through the no-op, the split adding up to the total, verify() passing throughout."""
    from hicache.bench import scale as bench_scale

    out = tmp_path / "scale.json"
    argv = ["--scale", "--quick", "--tree-core", core, "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["bench"] == "hicache.bench.tree --scale"
    check_provenance(data, "hicache.bench.tree", argv)
    assert {"git_commit", "time_utc", "torch", "host", "machine", "cpus"} <= set(data["meta"])
    c = data["config"]
    assert (c["page_size"], c["prompt_tokens"], c["requests"], c["host_ratio"], c["verify"]) == (16, 33, 30, 4.0, True)
    assert c["io_backend"].startswith("noop")
    rows = data["results"]
    assert [r["device_slots"] for r in rows] == list(bench_scale.QUICK_SIZES)
    expected_core = choose_core("auto" if core == "both" else core)[0]
    for r in rows:
        assert r["tree_core"] == expected_core
        assert r["host_slots"] == 4 * r["device_slots"] and r["requests"] == 30
        assert r["nodes_after_fill"] >= 0.9 * r["host_slots"] // 16  # filled to the host pool (1 page a node)
        assert r["evicting_fraction"] >= 0.5 and r["host_hit_fraction"] > 0 and r["copies_issued"] > 0
        assert r["metrics"]["load_backs"] > 0 and r["metrics"]["host_evicted_tokens"] > 0
        assert 0 < r["median_us"] <= r["p99_us"] <= r["max_us"]
        assert set(r["split"]) == set(bench_scale.PHASES)
        parts = sum(r["split"][p]["mean_us"] for p in bench_scale.PHASES)
        assert parts == pytest.approx(r["mean_us"], rel=1e-9)
    assert data["growth_ratio"] == rows[-1]["median_us"] / rows[0]["median_us"]
    assert set(data["targets"]) >= {"median_met", "p99_met", "growth_met"}
    printed = capsys.readouterr().out
    assert "growth (median, largest / smallest)" in printed and str(bench_scale.QUICK_SIZES[-1]) in printed


def test_scale_rounds_interleave_the_sizes_without_changing_their_requests():
    """The sizes' timed requests run in interleaved rounds; each size has its own seeded stream, so it
    serves the same requests, with the same outcome, as alone in one round."""
    from hicache.bench.scale import ScaleConfig, run_size, run_sizes

    cfg = ScaleConfig(requests=12, warmup=3, rounds=4)
    together = run_sizes([512, 1024], cfg)
    alone = [run_size(n, dataclasses.replace(cfg, rounds=1)) for n in (512, 1024)]
    keep = ("device_slots", "requests", "nodes", "device_tokens", "host_tokens", "evicting_fraction",
            "device_hit_fraction", "host_hit_fraction", "copies_issued", "metrics")  # fmt: skip
    assert [{k: r[k] for k in keep} for r in together] == [{k: r[k] for k in keep} for r in alone]
    assert all(r["requests"] == 12 for r in together)


def test_scale_growth_ratio_is_from_the_medians():
    from hicache.bench.scale import growth_ratio, p99

    rows = [{"device_slots": 4096, "median_us": 300.0, "mean_us": 1.0},
            {"device_slots": 1024, "median_us": 120.0, "mean_us": 9.0},
            {"device_slots": 2048, "median_us": 999.0, "mean_us": 5.0}]  # fmt: skip
    assert growth_ratio(rows) == 300.0 / 120.0  # largest size over smallest size, not max/min of the medians
    assert growth_ratio(rows[:1]) is None
    assert p99(list(range(1, 201))) == 198 and p99([5.0]) == 5.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--scale-sizes", "100"],
            "--scale-sizes: expected device slots >= 256 and a multiple of the page size 16, got 100",
        ),
        (["--scale-sizes", "1024", "1000"], "a multiple of the page size 16, got 1000"),
        (["--scale-sizes", "1024", "1024"], "--scale-sizes: a size given twice"),
        (["--requests", "0"], "--requests: expected >= 1, got 0"),
        (["--compare", "sglang-latest"], "--compare: applies to the match + insert comparison, not to --scale"),
    ],
)
def test_scale_refuses_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit):
        main(["--scale", *args])
    assert message in capsys.readouterr().err


def test_scale_flags_need_scale(capsys):
    with pytest.raises(SystemExit):
        main([*TINY, "--scale-sizes", "1024"])
    assert "--scale-sizes: only with --scale" in capsys.readouterr().err


# ---------------------------------------------------------------- --compare sglang-latest (hicache.bench.sglang)
def test_compare_sglang_latest_says_why_when_sglang_does_not_import(tmp_path, capsys):
    """A directory whose ``sglang`` lacks the radix cache (first on the child's import path, so an
    installed SGLang is not reached): no SGLang row, the reason in the JSON and the printout."""
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("__version__ = '0.0.fake'\n")
    out = tmp_path / "tree.json"
    argv = [*TINY, "--no-sglang", "--tree-core", "python", "--slot-sizes", "--compare", "sglang-latest"]
    assert main([*argv, "--sglang-path", str(fake), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    check_provenance(data, "hicache.bench.tree", [*argv, "--sglang-path", str(fake), "--json", str(out)])
    latest = data["sglang_latest"]
    assert latest["available"] is False
    assert latest["reason"] == (
        f"the sglang package at {fake / 'sglang'} has no srt/mem_cache/unified_radix_cache.py (SGLang 0.5.23 has)"
    )
    assert all("sglang_latest" not in row for row in data["results"])
    assert "sglang-latest (0.5.23, rust core): unavailable: the sglang package at" in capsys.readouterr().out


def test_sglang_latest_unavailable_without_its_rust_core(tmp_path, monkeypatch):
    """A package with the UnifiedRadixCache but no bundled Rust core (e.g. a source checkout) is refused
    before anything imports, naming the missing extension; no SGLang at all is refused too."""
    from hicache.bench import sglang as bench_sglang

    mem_cache = tmp_path / "sglang" / "srt" / "mem_cache"
    (mem_cache / "rust_tree_core").mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (mem_cache / "unified_radix_cache.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(bench_sglang.Unavailable, match=r"bundles no Rust TreeCore .*rust_tree_core/mem_cache\."):
        bench_sglang.load_unified()
    monkeypatch.setattr(bench_sglang.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(bench_sglang.Unavailable, match="SGLang is not importable: pass the directories"):
        bench_sglang.load_unified()


def test_sglang_child_without_a_result_is_reported():
    from hicache.bench.sglang import run_child

    out = run_child(["--no-such-flag"], [])
    assert out["available"] is False
    assert "exited 2 without a result" in out["reason"] and "--no-such-flag" in out["reason"]


def test_sglang_latest_rows_merge_only_for_the_same_requests():
    from hicache.bench.tree import add_sglang_latest, requests_digest

    requests = make_requests(Workload(0, 2, 2, 1, 16, 8, 8))
    ours = {"requests_per_s": 300.0, "hit_rate": 0.5}

    def child(digest: str) -> dict:
        sgl = {"requests_per_s": 100.0, "hit_rate": 0.5}
        return {"available": True, "version": "0.5.23", "requests_digest": digest, "results": {"16": sgl}}

    same_input = {"requests_per_s": 400.0, "hit_rate": 0.5}  # ours on array('q') prompts, as SGLang's side
    out = {"results": [{"page_size": 16, "hicache": dict(ours), "hicache_array": dict(same_input)}]}
    add_sglang_latest(out, child(requests_digest(requests)), requests)
    (row,) = out["results"]
    assert out["sglang_latest"]["available"] and row["speedup_vs_sglang_latest"] == 3.0
    assert row["speedup_vs_sglang_latest_same_input"] == 4.0
    assert row["hit_rates_equal_latest"] is True and "results" not in out["sglang_latest"]
    out = {"results": [{"page_size": 16, "hicache": dict(ours), "hicache_array": dict(same_input)}]}
    add_sglang_latest(out, child(requests_digest(requests[:-1])), requests)
    assert out["sglang_latest"] == {
        "available": False, "reason": "the SGLang child process ran different requests (digest mismatch)"
    }  # fmt: skip
    assert "sglang_latest" not in out["results"][0]


@pytest.mark.skipif(not os.environ.get("HICACHE_SGLANG_PATH"), reason="HICACHE_SGLANG_PATH (SGLang 0.5.23) not set")
def test_compare_sglang_latest_runs_on_the_rust_core(tmp_path):
    out = tmp_path / "tree.json"
    argv = [*TINY[:-3], "--page-sizes", "1", "16", "--no-sglang", "--slot-sizes", "--compare", "sglang-latest"]
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    latest = data["sglang_latest"]
    assert latest["available"], latest.get("reason")
    assert latest["version"] == "0.5.23" and latest["tree_core_class"].endswith("RustUnifiedTreeCore")
    for row in data["results"]:
        assert row["hit_rates_equal_latest"] and row["sglang_latest"]["requests_per_s"] > 0
