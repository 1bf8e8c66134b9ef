"""The nodes of a :class:`~hicache.cache.radix_cache.HiRadixCache` and what is kept about them as they change.

:class:`CacheTree` owns the tree (on either core, :mod:`hicache.tree.core`) and every piece of per-node
state the cache's components share, so that each of them changes it through one place:

- topology: the root, splits, new host-only children, deletion of a subtree;
- locks (``lock_ref``, on a node and all its ancestors) and host pins (a storage backup reading a node's
  host copy: host eviction leaves it, its device copy may go);
- what is kept instead of walking the tree: the device tokens in locked nodes (``protected``), the
  tree's device slots (``slots``, :class:`~hicache.cache.slot_check.TreeDeviceSlots`), each tier's eviction
  candidates in policy order (:mod:`hicache.tree.candidates`);
- lost nodes (a failed load-back's device copy, dropped at the last unlock) and the nodes' storage page
  keys (computed by the storage tier, split and dropped with their node).

It issues no copy and knows no controller: host slots it lets go of go to ``release_host`` (the storage
tier holds them while its backend may still touch them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from ..controller.metrics import CacheMetrics
from ..pools import DeviceKVPool
from ..tree.candidates import Candidates, CompiledCandidates, compiled_policy
from ..tree.core import _LOST, CompiledNode, CompiledTree
from ..tree.nodes import TreeNode, depth, is_attached, subtree
from ..tree.policies import EvictionPolicy
from .slot_check import TreeDeviceSlots

__all__ = ["CacheTree"]


class _LostNodes(dict):
    """``CacheTree.lost`` (id -> node): the compiled core keeps a copy of membership as a flag, which its
    ``match`` reads."""

    __slots__ = ("core",)

    def __init__(self, core: Any) -> None:
        super().__init__()
        self.core = core

    def __setitem__(self, node_id: int, node: Any) -> None:
        super().__setitem__(node_id, node)
        if self.core is not None:
            self.core.set_flag(node_id, _LOST, True)

    def __delitem__(self, node_id: int) -> None:
        super().__delitem__(node_id)
        if self.core is not None and self.core.alive(node_id):
            self.core.set_flag(node_id, _LOST, False)


class CacheTree:
    """The cache's nodes, locks, pins, kept sizes and eviction candidates (module docstring).

    Parameters
    ----------
    device_pool : the device pool whose slots the nodes' ``value`` s are.
    core : ``"compiled"`` or ``"python"`` (:func:`hicache.tree.core.choose_core`).
    policy : the eviction policy; its ``key`` orders both tiers' candidates.
    metrics : where deleted host tokens are counted.
    release_host : called with host slots no node owns any more (default ``host_pool.free`` of the
        caller's choice: the cache passes its storage tier's, which holds busy ones back).
    """

    def __init__(
        self,
        device_pool: DeviceKVPool,
        core: str,
        policy: EvictionPolicy,
        metrics: CacheMetrics,
        release_host: Callable[[torch.Tensor], None],
    ) -> None:
        self.page_size = device_pool.page_size
        self.policy = policy
        self.metrics = metrics
        self.release_host = release_host
        self.ids = itertools.count(1)  # node ids of the Python core (the compiled core numbers its own)
        self.clock = 0  # a logical clock: TP ranks that see the same requests order evictions alike
        self.slots = TreeDeviceSlots(device_pool, self.nodes)
        self.compiled: CompiledTree | None = None
        if core == "compiled":
            self.compiled = CompiledTree(self.page_size, device_pool._state_array(), self.slots.owned)
            self.root: TreeNode | CompiledNode = self.compiled.node(0)
        else:
            self.root = TreeNode(0, None, (), 0)
        self.root.lock_ref = 1  # never evicted
        self.protected = 0  # device tokens in locked nodes (the tree's device tokens are slots.count)
        self.chosen: set[int] = set()  # the nodes an eviction in progress has picked
        # Each tier's eviction candidates in policy order; None for a policy that cannot be kept ordered
        # (then sorted per eviction).
        self.device_candidates: Candidates | CompiledCandidates | None = None
        self.host_candidates: Candidates | CompiledCandidates | None = None
        code = compiled_policy(policy) if self.compiled is not None else None
        if code is not None:  # a built-in policy over the compiled core: the heaps live in the core
            self.device_candidates = CompiledCandidates(self.compiled, code, self.is_device_candidate)
            self.host_candidates = CompiledCandidates(self.compiled, code, self.is_host_candidate)
        elif getattr(policy, "monotonic", False) is True:
            self.device_candidates = Candidates(policy.key, self.is_device_candidate)
            self.host_candidates = Candidates(policy.key, self.is_host_candidate)
        # Nodes whose load-back failed while others held them locked: device KV lost, dropped at the last unlock.
        self.lost: dict[int, Any] = _LostNodes(None if self.compiled is None else self.compiled.core)
        self.node_keys: dict[int, list[str]] = {}  # node id -> its pages' storage keys, once computed
        self.host_pins: dict[int, int] = {}  # node id -> storage backups reading its host copy

    # ------------------------------------------------------------------ walks (verify, policies that sort)
    def nodes(self, start: Any = None) -> list:
        """Every node below ``start`` (default: the root), ``start`` itself excluded."""
        if self.compiled is not None:
            t = self.compiled
            return [t.node(i) for i in t.core.subtree((start or self.root).id)]
        return subtree(start or self.root)

    def child_nodes(self, node: Any) -> list:
        if self.compiled is not None:
            return [self.compiled.node(c) for c in self.compiled.core.children(node.id)]
        return list(node.children.values())

    def attached(self, node: Any) -> bool:
        """``node`` is a node of this tree, still in it."""
        if self.compiled is not None:
            return isinstance(node, CompiledNode) and self.compiled.attached(node)
        return isinstance(node, TreeNode) and is_attached(self.root, node, self.page_size)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # ------------------------------------------------------------------ topology
    def split(self, child: TreeNode, at: int) -> TreeNode:
        """Split ``child`` (Python core) after ``at`` tokens; returns the new upper node, which inherits
        locks and counters (a lock on any descendant covers it too)."""
        upper = TreeNode(next(self.ids), child.parent, child.key[:at], child.creation_time)
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.last_access_time = child.last_access_time
        upper.priority = child.priority
        if child.value is not None:
            upper.value, child.value = child.value[:at], child.value[at:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:at], child.host_value[at:]
        if child.id in self.lost:
            self.lost[upper.id] = upper
        child.parent.children[child.key[: self.page_size]] = upper
        if self.node_keys:
            self._split_keys(child.id, upper.id, at)
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    def after_splits(self, splits: list[tuple[int, int, int]]) -> None:
        """The Python-side state of nodes the compiled core split (a node without a handle has none): the
        upper node inherits the locks, the first ``at`` host slots and a lost mark, as :meth:`split`."""
        t = self.compiled
        for lower_id, upper_id, at in splits:
            if self.node_keys:
                self._split_keys(lower_id, upper_id, at)
            lower = t._handles.get(lower_id)
            if lower is None:
                continue
            upper = t.node(upper_id)
            upper.lock_ref = lower.lock_ref
            host = lower._host
            if host is not None:
                upper._host, lower._host = host[:at], host[at:]
            if lower_id in self.lost:
                self.lost[upper_id] = upper

    def _split_keys(self, lower_id: int, upper_id: int, at: int) -> None:
        keys = self.node_keys.get(lower_id)
        if keys is not None:
            k = at // self.page_size
            self.node_keys[upper_id], self.node_keys[lower_id] = keys[:k], keys[k:]

    def add_host_node(self, parent: Any, tokens: list[int], host: torch.Tensor) -> Any:
        """A new host-only child of ``parent`` holding ``tokens`` in host slots ``host`` (SYNCED)."""
        if self.compiled is not None:
            node = self.compiled.node(self.compiled.core.add_child(parent.id, tokens))
        else:
            node = TreeNode(next(self.ids), parent, tuple(tokens), self.tick())
            parent.children[node.key[: self.page_size]] = node
        node.host_value = host
        self.maybe_host_candidate(node)
        return node

    def delete(self, node: Any) -> None:
        """Remove ``node`` and its subtree, freeing every slot they own (none may be in flight)."""
        for x in [node, *self.nodes(node)]:
            if x.value is not None:
                self.slots.free(x.value)
            if x.host_value is not None:
                self.release_host(x.host_value)
                self.metrics.host_evicted_tokens += x.num_tokens
            x.value = x.host_value = None
            self.node_keys.pop(x.id, None)
        parent = node.parent
        if self.compiled is not None:
            self.compiled.remove(node)
        else:
            del parent.children[node.key[: self.page_size]]
        self.lost_child(parent)

    def drop_device(self, node: Any) -> None:
        """``node`` loses its device copy: host-only when backed up, else deleted (with its subtree)."""
        if node.host_value is not None:
            self.slots.free(node.value)
            node.value = None
            self.lost_child(node.parent)
            self.maybe_host_candidate(node)  # host-only now: a host leaf, if childless
        else:
            self.delete(node)

    # ------------------------------------------------------------------ locks and pins
    def inc_lock_ref(self, node: Any) -> None:
        """Protect ``node`` and its ancestors from eviction."""
        root = self.root
        while node is not root:
            if not node.lock_ref and not node.evicted:
                self.protected += node.num_tokens
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Any) -> None:
        """Release a lock taken with :meth:`inc_lock_ref`; ``RuntimeError`` if a count would go negative."""
        root = self.root
        x = node
        while x is not root:
            if x.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref: {x} is not locked")
            x = x.parent
        while node is not root:
            node.lock_ref -= 1
            if not node.lock_ref:
                self._unlocked(node)
            node = node.parent
        if self.lost:
            self._release_lost()

    def pin_host(self, node: Any) -> None:
        """A storage backup starts reading ``node``'s host copy: host eviction leaves it until unpinned."""
        self.host_pins[node.id] = self.host_pins.get(node.id, 0) + 1

    def unpin_host(self, node: Any) -> None:
        left = self.host_pins[node.id] - 1
        if left:
            self.host_pins[node.id] = left
        else:
            del self.host_pins[node.id]
            self.maybe_host_candidate(node)  # host eviction may take it again

    def _release_lost(self) -> None:
        """Drop the device copies of lost nodes nobody holds any more, and everything device-resident
        below them (whose prefix is gone); deepest first, so parents go after their children."""
        for x in sorted(self.lost.values(), key=lambda n: depth(self.root, n), reverse=True):
            if x.lock_ref:
                continue  # still in use: the lock's owner releases it later
            for d in reversed(list(self.nodes(x))):  # children before parents; unlocked, as x is
                if d.value is not None:
                    self.drop_device(d)
            self.slots.free(x.value)  # it has its host copy (the load's source)
            x.value = None
            self.lost_child(x.parent)
            self.maybe_host_candidate(x)
            del self.lost[x.id]

    # ------------------------------------------------------------------ kept sizes and candidates (no walks)
    def evictable_size(self) -> int:
        return self.slots.count - self.protected

    def is_device_candidate(self, node: Any) -> bool:
        """Unlocked, on the device, and no child on the device (children an eviction in progress has
        picked count as gone)."""
        if node.lock_ref or node.evicted:
            return False
        chosen = self.chosen
        if self.compiled is not None:  # ids straight from the core: no handle per child
            core = self.compiled.core
            return all(c in chosen or not core.has_value(c) for c in core.children(node.id))
        return all(c.evicted or c.id in chosen for c in node.children.values())

    def is_host_candidate(self, node: Any) -> bool:
        """Host-only, unlocked, childless, and no storage backup reading its host copy."""
        return (
            not node.lock_ref
            and node.evicted
            and node.host_value is not None
            and not (self.compiled.core.children(node.id) if self.compiled is not None else node.children)
            and node.id not in self.host_pins
        )

    def maybe_device_candidate(self, node: Any) -> None:
        """``node`` may have become a device eviction candidate (checked when popped)."""
        if self.device_candidates is not None:
            self.device_candidates.push(node)

    def maybe_host_candidate(self, node: Any) -> None:
        """``node`` may have become a host eviction candidate (checked when popped)."""
        if self.host_candidates is not None:
            self.host_candidates.push(node)

    def gained_device(self, node: Any) -> None:
        """``node`` got device slots: protected tokens if it is locked, else maybe a device leaf."""
        if node.lock_ref:
            self.protected += node.num_tokens
        else:
            self.maybe_device_candidate(node)

    def _unlocked(self, node: Any) -> None:
        """``node``'s last lock went: its tokens are evictable again, and it may be a candidate."""
        if not node.evicted:
            self.protected -= node.num_tokens
            self.maybe_device_candidate(node)
        elif node.host_value is not None:
            self.maybe_host_candidate(node)

    def lost_child(self, parent: Any) -> None:
        """A child of ``parent`` lost its device copy or left the tree: ``parent`` may be a leaf now."""
        if parent is not self.root:
            self.maybe_device_candidate(parent)
            self.maybe_host_candidate(parent)
