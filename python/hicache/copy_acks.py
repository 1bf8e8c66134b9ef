"""The copies of a :class:`~hicache.radix_cache.HiRadixCache` in flight: starting backups, and
processing the controller's acks, including the roll-back of failed and dropped copies.

A completed backup makes its host slots SYNCED; a failed (or dropped) one frees them, and its node
stays device-only. A completed load-back unlocks its nodes; a failed (or dropped) one leaves the host
copy intact and makes the device copy *lost*: lost nodes no longer match, and as soon as nobody else
holds them they go back to host-only, together with whatever device copies were inserted below them
meanwhile (their prefix is gone). Failures, not drops, are then raised as :class:`CopyError`, after
the roll-back, so the cache is consistent when the caller sees the error.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .copy_errors import CopyDropped, CopyError
from .tree import TreeNode, copy_chain, depth

if TYPE_CHECKING:
    from .radix_cache import HiRadixCache


class CopyAcks:
    """Mixin of :class:`~hicache.radix_cache.HiRadixCache`: its backups and ack processing (module
    docstring). Uses the cache's ``controller``, pools, ``root``, ``_inflight_writes``,
    ``_inflight_loads``, ``_lost`` and its device-slot record ``_slots``."""

    def _host_room(self: HiRadixCache, tokens: int) -> None:
        """Make ``tokens`` host slots free if host eviction can (a full host pool is the steady state)."""
        short = tokens - self.host_pool.available_size()
        if short > 0:
            self.evict_host(short)

    def _backup(self: HiRadixCache, node: TreeNode) -> bool:
        value = node.value
        self._host_room(len(value))
        host = self.controller.write(value, node.id)
        if host is None:
            return False
        self._started_backup(node, host)
        return True

    def _backup_many(self: HiRadixCache, nodes: list[TreeNode]) -> None:
        """Back up ``nodes`` in one copy op when the host pool can take them all (after making room
        once); otherwise one by one, as :meth:`_backup`, so each gets what room there is."""
        if len(nodes) == 1:
            self._backup(nodes[0])
            return
        items = [(node.value, node.id) for node in nodes]
        self._host_room(sum(len(value) for value, _ in items))
        hosts = self.controller.write_many(items, count_refusal=False)
        if hosts is None:
            for node in nodes:
                self._backup(node)
            return
        for node, host in zip(nodes, hosts, strict=True):
            self._started_backup(node, host)

    def _started_backup(self: HiRadixCache, node: TreeNode, host) -> None:
        node.host_value = host
        self.inc_lock_ref(node)
        self._inflight_writes[node.id] = (node, host)

    def _count_failure(self: HiRadixCache, kind: str, node: TreeNode, error: BaseException, failures: list) -> None:
        m = self.metrics
        if isinstance(error, CopyDropped):
            m.copies_dropped += 1  # asked for by close(drain=False): rolled back, not an error
        else:
            if kind == "write":
                m.writes_failed += 1
            else:
                m.loads_failed += 1
            failures.append((kind, node.id, error))

    def _take_writes(self: HiRadixCache, failures: list, done: list | None = None) -> int:
        done = self.controller.finished_writes() if done is None else done
        for node_id, error in done:
            node, host = self._inflight_writes.pop(node_id)
            if error is None:
                self.host_pool.mark_synced(host)
                self._after_host_copy(node, host)  # the storage tier's backup, when there is one
            else:  # the host copy is incomplete: drop it, the node keeps its device copy
                for x in copy_chain(self.root, node, host):
                    x.host_value = None
                self.host_pool.abort_write(host)
                self.host_pool.free(host)
                self._count_failure("write", node, error, failures)
            self.dec_lock_ref(node)
        return len(done)

    def _take_loads(self: HiRadixCache, failures: list, done: list | None = None) -> int:
        done = self.controller.finished_loads() if done is None else done
        for node_id, error in done:
            node, host, t0 = self._inflight_loads.pop(node_id)
            self.host_pool.mark_synced(host)  # a failed load only read them: the host copy stays valid
            if error is None:
                self.metrics.load_back_latency_s.append(time.perf_counter() - t0)
            else:  # the device copy is garbage: lost, dropped once nobody else holds it (at the unlock below)
                for x in copy_chain(self.root, node, host):
                    self._lost[x.id] = x
                self._count_failure("load", node, error, failures)
            self.dec_lock_ref(node)
        return len(done)

    @staticmethod
    def _raise(failures: list) -> None:
        if failures:
            raise CopyError(failures) from failures[0][2]

    def check_writes(self: HiRadixCache) -> int:
        """Process finished backups (agreed across TP ranks): host slots become SYNCED, nodes unlock.
        Returns how many were processed; raises :class:`CopyError` after rolling back failed ones."""
        failures: list = []
        n = self._take_writes(failures)
        self._take_storage()  # storage backups that finished: their nodes unlock (no collective without storage)
        self._raise(failures)
        return n

    def check_loads(self: HiRadixCache) -> int:
        """Process finished load-backs: host slots back to SYNCED, nodes unlock, latency recorded.
        Returns how many were processed; raises :class:`CopyError` after rolling back failed ones."""
        failures: list = []
        n = self._take_loads(failures)
        self._raise(failures)
        return n

    def check_acks(self: HiRadixCache) -> int:
        """Process the finished backups and load-backs of this step and the storage tier's finished
        backups together, agreed across TP ranks in ONE collective (:meth:`check_writes` and
        :meth:`check_loads` take one or two each). Returns how many copies were processed; raises
        :class:`CopyError` after rolling back failed ones. What a scheduler calls once per step."""
        failures: list = []
        counts = None if self._storage is None else {"storage": self._storage.landed_backups()}
        done = self.controller.finished(counts=counts)
        n = self._take_writes(failures, done["write"]) + self._take_loads(failures, done["load"])
        self._take_storage(done["counts"].get("storage"))
        self._raise(failures)
        return n

    def _take_acks(self: HiRadixCache) -> None:
        self.check_acks()

    def _release_lost(self: HiRadixCache) -> None:
        """Drop the device copies of lost nodes nobody holds any more, and everything device-resident
        below them (whose prefix is gone); deepest first, so parents go after their children."""
        for x in sorted(self._lost.values(), key=lambda n: depth(self.root, n), reverse=True):
            if x.lock_ref:
                continue  # still in use: the lock's owner releases it later
            for d in reversed(list(self._nodes(x))):  # children before parents; unlocked, as x is
                if d.value is not None:
                    self._drop_device(d)
            self._slots.free(x.value)  # it has its host copy (the load's source)
            x.value = None
            self._lost_child(x.parent)
            self._maybe_host_candidate(x)
            del self._lost[x.id]
