"""The K/V of a model's sliding-window layers, kept only for the tokens some window still needs
(:class:`WindowKVPool`).

A sliding-window layer reads only the last ``window`` tokens' K/V, so a cache that kept those layers'
K/V for every token would spend most of their memory on rows nobody reads again. This pool holds the
windowed layers in a device pool of its own, usually much smaller than the KV pool of the full
layers, with its own page allocator, keyed by the KV pool's pages: a KV page has window rows (a page
here) or has none (the window moved past it: a "tombstone", as SGLang's SWA radix cache calls it).
The KV pool's slot numbering stays the only one the tree knows:

- a request gives its pages window rows when it computes them (:meth:`WindowKVPool.alloc_for`) and,
  when it is cached, keeps them only for its last ``window`` tokens (:meth:`WindowKVPool.trim`);
- freeing a KV page frees its window rows (the KV pool's free listener), so whatever evicts, aborts or
  frees KV lets go of the windows with it;
- a prefix can be resumed at position ``p`` only if the ``window`` tokens before ``p`` all have their
  rows (:meth:`WindowKVPool.usable`): the cache cuts its matches there, so a cached prefix whose window
  is gone stays in the tree, reusable only up to where its windows are whole.

On the host the rows of a backed-up page sit in a host pool sharing the host KV pool's slot numbering
(:meth:`WindowKVPool.attach_host`), with a flag byte per host page saying whether its rows came along
(they do when the device page had them at the backup). A storage tier stores both with the page (each
head group's object carries its heads' rows and the flag), so a page read back from the store says
whether it has rows. Thread-safe for the cache's use: the maps change on
the scheduler's thread; the copies read what was decided when they were queued.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .device_pool import DeviceKVPool, _positive_int
from .host_pool import HostKVPool

__all__ = ["WindowKVPool"]


class WindowKVPool:
    """Device (and host) rows of the sliding-window layers, per KV page (module docstring).

    Parameters
    ----------
    kv_pool : the full layers' :class:`DeviceKVPool`; its pages key this pool's, its head geometry,
        dtype, device and page size are this pool's.
    num_slots : window token slots on the device (a multiple of the page size).
    num_layers : the windowed layers.
    window : tokens a windowed layer attends to (the query's own included).

    Attributes
    ----------
    pool : the windowed layers' :class:`DeviceKVPool` (``num_layers`` layers, ``num_slots`` slots).
    host : its host pool (after :meth:`attach_host`), sharing the host KV pool's slots; ``None`` before.
    window, page_size : as given.
    """

    def __init__(self, kv_pool: DeviceKVPool, *, num_slots: int, num_layers: int, window: int) -> None:
        if not isinstance(kv_pool, DeviceKVPool):
            raise TypeError(f"kv_pool: expected a DeviceKVPool, got {type(kv_pool).__name__}")
        if kv_pool.mla:
            raise ValueError("kv_pool: sliding-window layers are served with MHA/GQA pools, not MLA")
        self.window = _positive_int(window, "window")
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.pool = DeviceKVPool(num_slots=num_slots, num_layers=num_layers, head_num=kv_pool.head_num,
                                 head_dim=kv_pool.head_dim, dtype=kv_pool.dtype, device=kv_pool.device,
                                 page_size=kv_pool.page_size, stacked=kv_pool.stacked)  # fmt: skip
        self._lock = threading.Lock()
        # KV page -> window page (-1: none), and the host pages whose backup carried window rows.
        self._page_map = np.full(kv_pool.size // self.page_size, -1, dtype=np.int64)
        self.host: HostKVPool | None = None
        # One byte per host page (1: its backup carried rows): a stored page's object carries its byte.
        self.host_flags = torch.zeros(0, dtype=torch.uint8)
        self._host_rows: np.ndarray = np.zeros(0, dtype=bool)
        kv_pool.add_free_listener(self.trim)

    # ------------------------------------------------------------------ device rows
    def _pages(self, kv_slots: torch.Tensor) -> np.ndarray:
        s = np.asarray(kv_slots.cpu(), dtype=np.int64).reshape(-1)
        if len(s) % self.page_size or (len(s) and (s[:: self.page_size] % self.page_size).any()):
            raise ValueError("kv_slots: expected whole KV pages (page-aligned slots)")
        return s[:: self.page_size] // self.page_size

    def available_pages(self) -> int:
        """Window pages free on the device."""
        return self.pool.available_size() // self.page_size

    def alloc_for(self, kv_slots: torch.Tensor) -> bool:
        """Give the KV pages of ``kv_slots`` (whole pages) that have none window rows; False (nothing
        allocated) when the pool has too few free pages."""
        pages = self._pages(kv_slots)
        with self._lock:
            need = np.unique(pages[self._page_map[pages] < 0])
            if not len(need):
                return True
            got = self.pool.alloc(len(need) * self.page_size)
            if got is None:
                return False
            self._page_map[need] = got[:: self.page_size].numpy() // self.page_size
            return True

    def trim(self, kv_slots: torch.Tensor) -> None:
        """Let go of the window rows of the KV pages of ``kv_slots`` (those that have any)."""
        pages = self._pages(kv_slots)
        with self._lock:
            mapped = np.unique(pages[self._page_map[pages] >= 0])
            if not len(mapped):
                return
            first = self._page_map[mapped] * self.page_size
            self._page_map[mapped] = -1
        offsets = np.arange(self.page_size, dtype=np.int64)
        self.pool.free(torch.from_numpy((first[:, None] + offsets).reshape(-1)))

    def adopt(self, from_slots: torch.Tensor, to_slots: torch.Tensor) -> int:
        """Move the window rows of ``from_slots``' pages to ``to_slots``' pages (page for page, whole
        pages, the same tokens at the same positions: a request's copy of pages the tree already held)
        where the ``to`` page has none; returns the pages moved. No data moves: the rows change owner."""
        src, dst = self._pages(from_slots), self._pages(to_slots)
        if len(src) != len(dst):
            raise ValueError(f"to_slots: {len(dst)} pages for {len(src)} pages of from_slots")
        with self._lock:
            move = (self._page_map[src] >= 0) & (self._page_map[dst] < 0) & (src != dst)
            self._page_map[dst[move]] = self._page_map[src[move]]
            self._page_map[src[move]] = -1
            return int(move.sum())

    def has_rows(self, kv_slots: torch.Tensor) -> np.ndarray:
        """Per KV page of ``kv_slots`` (whole pages), whether it has window rows on the device."""
        return self._page_map[self._pages(kv_slots)] >= 0

    def slots(self, kv_slots: torch.Tensor) -> torch.Tensor:
        """The window slots of ``kv_slots`` (any slots, one per token; their pages must have rows:
        ``ValueError`` naming the first that has none)."""
        s = kv_slots.to(torch.int64).cpu()
        wp = torch.from_numpy(self._page_map)[s // self.page_size]
        if len(wp) and int(wp.min()) < 0:
            bad = int(s[wp < 0][0])
            raise ValueError(f"kv_slots: slot {bad}'s page has no window rows (its window moved past it)")
        return wp * self.page_size + s % self.page_size

    def usable(self, present: np.ndarray) -> int:
        """The longest prefix, in tokens, whose last ``window - 1`` tokens (what the first query resumed
        after it reads) all have rows, given ``present``
        (a bool per page of the prefix, in order): a prefix resumed there finds its window whole."""
        n = len(present)
        if not n or present.all():
            return n * self.page_size
        missing = np.concatenate([[0], np.cumsum(~present)])  # missing pages before page k
        # A query resumed at position p reads the window - 1 tokens before it: the pages they span.
        need = -(-(self.window - 1) // self.page_size)
        ends = np.arange(n, -1, -1)  # candidate lengths in pages, longest first
        ok = missing[ends] - missing[np.maximum(ends - need, 0)] == 0
        return int(ends[np.argmax(ok)]) * self.page_size  # ends[-1] = 0 is always usable

    # ------------------------------------------------------------------ host rows
    def attach_host(self, host_kv: HostKVPool) -> HostKVPool:
        """Make the host pool of the window rows: ``host_kv``'s slot count, layout and pinning."""
        if self.host is not None:
            raise ValueError("host_kv: this window pool has its host pool already")
        self.host = HostKVPool(self.pool, layout=host_kv.layout, num_slots=host_kv.size, pin_memory=host_kv.pinned,
                               safety_margin_gb=0.0)  # fmt: skip
        self.host_flags = torch.zeros(host_kv.size // self.page_size, dtype=torch.uint8)
        self._host_rows = self.host_flags.numpy().view(bool)  # the same bytes
        return self.host

    def host_has_rows(self, host_slots: torch.Tensor) -> np.ndarray:
        """Per host page of ``host_slots`` (whole pages), whether its backup carried window rows."""
        return self._host_rows[self._pages_host(host_slots)]

    def _pages_host(self, host_slots: torch.Tensor) -> np.ndarray:
        return np.asarray(host_slots.cpu(), dtype=np.int64).reshape(-1)[:: self.page_size] // self.page_size

    def plan_backup(self, kv_slots: torch.Tensor, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A backup of KV ``kv_slots`` into host ``host_slots`` is queued: ``(window slots, host slots)``
        of its pages that have window rows (copied with it), and the host pages flagged accordingly."""
        present = self.has_rows(kv_slots)
        self._host_rows[self._pages_host(host_slots)] = present
        return self._select(kv_slots, host_slots, present)

    def plan_load(self, kv_slots: torch.Tensor, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A load-back of host ``host_slots`` into KV ``kv_slots`` starts: ``(window slots, host slots)``
        of its pages whose host copy has rows and whose device page was given rows (:meth:`alloc_for`)."""
        present = self.host_has_rows(host_slots) & self.has_rows(kv_slots)
        return self._select(kv_slots, host_slots, present)

    def _select(self, kv_slots: torch.Tensor, host_slots: torch.Tensor, pages: np.ndarray) -> tuple:
        keep = torch.from_numpy(np.repeat(pages, self.page_size))
        kv = kv_slots.cpu()[keep]
        return self.slots(kv), host_slots.cpu()[keep]

    def check(self) -> None:
        """``AssertionError`` naming the first broken invariant: each window page is given to at most one
        KV page, only allocated KV pages have rows, and every allocated window page is given to one (no
        rows leak)."""
        with self._lock:
            pm = self._page_map.copy()
        mapped = pm[pm >= 0]
        assert len(np.unique(mapped)) == len(mapped), "window pool: a window page given to two KV pages"
        with_rows = np.flatnonzero(pm >= 0)
        held = self.kv_pool.allocated_of(with_rows * self.page_size)
        assert held.all(), f"window pool: free KV pages hold rows: {with_rows[~held][:8].tolist()}"
        allocated = self.pool.size // self.page_size - self.available_pages()
        assert allocated == len(mapped), f"window pool: {allocated} pages allocated, {len(mapped)} given to KV pages"

    def __repr__(self) -> str:
        return (
            f"WindowKVPool(window={self.window}, {self.pool.num_layers} layers, {self.pool.size} slots, "
            f"{self.available_pages()} pages free)"
        )
