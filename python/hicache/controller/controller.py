"""HiCacheController: moves KV between the device pool and the host pool on an io-backend, and reports
completions back to the tree.

- Writes (backups) and loads (load-backs) go through two queues, each served by a worker thread that
  issues the copies on its own stream of the pools' device (:mod:`hicache.streams`: CUDA streams on a
  GPU). Every ordering decision goes through that stream/event abstraction: a copy waits on an event
  of the pools' current stream (the KV it reads was produced there), and a copy is *done* when an
  event recorded after it completes, never when its launch returns. An issued copy is acknowledged
  on an ack queue with that event; the tree takes the acks whose events completed when it polls
  (:meth:`HiCacheController.finished_writes` / ``finished_loads``; that side, TP agreement included,
  is :mod:`hicache.controller.copy_completions`), so all tree mutations stay on the scheduler's thread.
  :class:`~hicache.streams.deferred.DeferredDevice` runs all of this on CPU pools with copies that complete
  later than they are issued.
- Loads run layer by layer (:class:`~hicache.controller.layer_loads.LayerLoads`) and record a layer event each
  on the :class:`LayerDoneCounter`, so a forward pass can start layer ``k`` as soon as its KV has
  arrived while later layers are still loading. Each load batch keeps its per-layer events until it
  has landed.
- A copy that fails (or is dropped by ``close(drain=False)``) is acknowledged like any other, with
  its error, and taken only once what it had issued before failing has landed: the tree rolls its
  nodes back when it processes the ack (freeing slots no copy touches any more) and raises
  :class:`CopyError`; the controller itself keeps working. A failed or dropped load batch is aborted
  on the layer counter at once, so its consumers get an error instead of waiting.
- The worker threads hold only their queues and a weak reference to the controller: a controller
  dropped without :meth:`HiCacheController.close` is collected, and its finalizer stops the workers.
- Tensor parallelism: every rank runs the same tree logic; what differs between ranks is timing
  (how many copies have landed). Whenever a decision depends on timing, ranks agree by an
  all-reduce (MIN) over the given process group (gloo: the values are CPU tensors): always issued,
  whatever the local value, because a collective skipped on one rank hangs the others
  (:meth:`HiCacheController.agree_min`, ``agree_all``, and the agreement on landed copies).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from hicache_kernels.backends import IO_BACKENDS, IOBackend, get_backend
from hicache_kernels.binding import KVBinding

from ..pools import DeviceKVPool, HostKVPool
from ..pools.window_pool import WindowKVPool
from ..streams import lifetime
from ..streams.deferred import DeferredDevice, env_seed
from ..streams.devices import CudaDevice, EagerDevice, KVRegion
from .copy_completions import CopyAck, CopyCompletions, check_tp_group
from .copy_errors import CopyDropped, CopyError, CopyFailedOnPeer  # noqa: F401 - CopyError re-exported here
from .layer_counter import LayerDoneCounter
from .layer_loads import LayerLoads
from .metrics import CacheMetrics

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def check_sidecars(sidecars: Any, device_pool: DeviceKVPool, host_pool: HostKVPool) -> list[tuple[Any, Any]]:
    """``sidecars``: ``(DeviceKVPool, HostKVPool)`` pairs of per-token pools beside the KV (a sparse
    attention indexer's keys and scales: any item shape and dtype) that share the KV pools' slot
    numbering (device slot ``i`` and host slot ``j`` hold the same tokens' sidecar items as the KV pools'
    slots ``i`` and ``j``; the KV pools' allocators are the only ones used). Each must match the KV pools'
    slot counts, page size and device and have at most their layers: a sidecar of fewer layers (a
    recurrent state kept for one layer) loads its layer ``j`` with the KV's layer ``j``, so it is in
    place no later than the KV's. ``ValueError`` / ``TypeError`` naming the one that does not."""
    if not isinstance(sidecars, (list, tuple)):
        raise TypeError(f"sidecars: expected a list of (DeviceKVPool, HostKVPool) pairs, got {type(sidecars).__name__}")
    out = []
    for i, pair in enumerate(sidecars):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], DeviceKVPool)
                and isinstance(pair[1], HostKVPool) and pair[1].device_pool is pair[0]):  # fmt: skip
            raise TypeError(f"sidecars[{i}]: expected a (DeviceKVPool, HostKVPool over it) pair")
        d, h = pair
        for what, got, want in (
            ("device slots", d.size, device_pool.size),
            ("host slots", h.size, host_pool.size),
            ("page_size", d.page_size, device_pool.page_size),
            ("device", torch.device(d.device), torch.device(device_pool.device)),
            ("pinned host memory", h.pinned, host_pool.pinned),
        ):
            if got != want:
                raise ValueError(f"sidecars[{i}]: {what} {got} differ from the KV pools' {want}")
        if d.num_layers > device_pool.num_layers:
            n = device_pool.num_layers
            raise ValueError(f"sidecars[{i}]: num_layers {d.num_layers}, more than the KV pools' {n}")
        out.append((d, h))
    return out


