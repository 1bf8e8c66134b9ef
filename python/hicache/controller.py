"""HiCacheController: moves KV between the device pool and the host pool on an io-backend, off the
scheduler's thread, and reports completions back to the tree.

- Writes (backups) and loads (load-backs) go through two queues, each served by a worker thread with
  its own CUDA stream on a GPU. A finished copy is acknowledged on an ack queue; the tree processes
  acks when it polls (:meth:`HiCacheController.finished_writes` / ``finished_loads``), so all tree
  mutations stay on the scheduler's thread.
- Loads run layer by layer and tick a :class:`LayerDoneCounter`, so a forward pass can start layer
  ``k`` as soon as its KV has arrived while later layers are still loading. Each load batch keeps
  its per-layer events until the copy has landed and is acknowledged (:meth:`LayerDoneCounter.finish`).
- A copy that fails (or is dropped by ``close(drain=False)``) is acknowledged like any other, with
  its error: the tree rolls its nodes back when it processes the ack and raises :class:`CopyError`;
  the controller itself keeps working. A failed or dropped load batch is aborted on the layer counter,
  so its consumers get an error instead of waiting.
- The worker threads hold only their queues and a weak reference to the controller: a controller
  dropped without :meth:`HiCacheController.close` is collected, and its finalizer stops the workers.
- Tensor parallelism: every rank runs the same tree logic; what differs between ranks is timing
  (how many copies have finished). Whenever a decision depends on timing, ranks agree by an
  all-reduce (MIN) over the given process group: always issued, whatever the local value, because a
  collective skipped on one rank hangs the others.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hicache_kernels._names import IO_BACKENDS
from hicache_kernels.backends import get_backend
from hicache_kernels.binding import KVBinding

from .layer_counter import LayerDoneCounter
from .pools import DeviceKVPool, HostKVPool

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass
class CacheMetrics:
    """Counters of a HiCache instance. Times in seconds, sizes in tokens and bytes."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    miss_tokens: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    write_time_s: float = 0.0
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    load_time_s: float = 0.0
    device_evicted_tokens: int = 0
    host_evicted_tokens: int = 0
    writes_refused_host_full: int = 0
    load_backs: int = 0
    load_backs_skipped: int = 0
    writes_failed: int = 0  # backups that raised (their nodes stay device-only)
    loads_failed: int = 0  # load-backs that raised (their nodes go back to host-only)
    copies_dropped: int = 0  # copies dropped unrun by close(drain=False)
    load_back_latency_s: list[float] = field(default_factory=list)
    # The storage tier (HiRadixCache(storage=...)); pages are host pages (page_size tokens).
    storage_pages_written: int = 0
    storage_pages_skipped: int = 0  # already stored (by this or another instance): not written again
    storage_bytes_written: int = 0
    storage_write_time_s: float = 0.0
    storage_backups_failed: int = 0  # backups whose backend call raised (their pages are simply not stored)
    storage_hit_tokens: int = 0  # tokens a prefetch brought into the host pool and the tree
    storage_pages_read: int = 0
    storage_bytes_read: int = 0
    storage_read_time_s: float = 0.0  # the prefetch I/O thread's time on prefetches that finished
    prefetches: int = 0  # started
    prefetches_cut: dict[str, int] = field(default_factory=dict)  # per policy: stopped before every page landed
    prefetches_discarded: int = 0  # landed, but the tree had meanwhile cached those tokens: slots freed
    prefetch_latency_s: list[float] = field(default_factory=list)

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_time_s / 1e9 if self.write_time_s else 0.0

    @property
    def load_gbps(self) -> float:
        return self.bytes_loaded / self.load_time_s / 1e9 if self.load_time_s else 0.0

    @property
    def storage_write_gbps(self) -> float:
        t = self.storage_write_time_s
        return self.storage_bytes_written / t / 1e9 if t else 0.0

    @property
    def storage_read_gbps(self) -> float:
        t = self.storage_read_time_s
        return self.storage_bytes_read / t / 1e9 if t else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        lat = d.pop("load_back_latency_s")
        plat = d.pop("prefetch_latency_s")
        d.update(
            write_gbps=self.write_gbps,
            load_gbps=self.load_gbps,
            load_back_latency_mean_s=sum(lat) / len(lat) if lat else 0.0,
            load_back_latency_max_s=max(lat, default=0.0),
            storage_write_gbps=self.storage_write_gbps,
            storage_read_gbps=self.storage_read_gbps,
            prefetch_latency_mean_s=sum(plat) / len(plat) if plat else 0.0,
            prefetch_latency_max_s=max(plat, default=0.0),
        )
        return d


