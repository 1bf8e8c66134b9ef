"""The compiled radix-tree core of :class:`~hicache.cache.radix_cache.HiRadixCache` and its node handles.

The tree has two interchangeable cores:

- ``python``: :class:`~hicache.tree.nodes.TreeNode` objects holding everything; the reference.
- ``compiled``: ``hicache._core.RadixTree`` (C++, ``csrc/host/radix_tree.cpp``) holds every node's
  token key, topology, device slots and access counters, and runs ``match_prefix`` and ``insert``
  (walk, split, touch, the check of the caller's slots, new node) in one call each. Nodes are
  :class:`CompiledNode` handles, made on first use (one per node, so ``is`` works), whose attributes
  read and write the core; what only Python needs (host slots, lock counts) lives on the handle.

Both give the same results for the same calls (``tests/tree/test_tree_core.py`` runs them side by side on
random operation sequences). ``HiRadixCache(tree_core=...)`` picks one: ``"auto"`` (the default, or
the ``HICACHE_TREE_CORE`` environment variable) takes the compiled core when the host core
``hicache._core`` is built (every build makes it, with or without CUDA: :mod:`hicache.native`), else the
Python one; ``cache.tree_core`` says which, ``cache.tree_core_reason`` why.
"""

from __future__ import annotations

import array
import os
from typing import Any

import numpy as np
import torch

from ..native import core_status, load_core

TREE_CORES = ("auto", "compiled", "python")
ENV = "HICACHE_TREE_CORE"

# The core's per-node counters (RadixTree.meta / set_meta) and flags (flag / set_flag).
_HIT, _ACCESS, _CREATION, _PRIORITY = 0, 1, 2, 3
_HAS_HOST, _LOST = 0, 1
# Touch modes of RadixTree.match / insert, by write policy.
TOUCH = {"write_back": 0, "write_through_selective": 1, "write_through": 2}


def compiled_core_status() -> tuple[bool, str]:
    """``(True, "ok")`` when the compiled core (``hicache._core``) can be used, else ``(False, reason)``."""
    return core_status()


def choose_core(tree_core: str | None) -> tuple[str, str]:
    """``(core, reason)`` for ``HiRadixCache(tree_core=...)``: ``"compiled"`` or ``"python"``.

    ``None`` reads ``HICACHE_TREE_CORE`` (default ``"auto"``). ``"compiled"`` raises ``RuntimeError``
    with the reason when the compiled core cannot be used; ``"auto"`` then takes the Python core and
    the reason says why.
    """
    source = "tree_core"
    if tree_core is None:
        tree_core, source = os.environ.get(ENV, "auto").strip() or "auto", ENV
    if tree_core not in TREE_CORES:
        raise ValueError(f"{source}: expected one of {', '.join(TREE_CORES)}, got {tree_core!r}")
    if tree_core == "python":
        return "python", f"asked for ({source}=python)"
    ok, reason = compiled_core_status()
    if ok:
        return "compiled", f"hicache._core.RadixTree ({source}={tree_core})"
    if tree_core == "compiled":
        raise RuntimeError(f"{source}: the compiled tree core cannot be used: {reason}")
    return "python", f"the compiled core cannot be used: {reason}"


_INT_TYPECODES = frozenset("bBhHiIlLqQ")


def token_source(tokens: Any) -> Any:
    """``tokens`` in a form the core converts in one pass: lists and tuples as they are (each item an
    int or anything with ``__index__``), tensors, numpy arrays and integer ``array.array`` s (SGLang's
    ``Req`` holds its ids in an ``array('q')``) as 1-D integer numpy arrays over the same memory;
    ``TypeError`` naming ``tokens`` for float or non-1-D data."""
    if type(tokens) is list or type(tokens) is tuple:
        return tokens
    if type(tokens) is array.array and tokens.typecode in _INT_TYPECODES:  # what SGLang's Req holds: read in place
        return np.frombuffer(tokens, dtype=tokens.typecode) if len(tokens) else np.empty(0, dtype=np.int64)
    if isinstance(tokens, torch.Tensor):
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"tokens: expected integer token ids, got a {tokens.dtype} tensor")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens: expected a 1-D integer array, got {tokens.dtype} with shape {tokens.shape}")
        return tokens
    return list(tokens)


