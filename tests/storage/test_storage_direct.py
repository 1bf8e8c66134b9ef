"""Tests of the file backend's direct I/O (``direct_io``): round trips through ``O_DIRECT`` for every host
layout, objects shared with buffered backends, damaged objects, the per-page fallback for memory that is
not whole blocks, and a directory that refuses ``O_DIRECT``.

They need a directory that takes ``O_DIRECT`` (pytest's ``tmp_path``, else one under /var/tmp); without
one they skip, saying why. The pools here have pages of whole 4096-byte blocks (head_dim 512)."""

from __future__ import annotations

import errno
import os
import shutil
import struct
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from storagedata import PAGE, host_pool, page_bytes

import hicache.storage.fileio as fileio
from hicache.storage import FileBackend, Namespace, create_backend, page_keys
from hicache.storage.file import DIRECT_ALIGN, HEADER_BYTES, probe_direct_io
from hicache_kernels import layouts

from kvdata import POISON, poison_, random_bytes_

CASES = [(lay, False) for lay in layouts.LAYOUTS] + [(lay, True) for lay in layouts.MLA_LAYOUTS]


@pytest.fixture
def direct_dir(tmp_path):
    """A fresh directory that takes O_DIRECT: ``tmp_path``, else one under /var/tmp; else skip."""
    reason = probe_direct_io(tmp_path)
    if reason is None:
        yield tmp_path
        return
    if os.path.isdir("/var/tmp") and probe_direct_io("/var/tmp") is None:
        d = tempfile.mkdtemp(prefix="hicache-direct-", dir="/var/tmp")
        try:
            yield Path(d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return
    pytest.skip(f"no directory here takes O_DIRECT ({tmp_path}: {reason}; nor /var/tmp)")


def aligned_pool(layout: str = "page_first", mla: bool = False, seed: int = 0):
    """A host pool whose pages are whole 4096-byte blocks in every layout (the pool's buffer is
    page-aligned, each range of a page is 4 tokens x 2 heads x 512 x bf16 = 8 KiB, 4 KiB for MLA)."""
    host = host_pool(layout, mla, seed=seed, head_dim=512, num_layers=2)
    assert host.buffer.data_ptr() % DIRECT_ALIGN == 0
    return host


def keys_for(n: int, salt: str = "") -> list[str]:
    return page_keys(list(range(3, 3 + n * PAGE)), PAGE, namespace=Namespace("d" + salt, "bfloat16", 2, 2, 512, PAGE,
                                                                            "x"))  # fmt: skip


def obj(root: Path, key: str) -> Path:
    return root / key[:2] / f"{key}.kv"


def raw(host) -> torch.Tensor:
    return host.buffer.view(-1).view(torch.uint8)


def expected_after_copy(host, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The pool's bytes once the pages of ``dst`` hold those of ``src`` and nothing else changed."""
    want = raw(host).clone()
    base = host.buffer.data_ptr()
    for s_ranges, d_ranges in zip(host.page_ranges(src), host.page_ranges(dst), strict=True):
        for (sa, n), (da, m) in zip(s_ranges, d_ranges, strict=True):
            assert n == m
            want[da - base : da - base + n] = raw(host)[sa - base : sa - base + n]
    return want


def poison_pages(host, slots: torch.Tensor) -> None:
    base = host.buffer.data_ptr()
    for ranges in host.page_ranges(slots):
        for a, n in ranges:
            poison_(raw(host)[a - base : a - base + n])


# -- round trips ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,mla", CASES)
def test_direct_round_trip_every_layout(direct_dir, layout, mla):
    host = aligned_pool(layout, mla, seed=1)
    src, dst = host.alloc(3 * PAGE), host.alloc(3 * PAGE)
    assert all(a % DIRECT_ALIGN == 0 and n % DIRECT_ALIGN == 0 for r in host.page_ranges(src) for a, n in r)
    want_pages = page_bytes(host, src)
    keys = keys_for(3)
    with FileBackend(direct_dir, num_threads=2, direct_io=True).attach(host) as be:
        assert be.batch_set_from(keys, src) == [True] * 3
        poison_pages(host, dst)  # what is not read stays poisoned
        expected = expected_after_copy(host, src, dst)
        assert not torch.equal(raw(host), expected)
        assert be.batch_get_into(keys, dst) == [True] * 3
        assert torch.equal(raw(host), expected)  # the whole pool: exactly the destination pages changed
        assert page_bytes(host, dst) == want_pages
        st = be.stats()
        assert st["direct_io"] == 1 and st["direct_io_refused"] == ""
        assert st["direct_pages"] == 6 and st["direct_fallbacks"] == 0
        assert st["hits"] == 3 and st["bytes_read"] == 3 * host.page_bytes
        assert st["used_bytes"] == 3 * (HEADER_BYTES + host.page_bytes)
    for k in keys:
        assert obj(direct_dir, k).stat().st_size == HEADER_BYTES + host.page_bytes


def test_direct_io_opens_objects_with_o_direct(direct_dir, monkeypatch):
    """The batch methods really open the objects with O_DIRECT (aligned pages) and without (otherwise)."""
    opened: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path, flags, *args, **kw):
        opened.append((str(path), flags))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", spy)
    for direct_io, aligned, want in [(True, True, True), (True, False, False), (False, True, False)]:
        host = aligned_pool(seed=2) if aligned else host_pool(seed=2)
        src, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE)
        store = direct_dir / f"{direct_io}-{aligned}"
        with FileBackend(store, direct_io=direct_io).attach(host) as be:
            opened.clear()
            assert be.batch_set_from(keys_for(2), src) == [True, True]
            assert be.batch_get_into(keys_for(2), dst) == [True, True]
        objects = [flags for path, flags in opened if path.startswith(str(store / "")) and ".kv" in path]
        assert len(objects) == 4  # two writes (the temporary files), two reads
        assert all(bool(flags & os.O_DIRECT) == want for flags in objects), (direct_io, aligned)
        assert page_bytes(host, dst) == page_bytes(host, src)