@dataclass
class _Op:
    kind: str  # "write" or "load"
    device_indices: torch.Tensor
    host_indices: torch.Tensor
    node_ids: list[int]
    ready: Any = None  # CUDA event the copy must wait for (data produced on the scheduler's stream)
    generation: int = 0  # the LayerDoneCounter batch of a load


_STOP = object()


class CopyDropped(RuntimeError):
    """The error a copy is acknowledged with when ``close(drain=False)`` dropped it before it ran."""


class CopyFailedOnPeer(RuntimeError):
    """The error a copy that completed here is acknowledged with when the same copy failed on another
    TP rank: every rank rolls it back, so the ranks' trees stay the same."""


class CopyError(RuntimeError):
    """Copies failed. Raised by the tree's ack processing (``check_writes``, ``check_loads``, ``flush``,
    ``close``) *after* it rolled the nodes of every failed copy back, so the cache is consistent.

    Attributes
    ----------
    failures : ``(kind, node_id, error)`` per failed copy, ``kind`` ``"write"`` or ``"load"``; the
        first error is also the exception's ``__cause__``.
    """

    def __init__(self, failures: list[tuple[str, int, BaseException]]) -> None:
        self.failures = list(failures)
        kind, node_id, error = self.failures[0]
        more = f" (and {len(self.failures) - 1} more failed copies)" if len(self.failures) > 1 else ""
        super().__init__(f"{kind} of node {node_id} failed: {error!r}{more}; its nodes were rolled back")


def _stop_workers(*queues: queue.Queue) -> None:
    """Finalizer and :meth:`HiCacheController.close`: one stop marker per worker queue (never blocks)."""
    for q in queues:
        q.put(_STOP)


def _run_op(controller_ref: weakref.ref, op: _Op) -> bool:
    """Run ``op`` on the controller if it still exists; False when it was collected. The strong
    reference lives only in this frame, so a worker waiting for work keeps nothing alive."""
    controller = controller_ref()
    if controller is None:
        return False
    controller._run(op)
    return True


def _worker_loop(q: queue.Queue, controller_ref: weakref.ref) -> None:
    """A worker thread: serves ``q`` until a stop marker, or until its controller is gone."""
    while True:
        op = q.get()
        try:
            if op is _STOP or not _run_op(controller_ref, op):
                return
        finally:
            q.task_done()


