"""Radix-tree nodes of :class:`~hicache.cache.radix_cache.HiRadixCache` and read-only walks over them."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
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

    @property
    def num_tokens(self) -> int:
        """Tokens of the edge (as :attr:`CompiledNode.num_tokens <hicache.tree.core.CompiledNode.num_tokens>`)."""
        return len(self.key)

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


def _index_all(key: tuple) -> tuple[int, ...]:
    try:
        return tuple(map(operator.index, key))
    except TypeError:
        bad = next(t for t in key if not hasattr(type(t), "__index__"))
        raise TypeError(f"tokens: expected integer token ids, got {type(bad).__name__}") from None


def page_key(tokens: Any, page_size: int) -> tuple[int, ...]:
    """``tokens`` as a tuple of ints cut to whole pages: the one conversion of a tree call.

    A list or tuple whose first and last items are Python ints is taken as it is (``tuple()`` in C, no
    per-token conversion); integer tensors and arrays go through ``tolist()``; anything else through
    ``operator.index`` per token (numpy integers pass, floats raise ``TypeError`` naming ``tokens``).
    Equal ints compare and hash equal whatever their type, so this changes speed, never which prefix
    matches. A float inside a list whose ends are ints is kept as a token that no int equals (a miss,
    never a wrong hit); the compiled core refuses it.
    """
    if type(tokens) is list or type(tokens) is tuple:
        key = tuple(tokens)
        if key and (type(key[0]) is not int or type(key[-1]) is not int):
            key = _index_all(key)
    elif isinstance(tokens, (torch.Tensor, np.ndarray)):
        if tokens.ndim != 1 or (
            tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool
            if isinstance(tokens, torch.Tensor)
            else tokens.dtype.kind not in "iu"
        ):
            raise TypeError(f"tokens: expected a 1-D integer tensor or array, got {tokens.dtype} {tuple(tokens.shape)}")
        key = tuple(tokens.tolist())
    else:
        key = _index_all(tuple(tokens))
    cut = len(key) % page_size
    return key[: len(key) - cut] if cut else key


def _common(edge: tuple[int, ...], key: tuple[int, ...], pos: int, page_size: int) -> int:
    """Page-aligned length of the common prefix of ``edge`` and ``key[pos:]``, for an edge that does not
    match whole: bisection over slice comparisons, so tokens are compared in C, not one by one."""
    limit = min(len(edge), len(key) - pos)
    if edge[:limit] == key[pos : pos + limit]:
        lo = limit  # the key ends inside the edge
    else:
        lo, hi = 0, limit  # edge[:lo] matches; the first difference lies in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if edge[lo:mid] == key[pos + lo : pos + mid]:
                lo = mid
            else:
                hi = mid
    return lo - lo % page_size


def match_path(root: TreeNode, key: tuple[int, ...], page_size: int) -> tuple[list[TreeNode], int, int]:
    """The nodes a page-aligned ``key`` runs through from ``root``, top-down, without changing the tree:
    ``(path, matched, cut)``. ``matched`` tokens match; ``cut`` > 0 when the key leaves the last node
    after ``cut`` of its tokens (the caller splits it there before using it), else 0.

    An edge that matches whole (the usual case) costs one slice of the key and one tuple comparison,
    both in C; the rest of the key is never copied.
    """
    node, pos, path = root, 0, []
    size = len(key)
    while pos < size:
        child = node.children.get(key[pos : pos + page_size])
        if child is None:
            break
        edge = child.key
        n = len(edge)
        path.append(child)
        if key[pos : pos + n] != edge:
            n = _common(edge, key, pos, page_size)
            if n < len(edge):
                return path, pos + n, n
        pos += n
        node = child
    return path, pos, 0


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
