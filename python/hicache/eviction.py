"""Eviction from both tiers of a :class:`~hicache.radix_cache.HiRadixCache`: device leaves to the host
(or deleted when not backed up), host-only leaves deleted; least valuable first by the cache's policy.
Locked nodes stay in both tiers; host-pinned ones (a storage backup reading them) stay on the host."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .candidates import Candidates

if TYPE_CHECKING:
    from .radix_cache import HiRadixCache
    from .tree import TreeNode


class Eviction:
    """Mixin of :class:`~hicache.radix_cache.HiRadixCache`: ``evict``, ``evict_host`` and the node
    removal they share. Uses the cache's tree, pools, policy, ``_slots`` and the storage tier's pins."""

    def _is_device_leaf(self: HiRadixCache, node: TreeNode) -> bool:
        return not node.evicted and all(c.evicted for c in self._child_nodes(node))

    def _delete(self: HiRadixCache, node: TreeNode) -> None:
        """Remove ``node`` and its subtree, freeing every slot they own (none may be in flight)."""
        for x in [node, *self._nodes(node)]:
            if x.value is not None:
                self._slots.free(x.value)
            if x.host_value is not None:
                self._free_host(x.host_value)  # held while the storage backend may still read it
                self.metrics.host_evicted_tokens += x.num_tokens
            x.value = x.host_value = None
            self._node_keys.pop(x.id, None)
        parent = node.parent
        if self._tree is not None:
            self._tree.remove(node)
        else:
            del parent.children[node.key[: self.page_size]]
        self._lost_child(parent)

    def _drop_device(self: HiRadixCache, node: TreeNode) -> None:
        """``node`` loses its device copy: host-only when backed up, else deleted (with its subtree)."""
        if node.host_value is not None:
            self._slots.free(node.value)
            node.value = None
            self._lost_child(node.parent)
            self._maybe_host_candidate(node)  # host-only now: a host leaf, if childless
        else:
            self._delete(node)

    def evict(self: HiRadixCache, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots if possible, least valuable device leaves first.

        Backed-up nodes keep their host copy and stay in the tree; others are written to the host
        first under ``write_back``, else deleted. Returns the device slots freed. Under ``write_back``,
        :class:`CopyError` when a backup failed (nothing is evicted then).
        """
        self._check_open("evict")
        chosen = self._pick_device(num_tokens)
        if self.write_policy == "write_back":
            pending = [x for x in chosen if x.host_value is None]
            if pending:
                try:
                    self._backup_many(pending)  # one copy op for all of them
                    # Write-back: the host copy must exist before the device copy goes (the storage backups
                    # these host copies start are not waited for).
                    self.controller.flush()
                    self._take_acks()
                except BaseException:  # nothing is evicted: the picked nodes are candidates again
                    for x in chosen:
                        self._maybe_device_candidate(x)
                    raise
                chosen = [x for x in chosen if x.value is not None]  # acks may have released lost subtrees
        freed = 0
        # Children before parents: a parent is only evictable once its device children are gone.
        for x in chosen:
            freed += x.num_tokens
            self._drop_device(x)
        self.metrics.device_evicted_tokens += freed
        return freed

    def _pick_device(self: HiRadixCache, num_tokens: int) -> list[TreeNode]:
        """Device leaves worth at least ``num_tokens`` (fewer if there are not), least valuable first;
        a parent whose last device child is picked becomes a candidate in the same call."""
        chosen: list[TreeNode] = []
        planned = 0
        cands = self._device_candidates
        if cands is None:  # a policy that cannot be kept ordered: sort the leaves (a walk)
            if self._tree is not None:
                leaves = [self._tree.node(i) for i in self._tree.core.leaves(0)]
            else:
                leaves = [n for n in self._nodes() if self._is_device_leaf(n)]
            cands = Candidates(self.policy.key, self._is_device_candidate)
            cands.push_all(leaves)
        self._chosen = picked = set()
        try:
            while planned < num_tokens:
                x = cands.pop()
                if x is None:
                    break
                chosen.append(x)
                picked.add(x.id)
                planned += x.num_tokens
                if x.parent is not self.root:
                    cands.push(x.parent)
        finally:
            self._chosen = set()
        return chosen

    def evict_host(self: HiRadixCache, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots if possible by deleting host-only leaves."""
        self._check_open("evict_host")
        cands = self._host_candidates
        if cands is None:  # a policy that cannot be kept ordered: sort the leaves (a walk)
            if self._tree is not None:
                leaves = [self._tree.node(i) for i in self._tree.core.leaves(1)]
            else:
                leaves = [n for n in self._nodes() if n.evicted and not n.children]
            cands = Candidates(self.policy.key, self._is_host_candidate)
            cands.push_all(leaves)
        freed = 0
        while freed < num_tokens:
            x = cands.pop()
            if x is None:
                break
            parent = x.parent
            freed += len(x.host_value)
            self._delete(x)
            if parent is not self.root:
                cands.push(parent)  # childless now, perhaps
        return freed
