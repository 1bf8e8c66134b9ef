"""The ``file`` storage backend: one file per page object in a directory (local disk or shared FS).

Object format: a fixed 92-byte header then the page's bytes. The header (little-endian) is the magic
``b"HICKVPG2"``, the page key (32 bytes), the namespace digest (32 bytes, zeros when the backend has
none), the payload length (uint64), the payload's checksum (uint64, :mod:`.checksum`) and the CRC-32
of the header fields before it (uint32). Every read checks all of them: a torn, truncated or corrupt
object (or one in another format) is a miss and is removed (unless another process has replaced it
meanwhile); an object under another namespace is a miss and left alone.

Writes go to a temporary name in the same directory and are renamed into place (atomic on POSIX), so a
reader sees a whole object or none. Reads and writes of a batch run in a thread pool: ``os.preadv`` /
``os.pwritev`` move the bytes straight between the file and the host pool's pages (one iovec per
memory range of the page, no staging copy). A read checks the header first, then reads the payload in
chunks of :data:`CHUNK_BYTES` and checksums each chunk right after it lands, while it is still in the
CPU cache (both release the GIL). A read lands in the page before its checksum is known: on a mismatch
the page holds garbage and the batch reports ``False`` for it, so the caller frees the slots instead
of using them.

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
from .keys import DIGEST_BYTES, Namespace

__all__ = ["FileBackend"]

MAGIC = b"HICKVPG2"
_HEAD = struct.Struct("<8s32s32sQQ")  # magic, key, namespace, payload length, payload checksum
_HEADER = struct.Struct("<8s32s32sQQI")  # ... + crc32 of the fields above
CHUNK_BYTES = 256 << 10  # read and checksummed while in the CPU cache
HEADER_BYTES = _HEADER.size
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024
_SUFFIX = ".kv"


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without their first ``n`` bytes."""
    i = 0
    while i < len(bufs) and n >= len(bufs[i]):
        n -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def _preadv_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill ``bufs`` from ``fd`` at ``offset`` (retrying short reads); returns the bytes read (less at EOF)."""
    total = 0
    while bufs:
        n = os.preadv(fd, bufs[:_IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        bufs = _advance(bufs, n)
    return total


def _pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    total = 0
    while bufs:
        n = os.pwritev(fd, bufs[:_IOV_MAX], offset + total)
        if n == 0:
            raise OSError("pwritev wrote nothing")
        total += n
        bufs = _advance(bufs, n)


def _chunks(views: Sequence[memoryview]) -> list[memoryview]:
    """``views`` cut into pieces of at most :data:`CHUNK_BYTES`, in order."""
    out = []
    for v in views:
        for i in range(0, len(v), CHUNK_BYTES):
            out.append(v[i : i + CHUNK_BYTES])
    return out


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
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity_bytes: int | None = None,
        namespace: Namespace | bytes | None = None,
        num_threads: int = 4,
        fsync: bool = False,
    ) -> None:
        super().__init__()
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or capacity_bytes < 0):
            raise ValueError(f"capacity_bytes: expected None or a non-negative int, got {capacity_bytes!r}")
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads: expected a positive int, got {num_threads!r}")
        ns = namespace.digest if isinstance(namespace, Namespace) else namespace
        if ns is None:
            ns = bytes(DIGEST_BYTES)
        if not isinstance(ns, (bytes, bytearray)) or len(ns) != DIGEST_BYTES:
            raise ValueError(f"namespace: expected a Namespace or a {DIGEST_BYTES}-byte digest")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = None if capacity_bytes is None else int(capacity_bytes)
        self.namespace_digest = bytes(ns)
        self.fsync = bool(fsync)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> object bytes, least recently used first
        self._writing: set[str] = set()  # keys being written by this process: never evicted
        self._used = 0
        self._counts.update(evictions=0, corrupt=0, foreign=0)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="hicache-file")
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
        if len(key) != 2 * DIGEST_BYTES:
            raise ValueError(f"key: expected a {2 * DIGEST_BYTES}-character hex digest, got {key!r}")
        return self.path / key[:2] / (key + _SUFFIX)

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def _touch(self, key: str, size: int, path: Path) -> None:
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
    def _write(self, key: str, views: list[memoryview]) -> bool:
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
            head = _HEAD.pack(MAGIC, bytes.fromhex(key), self.namespace_digest, nbytes, checksum(*views))
            header = head + struct.pack("<I", zlib.crc32(head))
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _pwritev_all(fd, [memoryview(header), *views], 0)
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
        """``("ok", payload checksum)``, ``("foreign", 0)`` (another namespace) or ``("corrupt", 0)``."""
        if len(header) != HEADER_BYTES:
            return "corrupt", 0
        magic, k, ns, length, crc, head_crc = _HEADER.unpack(header)
        if magic != MAGIC or head_crc != zlib.crc32(bytes(header[: _HEAD.size])) or k != bytes.fromhex(key):
            return "corrupt", 0
        if ns != self.namespace_digest:
            return "foreign", 0
        if length != nbytes:
            return "corrupt", 0
        return "ok", crc

    def _drop(self, key: str, path: Path, ino: int) -> None:
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

    def _read_into(self, key: str, views: list[memoryview], nbytes: int) -> bool:
        path = self._file(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._miss(key)
            return False
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            header = bytearray(HEADER_BYTES)
            if st.st_size != HEADER_BYTES + nbytes:
                verdict, crc = "corrupt", 0  # truncated or extended
            else:
                verdict, crc = self._check_header(key, memoryview(header)[: _preadv_all(fd, [memoryview(header)], 0)],
                                                  nbytes)  # fmt: skip
            if verdict == "ok":
                if _checksum.pread_checksum is not None and not any(len(v) % 8 for v in views):
                    # One call for the whole page: read and checksummed chunk by chunk, no GIL.
                    got, total = _checksum.pread_checksum(fd, HEADER_BYTES, views, 0, 0, CHUNK_BYTES)
                    ok = got == nbytes and _checksum.finish(total, nbytes) == crc
                else:
                    ok, offset, sums = True, HEADER_BYTES, PageChecksum()
                    for chunk in _chunks(views):  # checksummed while still in the CPU cache
                        if _preadv_all(fd, [chunk], offset) != len(chunk):
                            ok = False
                            break
                        sums.update(chunk)
                        offset += len(chunk)
                    ok = ok and sums.value() == crc
                verdict = "ok" if ok else "corrupt"
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

    # -- the three user-level methods --------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self._file(key).exists()

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
            if not self._file(key).exists():
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

    def batch_get_into(self, keys: Sequence[str], host_slots: torch.Tensor) -> list[bool]:
        pages = self._pages("batch_get_into", keys, host_slots)
        nbytes = self.host_pool.page_bytes
        out = self._map(self._read_into, [(k, page_views(r), nbytes) for k, r in zip(keys, pages, strict=True)])
        hits = sum(out)
        self._count(hits=hits, misses=len(out) - hits, bytes_read=hits * nbytes)
        return out

    def batch_set_from(self, keys: Sequence[str], host_slots: torch.Tensor) -> list[bool]:
        pages = self._pages("batch_set_from", keys, host_slots)
        out = self._map(self._write, [(k, page_views(r)) for k, r in zip(keys, pages, strict=True)])
        done = sum(out)
        self._count(sets=done, set_failures=len(out) - done, bytes_written=done * self.host_pool.page_bytes)
        return out

    def stats(self) -> dict[str, int | float | str]:
        out = super().stats()
        with self._lock:
            out.update(
                used_bytes=self._used,
                num_objects=len(self._index),
                capacity_bytes=-1 if self.capacity_bytes is None else self.capacity_bytes,
                path=str(self.path),
            )
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