def test_direct_and_buffered_backends_read_each_other(direct_dir):
    host = aligned_pool("layer_first", seed=3)
    a, b, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE), host.alloc(2 * PAGE)
    keys_a, keys_b = keys_for(2, "a"), keys_for(2, "b")
    with FileBackend(direct_dir, direct_io=True).attach(host) as direct:
        assert direct.batch_set_from(keys_a, a) == [True, True]
    with FileBackend(direct_dir).attach(host) as buffered:
        assert buffered.batch_set_from(keys_b, b) == [True, True]
        poison_pages(host, dst)
        assert buffered.batch_get_into(keys_a, dst) == [True, True]  # written direct, read buffered
        assert page_bytes(host, dst) == page_bytes(host, a)
        assert buffered.get(keys_a[1]) == page_bytes(host, a)[1]
    for k in keys_a + keys_b:  # one format
        assert obj(direct_dir, k).stat().st_size == HEADER_BYTES + host.page_bytes
    with FileBackend(direct_dir, direct_io=True).attach(host) as direct:
        poison_pages(host, dst)
        assert direct.batch_get_into(keys_b, dst) == [True, True]  # written buffered, read direct
        assert page_bytes(host, dst) == page_bytes(host, b)
        assert direct.stats()["direct_pages"] == 2
        # the byte-level API of a direct backend (buffered) reads and writes the same objects
        assert direct.get(keys_a[0]) == page_bytes(host, a)[0]
        key = keys_for(1, "c")[0]
        assert direct.set(key, page_bytes(host, b)[0])
        poison_pages(host, dst[:PAGE])
        assert direct.batch_get_into([key], dst[:PAGE]) == [True]
        assert page_bytes(host, dst[:PAGE]) == page_bytes(host, b[:PAGE])


# -- faults -----------------------------------------------------------------------------------------------
FAULTS = ["payload", "header", "header_padding", "magic", "truncated", "extended", "old_format"]


@pytest.mark.parametrize("fault", FAULTS)
def test_direct_damaged_object_is_a_miss_and_removed(direct_dir, fault):
    host = aligned_pool(seed=4)
    src, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE)
    keys = keys_for(2)
    with FileBackend(direct_dir, direct_io=True).attach(host) as be:
        assert be.batch_set_from(keys, src) == [True, True]
        path = obj(direct_dir, keys[1])
        data = bytearray(path.read_bytes())
        if fault == "payload":
            data[HEADER_BYTES + 5000] ^= 0x40
        elif fault == "header":
            data[50] ^= 0x01  # in the namespace digest: the header's CRC no longer matches
        elif fault == "magic":  # the old magic in this format, CRC recomputed
            data[:8] = b"HICKVPG2"
            data[88:92] = struct.pack("<I", zlib.crc32(bytes(data[:88])))
        elif fault == "header_padding":
            data[HEADER_BYTES - 1] = 1  # outside the header fields, inside the header block
        elif fault == "truncated":
            data = data[:-DIRECT_ALIGN]  # still whole blocks: O_DIRECT could read it
        elif fault == "extended":
            data += bytes(DIRECT_ALIGN)
        else:  # the previous format: a 92-byte header (magic HICKVPG2), then the payload
            head = struct.pack("<8s32s32sQQ", b"HICKVPG2", bytes(data[8:40]), bytes(data[40:72]),
                               host.page_bytes, struct.unpack_from("<Q", data, 80)[0])  # fmt: skip
            data = bytearray(head + struct.pack("<I", zlib.crc32(head)) + data[HEADER_BYTES:])
        path.write_bytes(bytes(data))
        poison_pages(host, dst)
        assert be.batch_get_into(keys, dst) == [True, False]
        assert page_bytes(host, dst)[0] == page_bytes(host, src)[0]
        assert not path.exists() and be.batch_exists(keys) == 1
        st = be.stats()
        assert st["corrupt"] == 1 and st["misses"] == 1 and st["direct_pages"] == 4


