"""A deferred-completion device for CPU tests: copies complete later than they are issued, as on a GPU.

On a CPU every copy has finished when its call returns, so a test never sees a slot freed or reused
while a copy still reads or writes it, an event recorded on the wrong stream, or a forward reading KV
before its layer landed. :class:`DeferredDevice` is a :class:`~hicache.streams.StreamDevice` in which
**a launched copy does not run when it is issued**: it is queued on its stream and runs later, when

- something waits on an event recorded after it (``event.synchronize()``, ``stream.wait_event`` when
  that stream runs, the current stream's wait: the host's own work follows the current stream),
- its stream is synchronized, or
- a seeded scheduler picks its stream at any call into the model (so the streams interleave
  differently per seed; ``step_probability`` sets how eagerly).

While a copy is queued its destination holds poison bytes (``0xA5``) and its source is snapshotted.
When it runs, the model checks, and raises :class:`OrderingError` naming the op, its stream, the
other op and the slots:

- its source does not overlap the destination of a copy still queued (it would read unwritten data),
- its source equals the snapshot, except where an earlier queued copy was still to fill it (a source
  overwritten, or freed and reused, before the copy ran),
- its destination still holds the poison (written by someone else before the copy ran).

:meth:`DeferredDevice.check_read` is the same first check for the host's own reads (the forward
reading a layer's KV). Every hazard is also kept in :attr:`DeferredDevice.hazards`: a test fixture
fails the test on any, even when the error was caught (a copy that failed in a worker is acked as
failed and rolled back, which would hide it otherwise).

An exception raised by the copy itself when it runs is an asynchronous error: sticky on its stream,
raised by the ``query``/``synchronize`` of any later event there (as CUDA reports a kernel fault). A
launch error, raised at issue, is modelled by :meth:`DeferredDevice.fail_launch`.

The io-backends (``direct``, ``staged``, ``triton`` on CPU) run under it unchanged: the model sits
where the streams are, and runs each queued copy's work with ``stream=None``.

What it cannot show: the GPU memory model, PCIe, the kernels' own races (compute-sanitizer on a GPU
finds those), and host code that reads or writes pool memory without going through the controller or
:meth:`check_read`.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .devices import KVRegion

__all__ = ["POISON", "DeferredDevice", "OrderingError", "env_seed", "hazard_log"]

POISON = 0xA5
SEED_ENV = "HICACHE_DEFERRED_SEED"

# Every hazard any DeferredDevice caught, in order (a test fixture checks that its test added none).
_HAZARDS: list[str] = []


def hazard_log() -> list[str]:
    """The hazards every :class:`DeferredDevice` of this process caught, oldest first (the list itself:
    a fixture may clear it)."""
    return _HAZARDS


def env_seed() -> int | None:
    """The seed in ``HICACHE_DEFERRED_SEED`` (None when unset or empty); ``ValueError`` when not an int."""
    raw = os.environ.get(SEED_ENV, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{SEED_ENV}: expected an integer seed, got {raw!r}") from None


class OrderingError(RuntimeError):
    """A stream-ordering hazard the deferred model caught (module docstring)."""


class _Span:
    """A region's bytes: chunks of ``width`` bytes at ``starts`` inside the 1-D uint8 view ``flat``."""

    __slots__ = ("addrs", "flat", "idx", "region", "slot_of", "width")

    def __init__(
        self, region: KVRegion, flat: torch.Tensor, starts: np.ndarray, width: int, slot_of: np.ndarray
    ) -> None:
        self.region, self.flat, self.width = region, flat, width
        starts = starts.astype(np.int64)
        self.slot_of = np.broadcast_to(slot_of, starts.shape).reshape(-1)  # the token slot of each chunk
        starts = starts.reshape(-1)
        self.addrs = (starts + flat.data_ptr()).tolist()
        self.idx = (torch.from_numpy(starts)[:, None] + torch.arange(width)).reshape(-1)

    def read(self) -> torch.Tensor:
        return self.flat[self.idx].view(-1, self.width)


