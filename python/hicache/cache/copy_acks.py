"""The copies of a :class:`~hicache.cache.radix_cache.HiRadixCache` in flight: starting backups, and
processing the controller's acks, including the roll-back of failed and dropped copies.

A completed backup makes its host slots SYNCED; a failed (or dropped) one frees them, and its node
stays device-only. A completed load-back unlocks its nodes; a failed (or dropped) one leaves the host
copy intact and makes the device copy *lost*: lost nodes no longer match, and as soon as nobody else
holds them they go back to host-only, together with whatever device copies were inserted below them
meanwhile (their prefix is gone). Failures, not drops, are collected for the caller to raise as
:class:`CopyError`, after the roll-back, so the cache is consistent when the caller sees the error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..controller.controller import HiCacheController
from ..controller.copy_errors import CopyDropped, CopyError
from ..pools import HostKVPool
from ..tree.nodes import copy_chain
from .cache_tree import CacheTree

__all__ = ["CopyAcks"]


class CopyAcks:
    """The tree's copies in flight (``writes``: backups, ``loads``: load-backs, each by node id) and
    their acks.

    Parameters
    ----------
    tree, controller, host_pool : what the copies change and who issues them.
    evict_host : ``evict_host(tokens)`` frees host slots by host eviction (a backup makes room first).
    host_copy_landed : called with ``(node, host_slots)`` when a backup's host copy is SYNCED (the
        storage tier queues it for its backend), or None.
    """

    def __init__(
        self,
        tree: CacheTree,
        controller: HiCacheController,
        host_pool: HostKVPool,
        evict_host: Callable[[int], int],
        host_copy_landed: Callable[[Any, torch.Tensor], None] | None = None,
    ) -> None:
        self.tree = tree
        self.controller = controller
        self.host_pool = host_pool
        self.metrics = controller.metrics
        self.evict_host = evict_host
        self.host_copy_landed = host_copy_landed
        self.writes: dict[int, tuple[Any, torch.Tensor]] = {}  # node id -> (node, host slots)
        self.loads: dict[int, tuple[Any, torch.Tensor, float]] = {}  # node id -> (node, host slots, start time)

    # ------------------------------------------------------------------ backups
    def host_room(self, tokens: int) -> None:
        """Make ``tokens`` host slots free if host eviction can (a full host pool is the steady state)."""
        short = tokens - self.host_pool.available_size()
        if short > 0:
            self.evict_host(short)

    def backup(self, node: Any) -> bool:
        """Back ``node`` 's device copy up to new host slots; False when the host pool has no room."""
        value = node.value
        self.host_room(len(value))
        host = self.controller.write(value, node.id)
        if host is None:
            return False
        self._started(node, host)
        return True

    def backup_many(self, nodes: list[Any]) -> None:
        """Back up ``nodes`` in one copy op when the host pool can take them all (after making room
        once); otherwise one by one, as :meth:`backup`, so each gets what room there is."""
        if len(nodes) == 1:
            self.backup(nodes[0])
            return
        items = [(node.value, node.id) for node in nodes]
        self.host_room(sum(len(value) for value, _ in items))
        hosts = self.controller.write_many(items, count_refusal=False)
        if hosts is None:
            for node in nodes:
                self.backup(node)
            return
        for node, host in zip(nodes, hosts, strict=True):
            self._started(node, host)

    def _started(self, node: Any, host: torch.Tensor) -> None:
        node.host_value = host
        self.tree.inc_lock_ref(node)  # released by the ack
        self.writes[node.id] = (node, host)

    # ------------------------------------------------------------------ acks
    def _count_failure(self, kind: str, node: Any, error: BaseException, failures: list) -> None:
        m = self.metrics
        if isinstance(error, CopyDropped):
            m.copies_dropped += 1  # asked for by close(drain=False): rolled back, not an error
        else:
            if kind == "write":
                m.writes_failed += 1
            else:
                m.loads_failed += 1
            failures.append((kind, node.id, error))

    def take_writes(self, failures: list, done: list | None = None) -> int:
        """Process finished backups (``done``: ``(node id, error)`` pairs, default the controller's
        agreed ones); failed ones are rolled back and appended to ``failures``. Returns how many."""
        done = self.controller.finished_writes() if done is None else done
        tree = self.tree
        for node_id, error in done:
            node, host = self.writes.pop(node_id)
            if error is None:
                self.host_pool.mark_synced(host)
                if self.host_copy_landed is not None:
                    self.host_copy_landed(node, host)
            else:  # the host copy is incomplete: drop it, the node keeps its device copy
                for x in copy_chain(tree.root, node, host):
                    x.host_value = None
                self.host_pool.abort_write(host)
                self.host_pool.free(host)
                self._count_failure("write", node, error, failures)
            tree.dec_lock_ref(node)
        return len(done)

    def take_loads(self, failures: list, done: list | None = None) -> int:
        """Process finished load-backs, as :meth:`take_writes`; a failed one makes its nodes lost."""
        done = self.controller.finished_loads() if done is None else done
        tree = self.tree
        for node_id, error in done:
            node, host, t0 = self.loads.pop(node_id)
            self.host_pool.mark_synced(host)  # a failed load only read them: the host copy stays valid
            if error is None:
                self.metrics.load_back_latency_s.append(time.perf_counter() - t0)
            else:  # the device copy is garbage: lost, dropped once nobody else holds it (at the unlock below)
                for x in copy_chain(tree.root, node, host):
                    tree.lost[x.id] = x
                self._count_failure("load", node, error, failures)
            tree.dec_lock_ref(node)
        return len(done)

    @staticmethod
    def raise_failures(failures: list) -> None:
        """Raise :class:`CopyError` for the failures collected by :meth:`take_writes` / :meth:`take_loads`."""
        if failures:
            raise CopyError(failures) from failures[0][2]
