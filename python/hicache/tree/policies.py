"""Eviction policies: which evictable node goes first.

A policy maps a node to a sort key; the node with the smallest key is evicted first. Policies are
looked up by name (``lru``, ``lfu``, ``slru``, ``fifo``, ``priority``) or passed as objects with a
``key(node)`` method, so a deployment can plug in its own.
"""

from __future__ import annotations

from typing import Any, Protocol


class EvictionPolicy(Protocol):
    """``key(node)``: smallest first. ``monotonic = True`` promises a node's key never decreases while
    it lives (true of every built-in policy: access times, hit counts and priorities only grow), which
    lets the cache keep its candidates ordered as nodes change (:mod:`hicache.tree.candidates`); a policy
    without it is served by sorting the candidates at each eviction (a walk of the tree)."""

    name: str

    def key(self, node: Any) -> tuple: ...


class LRU:
    """Least recently used first."""

    name = "lru"
    monotonic = True

    def key(self, node: Any) -> tuple:
        return (node.last_access_time, node.id)


class LFU:
    """Fewest hits first; ties broken by age of last access."""

    name = "lfu"
    monotonic = True

    def key(self, node: Any) -> tuple:
        return (node.hit_count, node.last_access_time, node.id)


class SLRU:
    """Segmented LRU: nodes hit fewer than ``protected_hits`` times (the probationary segment) go
    before any protected node, each segment in LRU order."""

    name = "slru"
    monotonic = True

    def __init__(self, protected_hits: int = 2) -> None:
        self.protected_hits = protected_hits

    def key(self, node: Any) -> tuple:
        return (node.hit_count >= self.protected_hits, node.last_access_time, node.id)


class FIFO:
    """Oldest inserted first."""

    name = "fifo"
    monotonic = True

    def key(self, node: Any) -> tuple:
        return (node.creation_time, node.id)


class Priority:
    """Lowest ``node.priority`` first (set by the caller on insert), then LRU."""

    name = "priority"
    monotonic = True

    def key(self, node: Any) -> tuple:
        return (node.priority, node.last_access_time, node.id)


POLICIES = {p.name: p for p in (LRU, LFU, SLRU, FIFO, Priority)}


def get_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy by name, or the given object if it has a ``key`` method."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"eviction_policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
        return POLICIES[policy]()
    if not callable(getattr(policy, "key", None)):
        raise TypeError(f"eviction_policy: expected a name or an object with key(node), got {type(policy).__name__}")
    return policy
