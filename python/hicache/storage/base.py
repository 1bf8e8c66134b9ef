"""The storage-tier interface: :class:`StorageBackend`.

A backend stores *objects* under 64-hex-character keys. Attached to a host pool, an object is the
bytes of one host-pool page (``page_size`` slots, all layers, K and V or the MLA latent), in the order
of its memory ranges in the host pool (:meth:`hicache.pools.HostKVPool.page_ranges`),
``host_pool.page_bytes`` long, under its page key (:func:`hicache.storage.keys.page_keys`). The storage
tier attaches its :class:`~hicache.storage.objects.StoredObjects` instead, which has the same
``page_ranges`` / ``page_bytes`` / ``buffer`` (plus ``extra_buffers``, staging memory a backend that
registers memory registers too): there an MHA page is one object per head group, each under its own
key. The namespace is in the key (the chain is rooted in it), so a backend needs no namespace to keep
deployments apart.

A user backend implements three methods, :meth:`~StorageBackend.exists`, :meth:`~StorageBackend.get`
and :meth:`~StorageBackend.set`; everything else has a default built on them and may be overridden for
speed: :meth:`~StorageBackend.batch_exists`, and the zero-copy :meth:`~StorageBackend.batch_get_into` /
:meth:`~StorageBackend.batch_set_from`, which read and write the host pool's pages in place (the
defaults copy through ``bytes``). A backend is bound to one host pool by :meth:`~StorageBackend.attach`
before the batch methods are used.

Failures are misses: a batch method returns ``False`` for a page it could not read or write and never
raises for a store fault (a missing, torn or corrupt object, a full store). After a ``False`` from
:meth:`~StorageBackend.batch_get_into` the page's host slots hold garbage: the caller frees them.

A batch method normally returns only when it is done with the host pool's memory. A backend that bounds
its calls in time may instead give up on one and return (``False``) while its store's client is still
reading or writing those host slots in the background; it then reports them through
:meth:`~StorageBackend.slots_busy` until that transfer has ended, and the caller must not free (or
reuse) busy slots: a late read would land in whatever the slots hold by then (another page's KV), a late
write would store whatever they hold under the key. The default (no transfer is ever left behind) says
no slot is busy.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["StorageBackend", "page_views"]


def page_views(ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
    """Writable byte memoryviews over ``(address, nbytes)`` ranges, no copy (``os.preadv`` / ``os.pwritev``
    take them as iovecs). The memory must outlive the views: the host pool's ``buffer`` does."""
    return [memoryview((ctypes.c_char * n).from_address(addr)).cast("B") for addr, n in ranges]


class StorageBackend:
    """Base class of storage backends (the L3 tier below the host pool).

    Subclasses implement :meth:`exists`, :meth:`get` and :meth:`set`, and may override the batch
    methods, :meth:`close` and :meth:`stats`. Keys are 64-character hex strings; a backend may rely on
    that (e.g. as file names).
    """

    def __init__(self) -> None:
        self.host_pool: Any = None
        self._counts = {"hits": 0, "misses": 0, "sets": 0, "set_failures": 0, "bytes_read": 0, "bytes_written": 0}
        self._count_lock = threading.Lock()

    # -- the three methods a user implements -------------------------------------------------------
    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key`` (a later get may still miss: it can be evicted)."""
        raise NotImplementedError

    def get(self, key: str) -> bytes | bytearray | memoryview | None:
        """The object stored under ``key``, or None when there is none (or it is unreadable)."""
        raise NotImplementedError

    def set(self, key: str, value: bytes | memoryview) -> bool:
        """Store ``value`` under ``key``; False when it was not stored (e.g. no room)."""
        raise NotImplementedError

    # -- attachment and defaults -------------------------------------------------------------------
    def attach(self, host_pool: Any) -> StorageBackend:
        """Bind the backend to the host pool whose pages the batch methods read and write; returns self."""
        if not hasattr(host_pool, "page_ranges"):
            raise TypeError(f"attach: expected a HostKVPool, got {type(host_pool).__name__}")
        self.host_pool = host_pool
        return self

    def _pages(self, method: str, keys: Sequence[str], host_slots: torch.Tensor) -> list[list[tuple[int, int]]]:
        if self.host_pool is None:
            raise RuntimeError(f"{method}: no host pool attached; call backend.attach(host_pool) first")
        ranges = self.host_pool.page_ranges(host_slots)
        if len(ranges) != len(keys):
            raise ValueError(f"{method}: {len(keys)} keys for {len(ranges)} pages of host slots")
        return ranges

    def _count(self, **deltas: int) -> None:
        with self._count_lock:
            for name, delta in deltas.items():
                self._counts[name] = self._counts.get(name, 0) + delta

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many LEADING ``keys`` are stored: the length of the prefix a prefetch may read."""
        n = 0
        for key in keys:
            if not self.exists(key):
                break
            n += 1
        return n

    def batch_get_into(self, keys: Sequence[str], host_slots: torch.Tensor) -> list[bool]:
        """Read the object of each key into the matching page of ``host_slots`` (whole pages, in the key
        order); per page, whether it was read. A False page holds garbage."""
        pages = self._pages("batch_get_into", keys, host_slots)
        nbytes = self.host_pool.page_bytes
        out = []
        for key, ranges in zip(keys, pages, strict=True):
            value = self.get(key)
            ok = value is not None and len(memoryview(value).cast("B")) == nbytes
            if ok:
                src = memoryview(value).cast("B")
                pos = 0
                for view in page_views(ranges):
                    view[:] = src[pos : pos + len(view)]
                    pos += len(view)
            self._count(hits=int(ok), misses=int(not ok), bytes_read=nbytes if ok else 0)
            out.append(ok)
        return out

    def batch_set_from(self, keys: Sequence[str], host_slots: torch.Tensor) -> list[bool]:
        """Store the page of ``host_slots`` matching each key; per page, whether it was stored."""
        pages = self._pages("batch_set_from", keys, host_slots)
        out = []
        for key, ranges in zip(keys, pages, strict=True):
            views = page_views(ranges)
            value = views[0] if len(views) == 1 else b"".join(views)
            ok = bool(self.set(key, value))
            self._count(sets=int(ok), set_failures=int(not ok), bytes_written=len(value) if ok else 0)
            out.append(ok)
        return out

    def slots_busy(self, host_slots: torch.Tensor, timeout: float | None = 0.0) -> bool:
        """Whether a transfer this backend gave up on (a batch call that returned while the store went on
        with it) may still read or write any of ``host_slots``, after waiting up to ``timeout`` seconds
        (``0``: not at all; None: until it ends) for such transfers to end. The caller keeps busy slots
        out of use and asks again later. The default: False (every batch call here returns when it is
        done with the host memory); thread-safe, as overrides must be."""
        return False

    def stats(self) -> dict[str, int | float | str]:
        """Counters: ``hits`` / ``misses`` (pages read or not), ``sets`` / ``set_failures``, ``bytes_read`` /
        ``bytes_written``; backends add their own."""
        with self._count_lock:
            return {"backend": type(self).__name__, **self._counts}

    def close(self) -> None:
        """Release the backend's resources (threads, connections); the default has none."""

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
