"""The device slots a :class:`~hicache.radix_cache.HiRadixCache` owns, and the check of the slots an
``insert`` brings.

Validate once, check per call: what does not change (pool size, page size, the page offsets, a scratch
array for the repeat check) is prepared when the tree is built; a call then costs O(len(slots)) numpy
work on its own slots (no sort, no pass over the pool).
"""

from __future__ import annotations

import numpy as np
import torch

from .pools import DeviceKVPool, _fmt_slots

ARG = "device_indices"


class TreeDeviceSlots:
    """Ownership of device slots by the tree (``owned``, one bool per slot) and the per-call check.

    Every change of a node's device slots goes through :meth:`take` / :meth:`free`, so ``owned`` is
    what :meth:`HiRadixCache.verify` finds in the nodes (it checks that it is).
    """

    def __init__(self, pool: DeviceKVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.owned = np.zeros(pool.size, dtype=bool)
        self._offsets = np.arange(pool.page_size, dtype=np.int64)
        self._scratch = np.empty(pool.size // pool.page_size, dtype=np.int64)

    def check(self, slots: object, num_tokens: int) -> np.ndarray:
        """``slots`` as int64 numpy, or ``TypeError`` / ``ValueError`` naming ``device_indices``.

        Checks: a 1-D integer tensor, one slot per token, inside the pool, whole pages in order (page
        ``p`` is slots ``[p * page_size, (p + 1) * page_size)``), no slot twice, every slot allocated.
        """
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"{ARG}: expected a 1-D integer torch.Tensor of device slots, got {type(slots).__name__}")
        if slots.dtype == torch.bool or slots.is_floating_point() or slots.is_complex():
            raise TypeError(f"{ARG}: expected an integer tensor of device slots, got {slots.dtype}")
        if slots.dim() != 1:
            raise ValueError(f"{ARG}: expected a 1-D tensor, got shape {tuple(slots.shape)}")
        ps = self.page_size
        if len(slots) != num_tokens:
            raise ValueError(
                f"{ARG}: expected one slot per token of a page-aligned key (page_size {ps}); "
                f"got {num_tokens} tokens and {len(slots)} slots"
            )
        s = slots.detach().cpu().numpy().astype(np.int64, copy=False)
        if s.size == 0:
            return s
        out = (s < 0) | (s >= self.pool.size)
        if out.any():
            raise ValueError(f"{ARG}: slot(s) {_fmt_slots(s[out])} out of range [0, {self.pool.size})")
        if ps > 1:
            rows = s.reshape(-1, ps)
            bad = (rows[:, 0] % ps != 0) | (rows != rows[:, :1] + self._offsets).any(axis=1)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"{ARG}: each page of the key needs one whole device page in order (page p is slots "
                    f"[p*{ps}, (p+1)*{ps})); key page {i} got slots {_fmt_slots(rows[i])}"
                )
            pages = rows[:, 0] // ps
        else:
            pages = s
        # Repeats in O(n): the last writer of a page wins, so an earlier position of a repeated page reads
        # back another position's index.
        idx = np.arange(pages.size, dtype=np.int64)
        self._scratch[pages] = idx
        repeated = self._scratch[pages] != idx
        if repeated.any():
            raise ValueError(f"{ARG}: repeated slot(s) {_fmt_slots(np.unique(pages[repeated] * ps))} (page starts)")
        free = ~self.pool.allocated_of(s)
        if free.any():
            raise ValueError(
                f"{ARG}: slot(s) {_fmt_slots(s[free])} are not allocated in the device pool (never allocated or "
                "already freed); allocate them with device_pool.alloc"
            )
        return s

    def check_unowned(self, s: np.ndarray, taken: np.ndarray) -> None:
        """``ValueError`` when a slot the tree is about to take (``s[taken]``) already holds cached KV."""
        sel = s[taken]
        owned = self.owned[sel]
        if owned.any():
            raise ValueError(
                f"{ARG}: slot(s) {_fmt_slots(sel[owned])} already hold the KV of other cached tokens (owned by "
                "the tree); pass the caller's own slots for the tokens that are not cached on the device"
            )

    def take(self, slots: torch.Tensor) -> None:
        """The tree now owns ``slots`` (allocated, checked)."""
        self.owned[slots.numpy()] = True

    def free(self, slots: torch.Tensor) -> None:
        """Return ``slots`` (owned by the tree) to the device pool."""
        self.pool.free(slots)
        self.owned[slots.numpy()] = False
