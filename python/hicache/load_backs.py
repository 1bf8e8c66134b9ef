"""Load-backs of a :class:`~hicache.radix_cache.HiRadixCache`: a host-only prefix brought back to device
slots, and how the TP ranks agree on it.

A load-back decides locally whether it can go (a threshold, a quota, room on the device after
evicting) and the ranks must decide alike: their trees and schedules stay identical only if every rank
loads the same prefixes. Two ways to agree:

- ``agree="now"`` (the default): the decision is agreed before :meth:`LoadBacks.load_back` returns,
  one collective per load-back (none without a TP group).
- ``agree="step"``: no collective; the decision stands on this rank, and the step's
  :meth:`LoadBacks.agree_load_backs` settles every load-back of the step in ONE collective. One that
  did not go on some rank (no room there, or an error there) is revoked everywhere it went, before any
  copy started: the caller gets the revoked nodes back and unwinds the requests that used them. An
  error inside a load-back is recorded and raised by ``agree_load_backs`` after the collective, on the
  rank where it happened, so no rank is left waiting in a collective. What a scheduler admitting
  several requests per step uses (:class:`~hicache.engine.Engine` does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .tree import TreeNode
from .tree_core import CompiledNode

if TYPE_CHECKING:
    from .radix_cache import HiRadixCache

AGREE_MODES = ("now", "step")


@dataclass
class _StepLoad:
    """One load-back of the step awaiting :meth:`LoadBacks.agree_load_backs`."""

    node: Any
    path: list[Any]  # the host-only nodes it loads, top first (empty when it did not go here)
    device: torch.Tensor | None  # the new device slots (None: it did not go here)
    error: BaseException | None = None


class LoadBacks:
    """Mixin of :class:`~hicache.radix_cache.HiRadixCache`: ``load_back``, ``agree_load_backs`` and
    ``start_loading``. Uses the cache's pools, controller, ``_slots``, locks and ``_step_loads``."""

    def load_back(
        self: HiRadixCache, node: TreeNode, mem_quota: int | None = None, *, agree: str = "now"
    ) -> torch.Tensor | None:
        """Bring the host-only part of the prefix ending at ``node`` back to device slots.

        Returns the new device slots (in prefix order; the copy starts with :meth:`start_loading` and
        the nodes stay locked until its ack is processed), or None when skipped: nothing to load,
        fewer than ``load_back_threshold`` tokens, more than ``mem_quota`` tokens, or more than the
        free plus evictable device slots (then nothing is evicted).

        ``agree``: ``"now"`` agrees the decision across TP ranks before returning (one collective);
        ``"step"`` leaves it to the step's :meth:`agree_load_backs` (module docstring), which may
        revoke the slots returned here, and records an error inside the load-back (then None here) for
        it to raise.

        Raises (and changes nothing) ``TypeError`` / ``ValueError`` naming ``node``, ``mem_quota`` or
        ``agree``: ``node`` must be a node of this tree still in it (a host eviction after the match may
        have deleted it: match again); ``RuntimeError`` after :meth:`close`.
        """
        self._check_open("load_back")
        if agree not in AGREE_MODES:
            raise ValueError(f"agree: expected 'now' or 'step', got {agree!r}")
        if not isinstance(node, (TreeNode, CompiledNode)):
            raise TypeError(f"node: expected a TreeNode (a MatchResult's last_host_node), got {type(node).__name__}")
        if mem_quota is not None and (
            isinstance(mem_quota, bool) or not isinstance(mem_quota, (int, np.integer)) or mem_quota < 0
        ):
            raise ValueError(f"mem_quota: expected None or a non-negative int of tokens, got {mem_quota!r}")
        if not self._attached(node):
            raise ValueError(
                f"node: {node} is no longer in the tree (its host copy was evicted after the match); "
                "match the tokens again"
            )
        path: list[TreeNode] = []
        x = node
        while x is not self.root and x.evicted:
            path.append(x)
            x = x.parent
        path.reverse()
        lengths = [n.num_tokens for n in path]
        total = sum(lengths)
        step = agree == "step"
        if total == 0 or total < self.load_back_threshold or (mem_quota is not None and total > mem_quota):
            if total:  # the same on every rank (their trees are alike): nothing to agree
                self.metrics.load_backs_skipped += 1
            return None
        t0 = time.perf_counter()
        # Lock the whole path first: eviction below must neither take the device ancestor nor (through a
        # write-back's host eviction) the host-only nodes we are about to load.
        self.inc_lock_ref(node)
        device = None
        failed: BaseException | None = None
        try:
            available = self.device_pool.available_size()
            # Evict only when that can make enough room: a load-back that cannot fit changes nothing.
            if total <= available + (self.evictable_size() if total > available else 0):
                device = self.device_pool.alloc(total)
                if device is None:
                    self.evict(total - available)
                    device = self.device_pool.alloc(total)
        except Exception as exc:  # raised after the agreement every rank must take part in
            failed = exc

        def give_back() -> None:  # the load-back does not go here: the slots and the path's lock go back
            if device is not None:
                self.device_pool.free(device)
            self.dec_lock_ref(node)

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
            self._step_loads.append(_StepLoad(node, [], None, exc))
            return None
        if not loading:
            give_back()
            if failed is None:
                self.metrics.load_backs_skipped += 1
            if step:
                self._step_loads.append(_StepLoad(node, [], None, failed))
            return None
        self._slots.take(device)
        self._protected += total  # the path is locked (above) until the load's ack
        offset = 0
        for n, length in zip(path, lengths, strict=True):
            n.value = device[offset : offset + length]
            offset += length
        self._inflight_loads[node.id] = (node, host, t0)
        self.metrics.load_backs += 1
        if step:
            self._step_loads.append(_StepLoad(node, path, device))
        return device

    def agree_load_backs(self: HiRadixCache) -> list[int]:
        """Settle the step's ``agree="step"`` load-backs across TP ranks in ONE collective (none without a
        group or without such load-backs): one that did not go on every rank is revoked where it went
        (its device slots freed, its nodes host-only again, its lock released; no copy had started).
        Returns the ids of the revoked load-backs' ``node`` arguments, in call order; raises the first
        error recorded inside this rank's load-backs, after settling them."""
        self._check_open("agree_load_backs")
        entries, self._step_loads = self._step_loads, []
        if not entries:
            return []
        went = [int(e.device is not None) for e in entries]
        agreed = self.controller.agree_all(went)
        revoked = []
        for e, ok in zip(entries, agreed, strict=True):
            if e.device is not None and not ok:
                self._revoke_load_back(e)
                revoked.append(e.node.id)
        for e in entries:
            if e.error is not None:
                raise e.error
        return revoked

    def _revoke_load_back(self: HiRadixCache, e: _StepLoad) -> None:
        """Undo a load-back whose copy has not started: the inverse of ``load_back``'s last steps."""
        node, device = e.node, e.device
        _, host, _ = self._inflight_loads.pop(node.id)
        self.controller.cancel_load(node.id, host)
        for n in e.path:
            n.value = None
        self._slots.free(device)
        self._protected -= len(device)
        self.metrics.load_backs -= 1
        self.metrics.load_backs_skipped += 1
        self._lost_child(e.path[0].parent)  # its device parent is a leaf again
        self.dec_lock_ref(node)  # the path is host-only again: host candidates as they unlock

    def start_loading(self: HiRadixCache) -> int:
        """Start the queued load-backs as one layer-by-layer batch (see the controller). Load-backs
        decided with ``agree="step"`` must be settled by :meth:`agree_load_backs` first
        (``RuntimeError`` otherwise: a copy that starts cannot be revoked)."""
        self._check_open("start_loading")
        if self._step_loads:
            raise RuntimeError(
                f"start_loading: {len(self._step_loads)} load-back(s) decided with agree='step' are not settled; "
                "call agree_load_backs() first"
            )
        return self.controller.start_loading()
