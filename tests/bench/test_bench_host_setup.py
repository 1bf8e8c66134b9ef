"""The host set-up benchmark runs end to end on a small buffer and writes its JSON; wrong arguments are
refused naming them. No figure is asserted (CI's machine is busy): only that each was measured."""

from __future__ import annotations

import json
import re

import pytest
from provenancecheck import check_provenance

from hicache.bench import host_setup
from hicache.pools import host_memory


def test_bench_host_setup_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(host_memory, "_SMALL_BYTES", 0)  # the thread counts asked for, on a small buffer
    out = tmp_path / "setup.json"
    args = ["--gib", "0.03125", "--threads", "1", "3", "--repeats", "2", "--no-pin", "--json", str(out)]
    rc = host_setup.main(args)
    data = json.loads(out.read_text())
    assert data["bench"] == "hicache.bench.host_setup" and data["bytes"] == 32 << 20 and not data["pinned"]
    assert data["memset_s"] > 0 and data["memset_gbps"] > 0
    default = host_memory._default_threads()
    assert [r["threads"] for r in data["results"]] == sorted({1, 3, default})
    for r in data["results"]:
        assert r["threads_used"] == r["threads"] and r["populate"] == "madvise"
        assert r["populate_s"] > 0 and r["populate_gbps"] > 0 and r["register_s"] == 0.0
        assert r["vs_memset"] == pytest.approx(data["memset_s"] / r["populate_s"])
    assert data["target"]["status"] in ("PASS", "MISS") and rc == 0
    assert "single-threaded memset" in capsys.readouterr().out
    check_provenance(data, "hicache.bench.host_setup", args)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--gib", "0"], "--gib: expected a positive size"),
        (["--gib", "100000"], "--gib: .* does not fit in available RAM"),
        (["--repeats", "0"], "--repeats: expected >= 1"),
        (["--threads", "2", "0"], "--threads: expected counts >= 1"),
        (["--numa-node", "4096"], "--numa-node: numa_node: node 4096 has no memory here"),
        (["--pin"], "--pin: pinning needs CUDA"),
    ],
)
def test_bench_host_setup_refuses_wrong_arguments(args, match, capsys):
    with pytest.raises(SystemExit) as e:
        host_setup.main(args)
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)
