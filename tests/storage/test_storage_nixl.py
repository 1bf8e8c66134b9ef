"""Tests of the nixl storage backend over NIXL's POSIX plugin: real NIXL, real files, no GPU. Round trips
for every host layout (MHA and MLA) compared as whole tensors; one NIXL transfer per batch; a second
process reading what the first wrote; the file backend reading NIXL's objects and the other way round;
damaged objects and failing transfers as misses; staging buffers (``extra_buffers``) registered at
attach; the clear errors (NIXL missing, a bad plugin, a closed backend); the storage benchmark.

Needs NIXL (``pip install hicache-kernels[nixl]``, or ``HICACHE_NIXL=1 bash scripts/setup.sh``); without it
the tests that need it skip, saying so, and the missing-NIXL error is still checked.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import threading

import pytest
import torch
from storagedata import PAGE, host_pool, page_bytes

from hicache.storage import FileBackend, Namespace, create_backend, page_keys
from hicache.storage.file import HEADER_BYTES
from hicache.storage.nixl import NIXL_MODULES, NixlBackend, install_hint, load_nixl, nixl_status
from hicache_kernels import layouts

try:
    load_nixl()
    NO_NIXL = None
except ImportError as e:
    NO_NIXL = str(e)
needs_nixl = pytest.mark.skipif(NO_NIXL is not None, reason=f"NIXL is not installed ({install_hint()})")

CASES = [(lay, False) for lay in layouts.LAYOUTS] + [(lay, True) for lay in layouts.MLA_LAYOUTS]


def keys_for(n: int, salt: str = "") -> list[str]:
    return page_keys(list(range(3, 3 + n * PAGE)), PAGE, namespace=Namespace("nixl" + salt, "bfloat16", 3, 2, 8,
                                                                             PAGE, "x"))  # fmt: skip


def page_index(host, slots: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The buffer dimension that indexes ``slots``' pages and the indices along it, by the layout's shape
    (independent of ``page_ranges``)."""
    dim = (0 if host.mla else 1) + (host.layout == "layer_first")
    if host.layout in ("page_first_direct", "page_head"):
        return dim, slots[::PAGE] // PAGE
    return dim, slots


def poison(host, slots: torch.Tensor) -> None:
    dim, idx = page_index(host, slots)
    host.buffer.view(torch.uint8).index_fill_(dim, idx, 0xA5)