def test_direct_foreign_namespace_is_a_miss_left_alone(direct_dir):
    host = aligned_pool(seed=5)
    src, dst = host.alloc(PAGE), host.alloc(PAGE)
    key = keys_for(1)
    ns_a, ns_b = Namespace.for_pool(host, "a"), Namespace.for_pool(host, "b")
    with FileBackend(direct_dir, namespace=ns_a, direct_io=True).attach(host) as a:
        assert a.batch_set_from(key, src) == [True]
    with FileBackend(direct_dir, namespace=ns_b, direct_io=True).attach(host) as b:
        assert b.batch_get_into(key, dst) == [False]
        assert b.stats()["foreign"] == 1 and obj(direct_dir, key[0]).exists()


# -- the fallback for memory that is not whole blocks -------------------------------------------------------
def test_unaligned_geometry_falls_back_and_counts(direct_dir):
    host = host_pool("page_first", seed=6)  # pages of 384-byte ranges: not whole blocks
    src, dst = host.alloc(3 * PAGE), host.alloc(3 * PAGE)
    keys = keys_for(3)
    with FileBackend(direct_dir, direct_io=True).attach(host) as be:
        assert be.batch_set_from(keys, src) == [True] * 3
        poison_pages(host, dst)
        expected = expected_after_copy(host, src, dst)
        assert be.batch_get_into(keys, dst) == [True] * 3
        assert torch.equal(raw(host), expected)
        st = be.stats()
        assert st["direct_io"] == 1 and st["direct_pages"] == 0 and st["direct_fallbacks"] == 6


