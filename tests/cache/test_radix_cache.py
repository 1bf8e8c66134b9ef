"""HiRadixCache behaviour on CPU pools with the `direct` backend (and `triton` under the interpreter)."""

from __future__ import annotations

import array
import threading

import numpy as np
import pytest
import torch
from cachedriver import state_of

from hicache import FIFO, LFU, LRU, SLRU, Priority, get_policy
from hicache_kernels.layouts import LAYOUTS, MLA_LAYOUTS

from cachedata import check_kv, evict_and_reload, make_cache, prefill, write_kv

# Every test runs on both radix-tree cores (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("each_tree_core")


def test_insert_then_match_returns_device_prefix():
    with make_cache(device_slots=32) as c:
        toks = list(range(10, 30))
        assert prefill(c, toks) == 0
        m = c.match_prefix(toks + [1, 2, 3])
        assert len(m.device_indices) == 20 and m.host_hit_length == 0
        check_kv(c, toks, m.device_indices)
        c.verify()


def test_partial_match_splits_a_node_and_keeps_both_halves():
    with make_cache(device_slots=32) as c:
        a = list(range(100, 116))
        prefill(c, a)
        b = a[:6] + [7, 8, 9]
        assert prefill(c, b) == 6
        c.verify()
        assert len(c.root.children) == 1
        (upper,) = c.root.children.values()
        assert len(upper.key) == 6 and len(upper.children) == 2
        check_kv(c, a, c.match_prefix(a).device_indices)
        check_kv(c, b, c.match_prefix(b).device_indices)


def test_page_aligned_keys():
    with make_cache(device_slots=32, page_size=4, layout="page_first_direct") as c:
        toks = list(range(50, 62))  # 12 tokens = 3 pages
        prefill(c, toks)
        m = c.match_prefix(toks[:10])  # 10 tokens: only 2 whole pages can match
        assert len(m.device_indices) == 8
        with pytest.raises(ValueError, match="page-aligned"):
            c.insert(toks[:6], torch.arange(6))
        c.verify()


LAYOUT_KINDS = [(lo, False) for lo in LAYOUTS] + [(lo, True) for lo in MLA_LAYOUTS]  # page_head: MHA only


@pytest.mark.parametrize(
    ("layout", "mla"), LAYOUT_KINDS, ids=[f"{lo}-{'mla' if m else 'mha'}" for lo, m in LAYOUT_KINDS]
)
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_backup_evict_load_back_reproduces_kv(layout, mla, stacked):
    """The KV that comes back after backup -> device eviction -> load_back is what was written."""
    with make_cache(device_slots=32, page_size=4, layout=layout, mla=mla, stacked=stacked) as c:
        toks = list(range(300, 324))
        prefill(c, toks)
        c.flush()
        assert c.evict(32) == 24
        m = c.match_prefix(toks)
        assert len(m.device_indices) == 0 and m.host_hit_length == 24
        held = c.device_pool.alloc(4)  # the load-back must land on other slots than the originals
        dev = c.load_back(m.last_host_node)
        assert dev is not None and len(dev) == 24
        c.start_loading()
        c.flush()
        c.verify(external_device=held)
        check_kv(c, toks, c.match_prefix(toks).device_indices)
        c.device_pool.free(held)


def test_nodes_are_locked_while_copies_are_in_flight():
    with make_cache(device_slots=32) as c:
        toks = list(range(20))
        prefill(c, toks)
        (node,) = c.root.children.values()
        assert node.lock_ref == 1  # the backup holds it
        assert c.evict(32) == 0  # locked: nothing evictable
        c.flush()
        assert node.lock_ref == 0
        assert c.evict(32) == 20


def test_lock_ref_protects_and_never_goes_negative():
    with make_cache(device_slots=32) as c:
        prefill(c, list(range(16)))
        c.flush()
        m = c.match_prefix(list(range(16)))
        c.inc_lock_ref(m.last_device_node)
        assert c.evict(32) == 0 and c.protected_size() == 16 and c.evictable_size() == 0
        c.dec_lock_ref(m.last_device_node)
        with pytest.raises(RuntimeError, match="not locked"):
            c.dec_lock_ref(m.last_device_node)
        assert c.evictable_size() == 16


