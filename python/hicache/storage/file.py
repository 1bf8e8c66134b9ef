"""The ``file`` storage backend: one file per page object in a directory (local disk or shared FS).

Object format (version 3): a :data:`HEADER_BYTES` (4096-byte) header block, then the page's bytes; the
file is exactly ``HEADER_BYTES + payload length`` long. The header block holds the header (92 bytes,
little-endian: the magic ``b"HICKVPG3"``, the page key (32 bytes), the namespace digest (32 bytes, zeros
when the backend has none), the payload length (uint64), the payload's checksum (uint64,
:mod:`.checksum`) and the CRC-32 of the header fields before it (uint32)), then zeros. Every read checks
all of them, the zeros included: a torn, truncated or corrupt object (or one in another format) is a
miss and is removed (unless another process has replaced it meanwhile); an object under another
namespace is a miss and left alone. The payload starts on a block boundary so that one format serves
both I/O modes: objects written with ``direct_io`` are read by a backend without it and the other way
round. Objects of the previous format (magic ``b"HICKVPG2"``, a 92-byte header) are misses, removed
and counted as corrupt.

Writes go to a temporary name in the same directory and are renamed into place (atomic on POSIX), so a
reader sees a whole object or none. Reads and writes of a batch run in a thread pool: ``os.preadv`` /
``os.pwritev`` move the bytes straight between the file and the host pool's pages (one iovec per
memory range of the page, no staging copy). A buffered read checks the header first, then reads the
payload in chunks of :data:`CHUNK_BYTES` and checksums each chunk right after it lands, while it is
still in the CPU cache (both release the GIL). A read lands in the page before its checksum is known:
on a mismatch the page holds garbage and the batch reports ``False`` for it, so the caller frees the
slots instead of using them.

Direct I/O (``direct_io=True``, or ``"direct_io": true`` in the config): the batch methods open objects
with ``O_DIRECT``, so pages move between the disk and the host pool by DMA, bypassing the page cache (a
host pool of tens of GiB is not held a second time in the page cache, and a read measures the disk).
``O_DIRECT`` wants file offsets, lengths and memory addresses aligned to the device's logical block
size, which cannot be asked of a file (``BLKSSZGET`` needs the block device; ``statx``'s direct-I/O
alignment needs Linux 6.1 and is not in Python's ``os``); the backend aligns to :data:`DIRECT_ALIGN`
(4096 bytes): the largest logical block size in common use (512- and 4096-byte sectors) and the OS page
size, so it fits both. A page goes direct when each of its memory ranges starts at and spans a multiple
of 4096 bytes: the host pool's buffer is page-aligned (:mod:`hicache.pools.host_memory`) and pages of
realistic geometry are whole blocks (Llama-3-8B bf16, 16 tokens: 1 MiB per K and V; DeepSeek-V3 MLA,
64 tokens: 4,497,408 bytes), but not all (DeepSeek-V3, 16 tokens: 1,124,352 bytes; small test pools).
A page that is not goes through the buffered path instead (a plain descriptor; a fallback read then
drops the object from the page cache with ``POSIX_FADV_DONTNEED``, a fallback write's pages stay until
the kernel writes them back), and :meth:`FileBackend.stats` counts such pages in ``direct_fallbacks``
(next to ``direct_pages``). A direct read is one ``preadv`` of the header block and the payload, then the
header check and the payload's checksum (the bytes came by DMA, not through the CPU cache, so there is
nothing to gain from chunks, and one large request keeps the device busy). The byte-level :meth:`get` /
:meth:`set` stay buffered.

Construction probes the directory: it writes and reads one 4096-byte block of a probe file with
``O_DIRECT``. A filesystem that refuses (tmpfs before Linux 6.6, some FUSE and network filesystems;
tmpfs accepts ``O_DIRECT`` since 6.6, though its files are RAM anyway) makes ``direct_io=True`` raise a
``ValueError`` naming the directory; ``direct_io="auto"`` falls back to buffered I/O there instead, and
``stats()["direct_io"]`` (0 or 1) and ``stats()["direct_io_refused"]`` (why, or empty) say which mode
is in use.

Capacity: with ``capacity_bytes`` (header included) a write evicts least-recently-used objects (an
index ordered by last write or hit) until the new one fits, and a write larger than the capacity is
refused (``False``, nothing written). Several processes sharing a directory: each keeps its own index
(the startup scan, its own writes and hits, objects of others it reads), so capacity holds per process,
and the directory can hold up to about the writers' count times the capacity; an object evicted by
one process is simply a miss for the others (their index drops it when they see it gone); a reader
that opened an object before another process unlinked it still reads it whole (the open descriptor
keeps the inode). Hits also bump the file's mtime, which orders the startup scan of a later process.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import checksum as _checksum
from .base import StorageBackend, page_views
from .checksum import PageChecksum, checksum
from .fileio import (
    CHUNK_BYTES,
    DIRECT_ALIGN,
    O_DIRECT_FLAG,
    check_direct_io,
    chunks,
    direct_aligned,
    preadv_all,
    probe_direct_io,
    pwritev_all,
)
from .keys import DIGEST_BYTES, Namespace

__all__ = ["DIRECT_ALIGN", "FileBackend", "probe_direct_io"]

MAGIC = b"HICKVPG3"
_HEAD = struct.Struct("<8s32s32sQQ")  # magic, key, namespace, payload length, payload checksum
_HEADER = struct.Struct("<8s32s32sQQI")  # ... + crc32 of the fields above
_SUFFIX = ".kv"
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)
HEADER_BYTES = DIRECT_ALIGN  # the header block: the header, then zeros; the payload starts after it
_PAD = bytes(HEADER_BYTES - _HEADER.size)


def _started_pool(num_threads: int) -> ThreadPoolExecutor:
    """A thread pool whose ``num_threads`` threads run from now on. :class:`ThreadPoolExecutor` starts
    a thread when work finds none idle, but a backup still running at interpreter exit (it finishes;
    :mod:`hicache.streams.lifetime`) cannot start one there: Python 3.12 refuses new threads once
    finalization began. Each thread is started by a task that waits until all have started."""
    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="hicache-file")
    started = threading.Barrier(num_threads)
    for f in [pool.submit(started.wait, 60.0) for _ in range(num_threads)]:
        f.result()
    return pool


class FileBackend(StorageBackend):
    """Page objects as files under ``path``.

    Parameters
    ----------
    path : the directory (created when missing); objects are ``path/<key[:2]>/<key>.kv``.
    capacity_bytes : the most bytes (headers included) this process keeps there; None: unlimited.
        ``0`` stores nothing.
    namespace : a :class:`~hicache.storage.keys.Namespace` (or its 32-byte digest) written into every
        header and required on every read; None: zeros, and reads accept only zeros.
    num_threads : threads that read and write the pages of one batch in parallel (default 4).
    fsync : fsync each object before renaming it (durable across a crash; slower). Default False.
    direct_io : ``True``: the batch methods read and write with ``O_DIRECT``, bypassing the page cache
        (module docstring); ``ValueError`` naming the directory when its filesystem refuses ``O_DIRECT``.
        ``"auto"``: ``O_DIRECT`` where the directory takes it, buffered I/O where not (``stats()`` says
        which). ``False`` (default): buffered I/O through the page cache.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity_bytes: int | None = None,
        namespace: Namespace | bytes | None = None,
        num_threads: int = 4,
        fsync: bool = False,
        direct_io: bool | str = False,
    ) -> None:
        super().__init__()
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or capacity_bytes < 0):
            raise ValueError(f"capacity_bytes: expected None or a non-negative int, got {capacity_bytes!r}")
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads: expected a positive int, got {num_threads!r}")
        mode = check_direct_io(direct_io)
        ns = namespace.digest if isinstance(namespace, Namespace) else namespace
        if ns is None:
            ns = bytes(DIGEST_BYTES)
        if not isinstance(ns, (bytes, bytearray)) or len(ns) != DIGEST_BYTES:
            raise ValueError(f"namespace: expected a Namespace or a {DIGEST_BYTES}-byte digest")
        self.path = Path(path)
        self._root = str(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        refused = probe_direct_io(self.path) if mode else None
        if refused and mode is True:
            raise ValueError(
                f"direct_io: the directory {str(self.path)!r} does not take O_DIRECT I/O ({refused}); put the "
                f"store on a filesystem that does (e.g. ext4 or xfs on a local disk), or pass direct_io='auto' "
                f"to fall back to buffered I/O there (stats()['direct_io'] then says 0), or direct_io=False"
            )
        #: Whether the batch methods use ``O_DIRECT``; ``direct_io_refused``: why not, when "auto" fell back.
        self.direct_io = bool(mode) and not refused
        self.direct_io_refused = refused or ""
        self.capacity_bytes = None if capacity_bytes is None else int(capacity_bytes)
        self.namespace_digest = bytes(ns)
        self.fsync = bool(fsync)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> object bytes, least recently used first
        self._writing: set[str] = set()  # keys being written by this process: never evicted
        self._used = 0
        self._counts.update(evictions=0, corrupt=0, foreign=0, direct_pages=0, direct_fallbacks=0)
        self._local = threading.local()  # each thread's aligned header block (direct I/O)
        self._pool = _started_pool(num_threads)
        self.num_threads = num_threads
        self._closed = False
        self._scan()

    # -- index -------------------------------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        for sub in self.path.iterdir():
            if sub.is_dir() and len(sub.name) == 2:
                for f in sub.iterdir():
                    if f.name.endswith(_SUFFIX) and len(f.name) == 64 + len(_SUFFIX):
                        try:
                            st = f.stat()
                        except FileNotFoundError:
                            continue
                        found.append((st.st_mtime_ns, f.name[:64], st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size

    def _file(self, key: str) -> Path:
        return Path(self._fname(key))

    def _fname(self, key: str) -> str:
        """The object's file name as a string (the read path's: no ``pathlib`` per object)."""
        if len(key) != 2 * DIGEST_BYTES:
            raise ValueError(f"key: expected a {2 * DIGEST_BYTES}-character hex digest, got {key!r}")
        return f"{self._root}/{key[:2]}/{key}{_SUFFIX}"

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def _touch(self, key: str, size: int, path: Path | str) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:  # written by another process
                self._index[key] = size
                self._used += size
        try:
            os.utime(path)
        except OSError:
            pass

    def _reserve(self, key: str, size: int) -> bool:
        """Make room for ``size`` bytes (evicting LRU objects) and account them; False when they cannot fit."""
        cap = self.capacity_bytes
        with self._lock:
            if cap is not None:
                if size > cap:
                    return False
                victims = iter(list(self._index))
                while self._used + size > cap:
                    victim = next(victims, None)
                    if victim is None:
                        return False  # the rest is being written right now
                    if victim in self._writing:
                        continue
                    self._forget(victim)
                    self._counts["evictions"] += 1
                    try:
                        os.unlink(self._file(victim))
                    except FileNotFoundError:
                        pass
            self._forget(key)
            self._index[key] = size
            self._used += size
            self._writing.add(key)
            return True

    # -- one object --------------------------------------------------------------------------------
    def _block(self) -> memoryview:
        """This thread's :data:`HEADER_BYTES` of page-aligned memory: the header block of a direct transfer."""
        block = getattr(self._local, "block", None)
        if block is None:
            block = self._local.block = memoryview(mmap.mmap(-1, HEADER_BYTES))
        return block

    def _header(self, key: str, nbytes: int, crc: int) -> bytes:
        """The header block of an object: the header fields, their CRC-32, then zeros."""
        head = _HEAD.pack(MAGIC, bytes.fromhex(key), self.namespace_digest, nbytes, crc)
        return head + struct.pack("<I", zlib.crc32(head)) + _PAD

    def _write(self, key: str, views: list[memoryview], direct: bool = False) -> bool:
        path = self._file(key)
        if path.exists():  # content-addressed: the same key is the same bytes
            self._touch(key, HEADER_BYTES + sum(len(v) for v in views), path)
            return True
        nbytes = sum(len(v) for v in views)
        if not self._reserve(key, HEADER_BYTES + nbytes):
            return False
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        ok = False
        try:
            header = self._header(key, nbytes, checksum(*views))
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            if direct:  # every view is whole aligned blocks; the header goes from aligned memory too
                block = self._block()
                block[:] = header
                first, flags = block, flags | O_DIRECT_FLAG
            else:
                first = memoryview(header)
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
            try:
                pwritev_all(fd, [first, *views], 0)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            ok = True
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        with self._lock:
            self._writing.discard(key)
            if not ok:
                self._forget(key)
        return ok

    def _check_header(self, key: str, header: bytes | memoryview, nbytes: int) -> tuple[str, int]:
        """``("ok", payload checksum)``, ``("foreign", 0)`` (another namespace) or ``("corrupt", 0)`` for a
        header block."""
        if len(header) != HEADER_BYTES:
            return "corrupt", 0
        magic, k, ns, length, crc, head_crc = _HEADER.unpack(header[: _HEADER.size])
        if magic != MAGIC or head_crc != zlib.crc32(header[: _HEAD.size]) or k != bytes.fromhex(key):
            return "corrupt", 0
        if bytes(header[_HEADER.size :]) != _PAD:
            return "corrupt", 0
        if ns != self.namespace_digest:
            return "foreign", 0
        if length != nbytes:
            return "corrupt", 0
        return "ok", crc

    def _drop(self, key: str, path: Path | str, ino: int) -> None:
        """Remove a corrupt object unless another process has already replaced it."""
        with self._lock:
            self._forget(key)
            self._counts["corrupt"] += 1
        try:
            if os.stat(path).st_ino == ino:
                os.unlink(path)
        except OSError:
            pass

    def _miss(self, key: str) -> None:
        with self._lock:
            self._forget(key)

    def _read_into(self, key: str, views: list[memoryview], nbytes: int, direct: bool = False) -> bool:
        path = self._fname(key)
        try:
            fd = os.open(path, os.O_RDONLY | (O_DIRECT_FLAG if direct else 0))
        except FileNotFoundError:
            self._miss(key)
            return False
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if st.st_size != HEADER_BYTES + nbytes:
                verdict, crc = "corrupt", 0  # truncated or extended
            elif direct:
                # One request for the header block and the payload (all whole aligned blocks), then the checks.
                block = self._block()
                if preadv_all(fd, [block, *views], 0) != st.st_size:
                    verdict, crc = "corrupt", 0
                else:
                    verdict, crc = self._check_header(key, block, nbytes)
                    if verdict == "ok" and checksum(*views) != crc:
                        verdict = "corrupt"
            else:
                header = bytearray(HEADER_BYTES)
                verdict, crc = self._check_header(key, memoryview(header)[: preadv_all(fd, [memoryview(header)], 0)],
                                                  nbytes)  # fmt: skip
                if verdict == "ok":
                    verdict = "ok" if self._read_payload(fd, views, nbytes, crc) else "corrupt"
                if self.direct_io and _DONTNEED is not None:  # a fallback page: keep the page cache clean
                    os.posix_fadvise(fd, 0, 0, _DONTNEED)
        except OSError:
            return False
        finally:
            os.close(fd)
        if verdict == "ok":
            self._touch(key, HEADER_BYTES + nbytes, path)
            return True
        if verdict == "foreign":
            self._count(foreign=1)
        else:
            self._drop(key, path, st.st_ino)
        return False

    @staticmethod
    def _read_payload(fd: int, views: list[memoryview], nbytes: int, crc: int) -> bool:
        """Buffered: read the payload into ``views`` chunk by chunk, each checksummed as it lands."""
        if _checksum.pread_checksum is not None and not any(len(v) % 8 for v in views):
            # One call for the whole page: read and checksummed chunk by chunk, no GIL.
            got, total = _checksum.pread_checksum(fd, HEADER_BYTES, views, 0, 0, CHUNK_BYTES)
            return got == nbytes and _checksum.finish(total, nbytes) == crc
        offset, sums = HEADER_BYTES, PageChecksum()
        for chunk in chunks(views):  # checksummed while still in the CPU cache
            if preadv_all(fd, [chunk], offset) != len(chunk):
                return False
            sums.update(chunk)
            offset += len(chunk)
        return sums.value() == crc

    # -- the three user-level methods --------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return os.path.exists(self._fname(key))

    def get(self, key: str) -> bytes | None:
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                ino = os.fstat(f.fileno()).st_ino
                data = f.read()
        except FileNotFoundError:
            self._miss(key)
            return None
        except OSError:
            return None
        view = memoryview(data)
        nbytes = len(data) - HEADER_BYTES
        if nbytes < 0:
            self._drop(key, path, ino)
            return None
        header, payload = view[:HEADER_BYTES], view[HEADER_BYTES:]
        # The stored length decides what "whole" is here (no page geometry); the check compares it.
        verdict, crc = self._check_header(key, header, nbytes)
        if verdict == "ok" and crc != checksum(payload):
            verdict = "corrupt"
        if verdict == "ok":
            self._touch(key, len(data), path)
            return bytes(payload)
        if verdict == "foreign":
            self._count(foreign=1)
        else:
            self._drop(key, path, ino)
        return None

    def set(self, key: str, value: bytes | memoryview) -> bool:
        return self._write(key, [memoryview(value).cast("B")])

    # -- batches -----------------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            if not os.path.exists(self._fname(key)):
                break
            n += 1
        return n

    def _map(self, fn, items: list) -> list[bool]:  # noqa: ANN001
        if self._closed:
            raise RuntimeError("FileBackend is closed")
        if len(items) <= 1:
            return [fn(*it) for it in items]
        # One task per thread over a contiguous share of the pages (not one per page: a future costs
        # tens of microseconds of Python, under the GIL, next to a page read of about as long).
        n = min(self.num_threads, len(items))
        shares = [items[i::n] for i in range(n)]
        done = list(self._pool.map(lambda share: [fn(*it) for it in share], shares))
        out: list[bool] = [False] * len(items)
        for i, share in enumerate(done):
            out[i::n] = share
        return out

    def _direct(self, pages: list[list[tuple[int, int]]]) -> list[bool]:
        """Per page, whether it moves with ``O_DIRECT`` (direct I/O on and its ranges aligned); counts both."""
        if not self.direct_io:
            return [False] * len(pages)
        direct = [direct_aligned(ranges) for ranges in pages]
        n = sum(direct)
        self._count(direct_pages=n, direct_fallbacks=len(direct) - n)
        return direct

    def batch_get_into(self, keys: Sequence[str], host_slots: torch.Tensor) -> list[bool]:
        pages = self._pages("batch_get_into", keys, host_slots)
        nbytes = self.host_pool.page_bytes
        items = [(k, page_views(r), nbytes, d) for k, r, d in zip(keys, pages, self._direct(pages), strict=True)]
        out = self._map(self._read_into, items)
        hits = sum(out)
        self._count(hits=hits, misses=len(out) - hits, bytes_read=hits * nbytes)
        return out

    def batch_set_from(self, keys: Sequence[str], host_slots: torch.Tensor) -> list[bool]:
        pages = self._pages("batch_set_from", keys, host_slots)
        items = [(k, page_views(r), d) for k, r, d in zip(keys, pages, self._direct(pages), strict=True)]
        out = self._map(self._write, items)
        done = sum(out)
        self._count(sets=done, set_failures=len(out) - done, bytes_written=done * self.host_pool.page_bytes)
        return out

    def stats(self) -> dict[str, int | float | str]:
        """The base counters, and ``evictions``, ``corrupt``, ``foreign``; ``used_bytes``, ``num_objects``,
        ``capacity_bytes`` (-1: unlimited), ``path``; ``direct_io`` (1 when the batch methods use
        ``O_DIRECT``), ``direct_io_refused`` (why not, when ``"auto"`` fell back; else empty),
        ``direct_pages`` / ``direct_fallbacks`` (pages of batch calls, read or written, found or not,
        that moved with ``O_DIRECT`` / went buffered because their memory is not whole
        :data:`DIRECT_ALIGN`-byte blocks; both 0 without direct I/O)."""
        out = super().stats()
        with self._lock:
            out.update(
                used_bytes=self._used,
                num_objects=len(self._index),
                capacity_bytes=-1 if self.capacity_bytes is None else self.capacity_bytes,
                path=str(self.path),
                direct_io=int(self.direct_io),
                direct_io_refused=self.direct_io_refused,
            )
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
