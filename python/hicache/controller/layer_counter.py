"""Per-layer completion of layer-by-layer load batches: the producer (the controller's load worker)
records one event per layer on its stream, the consumer (a forward pass) waits for the layer it is
about to read. Events are created once, in a fixed ring of producer slots, and each batch keeps its
slot until its load is acknowledged."""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from ..streams.devices import CudaDevice


class LayerEvent(Protocol):
    """One layer's completion marker on a load stream (``torch.cuda.Event`` is one)."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...


class LayerEvents(Protocol):
    """Where a :class:`LayerDoneCounter` gets its events and how a consumer waits on one.

    The counter creates its events once (:meth:`new_event`) and re-records them batch after batch;
    :meth:`wait` orders the *consumer's* later work after an event without blocking the producer.
    Injectable so that a test can drive completion with a fake clock.
    """

    def new_event(self) -> LayerEvent: ...

    def wait(self, event: LayerEvent) -> None: ...


class LayerDoneCounter:
    """Per-layer completion of load batches, for a forward pass that overlaps a layer-wise load.

    :meth:`start` opens a batch (a *generation*, numbered from 1); the loader calls
    :meth:`layer_issued` with that generation after issuing each layer's copy (in layer order) and
    :meth:`finish` once the whole batch has landed (the controller: when the event after its last
    layer completed) or :meth:`abort` when it failed. The forward pass calls
    :meth:`wait_until` before reading a layer, for the newest batch unless told otherwise.

    Batches may overlap (a new one can start while older ones are still loading): each keeps its own
    layer count and its own events until it is finished, so an older batch's layers never count for a
    newer one and a consumer of an older batch still waits for *its* copies. With events (on a GPU)
    each layer is an event recorded on the load stream after the layer's copy; :meth:`wait_until`
    makes the consumer wait on it (the current CUDA stream, without blocking the host). Without
    events (CPU pools, whose copies are synchronous) issuing a layer means it has landed.

    Memory is bounded: a fixed ring of ``num_slots`` producer slots, each holding ``num_layers``
    events created once and re-recorded by every batch that takes the slot. A batch holds its slot
    from :meth:`start` to :meth:`finish` / :meth:`abort`; when all are held :meth:`start` blocks until
    one is released (back-pressure on whoever starts loads faster than they land) and raises
    ``TimeoutError`` after ``start_timeout`` seconds.

    Parameters
    ----------
    num_layers : layers per batch.
    device : the pools' device; a CUDA device selects :class:`~hicache.streams.CudaDevice` events
        (default: none).
    num_slots : batches that may be in flight at once (default 8).
    events : a :class:`LayerEvents` overriding what ``device`` selects (tests use a fake clock).
    start_timeout : seconds :meth:`start` waits for a free slot (None: forever).
    """

    def __init__(
        self,
        num_layers: int,
        device: torch.device | None = None,
        *,
        num_slots: int = 8,
        events: LayerEvents | None = None,
        start_timeout: float | None = 60.0,
    ) -> None:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers: expected a positive int, got {num_layers!r}")
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots: expected a positive int, got {num_slots!r}")
        if events is None and device is not None and torch.device(device).type == "cuda":
            events = CudaDevice(torch.device(device))
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.start_timeout = start_timeout
        self._clock = events
        self._cond = threading.Condition()
        self._generation = 0  # the newest generation started
        # Per slot: the generation holding it (0: free), layers issued, and its events (made once).
        self._slot_gen = [0] * num_slots
        self._issued = [0] * num_slots
        self._events = [[events.new_event() for _ in range(num_layers)] if events else [] for _ in range(num_slots)]
        self._slot_of: dict[int, int] = {}  # generation in flight -> its slot (at most num_slots entries)
        # Aborted generations, the newest max_failed of them: waiting on one raises. (An older aborted
        # batch, beyond the bound, reads as finished: nobody waits that long after its ack was taken.)
        self._failed: dict[int, BaseException | str] = {}
        self.max_failed = 1024

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Generations started and not yet finished or aborted, oldest first."""
        with self._cond:
            return tuple(sorted(self._slot_of))

    def start(self) -> int:
        """Open a new load batch (all layers pending) and return its generation. Blocks while all
        ``num_slots`` slots hold unfinished batches; ``TimeoutError`` after ``start_timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: 0 in self._slot_gen, timeout=self.start_timeout):
                raise TimeoutError(
                    f"LayerDoneCounter.start: all {self.num_slots} slots still hold load batches "
                    f"{sorted(self._slot_of)} after {self.start_timeout} s; each batch needs finish() or abort()"
                )
            slot = self._slot_gen.index(0)
            self._generation += 1
            self._slot_gen[slot] = self._generation
            self._issued[slot] = 0
            self._slot_of[self._generation] = slot
            return self._generation

    def _slot(self, gen: int, method: str) -> int:
        slot = self._slot_of.get(gen)
        if slot is None:
            raise ValueError(f"generation: {gen} is not a load batch in progress ({method})")
        return slot

    def layer_issued(self, layer: int, stream: Any = None, generation: int | None = None) -> None:
        """``layer``'s copy of batch ``generation`` (default: the newest) has been issued on ``stream``
        (the current stream when None): records the layer's event there, which completes when the copy
        has landed. Layers are issued in order; skipping ahead marks the skipped
        ones issued at the same point of the stream, which covers them."""
        with self._cond:
            gen = self._generation if generation is None else generation
            slot = self._slot(gen, "layer_issued")
            issued = self._issued[slot]
            if not isinstance(layer, int) or not issued <= layer < self.num_layers:
                raise ValueError(
                    f"layer: expected {issued} <= layer < {self.num_layers} for generation {gen} "
                    f"({issued} layers already done), got {layer!r}"
                )
            for event in self._events[slot][issued : layer + 1]:
                event.record(stream)
            self._issued[slot] = layer + 1
            self._cond.notify_all()

    def finish(self, generation: int) -> None:
        """Every layer of batch ``generation`` has landed (its load stream synchronised): release its
        slot. Waiting on it afterwards returns at once."""
        with self._cond:
            slot = self._slot(generation, "finish")
            if self._issued[slot] != self.num_layers:
                raise ValueError(
                    f"generation: {generation} finished with {self._issued[slot]} of {self.num_layers} layers "
                    "done; use abort() for a failed load"
                )
            self._release(generation, slot)

    def abort(self, generation: int, error: BaseException | str) -> None:
        """Batch ``generation`` failed: release its slot; waiting on it raises ``RuntimeError``."""
        with self._cond:
            slot = self._slot(generation, "abort")
            self._failed[generation] = error
            while len(self._failed) > self.max_failed:  # never handled: keep the newest only
                del self._failed[next(iter(self._failed))]
            self._release(generation, slot)

    def _release(self, gen: int, slot: int) -> None:
        del self._slot_of[gen]
        self._slot_gen[slot] = 0
        self._cond.notify_all()  # consumers of ``gen`` and a start() waiting for a slot

    def wait_until(self, layer: int, timeout: float | None = 60.0, generation: int | None = None) -> None:
        """Make the consumer wait until ``layer`` of batch ``generation`` has loaded.

        Blocks the host until the layer's copy is issued, then (with events) makes the consumer wait
        for the copy itself: on a GPU the current CUDA stream waits, the host does not.

        Parameters
        ----------
        layer : ``0 <= layer < num_layers``.
        timeout : seconds to wait for the copy to be issued (None: forever); ``TimeoutError`` after.
        generation : a number :meth:`start` returned; default the newest. Returns at once for 0 (what
            ``start_loading`` returns when nothing was queued), when no batch was ever started, and
            for a finished batch (its data has landed). ``ValueError`` for a generation never
            started, ``RuntimeError`` for an aborted one.
        """
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer!r}")
        with self._cond:
            gen = self._generation if generation is None else generation
            if not isinstance(gen, int) or not 0 <= gen <= self._generation:
                raise ValueError(f"generation: {gen!r} was never started (newest is {self._generation})")

            def issued() -> bool:
                slot = self._slot_of.get(gen)
                return slot is None or self._issued[slot] > layer

            if not self._cond.wait_for(issued, timeout=timeout):
                raise TimeoutError(f"layer {layer} of load generation {gen} did not finish within {timeout} s")
            if gen in self._failed:
                raise RuntimeError(f"load generation {gen} failed: {self._failed[gen]!r}")
            slot = self._slot_of.get(gen)
            if slot is None or self._clock is None:
                return  # finished (landed), never started (gen 0), or no events: issued means landed
            event = self._events[slot][layer]
        # Outside the lock: a fake clock blocks here. Should the batch finish meanwhile and its slot be
        # re-recorded by a newer batch, this waits for later work on the same stream: never too early.
        self._clock.wait(event)

    @property
    def layers_done(self) -> int:
        """Layers of the newest batch that have loaded (issued, and their events complete)."""
        with self._cond:
            slot = self._slot_of.get(self._generation)
            if slot is None:
                return self.num_layers  # finished, or none started
            issued = self._issued[slot]
            if self._clock is None:
                return issued
            return next((i for i, ev in enumerate(self._events[slot][:issued]) if not ev.query()), issued)