def _uint8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _spans(region: KVRegion) -> list[_Span]:
    """Byte spans of ``region`` (one per pool tensor), whatever the pool's layout."""
    pool = region.pool
    slots = region.slots.detach().cpu().numpy().astype(np.int64)
    if slots.size and (slots.min() < 0 or slots.max() >= pool.size):
        raise IndexError(f"slots outside the pool's [0, {pool.size})")
    layers = list(range(pool.num_layers)) if region.layers is None else [int(x) for x in region.layers]
    item = pool.item_bytes
    if hasattr(pool, "device_k"):  # DeviceKVPool: [L, N, H, D] per K/V (or a list of [N, H, D])
        out = []
        for t in (pool.device_k, pool.device_v):
            if t is None:
                continue
            if isinstance(t, torch.Tensor):
                starts = (np.asarray(layers)[:, None] * pool.size + slots[None, :]) * item
                out.append(_Span(region, _uint8(t), starts, item, slots[None, :]))
            else:
                out += [_Span(region, _uint8(t[layer]), slots * item, item, slots) for layer in layers]
        return out
    g = pool.geometry  # HostKVPool: its layout's byte strides
    kv = np.arange(g.num_kv)[:, None, None, None] * g.s_kv
    lay = np.asarray(layers)[None, :, None, None] * g.s_layer
    n = slots[None, None, :, None]
    slot = (n // g.page_size) * g.s_page + (n % g.page_size) * g.s_in_page
    chunk = np.arange(g.num_chunks)[None, None, None, :] * g.s_chunk
    return [_Span(region, _uint8(pool.buffer), kv + lay + slot + chunk, g.chunk_bytes, n)]


class _Item:
    """One entry of a stream's queue: a launch, an event record, or a wait for another stream."""

    __slots__ = ("error", "event", "kind", "masked", "reads", "result", "seq", "snapshot", "stream", "target",
                 "what", "work", "writes")  # fmt: skip

    def __init__(self, seq: int, kind: str, stream: _Stream, what: str = "") -> None:
        self.seq, self.kind, self.stream, self.what = seq, kind, stream, what
        self.work: Callable[[Any], None] | None = None  # None: done at launch, ``result`` lands when run
        self.result: list[torch.Tensor] = []
        self.reads: list[_Span] = []
        self.writes: list[_Span] = []
        self.snapshot: list[torch.Tensor] = []
        self.masked: list[np.ndarray] = []
        self.event: _Event | None = None
        self.target: tuple[_Stream, int] | None = None
        self.error: BaseException | None = None

    def __str__(self) -> str:
        return f"op #{self.seq} ({self.what}) on stream {self.stream.name!r}"


class _Stream:
    """A stream of the model: a FIFO of :class:`_Item`; ``done`` is the seq of the last item run."""

    def __init__(self, model: DeferredDevice, name: str) -> None:
        self.model, self.name = model, name
        self.queue: deque[_Item] = deque()
        self.done = 0
        self.errors: list[tuple[int, BaseException]] = []  # (seq, error) of launches that raised when run
        self.high_priority = False  # as asked of new_stream; the model does not schedule by it

    def wait_event(self, event: _Event) -> None:
        self.model._wait(self, event)

    def synchronize(self) -> None:
        self.model._sync_stream(self)

    def __repr__(self) -> str:
        return f"<deferred stream {self.name!r}: {len(self.queue)} queued>"


class _Event:
    """An event of the model: the point ``seq`` on ``stream`` (None: never recorded, complete)."""

    def __init__(self, model: DeferredDevice) -> None:
        self.model = model
        self.stream: _Stream | None = None
        self.seq = 0
        self.t = 0.0  # host time its point was reached

    def record(self, stream: _Stream | None = None) -> None:
        self.model._record(self, stream)

    def query(self) -> bool:
        return self.model._query(self)

    def synchronize(self) -> None:
        self.model._sync_event(self)


class DeferredDevice:
    """The deferred-completion :class:`~hicache.streams.StreamDevice` (module docstring).

    Parameters
    ----------
    seed : seeds the scheduler that runs queued work at random points.
    step_probability : chance that a call into the model first runs one queued item (default 0.3;
        0 runs queued work only when something waits for it).
    """

    name = "deferred"
    has_events = True
    tracks_regions = True

    def __init__(self, seed: int = 0, step_probability: float = 0.3) -> None:
        if not 0.0 <= step_probability <= 1.0:
            raise ValueError(f"step_probability: expected a probability in [0, 1], got {step_probability!r}")
        self.seed = seed
        self.step_probability = step_probability
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._seq = 0
        self._streams: list[_Stream] = []
        self._current: dict[str, _Stream] = {}
        self.current_device = "pool"  # whose current stream a record without a stream goes to
        self._writers: dict[int, _Item] = {}  # chunk address -> the queued launch that will write it
        self._launch_faults: dict[str, list[tuple[int, BaseException]]] = {}
        self._launches: dict[str, int] = {}
        self._busy = False
        self.hazards: list[str] = []
        self.launched = 0  # launches queued, all streams
        self.ran_late = 0  # launches that ran after a later call into the model (not at their own launch)

    # ------------------------------------------------------------------ the StreamDevice interface
    def new_stream(self, name: str, high_priority: bool = False) -> _Stream:
        with self._lock:
            s = _Stream(self, name)
            s.high_priority = high_priority
            self._streams.append(s)
            return s

    def current_stream(self, device: str = "pool") -> _Stream:
        """The current stream of ``device`` (default: the pools' device), which the host's work follows."""
        with self._lock:
            s = self._current.get(device)
            if s is None:
                s = self._current[device] = self.new_stream(f"current[{device}]")
            return s

    def new_event(self, timing: bool = False) -> _Event:
        return _Event(self)

    def wait(self, event: _Event) -> None:
        """The pools' current stream (so the host) waits for ``event``: what it covers runs now."""
        self._wait(self.current_stream(), event)

    def launch(
        self,
        stream: _Stream,
        work: Callable[[Any], None],
        *,
        reads: Sequence[KVRegion] = (),
        writes: Sequence[KVRegion] = (),
        what: str = "copy",
    ) -> None:
        """Queue ``work`` on ``stream``: poison its destination, snapshot its source (module docstring)."""
        with self._lock:
            self._maybe_step()
            faults = self._launch_faults.get(stream.name)
            count = self._launches[stream.name] = self._launches.get(stream.name, 0) + 1
            if faults and faults[0][0] == count:
                raise faults.pop(0)[1]
            try:
                read_spans = [sp for r in reads for sp in _spans(r)]
                write_spans = [sp for r in writes for sp in _spans(r)]
            except IndexError:  # slots outside the pool: the copy's own check says so, below
                read_spans = write_spans = None
            else:
                snapshot = [sp.read().clone() for sp in read_spans]
                masked = [np.fromiter((a in self._writers for a in sp.addrs), bool, len(sp.addrs)) for sp in read_spans]
        if read_spans is None:
            work(None)
            raise IndexError(f"{what}: slots outside the pools, and the copy did not refuse them")
        # Its source is final: do the copy now (outside the lock: a test's hook may block here, as a
        # launch can), keep what it wrote and put the poison back; the result lands when the item
        # runs. A failing copy raises here, at its launch, as on a GPU.
        done_now = not any(m.any() for m in masked)
        if done_now:
            work(None)
        with self._lock:
            item = self._new_item("launch", stream, what)
            item.reads, item.writes, item.snapshot, item.masked = read_spans, write_spans, snapshot, masked
            if done_now:
                item.result = [sp.read().clone() for sp in write_spans]
            else:
                item.work = work  # its source is still being filled: the copy itself runs when it runs
            for sp in write_spans:
                sp.flat[sp.idx] = POISON
                for a in sp.addrs:
                    self._writers[a] = item
            stream.queue.append(item)
            self.launched += 1
            self._maybe_step()

    def elapsed_s(self, start: _Event, end: _Event) -> float:
        return max(0.0, end.t - start.t)

    def check_read(self, regions: Sequence[KVRegion], what: str) -> None:
        """Work on the pools' current stream (the forward) reads ``regions`` now: what that stream has
        queued runs first (it is ordered before), then none of ``regions`` may be the destination of a
        copy still queued on another stream."""
        with self._lock:
            self._sync_stream(self.current_stream())
            for r in regions:
                for sp in _spans(r):
                    self._check_unwritten(sp, what)

    # ------------------------------------------------------------------ test controls
    def fail_launch(self, stream_name: str, nth: int, error: BaseException) -> None:
        """Make the ``nth`` launch (counted from 1, from now) on streams named ``stream_name`` raise
        ``error`` when issued: a launch error, as a GPU reports it at the launch call."""
        with self._lock:
            at = self._launches.get(stream_name, 0) + nth
            self._launch_faults.setdefault(stream_name, []).append((at, error))
            self._launch_faults[stream_name].sort(key=lambda f: f[0])

    def set_current_device(self, device: str) -> None:
        """Which device's current stream ``event.record()`` without a stream records on (default
        ``"pool"``): a test of code that should name the pools' device and does not."""
        self.current_device = device

    def queued(self) -> int:
        """Launches queued and not yet run, all streams."""
        with self._lock:
            return sum(1 for s in self._streams for i in s.queue if i.kind == "launch")

    def synchronize(self) -> None:
        """Run everything queued on every stream."""
        with self._lock:
            while any(s.queue for s in self._streams):
                for s in self._streams:
                    self._sync_stream(s)

    # ------------------------------------------------------------------ the model
    def _new_item(self, kind: str, stream: _Stream, what: str = "") -> _Item:
        self._seq += 1
        return _Item(self._seq, kind, stream, what)

    def _maybe_step(self) -> None:
        if self._busy or self.step_probability == 0.0 or self._rng.random() >= self.step_probability:
            return
        busy = [s for s in self._streams if s.queue]
        if busy:
            self._run_head(self._rng.choice(busy), late=True)

    def _record(self, event: _Event, stream: _Stream | None) -> None:
        with self._lock:
            self._maybe_step()
            stream = self.current_stream(self.current_device) if stream is None else stream
            item = self._new_item("record", stream, "event")
            item.event = event
            event.stream, event.seq = stream, item.seq
            stream.queue.append(item)
            if len(stream.queue) == 1:
                self._run_head(stream)  # nothing before it: reached at once

    def _wait(self, stream: _Stream, event: _Event) -> None:
        with self._lock:
            self._maybe_step()
            src = event.stream
            if src is None or src.done >= event.seq or src is stream:
                return
            if stream in self._current.values():  # the host follows this stream: it waits now
                self._drain(src, event.seq)
                return
            item = self._new_item("wait", stream, f"wait for {src.name!r} #{event.seq}")
            item.target = (src, event.seq)
            stream.queue.append(item)

    def _query(self, event: _Event) -> bool:
        with self._lock:
            self._maybe_step()
            s = event.stream
            if s is None:
                return True
            if s.done < event.seq:
                return False
            self._raise_async(s, event.seq)
            return True

    def _sync_event(self, event: _Event) -> None:
        with self._lock:
            s = event.stream
            if s is None:
                return
            self._drain(s, event.seq)
            self._raise_async(s, event.seq)

    def _sync_stream(self, stream: _Stream) -> None:
        with self._lock:
            if stream.queue:
                self._drain(stream, stream.queue[-1].seq)

    @staticmethod
    def _raise_async(stream: _Stream, seq: int) -> None:
        for at, error in stream.errors:
            if at < seq:
                raise error

    def _drain(self, stream: _Stream, upto: int) -> None:
        while stream.queue and stream.queue[0].seq <= upto:
            self._run_head(stream)

    def _run_head(self, stream: _Stream, late: bool = False) -> None:
        item = stream.queue[0]
        busy, self._busy = self._busy, True
        try:
            if item.kind == "wait":
                src, upto = item.target
                self._drain(src, upto)
            elif item.kind == "record":
                item.event.t = time.perf_counter()
            else:
                self._run_launch(item, late)
        finally:
            self._busy = busy
            if stream.queue and stream.queue[0] is item:
                stream.queue.popleft()
                stream.done = item.seq

    def _run_launch(self, item: _Item, late: bool) -> None:
        try:
            for sp in item.reads:
                self._check_unwritten(sp, f"{item} reads its source")
            for sp, snap, masked in zip(item.reads, item.snapshot, item.masked, strict=True):
                changed = ~masked & ~torch.all(sp.read() == snap, dim=1).numpy()
                if changed.any():
                    self._hazard(
                        f"{item}: its source {_cells(sp, changed)} changed between the launch and the copy "
                        "(overwritten, or freed and reused, before the copy ran)"
                    )
            for sp in item.writes:
                clean = torch.all(sp.read() == POISON, dim=1).numpy()
                mine = np.fromiter((self._writers.get(a) is item for a in sp.addrs), bool, len(sp.addrs))
                if (~clean & mine).any():
                    self._hazard(
                        f"{item}: its destination {_cells(sp, ~clean & mine)} was written by someone else "
                        "after the launch and before the copy ran"
                    )
        except OrderingError as exc:
            item.stream.errors.append((item.seq, exc))
            self._forget(item)
            raise
        self._forget(item)
        if late:
            self.ran_late += 1
        if item.work is None:
            for sp, result in zip(item.writes, item.result, strict=True):
                later = self._later_writer(sp)
                if not later.any():
                    sp.flat[sp.idx] = result.reshape(-1)
                else:  # a later launch on these chunks has not run: they keep its poison until it does
                    mine = torch.from_numpy(~later)
                    sp.flat[sp.idx.view(-1, sp.width)[mine].reshape(-1)] = result[mine].reshape(-1)
            return
        try:  # its source was still being filled at launch: the copy itself runs now
            item.work(None)
        except Exception as exc:  # an asynchronous error: sticky on the stream
            item.error = exc
            item.stream.errors.append((item.seq, exc))
        for sp in item.writes:  # chunks a later launch will write keep its poison until it runs
            later = self._later_writer(sp)
            if later.any():
                sp.flat[sp.idx.view(-1, sp.width)[torch.from_numpy(later)].reshape(-1)] = POISON

    def _later_writer(self, sp: _Span) -> np.ndarray:
        """Per chunk of ``sp``: another launch, issued later and not run yet, writes it too (two writes
        in stream order, e.g. a slot written, freed, taken again and written before either ran)."""
        return np.fromiter((a in self._writers for a in sp.addrs), bool, len(sp.addrs))

    def _forget(self, item: _Item) -> None:
        for sp in item.writes:
            for a in sp.addrs:
                if self._writers.get(a) is item:
                    del self._writers[a]

    def _check_unwritten(self, sp: _Span, what: str) -> None:
        pending = [self._writers.get(a) for a in sp.addrs]
        hit = np.fromiter((w is not None for w in pending), bool, len(pending))
        if hit.any():
            other = next(w for w in pending if w is not None)
            self._hazard(f"{what}: {_cells(sp, hit)} is the destination of {other}, which has not run yet")

    def _hazard(self, message: str) -> None:
        self.hazards.append(message)
        _HAZARDS.append(message)
        raise OrderingError(message)


def _cells(sp: _Span, which: np.ndarray) -> str:
    """The token slots of ``sp`` whose chunks ``which`` marks, and the region they belong to."""
    slots = sorted(set(sp.slot_of[which].tolist()))
    shown = slots if len(slots) <= 8 else [*slots[:6], "..."]
    return f"slots {shown} of {sp.region.describe()}"
