"""File I/O of the file-based storage backends (:mod:`.file`, :mod:`.nixl`): whole ``preadv`` /
``pwritev`` transfers (short ones retried), pieces of :data:`CHUNK_BYTES` to checksum while they are in the
CPU cache, and ``O_DIRECT``: its alignment (:data:`DIRECT_ALIGN`, see :mod:`.file`), whether memory
ranges meet it, and a probe of whether a directory takes it."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "CHUNK_BYTES",
    "DIRECT_ALIGN",
    "O_DIRECT_FLAG",
    "check_direct_io",
    "chunks",
    "direct_aligned",
    "preadv_all",
    "probe_direct_io",
    "pwritev_all",
]

CHUNK_BYTES = 256 << 10  # read and checksummed while in the CPU cache
DIRECT_ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and addresses (see hicache.storage.file)
O_DIRECT_FLAG = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


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


def preadv_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill ``bufs`` from ``fd`` at ``offset`` (retrying short reads); returns the bytes read (less at EOF)."""
    total = 0
    while bufs:
        n = os.preadv(fd, bufs[:_IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        bufs = _advance(bufs, n)
    return total


def pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    total = 0
    while bufs:
        n = os.pwritev(fd, bufs[:_IOV_MAX], offset + total)
        if n == 0:
            raise OSError("pwritev wrote nothing")
        total += n
        bufs = _advance(bufs, n)


def chunks(views: Sequence[memoryview]) -> list[memoryview]:
    """``views`` cut into pieces of at most :data:`CHUNK_BYTES`, in order."""
    out = []
    for v in views:
        for i in range(0, len(v), CHUNK_BYTES):
            out.append(v[i : i + CHUNK_BYTES])
    return out


def direct_aligned(ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether every ``(address, nbytes)`` range starts at and spans a multiple of :data:`DIRECT_ALIGN`."""
    return all(addr % DIRECT_ALIGN == 0 and n % DIRECT_ALIGN == 0 for addr, n in ranges)


def probe_direct_io(directory: str | os.PathLike[str]) -> str | None:
    """None when ``directory`` (which must exist) takes ``O_DIRECT`` transfers of :data:`DIRECT_ALIGN`
    bytes, else why not (a short sentence). It writes, reads and removes a probe file there."""
    if not O_DIRECT_FLAG:
        return "this platform has no O_DIRECT"
    probe = Path(directory) / f".direct-io-probe.{os.getpid()}.{threading.get_ident()}.tmp"
    block = mmap.mmap(-1, DIRECT_ALIGN)  # page-aligned memory
    try:
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | O_DIRECT_FLAG, 0o600)
        except OSError as e:
            return f"opening a file with O_DIRECT failed: {e.strerror or e} (errno {e.errno})"
        try:
            if os.pwritev(fd, [block], 0) != DIRECT_ALIGN or os.preadv(fd, [block], 0) != DIRECT_ALIGN:
                return f"a {DIRECT_ALIGN}-byte O_DIRECT transfer was short"
        except OSError as e:
            return f"a {DIRECT_ALIGN}-byte O_DIRECT transfer failed: {e.strerror or e} (errno {e.errno})"
        finally:
            os.close(fd)
        return None
    finally:
        block.close()
        try:
            os.unlink(probe)
        except OSError:
            pass


def check_direct_io(value: object) -> bool | str:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value == "auto":
            return value
        raise ValueError(f"direct_io: expected True, False or 'auto', got {value!r}")
    raise TypeError(f"direct_io: expected a bool or 'auto', got {type(value).__name__} {value!r}")
