"""Tests of hicache.storage: page keys, the file backend on real files (round trips for every host
layout, faults as misses, capacity), the registry and user backends, and two processes sharing a
directory."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import textwrap
import threading

import pytest
import torch
from storagedata import PAGE, host_pool, page_bytes

from hicache.pools import DeviceKVPool, HostKVPool
from hicache.storage import FileBackend, Namespace, StorageBackend, create_backend, load_config, page_keys, page_views
from hicache.storage.file import HEADER_BYTES
from hicache_kernels import layouts

from kvdata import random_bytes_, same_bytes

CASES = [(lay, False) for lay in layouts.LAYOUTS] + [(lay, True) for lay in layouts.MLA_LAYOUTS]


def keys_for(n: int, salt: str = "") -> list[str]:
    return page_keys(
        list(range(7, 7 + n * PAGE)), PAGE, namespace=Namespace("m" + salt, "bfloat16", 3, 2, 8, PAGE, "x")
    )


# -- host pool page objects -------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,mla", CASES)
def test_page_ranges_cover_the_page_bytes(layout, mla):
    host = host_pool(layout, mla)
    slots = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    ranges = host.page_ranges(slots)
    assert len(ranges) == 2
    from hicache.storage import page_views

    for got, want in zip(ranges, page_bytes(host, slots), strict=True):
        assert sum(n for _, n in got) == host.page_bytes
        assert b"".join(bytes(v) for v in page_views(got)) == want
    expected_ranges = (1 if mla else 2) * (host.num_layers if layout == "layer_first" else 1)
    assert len(ranges[0]) == expected_ranges


# -- keys -------------------------------------------------------------------------------------------------
def test_keys_chain_property():
    ns = Namespace("m", "bfloat16", 3, 2, 8, PAGE, "page_first")
    tokens = list(range(100, 100 + 5 * PAGE + 3))
    keys = page_keys(tokens, PAGE, namespace=ns)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert page_keys(tokens[: 2 * PAGE], PAGE, namespace=ns) == keys[:2]  # a prefix has the same keys
    assert page_keys(tokens[2 * PAGE :], PAGE, prev_digest=keys[1]) == keys[2:]  # continuing a chain
    assert page_keys(tokens[2 * PAGE :], PAGE, prev_digest=bytes.fromhex(keys[1])) == keys[2:]
    changed = list(tokens)
    changed[PAGE + 1] += 1  # a change in page 1 changes key 1 and every later key, not key 0
    k2 = page_keys(changed, PAGE, namespace=ns)
    assert k2[0] == keys[0] and all(a != b for a, b in zip(k2[1:], keys[1:], strict=True))
    assert page_keys([2**32 - 1] * PAGE, PAGE) != page_keys([0] * PAGE, PAGE)
    with pytest.raises(ValueError, match="token ids"):
        page_keys([2**32], 1)
    with pytest.raises(ValueError, match="prev_digest"):
        page_keys([1], 1, prev_digest=b"short")


def test_namespace_and_salt_change_keys():
    base = dict(model_id="m", dtype="bfloat16", num_layers=3, head_num=2, head_dim=8, page_size=PAGE,
                layout="page_first")  # fmt: skip
    tokens = list(range(3 * PAGE))
    ref = page_keys(tokens, PAGE, namespace=Namespace(**base))
    for change in [dict(model_id="m2"), dict(dtype="float16"), dict(num_layers=4), dict(head_num=1),
                   dict(head_dim=16), dict(tp_size=2), dict(head_group=2), dict(salt="tenant-a")]:  # fmt: skip
        other = page_keys(tokens, PAGE, namespace=Namespace(**{**base, **change}))
        assert all(a != b for a, b in zip(ref, other, strict=True)), change
    # An MHA page is stored as head groups, head-major whatever the layout: the model's heads decide the
    # keys, not how TP cuts them (TP=2 ranks of one head each = TP=1 with both) nor the host layout.
    for same in [dict(layout="layer_first"), dict(layout="page_head"), dict(head_num=1, tp_rank=0, tp_size=2),
                 dict(head_num=1, tp_rank=1, tp_size=2, layout="page_head")]:  # fmt: skip
        assert page_keys(tokens, PAGE, namespace=Namespace(**{**base, **same})) == ref, same
    assert page_keys(tokens, PAGE, namespace=Namespace(**base, salt="a")) != page_keys(
        tokens, PAGE, namespace=Namespace(**base, salt="b")
    )
    # MLA pages are rank-independent: every rank computes the same keys, only rank 0 writes.
    mla = dict(base, head_num=1, mla=True)
    r0, r1 = Namespace(**mla, tp_rank=0, tp_size=2), Namespace(**mla, tp_rank=1, tp_size=2)
    assert r0.digest == r1.digest and r0.writer and not r1.writer
    assert Namespace(**base, tp_rank=1, tp_size=2).writer
    host = host_pool("page_first_direct", mla=True)
    assert Namespace.for_pool(host, "m").layout == "page_first_direct"
    assert Namespace(**mla).digest != Namespace(**{**mla, "layout": "layer_first"}).digest  # MLA: layout order
    assert Namespace(**mla).digest == Namespace(**mla, head_group=3).digest  # no heads to group


@pytest.mark.parametrize("head_group", [0, -1, 3, True, 1.0, "1"])
def test_head_group_must_divide_the_rank_heads(head_group):
    base = dict(model_id="m", dtype="bfloat16", num_layers=3, head_num=2, head_dim=8, page_size=PAGE,
                layout="page_first", tp_size=4)  # fmt: skip
    with pytest.raises(ValueError, match="head_group"):
        Namespace(**base, head_group=head_group)


# -- round trips ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,mla", CASES)
def test_file_round_trip_every_layout(tmp_path, layout, mla):
    host = host_pool(layout, mla, seed=1)
    src = host.alloc(3 * PAGE)
    dst = host.alloc(3 * PAGE)
    want = page_bytes(host, src)
    keys = keys_for(3)
    with FileBackend(tmp_path, num_threads=3).attach(host) as be:
        assert be.batch_set_from(keys, src) == [True] * 3
        assert be.batch_exists(keys) == 3
        assert be.batch_get_into(keys, dst) == [True] * 3
        assert page_bytes(host, dst) == want
        st = be.stats()
        assert st["hits"] == 3 and st["sets"] == 3 and st["bytes_read"] == 3 * host.page_bytes
        assert st["num_objects"] == 3 and st["used_bytes"] == 3 * (HEADER_BYTES + host.page_bytes)
    # The same via a second pool of the same geometry (a new process would see exactly this).
    other = host_pool(layout, mla, seed=2)
    dst2 = other.alloc(3 * PAGE)
    with FileBackend(tmp_path).attach(other) as be:
        assert be.batch_get_into(keys, dst2) == [True] * 3
    assert page_bytes(other, dst2) == want


def test_batches_start_no_thread(tmp_path, monkeypatch):
    """Every I/O thread runs from construction: a batch still running at interpreter exit, where Python
    3.12 refuses to start threads, finishes. Here starting a thread fails as it does there."""
    host = host_pool("page_first", seed=4)
    src, dst = host.alloc(4 * PAGE), host.alloc(4 * PAGE)
    want = page_bytes(host, src)
    keys = keys_for(4, salt="exit")
    with FileBackend(tmp_path, num_threads=4).attach(host) as be:

        def refuse(self):  # noqa: ANN001
            raise RuntimeError("can't create new thread at interpreter shutdown")

        monkeypatch.setattr(threading.Thread, "start", refuse)
        assert be.batch_set_from(keys, src) == [True] * 4
        assert be.batch_get_into(keys, dst) == [True] * 4
        monkeypatch.undo()
    assert page_bytes(host, dst) == want


def test_round_trip_compares_whole_tensors(tmp_path):
    """torch.equal over the pool: the get touches exactly the destination pages."""
    host = host_pool("layer_first", seed=3)
    src, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE)
    keys = keys_for(2)
    with FileBackend(tmp_path).attach(host) as be:
        be.batch_set_from(keys, src)
        expected = host.buffer.clone()
        expected[:, :, dst] = expected[:, :, src]
        assert be.batch_get_into(keys, dst) == [True, True]
    assert same_bytes(host.buffer, expected)


# -- faults -----------------------------------------------------------------------------------------------
def obj(tmp_path, key):
    return tmp_path / key[:2] / f"{key}.kv"


@pytest.mark.parametrize("read_path", ["compiled", "python"])
@pytest.mark.parametrize("fault", ["corrupt_payload", "corrupt_header", "truncated", "extended", "empty"])
def test_faulty_object_is_a_miss_and_removed(tmp_path, fault, read_path, monkeypatch):
    from hicache.storage import checksum as ck

    if read_path == "python":  # the chunked Python read (no hicache._core, pages of odd-sized ranges)
        monkeypatch.setattr(ck, "pread_checksum", None)
    elif ck.pread_checksum is None:
        pytest.skip("hicache._core is not built")
    host = host_pool(seed=4)
    src, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE)
    keys = keys_for(2)
    want = page_bytes(host, src)
    with FileBackend(tmp_path).attach(host) as be:
        assert be.batch_set_from(keys, src) == [True, True]
        path = obj(tmp_path, keys[1])
        data = bytearray(path.read_bytes())
        g = torch.Generator().manual_seed(5)
        if fault == "corrupt_payload":
            i = HEADER_BYTES + int(torch.randint(0, len(data) - HEADER_BYTES, (1,), generator=g))
            data[i] ^= 0x40
        elif fault == "corrupt_header":
            data[int(torch.randint(0, HEADER_BYTES, (1,), generator=g))] ^= 0x01
        elif fault == "truncated":
            data = data[: len(data) - 3]
        elif fault == "extended":
            data += b"\0"
        else:
            data = bytearray()
        path.write_bytes(bytes(data))
        assert be.batch_get_into(keys, dst) == [True, False]
        assert page_bytes(host, dst)[0] == want[0]
        assert not path.exists() and be.batch_exists(keys) == 1
        assert be.stats()["corrupt"] == 1 and be.stats()["misses"] == 1
        # the byte-level API sees the same
        assert be.get(keys[0]) == want[0]
        assert be.set(keys[1], want[1]) and be.get(keys[1]) == want[1]
        path.write_bytes(path.read_bytes()[:-1])
        assert be.get(keys[1]) is None and not path.exists()


def test_foreign_namespace_is_a_miss(tmp_path):
    host = host_pool(seed=6)
    src, dst = host.alloc(PAGE), host.alloc(PAGE)
    ns_a = Namespace.for_pool(host, "model-a")
    ns_b = Namespace.for_pool(host, "model-b")
    key_a = page_keys(list(range(PAGE)), PAGE, namespace=ns_a)
    key_b = page_keys(list(range(PAGE)), PAGE, namespace=ns_b)
    assert key_a != key_b
    with FileBackend(tmp_path, namespace=ns_a).attach(host) as a:
        assert a.batch_set_from(key_a, src) == [True]
    with FileBackend(tmp_path, namespace=ns_b).attach(host) as b:
        assert b.batch_exists(key_b) == 0 and b.batch_get_into(key_b, dst) == [False]
        # An object of namespace A under the very key B asks for: the header still tells them apart.
        obj(tmp_path, key_b[0]).parent.mkdir(exist_ok=True)
        header_a = obj(tmp_path, key_a[0]).read_bytes()
        forged = bytearray(header_a)
        forged[8:40] = bytes.fromhex(key_b[0])  # right key, wrong namespace (header CRC recomputed)
        import struct
        import zlib

        forged[88:92] = struct.pack("<I", zlib.crc32(bytes(forged[:88])))
        obj(tmp_path, key_b[0]).write_bytes(bytes(forged))
        assert b.batch_get_into(key_b, dst) == [False]
        assert b.stats()["foreign"] == 1 and obj(tmp_path, key_b[0]).exists()  # left for its owner
        assert b.get(key_b[0]) is None


def test_capacity_zero_stores_nothing(tmp_path):
    host = host_pool(seed=7)
    src = host.alloc(2 * PAGE)
    keys = keys_for(2)
    with FileBackend(tmp_path, capacity_bytes=0).attach(host) as be:
        assert be.batch_set_from(keys, src) == [False, False]
        assert be.set(keys[0], b"x") is False
        assert be.stats()["set_failures"] == 2 and be.stats()["used_bytes"] == 0
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_capacity_evicts_least_recently_used(tmp_path):
    host = host_pool(seed=8)
    obj_bytes = HEADER_BYTES + host.page_bytes
    src, dst = host.alloc(4 * PAGE), host.alloc(PAGE)
    keys = keys_for(4)
    with FileBackend(tmp_path, capacity_bytes=3 * obj_bytes).attach(host) as be:
        for i in range(3):
            assert be.batch_set_from(keys[i : i + 1], src[i * PAGE : (i + 1) * PAGE]) == [True]
        assert be.batch_get_into(keys[0:1], dst) == [True]  # 0 becomes most recent: 1 is now the oldest
        assert be.batch_set_from(keys[3:4], src[3 * PAGE :]) == [True]
        assert [obj(tmp_path, k).exists() for k in keys] == [True, False, True, True]
        assert be.batch_set_from(keys[1:2], src[PAGE : 2 * PAGE]) == [True]  # evicts 2 (now the oldest)
        assert [obj(tmp_path, k).exists() for k in keys] == [True, True, False, True]
        st = be.stats()
        assert st["evictions"] == 2 and st["used_bytes"] == 3 * obj_bytes and st["num_objects"] == 3
        assert be.set(keys[2], b"\0" * (3 * obj_bytes)) is False  # larger than the capacity


def test_batch_exists_counts_leading_keys(tmp_path):
    host = host_pool(seed=9)
    src = host.alloc(4 * PAGE)
    keys = keys_for(4)
    with FileBackend(tmp_path).attach(host) as be:
        assert be.batch_exists(keys) == 0 and be.batch_exists([]) == 0
        be.batch_set_from([keys[0], keys[1], keys[3]], torch.cat([src[: 2 * PAGE], src[3 * PAGE :]]))
        assert be.batch_exists(keys) == 2  # key 3 is present but not leading
        assert be.batch_exists(keys[3:]) == 1


def test_batch_arguments_checked(tmp_path):
    host = host_pool()
    with FileBackend(tmp_path) as be:
        with pytest.raises(RuntimeError, match="attach"):
            be.batch_get_into(keys_for(1), torch.arange(PAGE))
        be.attach(host)
        with pytest.raises(ValueError, match="2 keys for 1 pages"):
            be.batch_set_from(keys_for(2), torch.arange(PAGE))
        with pytest.raises(ValueError, match="page-aligned"):
            be.batch_set_from(keys_for(1), torch.arange(1, PAGE + 1))
        with pytest.raises(ValueError, match="whole pages"):
            host.page_ranges(torch.arange(PAGE - 1))
    with pytest.raises(RuntimeError, match="closed"):
        be.batch_set_from(keys_for(2), torch.arange(2 * PAGE))


# -- registry and user backends ---------------------------------------------------------------------------
USER_MODULE = textwrap.dedent(
    '''
    from hicache.storage import StorageBackend

    class DictBackend(StorageBackend):
        """Only the three required methods."""

        def __init__(self, limit=None):
            super().__init__()
            self.data, self.limit = {}, limit

        def exists(self, key):
            return key in self.data

        def get(self, key):
            return self.data.get(key)

        def set(self, key, value):
            if self.limit is not None and len(self.data) >= self.limit:
                return False
            self.data[key] = bytes(value)
            return True

    class NotABackend:
        pass
    '''
)


@pytest.mark.parametrize("config_kind", ["dict", "json", "toml", "json_str"])
def test_user_backend_from_module_class(tmp_path, monkeypatch, config_kind):
    (tmp_path / "my_store.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {
        "dict": {"limit": 2},
        "json": tmp_path / "c.json",
        "toml": tmp_path / "c.toml",
        "json_str": '{"limit": 2}',
    }[config_kind]
    (tmp_path / "c.json").write_text('{"limit": 2}')
    (tmp_path / "c.toml").write_text("limit = 2\n")
    host = host_pool("layer_first", seed=10)  # several ranges per page: the defaults join and scatter
    src, dst = host.alloc(3 * PAGE), host.alloc(3 * PAGE)
    keys = keys_for(3)
    be = create_backend("my_store:DictBackend", config).attach(host)
    assert be.batch_set_from(keys, src) == [True, True, False]
    assert be.batch_exists(keys) == 2
    assert be.batch_get_into(keys, dst) == [True, True, False]
    assert page_bytes(host, dst)[:2] == page_bytes(host, src)[:2]
    st = be.stats()
    assert (st["hits"], st["misses"], st["sets"], st["set_failures"]) == (2, 1, 2, 1)
    be.close()
    with pytest.raises(TypeError, match="not a StorageBackend"):
        create_backend("my_store:NotABackend")
    sys.modules.pop("my_store", None)


def test_registry_names_and_errors(tmp_path):
    be = create_backend("file", {"path": str(tmp_path / "s")}, capacity_bytes=10)
    assert isinstance(be, FileBackend) and be.capacity_bytes == 10
    be.close()
    # The mooncake backend by name: no master at this address, refused at once, naming mooncake (with
    # the install hint when the client is not installed).
    with pytest.raises(RuntimeError, match="mooncake"):
        create_backend("mooncake", master_server_address="127.0.0.1:1")
    with pytest.raises(ValueError, match="module:Class"):
        create_backend("nosuch")
    with pytest.raises(ValueError, match="config"):
        load_config(str(tmp_path / "c.yaml"))
    assert load_config(None) == {}


def test_minimal_backend_needs_the_three_methods():
    class Empty(StorageBackend):
        pass

    with pytest.raises(NotImplementedError):
        Empty().batch_exists(["0" * 64])


# -- two processes ----------------------------------------------------------------------------------------
def _process_a(path: str, layout: str) -> None:
    host = host_pool(layout, seed=11)
    src = host.alloc(3 * PAGE)
    with FileBackend(path).attach(host) as be:
        assert be.batch_set_from(keys_for(3), src) == [True] * 3


def _process_b(path: str, layout: str, out: str) -> None:
    host = host_pool(layout, seed=12)
    host.alloc(3 * PAGE)
    dst = host.alloc(3 * PAGE)
    with FileBackend(path).attach(host) as be:
        ok = be.batch_get_into(keys_for(3), dst)
    torch.save({"ok": ok, "pages": page_bytes(host, dst)}, out)


def test_two_processes_share_a_directory(tmp_path):
    ctx = mp.get_context("spawn")
    store = str(tmp_path / "store")
    for target, args in [(_process_a, (store, "page_first_direct")),
                         (_process_b, (store, "page_first_direct", str(tmp_path / "b.pt")))]:  # fmt: skip
        p = ctx.Process(target=target, args=args)
        p.start()
        p.join(timeout=120)
        assert p.exitcode == 0
    result = torch.load(tmp_path / "b.pt")
    reference = host_pool("page_first_direct", seed=11)
    assert result["ok"] == [True] * 3
    assert result["pages"] == page_bytes(reference, reference.alloc(3 * PAGE))
    assert not [p for p in (tmp_path / "store").rglob("*.tmp")]
    assert os.listdir(store)


# ---------------------------------------------------------------------------------------------------
# The page checksum
# ---------------------------------------------------------------------------------------------------


def test_checksum_compiled_numpy_and_pieces_agree(monkeypatch):
    import random

    from hicache.storage import checksum as ck

    r = random.Random(5)
    for n in [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096 + 3]:
        data = bytes(r.randrange(256) for _ in range(n))
        whole = ck.checksum(data)
        cuts = sorted(r.randrange(n + 1) for _ in range(3))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        assert ck.checksum(*pieces) == whole, (n, cuts)  # any split into pieces: the same value
        with monkeypatch.context() as m:
            m.setattr(ck, "_compiled", None)  # the numpy twin (pure-Python builds)
            assert ck.checksum(data) == whole and ck.checksum(*pieces) == whole
    if ck._compiled is None:
        pytest.skip("the extension is not built: only the numpy version ran")


def test_checksum_sees_flips_swaps_and_length():
    import random

    from hicache.storage.checksum import checksum

    r = random.Random(6)
    data = bytearray(r.randrange(256) for _ in range(4096))
    base = checksum(data)
    for _ in range(200):
        i, bit = r.randrange(len(data)), 1 << r.randrange(8)
        data[i] ^= bit
        assert checksum(data) != base
        data[i] ^= bit
    swapped = data[8:16] + data[:8] + data[16:]  # two words exchanged
    assert checksum(swapped) != base
    assert checksum(data + b"\0") != base and checksum(data[:-1]) != base  # zero padding is not free


@pytest.mark.parametrize("mla", [True, False])
def test_odd_sized_ranges_round_trip_and_corruption(tmp_path, mla):
    """Page size 1, head_dim 3 in bf16, layer-first: every range of a page is 6 (MLA) or 12 bytes, not
    whole 8-byte words, so the checksum carries bytes from one range to the next (the chunked Python
    read), and the result must be the same as for the same bytes in one piece."""
    dev = DeviceKVPool(num_slots=8, num_layers=3, head_num=1 if mla else 1, head_dim=3, dtype=torch.bfloat16,
                       device="cpu", page_size=1, mla=mla)  # fmt: skip
    host = HostKVPool(dev, layout="layer_first", ratio=4.0)
    random_bytes_(host.buffer, torch.Generator().manual_seed(9))
    assert all(n % 8 for _, n in host.page_ranges(torch.arange(1))[0])
    src, dst = host.alloc(2), host.alloc(2)
    keys = page_keys([5, 6], 1, namespace=Namespace("odd", "bfloat16", 3, 1, 3, 1, "layer_first", mla=mla))
    with FileBackend(tmp_path).attach(host) as be:
        assert be.batch_set_from(keys, src) == [True, True]
        assert be.batch_get_into(keys, dst) == [True, True]
        for s_, d_ in zip(src.tolist(), dst.tolist(), strict=True):
            for (a, n), (b, _) in zip(host.page_ranges(torch.tensor([s_]))[0], host.page_ranges(torch.tensor([d_]))[0],
                                      strict=True):  # fmt: skip
                assert bytes(page_views([(a, n)])[0]) == bytes(page_views([(b, n)])[0])
        path = obj(tmp_path, keys[0])
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 5] ^= 0x10
        path.write_bytes(bytes(data))
        assert be.batch_get_into(keys, dst) == [False, True]
