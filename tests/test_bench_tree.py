"""The radix-tree benchmark runs, writes valid JSON, and its hit rate is the workload's real one."""

from __future__ import annotations

import json

import pytest

from hicache.bench_tree import Workload, main, make_requests
from hicache.tree_core import compiled_core_status

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
    assert main([*TINY, "--no-sglang", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["bench"] == "hicache.bench_tree" and data["sglang_version"] is None
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
        runs = [row["hicache"], *([row["hicache_python"]] if compiled else [])]
        assert ("hicache_python" in row) == compiled
        for h in runs:  # both cores: the workload's exact hit rate
            assert h["requests_per_s"] > 0 and len(h["times_s"]) == 2 and "sglang" not in row
            assert h["hit_rate"] == reference_hits(requests, row["page_size"]) / total


def test_bench_tree_slot_cycle(tmp_path, capsys):
    """The slot bookkeeping timing: one row per size, leaves the pools balanced (a second run of the
    same cycle would fail on a leaked or wrongly stated slot); bad sizes refused."""
    from hicache.bench_tree import slot_cycle

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
