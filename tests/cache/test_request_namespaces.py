"""Request namespaces (``extra_key``: a LoRA adapter, a tenant's cache salt) through every tier: tenants
that send the same tokens each hold their own KV (written different here), and a prefix never matches
across namespaces on the device, on the host or in storage. Every test runs on both tree cores."""

from __future__ import annotations

import time

import pytest
import torch
from test_storage_tier import make

from hicache.storage import FileBackend

from cachedata import check_kv, make_cache, write_kv

pytestmark = pytest.mark.usefixtures("each_tree_core")

TOKENS = [(11 * i + 5) % 900 for i in range(24)]
TENANTS = ("tenant-a", "tenant-b", None)


def kv_of(tokens, extra_key):
    """The tokens whose fingerprint a tenant's KV carries: every tenant's KV differs for one prompt."""
    shift = {None: 0, "tenant-a": 1000, "tenant-b": 2000, "lora-7": 3000}.get(extra_key, 4000)
    return [t + shift for t in tokens]


def prefill(cache, tokens, extra_key):
    m = cache.match_prefix(tokens, extra_key=extra_key)
    hit = len(m.device_indices)
    slots = cache.device_pool.alloc(len(tokens) - hit)
    assert slots is not None
    write_kv(cache, kv_of(tokens, extra_key)[hit:], slots, start=hit)
    full = torch.cat([m.device_indices, slots])
    dup = cache.insert(tokens, full, extra_key=extra_key)
    assert dup == hit
    return hit


def test_namespaces_never_share_a_prefix_on_the_device():
    cache = make_cache(device_slots=128, page_size=4)
    for key in TENANTS:
        assert prefill(cache, TOKENS, key) == 0, f"{key!r} hit another namespace's pages"
    slots = {}
    for key in TENANTS:
        m = cache.match_prefix(TOKENS, extra_key=key)
        assert len(m.device_indices) == len(TOKENS)
        check_kv(cache, kv_of(TOKENS, key), m.device_indices)  # its own bytes
        slots[key] = set(m.device_indices.tolist())
    assert all(not (slots[a] & slots[b]) for a in TENANTS for b in TENANTS if a != b)
    assert len(cache.match_prefix(TOKENS, extra_key="lora-7").device_indices) == 0
    assert prefill(cache, TOKENS[:12], "tenant-a") == 12  # a namespace still shares within itself
    cache.verify()


def test_namespaces_never_share_a_prefix_on_the_host():
    cache = make_cache(device_slots=128, page_size=4)
    for key in TENANTS:
        prefill(cache, TOKENS, key)
    cache.flush()  # write_through: every node backed up
    cache.evict(cache.device_pool.size)
    for key in TENANTS:
        m = cache.match_prefix(TOKENS, extra_key=key)
        assert len(m.device_indices) == 0 and m.host_hit_length == len(TOKENS)
        assert cache.load_back(m.last_host_node) is not None
        cache.start_loading()
        cache.flush()
        check_kv(cache, kv_of(TOKENS, key), cache.match_prefix(TOKENS, extra_key=key).device_indices)
    m = cache.match_prefix(TOKENS, extra_key="lora-7")
    assert len(m.device_indices) == 0 and m.host_hit_length == 0
    cache.verify()


def _prefetch(cache, tokens, extra_key, rid):
    m = cache.match_prefix(tokens, extra_key=extra_key)
    if not cache.prefetch_from_storage(rid, m.last_host_node, tokens, extra_key=extra_key):
        return 0
    before = cache.metrics.storage_hit_tokens
    t0 = time.perf_counter()
    while not cache.check_prefetch_progress(rid):
        assert time.perf_counter() - t0 < 10, "prefetch never finished"
        time.sleep(0.001)
    return cache.metrics.storage_hit_tokens - before


def test_a_namespace_reads_only_its_own_pages_from_storage(tmp_path):
    with make(FileBackend(tmp_path)) as a:  # the writer: two tenants' pages of one prompt
        for key in ("tenant-a", "tenant-b"):
            prefill(a, TOKENS, key)
        a.flush()
        a.check_storage()
        a.flush()
    with make(FileBackend(tmp_path)) as b:  # a fresh cache (and backend) over the same store
        assert _prefetch(b, TOKENS, None, "none") == 0
        assert _prefetch(b, TOKENS, "lora-7", "other") == 0
        for key in ("tenant-b", "tenant-a"):
            assert _prefetch(b, TOKENS, key, key) == len(TOKENS), key
            m = b.match_prefix(TOKENS, extra_key=key)
            assert b.load_back(m.last_host_node) is not None
            b.start_loading()
            b.flush()
            check_kv(b, kv_of(TOKENS, key), b.match_prefix(TOKENS, extra_key=key).device_indices)
        b.verify()


def test_extra_keys_of_other_types_or_values_are_other_namespaces():
    cache = make_cache(device_slots=128, page_size=4)
    prefill(cache, TOKENS[:8], "1")
    for other in (1, b"1", "01", "1 "):
        assert len(cache.match_prefix(TOKENS[:8], extra_key=other).device_indices) == 0, other
    assert len(cache.match_prefix(TOKENS[:8], extra_key="1").device_indices) == 8


def test_bad_extra_keys_and_token_ids_are_refused_before_anything_changes():
    cache = make_cache(device_slots=64, page_size=4)
    slots = cache.device_pool.alloc(8)
    for bad in (1.5, ("a",), True):
        with pytest.raises(TypeError, match="extra_key"):
            cache.insert(TOKENS[:8], slots, extra_key=bad)
        with pytest.raises(TypeError, match="extra_key"):
            cache.match_prefix(TOKENS[:8], extra_key=bad)
    assert len(cache.namespaces) == 0
    with pytest.raises(ValueError, match=r"tokens: token ids must lie in \[0, 2\*\*32\)"):
        cache.insert([2**32] + TOKENS[1:8], slots, extra_key="a")
    assert cache.evictable_size() == 0
    # once a namespace exists, a request without one may not hold ids a namespaced token could equal
    cache.match_prefix(TOKENS[:8], extra_key="a")
    with pytest.raises(ValueError, match="request namespaces are in use"):
        cache.insert([(1 << 32) + t for t in TOKENS[:8]], slots)
    assert cache.evictable_size() == 0
    cache.device_pool.free(slots)
    cache.verify()
