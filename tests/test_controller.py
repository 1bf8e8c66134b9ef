"""HiCacheController: queues, acks, layer-by-layer loads, shutdown, errors; a GPU run on `kernel`."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hicache import DeviceKVPool, HiCacheController, HiRadixCache, HostKVPool, LayerDoneCounter, SlotState

from cachedata import evict_and_reload, make_cache, prefill


def pools(device="cpu", pin=False, layout="page_first", page_size=1):
    dev = DeviceKVPool(num_slots=32, num_layers=4, head_num=2, head_dim=4, dtype=torch.float16, device=device,
                       page_size=page_size)  # fmt: skip
    return dev, HostKVPool(dev, layout=layout, ratio=2.0, pin_memory=pin)


def test_layer_done_counter_blocks_until_the_layer_is_loaded():
    counter = LayerDoneCounter(3)
    counter.wait_until(2)  # nothing in flight: ready at once
    counter.start()
    seen = []

    def consumer():
        for layer in range(3):
            counter.wait_until(layer)
            seen.append(layer)

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.05)
    assert seen == []
    counter.layer_done(0)
    counter.layer_done(1)
    time.sleep(0.05)
    assert seen == [0, 1]
    counter.layer_done(2)
    t.join(5)
    assert seen == [0, 1, 2] and counter.layers_done == 3


def test_layer_done_counter_keeps_overlapping_batches_apart():
    counter = LayerDoneCounter(2)
    first = counter.start()
    second = counter.start()
    counter.layer_done(0, generation=first)
    counter.layer_done(1, generation=first)  # the old batch completes...
    with pytest.raises(TimeoutError):
        counter.wait_until(0, timeout=0.01)  # ...which says nothing about the newest one
    counter.layer_done(0, generation=second)
    counter.wait_until(0)
    counter.wait_until(1, generation=first)  # a finished batch stays ready
    assert counter.layers_done == 1
    with pytest.raises(ValueError, match="generation"):
        counter.layer_done(0, generation=99)


def test_layer_done_counter_times_out():
    counter = LayerDoneCounter(2)
    counter.start()
    with pytest.raises(TimeoutError, match="layer 0"):
        counter.wait_until(0, timeout=0.01)


def test_load_ticks_layers_in_order():
    dev, host = pools()
    ctrl = HiCacheController(dev, host, io_backend="direct", threaded=False)
    ticks = []
    original = ctrl.layer_counter.layer_done
    ctrl.layer_counter.layer_done = lambda layer, stream=None, generation=None: (
        ticks.append(layer),
        original(layer, stream, generation),
    )
    slots = dev.alloc(4)
    hs = ctrl.write(slots, node_id=1)
    assert ctrl.finished_writes() == [1]
    host.mark_synced(hs)
    ctrl.load(hs, slots, node_id=2)
    assert ticks == []  # queued, not started
    assert ctrl.start_loading() == 1
    assert ticks == [0, 1, 2, 3] and ctrl.finished_loads() == [2]
    ctrl.close()


def test_write_refused_when_host_is_full():
    dev, host = pools()
    ctrl = HiCacheController(dev, host, io_backend="direct", threaded=False)
    big = dev.alloc(32)
    assert ctrl.write(big, 1) is not None
    assert ctrl.write(big, 2) is not None
    assert ctrl.write(big[:1], 3) is None  # 64 host slots used
    assert ctrl.metrics.writes_refused_host_full == 1
    ctrl.close()


def test_threaded_workers_ack_in_submission_order_and_flush():
    dev, host = pools()
    with HiCacheController(dev, host, io_backend="direct", threaded=True) as ctrl:
        ids = []
        for i in range(8):
            ctrl.write(dev.alloc(2), node_id=i)
            ids.append(i)
        ctrl.flush()
        assert ctrl.finished_writes() == ids
        assert (host.state()[:16] == SlotState.WRITING).all()  # the tree marks them synced


def test_worker_error_surfaces_on_the_next_call():
    dev, host = pools()
    ctrl = HiCacheController(dev, host, io_backend="direct", threaded=True)
    ctrl.write(torch.tensor([999]), node_id=1)  # out of range: the worker's op raises
    with pytest.raises(RuntimeError, match="worker failed"):
        ctrl.flush()
    ctrl.close(drain=False)


def test_close_without_drain_drops_queued_work_and_joins():
    before = threading.active_count()
    dev, host = pools()
    ctrl = HiCacheController(dev, host, io_backend="direct", threaded=True)
    gate = threading.Event()
    original = ctrl._execute
    ctrl._execute = lambda op: (gate.wait(5), original(op))
    for i in range(4):
        ctrl.write(dev.alloc(1), node_id=i)
    gate.set()
    ctrl.close(drain=False)
    assert threading.active_count() == before
    ctrl.close()  # idempotent


def test_agree_min_without_group_is_identity():
    dev, host = pools()
    ctrl = HiCacheController(dev, host, io_backend="direct", threaded=False)
    assert ctrl.agree_min(5) == 5 and ctrl.agree_min(False) == 0
    ctrl.close()


def test_layer_wise_load_through_the_cache_matches_all_at_once():
    for layer_wise in (True, False):
        c = make_cache(device_slots=32)
        c.controller.layer_wise = layer_wise
        toks = list(range(60, 80))
        prefill(c, toks)
        evict_and_reload(c, toks, wait_layer=c.device_pool.num_layers - 1)
        c.close()


@pytest.mark.gpu
@pytest.mark.gpu_smoke
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_controller_on_gpu_with_kernel_backend(write_policy):
    """Pinned host pool, real streams, worker threads, zero-copy kernels."""
    dev = DeviceKVPool(num_slots=256, num_layers=4, head_num=8, head_dim=64, dtype=torch.bfloat16, device="cuda",
                       page_size=16)  # fmt: skip
    host = HostKVPool(dev, layout="page_first_direct", ratio=2.0, pin_memory=True)
    with HiRadixCache(dev, host, io_backend="kernel", write_policy=write_policy, threaded=True,
                      load_back_threshold=16) as c:  # fmt: skip
        seqs = [list(range(i * 1000, i * 1000 + 64)) for i in range(6)]
        for s in seqs:
            match = c.match_prefix(s)
            slots = dev.alloc(len(s) - len(match.device_indices))
            if slots is None:
                c.evict(len(s))
                slots = dev.alloc(len(s) - len(match.device_indices))
            torch.manual_seed(len(s))
            for layer in range(4):
                dev.k[layer, slots] = torch.randn(len(slots), 8, 64, device="cuda", dtype=torch.bfloat16)
                dev.v[layer, slots] = torch.randn(len(slots), 8, 64, device="cuda", dtype=torch.bfloat16)
            c.insert(s, torch.cat([match.device_indices, slots]))
            c.check_writes()
        snapshot = {
            tuple(s): (dev.k[:, idx].clone(), dev.v[:, idx].clone())
            for s in seqs[-2:]
            if len(idx := c.match_prefix(s).device_indices) == len(s)
        }
        c.flush()
        c.evict(dev.size)
        for s, (k, v) in snapshot.items():
            m = c.match_prefix(list(s))
            assert c.load_back(m.last_host_node) is not None
            c.start_loading()
            c.flush()
            idx = c.match_prefix(list(s)).device_indices
            assert torch.equal(dev.k[:, idx], k) and torch.equal(dev.v[:, idx], v)
        c.verify()
