"""The device slots a :class:`~hicache.cache.radix_cache.HiRadixCache` owns, and the check of the slots an
``insert`` brings.

Validate once, check per call: what does not change (pool size, page size, the page offsets, a scratch
array for the repeat check) is prepared when the tree is built; a call then costs O(len(slots)) numpy
work on its own slots (no sort, no pass over the pool).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from ..pools import DeviceKVPool
from ..pools.paged_slots import _fmt_slots

ARG = "device_indices"
_SHOW_NODES = 3  # nodes named in a refused free before "..."


class TreeDeviceSlots:
    """Ownership of device slots by the tree (``owned``, one bool per slot) and the per-call check.

    Every change of a node's device slots goes through :meth:`take` / :meth:`free`, so ``owned`` is
    what :meth:`HiRadixCache.verify` finds in the nodes (it checks that it is). The pool knows it too
    (:meth:`DeviceKVPool.add_owner`): a caller's ``device_pool.free`` of a slot the tree holds is
    refused, naming the node (from ``nodes``: the tree's nodes, walked only then).
    """

    def __init__(self, pool: DeviceKVPool, nodes: Callable[[], Iterable[Any]]) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.owned = np.zeros(pool.size, dtype=bool)
        self.count = 0  # slots owned (kept with every take/free: the tree's device tokens, no walk)
        self._tree_nodes = nodes
        self._offsets = np.arange(pool.page_size, dtype=np.int64)
        self._scratch = np.empty(pool.size // pool.page_size, dtype=np.int64)
        self._index = np.arange(pool.size // pool.page_size, dtype=np.int64)
        pool.add_owner(self)

    def as_array(self, slots: object, num_tokens: int) -> np.ndarray:
        """``slots`` as int64 numpy (sharing the tensor's memory when it can), or ``TypeError`` /
        ``ValueError`` naming ``device_indices``: a 1-D integer tensor, one slot per token."""
        if type(slots) is torch.Tensor and slots.dtype is torch.int64 and slots.dim() == 1 and slots.is_cpu:
            if len(slots) == num_tokens:  # the usual call: a CPU int64 vector, no conversion
                return slots.numpy()
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"{ARG}: expected a 1-D integer torch.Tensor of device slots, got {type(slots).__name__}")
        if slots.dtype == torch.bool or slots.is_floating_point() or slots.is_complex():
            raise TypeError(f"{ARG}: expected an integer tensor of device slots, got {slots.dtype}")
        if slots.dim() != 1:
            raise ValueError(f"{ARG}: expected a 1-D tensor, got shape {tuple(slots.shape)}")
        if len(slots) != num_tokens:
            raise ValueError(
                f"{ARG}: expected one slot per token of a page-aligned key (page_size {self.page_size}); "
                f"got {num_tokens} tokens and {len(slots)} slots"
            )
        return slots.detach().cpu().numpy().astype(np.int64, copy=False)

    def check(self, s: np.ndarray) -> None:
        """``ValueError`` naming ``device_indices`` unless the slots ``s`` (from :meth:`as_array`) are inside
        the pool, whole pages in order (page ``p`` is slots ``[p * page_size, (p + 1) * page_size)``), no
        slot twice, every slot allocated. A handful of numpy calls on ``s`` alone."""
        if s.size == 0:
            return
        if np.count_nonzero(s.view(np.uint64) >= self.pool.size):  # negatives wrap to huge
            out = (s < 0) | (s >= self.pool.size)
            raise ValueError(f"{ARG}: slot(s) {_fmt_slots(s[out])} out of range [0, {self.pool.size})")
        ps = self.page_size
        if ps > 1:
            base = s.reshape(-1, ps) - self._offsets  # a page in order reads its first slot in every column
            first = base[:, :1]
            if np.count_nonzero(base != first) or np.count_nonzero(first % ps):
                rows = s.reshape(-1, ps)
                bad = (rows[:, 0] % ps != 0) | (rows != rows[:, :1] + self._offsets).any(axis=1)
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"{ARG}: each page of the key needs one whole device page in order (page p is slots "
                    f"[p*{ps}, (p+1)*{ps})); key page {i} got slots {_fmt_slots(rows[i])}"
                )
            pages = base[:, 0] // ps
        else:
            pages = s
        # Repeats in O(n): the last writer of a page wins, so an earlier position of a repeated page reads
        # back another position's index.
        idx = self._index[: pages.size]
        self._scratch[pages] = idx
        repeated = self._scratch[pages] != idx
        if np.count_nonzero(repeated):
            raise ValueError(f"{ARG}: repeated slot(s) {_fmt_slots(np.unique(pages[repeated] * ps))} (page starts)")
        # The device pool allocates and frees whole pages, so a page's first slot speaks for the page.
        free = ~self.pool.allocated_of(s if ps == 1 else s[::ps])
        if np.count_nonzero(free):
            free = ~self.pool.allocated_of(s)
            raise ValueError(
                f"{ARG}: slot(s) {_fmt_slots(s[free])} are not allocated in the device pool (never allocated or "
                "already freed); allocate them with device_pool.alloc"
            )

    def check_insert(self, s: np.ndarray, dup: int, cached: list[torch.Tensor]) -> None:
        """The full check of an insert's slots ``s`` (the fast paths' fallback, which names the fault):
        :meth:`check` on all of them, :meth:`check_duplicates` on the first ``dup`` against the tree's
        slots there (``cached``), :meth:`check_unowned` on the rest."""
        self.check(s)
        self.check_duplicates(s[:dup], cached)
        self.check_unowned(s[dup:])

    @staticmethod
    def is_cached(head: np.ndarray, cached: list[torch.Tensor]) -> bool:
        """Whether ``head`` (the slots at the positions the tree already caches on the device, which
        ``insert`` leaves to their owner) is exactly the tree's slots there (``cached``, the nodes' slots
        in order), as when the caller passes the ``match_prefix`` result back."""
        if head.size == 0:
            return True
        tree = torch.cat(cached).numpy() if len(cached) > 1 else cached[0].numpy()
        return np.count_nonzero(head != tree) == 0

    def check_duplicates(self, head: np.ndarray, cached: list[torch.Tensor]) -> None:
        """``ValueError`` when a slot of ``head`` (checked by :meth:`check`) is owned by the tree but is not
        the tree's slot for that token (see :meth:`is_cached`): the caller would free it as a duplicate."""
        if head.size == 0:
            return
        tree = torch.cat(cached).numpy()
        wrong = (head != tree) & self.owned[head]
        if wrong.any():
            raise ValueError(
                f"{ARG}: slot(s) {_fmt_slots(head[wrong])} are owned by the tree for other tokens than the ones "
                f"at their positions (cached there: slots {_fmt_slots(tree[wrong])}); pass match_prefix's "
                "device_indices back, or the caller's own slots"
            )

    def check_unowned(self, sel: np.ndarray) -> None:
        """``ValueError`` when a slot the tree is about to take (``sel``) already holds cached KV."""
        owned = self.owned[sel]
        if np.count_nonzero(owned):
            raise ValueError(
                f"{ARG}: slot(s) {_fmt_slots(sel[owned])} already hold the KV of other cached tokens (owned by "
                "the tree); pass the caller's own slots for the tokens that are not cached on the device"
            )

    def take(self, slots: torch.Tensor) -> None:
        """The tree now owns ``slots`` (allocated, checked)."""
        self.owned[slots.numpy()] = True
        self.count += len(slots)

    def took(self, n: int) -> None:
        """The compiled core took ``n`` slots itself (it writes ``owned`` in C++)."""
        self.count += n

    def free(self, slots: torch.Tensor) -> None:
        """Return ``slots`` (owned by the tree) to the device pool: the tree lets go of them first, so the
        pool's free accepts them (and holds them again if it refuses)."""
        s = slots.numpy()
        self.owned[s] = False
        try:
            self.pool.free(slots)
        except BaseException:
            self.owned[s] = True
            raise
        self.count -= len(s)

    def describe(self, slots: np.ndarray) -> str:
        """The nodes that hold ``slots`` (tree-owned), for the pool's refusal: a walk of the tree, which only
        that error path takes."""
        named: list[str] = []
        for node in self._tree_nodes():
            value = node.value
            if value is None:
                continue
            v = value.numpy()
            hit = np.isin(v, slots)
            if np.count_nonzero(hit):
                named.append(f"node {node.id} ({node.num_tokens} tokens; slots {_fmt_slots(v[hit])})")
        if not named:
            return "the radix tree (no node lists them: run verify())"
        more = f", ... ({len(named)} nodes)" if len(named) > _SHOW_NODES else ""
        return f"the radix tree: {', '.join(named[:_SHOW_NODES])}{more}"
