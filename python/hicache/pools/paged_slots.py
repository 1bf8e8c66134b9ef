"""The page-aligned slot allocator both KV pools share, with the per-slot states the host pool's
copies move through (see :mod:`hicache.pools` for the state machine). Thread-safe; every state change
checks all given slots first and changes nothing when any is wrong."""

from __future__ import annotations

import threading
from collections.abc import Callable
from enum import IntEnum

import numpy as np
import torch

from ..native import core_attr

__all__ = ["SlotState"]

_SHOW = 4  # slots listed in an error message before "..."


class SlotState(IntEnum):
    """State of one host slot (the device pool uses only ``FREE`` and ``RESERVED``, "allocated")."""

    FREE = 0
    RESERVED = 1  # allocated, holds no valid data yet
    WRITING = 2  # a backup (device -> host) into it is in flight
    SYNCED = 3  # holds valid data
    LOADING = 4  # a load-back (host -> device) from it is in flight; data stays valid


_FREE, _RESERVED = np.uint8(SlotState.FREE), np.uint8(SlotState.RESERVED)  # plain numpy scalars: no enum per call
_RESERVED_INT = int(SlotState.RESERVED)


def _compiled_page_stack(stack: np.ndarray, states: np.ndarray, ever: np.ndarray, page_size: int):
    """``hicache._core.PageStack`` over the pool's arrays, or None when the host core is not built
    (:func:`hicache.native.core_status` says why)."""
    page_stack = core_attr("PageStack")
    return None if page_stack is None else page_stack(stack, states, ever, page_size)


def _mask(states: tuple[SlotState, ...]) -> int:
    m = 0
    for st in states:
        m |= 1 << int(st)
    return m


class Transition:
    """One state change of a pool's slots, made once (module constants of :mod:`hicache.pools`): the
    method it serves (named in errors), the states it moves from and to, the reason named for each wrong
    state, whether it takes whole pages only; and what the compiled call takes (a bit mask of the
    sources, the target as an int, whether the slots' pages go back to the free stack)."""

    __slots__ = ("method", "sources", "target", "reasons", "whole_pages", "mask", "target_int", "push")

    def __init__(
        self,
        method: str,
        sources: tuple[SlotState, ...],
        target: SlotState,
        reasons: dict[SlotState, str],
        whole_pages: bool = False,
    ) -> None:
        self.method, self.sources, self.target, self.reasons = method, sources, target, reasons
        self.whole_pages = whole_pages
        self.mask, self.target_int, self.push = _mask(sources), int(target), target == SlotState.FREE


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def _fmt_slots(slots: np.ndarray) -> str:
    head = ", ".join(str(int(s)) for s in slots[:_SHOW])
    return f"[{head}]" if slots.size <= _SHOW else f"[{head}, ...] ({slots.size} slots)"