def with_pages_copied(host, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The pool's bytes with the pages of ``dst`` replaced by those of ``src``."""
    raw = host.buffer.view(torch.uint8)
    dim, s = page_index(host, src)
    _, d = page_index(host, dst)
    return raw.index_copy(dim, d, raw.index_select(dim, s))


def obj(path, key):
    return path / key[:2] / f"{key}.kv"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- round trips ------------------------------------------------------------------------------------------
@needs_nixl
@pytest.mark.parametrize("layout,mla", CASES)
def test_round_trip_every_layout(tmp_path, layout, mla):
    host = host_pool(layout, mla, seed=21)
    src, dst = host.alloc(3 * PAGE), host.alloc(3 * PAGE)
    keys = keys_for(3)
    want = page_bytes(host, src)
    with NixlBackend(tmp_path).attach(host) as be:
        assert be.batch_set_from(keys, src) == [True] * 3
        assert be.stats()["transfers"] == 1  # the whole batch in one NIXL transfer
        assert be.batch_exists(keys) == 3
        poison(host, dst)
        expected = with_pages_copied(host, src, dst)
        assert not torch.equal(host.buffer.view(torch.uint8), expected)
        assert be.batch_get_into(keys, dst) == [True] * 3
        assert torch.equal(host.buffer.view(torch.uint8), expected)  # the pages, and nothing else
        st = be.stats()
        assert st["transfers"] == 2 and st["transfer_errors"] == 0
        assert (st["hits"], st["sets"], st["bytes_read"]) == (3, 3, 3 * host.page_bytes)
        assert st["plugin"] == "POSIX" and st["nixl"] in NIXL_MODULES
    assert page_bytes(host, dst) == want
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(f"{k}.kv" for k in keys)
    # The file backend reads the same objects (one format), and writes objects NIXL reads.
    other = host_pool(layout, mla, seed=22)
    a, b = other.alloc(3 * PAGE), other.alloc(3 * PAGE)
    with FileBackend(tmp_path).attach(other) as fb:
        assert fb.batch_get_into(keys, a) == [True] * 3
        assert page_bytes(other, a) == want
        assert fb.batch_set_from(keys_for(3, "f"), b) == [True] * 3
    poison(other, a)
    with NixlBackend(tmp_path).attach(other) as be:
        assert be.batch_get_into(keys_for(3, "f"), a) == [True] * 3
    assert page_bytes(other, a) == page_bytes(other, b)


@needs_nixl
def test_batch_exists_repeats_capacity_and_byte_api(tmp_path):
    host = host_pool("layer_first", seed=23)
    src, dst = host.alloc(4 * PAGE), host.alloc(2 * PAGE)
    keys = keys_for(4)
    size = HEADER_BYTES + host.page_bytes
    with NixlBackend(tmp_path, capacity_bytes=3 * size).attach(host) as be:
        assert be.batch_exists(keys) == 0 and be.batch_exists([]) == 0
        assert be.batch_set_from([], src[:0]) == [] and be.batch_get_into([], dst[:0]) == []
        # A key twice in one batch: stored, both True; a stored key is not written again.
        twice = torch.cat([src[:PAGE], src[:PAGE]])
        assert be.batch_set_from([keys[0], keys[0]], twice) == [True, True]
        assert be.batch_set_from(keys[:2], src[: 2 * PAGE]) == [True, True]
        assert be.stats()["skipped"] == 1 and be.batch_exists(keys) == 2
        # Capacity: keys 0..2 fill it; key 3 evicts the least recently used (0).
        assert be.batch_set_from(keys[2:], src[2 * PAGE :]) == [True, True]
        assert [obj(tmp_path, k).exists() for k in keys] == [False, True, True, True]
        assert be.stats()["evictions"] == 1 and be.stats()["used_bytes"] == 3 * size
        assert be.batch_get_into(keys[:2], dst) == [False, True]
        assert page_bytes(host, dst[PAGE:]) == page_bytes(host, src[PAGE : 2 * PAGE])
        # The byte-level methods read and write the same objects.
        assert be.get(keys[1]) == page_bytes(host, src[PAGE : 2 * PAGE])[0]
        assert be.set(keys[0], be.get(keys[1])) and be.exists(keys[0])


# -- two processes ----------------------------------------------------------------------------------------
def _reader(path: str, out: str) -> None:
    host = host_pool("page_first_direct", mla=True, seed=24)
    dst = host.alloc(3 * PAGE)
    poison(host, dst)
    with NixlBackend(path).attach(host) as be:
        ok = be.batch_get_into(keys_for(3), dst)
    torch.save({"ok": ok, "pages": page_bytes(host, dst)}, out)


@needs_nixl
def test_a_second_process_reads_what_the_first_wrote(tmp_path):
    host = host_pool("page_first_direct", mla=True, seed=25)
    src = host.alloc(3 * PAGE)
    with NixlBackend(tmp_path / "store").attach(host) as be:
        assert be.batch_set_from(keys_for(3), src) == [True] * 3
    p = mp.get_context("spawn").Process(target=_reader, args=(str(tmp_path / "store"), str(tmp_path / "r.pt")))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == 0
    result = torch.load(tmp_path / "r.pt")
    assert result["ok"] == [True] * 3 and result["pages"] == page_bytes(host, src)
    assert not list((tmp_path / "store").rglob("*.tmp"))


# -- faults -----------------------------------------------------------------------------------------------
@needs_nixl
@pytest.mark.parametrize("fault", ["payload_byte", "header_byte", "truncated", "extended", "empty", "foreign"])
def test_damaged_objects_are_misses(tmp_path, fault):
    host = host_pool("page_first", seed=26)
    src, dst = host.alloc(3 * PAGE), host.alloc(3 * PAGE)
    keys = keys_for(3)
    with NixlBackend(tmp_path).attach(host) as be:
        assert be.batch_set_from(keys, src) == [True] * 3
        path = obj(tmp_path, keys[1])
        data = bytearray(path.read_bytes())
        if fault == "payload_byte":
            data[HEADER_BYTES + 301] ^= 0x04
        elif fault == "header_byte":
            data[40] ^= 0x01
        elif fault == "truncated":
            data = data[:-1]
        elif fault == "extended":
            data += b"\0"
        elif fault == "empty":
            data = bytearray()
        path.write_bytes(bytes(data))
        if fault == "foreign":
            other = NixlBackend(tmp_path, namespace=Namespace("other", "bfloat16", 3, 2, 8, PAGE, "x")).attach(host)
        poison(host, dst)
        expected = with_pages_copied(host, src[[*range(PAGE), *range(2 * PAGE, 3 * PAGE)]],
                                     dst[[*range(PAGE), *range(2 * PAGE, 3 * PAGE)]])  # fmt: skip
        reader = other if fault == "foreign" else be
        got = reader.batch_get_into(keys, dst)
        if fault == "foreign":  # every object is of another namespace: all misses, all left alone
            assert got == [False] * 3 and reader.stats()["foreign"] == 3 and path.exists()
            other.close()
            return
        assert got == [True, False, True]
        raw = host.buffer.view(torch.uint8)
        good = [*range(PAGE), *range(2 * PAGE, 3 * PAGE)]
        assert page_bytes(host, dst[good]) == page_bytes(host, src[good])  # the good pages are exact
        if fault != "payload_byte":  # caught before any byte moved: the damaged page was not touched
            assert torch.equal(raw, expected)
        assert not path.exists() and be.stats()["corrupt"] == 1 and be.stats()["misses"] == 1
        assert be.batch_exists(keys) == 1
        assert be.batch_set_from(keys[1:2], src[PAGE : 2 * PAGE]) == [True]  # written anew
        assert be.batch_get_into(keys, dst) == [True] * 3


@needs_nixl
def test_failing_transfers_are_misses_page_by_page(tmp_path, monkeypatch):
    """A transfer NIXL fails (an object truncated after its checks; a file it cannot write) fails no
    other page of the batch: the batch is retried page by page, the bad page is a miss, no exception."""
    host = host_pool("layer_first", seed=27)
    src, dst = host.alloc(3 * PAGE), host.alloc(3 * PAGE)
    keys = keys_for(3)
    be = NixlBackend(tmp_path).attach(host)
    fds = open_fds()
    assert be.batch_set_from(keys, src) == [True] * 3
    opened = NixlBackend._open_object

    def truncate_second(self, i, key, ranges, nbytes):
        o = opened(self, i, key, ranges, nbytes)
        if i == 1:
            os.truncate(o.path, HEADER_BYTES + 10)  # after the size check: NIXL reads short
        return o

    with monkeypatch.context() as m:
        m.setattr(NixlBackend, "_open_object", truncate_second)
        assert be.batch_get_into(keys, dst) == [True, False, True]
    assert page_bytes(host, dst[[*range(PAGE), *range(2 * PAGE, 3 * PAGE)]]) == [page_bytes(host, src)[i]
                                                                                 for i in (0, 2)]  # fmt: skip
    st = be.stats()
    assert st["transfers"] == 1 + 1 + 3 and st["transfer_errors"] == 2  # the batch, then each page
    created = NixlBackend._create_object

    def read_only_second(self, i, key, ranges, nbytes):
        o = created(self, i, key, ranges, nbytes)
        if i == 1:
            os.close(o.fd)
            o.fd = os.open(o.tmp, os.O_RDONLY)  # NIXL cannot write through it
        return o

    new = keys_for(3, "w")
    with monkeypatch.context() as m:
        m.setattr(NixlBackend, "_create_object", read_only_second)
        assert be.batch_set_from(new, src) == [True, False, True]
    assert [obj(tmp_path, k).exists() for k in new] == [True, False, True]
    assert not list(tmp_path.rglob("*.tmp")) and be.stats()["set_failures"] == 1
    assert be.batch_get_into(new, dst) == [True, False, True]
    assert open_fds() == fds  # every object's descriptor closed, failed batches too
    be.close()


class _StuckOnce:
    """A NIXL agent whose transfer handles refuse to be released the first ``n`` times (a transfer NIXL
    could not cancel), otherwise the real agent."""

    def __init__(self, agent, n: int) -> None:
        self.agent, self.n = agent, n

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def initialize_xfer(self, *args):
        handle, outer = self.agent.initialize_xfer(*args), self

        class Handle:
            def release(self) -> None:
                if outer.n > 0:
                    outer.n -= 1
                    raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
                handle.release()

            def __getattr__(self, name):
                return getattr(handle, name)

        h = Handle()
        h._handle = handle._handle
        return h

    def transfer(self, h):
        return self.agent.transfer(h)

    def check_xfer_state(self, h):
        return self.agent.check_xfer_state(h)


@needs_nixl
def test_a_transfer_nixl_will_not_release_keeps_its_slots_busy(tmp_path):
    host = host_pool("page_first", seed=28)
    src, dst, other = host.alloc(2 * PAGE), host.alloc(2 * PAGE), host.alloc(PAGE)
    keys = keys_for(2)
    be = NixlBackend(tmp_path).attach(host)
    assert be.batch_set_from(keys, src) == [True, True]
    be._agent = _StuckOnce(be._agent, 3)
    assert be.batch_get_into(keys, dst) == [False, False]  # not released: not known to be done
    assert be.stats()["stuck"] == 1
    assert be.slots_busy(dst) and not be.slots_busy(other)  # the second and third refusals
    assert not be.slots_busy(dst, timeout=None) and be.stats()["stuck"] == 0  # released now
    assert be.batch_get_into(keys, dst) == [True, True]
    be.close()


class _DoneWithoutWriting:
    """A NIXL agent that reports every transfer done without posting it (a plugin that lost a write)."""

    def __init__(self, agent) -> None:
        self.agent = agent

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def transfer(self, handle):
        return "DONE"


@needs_nixl
def test_a_write_reported_done_but_short_is_not_stored(tmp_path):
    host = host_pool("page_first", seed=34)
    src = host.alloc(2 * PAGE)
    keys = keys_for(2)
    with NixlBackend(tmp_path).attach(host) as be:
        be._agent = _DoneWithoutWriting(be._agent)
        assert be.batch_set_from(keys, src) == [False, False]  # the files hold the header alone
        be._agent = be._agent.agent
        assert be.batch_exists(keys) == 0 and be.stats()["used_bytes"] == 0
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


# -- attach: the host pool, a view of it, staging buffers --------------------------------------------------
class StagedView:
    """A view of a host pool as the storage tier may attach it: each object's range lies in a staging
    tensor (``extra_buffers``), not in the pool's buffer."""

    def __init__(self, host, register_stage: bool = True) -> None:
        self.buffer = host.buffer
        self.page_bytes = host.page_bytes
        self.stage = torch.empty(8 * host.page_bytes, dtype=torch.uint8)
        self.extra_buffers = (self.stage,) if register_stage else ()

    def page_ranges(self, slots: torch.Tensor) -> list[list[tuple[int, int]]]:
        base, n = self.stage.data_ptr(), self.page_bytes
        return [[(base + (int(s) // PAGE) * n, n)] for s in slots[::PAGE]]


@needs_nixl
def test_attach_registers_extra_buffers_and_reattach(tmp_path):
    host = host_pool("page_head", seed=29)
    view = StagedView(host)
    torch.manual_seed(0)
    view.stage[: 2 * host.page_bytes] = torch.randint(0, 256, (2 * host.page_bytes,), dtype=torch.uint8)
    want = view.stage[: 2 * host.page_bytes].clone()
    keys = keys_for(2, "staged")
    with NixlBackend(tmp_path).attach(view) as be:
        assert be.batch_set_from(keys, torch.arange(2 * PAGE)) == [True, True]
        view.stage.fill_(0x5A)
        assert be.batch_get_into(keys, torch.arange(4 * PAGE, 6 * PAGE)) == [True, True]
        assert torch.equal(view.stage[4 * host.page_bytes : 6 * host.page_bytes], want)
        # Re-attached to a view whose staging tensor is not among its buffers: NIXL refuses the
        # transfer (its memory is not registered), and that is a miss, not an exception.
        bare = StagedView(host, register_stage=False)
        be.attach(bare)
        assert be.batch_get_into(keys, torch.arange(2 * PAGE)) == [False, False]
        assert be.stats()["transfer_errors"] >= 1
        # ... and back to a pool: its buffer is registered again.
        other = host_pool("page_head", seed=30)
        dst = other.alloc(2 * PAGE)
        be.attach(other)
        assert be.batch_get_into(keys_for(2, "none"), dst) == [False, False]  # absent: no transfer at all
        assert be.batch_set_from(keys_for(2, "pool"), dst) == [True, True]
        with pytest.raises(TypeError, match="extra_buffers"):
            bad = StagedView(host)
            bad.extra_buffers = (bad.stage[::2],)
            be.attach(bad)
        with pytest.raises(TypeError, match="HostKVPool"):
            be.attach(object())


# -- clear errors -----------------------------------------------------------------------------------------
def test_missing_nixl_is_a_clear_import_error(tmp_path, monkeypatch):
    for name in NIXL_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # "import nixl_cu13" now raises ImportError
        monkeypatch.setitem(sys.modules, f"{name}._api", None)
    with pytest.raises(ImportError, match=r"pip install hicache-kernels\[nixl\]"):
        NixlBackend(tmp_path / "s")
    with pytest.raises(ImportError, match="nixl_cu13"):
        create_backend("nixl", {"path": str(tmp_path / "s")})
    assert not (tmp_path / "s").exists()  # refused before anything was made
    status = nixl_status()
    assert status["available"] is False and "hicache-kernels[nixl]" in status["reason"]


@needs_nixl
def test_bad_plugin_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"'NOPE' is not a plugin.*POSIX"):
        NixlBackend(tmp_path, plugin="NOPE")
    with pytest.raises(ValueError, match=r"'UCX' does not move host memory \(DRAM\) to files"):
        NixlBackend(tmp_path, plugin="UCX")
    with pytest.raises(ValueError, match="plugin: expected"):
        NixlBackend(tmp_path, plugin="")
    with pytest.raises(ValueError, match="plugin_params"):
        NixlBackend(tmp_path, plugin_params=["use_uring"])
    try:  # GDS: usable on a GPU machine with cuFile, else a ValueError that names it
        NixlBackend(tmp_path, plugin="GDS").close()
    except ValueError as e:
        assert "'GDS'" in str(e)
    status = nixl_status()
    assert status["available"] and status["file_plugins"]["POSIX"].startswith("loads (")


@needs_nixl
def test_closed_backend(tmp_path):
    host = host_pool(seed=31)
    src = host.alloc(PAGE)
    keys = keys_for(1)
    be = create_backend("nixl", {"path": str(tmp_path), "plugin": "POSIX"})
    assert isinstance(be, NixlBackend)
    with pytest.raises(RuntimeError, match="attach"):
        be.batch_get_into(keys, src)
    be.attach(host)
    assert be.batch_set_from(keys, src) == [True]
    be.close()
    be.close()  # twice is fine
    for call in (lambda: be.batch_get_into(keys, src), lambda: be.batch_set_from(keys, src),
                 lambda: be.attach(host)):  # fmt: skip
        with pytest.raises(RuntimeError, match="closed"):
            call()
    # What is on disk stays readable without NIXL: the file backend's exists / get.
    assert be.exists(keys[0]) and be.batch_exists(keys) == 1 and be.get(keys[0]) == page_bytes(host, src)[0]
    assert not be.slots_busy(src) and be.stats()["sets"] == 1


@needs_nixl
def test_threads_share_one_backend(tmp_path):
    """The storage tier's backup, prefetch and query threads call one backend at once."""
    host = host_pool("page_first", seed=32)
    be = NixlBackend(tmp_path).attach(host)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            src, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE)
            for i in range(10):
                keys = keys_for(2, f"t{t}-{i}")
                assert be.batch_set_from(keys, src) == [True, True]
                assert be.batch_exists(keys) == 2
                assert be.batch_get_into(keys, dst) == [True, True]
                assert page_bytes(host, dst) == page_bytes(host, src)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    be.close()
    assert not errors, errors[0]


# -- the storage benchmark ----------------------------------------------------------------------------------
@needs_nixl
@pytest.mark.parametrize("preset", ["deepseek-v3", "llama3-8b"])
def test_bench_storage_runs_the_nixl_backend(tmp_path, capsys, preset):
    """``hicache.bench.storage --backend nixl``: batch get/set, then prefetches through a real cache and storage
    tier (MLA: zero copy; MHA: head-group objects through the tier's staging buffers, which attach
    registers as ``extra_buffers``); the bench asserts every prefetched token is a storage hit."""
    from hicache.bench.storage import main

    out = tmp_path / "nixl.json"
    args = ["--backend", "nixl", "--config", json.dumps({"path": str(tmp_path / "store")}), "--presets", preset,
            "--page-sizes", "2", "--pages", "3", "--repeats", "2", "--prefetch-hits", "1", "2",
            "--dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["backend"] == "nixl" and [r["pages"] for r in data["results"]] == [3]
    assert data["results"][0]["get_gbps"] > 0 and [p["hit_pages"] for p in data["prefetch"]] == [1, 2]
    if preset == "deepseek-v3":
        # The bench removes a file-like backend's objects between repeats (NixlBackend is a FileBackend):
        # the last repeat's 3 pages stay, and the prefetch writer's 2 (MLA: one object a page); not 2 x 3 + 2.
        assert len(list((tmp_path / "store").rglob("*.kv"))) == 3 + 2
    assert "get/seq" in capsys.readouterr().out
