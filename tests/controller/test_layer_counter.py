"""LayerDoneCounter: overlapping load batches keep their own events until finished, a fixed ring of
producer slots bounds memory, unknown and failed generations raise; the controller finishes (or
aborts) every batch it starts. On CPU a fake event clock stands in for a GPU stream that runs behind
the host; on a GPU the load stream is delayed with ``torch.cuda._sleep``."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from hicache import DeviceKVPool, HiCacheController, HostKVPool, LayerDoneCounter

from cachedata import wrap_copies

# ---------------------------------------------------------------------------------------------------
# A fake event clock: what CPU cannot reach (a stream that runs behind the host)
# ---------------------------------------------------------------------------------------------------


class FakeStream:
    """A load stream whose work runs only when a consumer waits for it, like a GPU stream that is far
    behind the host: work enqueued here has *not* happened until something waits past it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Callable[[], object]] = []
        self.completed = 0  # work items run so far

    @property
    def enqueued(self) -> int:
        with self._lock:
            return self.completed + len(self._pending)

    def enqueue(self, work: Callable[[], object]) -> None:
        with self._lock:
            self._pending.append(work)

    def run_until(self, position: int) -> None:
        with self._lock:
            while self.completed < position:
                self._pending.pop(0)()
                self.completed += 1


class FakeEvent:
    """Marks a position on a :class:`FakeStream`; complete once the stream has run up to it."""

    def __init__(self, default_stream: FakeStream) -> None:
        self._default = default_stream
        self.stream = default_stream
        self.position = 0  # never recorded: complete, as a fresh CUDA event is

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream or self._default
        self.position = self.stream.enqueued

    def query(self) -> bool:
        return self.stream.completed >= self.position


class FakeClock:
    """:class:`hicache.controller.layer_counter.LayerEvents` over a :class:`FakeStream`. ``wait`` runs the stream up
    to the event, as a consumer stream waiting on a CUDA event only proceeds once the copies before it
    have run; ``created`` and ``waits`` record what the counter asked of it."""

    def __init__(self) -> None:
        self.stream = FakeStream()
        self.created = 0
        self.waits: list[int] = []

    def new_event(self) -> FakeEvent:
        self.created += 1
        return FakeEvent(self.stream)

    def wait(self, event: FakeEvent) -> None:
        self.waits.append(event.position)
        event.stream.run_until(event.position)


# ---------------------------------------------------------------------------------------------------
# The defect: an older batch completing its issue while a newer one exists lost its events
# ---------------------------------------------------------------------------------------------------


def test_consumer_of_an_older_batch_waits_for_its_copies_not_just_their_issue():
    L = 3
    clock = FakeClock()
    counter = LayerDoneCounter(L, events=clock)
    host = torch.arange(1, 2 * L * 4 + 1, dtype=torch.float32).reshape(2, L, 4)  # [batch, layer, item]
    dev = torch.zeros(2, L, 4)

    def issue(batch: int, generation: int, layer: int) -> None:
        clock.stream.enqueue(lambda: dev[batch, layer].copy_(host[batch, layer]))
        counter.layer_issued(layer, clock.stream, generation)

    first = counter.start()
    for layer in range(L - 1):
        issue(0, first, layer)
    second = counter.start()
    issue(0, first, L - 1)  # the older batch's last layer is issued while a newer batch exists
    for layer in range(L):
        issue(1, second, layer)
    assert counter.in_flight == (first, second)
    assert not dev.any()  # everything issued, nothing landed: the stream runs behind
    assert counter.layers_done == 0  # issued is not loaded

    counter.wait_until(0, generation=first)
    assert torch.equal(dev[0, 0], host[0, 0])
    assert clock.stream.completed == 1  # waited for layer 0 only: later layers still overlap
    for layer in range(1, L):
        counter.wait_until(layer, generation=first)
        assert torch.equal(dev[0, layer], host[0, layer])
    for layer in range(L):
        counter.wait_until(layer)  # the newest batch
        assert torch.equal(dev[1, layer], host[1, layer])
    assert counter.layers_done == L

    clock.stream.run_until(clock.stream.enqueued)
    counter.finish(first)
    counter.finish(second)
    waits = len(clock.waits)
    counter.wait_until(L - 1, generation=first)  # finished: landed, nothing left to wait on
    assert len(clock.waits) == waits and counter.in_flight == ()


