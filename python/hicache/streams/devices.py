"""One stream/event abstraction for every ordering decision of the cache: the controller's copies, the
layer-by-layer loads a forward waits for, and the acks that say a copy has landed.

A :class:`StreamDevice` hands out streams and events and *launches* work on a stream; callers never
touch ``torch.cuda`` themselves, so the same controller runs on

- :class:`CudaDevice`: ``torch.cuda`` streams and events on the pools' GPU. A launch calls the work
  with the ``torch.cuda.Stream`` (the io-backends issue asynchronously on it).
- :class:`EagerDevice`: CPU pools (the default without a GPU). A launch runs the copy at once, so an
  event is complete as soon as it is recorded.
- :class:`hicache.streams.deferred.DeferredDevice`: CPU pools under a *deferred-completion* model for tests:
  a launched copy runs later, as on a GPU, and hazards (a source changed before its copy ran, a
  destination read or written before it was filled) fail loudly.

A launch names what the work reads and writes as :class:`KVRegion` s (a pool, its slots, its layers):
only the deferred model uses them (``tracks_regions``), to poison destinations and check sources.

Rules the callers keep (and the deferred model checks): a copy is done when an event recorded after it
on its stream says so (``query``/``synchronize``), never when the launch returns; a stream that must
see another stream's results waits on an event of that stream (``stream.wait_event``); the *current*
stream of the pools' device (:meth:`StreamDevice.current_stream`) is the one the host's own work (the
forward, the scheduler) is ordered with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["CudaDevice", "EagerDevice", "Event", "KVRegion", "Stream", "StreamDevice"]


@dataclass(frozen=True)
class KVRegion:
    """Slots of a pool, in some layers: what a launch reads or writes.

    ``pool`` is a :class:`~hicache.pools.DeviceKVPool` or :class:`~hicache.pools.HostKVPool`;
    ``slots`` an int tensor of token slots; ``layers`` the layer ids (None: every layer).
    """

    pool: Any
    slots: torch.Tensor
    layers: Sequence[int] | None = None

    def describe(self) -> str:
        kind = type(self.pool).__name__
        s = self.slots.tolist()
        shown = s if len(s) <= 8 else [*s[:4], "...", *s[-2:]]
        layers = "all layers" if self.layers is None else f"layers {list(self.layers)}"
        return f"{kind} slots {shown} ({len(s)} slots, {layers})"


class Event(Protocol):
    """A point on a stream: complete once everything launched on that stream before it has run."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


HIGHEST_PRIORITY = -1000
"""A CUDA stream priority below every device's range (Hopper: -5 to 0; lower is higher): torch clamps it
to the highest the device has."""


class Stream(Protocol):
    """An ordered queue of work on a device."""

    def wait_event(self, event: Any) -> None: ...

    def synchronize(self) -> None: ...


class StreamDevice(Protocol):
    """Streams, events and launches on the pools' device (module docstring).

    It is also the :class:`~hicache.controller.layer_counter.LayerEvents` of the controller's layer counter
    (``new_event``, ``wait``), or None-equivalent for :class:`EagerDevice` (``has_events`` False: a copy
    has landed when its launch returns).
    """

    name: str
    has_events: bool
    # Whether the regions a launch or check_read names are used (the deferred model); callers skip
    # building them (and a launch's description) otherwise: they cost host time on every copy.
    tracks_regions: bool

    def new_stream(self, name: str, high_priority: bool = False) -> Any:
        """A new stream; ``high_priority``: its work is scheduled ahead of the device's other streams
        (the layer loads a forward waits for, not the backups)."""
        ...

    def current_stream(self) -> Any: ...

    def new_event(self, timing: bool = False) -> Any: ...

    def wait(self, event: Any) -> None: ...

    def launch(
        self,
        stream: Any,
        work: Callable[[Any], None],
        *,
        reads: Sequence[KVRegion] = (),
        writes: Sequence[KVRegion] = (),
        what: str = "copy",
    ) -> None: ...

    def elapsed_s(self, start: Any, end: Any) -> float: ...

    def check_read(self, regions: Sequence[KVRegion], what: str) -> None: ...


class CudaDevice:
    """:class:`StreamDevice` on a CUDA GPU: ``torch.cuda`` streams and events of ``device``."""

    name = "cuda"
    has_events = True
    tracks_regions = False

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def new_stream(self, name: str, high_priority: bool = False) -> torch.cuda.Stream:
        if high_priority:  # below the device's range: torch maps it to the highest priority there is
            return torch.cuda.Stream(device=self.device, priority=HIGHEST_PRIORITY)
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        """The pools' device's current stream (not the current device's: the two may differ)."""
        return torch.cuda.current_stream(self.device)

    def new_event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def wait(self, event: torch.cuda.Event) -> None:
        """The pools' device's current stream waits for ``event`` (the host does not block)."""
        self.current_stream().wait_event(event)

    def launch(self, stream: torch.cuda.Stream, work: Callable[[Any], None], **_: Any) -> None:
        with torch.cuda.device(self.device):  # worker threads start on device 0
            work(stream)

    def elapsed_s(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def check_read(self, regions: Sequence[KVRegion], what: str) -> None:
        pass  # the GPU orders reads through events; nothing to check on the host


class _DoneEvent:
    """An event of :class:`EagerDevice`: complete when recorded (the work before it ran at launch)."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _EagerStream:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class EagerDevice:
    """:class:`StreamDevice` for CPU pools: a launch runs its work at once (``work(None)``: the CPU
    io-backends take no stream), so every event is complete when recorded."""

    name = "eager"
    has_events = False
    tracks_regions = False

    def new_stream(self, name: str, high_priority: bool = False) -> _EagerStream:
        return _EagerStream(name)

    def current_stream(self) -> _EagerStream:
        return _EagerStream("current")

    def new_event(self, timing: bool = False) -> _DoneEvent:
        return _DoneEvent()

    def wait(self, event: Any) -> None:
        pass

    def launch(self, stream: Any, work: Callable[[Any], None], **_: Any) -> None:
        work(None)

    def elapsed_s(self, start: _DoneEvent, end: _DoneEvent) -> float:
        return max(0.0, end.t - start.t)

    def check_read(self, regions: Sequence[KVRegion], what: str) -> None:
        pass
