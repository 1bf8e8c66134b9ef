"""The storage tier's threads: backups of host pages to a :class:`StorageBackend`, and prefetches of
stored pages into host slots. :class:`~hicache.cache.radix_cache.HiRadixCache` drives it (``storage=``).

Threads never call back into the tree: the backup thread acknowledges through a queue that the
scheduler drains (:meth:`StorageTier.finished_backups`, the count agreed across TP ranks like the
controller's copies); a prefetch is a :class:`Prefetch` whose progress the scheduler reads. A backend
that raises is a failure of that batch (counted, logged once per kind), never an exception in the
scheduler; a backend that hangs holds only its prefetch's host slots, which are released when the call
returns (the request goes ahead without them), or, when the backend gave up on the call but its
transfer goes on, when :meth:`StorageTier.slots_busy` says it has ended.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ..streams import lifetime
from .base import StorageBackend
from .keys import Namespace, page_keys
from .objects import StoredObjects

__all__ = ["PREFETCH_POLICIES", "Prefetch", "PrefetchPolicy", "StorageTier"]

log = logging.getLogger("hicache.storage")

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class PrefetchPolicy:
    """When a prefetch stops, and which prefetches start.

    name : ``best_effort`` (stop when the scheduler asks, keep the pages that landed),
        ``wait_complete`` (only when every page is read or failed), ``timeout`` (when complete, or at
        ``min(timeout_max_s, timeout_base_s + timeout_per_1k_tokens_s * hit_tokens / 1000)``).
    threshold_tokens : a prefetch starts only for at least this many stored tokens (default 256).
    max_host_tokens : cap on host slots held by prefetches in flight (None: no cap beyond the pool).
    batch_pages : pages per backend call (default 128).
    """

    name: str = "best_effort"
    timeout_base_s: float = 1.0
    timeout_per_1k_tokens_s: float = 0.25
    timeout_max_s: float = 10.0
    threshold_tokens: int = 256
    max_host_tokens: int | None = None
    batch_pages: int = 128

    def __post_init__(self) -> None:
        if self.name not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy: expected one of {', '.join(PREFETCH_POLICIES)}, got {self.name!r}")
        for name in ("timeout_base_s", "timeout_per_1k_tokens_s", "timeout_max_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)!r}")
        if self.threshold_tokens < 0:
            raise ValueError(f"threshold_tokens: expected >= 0, got {self.threshold_tokens}")
        if self.max_host_tokens is not None and self.max_host_tokens < 0:
            raise ValueError(f"max_host_tokens: expected None or >= 0, got {self.max_host_tokens}")
        if self.batch_pages < 1:
            raise ValueError(f"batch_pages: expected >= 1, got {self.batch_pages}")

    def worth(self, tokens: int, page_size: int) -> bool:
        """Whether ``tokens`` are enough for a prefetch: at least ``threshold_tokens`` and a page."""
        return tokens >= max(self.threshold_tokens, page_size)

    def deadline(self, start: float, hit_tokens: int) -> float:
        return start + min(self.timeout_max_s, self.timeout_base_s + self.timeout_per_1k_tokens_s * hit_tokens / 1000)


@dataclass
class Prefetch:
    """One prefetch: first a *query* (the query thread keys ``tokens``' pages and asks the backend how
    many leading ones it holds: ``keys``, ``query_hit``, then ``queried`` is set), then, once the ranks
    agreed on the hit and host slots were allocated, a *read*: ``keys`` into ``host_slots`` (whole
    pages, in order) on the I/O thread, batch by batch; ``landed`` counts the leading pages read so far
    (a failed page ends it)."""

    request_id: Any
    node: Any  # the host node the pages continue (locked while in flight)
    tokens: list[int]  # the tokens of the pages, page-aligned
    prev: str  # the digest the keys chain from (the node's last page, or the namespace)
    start: float
    deadline: float
    state: str = "query"  # then "read"
    keys: list[str] = field(default_factory=list)
    query_hit: int = 0
    host_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    landed: int = 0
    read_s: float = 0.0  # the I/O thread's time on it
    queried: threading.Event = field(default_factory=threading.Event)  # the query thread is done with it
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)  # the I/O thread is done with it
    key_tokens: list[int] | None = None  # the token ids the keys hash, when not ``tokens`` (a request namespace's)

    @property
    def complete(self) -> bool:
        return self.finished.is_set()


def _stop_at_exit(queues: tuple[queue.Queue, ...], threads: tuple[threading.Thread, ...], timeout: float) -> str | None:
    """At interpreter exit (:mod:`hicache.streams.lifetime`): queued backups, prefetches and queries are
    dropped unrun, the I/O a thread is inside finishes, and the threads are joined. Reports the backups
    dropped: pages the caller may have expected in storage."""
    pages = 0
    for q in queues:
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
            if item is not None and q is queues[0]:  # (node id, keys, host slots)
                pages += len(item[1])
            q.task_done()
        q.put(None)
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    lost = [f"{pages} page(s) queued for storage were not written"] if pages else []
    lost += [
        f"storage thread {t.name} was still inside an I/O call after {timeout:g} s" for t in threads if t.is_alive()
    ]
    return "; ".join(lost) or None


class StorageTier:
    """A backend bound to a host pool, its namespace, and the backup and prefetch threads.

    Pages are keyed by :func:`page_keys`; what is stored under them is :attr:`objects`
    (:class:`~hicache.storage.objects.StoredObjects`: an MHA page is one object per head group of this
    rank, each under its own key; the backend is attached to it, not to the host pool).

    Parameters
    ----------
    backend : the :class:`StorageBackend` (attached to the host pool's stored objects here).
    host_pool : the cache's :class:`~hicache.pools.HostKVPool`.
    namespace : the :class:`Namespace` the page keys are rooted in; decides whether this rank writes
        (:attr:`Namespace.writer`: MLA pages only from rank 0).
    agree_min : the controller's TP agreement (minimum over ranks, always issued).
    policy : the :class:`PrefetchPolicy`.
    threaded : run backups, hit queries and prefetch reads on the tier's three threads (default). ``False`` runs each
        inline when it is submitted (as the controller's ``threaded=False``): deterministic, for tests.
    sidecars : the sidecar host pools (sharing ``host_pool``'s slots) whose rows each page's object carries
        after the KV (MLA pages, or MHA pages in a zero-copy layout; the namespace must describe them:
        ``Namespace.sidecars``).
    window : the cache's :class:`~hicache.pools.window_pool.WindowKVPool` (its host rows and flags go in
        each head group's object; MHA pages in a zero-copy layout; described in ``Namespace.sidecars``).
    """

    def __init__(
        self,
        backend: StorageBackend,
        host_pool: Any,
        namespace: Namespace,
        agree_min: Callable[[int], int],
        policy: PrefetchPolicy | None = None,
        threaded: bool = True,
        sidecars: Sequence[Any] = (),
        window: Any = None,
    ) -> None:
        if not isinstance(backend, StorageBackend):
            raise TypeError(f"storage: expected a StorageBackend (or a backend name), got {type(backend).__name__}")
        self.host_pool = host_pool
        self.namespace = namespace
        self.root_digest = namespace.digest.hex()
        self.agree_min = agree_min
        self.policy = policy or PrefetchPolicy()
        self.page_size = host_pool.page_size
        self.objects = StoredObjects(host_pool, tp_rank=namespace.tp_rank, tp_size=namespace.tp_size,
                                     head_group=namespace.head_group, max_pages=self.policy.batch_pages,
                                     sidecars=sidecars, window=window)  # fmt: skip
        # A batch is at most a staging area's pages (staged objects).
        self._batch = min(self.policy.batch_pages, self.objects.stage_pages or self.policy.batch_pages)
        self.backend = backend.attach(self.objects)
        self._backups: queue.Queue = queue.Queue()
        self._backup_acks: queue.Queue = queue.Queue()
        self._prefetches: queue.Queue = queue.Queue()
        self._queries: queue.Queue = queue.Queue()
        self._logged: set[str] = set()
        self._closed = False
        self.threaded = threaded
        self._threads = []
        if threaded:
            self._threads = [
                threading.Thread(target=self._serve, args=(q, f"_{name}_one"), name=f"hicache-storage-{name}",
                                 daemon=True)
                for name, q in (("backup", self._backups), ("prefetch", self._prefetches), ("query", self._queries))
            ]  # fmt: skip
        for t in self._threads:
            t.start()
        # Stopped and joined before the interpreter finalizes if still running then: a daemon thread
        # inside a backend's I/O at finalization aborts the process.
        self._exit = lifetime.stop_at_exit(
            partial(_stop_at_exit, (self._backups, self._prefetches, self._queries), tuple(self._threads))
        ) if self._threads else None  # fmt: skip

    def _serve(self, q: queue.Queue, method: str) -> None:
        """A worker thread: ``self.<method>(*item)`` for each item of ``q`` until ``None`` (looked up per
        item, as an inline call would)."""
        while True:
            item = q.get()
            if item is not None:
                getattr(self, method)(*item)
            q.task_done()  # wait_backups joins the backup queue
            if item is None:
                return

    def _submit(self, q: queue.Queue, method: str, *item: Any) -> None:
        """``self.<method>(*item)`` on ``q``'s thread, or inline when the tier is not threaded."""
        if self.threaded:
            q.put(item)
        else:
            getattr(self, method)(*item)

    # ------------------------------------------------------------------ faults
    def _fault(self, kind: str, exc: BaseException) -> None:
        if kind not in self._logged:  # once per kind: a dead store must not flood the log
            self._logged.add(kind)
            log.warning("hicache storage %s failed (counted as misses from now on, logged once): %r", kind, exc)

    # ------------------------------------------------------------------ backups
    def submit_backup(self, node_id: int, keys: list[str], host_slots: torch.Tensor) -> None:
        """Queue the pages ``host_slots`` (SYNCED, held by a locked node) under ``keys``."""
        self._submit(self._backups, "_backup_one", node_id, keys, host_slots)

    def _backup_one(self, node_id: int, keys: list[str], slots: torch.Tensor) -> None:
        ps, batch, objects = self.page_size, self._batch, self.objects
        per = objects.objects_per_page
        written = skipped = 0
        error: BaseException | None = None
        t0 = time.perf_counter()
        if self.namespace.writer:
            try:
                for i in range(0, len(keys), batch):
                    bk, bs = objects.keys(keys[i : i + batch]), slots[i * ps : (i + batch) * ps]
                    # Pages already stored whole (by us or another instance, of any TP size): skipped.
                    present = self.backend.batch_exists(bk) // per
                    skipped += present
                    if present * per < len(bk):
                        todo = bs[present * ps :]
                        if self._area_busy("backup", todo):
                            raise RuntimeError("the backup staging area is still in use by a transfer given up on")
                        ok = self.backend.batch_set_from(bk[present * per :], objects.gather("backup", todo))
                        written += sum(all(ok[j : j + per]) for j in range(0, len(ok), per))
            except Exception as exc:  # noqa: BLE001 - a store fault is a failed backup, not a crash
                self._fault("backup", exc)
                error = exc
        self._backup_acks.put((node_id, written, skipped, len(keys), time.perf_counter() - t0, error))

    def _area_busy(self, area: str, host_slots: torch.Tensor) -> bool:
        """Staged objects: whether a transfer the backend gave up on still holds staging area ``area``
        (the slots of ``host_slots``' pages there); zero copy: False (busy host slots are the cache's
        business, :meth:`slots_busy`)."""
        if self.objects.zero_copy:
            return False
        return self.slots_busy(self.objects.store_slots(area, host_slots))

    def landed_backups(self) -> int:
        """Backups finished on this rank whose acks :meth:`finished_backups` has not taken yet."""
        return self._backup_acks.qsize()

    def finished_backups(
        self, agreed: int | None = None
    ) -> list[tuple[int, int, int, int, float, BaseException | None]]:
        """Backups finished on every rank, in submission order:
        ``(node_id, pages_written, pages_already_stored, pages, seconds, error)``. ``agreed``: how many,
        when the caller agreed :meth:`landed_backups` across the ranks already (in its step's one
        collective); else agreed here (one collective)."""
        n = self.agree_min(self._backup_acks.qsize()) if agreed is None else int(agreed)
        if n > self._backup_acks.qsize():
            raise ValueError(f"agreed: {n} backups, more than the {self._backup_acks.qsize()} landed here")
        return [self._backup_acks.get_nowait() for _ in range(n)]

    def wait_backups(self) -> None:
        """Block until every queued backup ran (its ack still needs :meth:`finished_backups`)."""
        self._backups.join()

    # ------------------------------------------------------------------ prefetches
    def stored_pages(self, keys: list[str]) -> int:
        """Leading pages of ``keys`` (page keys) stored whole, every object of this rank's (0 when the
        backend fails: a miss)."""
        try:
            return int(self.backend.batch_exists(self.objects.keys(keys))) // self.objects.objects_per_page
        except Exception as exc:  # noqa: BLE001
            self._fault("exists", exc)
            return 0

    def slots_busy(self, host_slots: torch.Tensor, timeout: float | None = 0.0) -> bool:
        """The backend's :meth:`~hicache.storage.StorageBackend.slots_busy`: whether host slots must stay
        out of use, because a transfer the backend gave up on (a read that failed, a write that failed)
        may still touch them. A backend that raises keeps them busy (a leak at worst, never a slot reused
        under a transfer)."""
        try:
            return bool(self.backend.slots_busy(host_slots, timeout))
        except Exception as exc:  # noqa: BLE001
            self._fault("slots_busy", exc)
            return True

    def start_query(self, p: Prefetch) -> None:
        """Key ``p.tokens``' pages and count the leading ones stored (on the query thread)."""
        self._submit(self._queries, "_query_one", p)

    def _query_one(self, p: Prefetch) -> None:
        try:
            tokens = p.tokens if p.key_tokens is None else p.key_tokens
            keys = page_keys(tokens, self.page_size, prev_digest=p.prev)
        except ValueError:  # token ids a key cannot hold: nothing of this is stored
            keys = []
        p.keys = keys
        p.query_hit = self.stored_pages(keys) if keys else 0
        p.queried.set()

    def start_prefetch(self, p: Prefetch) -> None:
        """Read ``p.keys`` into ``p.host_slots`` (on the I/O thread)."""
        self._submit(self._prefetches, "_prefetch_one", p)

    def _prefetch_one(self, p: Prefetch) -> None:
        ps, batch, objects = self.page_size, self._batch, self.objects
        per = objects.objects_per_page
        t0 = time.perf_counter()
        try:
            for i in range(0, len(p.keys), batch):
                if p.cancel.is_set():
                    break
                bk = objects.keys(p.keys[i : i + batch])
                host = p.host_slots[i * ps : (i + len(bk) // per) * ps]
                try:
                    if self._area_busy("prefetch", host):
                        raise RuntimeError("the prefetch staging area is still in use by a transfer given up on")
                    ok = self.backend.batch_get_into(bk, objects.store_slots("prefetch", host))
                except Exception as exc:  # noqa: BLE001
                    self._fault("get", exc)
                    ok = [False] * len(bk)
                good = 0  # leading pages read whole: a hole ends the prefix
                while good * per < len(bk) and all(ok[good * per : (good + 1) * per]):
                    good += 1
                objects.scatter("prefetch", host[: good * ps])
                p.landed = i + good
                if good * per < len(bk):
                    break
        finally:
            p.read_s = time.perf_counter() - t0
            p.finished.set()

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 30.0) -> None:
        """Stop the threads after the queued backups (prefetches must have been cancelled by the
        cache). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.threaded:
            self._backups.put(None)
            self._prefetches.put(None)
            self._queries.put(None)
        for t in self._threads:
            t.join(timeout)
        lifetime.forget(self._exit)
        self.backend.close()

    @property
    def closed(self) -> bool:
        return self._closed