class CompiledNode:
    """A node of the compiled core (same attributes as :class:`~hicache.tree.nodes.TreeNode`).

    ``key``, ``children``, ``parent``, ``value`` and the counters are read from (and written to) the
    core on each access; ``host_value`` and ``lock_ref`` live here. A removed node reads as detached:
    no parent, children or device slots.
    """

    __slots__ = ("id", "_tree", "_host", "lock_ref", "_dead")

    def __init__(self, tree: CompiledTree, node_id: int) -> None:
        self.id = node_id
        self._tree = tree
        self._host: torch.Tensor | None = None
        self.lock_ref = 0
        self._dead = False

    # topology and key
    @property
    def parent(self) -> CompiledNode | None:
        if self._dead:
            return None
        pid = self._tree.core.parent(self.id)
        return None if pid < 0 else self._tree.node(pid)

    @property
    def key(self) -> tuple[int, ...]:
        return () if self._dead else self._tree.core.key(self.id)

    @property
    def children(self) -> dict[tuple[int, ...], CompiledNode]:
        if self._dead:
            return {}
        t = self._tree
        ps = t.page_size
        return {t.core.key(c)[:ps]: t.node(c) for c in t.core.children(self.id)}

    # device and host copies
    @property
    def value(self) -> torch.Tensor | None:
        if self._dead:
            return None
        slots = self._tree.core.slots(self.id)
        return None if slots is None else torch.from_numpy(slots)

    @value.setter
    def value(self, v: torch.Tensor | None) -> None:
        if self._dead:
            if v is not None:
                raise RuntimeError(f"{self!r} was removed from the tree")
            return
        if v is None:
            self._tree.core.set_slots(self.id, None)
        else:
            self._tree.core.set_slots(self.id, np.ascontiguousarray(v.numpy(), dtype=np.int64))

    @property
    def host_value(self) -> torch.Tensor | None:
        return self._host

    @host_value.setter
    def host_value(self, v: torch.Tensor | None) -> None:
        self._host = v
        if not self._dead:
            self._tree.core.set_flag(self.id, _HAS_HOST, v is not None)

    @property
    def evicted(self) -> bool:
        """No device copy."""
        return self._dead or not self._tree.core.has_value(self.id)

    @property
    def backuped(self) -> bool:
        """Has a host copy (complete unless the node is locked by its backup)."""
        return self._host is not None

    # counters
    def _meta(self, which: int) -> int:
        return 0 if self._dead else self._tree.core.meta(self.id, which)

    def _set_meta(self, which: int, v: int) -> None:
        if not self._dead:
            self._tree.core.set_meta(self.id, which, v)

    hit_count = property(lambda self: self._meta(_HIT), lambda self, v: self._set_meta(_HIT, v))
    last_access_time = property(lambda self: self._meta(_ACCESS), lambda self, v: self._set_meta(_ACCESS, v))
    creation_time = property(lambda self: self._meta(_CREATION), lambda self, v: self._set_meta(_CREATION, v))
    priority = property(lambda self: self._meta(_PRIORITY), lambda self, v: self._set_meta(_PRIORITY, v))

    @property
    def num_tokens(self) -> int:
        """Tokens of the edge (``len(key)`` without building the key)."""
        return 0 if self._dead else self._tree.core.length(self.id)

    def __repr__(self) -> str:
        if self._dead:
            return f"CompiledNode(id={self.id}, removed)"
        return (
            f"CompiledNode(id={self.id}, tokens={self.num_tokens}, device={not self.evicted}, "
            f"host={self._host is not None}, lock_ref={self.lock_ref})"
        )


class CompiledTree:
    """The core (``hicache._core.RadixTree``) and the handles of its nodes (made on first use)."""

    def __init__(self, page_size: int, states: np.ndarray, owned: np.ndarray) -> None:
        self.page_size = page_size
        self.core = load_core().RadixTree(page_size)
        self.core.bind_slots(states, owned)  # validate once: the pool's state bytes and the ownership bytes
        self._handles: dict[int, CompiledNode] = {}

    def node(self, node_id: int) -> CompiledNode:
        h = self._handles.get(node_id)
        if h is None:
            h = self._handles[node_id] = CompiledNode(self, node_id)
        return h

    def remove(self, node: CompiledNode) -> None:
        """Remove ``node`` and its subtree from the core; their handles read as removed."""
        for i in self.core.remove(node.id):
            h = self._handles.pop(i, None)
            if h is not None:
                h._dead = True

    def attached(self, node: CompiledNode) -> bool:
        return not node._dead and node._tree is self and self.core.alive(node.id)