class HiCacheController:
    """Moves KV between ``device_pool`` and ``host_pool`` (see module docstring).

    Parameters
    ----------
    device_pool, host_pool : the pools (:mod:`hicache.pools`).
    io_backend : ``direct``, ``batch``, ``kernel``, ``triton`` or ``auto`` (the transfer ops'
        backends); checked against the pools: the zero-copy backends need a pinned host pool when the
        device pool is on a GPU.
    write_policy : ``write_through``, ``write_through_selective`` or ``write_back`` (used by the tree).
    tp_group : a ``torch.distributed`` process group whose ranks must take identical decisions, or None.
    threaded : run copies on worker threads (default). ``False`` runs each copy inline when queued,
        which makes a run deterministic (tests, debugging); a failed inline copy is acknowledged with
        its error, as on a worker.
    layer_wise : load layer by layer, ticking :attr:`layer_counter` (default); else all layers at once.
    """

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        *,
        io_backend: str = "auto",
        write_policy: str = "write_through",
        tp_group: Any = None,
        threaded: bool = True,
        layer_wise: bool = True,
    ) -> None:
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend: expected one of {', '.join(IO_BACKENDS)}, got {io_backend!r}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy: expected one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        on_gpu = torch.device(device_pool.device).type == "cuda"
        if on_gpu and io_backend in ("kernel", "triton") and not host_pool.buffer.is_pinned():
            raise ValueError(
                f"io_backend: {io_backend!r} reads the host pool directly and needs it pinned; create the "
                "HostKVPool with pin_memory=True or use io_backend='direct'"
            )
        if not on_gpu and io_backend in ("kernel", "batch"):
            raise ValueError(
                f"io_backend: {io_backend!r} needs the device pool on a CUDA GPU (got {device_pool.device}); "
                "use 'direct' (or 'triton' under TRITON_INTERPRET=1) with CPU pools"
            )
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.io_backend = io_backend
        self.backend = get_backend(io_backend)
        # Validate the pools once; every copy then checks only its indices.
        self.binding = KVBinding(device_pool.device_k, device_pool.device_v, host_pool.buffer,
                                 layout=host_pool.layout, page_size=host_pool.page_size)  # fmt: skip
        self.write_policy = write_policy
        self.tp_group = tp_group
        self.threaded = threaded
        self.layer_wise = layer_wise
        self.on_gpu = on_gpu
        self.metrics = CacheMetrics()
        self.layer_counter = LayerDoneCounter(device_pool.num_layers, torch.device(device_pool.device))
        self.ack_write_queue: queue.Queue[list[int]] = queue.Queue()
        self.ack_load_queue: queue.Queue[list[int]] = queue.Queue()
        self._write_queue: queue.Queue[Any] = queue.Queue()
        self._load_queue: queue.Queue[Any] = queue.Queue()
        self._pending_loads: list[_Op] = []
        # Copies submitted whose ack the tree has not taken yet, per kind: node id -> count.
        self._outstanding: dict[str, Counter[int]] = {"write": Counter(), "load": Counter()}
        self._closed = False
        self._write_stream = torch.cuda.Stream(device=device_pool.device) if on_gpu else None
        self._load_stream = torch.cuda.Stream(device=device_pool.device) if on_gpu else None
        self._threads: list[threading.Thread] = []
        self._finalizer: weakref.finalize | None = None
        if threaded:
            # The threads get their queue and a weak reference only; the finalizer holds the queues only.
            me = weakref.ref(self)
            self._finalizer = weakref.finalize(self, _stop_workers, self._write_queue, self._load_queue)
            for name, q in (("hicache-write", self._write_queue), ("hicache-load", self._load_queue)):
                t = threading.Thread(target=_worker_loop, args=(q, me), name=name, daemon=True)
                t.start()
                self._threads.append(t)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (no new copy is accepted)."""
        return self._closed

    def outstanding(self, kind: str) -> Counter[int]:
        """Node ids of the copies of ``kind`` (``"write"`` or ``"load"``) submitted and not yet taken by
        :meth:`finished_writes` / :meth:`finished_loads` (queued, running, or acknowledged), with
        their counts; a copy."""
        if kind not in self._outstanding:
            raise ValueError(f"kind: expected 'write' or 'load', got {kind!r}")
        return Counter(self._outstanding[kind])

    # ------------------------------------------------------------------ agreement across TP ranks
    def agree_min(self, value: int) -> int:
        """The minimum of ``value`` over the TP group (``value`` itself without one). Always issues
        the collective when a group is set, whatever ``value`` is."""
        if self.tp_group is None:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
        return int(t.item())

    # ------------------------------------------------------------------ submitting copies
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HiCacheController is closed")

    def _ready_event(self) -> Any:
        if not self.on_gpu:
            return None
        ev = torch.cuda.Event()
        ev.record()  # the scheduler's current stream produced (or will read) the device KV
        return ev

    def write(self, device_indices: torch.Tensor, node_id: int, count_refusal: bool = True) -> torch.Tensor | None:
        """Back up ``device_indices`` into newly allocated host slots; returns them (state WRITING
        until the ack is processed) or None when the host pool has no room (counted in
        ``metrics.writes_refused_host_full`` unless ``count_refusal`` is False: a caller that will
        make room and retry counts only its final outcome)."""
        out = self.write_many([(device_indices, node_id)], count_refusal)
        return None if out is None else out[0]

    def write_many(
        self, items: list[tuple[torch.Tensor, int]], count_refusal: bool = True
    ) -> list[torch.Tensor] | None:
        """Back up several nodes' ``(device_indices, node_id)`` in ONE copy op (one bound call, one
        index check): host slots for all of them are allocated together, and returned per item in
        order; None (nothing allocated; one refusal counted per item unless ``count_refusal`` is
        False) when the host pool cannot hold them all. Each node is acknowledged separately."""
        self._check_open()
        if not items:
            return []
        sizes = [len(d) for d, _ in items]
        host_indices = self.host_pool.alloc(sum(sizes))
        if host_indices is None:
            self.metrics.writes_refused_host_full += len(items) * int(count_refusal)
            return None
        self.host_pool.mark_writing(host_indices)
        device_indices = items[0][0] if len(items) == 1 else torch.cat([d for d, _ in items])
        op = _Op("write", device_indices, host_indices, [node_id for _, node_id in items], self._ready_event())
        for _, node_id in items:
            self._outstanding["write"][node_id] += 1
        self._submit(self._write_queue, op)
        return list(host_indices.split(sizes)) if len(items) > 1 else [host_indices]

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor, node_id: int) -> None:
        """Queue a load-back of ``host_indices`` into ``device_indices`` (already allocated); it starts
        with the next :meth:`start_loading`."""
        self._check_open()
        self.host_pool.mark_loading(host_indices)
        self._pending_loads.append(_Op("load", device_indices, host_indices, [node_id]))
        self._outstanding["load"][node_id] += 1

    def start_loading(self) -> int:
        """Merge the queued load-backs into one layer-by-layer batch and start it; returns the
        :attr:`layer_counter` generation to wait on (0 when nothing was queued)."""
        self._check_open()
        return self._start_pending()

    def _start_pending(self) -> int:
        if not self._pending_loads:
            return 0
        pending = self._pending_loads
        op = _Op(
            "load",
            torch.cat([p.device_indices for p in pending]),
            torch.cat([p.host_indices for p in pending]),
            [i for p in pending for i in p.node_ids],
            self._ready_event(),
        )
        op.generation = self.layer_counter.start()  # may time out: then the loads stay pending
        self._pending_loads = []
        self._submit(self._load_queue, op)
        return op.generation

    def _submit(self, q: queue.Queue, op: _Op) -> None:
        if self.threaded:
            q.put(op)
        else:
            self._run(op)

    # ------------------------------------------------------------------ workers
    def _run(self, op: _Op) -> None:
        """Execute ``op`` and acknowledge it: with None when it completed, with its error when it raised
        (a failed load batch is aborted on the layer counter first, so its consumers fail fast)."""
        acks = self.ack_write_queue if op.kind == "write" else self.ack_load_queue
        try:
            self._execute(op)
        except BaseException as exc:
            if op.kind == "load" and op.generation in self.layer_counter.in_flight:
                self.layer_counter.abort(op.generation, exc)
            acks.put((op.node_ids, exc))
            if not self.threaded and not isinstance(exc, Exception):
                raise  # KeyboardInterrupt on the caller's thread stays an interrupt
            return
        acks.put((op.node_ids, None))

    def _execute(self, op: _Op) -> None:
        if self.on_gpu:
            with torch.cuda.device(self.device_pool.device):  # worker threads start on device 0
                self._copy(op)
        else:
            self._copy(op)

    def _copy(self, op: _Op) -> None:
        dp = self.device_pool
        stream = self._write_stream if op.kind == "write" else self._load_stream
        start = time.perf_counter()
        if stream is not None and op.ready is not None:
            stream.wait_event(op.ready)
        # The pools were validated once (self.binding); each op checks its indices once (one sync).
        if op.kind == "write":
            self.binding.backup(op.device_indices, op.host_indices, backend=self.backend, stream=stream)
        elif self.layer_wise:
            # Indices checked and moved once per batch; each layer is one prepared launch.
            loads = self.binding.layer_loads(op.device_indices, op.host_indices, backend=self.backend, stream=stream)
            for layer in range(dp.num_layers):
                loads(layer)
                self.layer_counter.layer_done(layer, stream, op.generation)
        else:
            self.binding.load(op.device_indices, op.host_indices, backend=self.backend, stream=stream)
            for layer in range(dp.num_layers):
                self.layer_counter.layer_done(layer, stream, op.generation)
        if stream is not None:
            stream.synchronize()  # the ack promises the data has landed
        if op.kind == "load":
            self.layer_counter.finish(op.generation)  # landed: release its events before the ack
        elapsed = time.perf_counter() - start
        tokens = len(op.device_indices)
        nbytes = tokens * dp.bytes_per_slot
        m = self.metrics
        if op.kind == "write":
            m.tokens_written += tokens
            m.bytes_written += nbytes
            m.write_time_s += elapsed
        else:
            m.tokens_loaded += tokens
            m.bytes_loaded += nbytes
            m.load_time_s += elapsed

    # ------------------------------------------------------------------ completions
    def _finished(self, q: queue.Queue, kind: str) -> list[tuple[int, BaseException | None]]:
        # Works after close too: the owner must still take the acks of drained and dropped copies.
        n = self.agree_min(q.qsize())
        acks = [q.get_nowait() for _ in range(n)]
        if n and self.tp_group is not None:
            # A copy that failed on any rank counts as failed on every rank (MAX of the failure flags):
            # each rolls it back, and the trees stay alike.
            failed = torch.tensor([int(error is not None) for _, error in acks], dtype=torch.int64)
            torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX, group=self.tp_group)
            peer = CopyFailedOnPeer(f"a {kind} failed on another TP rank; rolled back here too")
            flags = failed.tolist()
            acks = [(ids, peer if error is None and f else error) for (ids, error), f in zip(acks, flags, strict=True)]
        out: list[tuple[int, BaseException | None]] = []
        outstanding = self._outstanding[kind]
        for node_ids, error in acks:
            for node_id in node_ids:
                out.append((node_id, error))
                outstanding[node_id] -= 1
                if outstanding[node_id] <= 0:
                    del outstanding[node_id]
        return out

    def finished_writes(self) -> list[tuple[int, BaseException | None]]:
        """Backups finished on every rank (agreed count), in submission order: ``(node_id, None)`` for a
        completed one, ``(node_id, error)`` for one that raised or was dropped (:class:`CopyDropped`).
        Their host slots are still WRITING: the caller marks them synced, or aborts them."""
        return self._finished(self.ack_write_queue, "write")

    def finished_loads(self) -> list[tuple[int, BaseException | None]]:
        """Load-backs finished on every rank, in submission order, as :meth:`finished_writes`."""
        return self._finished(self.ack_load_queue, "load")

    def flush(self) -> None:
        """Start the queued load-backs and wait until every queued copy has run (acks still need
        processing by the tree)."""
        self._check_open()
        self._start_pending()
        self._write_queue.join()
        self._load_queue.join()

    def _drop_queued(self, error: CopyDropped) -> None:
        """Take every copy off the queues unrun and acknowledge it with ``error``; a dropped load batch
        is aborted on the layer counter (its consumers get an error, not a timeout)."""
        for q, acks in ((self._write_queue, self.ack_write_queue), (self._load_queue, self.ack_load_queue)):
            while True:
                try:
                    op = q.get_nowait()
                except queue.Empty:
                    break
                try:
                    if op is _STOP:
                        continue
                    if op.kind == "load":
                        self.layer_counter.abort(op.generation, "controller closed")
                    acks.put((op.node_ids, error))
                finally:
                    q.task_done()

    def close(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Stop accepting copies, stop the workers and join them; always releases the threads, also
        after failed copies.

        Parameters
        ----------
        drain : run every queued copy first (queued load-backs are started). ``False`` drops them
            unrun: each is acknowledged with a :class:`CopyDropped` error (a dropped load batch is
            aborted on :attr:`layer_counter`), so the owner can roll its nodes back. A copy already
            running completes either way.
        timeout : seconds to wait for each worker; ``RuntimeError`` when one is still running a copy
            then (calling ``close`` again waits again).

        Idempotent. Acks stay readable afterwards (:meth:`finished_writes`, :meth:`finished_loads`).
        """
        if not self._closed:
            self._closed = True
            dropped = CopyDropped("HiCacheController closed with drain=False: the copy was dropped unrun")
            try:
                if drain:
                    self._start_pending()  # may time out waiting for a layer-counter slot
                else:
                    self._drop_queued(dropped)
            finally:
                for op in self._pending_loads:  # loads never started (drain=False, or start failed)
                    self.ack_load_queue.put((op.node_ids, dropped))
                self._pending_loads.clear()
                if self._finalizer is not None:
                    self._finalizer()  # the stop markers, queued behind what is still to run
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                raise RuntimeError(f"HiCacheController: worker {t.name} did not stop within {timeout} s")

    def __enter__(self) -> HiCacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
