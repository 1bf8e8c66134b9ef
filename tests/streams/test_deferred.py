"""The deferred-completion device model (hicache.streams.deferred) and the ordering defects it catches.

Part 1 checks the model itself on bare pools: a launched copy lands only later, its destination holds
poison meanwhile, and each hazard (a source changed before the copy ran, a destination written or read
before it ran, a stream reading another's unlanded output without waiting) raises naming the op, the
stream and the slots. Part 2 runs the cache over the model and shows the defects of issue 20 that are
about ordering: each test fails when its fix is taken out (noted per test)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from hicache import CopyError, DeviceKVPool, HiCacheController, HiRadixCache, HostKVPool
from hicache.streams import KVRegion
from hicache.streams.deferred import POISON, DeferredDevice, OrderingError, env_seed, hazard_log
from hicache_kernels.binding import KVBinding

L, H, D = 3, 2, 4


@pytest.fixture
def expect_hazards():
    """For tests that provoke hazards on purpose: they are taken off the log the autouse check reads."""
    log = hazard_log()
    start = len(log)
    yield
    del log[start:]


def pools(slots: int = 32, page: int = 4, layout: str = "page_first") -> tuple[DeviceKVPool, HostKVPool]:
    dev = DeviceKVPool(num_slots=slots, num_layers=L, head_num=H, head_dim=D, dtype=torch.float32, device="cpu",
                       page_size=page)  # fmt: skip
    dev.k.copy_(torch.randn_like(dev.k))
    dev.v.copy_(torch.randn_like(dev.v))
    host = HostKVPool(dev, layout=layout, ratio=2.0)
    host.buffer.copy_(torch.randn_like(host.buffer))
    return dev, host


def backup_launch(model, stream, binding, dev, host, d_idx, h_idx, what="backup"):
    model.launch(stream, lambda s: binding.backup(d_idx, h_idx, backend="direct"), reads=[KVRegion(dev, d_idx)],
                 writes=[KVRegion(host, h_idx)], what=what)  # fmt: skip


def load_launch(model, stream, binding, dev, host, d_idx, h_idx, what="load"):
    model.launch(stream, lambda s: binding.load(d_idx, h_idx, backend="direct"), reads=[KVRegion(host, h_idx)],
                 writes=[KVRegion(dev, d_idx)], what=what)  # fmt: skip


def bare_model() -> tuple[DeviceKVPool, HostKVPool, KVBinding, DeferredDevice]:
    """Random pools bound page-first, and a model that runs queued work only when waited for."""
    dev, host = pools()
    binding = KVBinding(dev.k, dev.v, host.buffer, layout="page_first", page_size=4)
    return dev, host, binding, DeferredDevice(seed=0, step_probability=0.0)


def is_poison(t: torch.Tensor) -> bool:
    return bool((t.reshape(-1).view(torch.uint8) == POISON).all())


# ---------------------------------------------------------------------------------------------------
# Part 1: the model
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_a_copy_lands_only_when_its_event_is_waited_for(layout):
    dev, host = pools(layout=layout)
    binding = KVBinding(dev.k, dev.v, host.buffer, layout=layout, page_size=4)
    model = DeferredDevice(seed=0, step_probability=0.0)
    stream = model.new_stream("write")
    d_idx, h_idx = torch.arange(8, 16), torch.arange(24, 32)
    # The reference: the same copy on clones, with the direct backend.
    ref_host = host.buffer.clone()
    KVBinding(dev.k.clone(), dev.v.clone(), ref_host, layout=layout, page_size=4).backup(d_idx, h_idx, backend="direct")
    untouched = host.buffer.clone()
    backup_launch(model, stream, binding, dev, host, d_idx, h_idx)
    done = model.new_event()
    done.record(stream)
    assert not done.query() and model.queued() == 1
    changed = host.buffer != untouched
    assert changed.any() and is_poison(host.buffer[changed])  # the destination holds poison, nothing else moved
    done.synchronize()
    assert done.query() and model.queued() == 0
    assert torch.equal(host.buffer, ref_host)


def test_seeds_interleave_two_streams_differently():
    orders = set()
    for seed in range(6):
        dev, host = pools(slots=64)
        binding = KVBinding(dev.k, dev.v, host.buffer, layout="page_first", page_size=4)
        model = DeferredDevice(seed=seed, step_probability=0.5)
        streams = [model.new_stream("a"), model.new_stream("b")]
        marks = []
        for i in range(8):
            s = streams[i % 2]
            backup_launch(model, s, binding, dev, host, torch.arange(4 * i, 4 * i + 4), torch.arange(4 * i, 4 * i + 4))
            ev = model.new_event()
            ev.record(s)
            marks.append(ev)
        orders.add(tuple(ev.query() for ev in marks))
        model.synchronize()
        assert all(ev.query() for ev in marks)
    assert len(orders) > 1


def test_a_source_overwritten_before_its_copy_ran_fails_naming_op_stream_and_slots(expect_hazards):
    dev, host, binding, model = bare_model()
    stream = model.new_stream("write")
    backup_launch(model, stream, binding, dev, host, torch.arange(4, 8), torch.arange(0, 4), what="backup of node 7")
    dev.k[1, 5] += 1.0  # the device slot is reused while its backup is still queued
    with pytest.raises(OrderingError, match=r"backup of node 7.*'write'.*slots \[5\].*changed") as e:
        stream.synchronize()
    assert model.hazards == [str(e.value)]


def test_a_destination_written_before_its_copy_ran_fails(expect_hazards):
    dev, host, binding, model = bare_model()
    stream = model.new_stream("load")
    d_idx, h_idx = torch.arange(8, 12), torch.arange(0, 4)
    load_launch(model, stream, binding, dev, host, d_idx, h_idx)
    dev.v[2, 9] = 0.5  # a forward writes into a slot the load has not filled yet
    with pytest.raises(OrderingError, match=r"'load'.*destination slots \[9\].*written by someone else"):
        stream.synchronize()


def test_a_read_before_the_copy_landed_fails_and_after_the_wait_passes(expect_hazards):
    dev, host, binding, model = bare_model()
    stream = model.new_stream("load")
    d_idx, h_idx = torch.arange(8, 12), torch.arange(0, 4)
    load_launch(model, stream, binding, dev, host, d_idx, h_idx)
    ev = model.new_event()
    ev.record(stream)
    region = [KVRegion(dev, torch.arange(6, 10), (0,))]
    with pytest.raises(OrderingError, match=r"the forward.*slots \[8, 9\].*has not run yet"):
        model.check_read(region, "the forward")
    model.wait(ev)  # the host's stream waits: the load lands now
    model.check_read(region, "the forward")


@pytest.mark.parametrize("wait", [True, False], ids=["waits", "does_not_wait"])
def test_a_stream_reading_anothers_output_must_wait_on_its_event(expect_hazards, wait):
    dev, host, binding, model = bare_model()
    load, write = model.new_stream("load"), model.new_stream("write")
    d_idx, h_idx = torch.arange(8, 12), torch.arange(0, 4)
    load_launch(model, load, binding, dev, host, d_idx, h_idx)
    if wait:
        ev = model.new_event()
        ev.record(load)
        write.wait_event(ev)
    backup_launch(model, write, binding, dev, host, d_idx, torch.arange(16, 20))
    if wait:
        write.synchronize()  # runs the load first, then the backup reads what it loaded
        assert torch.equal(host.buffer[:, 16:20], host.buffer[:, 0:4])
    else:
        with pytest.raises(OrderingError, match="is the destination of op #1"):
            write.synchronize()


def test_launch_faults_raise_at_issue_and_queue_nothing():
    dev, host, binding, model = bare_model()
    stream = model.new_stream("load")
    model.fail_launch("load", 2, RuntimeError("launch failed"))
    before = host.buffer.clone()
    backup_launch(model, stream, binding, dev, host, torch.arange(4), torch.arange(4))
    with pytest.raises(RuntimeError, match="launch failed"):
        backup_launch(model, stream, binding, dev, host, torch.arange(4, 8), torch.arange(4, 8))
    assert model.queued() == 1 and torch.equal(host.buffer[:, 4:8], before[:, 4:8])


def test_bad_settings_are_refused(monkeypatch):
    monkeypatch.setenv("HICACHE_DEFERRED_SEED", "x1")
    with pytest.raises(ValueError, match="HICACHE_DEFERRED_SEED"):
        env_seed()
    monkeypatch.setenv("HICACHE_DEFERRED_SEED", "7")
    assert env_seed() == 7
    dev, host = pools()
    assert isinstance(HiCacheController(dev, host, io_backend="direct", threaded=False).device, DeferredDevice)
    monkeypatch.delenv("HICACHE_DEFERRED_SEED")
    assert env_seed() is None
    with pytest.raises(ValueError, match="step_probability"):
        DeferredDevice(step_probability=1.5)
    with pytest.raises(TypeError, match="device_model: expected a DeferredDevice"):
        HiCacheController(dev, host, io_backend="direct", device_model=object())


# ---------------------------------------------------------------------------------------------------
# Part 2: the cache over the model
# ---------------------------------------------------------------------------------------------------


def cache_over(model, *, slots=16, threaded=False, **kw) -> HiRadixCache:
    dev, host = pools(slots=slots)
    return HiRadixCache(dev, host, io_backend="direct", threaded=threaded, load_back_threshold=1,
                        device_model=model, **kw)  # fmt: skip


def test_a_failed_load_is_rolled_back_only_after_its_issued_layers_landed():
    """Layer 1 of a load fails at its launch while layer 0 is still queued. The failure must not be
    processed (and the lost device copy freed) before layer 0 has landed: else the freed slots are
    reused by a forward and the queued layer-0 copy then overwrites its KV. Fails (a hazard, and no
    CopyError at the flush) when the controller acks a failure at once, as it did before."""
    model = DeferredDevice(seed=0, step_probability=0.0)
    toks = list(range(16))
    with cache_over(model, slots=16) as c:
        dev = c.device_pool
        slots = dev.alloc(16)
        c.insert(toks, slots)
        c.flush()
        assert c.evict(16) == 16
        m = c.match_prefix(toks)
        assert m.host_hit_length == 16
        assert c.load_back(m.last_host_node) is not None  # every device slot goes to the load
        model.fail_launch("load", 2, RuntimeError("injected launch failure of layer 1"))
        c.start_loading()
        assert model.queued() == 1  # layer 0, still running
        try:
            c.check_loads()
        except CopyError:
            pass  # the defect: processed while layer 0 is in flight (and its slots freed)
        reused = dev.alloc(16)
        if reused is not None:  # a forward computes into whatever slots it gets
            dev.k[:, reused] = torch.randn(L, 16, H, D)
        with pytest.raises(CopyError, match="injected launch failure"):
            c.flush()
        assert model.hazards == []
        assert c.match_prefix(toks).host_hit_length == 16  # host-only again
        c.verify()


def test_a_backup_waits_for_the_kv_its_forward_is_still_writing():
    """The scheduler's current device is another GPU than the pools'; the forward that writes the KV is
    still queued on the pools' device's current stream when the backup is issued. The backup's ready
    event must be recorded on the pools' device: recorded on the current device's stream (as before),
    it orders nothing, and the backup reads KV that is not there yet."""
    model = DeferredDevice(seed=0, step_probability=0.0)
    toks = list(range(8))
    with cache_over(model, slots=16) as c:
        dev, host = c.device_pool, c.host_pool
        model.set_current_device("cuda:1")
        slots = dev.alloc(8)
        kv = torch.randn(L, 8, H, D)

        def forward(_):
            dev.k[:, slots] = kv

        model.launch(model.current_stream(), forward, writes=[KVRegion(dev, slots)], what="forward")
        c.insert(toks, slots)  # write-through: the backup is issued now
        c.flush()
        assert model.hazards == []
        node = c.match_prefix(toks).last_device_node
        assert torch.equal(host.buffer[0][node.host_value], kv.transpose(0, 1))


def test_a_forward_reading_a_layer_before_it_loaded_is_caught(expect_hazards):
    """The engine checks each layer it reads against the copies still queued: a forward that did not
    wait for its layer (here: the layer counter's wait made a no-op) fails loudly instead of reading
    poison."""
    from hicache.serving.engine import Engine
    from hicache.serving.model import ModelConfig, TinyLM

    cfg = ModelConfig(num_layers=2, hidden=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn=32, vocab=31)
    model = TinyLM(cfg)
    pool = cfg.pool(16, 4)
    host = HostKVPool(pool, layout="page_first", ratio=2.0)
    dm = DeferredDevice(seed=0, step_probability=0.0)
    with HiRadixCache(pool, host, io_backend="direct", threaded=False, load_back_threshold=1, device_model=dm) as c:
        engine = Engine(model, pool, c)
        prompt = list(range(1, 13))
        engine.generate(prompt, 2)
        c.flush()
        c.evict(pool.size)
        c.controller.layer_counter.wait_until = lambda *a, **k: None  # the defect: no wait
        with pytest.raises(OrderingError, match=r"the forward reading layer 0.*has not run yet"):
            engine.generate(prompt, 2)


def test_engine_gives_back_a_step_whose_loads_could_not_start(monkeypatch):
    """``start_loading`` raises (a layer-counter timeout, a launch error): the new requests' slots and
    locks are given back. Before, it ran outside the step's unwind and leaked them."""
    from hicache.serving.engine import Engine
    from hicache.serving.model import ModelConfig, TinyLM

    cfg = ModelConfig(num_layers=2, hidden=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn=32, vocab=31)
    model = TinyLM(cfg)
    pool = cfg.pool(32, 4)
    host = HostKVPool(pool, layout="page_first", ratio=2.0)
    with HiRadixCache(pool, host, io_backend="direct", threaded=False, load_back_threshold=1) as c:
        engine = Engine(model, pool, c)
        prompt = list(range(1, 13))
        engine.generate(prompt, 2)
        c.flush()
        c.evict(pool.size)

        def start_loading():
            raise TimeoutError("injected: no layer-counter slot")

        monkeypatch.setattr(c, "start_loading", start_loading)
        with pytest.raises(TimeoutError, match="injected"):
            engine.generate(prompt, 2)
        monkeypatch.undo()
        c.flush()
        c.verify()
        assert c.protected_size() == 0
        assert pool.available_size() + c.evictable_size() == pool.size


def test_tp_group_must_be_gloo(tmp_path, monkeypatch):
    dev, host = pools()
    with pytest.raises(ValueError, match="tp_group: torch.distributed is not initialized"):
        HiCacheController(dev, host, io_backend="direct", tp_group=object())
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        HiCacheController(dev, host, io_backend="direct", tp_group=group, threaded=False).close()
        monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl")
        with pytest.raises(ValueError, match=r"tp_group: .*need a gloo group, got a 'nccl' group"):
            HiCacheController(dev, host, io_backend="direct", tp_group=group, threaded=False)
    finally:
        monkeypatch.undo()
        gc.collect()  # what still holds the group goes before it (see tests/tpharness.py)
        dist.destroy_process_group()


def test_failed_generations_are_bounded():
    from hicache.controller.layer_counter import LayerDoneCounter

    counter = LayerDoneCounter(2)
    for _ in range(3 * counter.max_failed):
        counter.abort(counter.start(), "failed")
    assert len(counter._failed) == counter.max_failed
    with pytest.raises(RuntimeError, match="failed"):
        counter.wait_until(0)  # the newest failure is still reported


def test_threaded_cache_over_the_model_with_a_concurrent_reader():
    """Worker threads issue while the test's thread waits on layers and reads KV: no hazard, and the
    loaded KV equals what was backed up (a smoke test of the model's locking)."""
    model = DeferredDevice(seed=3, step_probability=0.4)
    with cache_over(model, slots=32, threaded=True) as c:
        dev = c.device_pool
        seqs = [list(range(i * 100, i * 100 + 8)) for i in range(3)]
        kvs = []
        for toks in seqs:
            slots = dev.alloc(8)
            kv = torch.randn(L, 8, H, D)
            dev.k[:, slots] = kv
            kvs.append(kv)
            c.insert(toks, slots)
        c.flush()
        c.evict(32)
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                c.controller.device.check_read([], "idle")

        t = threading.Thread(target=poll)
        t.start()
        try:
            for toks, kv in zip(seqs, kvs, strict=True):
                m = c.match_prefix(toks)
                got = c.load_back(m.last_host_node)
                gen = c.start_loading()
                c.controller.layer_counter.wait_until(L - 1, generation=gen, timeout=60)
                for layer in range(L):
                    c.controller.layer_counter.wait_until(layer, generation=gen, timeout=60)
                    c.controller.device.check_read([KVRegion(dev, got, (layer,))], "reader")
                assert torch.equal(dev.k[:, got], kv)
        finally:
            stop.set()
            t.join()
        c.flush()
        assert model.hazards == []
        c.verify()


def test_two_queued_writes_of_one_slot_land_in_stream_order():
    """A slot written, freed, taken again and written before either write ran (one stream, as a
    forward does): no hazard; while the later write is queued the slot keeps its poison (a reader must
    wait for it), and the later write's bytes are what lands."""
    model = DeferredDevice(seed=0, step_probability=0.0)
    dev, _ = pools(slots=8)
    slots = torch.tensor([1, 2])
    first, second = torch.randn(L, 2, H, D), torch.randn(L, 2, H, D)
    current = model.current_stream()

    def write(values):
        def work(_):
            dev.k[:, slots] = values

        return work

    model.launch(current, write(first), writes=[KVRegion(dev, slots)], what="first forward")
    after_first = model.new_event()
    after_first.record(current)
    model.launch(current, write(second), writes=[KVRegion(dev, slots)], what="second forward")
    after_first.synchronize()  # the first write runs; the second is still queued
    assert (dev.k[:, slots].view(torch.uint8) == POISON).all()
    current.synchronize()
    assert torch.equal(dev.k[:, slots], second) and model.hazards == []


def test_a_copy_is_timed_from_after_its_wait_for_the_forward():
    """On the copy's stream: the wait for its ready event, then the start event, the copy and the done
    event. A start recorded before the wait times the copy's queueing behind the forward too
    (write_gbps and load_gbps then understate the link)."""
    model = DeferredDevice(seed=0, step_probability=0.0)
    with cache_over(model, slots=16) as c:
        dev = c.device_pool
        slots = dev.alloc(8)
        model.launch(model.current_stream(), lambda _: None, writes=[KVRegion(dev, slots)], what="forward")
        c.insert(list(range(8)), slots)  # write-through: the backup is issued now, behind the forward
        (write,) = [s for s in model._streams if s.name == "write"]
        assert [item.kind for item in write.queue] == ["wait", "record", "launch", "record"]
        c.flush()
