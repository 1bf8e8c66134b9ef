"""What the storage tier stores for a host page: :class:`StoredObjects`, the objects of a page and where
their bytes are.

MLA pool
    One object per page: the page's bytes in the order of its memory ranges in the host pool (the
    same on every TP rank; rank 0 writes). The host layout is in the namespace.
MHA pool
    One object per *(page, head group)*: a group is ``head_group`` consecutive K/V heads of the model
    (group ``g`` holds the model's heads ``[g * head_group, (g + 1) * head_group)``, counted over all
    TP ranks). Its bytes are head-major, ``[K|V, head of the group, token of the page, layer, head_dim]``
    (the order of the ``page_head`` layout), whatever the host layout and the TP size: a rank stores and
    reads the groups of its own heads, so deployments of one model with different TP sizes (and host
    layouts) read each other's pages. ``head_group`` must divide each rank's head count.

How the bytes move
    Where an object is at most two runs of the host pool's memory (``page_head``; any layout with one
    head per rank and group), the backend reads and writes the host pages in place (zero copy).
    Otherwise (``page_first``, ``page_first_direct``, ``layer_first`` with several heads a rank) the
    tier copies each batch through a *staging area*: a backup gathers the pages' heads into it before
    the backend writes, a prefetch scatters what the backend read into the host pages after. Each of
    the tier's two I/O threads has its own area of :attr:`StoredObjects.stage_pages` pages; the areas
    are :attr:`StoredObjects.extra_buffers` (a backend that registers memory registers them too).

The backend sees this object in place of the host pool (``backend.attach(objects)``): ``page_ranges``
gives each object's memory, ``page_bytes`` one object's size, ``buffer`` the host pool's buffer.
Slots passed to the backend are host slots (zero copy) or, in staged mode, *staging slots* numbered
from ``host_pool.size`` up.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["STAGE_BYTES", "StoredObjects", "group_key"]

# Bytes of one staging area (one per I/O thread), at least one page.
STAGE_BYTES = 64 << 20
_ALIGN = 4096  # staging areas start page-aligned (direct I/O wants aligned memory)
AREAS = ("backup", "prefetch")


def group_key(page_key: str, group: int) -> str:
    """The key of head group ``group`` (counted over the model's heads) of the page keyed ``page_key``."""
    return hashlib.sha256(bytes.fromhex(page_key) + b"heads" + int(group).to_bytes(4, "little")).hexdigest()


class StoredObjects:
    """The stored objects of ``host_pool``'s pages on one TP rank (module docstring).

    Parameters
    ----------
    host_pool : the cache's :class:`~hicache.pools.HostKVPool`.
    tp_rank, tp_size : this rank's shard of the model's K/V heads (``host_pool.head_num`` each).
    head_group : heads per stored object (MHA); must divide ``host_pool.head_num``. Ignored for MLA.
    stage_bytes : the most bytes of each staging area (staged mode only; at least one page).
    max_pages : the most pages a batch moves (the tier's ``batch_pages``): a staging area holds no more.

    Attributes
    ----------
    objects_per_page : objects a rank stores per page (its head groups; 1 for MLA).
    first_group : the model-wide index of this rank's first head group.
    page_bytes : bytes of one object.
    zero_copy : whether the backend moves objects straight from and to the host pages.
    stage_pages : pages per staging area (0 when zero copy).
    """

    def __init__(
        self,
        host_pool: Any,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        head_group: int = 1,
        stage_bytes: int = STAGE_BYTES,
        max_pages: int = 128,
        sidecars: Sequence[Any] = (),
        window: Any = None,
    ) -> None:
        if isinstance(head_group, bool) or not isinstance(head_group, int) or head_group < 1:
            raise ValueError(f"head_group: expected a positive int, got {head_group!r}")
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.mla = bool(host_pool.mla)
        self.buffer = host_pool.buffer
        self.sidecars = tuple(sidecars)
        self.extra_buffers: tuple[torch.Tensor, ...] = tuple(s.buffer for s in self.sidecars)
        self.stage_pages = 0
        side_bytes = sum(s.page_bytes for s in self.sidecars)
        if window is not None and self.mla:
            raise ValueError("window: sliding-window rows are stored with MHA pages only")
        if self.mla:
            self.head_group = 0
            self.objects_per_page, self.first_group = 1, 0
            # A page's object: the KV page, then each sidecar's rows of the page.
            self.page_bytes = host_pool.page_bytes + side_bytes
            self.zero_copy = True
            return
        heads = host_pool.head_num
        if heads % head_group:
            raise ValueError(
                f"head_group: {head_group} heads per stored object do not divide this rank's {heads} K/V heads "
                f"(the model's {heads * tp_size} over TP={tp_size}); choose a divisor of {heads}"
            )
        self.head_group = head_group
        self.objects_per_page = heads // head_group
        self.first_group = tp_rank * self.objects_per_page
        g = host_pool.geometry
        self._row_bytes = host_pool.head_dim * host_pool.dtype.itemsize  # one head of one token and layer
        offsets, slot, self._page_stride = _group_offsets(host_pool, head_group, self.objects_per_page)
        runs = [_runs(o, self._row_bytes) for o in offsets]
        self.zero_copy = all(len(r) <= 2 for r in runs)
        self._window = window
        window_bytes = 0
        if window is not None:  # each group's object: its heads' window rows and the page's rows flag, last
            w_offsets, _, self._w_stride = _group_offsets(window.host, head_group, self.objects_per_page)
            self._w_pattern = [_runs(o, self._row_bytes) for o in w_offsets]
            if not self.zero_copy or any(len(r) > 2 for r in self._w_pattern):
                raise ValueError(
                    f"window: a storage tier stores window rows only where a head group's object is read in "
                    f"place (layout page_head, or page_first with one head a group), not {host_pool.layout} "
                    f"with {head_group} heads a group"
                )
            window_bytes = w_offsets.shape[1] * self._row_bytes + 1
            self.extra_buffers += (window.host.buffer, window.host_flags)
        if self.sidecars and not self.zero_copy:
            raise ValueError(
                f"sidecars: a storage tier stores sidecar rows with MHA pages only where a head group's object is "
                f"read in place (layout page_head, or page_first with one head a group); {host_pool.layout} with "
                f"{head_group} heads a group needs staging"
            )
        # Each head group's object: its K/V rows, then every sidecar's rows of the page (the same bytes in
        # every group's object, so a rank of any TP size finds them in the objects it reads).
        self.page_bytes = offsets.shape[1] * self._row_bytes + side_bytes + window_bytes
        if self.zero_copy:
            self._pattern = runs
            return
        # Staged: a page's objects are one strided view of the pool (every layout is affine in the token
        # inside a page), copied to and from a staging page in stored order, in the widest element that
        # divides a row.
        s_n = g.s_page if g.page_size == 1 else g.s_in_page
        assert np.array_equal(slot.reshape(-1), np.arange(self.page_size) * s_n), "a layout not affine in a page"
        elem = next(e for e in (8, 4, 2, 1) if self._row_bytes % e == 0)
        h_b = g.s_chunk if g.num_chunks > 1 else self._row_bytes
        self._view = (
            (self.objects_per_page, 2, head_group, self.page_size, g.num_layers, self._row_bytes // elem),
            tuple(x // elem for x in (head_group * h_b, g.s_kv, h_b, s_n, g.s_layer)) + (1,),
        )
        self._elem_stride = self._page_stride // elem
        page_total = self.objects_per_page * self.page_bytes
        self.stage_pages = max(1, min(int(max_pages), int(stage_bytes) // page_total))
        area = self.stage_pages * page_total
        raw = torch.empty(len(AREAS) * area + _ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % _ALIGN
        self._stage = raw[skip : skip + len(AREAS) * area]
        self.extra_buffers = (self._stage,)
        dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[elem]
        self._flat = self.buffer.view(-1).view(torch.uint8).view(dtype)
        self._stage_pages = self._stage.view(dtype).view(len(AREAS), self.stage_pages, *self._view[0])

    # -- keys ----------------------------------------------------------------------------------------
    def keys(self, page_keys: Sequence[str]) -> list[str]:
        """The object keys of pages keyed ``page_keys``, page by page (MLA: the page keys)."""
        if self.mla:
            return list(page_keys)
        groups = range(self.first_group, self.first_group + self.objects_per_page)
        return [group_key(k, g) for k in page_keys for g in groups]

    # -- memory --------------------------------------------------------------------------------------
    def page_ranges(self, slots: torch.Tensor) -> list[list[tuple[int, int]]]:
        """Each object's memory as ``(address, nbytes)`` ranges, for the pages of ``slots`` (host slots,
        or staging slots from :meth:`store_slots`), page by page, ``objects_per_page`` each."""
        if self.mla:
            pages = self.host_pool.page_ranges(slots)
            for side in self.sidecars:
                pages = [a + b for a, b in zip(pages, side.page_ranges(slots), strict=True)]
            return pages
        size, ps = self.host_pool.size, self.page_size
        if not self.zero_copy:  # staging slots (store_slots): one run per object
            if not len(slots):
                return []
            if int(slots.min()) < size:
                raise ValueError("page_ranges: staged objects are read and written through staging slots")
            first = (slots.view(-1, ps)[:, 0] - size) // ps
            if int(first.max()) >= len(AREAS) * self.stage_pages:
                raise ValueError(f"page_ranges: staging slot(s) past the {len(AREAS)} staging areas")
            area_pages = self.stage_pages
            base = self._stage.data_ptr()
            out = []
            for q in first.tolist():
                a, i = divmod(q, area_pages)
                start = base + (a * area_pages + i) * self.objects_per_page * self.page_bytes
                out += [[(start + k * self.page_bytes, self.page_bytes)] for k in range(self.objects_per_page)]
            return out
        base = self.buffer.data_ptr()
        side: list[list[tuple[int, int]]] = [[] for _ in range(len(slots) // ps)]
        for s in self.sidecars:  # a read writes them once per object of the page: the same bytes each time
            side = [a + b for a, b in zip(side, s.page_ranges(slots), strict=True)]
        out = []
        w = self._window
        for p, rows in zip(self.host_pool.page_indices(slots), side, strict=True):
            start = base + p * self._page_stride
            if w is None:
                out += [[(start + off, n) for off, n in obj] + rows for obj in self._pattern]
                continue
            w_start = w.host.buffer.data_ptr() + p * self._w_stride
            flag = [(w.host_flags.data_ptr() + p, 1)]  # the page's rows flag, last
            out += [[(start + off, n) for off, n in obj] + rows + [(w_start + off, n) for off, n in wobj] + flag
                    for obj, wobj in zip(self._pattern, self._w_pattern, strict=True)]  # fmt: skip
        return out

    def store_slots(self, area: str, host_slots: torch.Tensor) -> torch.Tensor:
        """The slots the backend moves the objects of ``host_slots``' pages through: ``host_slots`` when
        zero copy, else the first pages of staging area ``area`` (at most :attr:`stage_pages` pages)."""
        if self.zero_copy:
            return host_slots
        pages = len(host_slots) // self.page_size
        if pages > self.stage_pages:
            raise ValueError(f"host_slots: {pages} pages, more than the staging area's {self.stage_pages}")
        first = self.host_pool.size + AREAS.index(area) * self.stage_pages * self.page_size
        return torch.arange(first, first + len(host_slots), dtype=torch.int64)

    def _page_view(self, page: int) -> torch.Tensor:
        """Pool page ``page``'s objects as a strided view of the pool, in stored order."""
        size, stride = self._view
        return self._flat.as_strided(size, stride, self._flat.storage_offset() + page * self._elem_stride)

    def gather(self, area: str, host_slots: torch.Tensor) -> torch.Tensor:
        """Before a write: copy the pages of ``host_slots`` into staging area ``area`` in stored order;
        returns the slots to hand the backend (:meth:`store_slots`). Zero copy: ``host_slots``."""
        slots = self.store_slots(area, host_slots)
        if not self.zero_copy and len(host_slots):
            stage = self._stage_pages[AREAS.index(area)]
            for q, page in enumerate(self.host_pool.page_indices(host_slots)):
                stage[q].copy_(self._page_view(page))
        return slots

    def scatter(self, area: str, host_slots: torch.Tensor) -> None:
        """After a read: copy what staging area ``area`` holds into the pages of ``host_slots`` (those
        the backend read; their objects in the area's first pages). Zero copy: nothing to do."""
        if not self.zero_copy and len(host_slots):
            self.store_slots(area, host_slots)  # at most a staging area's pages
            pages = self.host_pool.page_indices(host_slots)
            stage = self._stage_pages[AREAS.index(area)]
            for q, page in enumerate(pages):
                self._page_view(page).copy_(stage[q])


def _group_offsets(pool: Any, head_group: int, groups: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Byte offsets of the rows (one head of one token and layer) of ``pool``'s page 0 objects in stored
    order ``[group, K|V, head, token, layer]`` (``[groups, rows]``), the token offsets, and the page stride."""
    g = pool.geometry
    row = pool.head_dim * pool.dtype.itemsize
    kv = np.arange(2)[None, :, None, None, None] * g.s_kv
    head = np.arange(groups * head_group).reshape(groups, 1, head_group, 1, 1)
    head = head * (g.s_chunk if g.num_chunks > 1 else row)
    n = np.arange(pool.page_size)
    slot = ((n // g.page_size) * g.s_page + (n % g.page_size) * g.s_in_page)[None, None, None, :, None]
    layer = np.arange(g.num_layers)[None, None, None, None, :] * g.s_layer
    offsets = (kv + head + slot + layer).reshape(groups, -1)
    return offsets, slot, (pool.page_size // g.page_size) * g.s_page


def _runs(offsets: np.ndarray, nbytes: int) -> list[tuple[int, int]]:
    """``(start, length)`` runs of ``nbytes``-long pieces at ``offsets``, in order, adjacent ones merged."""
    out: list[list[int]] = []
    for start in offsets.tolist():
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += nbytes
        else:
            out.append([start, nbytes])
    return [(a, b) for a, b in out]
