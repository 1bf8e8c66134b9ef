"""Eviction candidates of one tier, kept as nodes change, so eviction never walks the tree.

A :class:`Candidates` is a lazy min-heap of ``(policy key, node id, node)``: the cache pushes a node
whenever it may have *become* a candidate (a lock released, a child dropped, a device copy gained or
lost), and eviction pops. A popped entry is checked then: no longer a candidate (locked, gone, a
child came back) and it is dropped; its key grew since the push (the node was hit) and it goes back
with the new key. That is exact for the built-in policies, whose keys never decrease over a node's
life (``policy.monotonic``): every candidate's current key is at least its stored one, so the first
entry popped whose stored key is current is the least valuable candidate, as a full sort would find.
A node is in the heap at most once (``_queued``), so the heap holds at most one entry per node.

With the compiled tree core and a built-in policy, :class:`CompiledCandidates` keeps the same heap in
the core (``hicache._core.CandidateHeap``: the keys come from the core's counters, no Python per
entry); a custom policy keeps the Python heap, which calls its ``key``.

A custom policy object without ``monotonic = True`` cannot be ordered this way: the cache then
collects and sorts the candidates at each eviction (a walk of the tree, documented as the slow path).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from ..native import load_core


class Candidates:
    """Eviction candidates of one tier (module docstring).

    Parameters
    ----------
    key : the policy's ``key(node)`` (a tuple ending in the node id: no two entries compare equal).
    is_candidate : whether a node is a candidate now (called on pop).
    """

    def __init__(self, key: Callable[[Any], tuple], is_candidate: Callable[[Any], bool]) -> None:
        self._key = key
        self._is_candidate = is_candidate
        self._heap: list[tuple[tuple, int, Any]] = []
        self._queued: set[int] = set()

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, node_id: int) -> bool:
        return node_id in self._queued

    def push(self, node: Any) -> None:
        """``node`` may have become a candidate (checked when popped)."""
        if node.id not in self._queued:
            self._queued.add(node.id)
            heapq.heappush(self._heap, (self._key(node), node.id, node))

    def push_all(self, nodes: Iterable[Any]) -> None:
        for node in nodes:
            self.push(node)

    def pop(self) -> Any | None:
        """The least valuable candidate (taken out of the heap), or None when there is none."""
        heap, queued = self._heap, self._queued
        while heap:
            stored, node_id, node = heapq.heappop(heap)
            queued.discard(node_id)
            if not self._is_candidate(node):
                continue
            key = self._key(node)
            if key != stored:  # hit since it was pushed: its place is further back
                queued.add(node_id)
                heapq.heappush(heap, (key, node_id, node))
                continue
            return node
        return None

    def rebuild(self, nodes: Iterable[Any]) -> None:
        """Start over from ``nodes`` (every candidate among them is queued): a walk, for inspection paths."""
        self._heap = [(self._key(n), n.id, n) for n in nodes if self._is_candidate(n)]
        heapq.heapify(self._heap)
        self._queued = {i for _, i, _ in self._heap}


# The built-in policies (hicache.tree.policies) by exact type, as the compiled heap's policy codes.
_POLICY_CODES = {"LRU": 0, "LFU": 1, "SLRU": 2, "FIFO": 3, "Priority": 4}


def compiled_policy(policy: Any) -> tuple[int, int] | None:
    """``(code, param)`` of a built-in policy for :class:`CompiledCandidates`, or None for anything else
    (a subclass may change ``key``: it keeps the Python heap)."""
    from . import policies  # noqa: PLC0415

    cls = type(policy)
    if getattr(policies, cls.__name__, None) is not cls or cls.__name__ not in _POLICY_CODES:
        return None
    return _POLICY_CODES[cls.__name__], int(getattr(policy, "protected_hits", 0))


class CompiledCandidates:
    """:class:`Candidates` kept in the compiled tree core, for a built-in policy (same interface and
    the same order: the core computes the policy's key from its counters).

    Parameters
    ----------
    tree : the cache's :class:`~hicache.tree.core.CompiledTree`.
    code : ``compiled_policy(policy)``.
    is_candidate : whether a node is a candidate now (called on pop, as :class:`Candidates` does).
    """

    def __init__(self, tree: Any, code: tuple[int, int], is_candidate: Callable[[Any], bool]) -> None:
        self._tree = tree
        self._heap = load_core().CandidateHeap(tree.core, *code)
        self._push = self._heap.push
        self._is_candidate = is_candidate

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, node_id: int) -> bool:
        return node_id in self._heap

    def push(self, node: Any) -> None:
        """``node`` may have become a candidate (checked when popped)."""
        self._push(node.id)

    def push_all(self, nodes: Iterable[Any]) -> None:
        push = self._push
        for node in nodes:
            push(node.id)

    def pop(self) -> Any | None:
        """The least valuable candidate (taken out of the heap), or None when there is none."""
        pop, node = self._heap.pop, self._tree.node
        while True:
            node_id = pop()
            if node_id < 0:
                return None
            x = node(node_id)
            if self._is_candidate(x):
                return x

    def rebuild(self, nodes: Iterable[Any]) -> None:
        """Start over from ``nodes`` (every candidate among them is queued): a walk, for inspection paths."""
        self._heap.clear()
        self.push_all(n for n in nodes if self._is_candidate(n))