class StagedView:
    """What the storage tier may attach instead of a host pool: ``page_ranges``, ``page_bytes``, ``buffer``
    and ``extra_buffers``; each object is one run in a staging tensor, at a block boundary for even
    pages and 8 bytes past one for odd pages."""

    def __init__(self, host, pages: int) -> None:
        self.buffer = host.buffer
        self.page_bytes = host.page_bytes
        self.page_size = PAGE
        self.stride = -(-(self.page_bytes + 8) // DIRECT_ALIGN) * DIRECT_ALIGN
        stage = torch.empty(pages * self.stride + DIRECT_ALIGN, dtype=torch.uint8)
        skip = -stage.data_ptr() % DIRECT_ALIGN
        self.extra_buffers = (stage[skip : skip + pages * self.stride],)

    def page_ranges(self, slots: torch.Tensor) -> list[list[tuple[int, int]]]:
        base = self.extra_buffers[0].data_ptr()
        pages = (slots.view(-1, PAGE)[:, 0] // PAGE).tolist()
        return [[(base + p * self.stride + 8 * (p % 2), self.page_bytes)] for p in pages]

    def pages(self, slots: torch.Tensor) -> list[bytes]:
        return [bytes(self.extra_buffers[0][a - self.extra_buffers[0].data_ptr() :][:n].numpy())
                for [(a, n)] in self.page_ranges(slots)]  # fmt: skip


def test_fallback_is_per_page_on_an_attached_view(direct_dir):
    host = aligned_pool(seed=7)
    view = StagedView(host, 8)
    random_bytes_(view.extra_buffers[0], torch.Generator().manual_seed(8))
    src, dst = torch.arange(4 * PAGE), torch.arange(4 * PAGE, 8 * PAGE)
    keys = keys_for(4)
    with FileBackend(direct_dir, direct_io=True).attach(view) as be:
        assert be.batch_set_from(keys, src) == [True] * 4
        view.extra_buffers[0][4 * view.stride :].fill_(POISON)
        assert be.batch_get_into(keys, dst) == [True] * 4
        assert view.pages(dst) == view.pages(src)
        st = be.stats()
        assert st["direct_pages"] == 4 and st["direct_fallbacks"] == 4  # pages 0, 2 / 1, 3 of each batch
    with FileBackend(direct_dir).attach(host) as buffered:  # the same objects, through the host pool's pages
        slots = host.alloc(4 * PAGE)
        assert buffered.batch_get_into(keys, slots) == [True] * 4
        assert page_bytes(host, slots) == view.pages(src)


# -- arguments and refusal --------------------------------------------------------------------------------
def refuse_o_direct(monkeypatch) -> None:
    """Make every open with O_DIRECT fail as on a filesystem without it (EINVAL)."""
    real_open = os.open

    def fake(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", fake)


def test_refused_o_direct_raises_naming_the_directory(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    refuse_o_direct(monkeypatch)
    store = tmp_path / "refusing"
    with pytest.raises(ValueError, match=r"direct_io: the directory .*refusing.* does not take O_DIRECT.*'auto'"):
        FileBackend(store, direct_io=True)
    assert list(store.iterdir()) == []  # the probe file is gone
    host = aligned_pool(seed=9)
    src, dst = host.alloc(PAGE), host.alloc(PAGE)
    with FileBackend(store, direct_io="auto").attach(host) as be:  # the documented fallback
        st = be.stats()
        assert st["direct_io"] == 0 and "Invalid argument" in st["direct_io_refused"]
        assert be.batch_set_from(keys_for(1), src) == [True]
        assert be.batch_get_into(keys_for(1), dst) == [True]
        assert page_bytes(host, dst) == page_bytes(host, src)
        assert be.stats()["direct_pages"] == 0 and be.stats()["direct_fallbacks"] == 0


def test_tmpfs_is_refused_or_works(tmp_path):
    """/dev/shm (tmpfs): refused with the error naming it where the kernel refuses O_DIRECT there (before
    Linux 6.6), a working direct backend where it does not."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    store = Path(tempfile.mkdtemp(prefix="hicache-direct-", dir="/dev/shm"))
    try:
        reason = probe_direct_io(store)
        if reason is not None:
            with pytest.raises(ValueError, match=f"direct_io: the directory '{store}' does not take O_DIRECT"):
                FileBackend(store, direct_io=True)
            return
        host = aligned_pool(seed=10)
        src, dst = host.alloc(PAGE), host.alloc(PAGE)
        with FileBackend(store, direct_io=True).attach(host) as be:
            assert be.batch_set_from(keys_for(1), src) == [True]
            assert be.batch_get_into(keys_for(1), dst) == [True]
            assert be.stats()["direct_pages"] == 2
        assert page_bytes(host, dst) == page_bytes(host, src)
    finally:
        shutil.rmtree(store, ignore_errors=True)


@pytest.mark.parametrize("value,error", [(1, TypeError), (None, TypeError), (0.0, TypeError), ("yes", ValueError),
                                         ("True", ValueError), ("", ValueError)])  # fmt: skip
def test_bad_direct_io_values_name_the_argument(tmp_path, value, error):
    with pytest.raises(error, match="direct_io"):
        FileBackend(tmp_path / "s", direct_io=value)
    assert not (tmp_path / "s").exists()  # checked before anything is created


def test_direct_io_from_a_config(direct_dir):
    be = create_backend("file", {"path": str(direct_dir / "s"), "direct_io": True})
    assert isinstance(be, FileBackend) and be.direct_io and be.stats()["direct_io"] == 1
    be.close()
    be = create_backend("file", '{"path": "%s", "direct_io": "auto"}' % (direct_dir / "t"))
    assert be.direct_io and be.stats()["direct_io_refused"] == ""
    be.close()
    with pytest.raises(ValueError, match="direct_io"):
        create_backend("file", {"path": str(direct_dir / "u"), "direct_io": "on"})


def test_host_pool_buffer_is_page_aligned():
    for layout, mla in CASES:
        host = host_pool(layout, mla)  # pageable (no CUDA here)
        assert host.buffer.data_ptr() % DIRECT_ALIGN == 0, layout
        assert host.buffer.untyped_storage().nbytes() == host.total_bytes


def test_probe_reports_why(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    refuse_o_direct(monkeypatch)
    assert "O_DIRECT" in probe_direct_io(tmp_path)
    monkeypatch.setattr(fileio, "O_DIRECT_FLAG", 0)
    assert probe_direct_io(tmp_path) == "this platform has no O_DIRECT"
    assert list(tmp_path.iterdir()) == []
