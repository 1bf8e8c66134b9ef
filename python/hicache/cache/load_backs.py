"""Load-backs of a :class:`~hicache.cache.radix_cache.HiRadixCache`: a host-only prefix brought back to device
slots, and how the TP ranks agree on it.

A load-back decides locally whether it can go (a threshold, a quota, room on the device after
evicting) and the ranks must decide alike: their trees and schedules stay identical only if every rank
loads the same prefixes. Two ways to agree:

- ``agree="now"`` (the default): the decision is agreed before ``HiRadixCache.load_back`` returns,
  one collective per load-back (none without a TP group).
- ``agree="step"``: no collective; the decision stands on this rank, and the step's
  ``HiRadixCache.agree_load_backs`` settles every load-back of the step in ONE collective. One that
  did not go on some rank (no room there, or an error there) is revoked everywhere it went, before any
  copy started: the caller gets the revoked nodes back and unwinds the requests that used them. An
  error inside a load-back is recorded and raised by ``agree_load_backs`` after the collective, on the
  rank where it happened, so no rank is left waiting in a collective. What a scheduler admitting
  several requests per step uses (:class:`~hicache.serving.engine.Engine` does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..controller.controller import HiCacheController
from ..pools import DeviceKVPool
from ..tree.core import CompiledNode
from ..tree.nodes import TreeNode
from .cache_tree import CacheTree
from .copy_acks import CopyAcks

__all__ = ["AGREE_MODES", "LoadBacks"]

AGREE_MODES = ("now", "step")


@dataclass
class _StepLoad:
    """One load-back of the step awaiting :meth:`LoadBacks.agree`."""

    node: Any
    path: list[Any]  # the host-only nodes it loads, top first (empty when it did not go here)
    device: torch.Tensor | None  # the new device slots (None: it did not go here)
    error: BaseException | None = None


class LoadBacks:
    """Load-backs of the tree's host-only prefixes (module docstring); owns the step's undecided ones.

    Parameters
    ----------
    tree, device_pool, controller : the nodes, where the slots come from, who copies.
    copies : the copies in flight; a load-back is recorded there until its ack.
    evict : ``evict(tokens)`` makes device room (the cache's eviction, write-back included).
    threshold : host hits shorter than this many tokens are not loaded back.
    """

    def __init__(
        self,
        tree: CacheTree,
        device_pool: DeviceKVPool,
        controller: HiCacheController,
        copies: CopyAcks,
        evict: Callable[[int], int],
        threshold: int,
    ) -> None:
        self.tree = tree
        self.device_pool = device_pool
        self.controller = controller
        self.copies = copies
        self.metrics = controller.metrics
        self.evict = evict
        self.threshold = threshold
        self.page_size = device_pool.page_size
        self.step: list[_StepLoad] = []  # agree="step" load-backs awaiting agree()

    def load_back(self, node: Any, mem_quota: int | None, agree: str) -> torch.Tensor | None:
        """:meth:`~hicache.cache.radix_cache.HiRadixCache.load_back` (its docstring): the checks, the
        decision, the slots and the queued copy."""
        if agree not in AGREE_MODES:
            raise ValueError(f"agree: expected 'now' or 'step', got {agree!r}")
        if not isinstance(node, (TreeNode, CompiledNode)):
            raise TypeError(f"node: expected a TreeNode (a MatchResult's last_host_node), got {type(node).__name__}")
        if mem_quota is not None and (
            isinstance(mem_quota, bool) or not isinstance(mem_quota, (int, np.integer)) or mem_quota < 0
        ):
            raise ValueError(f"mem_quota: expected None or a non-negative int of tokens, got {mem_quota!r}")
        tree = self.tree
        if not tree.attached(node):
            raise ValueError(
                f"node: {node} is no longer in the tree (its host copy was evicted after the match); "
                "match the tokens again"
            )
        path: list[Any] = []
        x = node
        while x is not tree.root and x.evicted:
            path.append(x)
            x = x.parent
        path.reverse()
        lengths = [n.num_tokens for n in path]
        total = sum(lengths)
        step = agree == "step"
        if total == 0 or total < self.threshold or (mem_quota is not None and total > mem_quota):
            if total:  # the same on every rank (their trees are alike): nothing to agree
                self.metrics.load_backs_skipped += 1
            return None
        t0 = time.perf_counter()
        # Lock the whole path first: eviction below must neither take the device ancestor nor (through a
        # write-back's host eviction) the host-only nodes we are about to load.
        tree.inc_lock_ref(node)
        device = None
        failed: BaseException | None = None
        try:
            available = self.device_pool.available_size()
            # Evict only when that can make enough room: a load-back that cannot fit changes nothing.
            if total <= available + (tree.evictable_size() if total > available else 0):
                device = self.device_pool.alloc(total)
                if device is None:
                    self.evict(total - available)
                    device = self.device_pool.alloc(total)
            window = self.controller.window
            if device is not None and window is not None:  # rows for the pages whose host copy carries them
                rows = window.host_has_rows(torch.cat([n.host_value for n in path]))
                if rows.any() and not window.alloc_for(device[torch.from_numpy(np.repeat(rows, self.page_size))]):
                    self.device_pool.free(device)  # no room for the rows: this load-back does not go here
                    device = None
        except Exception as exc:  # raised after the agreement every rank must take part in
            failed = exc

        def give_back() -> None:  # the load-back does not go here: the slots and the path's lock go back
            if device is not None:
                self.device_pool.free(device)
            tree.dec_lock_ref(node)

        went_here = device is not None and failed is None
        try:
            loading = went_here if step else bool(self.controller.agree_min(went_here))
            if failed is not None and not step:
                raise failed
            if loading:
                host = torch.cat([n.host_value for n in path])
                self.controller.load(host, device, node.id)  # the lock taken above is released by its ack
        except BaseException as exc:
            give_back()
            if not step or not isinstance(exc, Exception):
                raise
            self.step.append(_StepLoad(node, [], None, exc))
            return None
        if not loading:
            give_back()
            if failed is None:
                self.metrics.load_backs_skipped += 1
            if step:
                self.step.append(_StepLoad(node, [], None, failed))
            return None
        tree.slots.take(device)
        tree.protected += total  # the path is locked (above) until the load's ack
        offset = 0
        for n, length in zip(path, lengths, strict=True):
            n.value = device[offset : offset + length]
            offset += length
        self.copies.loads[node.id] = (node, host, t0)
        self.metrics.load_backs += 1
        if step:
            self.step.append(_StepLoad(node, path, device))
        return device

    def agree(self) -> list[int]:
        """:meth:`~hicache.cache.radix_cache.HiRadixCache.agree_load_backs` (its docstring)."""
        entries, self.step = self.step, []
        if not entries:
            return []
        went = [int(e.device is not None) for e in entries]
        agreed = self.controller.agree_all(went)
        revoked = []
        for e, ok in zip(entries, agreed, strict=True):
            if e.device is not None and not ok:
                self._revoke(e)
                revoked.append(e.node.id)
        for e in entries:
            if e.error is not None:
                raise e.error
        return revoked

    def _revoke(self, e: _StepLoad) -> None:
        """Undo a load-back whose copy has not started: the inverse of ``load_back`` 's last steps."""
        tree, node, device = self.tree, e.node, e.device
        _, host, _ = self.copies.loads.pop(node.id)
        self.controller.cancel_load(node.id, host)
        for n in e.path:
            n.value = None
        tree.slots.free(device)
        tree.protected -= len(device)
        self.metrics.load_backs -= 1
        self.metrics.load_backs_skipped += 1
        tree.lost_child(e.path[0].parent)  # its device parent is a leaf again
        tree.dec_lock_ref(node)  # the path is host-only again: host candidates as they unlock
