"""Randomized stress tests of HiRadixCache + HiCacheController on tiny CPU pools.

A driver applies random operations (requests that match / allocate / insert, locks and unlocks of
matched nodes, device and host eviction, load-backs, polls of the controller's acks, flushes, and
misuse: inserts of bad slots, load-backs of nodes a host eviction deleted after the match, closes
with copies in flight, then calls on the closed cache; every such error must leave the cache as it
was) and,
after every step, checks the tree against its own invariants (``HiRadixCache.verify``) and against
what the driver knows: exact lock counts (one per lock the driver holds, per request in flight, per
copy in flight), the host slot state machine (WRITING / LOADING exactly for copies in flight), slot
accounting of both pools, and the KV bytes of device-resident nodes (derived from token id, position
and layer, so they must survive backup -> device eviction -> load-back unchanged).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
import torch
from cachedriver import (
    ALL_OPS,
    MISUSE_WEIGHTS,
    POLICIES,
    WEIGHTS,
    Driver,
    H,
    L,
    SlowCopies,
    build,
    expected_kv,
    fill_host,
    host_only,
    insert_seq,
    state_of,
    tree_nodes,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache import HiRadixCache
from hicache.cache.radix_cache import TreeNode

from cachedata import check_kv, kv_value, wrap_copies

# Every test runs on both radix-tree cores (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("each_tree_core")


# Tiny heads: the KV of a token is 2 layers x 1 head x 4 elements. HEAD_DIM 4 (cachedata's) so that
# cachedata.kv_value / check_kv describe the same bytes the vectorized helpers below write and check.
def test_vectorized_kv_matches_cachedata():
    e = expected_kv([2, 0, 1], torch.tensor([5, 6, 7]))
    for i, (tok, pos) in enumerate([(2, 5), (0, 6), (1, 7)]):
        for layer in range(L):
            for kv in (0, 1):
                assert torch.equal(e[kv, layer, i], kv_value(tok, pos, layer, kv)[:H])


# ---------------------------------------------------------------------------------------------------
# Tree inspection that changes nothing (match_prefix touches and splits nodes)
# ---------------------------------------------------------------------------------------------------


CONFIGS = [
    dict(page_size=ps, write_policy=wp, eviction_policy=ev)
    for ps in (1, 4)
    for wp in POLICIES
    for ev in ("lru", "lfu", "slru", "fifo", "priority")
]


STORAGE_CONFIGS = [
    dict(page_size=1, write_policy="write_through", eviction_policy="lru", device_slots=48, host_ratio=2.5),
    dict(page_size=4, write_policy="write_back", eviction_policy="slru", device_slots=64, host_ratio=1.5),
    dict(page_size=2, write_policy="write_through_selective", eviction_policy="lfu", device_slots=32),
]


def driven(config: dict, seed: int, check_kv_every: int, **build_kw) -> Driver:
    """The driver over ``build(**build_kw, **config)`` (and the caches its closes make anew) after 1500
    random steps and a drain; the caller checks its counts and closes it."""

    def factory() -> HiRadixCache:
        return build(**build_kw, **config)

    max_pages = 4 if config["page_size"] > 1 else 8
    d = Driver(factory(), seed=seed, check_kv_every=check_kv_every, max_pages=max_pages, factory=factory)
    d.run_random(1500, seed=seed + 1)
    d.drain(sample=4)
    return d


@pytest.mark.parametrize("config", STORAGE_CONFIGS, ids=lambda c: f"ps{c['page_size']}-{c['write_policy']}")
def test_random_operations_with_storage(tmp_path, config):
    """The driver with a file-backed storage tier: backups, prefetches of what host eviction dropped,
    closes and new caches that find the old one's pages; every invariant after every step, and the
    KV that comes back from storage is the KV that was written."""
    d = driven(config, seed=11, check_kv_every=4, storage=tmp_path / "store")
    assert d.counts["prefetch_done"] > 0 and d.metric("storage_hit_tokens") > 0
    assert d.metric("storage_pages_written") > 0
    d.cache.close()


@pytest.mark.parametrize("config", STORAGE_CONFIGS, ids=lambda c: f"ps{c['page_size']}-{c['write_policy']}")
def test_random_operations_with_a_sidecar_pool(config):
    """The driver over a cache with a hybrid pool group (the storage tests' configurations): an
    indexer-style sidecar of the KV's layers and a one-layer state-style one (a recurrent layer's
    checkpoints) beside the KV. Every invariant after every step, and the device copy of every resident
    node (KV and both sidecars' rows alike) is what was written, after any sequence of backups,
    evictions, load-backs, failed inserts and closes."""
    d = driven(config, seed=21, check_kv_every=2, sidecar=True)
    assert d.counts["load_back_done"] > 0 and d.metric("load_backs") > 0
    d.cache.close()


@pytest.mark.parametrize("config", STORAGE_CONFIGS, ids=lambda c: f"ps{c['page_size']}-{c['write_policy']}")
def test_random_operations_with_a_window_pool(config):
    """The driver over a cache with a window pool (a sliding-window layer's rows, half the KV slots):
    requests give rows to their last pages (none when the window pool is full), copies move the rows of
    the pages that have them, matches are cut where a window is gone. Every invariant after every step
    (the window pool's too: no rows on free KV pages, none leaked), every resident node's rows are what
    was written, and every match that is used finds its window whole."""
    d = driven(config, seed=31, check_kv_every=2, window=True)
    assert d.counts["load_back_done"] > 0 and d.metric("load_backs") > 0
    assert d.metric("window_cut_tokens") > 0  # prefixes whose windows were gone were cut, not used
    d.cache.close()


@pytest.mark.parametrize("config", STORAGE_CONFIGS, ids=lambda c: f"ps{c['page_size']}-{c['write_policy']}")
def test_random_operations_with_a_window_pool_and_storage(tmp_path, config):
    """The window pool with a file-backed storage tier: pages stored with their window rows and flags,
    prefetched back after host eviction and by the caches a close makes anew; every invariant after every
    step, and the rows that come back are the rows that were written."""
    d = driven(config, seed=41, check_kv_every=4, window=True, storage=tmp_path / "store")
    assert d.counts["prefetch_done"] > 0 and d.metric("storage_hit_tokens") > 0
    d.cache.close()


@pytest.mark.slow
@settings(
    max_examples=1000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],  # the core, set once per test
)  # fmt: skip
@given(
    config=st.sampled_from(CONFIGS),
    device_slots=st.sampled_from([32, 48]),
    host_ratio=st.sampled_from([2.0, 3.0]),
    layout=st.sampled_from(["page_first", "layer_first", "page_first_direct", "page_head"]),
    load_back_threshold=st.sampled_from([1, 4]),
    ops=st.lists(st.tuples(st.sampled_from(ALL_OPS), st.integers(0, 2**16)), min_size=20, max_size=150),
)
def test_random_operations_property(config, device_slots, host_ratio, layout, load_back_threshold, ops):
    max_pages = 4 if config["page_size"] == 4 else 8

    def factory() -> HiRadixCache:
        return build(
            device_slots=device_slots, host_ratio=host_ratio, layout=layout, load_back_threshold=load_back_threshold,
            **config,
        )  # fmt: skip

    d = Driver(factory(), seed=len(ops), max_pages=max_pages, factory=factory)
    d.run(ops)
    d.drain(sample=3)
    d.cache.close()


# ---------------------------------------------------------------------------------------------------
# Long seeded run: >= 100k driver steps, deterministic
# ---------------------------------------------------------------------------------------------------

LONG_SEGMENTS = [  # (config, steps): 100_000 steps in all, every write policy, page sizes 1 and 4
    (dict(page_size=1, write_policy="write_through", eviction_policy="lru", device_slots=48, host_ratio=2.5), 20_000),
    (dict(page_size=4, write_policy="write_through_selective", eviction_policy="lfu", device_slots=64), 20_000),
    (dict(page_size=1, write_policy="write_back", eviction_policy="slru", device_slots=32, host_ratio=3.0), 20_000),
    (
        dict(page_size=4, write_policy="write_back", eviction_policy="priority", device_slots=48, host_ratio=1.25),
        20_000,
    ),
    (dict(page_size=1, write_policy="write_through_selective", eviction_policy="fifo", device_slots=32), 20_000),
]


@pytest.mark.slow
@pytest.mark.parametrize("each_tree_core", ["compiled"], indirect=True)  # the default core; both: test_tree_core
def test_long_seeded_run(each_tree_core):
    # No wall-clock limit here: speed belongs to benchmarks, and CI runs on a busy 2-core machine.
    total = Counter()
    for i, (config, steps) in enumerate(LONG_SEGMENTS):
        d = Driver(
            build(**config), seed=1000 + i, check_kv_every=16, max_pages=4 if config["page_size"] == 4 else 8,
            factory=lambda config=config: build(**config),
        )  # fmt: skip
        d.run_random(steps, seed=2000 + i)
        d.drain()
        total += d.counts
        total["steps"] += d.steps
        for key in ("load_backs", "device_evicted_tokens", "host_evicted_tokens", "writes_refused_host_full"):
            total[key] += d.metric(key)
        d.cache.close()
    print(f"long run: {total['steps']} steps; {dict(total)}")
    assert total["steps"] >= 100_000
    # The run reached the interesting states, not just the easy ones, and every kind of misuse.
    for key in ("load_back_done", "load_back_skipped", "device_full", "load_backs", "device_evicted_tokens"):
        assert total[key] > 0, key
    assert total["host_evicted_tokens"] > 0
    for key in ("bad_insert_refused", "load_back_raced", "close_drain", "close_drop"):
        assert total[key] > 0, key


# ---------------------------------------------------------------------------------------------------
# Threaded run: real worker threads
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("write_policy", POLICIES)
def test_threaded_run(write_policy):
    threads_before = threading.active_count()
    config = dict(page_size=4 if write_policy == "write_through_selective" else 1, write_policy=write_policy)
    builds = []

    def factory() -> HiRadixCache:
        cache = build(threaded=True, eviction_policy="lru", device_slots=48, **config)
        SlowCopies(cache.controller, seed=7 + len(builds))
        builds.append(cache)
        return cache

    cache = factory()
    assert threading.active_count() == threads_before + 2
    d = Driver(cache, seed=11, max_pages=4 if config["page_size"] == 4 else 8, factory=factory)
    # Verify after every step as it is (pool states change only on this thread: the workers copy
    # bytes and queue acks); every 100 steps also after a flush, when nothing is in flight. Misuse
    # included: closes here meet copies really in flight on the workers.
    r = random.Random(3)
    weights = MISUSE_WEIGHTS[:-1] + (1.0,)  # more closes than in the long run: 3000 steps here
    for i in range(3000):
        d.step(r.choices(ALL_OPS, WEIGHTS + weights)[0], r)
        if i % 100 == 99:
            d.cache.flush()
            d.check()
    assert d.counts["load_back_done"] > 0 and d.metric("tokens_written") > 0
    assert d.counts["close_drain"] + d.counts["close_drop"] > 0 and d.counts["bad_insert_refused"] > 0
    d.drain()
    d.cache.close()
    assert all(c.controller.closed for c in builds)
    deadline = time.monotonic() + 5
    while threading.active_count() != threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == threads_before


# ---------------------------------------------------------------------------------------------------
# Edge outcomes
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("write_policy", POLICIES)
def test_host_pool_full_backups_refused(write_policy):
    cache = build(device_slots=32, host_ratio=2.0, write_policy=write_policy)
    locked = fill_host(cache)
    before = cache.metrics.writes_refused_host_full
    toks = [9] * 16
    insert_seq(cache, toks)  # write_through: backup refused (no host room, nothing host-evictable)
    cache.match_prefix(toks)  # write_through_selective: second hit: backup refused
    node = cache.match_prefix(toks).last_device_node
    cache.verify()
    if write_policy != "write_back":
        assert cache.metrics.writes_refused_host_full > before
    assert node.host_value is None and node.value is not None and node.lock_ref == 0  # device-only
    # Device eviction of a node the host cannot take deletes it (write_back: after a refused backup).
    before = cache.metrics.writes_refused_host_full
    assert cache.evict(16) == 16
    if write_policy == "write_back":
        assert cache.metrics.writes_refused_host_full > before
    assert cache.match_prefix(toks).host_hit_length == 0
    cache.verify()
    assert cache.device_pool.available_size() == cache.device_pool.size
    # Unlocked, the host-only nodes make room again.
    for n in locked:
        cache.dec_lock_ref(n)
    insert_seq(cache, toks)
    cache.flush()
    cache.verify()
    assert cache.host_pool.available_size() < cache.host_pool.size
    cache.close()


@pytest.mark.parametrize("write_policy", POLICIES)
def test_device_pool_full(write_policy):
    cache = build(device_slots=32, write_policy=write_policy)
    host_only(cache, [5] * 8)
    held = []
    for tok in (3, 4):  # device full of locked nodes
        toks = [tok] * 16
        insert_seq(cache, toks)
        node = cache.match_prefix(toks).last_device_node
        cache.inc_lock_ref(node)
        held.append(node)
    cache.flush()
    assert cache.device_pool.available_size() == 0
    m = cache.match_prefix([5] * 8)
    before = state_of(cache)
    # A new request finds no room, even after eviction: nothing is evicted, nothing changes.
    assert cache.device_pool.alloc(8) is None
    assert cache.evict(8) == 0
    # A load-back finds no room either: skipped, counted, nothing changed.
    skipped = cache.metrics.load_backs_skipped
    assert cache.load_back(m.last_host_node) is None
    assert cache.metrics.load_backs_skipped == skipped + 1
    assert state_of(cache) == before
    cache.verify()
    for node in held:
        cache.dec_lock_ref(node)
    got = cache.load_back(m.last_host_node)  # room once unlocked
    assert got is not None and len(got) == 8
    cache.start_loading()
    cache.flush()
    cache.verify()
    check_kv(cache, [5] * 8, cache.match_prefix([5] * 8).device_indices)
    cache.close()


def test_load_back_below_threshold_quota_or_nothing_to_load():
    cache = build(device_slots=32, load_back_threshold=10)
    host_only(cache, [1] * 8)
    host_only(cache, [2] * 16)
    skipped = cache.metrics.load_backs_skipped
    m8, m16 = cache.match_prefix([1] * 8), cache.match_prefix([2] * 16)
    before = state_of(cache)
    assert cache.load_back(m8.last_host_node) is None  # 8 tokens < load_back_threshold 10
    assert cache.load_back(m16.last_host_node, mem_quota=15) is None  # more than the caller's budget
    assert cache.metrics.load_backs_skipped == skipped + 2
    assert state_of(cache) == before
    cache.verify()
    got = cache.load_back(m16.last_host_node, mem_quota=16)
    assert got is not None and len(got) == 16
    cache.start_loading()
    cache.flush()
    m = cache.match_prefix([2] * 16)
    assert cache.load_back(m.last_device_node) is None  # nothing host-only: not a skip
    assert cache.metrics.load_backs_skipped == skipped + 2
    check_kv(cache, [2] * 16, m.device_indices)
    cache.close()


def load_back_too_large() -> tuple[HiRadixCache, TreeNode, torch.Tensor, dict, int]:
    """A 24-token host-only prefix; 8 free device slots, 8 in an unlocked node, 16 held by a request."""
    cache = build(device_slots=32, write_policy="write_through")
    host_only(cache, [1] * 24)
    insert_seq(cache, [2] * 8)
    cache.flush()
    ext = cache.device_pool.alloc(16)
    m = cache.match_prefix([1] * 24)
    assert cache.device_pool.available_size() + cache.evictable_size() < m.host_hit_length
    return cache, m.last_host_node, ext, state_of(cache), cache.metrics.load_backs_skipped


def test_load_back_larger_than_the_device_can_give():
    # A prefix larger than the whole device pool cannot be built through the API (insert takes one
    # device slot per token of the whole key), so: larger than free + evictable device slots.
    cache, node, ext, _, skipped = load_back_too_large()
    assert cache.load_back(node) is None
    assert cache.metrics.load_backs_skipped == skipped + 1
    cache.verify(external_device=ext)
    m = cache.match_prefix([1] * 24)
    assert m.host_hit_length == 24 and all(n.lock_ref == 0 for n, _ in tree_nodes(cache))
    cache.device_pool.free(ext)
    cache.close()


def test_load_back_that_cannot_fit_evicts_nothing():
    cache, node, ext, before, _ = load_back_too_large()
    assert cache.load_back(node) is None
    assert state_of(cache) == before


def test_writes_refused_host_full_counts_refused_backups_exactly():
    cache = build(device_slots=32, host_ratio=2.0, write_policy="write_through")
    locked = fill_host(cache)
    before = cache.metrics.writes_refused_host_full
    insert_seq(cache, [9] * 16)  # refused: no host room, nothing host-evictable
    refused = cache.metrics.writes_refused_host_full - before
    cache.evict(32)
    cache.dec_lock_ref(locked[0])
    before = cache.metrics.writes_refused_host_full
    insert_seq(cache, [10] * 16)  # evict_host frees locked[0]'s 16 slots: the backup succeeds
    assert cache.match_prefix([10] * 16).last_device_node.host_value is not None
    succeeded = cache.metrics.writes_refused_host_full - before
    assert (refused, succeeded) == (1, 0)


def test_layer_counter_with_overlapping_load_batches(monkeypatch):

    cache = build(device_slots=32, threaded=True)
    host_only(cache, [1] * 8)
    host_only(cache, [2] * 8)
    gates = [threading.Event(), threading.Event()]
    calls: list[int] = []

    def gated(issue, call):
        calls.append(call.layer_id)
        if len(calls) in (1, L + 1):  # first layer of batch 1, first layer of batch 2
            gates[len(calls) > 1].wait(10)
        return issue()

    wrap_copies(monkeypatch, "load_layer", gated)
    counter = cache.controller.layer_counter
    try:
        assert cache.load_back(cache.match_prefix([1] * 8).last_host_node) is not None
        cache.start_loading()
        while not calls:
            time.sleep(0.001)
        assert cache.load_back(cache.match_prefix([2] * 8).last_host_node) is not None
        cache.start_loading()  # batch 2, queued behind batch 1
        gates[0].set()
        deadline = time.monotonic() + 10
        while len(cache.controller.ack_load_queue) < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        # Batch 1 is done, batch 2 waits at its first layer: no layer of the current batch is there.
        with pytest.raises(TimeoutError):
            counter.wait_until(0, timeout=0.2)
    finally:
        for g in gates:
            g.set()
        cache.close()
