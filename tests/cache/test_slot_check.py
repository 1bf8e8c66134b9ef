"""Tests of hicache.cache.slot_check's ownership of device slots by the tree, as the device pool enforces it: a
caller's ``device_pool.free`` of slots a tree node holds is refused, naming the node, and changes nothing;
the tree's own frees (eviction, a lost load-back) still go through."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from cachedriver import state_of

from cachedata import check_kv, make_cache, prefill

# Every test runs on both radix-tree cores (tests/conftest.py): the compiled one marks ownership in C++.
pytestmark = pytest.mark.usefixtures("each_tree_core")


def snapshot(cache) -> dict:
    return dict(state_of(cache), available=cache.device_pool.available_size(), owned=cache.tree.slots.owned.copy())


def same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) if k == "owned" else a[k] == b[k] for k in a)


@pytest.mark.parametrize("page_size", [1, 4])
def test_caller_free_of_tree_slots_is_refused_naming_the_node(page_size):
    with make_cache(device_slots=32, page_size=page_size) as c:
        toks = list(range(100, 116))
        prefill(c, toks)
        m = c.match_prefix(toks)
        node = m.last_device_node
        before = snapshot(c)
        with pytest.raises(ValueError, match=rf"free: slot\(s\) .* are held by the radix tree: node {node.id} "):
            c.device_pool.free(m.device_indices)
        with pytest.raises(ValueError, match=rf"node {node.id} \(16 tokens; slots \[{int(m.device_indices[-4])}, "):
            c.device_pool.free(m.device_indices[-4:])  # the node's last page alone
        assert same(snapshot(c), before)
        c.verify()
        check_kv(c, toks, c.match_prefix(toks).device_indices)


def test_mixed_free_changes_nothing_and_names_every_node():
    with make_cache(device_slots=32, page_size=4) as c:
        a = list(range(200, 216))
        prefill(c, a)
        prefill(c, a[:8] + list(range(300, 308)))  # splits the first node after 8 tokens
        upper = c.match_prefix(a[:8]).last_device_node
        lower = c.match_prefix(a).last_device_node
        assert upper is not lower
        own = c.device_pool.alloc(8)  # the caller's slots, not the tree's
        tree = c.match_prefix(a).device_indices[4:12]  # a page of each node
        before = snapshot(c)
        with pytest.raises(ValueError, match=rf"node {upper.id} \(8 tokens.*node {lower.id} \(8 tokens"):
            c.device_pool.free(torch.cat([own, tree]))
        assert same(snapshot(c), before)  # the caller's pages were not freed either
        c.verify(external_device=own)
        c.device_pool.free(own)  # its own slots: accepted
        c.verify()


def test_tree_frees_its_own_slots():
    with make_cache(device_slots=32, page_size=4, load_back_threshold=1) as c:
        toks = list(range(400, 424))
        prefill(c, toks)
        c.flush()
        assert c.evict(32) == 24  # eviction frees the tree's slots through the pool
        assert c.device_pool.available_size() == 32 and not c.tree.slots.owned.any()
        m = c.match_prefix(toks)
        loaded = c.load_back(m.last_host_node)  # the tree owns the loaded slots at once
        assert loaded is not None and c.tree.slots.owned[loaded.numpy()].all()
        with pytest.raises(ValueError, match="held by the radix tree"):
            c.device_pool.free(loaded)
        c.start_loading()
        c.flush()
        check_kv(c, toks, c.match_prefix(toks).device_indices)
        assert c.evict(32) == 24
        c.verify()


def test_a_dropped_cache_holds_nothing():
    c = make_cache(device_slots=32, page_size=4)
    prefill(c, list(range(16)))
    slots = c.match_prefix(list(range(16))).device_indices
    pool = c.device_pool
    with pytest.raises(ValueError, match="held by the radix tree"):
        pool.free(slots)
    c.close()
    del c
    gc.collect()
    pool.free(slots)  # the pool holds its owners by weak reference
    assert pool.available_size() == 32


def test_add_owner_checks_the_ownership_array():
    c = make_cache(device_slots=32)
    with pytest.raises(TypeError, match="owner: expected an object whose owned is a bool numpy array of 32 slots"):
        c.device_pool.add_owner(object())
    c.close()