def test_eviction_without_backup_deletes_the_node():
    with make_cache(device_slots=32, write_policy="write_through_selective") as c:
        prefill(c, list(range(16)))  # one hit: below the selective threshold, no backup
        assert c.metrics.tokens_written == 0
        assert c.evict(16) == 16
        assert not c.root.children
        c.verify()


def test_write_through_selective_backs_up_on_second_hit():
    with make_cache(device_slots=32, write_policy="write_through_selective") as c:
        toks = list(range(16))
        prefill(c, toks)
        c.match_prefix(toks)
        c.flush()
        assert c.metrics.tokens_written == 16
        (node,) = c.root.children.values()
        assert node.host_value is not None


def test_write_back_writes_on_eviction_only():
    with make_cache(device_slots=32, write_policy="write_back") as c:
        toks = list(range(16))
        prefill(c, toks)
        assert c.metrics.tokens_written == 0
        assert c.evict(16) == 16
        assert c.metrics.tokens_written == 16
        evict_and_reload(c, toks)
        c.verify()


def test_load_back_threshold_and_budget():
    with make_cache(device_slots=32, load_back_threshold=10) as c:
        prefill(c, list(range(8)))
        prefill(c, list(range(100, 120)))
        c.flush()
        c.evict(32)
        short = c.match_prefix(list(range(8)))
        assert c.load_back(short.last_host_node) is None  # 8 < threshold 10
        long = c.match_prefix(list(range(100, 120)))
        assert c.load_back(long.last_host_node, mem_quota=10) is None  # 20 > budget
        assert c.metrics.load_backs_skipped == 2
        assert c.load_back(long.last_host_node) is not None
        c.start_loading()
        c.flush()
        c.verify()


def test_load_back_without_device_room_is_skipped_and_changes_nothing():
    """A load-back that cannot get device slots even after evicting (here: running requests hold most
    of the pool, as a prefix larger than the pool would) returns None and leaves everything as it was."""
    with make_cache(device_slots=16, host_ratio=4.0) as c:
        toks = list(range(12))
        prefill(c, toks)
        c.flush()
        c.evict(16)
        held = c.device_pool.alloc(8)  # a running request's slots: not evictable
        m = c.match_prefix(toks)
        assert m.host_hit_length == 12
        states = c.host_pool.state().clone()
        assert c.load_back(m.last_host_node) is None
        assert c.metrics.load_backs_skipped == 1
        assert c.device_pool.available_size() == 8 and torch.equal(c.host_pool.state(), states)
        assert m.last_host_node.value is None and m.last_host_node.lock_ref == 0
        c.verify(external_device=held)
        c.device_pool.free(held)


def test_host_pool_full_refuses_backups_after_host_eviction():
    with make_cache(device_slots=16, host_ratio=1.5) as c:  # host: 24 slots
        prefill(c, list(range(16)))
        c.flush()
        c.evict(16)  # 16 tokens host-only
        prefill(c, list(range(100, 116)))  # needs 16 host slots: 8 free -> evicts the host-only node
        c.flush()
        assert c.metrics.host_evicted_tokens == 16
        c.verify()
        m = c.match_prefix(list(range(16)))
        assert m.host_hit_length == 0


def test_device_pool_full_is_reported_to_the_caller():
    with make_cache(device_slots=16) as c:
        prefill(c, list(range(16)))
        m = c.match_prefix(list(range(16)))
        c.inc_lock_ref(m.last_device_node)
        with pytest.raises(MemoryError):
            prefill(c, list(range(100, 108)))
        c.dec_lock_ref(m.last_device_node)
        c.verify()


