"""The storage benchmark runs end to end on a tiny configuration and writes its JSON."""

from __future__ import annotations

import json

from provenancecheck import check_provenance

from hicache.bench.storage import main


def test_bench_storage_writes_json(tmp_path, capsys):
    out = tmp_path / "storage.json"
    args = ["--presets", "deepseek-v3", "--page-sizes", "1", "4", "--pages", "3", "--repeats", "1",
            "--prefetch-hits", "1", "2", "--dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    assert main(args) == 0  # fewer than 128 pages: the target does not apply, nothing missed
    data = json.loads(out.read_text())
    assert data["bench"] == "hicache.bench.storage" and data["backend"] == "file"
    assert [(r["preset"], r["page_size"], r["pages"]) for r in data["results"]] == [
        ("deepseek-v3", 1, 3), ("deepseek-v3", 4, 3)]  # fmt: skip
    for r in data["results"]:
        assert r["bytes"] == 3 * r["page_bytes"] and r["get_gbps"] > 0 and r["seq_read_gbps"] > 0
        assert r["get_over_seq_read"] > 0 and r["set_over_seq_write"] > 0
    assert [p["hit_pages"] for p in data["prefetch"]] == [1, 2]
    assert all(p["objects_per_page"] == 1 and p["layout"] == "page_first" for p in data["prefetch"])  # MLA
    assert all(p["latency_s"] > 0 for p in data["prefetch"])
    assert data["target"]["status"] is None
    assert data["objects"] == []  # MLA pages are stored as they are
    assert "get/seq" in capsys.readouterr().out
    check_provenance(data, "hicache.bench.storage", args)


def test_bench_storage_reports_the_objects_staging_cost(tmp_path, capsys):
    """An MHA preset: per host layout, zero copy (page_head) or the staging copy's GB/s (the others)."""
    out = tmp_path / "storage.json"
    args = ["--presets", "llama3-8b", "--page-sizes", "1", "--pages", "2", "--repeats", "1", "--prefetch-hits",
            "--dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    objects = {o["layout"]: o for o in json.loads(out.read_text())["objects"]}
    assert sorted(objects) == ["layer_first", "page_first", "page_first_direct", "page_head"]
    for layout, o in objects.items():
        assert o["objects_per_page"] == 8 and o["object_bytes"] == 2 * 32 * 128 * 2  # a head: K and V, 32 layers
        assert o["zero_copy"] == (layout == "page_head")
        assert o["zero_copy"] or (o["gather_gbps"] > 0 and o["scatter_gbps"] > 0 and o["pages"] >= 1)
    assert "staged: gather" in capsys.readouterr().out


def test_bench_storage_prefetch_layout_and_head_group(tmp_path, capsys):
    out = tmp_path / "storage.json"
    args = ["--presets", "llama3-8b", "--page-sizes", "1", "--pages", "1", "--repeats", "3", "--prefetch-hits", "1",
            "--prefetch-layout", "page_head", "--head-group", "2", "--dir", str(tmp_path),
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    (p,) = json.loads(out.read_text())["prefetch"]
    assert (p["layout"], p["head_group"], p["objects_per_page"]) == ("page_head", 2, 4) and p["latency_s"] > 0
    # each of --repeats prefetches into a fresh cache; the row's latency is their median
    assert len(p["latencies_s"]) == 3 and p["latency_s"] == sorted(p["latencies_s"])[1]
    assert "4 objects a page" in capsys.readouterr().out
    import pytest

    with pytest.raises(SystemExit):
        main(["--head-group", "0"])
    assert "--head-group: expected >= 1" in capsys.readouterr().err


def test_bench_storage_refuses_bad_counts(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--pages", "0"])
    assert "--pages: expected >= 1" in capsys.readouterr().err


def test_bench_storage_direct_io_writes_json(tmp_path, capsys):
    """``--direct-io``: one preset whose pages are whole blocks (Llama-3-8B, 128 KiB a token) and one whose
    pages are not (DeepSeek-V3, 70,272 bytes): the schema, the counts and the page-cache fields, not the
    speed."""
    import pytest

    from hicache.storage.file import probe_direct_io

    reason = probe_direct_io(tmp_path)
    if reason is not None:
        pytest.skip(f"{tmp_path} does not take O_DIRECT: {reason}")
    out = tmp_path / "direct.json"
    args = ["--direct-io", "--presets", "llama3-8b", "deepseek-v3", "--page-sizes", "1", "--pages", "2",
            "--repeats", "1", "--prefetch-hits", "--dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    assert main(args) == 0  # fewer than 128 pages: no verdict
    data = json.loads(out.read_text())
    assert data["direct_io"] is True and data["prefetch"] == []
    aligned, unaligned = data["results"]
    for r in data["results"]:
        assert r["direct_io"] is True and r["bytes"] == 2 * r["page_bytes"]
        assert r["get_over_seq_read"] > 0 and r["seq_read_gbps"] > 0
        assert isinstance(r["store_cached_bytes"], int) and isinstance(r["seq_cached_bytes"], int)
        assert r["page_cache_growth_bytes"] is None or isinstance(r["page_cache_growth_bytes"], int)
    # one set and one get of 2 pages each
    assert (aligned["direct_pages"], aligned["direct_fallbacks"]) == (4, 0)
    assert (unaligned["direct_pages"], unaligned["direct_fallbacks"]) == (0, 4)
    target = data["target"]
    assert target["get_over_seq_read_min"] == 0.8 and target["status"] is None
    assert target["store_cached_share_max"] == 0.01 and target["page_cache_status"] is None
    printed = capsys.readouterr().out
    assert "O_DIRECT: 4 pages direct, 0 buffered" in printed and "O_DIRECT: 0 pages direct, 4 buffered" in printed


def test_bench_storage_direct_io_needs_the_file_backend(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--direct-io", "--backend", "mooncake"])
    assert "--direct-io: only the file backend" in capsys.readouterr().err


def test_bench_storage_prefetch_latency_is_the_median_of_its_repeats(tmp_path, monkeypatch):
    """Three prefetches timed 0.2 s, 0.1 s and 0.3 s (a stand-in clock): the row says 0.2 s, the median,
    neither the first nor the last."""
    import types

    from hicache.bench import storage as bench
    from hicache.storage import FileBackend

    ticks = iter([0.0, 0.2, 1.0, 1.1, 2.0, 2.3])
    clock = types.SimpleNamespace(perf_counter=lambda: next(ticks), sleep=lambda s: None)
    monkeypatch.setattr(bench, "time", clock)
    (row,) = bench.bench_prefetch(lambda: FileBackend(tmp_path / "store"), "deepseek-v3", 1, [1], repeats=3)
    assert [round(t, 6) for t in row["latencies_s"]] == [0.2, 0.1, 0.3]
    assert round(row["latency_s"], 6) == 0.2
