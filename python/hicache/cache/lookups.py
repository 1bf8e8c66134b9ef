"""The two operations on a :class:`~hicache.cache.radix_cache.HiRadixCache` 's request path: ``match_prefix``
and ``insert``, on either tree core. Each walks one path of the tree (the compiled core: one C++ call),
touches its nodes (hit counts, access times by the logical clock) and tells the cache which nodes its
write policy now wants backed up; it starts no copy itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..controller.metrics import CacheMetrics
from ..tree.core import TOUCH, token_source
from ..tree.nodes import MatchResult, TreeNode, match_path, page_key
from .cache_tree import CacheTree

__all__ = ["Lookups"]


class Lookups:
    """``match`` and ``insert`` over ``tree`` under ``write_policy`` (see the cache's docstring), with
    ``write_through_threshold`` hits making a node worth a backup under ``write_through_selective``."""

    def __init__(self, tree: CacheTree, write_policy: str, write_through_threshold: int, metrics: CacheMetrics) -> None:
        self.tree = tree
        self.root = tree.root
        self.page_size = tree.page_size
        self.slots = tree.slots
        self.lost = tree.lost
        self.compiled = tree.compiled
        self.write_policy = write_policy
        self.write_through_threshold = write_through_threshold
        self.metrics = metrics
        self.touch_mode = TOUCH[write_policy]

    def touch(self, node: TreeNode) -> bool:
        """A hit on ``node``; True when ``write_through_selective`` now wants it backed up (the caller
        backs up every such node of one call in one copy op, :meth:`~hicache.cache.copy_acks.CopyAcks.backup_many`)."""
        node.last_access_time = self.tree.tick()
        node.hit_count += 1
        return (
            self.write_policy == "write_through_selective"
            and node.hit_count >= self.write_through_threshold
            and node.value is not None
            and node.host_value is None
        )

    def match(self, tokens: Any) -> tuple[MatchResult, list]:
        """``HiRadixCache.match_prefix``; also returns the nodes this hit made worth a backup."""
        if self.compiled is not None:
            return self._match_compiled(tokens)
        key = page_key(tokens, self.page_size)
        device: list[torch.Tensor] = []
        last_device = last_host = self.root
        host_len = 0
        dev_len = 0
        path, _, cut = match_path(self.root, key, self.page_size)
        if cut:
            path[-1] = self.tree.split(path[-1], cut)
        touch = self.touch if self.write_policy == "write_through_selective" else None
        backups: list[TreeNode] = []
        lost = self.lost
        for node in path:
            if lost and node.id in lost:
                break  # its device KV is lost (failed load-back) and it has no usable copy until released
            if touch is None:  # _touch, inlined: the clock ticks once per node
                self.tree.clock += 1
                node.last_access_time = self.tree.clock
                node.hit_count += 1
            elif touch(node):
                backups.append(node)
            if node.value is not None:
                device.append(node.value)
                dev_len += len(node.key)
                last_device = node
            else:
                host_len += len(node.key)
            last_host = node
        indices = torch.cat(device) if device else torch.empty(0, dtype=torch.int64)  # a copy: the caller's
        m = self.metrics
        m.device_hit_tokens += dev_len
        m.host_hit_tokens += host_len
        m.miss_tokens += len(tokens) - dev_len - host_len
        return MatchResult(indices, last_device, last_host, host_len), backups

    def insert(self, tokens: Any, device_indices: torch.Tensor, priority: int) -> tuple[int, list]:
        """``HiRadixCache.insert``; also returns the nodes to back up (new ones, or hot ones)."""
        if self.compiled is not None:
            return self._insert_compiled(tokens, device_indices, priority)
        key = page_key(tokens, self.page_size)
        if len(key) != len(tokens):
            raise ValueError(
                f"tokens: expected a page-aligned key (a multiple of page_size {self.page_size}), got {len(tokens)}; "
                "device_indices: one slot per token"
            )
        s = self.slots.as_array(device_indices, len(key))
        path, end, cut = match_path(self.root, key, self.page_size)
        # Device-resident nodes come first on a path (invariant); the host-only ones after them get the
        # caller's slots, as does everything past the match.
        dup = 0
        cached: list[torch.Tensor] = []
        for node in path:
            if node.value is None:
                break
            if cut and node is path[-1]:
                cached.append(node.value[:cut])
                dup += cut
            else:
                cached.append(node.value)
                dup += len(node.key)
        # Usually the caller passes the tree's own slots back for the cached part: those need no check
        # (allocated, whole pages, and owned, so distinct from the unowned ones the tree takes), only
        # the rest does. Anything else, or a fault, goes through the full check, which names it.
        slots = self.slots
        try:
            fast = slots.is_cached(s[:dup], cached)
            if fast:
                slots.check(s[dup:])
                slots.check_unowned(s[dup:])
        except ValueError:
            fast = False
        if not fast:
            slots.check_insert(s, dup, cached)
        # Checked: from here on nothing raises. One copy of the slots the tree takes (the caller keeps
        # its tensor); the nodes hold views of it.
        taken = torch.from_numpy(s[dup:].copy())
        if cut:
            path[-1] = self.tree.split(path[-1], cut)
        touch = self.touch if self.write_policy == "write_through_selective" else None
        backups: list[TreeNode] = []
        node, pos = self.root, 0
        for node in path:
            n = len(node.key)
            if node.value is None:
                node.value = taken[pos - dup : pos - dup + n]
                self.slots.take(node.value)
                self.tree.gained_device(node)
            if priority > node.priority:
                node.priority = priority
            if touch is None:  # _touch, inlined
                self.tree.clock += 1
                node.last_access_time = self.tree.clock
                node.hit_count += 1
            elif touch(node):
                backups.append(node)
            pos += n
        if pos < len(key):
            new = TreeNode(next(self.tree.ids), node, key[pos:], self.tree.tick())
            new.value = taken[pos - dup :]
            self.slots.take(new.value)
            new.priority = priority
            node.children[new.key[: self.page_size]] = new
            new.hit_count = 1
            self.tree.gained_device(new)
            if self.write_policy == "write_through":
                backups.append(new)
        return dup, backups  # the new node (write_through) or the hot ones (selective)

    def _match_compiled(self, tokens: Any) -> tuple[MatchResult, list]:
        t = self.compiled
        src = tokens if type(tokens) is list else token_source(tokens)
        n = len(src)
        slots, dev_len, host_len, last_dev, last_host, splits, backups = t.core.match(
            src, n - n % self.page_size, self.touch_mode, self.write_through_threshold
        )
        if splits:
            self.tree.after_splits(splits)
        m = self.metrics
        m.device_hit_tokens += dev_len
        m.host_hit_tokens += host_len
        m.miss_tokens += n - dev_len - host_len
        result = MatchResult(torch.from_numpy(slots), t.node(last_dev), t.node(last_host), host_len)
        return result, [t.node(i) for i in backups] if backups else backups

    def _insert_compiled(self, tokens: Any, device_indices: torch.Tensor, priority: int) -> tuple[int, list]:
        t = self.compiled
        src = tokens if type(tokens) is list else token_source(tokens)
        n = len(src)
        if n % self.page_size:
            raise ValueError(
                f"tokens: expected a page-aligned key (a multiple of page_size {self.page_size}), got {n}; "
                "device_indices: one slot per token"
            )
        s = self.slots.as_array(device_indices, n)
        if not s.flags.c_contiguous:
            s = np.ascontiguousarray(s)
        mode, threshold = self.touch_mode, self.write_through_threshold
        status, dup, cached, splits, backups, new, revived = t.core.insert(src, s, priority, mode, threshold, False)
        if status:  # not the usual slots: the full check names the fault, or accepts them
            self.slots.check_insert(s, dup, [torch.from_numpy(cached)])
            status, dup, _, splits, backups, new, revived = t.core.insert(src, s, priority, mode, threshold, True)
        self.slots.took(n - dup)
        if splits:
            self.tree.after_splits(splits)
        for node_id in revived:
            self.tree.gained_device(t.node(node_id))
        if new >= 0:
            self.tree.gained_device(t.node(new))
        return dup, [t.node(i) for i in backups] if backups else backups