@pytest.mark.parametrize(
    ("policy", "first_evicted"),
    [("lru", "b"), ("fifo", "a"), ("lfu", "b"), ("slru", "b"), ("priority", "c")],
)
def test_eviction_policies_pick_the_expected_victim(policy, first_evicted):
    with make_cache(device_slots=48, eviction_policy=policy) as c:
        seqs = {"a": list(range(0, 8)), "b": list(range(100, 108)), "c": list(range(200, 208))}
        prefill(c, seqs["a"])
        prefill(c, seqs["b"])
        c.insert(seqs["c"], c.device_pool.alloc(8), priority=-1)
        # a: created first, 4 hits; b: 1 hit, least recently used; c: priority -1, 3 hits, used last.
        for _ in range(3):
            c.match_prefix(seqs["a"])
        c.match_prefix(seqs["c"])
        c.match_prefix(seqs["c"])
        c.flush()
        c.evict(8)
        gone = [name for name, s in seqs.items() if len(c.match_prefix(s).device_indices) == 0]
        assert gone == [first_evicted], (policy, gone)


def test_policy_lookup():
    assert isinstance(get_policy("lru"), LRU) and isinstance(get_policy("lfu"), LFU)
    assert isinstance(get_policy("slru"), SLRU) and isinstance(get_policy("fifo"), FIFO)
    assert isinstance(get_policy("priority"), Priority)
    custom = type("Custom", (), {"name": "x", "key": lambda self, n: (n.id,)})()
    assert get_policy(custom) is custom
    with pytest.raises(ValueError, match="eviction_policy"):
        get_policy("random")
    with pytest.raises(TypeError, match="eviction_policy"):
        get_policy(3)


def test_metrics_count_hits_per_tier():
    """Exact counts: hits per tier and misses (a host hit is not a miss), tokens and bytes moved each
    way (bytes, not tokens), and the copy times summed over the copies (each copy's time fixed here)."""
    with make_cache(device_slots=32) as c:
        bps = c.device_pool.bytes_per_slot
        c.controller.device.elapsed_s = lambda start, end: 0.25  # every copy takes 0.25 s
        toks = list(range(20))
        prefill(c, toks)  # a miss of 20 tokens, then a backup of 20
        c.flush()
        m = c.metrics.as_dict()
        assert (m["device_hit_tokens"], m["host_hit_tokens"], m["miss_tokens"]) == (0, 0, 20)
        assert (m["tokens_written"], m["bytes_written"], m["write_time_s"]) == (20, 20 * bps, 0.25)
        c.evict(20)
        match = c.match_prefix(toks + [99])  # 20 on the host, 1 nowhere
        m = c.metrics.as_dict()
        assert (m["device_hit_tokens"], m["host_hit_tokens"], m["miss_tokens"]) == (0, 20, 21)
        assert m["device_evicted_tokens"] == 20
        assert c.load_back(match.last_host_node) is not None
        c.start_loading()
        c.flush()
        m = c.metrics.as_dict()
        assert (m["tokens_loaded"], m["bytes_loaded"], m["load_time_s"], m["load_backs"]) == (20, 20 * bps, 0.25, 1)
        assert m["load_gbps"] == 20 * bps / 0.25 / 1e9 and m["write_gbps"] == 20 * bps / 0.25 / 1e9
        c.match_prefix(toks)  # all 20 on the device now
        c.match_prefix(toks[:4] + [77, 78])
        m = c.metrics.as_dict()
        assert (m["device_hit_tokens"], m["host_hit_tokens"], m["miss_tokens"]) == (24, 20, 23)
        # A second load-back sums its time onto the first's.
        c.evict(20)
        match = c.match_prefix(toks)
        assert c.load_back(match.last_host_node) is not None
        c.start_loading()
        c.flush()
        m = c.metrics.as_dict()
        assert (m["tokens_loaded"], m["bytes_loaded"], m["load_time_s"], m["load_backs"]) == (40, 40 * bps, 0.5, 2)


