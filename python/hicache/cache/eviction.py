"""Eviction from both tiers of a :class:`~hicache.cache.radix_cache.HiRadixCache`: device leaves to the host
(or deleted when not backed up), host-only leaves deleted; least valuable first by the cache's policy.
Locked nodes stay in both tiers; host-pinned ones (a storage backup reading them) stay on the host.

:class:`Eviction` picks and drops; it copies nothing. Under ``write_back`` the cache backs up the picked
nodes that have no host copy before :meth:`Eviction.drop` takes their device copies.
"""

from __future__ import annotations

from typing import Any

from ..tree.candidates import Candidates
from .cache_tree import CacheTree

__all__ = ["Eviction"]


class Eviction:
    """Picks eviction victims from ``tree`` 's kept candidates (or, for a policy that cannot be kept
    ordered, from a sort of the leaves) and removes them."""

    def __init__(self, tree: CacheTree) -> None:
        self.tree = tree

    def pick_device(self, num_tokens: int) -> list[Any]:
        """Device leaves worth at least ``num_tokens`` (fewer if there are not), least valuable first;
        a parent whose last device child is picked becomes a candidate in the same call. Children come
        before their parents (a parent is evictable only once its device children are gone)."""
        tree = self.tree
        chosen: list[Any] = []
        planned = 0
        cands = tree.device_candidates
        if cands is None:  # a policy that cannot be kept ordered: sort the leaves (a walk)
            if tree.compiled is not None:
                leaves = [tree.compiled.node(i) for i in tree.compiled.core.leaves(0)]
            else:
                leaves = [n for n in tree.nodes() if not n.evicted and all(c.evicted for c in n.children.values())]
            cands = Candidates(tree.policy.key, tree.is_device_candidate)
            cands.push_all(leaves)
        tree.chosen = picked = set()
        try:
            while planned < num_tokens:
                x = cands.pop()
                if x is None:
                    break
                chosen.append(x)
                picked.add(x.id)
                planned += x.num_tokens
                if x.parent is not tree.root:
                    cands.push(x.parent)
        finally:
            tree.chosen = set()
        return chosen

    def unpick(self, chosen: list[Any]) -> None:
        """Nodes picked but not evicted (a write-back that failed): candidates again."""
        for x in chosen:
            self.tree.maybe_device_candidate(x)

    def drop(self, chosen: list[Any]) -> int:
        """Take the device copies of ``chosen`` (in pick order); returns the device slots freed."""
        freed = 0
        for x in chosen:
            freed += x.num_tokens
            self.tree.drop_device(x)
        self.tree.metrics.device_evicted_tokens += freed
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots if possible by deleting host-only leaves."""
        tree = self.tree
        cands = tree.host_candidates
        if cands is None:  # a policy that cannot be kept ordered: sort the leaves (a walk)
            if tree.compiled is not None:
                leaves = [tree.compiled.node(i) for i in tree.compiled.core.leaves(1)]
            else:
                leaves = [n for n in tree.nodes() if n.evicted and not n.children]
            cands = Candidates(tree.policy.key, tree.is_host_candidate)
            cands.push_all(leaves)
        freed = 0
        while freed < num_tokens:
            x = cands.pop()
            if x is None:
                break
            parent = x.parent
            freed += len(x.host_value)
            tree.delete(x)
            if parent is not tree.root:
                cands.push(parent)  # childless now, perhaps
        return freed