def test_consumer_blocked_before_the_issue_then_waits_for_the_copy():
    """Consumer and producer on different threads: the consumer waits on the host for the issue and
    then for the copy itself, for the older of two overlapping batches."""
    L = 2
    clock = FakeClock()
    counter = LayerDoneCounter(L, events=clock)
    host = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [batch, layer]
    dev = torch.zeros(2, L)
    first = counter.start()
    second = counter.start()
    seen: list[float] = []
    errors: list[BaseException] = []

    def consumer() -> None:
        try:
            counter.wait_until(L - 1, timeout=10, generation=first)
            seen.append(float(dev[0, L - 1]))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=consumer, daemon=True)
    t.start()
    for batch, gen in ((0, first), (1, second)):
        for layer in range(L):
            clock.stream.enqueue(lambda b=batch, k=layer: dev[b, k].copy_(host[b, k]))
            counter.layer_issued(layer, clock.stream, gen)
    t.join(10)
    assert not t.is_alive() and errors == []
    assert seen == [2.0]


# ---------------------------------------------------------------------------------------------------
# Generations, slots, failures
# ---------------------------------------------------------------------------------------------------


def test_unknown_generation_raises_and_generation_zero_is_nothing_to_wait_for():
    counter = LayerDoneCounter(2)
    counter.wait_until(1)  # nothing ever started: ready at once
    counter.wait_until(1, generation=0)  # what start_loading returns when nothing was queued
    with pytest.raises(ValueError, match="generation"):
        counter.wait_until(0, generation=1)  # never started
    gen = counter.start()
    with pytest.raises(ValueError, match="generation"):
        counter.wait_until(0, generation=gen + 1)
    with pytest.raises(ValueError, match="generation"):
        counter.wait_until(0, generation=-1)
    with pytest.raises(ValueError, match="layer"):
        counter.wait_until(2, generation=gen)


def test_sequential_batches_reuse_a_fixed_ring_of_events():
    L, slots = 3, 2
    clock = FakeClock()
    counter = LayerDoneCounter(L, events=clock, num_slots=slots, start_timeout=5)
    for _ in range(5 * slots):
        gen = counter.start()
        for layer in range(L):
            counter.layer_issued(layer, clock.stream, gen)
        counter.wait_until(L - 1)
        counter.finish(gen)
        assert counter.in_flight == ()
    assert clock.created == slots * L  # created once, never per batch or per layer_issued


def test_start_blocks_while_every_slot_is_held_until_one_finishes():
    counter = LayerDoneCounter(1, num_slots=1, start_timeout=0.05)
    first = counter.start()
    with pytest.raises(TimeoutError, match="1 slots"):
        counter.start()
    counter.start_timeout = 10
    started: list[int] = []
    t = threading.Thread(target=lambda: started.append(counter.start()), daemon=True)
    t.start()
    counter.layer_issued(0, generation=first)
    counter.finish(first)
    t.join(10)
    assert not t.is_alive() and started == [first + 1]
    counter.wait_until(0, generation=first)  # finished: its data has landed


def test_layers_are_done_in_order_and_finish_needs_them_all():
    counter = LayerDoneCounter(3)
    gen = counter.start()
    counter.layer_issued(0, generation=gen)
    assert counter.layers_done == 1  # no events (CPU copies are synchronous): issued is loaded
    with pytest.raises(ValueError, match="layer"):
        counter.layer_issued(0, generation=gen)  # already done
    with pytest.raises(ValueError, match="layer"):
        counter.layer_issued(3, generation=gen)
    with pytest.raises(ValueError, match="1 of 3 layers"):
        counter.finish(gen)
    counter.layer_issued(2, generation=gen)  # skipping ahead covers layer 1 too
    counter.wait_until(1, timeout=0)
    counter.finish(gen)
    with pytest.raises(ValueError, match="generation"):
        counter.finish(gen)  # twice


def test_abort_wakes_and_fails_the_consumers_of_that_batch():
    counter = LayerDoneCounter(2)
    gen = counter.start()
    errors: list[BaseException] = []

    def consumer() -> None:
        try:
            counter.wait_until(1, timeout=10, generation=gen)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=consumer, daemon=True)
    t.start()
    counter.abort(gen, "disk on fire")
    t.join(10)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "disk on fire" in str(errors[0])
    assert counter.in_flight == ()
    with pytest.raises(RuntimeError, match=f"generation {gen} failed"):
        counter.wait_until(0, generation=gen)


