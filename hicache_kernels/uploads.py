"""Index uploads through a small ring of pinned host buffers, so that issuing a copy never blocks.

A copy whose slot indices are on the host uploads them to the GPU before its kernel runs. From pageable
memory ``cudaMemcpyAsync`` is not asynchronous: CUDA synchronizes the stream before a pageable
host-to-device copy starts, so the thread that issues a layer load would wait for everything already
queued on the load stream (the earlier layers' copies), and a large batch is staged by the driver on
that thread. From pinned memory the copy is queued and the call returns.

:class:`UploadRing` keeps ``slots`` pinned buffers of ``slot_bytes`` each per device. An upload packs the
tensors it is given into the next buffer (one host memcpy), queues ONE host-to-device copy of them on
the launch stream, records an event after it, and returns device views of the copied bytes with the
tensors' dtypes and shapes. A buffer is written again only once the event of its previous upload has
completed (the DMA has read it): with a few buffers that wait is on a copy issued several uploads ago,
normally long done. Uploads larger than a buffer, and any made while a CUDA graph is being captured
(the caller's tensors must then be on the device already), go the plain way (``tensor.to``), counted
in :attr:`UploadRing.plain`.

Thread-safe: the controller's write and load threads share a device's ring.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["SLOT_BYTES", "SLOTS", "UploadRing", "upload_ring"]

SLOTS = 8
"""Pinned buffers per device ring."""
SLOT_BYTES = 1 << 20
"""Bytes of each buffer: 64k pairs of int64 slot indices per upload."""


class _Slot:
    __slots__ = ("buffer", "event")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.event: Any = None  # recorded after the last upload out of this buffer


class UploadRing:
    """Pinned buffers that host tensors are uploaded through (module docstring).

    Parameters
    ----------
    device : the GPU the uploads go to.
    slots, slot_bytes : how many buffers, and their size in bytes (each a multiple of 16).
    pin : allocate the buffers pinned (True; False only for tests without CUDA).
    new_event : makes the event recorded after each upload (default ``torch.cuda.Event``).
    on_stream : the context in which an upload's device memory is allocated and its copy queued
        (default ``torch.cuda.stream``).
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        slots: int = SLOTS,
        slot_bytes: int = SLOT_BYTES,
        pin: bool = True,
        new_event: Callable[[], Any] | None = None,
        on_stream: Callable[[Any], Any] | None = None,
    ) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots: expected a positive int, got {slots!r}")
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < 16 or slot_bytes % 16:
            raise ValueError(f"slot_bytes: expected a positive multiple of 16, got {slot_bytes!r}")
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self._slots = [_Slot(torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pin)) for _ in range(slots)]
        self._next = 0
        self._lock = threading.Lock()
        self._new_event = new_event or (lambda: torch.cuda.Event())
        self._on_stream = on_stream or torch.cuda.stream
        self.uploads = 0  # through the ring
        self.plain = 0  # too large for a buffer, or under capture: tensor.to

    def upload(self, tensors: Sequence[torch.Tensor], stream: Any, capturing: bool = False) -> list[torch.Tensor]:
        """``tensors`` (contiguous host tensors) on :attr:`device`, copied on ``stream`` (None: the
        current one): the returned tensors are ready for work queued on ``stream`` after this call, and
        belong to its allocator. The host tensors may be changed or freed as soon as this returns."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // 16) * 16  # each tensor 16-byte aligned in the buffer and on the device
        if capturing or total > self.slot_bytes:
            with self._lock:
                self.plain += 1
            with self._on_stream(stream):
                return [t.to(self.device, non_blocking=True) for t in tensors]
        with self._lock:
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            if slot.event is not None:
                slot.event.synchronize()  # its previous upload has been read by the DMA
            for t, off, n in zip(tensors, offsets, sizes, strict=True):
                slot.buffer[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
            with self._on_stream(stream):
                out = torch.empty(total, dtype=torch.uint8, device=self.device)
                out.copy_(slot.buffer[:total], non_blocking=True)
                slot.event = self._new_event()
                slot.event.record(stream)
            self.uploads += 1
        return [
            out[off : off + n].view(t.dtype).view(t.shape) for t, off, n in zip(tensors, offsets, sizes, strict=True)
        ]


_rings: dict[torch.device, UploadRing] = {}
_rings_lock = threading.Lock()


def upload_ring(device: torch.device) -> UploadRing:
    """The ring of ``device`` (a CUDA device with its index), made at its first use."""
    with _rings_lock:
        ring = _rings.get(device)
        if ring is None:
            ring = _rings[device] = UploadRing(device)
        return ring
