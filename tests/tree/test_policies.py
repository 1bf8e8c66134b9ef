"""Each eviction policy against its own definition (hicache.tree.policies), on both tree cores.

The candidate tests compare the kept heap with a walk under the same policy key, so a wrong key is
wrong in both. Here the test keeps its own record of what happened to each node (inserted when, last
touched when, hit how often, at what priority) and derives the eviction order from the policy's
documented rule; the access pattern is one where every pair of policies disagrees, and where SLRU's
threshold matters by one hit.
"""

from __future__ import annotations

import itertools

import pytest

from cachedata import make_cache, write_kv

SEQ = 2  # tokens per node: every sequence is one leaf under the root
FIRST = {"A": 10, "B": 20, "C": 30, "D": 40, "E": 50, "F": 60}  # each node's first token
PRIORITY = {"A": 2, "B": 0, "C": 1, "D": 0, "E": 3, "F": 0}
# Inserts ("i") and matches ("m") in this order: every policy's first two victims differ, LFU's first
# differs from LRU's, and SLRU's order changes when its threshold moves by one hit either way.
OPS = [("i", "A"), ("i", "B"), ("m", "A"), ("i", "C"), ("i", "D"), ("m", "A"), ("m", "C"), ("i", "E"),
       ("m", "E"), ("m", "D"), ("m", "B"), ("i", "F")]  # fmt: skip


def tokens_of(name: str) -> list[int]:
    return [FIRST[name] + i for i in range(SEQ)]


def model() -> dict[str, dict[str, int]]:
    """What the cache's documented counters hold after OPS: an insert is the node's first hit and
    access; each match of its tokens one more hit and a later access; one clock for both."""
    clock = itertools.count(1)
    nodes: dict[str, dict[str, int]] = {}
    for op, name in OPS:
        t = next(clock)
        if op == "i":
            nodes[name] = {"created": t, "hits": 1, "access": t, "priority": PRIORITY[name]}
        else:
            nodes[name]["hits"] += 1
            nodes[name]["access"] = t
    return nodes


def on_device(cache, tokens: list[int]) -> bool:
    """Whether the leaf of ``tokens`` still has its device copy, read without touching it (a match
    would count as a hit and an access)."""
    (node,) = [c for c in cache.root.children.values() if list(c.key) == tokens]
    return node.value is not None


def definition_order(policy: str, nodes: dict[str, dict[str, int]], protected_hits: int = 2) -> list[str]:
    """The eviction order each policy's docstring defines (least valuable first)."""
    rule = {
        "lru": lambda n: (n["access"],),
        "lfu": lambda n: (n["hits"], n["access"]),
        "slru": lambda n: (n["hits"] >= protected_hits, n["access"]),
        "fifo": lambda n: (n["created"],),
        "priority": lambda n: (n["priority"], n["access"]),
    }[policy]
    return sorted(nodes, key=lambda name: rule(nodes[name]))


def test_the_pattern_tells_every_policy_apart():
    nodes = model()
    orders = {p: definition_order(p, nodes) for p in ("lru", "lfu", "slru", "fifo", "priority")}
    firsts = [tuple(o[:2]) for o in orders.values()]
    assert len(set(firsts)) == len(firsts), orders  # the first two victims differ per policy
    # SLRU moved by one hit either way changes its order; LFU and LRU disagree at the first victim.
    assert definition_order("slru", nodes, 1) != orders["slru"] != definition_order("slru", nodes, 3)
    assert orders["lfu"][0] != orders["lru"][0]


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru", "fifo", "priority"])
def test_eviction_follows_the_policy_definition(each_tree_core, policy):
    cache = make_cache(device_slots=32, host_ratio=2.0, eviction_policy=policy, write_policy="write_through")
    for op, name in OPS:
        tokens = tokens_of(name)
        if op == "i":
            slots = cache.device_pool.alloc(SEQ)
            write_kv(cache, tokens, slots)
            assert cache.insert(tokens, slots, priority=PRIORITY[name]) == 0
        else:
            assert len(cache.match_prefix(tokens).device_indices) == SEQ
    cache.flush()  # backups landed: every node evictable, each keeps its host copy
    evicted = []
    for _ in FIRST:
        assert cache.evict(SEQ) >= SEQ
        gone = [n for n in FIRST if n not in evicted and not on_device(cache, tokens_of(n))]
        assert len(gone) == 1, (evicted, gone)
        evicted += gone
    assert evicted == definition_order(policy, model())
    cache.close()