# ---------------------------------------------------------------------------------------------------
# The controller finishes each load batch it acknowledges, and aborts a failed one
# ---------------------------------------------------------------------------------------------------


def pools() -> tuple[DeviceKVPool, HostKVPool]:
    dev = DeviceKVPool(num_slots=32, num_layers=3, head_num=1, head_dim=4, dtype=torch.float32, device="cpu")
    return dev, HostKVPool(dev, layout="page_first", ratio=2.0)


@pytest.mark.parametrize("threaded", [False, True])
def test_controller_finishes_each_load_batch_by_its_ack(threaded):
    dev, host = pools()
    with HiCacheController(dev, host, io_backend="direct", threaded=threaded) as ctrl:
        counter = ctrl.layer_counter
        slots = dev.alloc(4)
        dev.k[:, slots] = torch.randn(3, 4, 1, 4)
        expected = dev.k[:, slots].clone()
        hs = ctrl.write(slots, node_id=0)
        ctrl.flush()
        assert ctrl.finished_writes() == [(0, None)]
        host.mark_synced(hs)
        for i in range(counter.num_slots + 2):  # more batches than slots: none may stay held
            dev.k.zero_()
            ctrl.load(hs, slots, node_id=i)
            gen = ctrl.start_loading()
            counter.wait_until(dev.num_layers - 1, timeout=10, generation=gen)
            ctrl.flush()  # landed
            assert ctrl.finished_loads() == [(i, None)]
            assert gen not in counter.in_flight  # released by the time its ack is taken
            assert torch.equal(dev.k[:, slots], expected)
            host.mark_synced(hs)
        assert counter.in_flight == ()


def test_controller_aborts_a_failed_load_so_its_consumers_fail_fast():
    dev, host = pools()
    ctrl = HiCacheController(dev, host, io_backend="direct", threaded=False)
    hs = ctrl.write(dev.alloc(2), node_id=0)
    ctrl.flush()
    assert ctrl.finished_writes() == [(0, None)]
    host.mark_synced(hs)
    ctrl.load(hs, torch.tensor([0, 999]), node_id=1)  # device slot out of range: the copy raises
    gen = ctrl.start_loading()  # a failed copy is acknowledged with its error, not raised here
    with pytest.raises(RuntimeError, match=f"generation {gen} failed"):
        ctrl.layer_counter.wait_until(0, timeout=5)
    assert ctrl.layer_counter.in_flight == ()
    ((node_id, error),) = ctrl.finished_loads()
    assert node_id == 1 and isinstance(error, IndexError)
    ctrl.close(drain=False)


# ---------------------------------------------------------------------------------------------------
# GPU: a load stream delayed with torch.cuda._sleep, consumers on their own stream
# ---------------------------------------------------------------------------------------------------

SLEEP_CYCLES = 50_000_000  # ~25 ms at the H200's ~2 GHz SM clock, per layer: far behind the host


@pytest.mark.gpu
@pytest.mark.gpu_smoke
def test_gpu_consumer_of_an_older_batch_reads_what_its_delayed_copies_loaded():
    L, n = 4, 1 << 14
    counter = LayerDoneCounter(L, torch.device("cuda"))
    host = torch.randn(2, L, n, pin_memory=True)  # [batch, layer, items]
    dev = torch.zeros(2, L, n, device="cuda")
    seen = torch.zeros(2, L, n, device="cuda")
    load, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()  # the zeros exist before either stream touches them

    def issue(batch: int, generation: int, layer: int) -> None:
        with torch.cuda.stream(load):
            torch.cuda._sleep(SLEEP_CYCLES)
            dev[batch, layer].copy_(host[batch, layer], non_blocking=True)  # pinned: truly async
        counter.layer_issued(layer, load, generation)

    first = counter.start()
    for layer in range(L - 1):
        issue(0, first, layer)
    second = counter.start()
    issue(0, first, L - 1)  # the older batch completes its issue while a newer one exists
    for layer in range(L):
        issue(1, second, layer)
    with torch.cuda.stream(consumer):
        for batch, gen in ((0, first), (1, second)):
            for layer in range(L):
                counter.wait_until(layer, generation=gen)
                seen[batch, layer].copy_(dev[batch, layer])  # ordered after the layer's copy, or stale
    consumer.synchronize()
    assert torch.equal(seen.cpu(), host)
    load.synchronize()
    counter.finish(first)
    counter.finish(second)
    assert counter.in_flight == ()