def test_threaded_cache_closes_cleanly():
    before = threading.active_count()
    c = make_cache(device_slots=32, threaded=True)
    assert threading.active_count() == before + 2
    for i in range(5):
        prefill(c, list(range(i * 10, i * 10 + 6)))
        c.flush()
    c.flush()
    c.verify()
    c.close()
    assert threading.active_count() == before
    with pytest.raises(RuntimeError, match="closed"):
        c.controller.write(torch.arange(2), 1)


def test_triton_backend_under_interpreter():
    with make_cache(device_slots=16, io_backend="triton", page_size=4, layout="page_first_direct") as c:
        toks = list(range(40, 52))
        prefill(c, toks)
        evict_and_reload(c, toks)


def test_bad_arguments():
    with pytest.raises(ValueError, match="io_backend"):
        make_cache(io_backend="kernel")  # CPU pools: kernel needs a GPU
    with pytest.raises(ValueError, match="io_backend"):
        make_cache(io_backend="dma")
    with pytest.raises(ValueError, match="write_policy"):
        make_cache(write_policy="write_around")
    with pytest.raises(ValueError, match="load_back_threshold"):
        make_cache(load_back_threshold=-1)


# ---------------------------------------------------------------------------------------------------
# Misuse: each error names its argument, changes nothing, and verify() holds afterwards
# ---------------------------------------------------------------------------------------------------


def host_only_prefix(c, toks):
    prefill(c, toks)
    c.flush()
    c.evict(c.device_pool.size)
    m = c.match_prefix(toks)
    assert m.host_hit_length == len(toks)
    return m


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_load_back_of_a_node_whose_host_copy_was_evicted_raises_and_changes_nothing(threaded):
    with make_cache(device_slots=32, threaded=threaded) as c:
        toks = list(range(40, 56))
        m = host_only_prefix(c, toks)
        assert c.evict_host(c.host_pool.size) == 16  # the matched node is deleted meanwhile
        before = state_of(c)
        with pytest.raises(ValueError, match=r"node: .* no longer in the tree"):
            c.load_back(m.last_host_node)
        assert state_of(c) == before
        assert c.device_pool.available_size() == c.device_pool.size
        c.verify()
        assert c.match_prefix(toks).host_hit_length == 0


def test_load_back_refuses_bad_arguments():
    with make_cache(device_slots=32) as c:
        m = host_only_prefix(c, list(range(16)))
        before = state_of(c)
        with pytest.raises(TypeError, match="node: expected a TreeNode"):
            c.load_back(list(range(16)))
        with pytest.raises(ValueError, match="mem_quota"):
            c.load_back(m.last_host_node, mem_quota=-1)
        assert state_of(c) == before
        c.verify()


