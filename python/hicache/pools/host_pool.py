"""The pinned host KV pool of the hierarchical cache (:class:`HostKVPool`): a larger copy of the
device pool in one of the host layouts of :mod:`hicache_kernels.layouts` (``buffer``), its own
page-aligned allocator, and a per-slot state that the cache controller drives while a backup (device ->
host) or load-back (host -> device) is in flight::

    FREE --alloc--> RESERVED --mark_writing--> WRITING --mark_synced--> SYNCED
    WRITING --abort_write--> RESERVED  (the backup failed or was dropped: no valid data)
    SYNCED --mark_loading--> LOADING --mark_synced--> SYNCED  (also when a load failed: data stays valid)
    RESERVED / SYNCED --free--> FREE

Every state change checks every given slot first and changes nothing when any is wrong (``ValueError``
naming the method, the slots and their states), so a controller bug surfaces at the call that made it,
not as corrupted KV data later. Thread-safe. Also importable from :mod:`hicache.pools`.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache_kernels import layouts

from . import host_memory
from .device_pool import DeviceKVPool
from .paged_slots import SlotState, Transition, _fmt_slots, _PagedSlots

__all__ = ["HostKVPool"]

_GIB = 1 << 30

# The host pool's slot state changes (hicache.pools.paged_slots.Transition), made once.
_HOST_MARK_WRITING = Transition(
    "mark_writing",
    (SlotState.RESERVED,),
    SlotState.WRITING,
    {
        SlotState.FREE: "slot not allocated",
        SlotState.WRITING: "a backup is already in flight",
        SlotState.SYNCED: "already holds valid data (SYNCED)",
        SlotState.LOADING: "a load from it is in flight",
    },
)

_HOST_MARK_SYNCED = Transition(
    "mark_synced",
    (SlotState.WRITING, SlotState.LOADING),
    SlotState.SYNCED,
    {
        SlotState.FREE: "slot not allocated",
        SlotState.RESERVED: "no backup was started",
        SlotState.SYNCED: "no transfer in flight",
    },
)

_HOST_MARK_FILLED = Transition(
    "mark_filled",
    (SlotState.RESERVED,),
    SlotState.SYNCED,
    {
        SlotState.FREE: "slot not allocated",
        SlotState.WRITING: "a backup into it is in flight (WRITING)",
        SlotState.SYNCED: "already holds valid data (SYNCED)",
        SlotState.LOADING: "a load from it is in flight",
    },
)

_HOST_ABORT_WRITE = Transition(
    "abort_write",
    (SlotState.WRITING,),
    SlotState.RESERVED,
    {
        SlotState.FREE: "slot not allocated",
        SlotState.RESERVED: "no backup was started",
        SlotState.SYNCED: "its backup already completed (SYNCED)",
        SlotState.LOADING: "a load from it is in flight",
    },
)

_HOST_MARK_LOADING = Transition(
    "mark_loading",
    (SlotState.SYNCED,),
    SlotState.LOADING,
    {
        SlotState.FREE: "slot not allocated",
        SlotState.RESERVED: "holds no valid data yet (RESERVED)",
        SlotState.WRITING: "its backup is still in flight (WRITING)",
        SlotState.LOADING: "a load is already in flight",
    },
)

_HOST_FREE = Transition(
    "free",
    (SlotState.RESERVED, SlotState.SYNCED),
    SlotState.FREE,
    {
        SlotState.FREE: "double free",
        SlotState.WRITING: "free of a slot in flight (WRITING)",
        SlotState.LOADING: "free of a slot in flight (LOADING)",
    },
    whole_pages=True,
)


class HostKVPool:
    """The pinned host KV pool in one host layout, with a per-slot state machine.

    Parameters
    ----------
    device_pool : the :class:`DeviceKVPool` it backs up; shape, dtype, MLA and ``page_size`` follow it.
    layout : ``"layer_first"``, ``"page_first"`` (default), ``"page_first_direct"`` or ``"page_head"``
        (MHA only), see :mod:`hicache_kernels.layouts`.
    ratio : host slots per device slot (default 2.0); used when ``size_gb`` is None.
    size_gb : host pool size in GiB; wins over ``ratio`` when given.
    num_slots : the host pool's slots exactly (rounded down to whole pages); wins over ``size_gb`` and
        ``ratio`` (a pool that shares another host pool's slot numbering takes its size).
    pin_memory : pin ``buffer`` (page-locked, so the GPU can DMA it and the zero-copy backends can read
        it). Default: pinned iff the device pool is on CUDA. ``True`` without CUDA raises ``ValueError``.
        Pinned memory is exactly the pool's bytes rounded up to OS pages (:mod:`hicache.pools.host_memory`;
        not torch's caching host allocator, which rounds up to a power of two).
    safety_margin_gb : GiB of available RAM to leave untouched (default 2.0).
    mem_available_bytes : available RAM in bytes; default read from ``/proc/meminfo`` (MemAvailable).
    setup : how the buffer's memory is made ready, a :class:`hicache.pools.host_memory.HostSetup`
        (threads that populate its pages before it is pinned, transparent huge pages, a NUMA node);
        default: several threads, no huge pages, no binding. What it took is ``setup_report``.

    The size is rounded down to whole pages. ``ValueError`` naming ``size_gb`` or ``ratio`` when the
    request is not positive, not larger than the device pool (as in SGLang's HiCache, host eviction
    assumes every device page can have a host copy), or more than available RAM minus the margin
    (counting what the allocation really takes: ``allocated_bytes``).

    Attributes
    ----------
    buffer : the pool, contiguous, of :func:`hicache_kernels.layouts.host_shape` for ``layout``:
        pass it as ``host`` to :mod:`hicache_kernels.ops` with ``layout`` and ``page_size``. It starts on
        an OS page (pinned or not), so pages of whole 4096-byte blocks can move by ``O_DIRECT``
        (:mod:`hicache.storage.file`).
    layout, size, page_size, num_layers, head_num, head_dim, dtype, mla, item_bytes : as above.
    pinned : whether ``buffer`` is pinned.
    allocated_bytes : host RAM ``buffer`` takes: ``total_bytes`` rounded up to OS pages when pinned,
        ``total_bytes`` when pageable.
    pinned_bytes : page-locked bytes: ``allocated_bytes`` when pinned, else 0.
    setup_report : a :class:`hicache.pools.host_memory.SetupReport`: threads, seconds to populate the
        pages and to pin them.

    Examples
    --------
    >>> import torch
    >>> dev = DeviceKVPool(num_slots=16, num_layers=2, head_num=1, head_dim=16, dtype=torch.float16,
    ...                    device="cpu", page_size=4, mla=True)
    >>> host = HostKVPool(dev, layout="page_first", ratio=2.5)
    >>> host.size, tuple(host.buffer.shape)
    (40, (40, 2, 1, 16))
    >>> slots = host.alloc(4)
    >>> host.mark_writing(slots); host.mark_synced(slots); host.free(slots)
    """

    def __init__(
        self,
        device_pool: DeviceKVPool,
        *,
        layout: str = "page_first",
        ratio: float | None = 2.0,
        size_gb: float | None = None,
        pin_memory: bool | None = None,
        safety_margin_gb: float = 2.0,
        mem_available_bytes: int | None = None,
        setup: host_memory.HostSetup | None = None,
        num_slots: int | None = None,
    ) -> None:
        if not isinstance(device_pool, DeviceKVPool):
            raise TypeError(f"device_pool: expected a DeviceKVPool, got {type(device_pool).__name__}")
        layouts.check_layout(layout, device_pool.mla)
        self.device_pool = device_pool
        self.layout = layout
        self.mla = device_pool.mla
        self.page_size = device_pool.page_size
        self.num_layers = device_pool.num_layers
        self.head_num = device_pool.head_num
        self.head_dim = device_pool.head_dim
        self.dtype = device_pool.dtype
        self.item_bytes = device_pool.item_bytes
        per_slot = device_pool.bytes_per_slot

        if num_slots is not None:
            arg = "num_slots"
            if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
                raise ValueError(f"num_slots: expected a positive int, got {num_slots!r}")
            size = num_slots
        elif size_gb is not None:
            arg = "size_gb"
            if not size_gb > 0:
                raise ValueError(f"size_gb: expected a positive size in GiB, got {size_gb!r}")
            size = int(size_gb * _GIB) // per_slot
        elif ratio is not None:
            arg = "ratio"
            if not ratio > 0:
                raise ValueError(f"ratio: expected a positive host/device slot ratio, got {ratio!r}")
            size = int(device_pool.size * ratio)
        else:
            raise ValueError("size_gb / ratio: give one (size_gb wins when both are given)")
        size -= size % self.page_size
        if size <= device_pool.size:
            raise ValueError(
                f"{arg}: host pool ({size} slots) must be larger than the device pool ({device_pool.size} slots)"
            )
        if safety_margin_gb < 0:
            raise ValueError(f"safety_margin_gb: expected a non-negative margin, got {safety_margin_gb!r}")
        if pin_memory is None:
            pin_memory = device_pool.device.type == "cuda"
        pin_memory = bool(pin_memory)
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory: pinning needs CUDA (torch.cuda.is_available() is False)")
        # What the allocation really takes (pinned memory comes in whole OS pages), not the pool's bytes.
        need = host_memory.allocated_bytes(size * per_slot, pin_memory)
        available = host_memory.mem_available_bytes() if mem_available_bytes is None else int(mem_available_bytes)
        if available is not None and need > available - safety_margin_gb * _GIB:
            pinned = f", {need} bytes pinned in whole {host_memory.PAGE_BYTES}-byte pages" if pin_memory else ""
            raise ValueError(
                f"{arg}: host pool of {need / _GIB:.2f} GiB ({size} slots x {per_slot} bytes{pinned}) does not fit "
                f"in available RAM {available / _GIB:.2f} GiB minus the safety margin {safety_margin_gb:.2f} GiB"
            )

        shape = layouts.host_shape(
            layout,
            mla=self.mla,
            num_layers=self.num_layers,
            num_slots=size,
            page_size=self.page_size,
            head_num=self.head_num,
            head_dim=self.head_dim,
        )
        if setup is not None and not isinstance(setup, host_memory.HostSetup):
            raise TypeError(f"setup: expected a host_memory.HostSetup or None, got {type(setup).__name__}")
        self.buffer, self.setup_report = host_memory.make_host(
            shape, self.dtype, pin=pin_memory, device=device_pool.device, setup=setup
        )
        self.allocated_bytes = need
        self.pinned_bytes = need if pin_memory else 0
        self.pinned = pin_memory
        self.size = size
        self._slots = _PagedSlots(size, self.page_size)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one token slot takes across all layers (K and V, or the latent)."""
        return self.device_pool.bytes_per_slot

    @property
    def total_bytes(self) -> int:
        """Bytes of ``buffer``."""
        return self.size * self.bytes_per_slot

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` slots as whole pages, in state ``RESERVED``.

        ``num_tokens`` must be a non-negative multiple of ``page_size``. Returns an int64 CPU tensor
        (each page's slots consecutive), or ``None`` with nothing allocated when too few are free.
        """
        return self._slots.alloc(num_tokens)

    def mark_writing(self, slots: torch.Tensor) -> None:
        """``RESERVED -> WRITING``: a backup into ``slots`` is about to be issued."""
        self._slots.transition(_HOST_MARK_WRITING, slots)

    def mark_synced(self, slots: torch.Tensor) -> None:
        """``WRITING -> SYNCED`` (backup done) or ``LOADING -> SYNCED`` (load-back done, or failed: a load
        only reads the host slots, so their data stays valid)."""
        self._slots.transition(_HOST_MARK_SYNCED, slots)

    def mark_filled(self, slots: torch.Tensor) -> None:
        """``RESERVED -> SYNCED``: ``slots`` were written outside the controller (a storage read that
        completed) and now hold valid data."""
        self._slots.transition(_HOST_MARK_FILLED, slots)

    def abort_write(self, slots: torch.Tensor) -> None:
        """``WRITING -> RESERVED``: the backup into ``slots`` failed or was dropped, so they hold no valid
        data; the owner frees them (or retries)."""
        self._slots.transition(_HOST_ABORT_WRITE, slots)

    def mark_loading(self, slots: torch.Tensor) -> None:
        """``SYNCED -> LOADING``: a load-back from ``slots`` is about to be issued."""
        self._slots.transition(_HOST_MARK_LOADING, slots)

    def free(self, slots: torch.Tensor) -> None:
        """``RESERVED / SYNCED -> FREE`` for whole allocated pages.

        A slot with a transfer in flight (``WRITING`` / ``LOADING``) cannot be freed: the copy engine or
        kernel may still be touching it.
        """
        self._slots.transition(_HOST_FREE, slots)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (``page_size`` slots, all layers, K and V or the latent): a page object's size."""
        return self.page_size * self.bytes_per_slot

    @property
    def geometry(self) -> layouts.HostGeometry:
        """The byte strides of ``buffer`` (:func:`hicache_kernels.layouts.host_geometry`), computed once."""
        g = getattr(self, "_geometry", None)
        if g is None:
            g = self._geometry = layouts.host_geometry(
                self.layout,
                mla=self.mla,
                num_layers=self.num_layers,
                num_slots=self.size,
                page_size=self.page_size,
                head_num=self.head_num,
                head_dim=self.head_dim,
                elem_bytes=self.dtype.itemsize,
            )
        return g

    def _page_pattern(self) -> tuple[tuple[int, int], ...]:
        """The byte ranges of page 0 relative to ``buffer``'s start, sorted and with adjacent ranges merged.

        Every layout is affine in the page (see :mod:`hicache_kernels.layouts`), so page ``p``'s ranges are
        these shifted by ``p * page_stride``; computed once from the layout geometry."""
        pattern = getattr(self, "_pattern", None)
        if pattern is None:
            g = self.geometry
            kv = np.arange(g.num_kv, dtype=np.int64)[:, None, None, None] * g.s_kv
            layer = np.arange(g.num_layers, dtype=np.int64)[None, :, None, None] * g.s_layer
            n = np.arange(self.page_size, dtype=np.int64)  # slots of page 0 in the layout's addressing
            slot = ((n // g.page_size) * g.s_page + (n % g.page_size) * g.s_in_page)[None, None, :, None]
            chunk = np.arange(g.num_chunks, dtype=np.int64)[None, None, None, :] * g.s_chunk
            starts = np.sort((kv + layer + slot + chunk).reshape(-1))
            merged: list[list[int]] = []
            for start in starts.tolist():
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1][1] += g.chunk_bytes
                else:
                    merged.append([start, g.chunk_bytes])
            pattern = tuple((a, b) for a, b in merged)
            # Page p starts where slot p * page_size does: the layout's page stride per pool page.
            self._page_stride = (self.page_size // g.page_size) * g.s_page
            self._pattern = pattern
        return pattern

    def page_ranges(self, slots: torch.Tensor) -> list[list[tuple[int, int]]]:
        """The memory of each page of ``slots`` as ``(address, nbytes)`` ranges inside ``buffer``.

        This is a page *object* as the storage tier reads and writes it in place: its ranges in address
        order, adjacent ones merged, ``page_bytes`` in all. How many ranges a page has follows the layout:
        ``page_first``, ``page_first_direct`` and ``page_head`` have one contiguous range per K/V (two for
        MHA, one for MLA), ``layer_first`` one per K/V and layer.

        Parameters
        ----------
        slots : int tensor of whole pages, each page's ``page_size`` slots consecutive and in order
            starting at a multiple of ``page_size`` (as :meth:`alloc` returns them); any slot state.

        Returns
        -------
        One list of ranges per page, in the order of ``slots``. The addresses stay valid while the pool
        lives (``buffer`` is never reallocated). ``ValueError`` when ``slots`` are not whole aligned
        pages inside the pool; ``TypeError`` when not a 1-D integer tensor.
        """
        pages = self.page_indices(slots)
        pattern = self._page_pattern()
        base = self.buffer.data_ptr()
        stride = self._page_stride
        return [[(base + p * stride + off, n) for off, n in pattern] for p in pages]

    def page_indices(self, slots: torch.Tensor) -> list[int]:
        """The pool page of each page of ``slots`` (page ``p`` is slots ``[p * page_size, (p + 1) *
        page_size)``), in order, with :meth:`page_ranges`' checks and errors."""
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"page_ranges: slots: expected a torch.Tensor, got {type(slots).__name__}")
        if slots.dtype == torch.bool or slots.is_floating_point() or slots.is_complex() or slots.dim() != 1:
            raise TypeError(
                f"page_ranges: slots: expected a 1-D integer tensor, got {slots.dtype} of shape {tuple(slots.shape)}"
            )
        s = slots.detach().cpu().numpy().astype(np.int64, copy=False)
        ps = self.page_size
        if s.size % ps:
            raise ValueError(f"page_ranges: {s.size} slots are not whole pages of {ps} slots")
        if s.size and (s.min() < 0 or s.max() >= self.size):
            raise ValueError(f"page_ranges: slot(s) out of range [0, {self.size})")
        rows = s.reshape(-1, ps)
        first = rows[:, :1]
        bad = np.flatnonzero((first[:, 0] % ps != 0) | np.any(rows != first + np.arange(ps), axis=1))
        if bad.size:
            raise ValueError(
                f"page_ranges: page(s) at position {_fmt_slots(bad)} are not page-aligned runs of {ps} consecutive "
                f"slots (page p is slots [p*{ps}, (p+1)*{ps}))"
            )
        return (first[:, 0] // ps).tolist()

    def state(self, slots: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 tensor of the :class:`SlotState` of each of ``slots`` (default: every slot); a copy."""
        return self._slots.states("state", slots)

    def available_size(self) -> int:
        """Free token slots."""
        return self._slots.available_size()

    def __repr__(self) -> str:
        return (
            f"HostKVPool({'MLA' if self.mla else 'MHA'}, {self.layout}, size={self.size}, "
            f"page_size={self.page_size}, {self.dtype}, {self.total_bytes / _GIB:.3f} GiB, "
            f"{f'pinned {self.pinned_bytes} bytes' if self.pinned else 'pageable'})"
        )