@dataclass
class _Op:
    kind: str  # "write" or "load"
    device_indices: torch.Tensor
    host_indices: torch.Tensor
    node_ids: list[int]
    ready: Any = None  # event the copy must wait for (data produced on the pools' current stream)
    generation: int = 0  # the LayerDoneCounter batch of a load
    window: Any = None  # (window slots, host slots) of the window rows moved with it, chosen when queued


_STOP = object()


def _stop_workers(exit_handle: int, *queues: queue.Queue) -> None:
    """Finalizer and :meth:`HiCacheController.close`: one stop marker per worker queue (never blocks);
    nothing is left to do at interpreter exit."""
    lifetime.forget(exit_handle)
    for q in queues:
        q.put(_STOP)


def _stop_at_exit(queues: tuple[queue.Queue, ...], threads: tuple[threading.Thread, ...], timeout: float) -> str | None:
    """At interpreter exit (:mod:`hicache.streams.lifetime`): the copies still queued are dropped unrun
    (no one will take their acks), the copy a worker is inside finishes, and the workers are joined.
    Copies between the pools hold nothing that outlives the process, so nothing is reported lost."""
    for q in queues:
        while True:
            try:
                q.get_nowait()
            except queue.Empty:
                break
            q.task_done()
        q.put(_STOP)
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    return f"copy workers {', '.join(stuck)} were still inside a copy after {timeout:g} s" if stuck else None


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
            # Not kept while waiting for the next: through its events, an op reaches the device's
            # queued copies, whose work may hold the controller (a backup of KV still being written).
            del op
            q.task_done()


def _choose_device(device: torch.device, device_model: Any) -> Any:
    """The :class:`~hicache.streams.StreamDevice` for pools on ``device`` (see ``device_model``)."""
    if device_model is not None:
        if device.type == "cuda":
            raise ValueError("device_model: the deferred-completion model runs CPU pools only; got CUDA pools")
        if not isinstance(device_model, DeferredDevice):
            raise TypeError(f"device_model: expected a DeferredDevice, got {type(device_model).__name__}")
        return device_model
    if device.type == "cuda":
        return CudaDevice(device)
    seed = env_seed()
    return EagerDevice() if seed is None else DeferredDevice(seed)