class _PagedSlots:
    """Page allocator + per-slot state array shared by both pools (not public).

    Free pages live in a numpy array used as a stack (``_stack[:_num_free]``, top at the end), so
    alloc and free move whole batches of pages with slicing instead of per-page Python loops. The
    invariant: a page is on the stack iff all its slots are ``FREE``. Alloc and every transition of
    whole pages in order update the states through a ``[pages, page_size]`` view (one index per page)
    and check repeats in O(n) with a scratch array instead of sorting (``np.unique``), which only the
    general path of :meth:`transition` (any slots, or whole pages given out of order) still does.
    """

    def __init__(self, size: int, page_size: int) -> None:
        self.size = size
        self.page_size = page_size
        num_pages = size // page_size
        # Reversed, so the first allocations come out as pages 0, 1, 2, ...: ascending runs of slots,
        # which the copy-engine backends merge into fewer copies.
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = num_pages
        self._states = np.zeros(size, dtype=np.uint8)
        self._ever = np.zeros(size, dtype=bool)  # allocated at least once: tells a double free from a stray one
        self._offsets = np.arange(page_size, dtype=np.int64)
        # Per-page views for page-granular updates, and the scratch of the O(n) repeat check on pages.
        self._page_states = self._states.reshape(num_pages, page_size)
        self._page_ever = self._ever.reshape(num_pages, page_size)
        self._scratch = np.empty(num_pages, dtype=np.int32 if num_pages < 2**31 else np.int64)
        self._index = np.arange(num_pages, dtype=self._scratch.dtype)
        self._lock = threading.Lock()
        # alloc's pops and the usual transitions in one compiled call each when the host core is built
        # (the same result as the numpy paths below, which tests also run): the scheduler allocates,
        # frees and moves host slots through their states several times per request.
        core = _compiled_page_stack(self._stack, self._states, self._ever, page_size)
        self._pop = None if core is None else core.pop
        self._move = None if core is None else core.transition
        self._set_owned = None if core is None else core.set_owned

    def set_owned(self, arrays: list[np.ndarray]) -> None:
        """The owners' slot flags (bool, one per slot; an owner holds whole pages) that a transition
        with a ``guard`` checks in its compiled path: a page an owner holds goes to the general path,
        where the guard names it."""
        if self._set_owned is not None:
            with self._lock:
                self._set_owned(arrays)

    def available_size(self) -> int:
        with self._lock:
            return self._num_free * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise ValueError(f"num_tokens: expected an int, got {type(num_tokens).__name__}")
        if num_tokens < 0 or num_tokens % self.page_size:
            raise ValueError(
                f"num_tokens: expected a non-negative multiple of page_size {self.page_size}, got {num_tokens}"
            )
        need = int(num_tokens) // self.page_size
        with self._lock:
            top = self._num_free
            if need > top:
                return None
            self._num_free = top - need
            if self._pop is not None:
                return torch.from_numpy(self._pop(top, need, _RESERVED_INT))
            pages = self._stack[top - need : top][::-1]
            # Page-indexed updates: one index per page, not per slot.
            self._page_states[pages] = _RESERVED
            self._page_ever[pages] = True
            if self.page_size == 1:
                slots = pages.copy()
            else:
                slots = (pages[:, None] * self.page_size + self._offsets).reshape(-1)
        return torch.from_numpy(slots)

    def _parse(self, method: str, slots: object, whole_pages: bool) -> np.ndarray:
        """Slots as a duplicate-free int64 numpy array inside the pool; ValueError/TypeError otherwise."""
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"{method}: slots: expected a torch.Tensor, got {type(slots).__name__}")
        if slots.dtype == torch.bool or slots.is_floating_point() or slots.is_complex():
            raise TypeError(f"{method}: slots: expected an integer tensor, got {slots.dtype}")
        if slots.dim() != 1:
            raise ValueError(f"{method}: slots: expected a 1-D tensor, got shape {tuple(slots.shape)}")
        s = slots.detach().cpu().numpy().astype(np.int64, copy=False)  # CUDA slots: one sync
        if s.size == 0:
            return s
        out = (s < 0) | (s >= self.size)
        if out.any():
            raise ValueError(f"{method}: slot(s) {_fmt_slots(s[out])} out of range [0, {self.size})")
        uniq = np.unique(s)
        if uniq.size != s.size:
            _, counts = np.unique(s, return_counts=True)
            raise ValueError(f"{method}: repeated slot(s) {_fmt_slots(uniq[counts > 1])}")
        if whole_pages and self.page_size > 1:
            pages, counts = np.unique(s // self.page_size, return_counts=True)
            partial = pages[counts != self.page_size]
            if partial.size:
                raise ValueError(
                    f"{method}: slots must be whole pages of {self.page_size} slots; partial page(s) "
                    f"{_fmt_slots(partial)} (page p is slots [p*{self.page_size}, (p+1)*{self.page_size}))"
                )
        return s

    def _whole_pages(self, s: np.ndarray) -> np.ndarray | None:
        """The pages of ``s`` when it is whole pages, each in order, none twice (what alloc hands out),
        checked in O(n) without sorting; None when it is anything else (then :meth:`_parse` decides)."""
        ps = self.page_size
        if s.size % ps or np.count_nonzero(s.view(np.uint64) >= self.size):  # negatives wrap to huge
            return None
        if ps == 1:
            pages = s
        else:
            base = s.reshape(-1, ps) - self._offsets  # a page in order reads its first slot in every column
            first = base[:, :1]
            if np.count_nonzero(base != first) or np.count_nonzero(first % ps):
                return None
            pages = base[:, 0] // ps
        idx = self._index[: pages.size]
        self._scratch[pages] = idx  # the last writer of a repeated page wins, so an earlier one reads back
        if np.count_nonzero(self._scratch[pages] != idx):
            return None
        return pages

    def _push(self, pages: np.ndarray) -> None:
        """Put distinct ``pages`` on the free stack, reversed and sorted so the next alloc takes them in
        ascending order."""
        pages = np.sort(pages)
        self._stack[self._num_free : self._num_free + pages.size] = pages[::-1]
        self._num_free += pages.size

    def transition(
        self,
        t: Transition,
        slots: torch.Tensor,
        guard: Callable[[np.ndarray, np.ndarray | None], None] | None = None,
    ) -> None:
        """Move every slot from one of ``t.sources`` to ``t.target``, all or nothing; target FREE
        releases the slots' pages to the free stack.

        The usual input (whole pages, each in order, as alloc hands them out and the tree keeps them)
        takes one compiled call when the host core is built, else O(n) numpy checks and page-indexed
        updates, no sort; anything else, or any wrong state, goes through the full parse, which accepts
        it or names the fault the same way. ``guard(slots, pages)`` is the caller's last check of slots
        that passed these (``pages``: one per page, in order, on the usual input, else None); it raises
        to refuse them, before anything changes (the compiled path checks the owners' flags of
        :meth:`set_owned` instead, and leaves a held page to the general path, where the guard names it)."""
        if type(slots) is torch.Tensor and slots.dtype is torch.int64 and self._move is not None and slots.is_cpu:
            if slots.dim() == 1:
                with self._lock:
                    top = self._move(slots.numpy(), t.mask, t.target_int, t.push, self._num_free, guard is not None)
                    if top >= 0:
                        self._num_free = top
                        return
                self._transition(t, slots, guard, quick=False)  # not the usual input, or refused: names why
                return
        self._transition(t, slots, guard, quick=True)

    def _transition(
        self,
        t: Transition,
        slots: torch.Tensor,
        guard: Callable[[np.ndarray, np.ndarray | None], None] | None,
        quick: bool,
    ) -> None:
        """The numpy paths of :meth:`transition`: the usual input in O(n) (``quick``), else the parse."""
        method, sources, target, reasons, whole_pages = t.method, t.sources, t.target, t.reasons, t.whole_pages
        quick = (
            quick and isinstance(slots, torch.Tensor) and slots.dim() == 1 and slots.dtype in (torch.int64, torch.int32)
        )
        with self._lock:
            if quick:
                s = slots.detach().cpu().numpy().astype(np.int64, copy=False)  # CUDA slots: one sync
                pages = self._whole_pages(s) if s.size else None
                if pages is not None:
                    cur = self._page_states[pages]
                    ok = cur == np.uint8(sources[0])
                    for src in sources[1:]:
                        ok |= cur == np.uint8(src)
                    if ok.all():
                        if guard is not None:
                            guard(s, pages)
                        self._page_states[pages] = np.uint8(target)
                        if target == SlotState.FREE:
                            self._push(pages)
                        return
            s = self._parse(method, slots, whole_pages)
            if s.size == 0:
                return
            cur = self._states[s]
            bad = ~np.isin(cur, np.array(sources, dtype=np.uint8))
            if bad.any():
                raise ValueError(self._message(method, s[bad], cur[bad], sources, reasons))
            if guard is not None:
                guard(s, None)
            self._states[s] = target
            if target == SlotState.FREE:
                self._push(np.unique(s // self.page_size))

    def _message(
        self,
        method: str,
        bad: np.ndarray,
        states: np.ndarray,
        sources: tuple[SlotState, ...],
        reasons: dict[SlotState, str],
    ) -> str:
        groups = []
        for st in np.unique(states):
            state = SlotState(int(st))
            sel = bad[states == st]
            if state == SlotState.FREE:
                # FREE is either a slot released before (double free / stale use) or never handed out.
                ever = self._ever[sel]
                for mask, what in ((ever, reasons.get(state, "not allocated")), (~ever, "never allocated")):
                    if mask.any():
                        groups.append(f"{what}: slot(s) {_fmt_slots(sel[mask])} are FREE")
            else:
                groups.append(f"{reasons.get(state, 'wrong state')}: slot(s) {_fmt_slots(sel)} are {state.name}")
        expected = " or ".join(s.name for s in sources)
        return f"{method}: {'; '.join(groups)} (expected {expected}); no slot was changed"

    def states_of(self, slots: np.ndarray) -> np.ndarray:
        """States of ``slots``: int64, in range, checked by the caller (no sort, no copy of the pool)."""
        with self._lock:
            return self._states[slots]

    def states(self, method: str, slots: torch.Tensor | None) -> torch.Tensor:
        with self._lock:
            if slots is None:
                return torch.from_numpy(self._states.copy())
            s = self._parse(method, slots, whole_pages=False)
            return torch.from_numpy(self._states[s])