@pytest.mark.gpu
@pytest.mark.gpu_smoke
def test_gpu_skipped_layers_wait_for_the_copy_that_covers_them():
    """Skipping ahead (layer_issued(3) after layer 0) records the skipped layers' events at the same
    point of the load stream as layer 3's, after every copy issued so far: a consumer of layer 1 or 2
    on another stream reads what those delayed copies loaded, never the zeros before them."""
    L, n = 4, 1 << 14
    counter = LayerDoneCounter(L, torch.device("cuda"))
    host = torch.randn(L, n, pin_memory=True)
    dev = torch.zeros(L, n, device="cuda")
    seen = torch.zeros(L, n, device="cuda")
    load, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    gen = counter.start()
    with torch.cuda.stream(load):
        torch.cuda._sleep(SLEEP_CYCLES)
        dev[0].copy_(host[0], non_blocking=True)
    counter.layer_issued(0, load, gen)
    with torch.cuda.stream(load):
        for layer in range(1, L):
            torch.cuda._sleep(SLEEP_CYCLES)
            dev[layer].copy_(host[layer], non_blocking=True)
    counter.layer_issued(L - 1, load, gen)  # layers 1 and 2 are covered by this one record
    with torch.cuda.stream(consumer):
        for layer in (2, 1, 0, 3):
            counter.wait_until(layer, generation=gen)
            seen[layer].copy_(dev[layer])
    consumer.synchronize()
    assert torch.equal(seen.cpu(), host)
    load.synchronize()
    counter.finish(gen)


@pytest.mark.gpu
def test_gpu_controller_overlapping_loads_on_a_delayed_stream(monkeypatch):
    L = 4
    dev = DeviceKVPool(num_slots=256, num_layers=L, head_num=8, head_dim=64, dtype=torch.bfloat16, device="cuda",
                       page_size=16)  # fmt: skip
    host = HostKVPool(dev, layout="page_first_direct", ratio=2.0, pin_memory=True)
    ctrl = HiCacheController(dev, host, io_backend="kernel", threaded=True)
    slots = [dev.alloc(32), dev.alloc(32)]
    idx = [s.cuda() for s in slots]
    torch.manual_seed(0)
    dev.k.normal_()
    dev.v.normal_()
    expected = [(dev.k[:, i].clone(), dev.v[:, i].clone()) for i in idx]
    host_slots = [ctrl.write(s, node_id=b) for b, s in enumerate(slots)]
    ctrl.flush()
    assert ctrl.finished_writes() == [(0, None), (1, None)]
    for hs in host_slots:
        host.mark_synced(hs)
    dev.k.zero_()
    dev.v.zero_()
    torch.cuda.synchronize()

    second_started = threading.Event()
    calls: list[int] = []

    def delayed(issue, call):
        calls.append(call.layer_id)
        if len(calls) == L:  # the first batch's last layer: only once the second batch exists
            second_started.wait(30)
        with torch.cuda.stream(call.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        return issue()

    wrap_copies(monkeypatch, "load_layer", delayed)
    try:
        ctrl.load(host_slots[0], slots[0], node_id=10)
        first = ctrl.start_loading()
        ctrl.load(host_slots[1], slots[1], node_id=11)
        second = ctrl.start_loading()
        second_started.set()
        consumer = torch.cuda.Stream()
        got = []
        with torch.cuda.stream(consumer):
            for b, gen in ((0, first), (1, second)):
                for layer in range(L):
                    ctrl.layer_counter.wait_until(layer, generation=gen)
                    got.append((b, layer, dev.k[layer, idx[b]], dev.v[layer, idx[b]]))
        consumer.synchronize()
        for b, layer, k, v in got:
            assert torch.equal(k, expected[b][0][layer]) and torch.equal(v, expected[b][1][layer]), (b, layer)
        ctrl.flush()
        assert ctrl.finished_loads() == [(10, None), (11, None)]
        assert ctrl.layer_counter.in_flight == ()
    finally:
        second_started.set()
        ctrl.close()
