"""Load-backs decided for the step (hicache.cache.load_backs, ``agree="step"``): settled by agree_load_backs,
revoked cleanly where they did not go everywhere, refused by start_loading while unsettled. The TP
side (two ranks, a failure on one) is in test_tp_faults."""

from __future__ import annotations

import pytest
import torch

from cachedata import check_kv, make_cache, prefill

TOKENS = list(range(200, 216))


def host_only(cache, tokens=TOKENS):
    """``tokens`` cached, backed up, then evicted from the device: a host hit of all of them."""
    prefill(cache, tokens)
    cache.flush()
    cache.evict(cache.device_pool.size)
    m = cache.match_prefix(tokens)
    assert m.host_hit_length == len(tokens) and len(m.device_indices) == 0
    return m


def test_a_step_load_back_settles_and_loads(each_tree_core):
    with make_cache(device_slots=32, page_size=4) as c:
        m = host_only(c)
        slots = c.load_back(m.last_host_node, agree="step")
        assert slots is not None and len(slots) == len(TOKENS)
        with pytest.raises(RuntimeError, match=r"start_loading: 1 load-back\(s\) decided with agree='step'"):
            c.start_loading()
        assert c.agree_load_backs() == []
        assert c.agree_load_backs() == []  # nothing left: no collective either
        c.start_loading()
        c.flush()
        check_kv(c, TOKENS, c.match_prefix(TOKENS).device_indices)
        assert c.metrics.load_backs == 1
        c.verify()


def test_a_revoked_load_back_leaves_the_cache_as_before(each_tree_core, monkeypatch):
    """A load-back another rank did not make (the agreement says 0) is undone: device slots freed, the
    nodes host-only and unlocked again, no copy ever issued; then it can be loaded again."""
    with make_cache(device_slots=32, page_size=4) as c:
        m = host_only(c)
        free = c.device_pool.available_size()
        host_states = c.host_pool.state().clone()
        slots = c.load_back(m.last_host_node, agree="step")
        assert slots is not None and c.device_pool.available_size() == free - len(TOKENS)
        monkeypatch.setattr(c.controller, "agree_all", lambda values: [0] * len(values))
        assert c.agree_load_backs() == [m.last_host_node.id]
        monkeypatch.undo()
        assert c.device_pool.available_size() == free
        assert torch.equal(c.host_pool.state(), host_states)  # LOADING back to SYNCED
        again = c.match_prefix(TOKENS)
        assert again.host_hit_length == len(TOKENS) and len(again.device_indices) == 0
        assert c.protected_size() == 0 and c.metrics.load_backs == 0 and c.metrics.load_backs_skipped == 1
        assert not c.controller.outstanding("load") and not c.controller._pending_loads
        c.verify()
        issued = c.controller.metrics.tokens_loaded
        c.start_loading()  # nothing queued
        c.flush()
        assert c.controller.metrics.tokens_loaded == issued
        # And it loads for real afterwards.
        assert c.load_back(again.last_host_node, agree="step") is not None
        assert c.agree_load_backs() == []
        c.start_loading()
        c.flush()
        check_kv(c, TOKENS, c.match_prefix(TOKENS).device_indices)
        c.verify()


def test_an_error_inside_a_step_load_back_is_raised_at_the_agreement(each_tree_core, monkeypatch):
    """On the rank where eviction raises, load_back records the error and returns None (it must still
    take part in the step's agreement); agree_load_backs raises it afterwards, with nothing held."""
    with make_cache(device_slots=16, page_size=4) as c:
        m = host_only(c)
        prefill(c, list(range(500, 516)))  # the device pool is full again: the load-back must evict
        c.flush()  # backed up and unlocked: evictable
        m = c.match_prefix(TOKENS)

        def evict(n):
            raise OSError("injected eviction failure")

        monkeypatch.setattr(c.load_backs, "evict", evict)  # the eviction the load-back calls
        assert c.load_back(m.last_host_node, agree="step") is None
        monkeypatch.undo()
        with pytest.raises(OSError, match="injected eviction failure"):
            c.agree_load_backs()
        assert c.protected_size() == 0 and not c.controller._pending_loads
        c.flush()
        c.verify()


def test_flush_settles_step_load_backs_and_bad_agree_is_refused(each_tree_core):
    with make_cache(device_slots=32, page_size=4) as c:
        m = host_only(c)
        with pytest.raises(ValueError, match="agree: expected 'now' or 'step', got 'later'"):
            c.load_back(m.last_host_node, agree="later")
        assert c.load_back(m.last_host_node, agree="step") is not None
        c.flush()  # settles first, then runs the load
        check_kv(c, TOKENS, c.match_prefix(TOKENS).device_indices)
        c.verify()


def test_a_write_back_eviction_starts_no_queued_load_back(each_tree_core):
    """A step load-back is queued (not agreed yet); a write-back eviction must then back up its victims
    and wait for them, and only them: were it to start the queued load-back, a revocation at the step's
    agreement would find it started (cancel_load refuses: ValueError), and it would have waited for every
    load in flight too."""
    with make_cache(device_slots=32, page_size=4, write_policy="write_back") as c:
        m = host_only(c)
        assert c.load_back(m.last_host_node, agree="step") is not None
        queued = list(c.controller._pending_loads)
        assert len(queued) == 1
        prefill(c, list(range(500, 516)))  # device-only (write-back): the device pool is full again
        assert c.device_pool.available_size() == 0
        assert c.evict(8) >= 8  # victims backed up first: waited for, then dropped
        assert c.controller._pending_loads == queued and c.controller.layer_counter.in_flight == ()
        op, node_id = queued[0], m.last_host_node.id
        c.controller.cancel_load(node_id, op.host_indices)  # still cancellable: never started
        c.controller.load(op.host_indices, op.device_indices, node_id)  # queued again, as it was
        assert c.agree_load_backs() == []
        c.start_loading()
        c.flush()
        check_kv(c, TOKENS, c.match_prefix(TOKENS).device_indices)
        c.verify()