def _bad_slots(c, page_size):
    """name -> (device_indices for 2 pages of new tokens, expected exception, message pattern)."""
    n, ps = 2 * page_size, page_size
    dp = c.device_pool
    mine = dp.alloc(n)
    owned = c.match_prefix(list(range(500, 500 + n))).device_indices  # the tree's slots for another key
    free_page = next(p for p in range(dp.size // ps) if not dp.is_allocated(torch.arange(p * ps, (p + 1) * ps)).any())
    cases = {
        "float": (mine.to(torch.float32), TypeError, "integer tensor"),
        "bool": (torch.ones(n, dtype=torch.bool), TypeError, "integer tensor"),
        "list": (mine.tolist(), TypeError, "torch.Tensor"),
        "2-D": (mine.reshape(1, -1), ValueError, "1-D"),
        "too short": (mine[:ps], ValueError, "one slot per token"),
        "out of range": (torch.cat([mine[:ps], torch.arange(dp.size, dp.size + ps)]), ValueError, "out of range"),
        "negative": (torch.cat([mine[:ps], torch.arange(-ps, 0)]), ValueError, "out of range"),
        "never allocated": (
            torch.cat([mine[:ps], torch.arange(free_page * ps, (free_page + 1) * ps)]), ValueError, "not allocated",
        ),
        "repeated": (torch.cat([mine[:ps], mine[:ps]]), ValueError, "repeated"),
        "owned by the tree": (torch.cat([mine[:ps], owned[:ps]]), ValueError, "owned by the tree"),
    }  # fmt: skip
    if ps > 1:
        cases["page out of order"] = (torch.cat([mine[:ps].flip(0), mine[ps:]]), ValueError, "whole device page")
        cases["straddles pages"] = (mine + 1 if int(mine[-1]) + 1 < dp.size else mine - 1, ValueError, "whole device")
    return mine, cases


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_insert_refuses_bad_slots_and_changes_nothing(page_size, threaded):
    layout = "page_first_direct" if page_size > 1 else "page_first"
    with make_cache(device_slots=64, page_size=page_size, layout=layout, threaded=threaded) as c:
        prefill(c, list(range(500, 500 + 2 * page_size)))
        c.flush()
        mine, cases = _bad_slots(c, page_size)
        toks = list(range(900, 900 + 2 * page_size))
        for name, (slots, exc, pattern) in cases.items():
            before = state_of(c)
            with pytest.raises(exc, match=f"device_indices: .*{pattern}"):
                c.insert(toks, slots)
            assert state_of(c) == before, name
            c.verify(external_device=mine)
        c.flush()  # nothing reached a worker: no copy fails
        assert c.insert(toks, mine) == 0  # the good slots still go in
        c.flush()
        c.verify()


def test_insert_takes_only_the_slots_of_uncached_tokens():
    """Where the tree holds the tokens on the device the caller may pass the tree's slots (as matched)
    or its own; where it takes slots (new tokens, host-only nodes) they must be the caller's."""
    with make_cache(device_slots=32) as c:
        a = list(range(100, 108))
        prefill(c, a)
        c.flush()
        m = c.match_prefix(a)
        own = c.device_pool.alloc(4)
        b = a + [1, 2, 3, 4]
        assert c.insert(b, torch.cat([m.device_indices, own])) == 8  # the tree's own slots for the prefix
        c.verify()
        mine = c.device_pool.alloc(12)
        assert c.insert(b, mine) == 12  # all cached: the caller keeps (and frees) its slots
        c.device_pool.free(mine)
        c.flush()
        c.evict(32)  # both nodes host-only now
        m = c.match_prefix(b)
        assert m.host_hit_length == 12
        before = state_of(c)
        with pytest.raises(ValueError, match="not allocated"):
            c.insert(b, m.device_indices.new_tensor(range(12)))  # reviving host-only nodes takes the slots
        assert state_of(c) == before
        c.verify()


def test_out_of_range_insert_no_longer_reaches_a_worker():
    with make_cache(device_slots=32, threaded=True) as c:
        with pytest.raises(ValueError, match="out of range"):
            c.insert(list(range(4)), torch.tensor([0, 1, 2, 999]))
        prefill(c, list(range(8)))
        c.flush()
        assert c.metrics.writes_failed == 0 and c.metrics.tokens_written == 8
        c.verify()


def test_calls_after_close_raise_before_changing_anything():
    c = make_cache(device_slots=32)
    toks = list(range(16))
    m = host_only_prefix(c, toks)
    prefill(c, list(range(100, 108)))
    c.flush()
    slots = c.device_pool.alloc(8)
    c.close()
    before = state_of(c)
    calls = {
        "insert": lambda: c.insert(list(range(200, 208)), slots),
        "load_back": lambda: c.load_back(m.last_host_node),
        "match_prefix": lambda: c.match_prefix(toks),
        "evict": lambda: c.evict(8),
        "evict_host": lambda: c.evict_host(8),
        "start_loading": c.start_loading,
        "flush": c.flush,
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="closed") as e:
            call()
        assert state_of(c) == before, name
        assert str(e.value) == f"{name}: the HiRadixCache is closed"
    c.verify(external_device=slots)
    c.close()  # idempotent


def test_a_cache_on_a_closed_controller_refuses_before_changing_anything():
    c = make_cache(device_slots=32)
    m = host_only_prefix(c, list(range(16)))
    c.controller.close()  # closed behind the cache's back
    slots = c.device_pool.alloc(4)
    before = state_of(c)
    with pytest.raises(RuntimeError, match="(?i)controller is closed"):
        c.load_back(m.last_host_node)
    with pytest.raises(RuntimeError, match="(?i)controller is closed"):
        c.insert(list(range(50, 54)), slots)
    assert state_of(c) == before and m.last_host_node.value is None
    c.verify(external_device=slots)
    c.close()


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_leaves_the_matched_slots_to_the_tree_and_reports_only_duplicates(page_size):
    """The insert contract: a caller that passes ``match_prefix``'s slots back and frees
    ``device_indices[hit:dup]`` frees only its own duplicates, never the tree's slots, even when another
    insert cached more of the key between its match and its insert."""
    with make_cache(device_slots=64, page_size=page_size, layout="page_first_direct") as c:
        base, ext = list(range(100, 108)), list(range(200, 208))
        prefill(c, base)
        m = c.match_prefix(base + ext)
        hit = len(m.device_indices)
        assert hit == 8
        mine = c.device_pool.alloc(8)
        write_kv(c, ext, mine, start=hit)
        assert prefill(c, base + ext) == 8  # another request caches `ext` first
        full = torch.cat([m.device_indices, mine])
        dup = c.insert(base + ext, full)
        assert dup == 16  # all of it was cached: the tree took none of `full`
        assert c.device_pool.is_allocated(m.device_indices).all()  # the tree's: not the caller's to free
        c.device_pool.free(full[hit:dup])  # the caller's duplicates
        c.verify()
        check_kv(c, base + ext, c.match_prefix(base + ext).device_indices)


def test_insert_refuses_a_tree_slot_at_another_tokens_position():
    """A slot the tree owns for other tokens, passed where the tree already caches the key, would be
    reported as a duplicate for the caller to free: refused before anything changes."""
    with make_cache(device_slots=64) as c:
        a, b = list(range(10, 18)), list(range(50, 58))
        prefill(c, a)
        prefill(c, b)
        ma = c.match_prefix(a)
        mb = c.match_prefix(b)
        wrong = ma.device_indices.clone()
        wrong[3] = mb.device_indices[0]  # owned by the tree, for b's first token
        wrong[5] = ma.device_indices[6]  # owned by the tree, for another position of a
        wrong[6] = ma.device_indices[5]
        before = state_of(c)
        with pytest.raises(ValueError, match="device_indices: .*owned by the tree for other tokens"):
            c.insert(a, wrong)
        assert state_of(c) == before
        c.verify()
        # The tree's own slots, or the caller's own (unowned) slots, are both fine there.
        assert c.insert(a, ma.device_indices) == 8
        mine = c.device_pool.alloc(8)
        assert c.insert(a, mine) == 8
        c.device_pool.free(mine)
        c.verify()


@pytest.mark.parametrize("page_size", [1, 4])
def test_tokens_of_any_integer_type_match_the_same_prefix(page_size):
    with make_cache(device_slots=64, page_size=page_size, layout="page_first_direct") as c:
        toks = list(range(1000, 1016))
        prefill(c, toks)
        want = c.match_prefix(toks).device_indices
        for form in (
            tuple(toks),
            torch.tensor(toks),
            np.array(toks),
            [np.int64(t) for t in toks],
            toks[:7] + [np.int32(toks[7])] + toks[8:],
            array.array("q", toks),  # SGLang's Req holds its ids so
            array.array("I", toks),
        ):
            got = c.match_prefix(form).device_indices
            assert torch.equal(got, want), type(form)
        # A key that leaves an edge part-way (by bisection) splits it at the page boundary.
        for n in (1, 5, 9, 15):
            other = toks[:n] + [7] * (16 - n)
            aligned = n - n % page_size
            assert torch.equal(c.match_prefix(other).device_indices, want[:aligned])
        c.verify()
