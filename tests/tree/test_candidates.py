"""The counters and eviction candidates the cache keeps as nodes change (hicache.tree.candidates), against
the walk they replace: randomized operations on both tree cores and every eviction policy, the kept
sizes equal to the walk's after every step, and each eviction picking the victims a full sort of the
walk's candidates picks."""

from __future__ import annotations

import random

import pytest
from cachedriver import Driver, build

from hicache.cache.invariants import check_kept
from hicache.tree import policies
from hicache.tree.candidates import Candidates, CompiledCandidates

POLICIES = ["lru", "lfu", "slru", "fifo", "priority"]


def walk_victims(cache, num_tokens: int) -> list[int]:
    """The device victims of the walk-and-sort path (what a policy without ``monotonic`` gets, and what
    every eviction did before), without evicting."""
    kept, cache.tree.device_candidates = cache.tree.device_candidates, None
    try:
        return [x.id for x in cache.eviction.pick_device(num_tokens)]
    finally:
        cache.tree.device_candidates = kept


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_kept_sizes_and_victims_equal_the_walk(each_tree_core, policy, write_policy):
    cache = build(device_slots=48, page_size=2, write_policy=write_policy, eviction_policy=policy)
    d = Driver(cache, seed=5, check_kv_every=8, max_pages=6)
    r = random.Random(9)
    for i in range(300):
        d.run_random(1, seed=r.randrange(1 << 30))
        check_kept(cache.tree)
        if i % 7 == 0:
            want = r.randrange(1, 24)
            expected = walk_victims(cache, want)
            got = [x.id for x in cache.eviction.pick_device(want)]
            assert got == expected
            cache.tree.device_candidates.push_all([n for n in cache.tree.nodes() if n.id in set(got)])  # not evicted
            check_kept(cache.tree)
    d.drain(sample=4)
    check_kept(cache.tree)
    cache.close()


def test_a_candidate_missed_by_the_kept_heap_fails_verify(each_tree_core):
    cache = build(device_slots=32, page_size=1)
    d = Driver(cache, seed=1, max_pages=4)
    d.run_random(60, seed=2)
    d.release_all()
    cache.flush()
    cands = [n for n in cache.tree.nodes() if cache.tree.is_device_candidate(n)]
    assert cands
    cache.tree.device_candidates.rebuild([n for n in cache.tree.nodes() if n is not cands[0]])  # one goes missing
    with pytest.raises(AssertionError, match="device eviction candidates .* are not queued"):
        cache.verify()
    cache.tree.protected += 1
    cache.tree.device_candidates.rebuild(cache.tree.nodes())
    with pytest.raises(AssertionError, match="protected_size kept"):
        cache.verify()
    cache.tree.protected -= 1
    cache.verify()
    cache.close()


class Unordered:
    """A custom policy without ``monotonic``: served by sorting the candidates at each eviction."""

    name = "custom"

    def key(self, node):
        return (-node.hit_count, node.id)


def test_a_custom_policy_takes_the_sorting_path(each_tree_core):
    cache = build(device_slots=32, page_size=1, eviction_policy=Unordered())
    assert cache.tree.device_candidates is None and cache.tree.host_candidates is None
    d = Driver(cache, seed=3, max_pages=4)
    d.run_random(200, seed=4)
    d.drain(sample=4)
    check_kept(cache.tree)
    cache.close()


class MonotonicLRU(policies.LRU):
    """A subclass of a built-in policy: it may change ``key``, so it keeps the Python heap."""

    name = "lru-subclass"


@pytest.mark.parametrize("policy", [*POLICIES, "subclass"])
def test_which_heap_serves_which_policy(each_tree_core, policy):
    """Built-in policies over the compiled core keep their heaps in the core; the Python core and any
    other monotonic policy keep the Python heap (victims equal the walk's either way, tested above)."""
    cache = build(device_slots=32, page_size=1, eviction_policy=MonotonicLRU() if policy == "subclass" else policy)
    want = CompiledCandidates if each_tree_core == "compiled" and policy != "subclass" else Candidates
    assert type(cache.tree.device_candidates) is want and type(cache.tree.host_candidates) is want
    cache.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_the_compiled_heap_keys_are_the_policy_keys(each_tree_core, policy):
    """The core computes each built-in policy's key from its counters: the same order as the policy's
    own ``key`` (the compiled key pads with zeros after the node id)."""
    if each_tree_core != "compiled":
        pytest.skip("the compiled heap exists over the compiled core only")
    cache = build(device_slots=48, page_size=2, eviction_policy=policy)
    d = Driver(cache, seed=11, max_pages=6)
    d.run_random(120, seed=12)
    nodes = cache.tree.nodes()
    assert len(nodes) > 10
    heap = cache.tree.device_candidates._heap
    for n in nodes:
        want = cache.policy.key(n)
        got = heap.key(n.id)
        assert tuple(int(v) for v in want) == got[: len(want)] and not any(got[len(want) :])
    d.drain(sample=4)
    cache.close()
