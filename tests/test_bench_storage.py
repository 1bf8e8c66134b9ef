"""The storage benchmark runs end to end on a tiny configuration and writes its JSON."""

from __future__ import annotations

import json

from hicache.bench_storage import main


def test_bench_storage_writes_json(tmp_path, capsys):
    out = tmp_path / "storage.json"
    args = ["--presets", "deepseek-v3", "--page-sizes", "1", "4", "--pages", "3", "--repeats", "1",
            "--prefetch-hits", "1", "2", "--dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    assert main(args) == 0  # fewer than 128 pages: the target does not apply, nothing missed
    data = json.loads(out.read_text())
    assert data["bench"] == "hicache.bench_storage" and data["backend"] == "file"
    assert [(r["preset"], r["page_size"], r["pages"]) for r in data["results"]] == [
        ("deepseek-v3", 1, 3), ("deepseek-v3", 4, 3)]  # fmt: skip
    for r in data["results"]:
        assert r["bytes"] == 3 * r["page_bytes"] and r["get_gbps"] > 0 and r["seq_read_gbps"] > 0
        assert r["get_over_seq_read"] > 0 and r["set_over_seq_write"] > 0
    assert [p["hit_pages"] for p in data["prefetch"]] == [1, 2]
    assert all(p["latency_s"] > 0 for p in data["prefetch"])
    assert data["target"]["status"] is None
    assert "get/seq" in capsys.readouterr().out


def test_bench_storage_refuses_bad_counts(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--pages", "0"])
    assert "--pages: expected >= 1" in capsys.readouterr().err
