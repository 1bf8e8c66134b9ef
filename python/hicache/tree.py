"""Radix-tree nodes of :class:`~hicache.radix_cache.HiRadixCache` and read-only walks over them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


class TreeNode:
    """One edge of the radix tree: ``key`` tokens and the slots that hold their KV."""

    __slots__ = (
        "id",
        "parent",
        "key",
        "children",
        "value",
        "host_value",
        "lock_ref",
        "hit_count",
        "last_access_time",
        "creation_time",
        "priority",
    )

    def __init__(self, node_id: int, parent: TreeNode | None, key: tuple[int, ...], clock: int) -> None:
        self.id = node_id
        self.parent = parent
        self.key = key
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.lock_ref = 0
        self.hit_count = 0
        self.last_access_time = clock
        self.creation_time = clock
        self.priority = 0

    @property
    def evicted(self) -> bool:
        """No device copy."""
        return self.value is None

    @property
    def backuped(self) -> bool:
        """Has a host copy (complete unless the node is locked by its backup)."""
        return self.host_value is not None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key)}, device={self.value is not None}, "
            f"host={self.host_value is not None}, lock_ref={self.lock_ref})"
        )


@dataclass
class MatchResult:
    """What :meth:`HiRadixCache.match_prefix` found.

    ``device_indices``: int64 device slots of the device-resident prefix (``len`` = device hit);
    ``last_device_node``: the deepest matched node with a device copy (the root when none);
    ``last_host_node``: the deepest matched node (device or host copy): pass it to ``load_back``;
    ``host_hit_length``: tokens matched beyond the device prefix that only the host holds.
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


def subtree(start: TreeNode) -> Iterator[TreeNode]:
    """Every node below ``start`` (``start`` excluded), each before its descendants."""
    stack = list(start.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        yield node


def is_attached(root: TreeNode, node: TreeNode, page_size: int) -> bool:
    """``node`` is reachable from ``root``: not deleted (eviction keeps a deleted node's parent pointer)."""
    while node is not root:
        parent = node.parent
        if parent is None or parent.children.get(node.key[:page_size]) is not node:
            return False
        node = parent
    return True


def depth(root: TreeNode, node: TreeNode) -> int:
    """Edges from ``root`` down to ``node``."""
    n = 0
    while node is not root:
        node, n = node.parent, n + 1
    return n


def copy_chain(root: TreeNode, node: TreeNode, host: torch.Tensor) -> list[TreeNode]:
    """The nodes holding the host slots ``host`` of one copy that was issued for ``node``: ``node`` and
    the upper halves that splits cut off it while the copy was in flight (its ancestors, contiguous),
    bottom-up. Host slots have one owner, so owning the first slot of ``host_value`` decides."""
    slots = set(host.tolist())
    out: list[TreeNode] = []
    while node is not root and node.host_value is not None and len(node.host_value):
        if int(node.host_value[0]) not in slots:
            break
        out.append(node)
        node = node.parent
    return out