class HiCacheController:
    """Moves KV between ``device_pool`` and ``host_pool`` (see module docstring).

    Parameters
    ----------
    device_pool, host_pool : the pools (:mod:`hicache.pools`).
    io_backend : ``direct``, ``batch``, ``kernel``, ``triton`` or ``auto`` (the transfer ops'
        backends), or an :class:`~hicache_kernels.backends.IOBackend` object (e.g. a no-op for host-cost
        benchmarks); checked against the pools: the zero-copy backends need a pinned host pool when the
        device pool is on a GPU.
    write_policy : ``write_through``, ``write_through_selective`` or ``write_back`` (used by the tree).
    tp_group : a gloo ``torch.distributed`` process group whose ranks must take identical decisions,
        or None (an NCCL group is refused: the agreements reduce CPU tensors).
    threaded : issue copies on worker threads. ``False`` issues each copy from the calling (scheduler)
        thread when it is queued: on a GPU that is only launches on the controller's streams, which
        return at once (the acks come from their events), so it is the default there (None); CPU pools
        copy on the CPU, so they default to worker threads. ``False`` on CPU makes a run deterministic
        (tests, debugging); a failed copy is acknowledged with its error, as on a worker.
    layer_wise : load layer by layer, ticking :attr:`layer_counter` (default); else all layers at once.
    device_model : a :class:`~hicache.streams.deferred.DeferredDevice` to run CPU pools under (copies complete
        later than they are issued); None: :class:`~hicache.streams.CudaDevice` for GPU pools,
        :class:`~hicache.streams.EagerDevice` for CPU pools, or a ``DeferredDevice`` when the
        ``HICACHE_DEFERRED_SEED`` environment variable holds a seed. :attr:`device` is the one used.
    """

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        *,
        io_backend: str = "auto",
        write_policy: str = "write_through",
        tp_group: Any = None,
        threaded: bool | None = None,
        layer_wise: bool = True,
        device_model: Any = None,
        sidecars: Any = (),
        window: Any = None,
    ) -> None:
        if window is not None and (not isinstance(window, WindowKVPool) or window.kv_pool is not device_pool):
            raise TypeError("window: expected a WindowKVPool over the device pool (WindowKVPool(device_pool, ...))")
        if not isinstance(io_backend, IOBackend) and io_backend not in IO_BACKENDS:
            raise ValueError(
                f"io_backend: expected one of {', '.join(IO_BACKENDS)} or an IOBackend, got {io_backend!r}"
            )
        backend_name = io_backend.name if isinstance(io_backend, IOBackend) else io_backend
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy: expected one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        on_gpu = torch.device(device_pool.device).type == "cuda"
        if on_gpu and backend_name in ("kernel", "triton") and not host_pool.buffer.is_pinned():
            raise ValueError(
                f"io_backend: {backend_name!r} reads the host pool directly and needs it pinned; create the "
                "HostKVPool with pin_memory=True or use io_backend='direct'"
            )
        if not on_gpu and backend_name in ("kernel", "batch"):
            raise ValueError(
                f"io_backend: {backend_name!r} needs the device pool on a CUDA GPU (got {device_pool.device}); "
                "use 'direct' (or 'triton' under TRITON_INTERPRET=1) with CPU pools"
            )
        check_tp_group(tp_group)
        self.device = _choose_device(torch.device(device_pool.device), device_model)
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.io_backend = backend_name
        self.backend = get_backend(io_backend)
        # Validate the pools once; every copy then checks only its indices.
        self.binding = KVBinding(device_pool.device_k, device_pool.device_v, host_pool.buffer,
                                 layout=host_pool.layout, page_size=host_pool.page_size)  # fmt: skip
        self.sidecars = check_sidecars(sidecars, device_pool, host_pool)
        # Every pool pair a copy moves: (binding, device pool, host pool), the KV's first.
        self.pool_pairs = [(self.binding, device_pool, host_pool)] + [
            (KVBinding(d.device_k, d.device_v, h.buffer, layout=h.layout, page_size=h.page_size), d, h)
            for d, h in self.sidecars
        ]
        # The sliding-window rows: a pool pair of their own, moved with the KV pages that have rows.
        self.window = window
        self.window_pair = None
        if window is not None:
            wh = window.attach_host(host_pool)
            wb = KVBinding(window.pool.device_k, window.pool.device_v, wh.buffer, layout=wh.layout,
                           page_size=wh.page_size)  # fmt: skip
            self.window_pair = (wb, window.pool, wh)
        if on_gpu:  # compiled / loaded now, not by the first copies mid-serving (nothing is copied)
            for b, _, _ in self.pool_pairs + ([self.window_pair] if self.window_pair else []):
                b.warm(self.backend)
        self.write_policy = write_policy
        self.tp_group = tp_group
        self.threaded = (not on_gpu) if threaded is None else bool(threaded)
        # CPU-bound side work (the storage tier's I/O) stays on threads unless threaded=False was asked for.
        self.side_threads = threaded is not False
        self.layer_wise = layer_wise
        self.on_gpu = on_gpu
        self.metrics = CacheMetrics(host_pinned_bytes=int(getattr(host_pool, "pinned_bytes", 0)))
        events = self.device if self.device.has_events else None
        self.layer_counter = LayerDoneCounter(device_pool.num_layers, events=events)
        # The acks of issued copies and their agreement over the TP ranks.
        self.completions = CopyCompletions(tp_group, self.layer_counter, self.device, device_pool.bytes_per_slot,
                                           self.metrics)  # fmt: skip
        self.ack_write_queue = self.completions.write_acks  # the issuing side appends here
        self.ack_load_queue = self.completions.load_acks
        self._write_queue: queue.Queue[Any] = queue.Queue()
        self._load_queue: queue.Queue[Any] = queue.Queue()
        self._pending_loads: list[_Op] = []
        # Copies submitted whose ack the tree has not taken yet, per kind: node id -> count.
        self._outstanding = self.completions.outstanding
        self._closed = False
        self._write_stream = self.device.new_stream("write")
        self._load_stream = self.device.new_stream("load", high_priority=True)  # a forward waits for its layers
        self._threads: list[threading.Thread] = []
        self._finalizer: weakref.finalize | None = None
        if self.threaded:
            # The threads get their queue and a weak reference only; the finalizer holds the queues only.
            me = weakref.ref(self)
            for name, q in (("hicache-write", self._write_queue), ("hicache-load", self._load_queue)):
                t = threading.Thread(target=_worker_loop, args=(q, me), name=name, daemon=True)
                t.start()
                self._threads.append(t)
            # Stopped and joined before the interpreter finalizes, if still running then (a daemon thread
            # inside a copy at finalization aborts the process).
            queues = (self._write_queue, self._load_queue)
            handle = lifetime.stop_at_exit(partial(_stop_at_exit, queues, tuple(self._threads)))
            self._finalizer = weakref.finalize(self, _stop_workers, handle, *queues)

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

    # ------------------------------------------------------------------ acks and agreements (CopyCompletions)
    def agree_min(self, value: int) -> int:
        """The minimum of ``value`` over the TP group (``value`` itself without one); always issues the
        collective when a group is set, whatever ``value`` is."""
        return self.completions.agree_min(value)

    def agree_all(self, values: list[int]) -> list[int]:
        """The minimum over the TP group of each of ``values`` (every rank passes as many), in ONE
        collective; ``values`` themselves without a group."""
        return self.completions.agree_all(values)

    def finished(self, kinds: tuple[str, ...] = ("write", "load"), counts: dict[str, int] | None = None) -> dict:
        """The copies of ``kinds`` that landed on every rank, agreed in ONE collective
        (:meth:`CopyCompletions.finished <hicache.controller.copy_completions.CopyCompletions.finished>`)."""
        return self.completions.finished(kinds, counts)

    def finished_writes(self) -> list[tuple[int, BaseException | None]]:
        """Backups finished on every rank, in submission order (``(node_id, error or None)``); their host
        slots are still WRITING: the caller marks them synced, or aborts them."""
        return self.completions.finished(("write",))["write"]

    def finished_loads(self) -> list[tuple[int, BaseException | None]]:
        """Load-backs finished on every rank, in submission order, as :meth:`finished_writes`."""
        return self.completions.finished(("load",))["load"]

    # ------------------------------------------------------------------ submitting copies
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HiCacheController is closed")

    def _ready_event(self) -> Any:
        """An event after the work the pools' device has queued so far on its current stream (the
        forward that produced the KV a backup reads, the reads of slots a load overwrites). Recorded on
        the *pools'* device, which need not be the current device."""
        if not self.device.has_events:
            return None
        ev = self.device.new_event()
        ev.record(self.device.current_stream())
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
        if self.window is not None:  # the window rows the pages have now go with them
            op.window = self.window.plan_backup(device_indices, host_indices)
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

    def cancel_load(self, node_id: int, host_indices: torch.Tensor) -> None:
        """Take back a queued load-back of ``node_id`` that has not started (:meth:`load` was called,
        :meth:`start_loading` not yet): its host slots go back to SYNCED; no ack will come for it.
        ``ValueError`` when there is none."""
        i = next((k for k, op in enumerate(self._pending_loads) if op.node_ids == [node_id]), None)
        if i is None:
            raise ValueError(f"node_id: no queued load-back of node {node_id} (started already, or never queued)")
        del self._pending_loads[i]
        self.host_pool.mark_synced(host_indices)
        outstanding = self._outstanding["load"]
        outstanding[node_id] -= 1
        if outstanding[node_id] <= 0:
            del outstanding[node_id]

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
        if self.window is not None:  # the window rows their host copies carry, into the rows given to them
            op.window = self.window.plan_load(op.device_indices, op.host_indices)
        self.completions.release_landed_loads()
        op.generation = self.layer_counter.start()  # may time out: then the loads stay pending
        self._pending_loads = []
        self._submit(self._load_queue, op)
        return op.generation

    def _submit(self, q: queue.Queue, op: _Op) -> None:
        if self.threaded:
            q.put(op)
        else:
            self._run(op)

    # ------------------------------------------------------------------ issuing copies
    def _run(self, op: _Op) -> None:
        """Issue ``op`` on its stream and acknowledge it with an event recorded after everything it
        issued; the ack is taken only once that event completes, also for a copy that failed part-way
        (the layers it had issued may still be running: its roll-back must not free their slots
        before they land). A failed load batch is aborted on the layer counter at once, so its
        consumers fail fast."""
        acks = self.ack_write_queue if op.kind == "write" else self.ack_load_queue
        stream = self._write_stream if op.kind == "write" else self._load_stream
        ack = CopyAck(op.kind, op.node_ids, None, tokens=len(op.device_indices), generation=op.generation)
        try:
            with torch.cuda.device(self.device_pool.device) if self.on_gpu else contextlib.nullcontext():
                ack.start = self.device.new_event(timing=True)  # worker threads start on device 0
                if op.ready is not None:  # the copy's data is ready (nothing waits here)
                    stream.wait_event(op.ready)
                ack.start.record(stream)  # after the wait: the copy's time is its own, not the queue's
                self._issue(op, stream)
        except BaseException as exc:
            ack.error = exc
            if op.kind == "load" and op.generation in self.layer_counter.in_flight:
                self.layer_counter.abort(op.generation, exc)
        finally:
            done = self.device.new_event(timing=True)
            try:
                done.record(stream)
            except BaseException as exc:  # cannot tell when its work lands: wait for the whole stream
                stream.synchronize()
                done = None
                ack.error = ack.error or exc
            ack.done = done
            acks.append(ack)
        if ack.error is not None and not self.threaded and not isinstance(ack.error, Exception):
            raise ack.error  # KeyboardInterrupt on the caller's thread stays an interrupt

    def _issue(self, op: _Op, stream: Any) -> None:
        """Launch ``op``'s copies on ``stream`` (which :meth:`_run` made wait for its ready event)."""
        dp = self.device_pool
        d_idx, h_idx = op.device_indices, op.host_indices
        # The pools were validated once (self.binding and the sidecars'); each op checks its indices once.
        # A sidecar pool's copies go with the KV's, on the same stream before the op's done event: one
        # ack covers both, so a page is never backed up or loaded half (KV without its sidecar).
        pairs = self.pool_pairs
        # The window rows (whole: all their layers) go with the KV, before a load's first layer is signalled.
        window = op.window is not None and len(op.window[0]) > 0
        if op.kind == "write":
            for b, d, h in pairs:
                work = lambda s, b=b: b.backup(d_idx, h_idx, backend=self.backend, stream=s)  # noqa: E731
                self._launch(stream, work, op, (d, d_idx), (h, h_idx), None)
            if window:
                self._launch_window(op, stream)
            return
        if self.layer_wise:
            # Indices checked and moved once per batch; each layer is one prepared launch per pool.
            backend_stream = stream if self.on_gpu else None
            loads = [(LayerLoads(b, d_idx, h_idx, backend=self.backend, stream=backend_stream), d, h)
                     for b, d, h in pairs]  # fmt: skip
            if window:  # all its layers before the KV's first: in place before any layer is read
                self._launch_window(op, stream)
            for layer in range(dp.num_layers):
                for load, d, h in loads:
                    if layer >= d.num_layers:  # a sidecar of fewer layers: all issued with the first ones
                        continue
                    work = lambda s, layer=layer, load=load: load(layer)  # noqa: E731
                    self._launch(stream, work, op, (h, h_idx), (d, d_idx), layer)
                self.layer_counter.layer_issued(layer, stream, op.generation)  # the layer of every pool
            return
        if window:
            self._launch_window(op, stream)
        for b, d, h in pairs:
            work = lambda s, b=b: b.load(d_idx, h_idx, backend=self.backend, stream=s)  # noqa: E731
            self._launch(stream, work, op, (h, h_idx), (d, d_idx), None)
        for layer in range(dp.num_layers):
            self.layer_counter.layer_issued(layer, stream, op.generation)

    def _launch_window(self, op: _Op, stream: Any) -> None:
        """``op``'s copy of the window rows chosen when it was queued (every layer)."""
        (b, d, h), (w_idx, h_idx) = self.window_pair, op.window
        if op.kind == "write":
            work = lambda s: b.backup(w_idx, h_idx, backend=self.backend, stream=s)  # noqa: E731
            self._launch(stream, work, op, (d, w_idx), (h, h_idx), None)
        else:
            work = lambda s: b.load(w_idx, h_idx, backend=self.backend, stream=s)  # noqa: E731
            self._launch(stream, work, op, (h, h_idx), (d, w_idx), None)

    def _launch(self, stream: Any, work: Any, op: _Op, src: tuple, dst: tuple, layer: int | None) -> None:
        """One launch of ``op`` on the device: ``src`` / ``dst`` are ``(pool, slots)``, for ``layer`` or
        every layer (None). The regions and the description are built only for a device that uses them."""
        dev = self.device
        if not dev.tracks_regions:
            dev.launch(stream, work)
            return
        layers = None if layer is None else (layer,)
        what = f"{'backup' if op.kind == 'write' else 'load'}{'' if layer is None else f' of layer {layer}'}"
        dev.launch(stream, work, reads=[KVRegion(*src, layers)], writes=[KVRegion(*dst, layers)],
                   what=f"{what} of nodes {op.node_ids}")  # fmt: skip

    def flush(self) -> None:
        """Start the queued load-backs and wait until every queued copy has run (acks still need
        processing by the tree)."""
        self._check_open()
        self._start_pending()
        self._write_queue.join()
        self._load_queue.join()
        self.completions.wait_landed()

    def flush_writes(self) -> None:
        """Wait until every queued backup has run and landed (acks still need processing by the tree).
        Load-backs are neither waited for nor started: a write-back eviction waits for its victims'
        host copies with this, and a queued load-back may not have been agreed across TP ranks yet."""
        self._check_open()
        self._write_queue.join()
        self.completions.wait_landed(("write",))

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
                    acks.append(CopyAck(op.kind, op.node_ids, error, generation=op.generation))
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
                    self.ack_load_queue.append(CopyAck("load", op.node_ids, dropped))
                self._pending_loads.clear()
                if self._finalizer is not None:
                    self._finalizer()  # the stop markers, queued behind what is still to run
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                raise RuntimeError(f"HiCacheController: worker {t.name} did not stop within {timeout} s")
        self.completions.wait_landed()  # what was issued lands before close returns

    def __enter__(self) -> HiCacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
