"""Tests of the mooncake storage backend against a real ``mooncake_master`` on 127.0.0.1 and real clients
(TCP transport, no mocks): round trips for every host layout, MHA and MLA; the leading-present count;
keys already stored skipped on a set; per-key failures as misses; the master frozen, killed and started
again; a second process reading the first's pages.

Needs the Mooncake Store client (``pip install mooncake-transfer-engine-non-cuda`` on a CPU machine, and
``apt-get install libibverbs1``); the tests that need a master skip, saying why, without it. The master
binary is ``$HICACHE_MOONCAKE_MASTER``, else the one in the ``mooncake`` package, else ``mooncake_master``
on PATH.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import sys
import threading
import time

import pytest
import torch
from mooncakedata import HANG_S, Master, free_ports, make_backend
from storagedata import PAGE, host_pool, page_bytes

from hicache.storage import Namespace, create_backend, mooncake_calls, page_keys
from hicache_kernels import layouts

from kvdata import random_bytes_

CASES = [(lay, False) for lay in layouts.LAYOUTS] + [(lay, True) for lay in layouts.MLA_LAYOUTS]
TIMEOUT_S = 1.0  # the backend's per-call bound in the fault tests
# HANG_S (mooncakedata) is a hang detector, never a speed limit (CI runs on a busy machine): a call still
# running after it fails the test instead of hanging it. Whether the backend's bounds acted (a call given
# up on at timeout_s, or not made at all while the master is down) is read from its counters, not the clock.
LOGGER = "hicache.storage.mooncake"


def returns(fn, *args, within: float = HANG_S):
    """``fn(*args)`` run on a thread: its result (or its exception, raised here); fails the test when it
    is still running after ``within`` seconds (a hang detector)."""
    box: dict = {}

    def target() -> None:
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(within)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} hung: still running after {within:g} s"
    if "error" in box:
        raise box["error"]
    return box["out"]


@pytest.fixture(scope="module")
def backend(master):
    be = make_backend(master.address)
    yield be
    be.close()


# -- pools and reference bytes --------------------------------------------------------------------------
def keys_for(n: int, salt: str) -> list[str]:
    """Keys unique to ``salt``: the tests share one store."""
    return page_keys(list(range(n * PAGE)), PAGE, namespace=Namespace("mc-" + salt, "bfloat16", 3, 2, 8, PAGE, "x"))


# -- without a master -------------------------------------------------------------------------------------
def test_import_without_the_client_and_a_clear_error(monkeypatch):
    import hicache.storage.mooncake as mod

    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # "import mooncake.store" raises ImportError
    with pytest.raises(RuntimeError, match="pip install mooncake-transfer-engine"):
        mod.MooncakeBackend("127.0.0.1:1")


@pytest.mark.parametrize(
    "kw,match",
    [({"master_server_address": "nohostport"}, "master_server_address"), ({"protocol": ""}, "protocol"),
     ({"global_segment_size": 0}, "global_segment_size"), ({"timeout_s": -1}, "timeout_s"),
     ({"local_hostname": 3}, "local_hostname"), ({"retry_interval_s": 0}, "retry_interval_s")],
)  # fmt: skip
def test_arguments_are_checked(kw, match):
    from hicache.storage.mooncake import MooncakeBackend

    kw = {"master_server_address": "127.0.0.1:50051", **kw}
    with pytest.raises(ValueError, match=match):
        MooncakeBackend(**kw)


def test_no_master_is_a_quick_clear_error(master_binary):
    """The constructor's probe answers, naming the argument: without it the client's setup() retries
    for ~90 s and the constructor gives up at setup_timeout_s (30 s) with another message. The message
    is the check; HANG_S is only a hang detector."""
    port = free_ports(1)[0]
    with pytest.raises(RuntimeError, match=f"master_server_address: no mooncake_master answers at 127.0.0.1:{port}"):
        returns(make_backend, f"127.0.0.1:{port}")


# -- calls given up on: a fake client (the fake_mooncake fixture) that stalls mid-transfer ---------------
@pytest.mark.parametrize("method", ["get", "put"])
@pytest.mark.parametrize("layout,mla", [("page_first", True), ("page_first", False), ("layer_first", False)])
def test_a_batch_call_given_up_on_keeps_its_slots_busy_until_it_returns(fake_mooncake, method, layout, mla):
    """A batch call that outlives timeout_s returns misses while the client goes on with the transfer:
    its batch's host slots are busy (slots_busy) until it returns, and no others; the transfer did move
    the bytes late (read into the destination, or stored from the source)."""
    host = host_pool(layout, mla, seed=40)
    src, dst, other = host.alloc(3 * PAGE), host.alloc(3 * PAGE), host.alloc(PAGE)
    keys = keys_for(3, f"late-{method}-{layout}-{mla}")
    want = page_bytes(host, src)
    be = fake_mooncake.backend(timeout_s=0.05, retry_interval_s=3600).attach(host)  # no call after a timeout
    stall = fake_mooncake.stall(method)
    try:
        if method == "get":
            fake_mooncake.objects.update(zip(keys, want, strict=True))
            random_bytes_(host.buffer, torch.Generator().manual_seed(41))  # the destination poisoned
            assert page_bytes(host, dst) != want
            busy = dst
            assert be.batch_get_into(keys, dst) == [False] * 3
        else:
            busy = src
            assert be.batch_set_from(keys, src) == [False] * 3
        assert be.slots_busy(busy) and be.slots_busy(busy[PAGE : 2 * PAGE])  # every page of the batch
        assert not be.slots_busy(other) and not be.slots_busy(dst if method == "put" else src)
        assert be.stats()["abandoned"] == 1
        stall.release.set()
        assert not be.slots_busy(busy, timeout=HANG_S)  # free to reuse once the call returned
        assert stall.done.is_set() and be.stats()["abandoned"] == 0
        if method == "get":
            assert page_bytes(host, dst) == want  # the late read landed (in slots kept busy until it did)
        else:
            assert [fake_mooncake.puts[k] for k in keys] == want  # the late put read the pages it was given
    finally:
        stall.release.set()
        be.close()


def test_a_call_on_time_leaves_no_slot_busy(fake_mooncake):
    host = host_pool(seed=42)
    src, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE)
    keys = keys_for(2, "on-time")
    with fake_mooncake.backend(timeout_s=30.0).attach(host) as be:
        assert be.batch_set_from(keys, src) == [True, True]
        assert be.batch_get_into(keys, dst) == [True, True]
        assert page_bytes(host, dst) == page_bytes(host, src)
        assert not be.slots_busy(src) and not be.slots_busy(dst) and be.stats()["abandoned"] == 0


def test_a_call_whose_thread_cannot_start_is_not_left_running(monkeypatch):
    """Where no thread may start (Python 3.12 at interpreter exit) the call is refused, and not counted
    as running: the exit hook does not wait for it."""
    monkeypatch.setattr(mooncake_calls.lifetime, "stop_at_exit", lambda stop: 0)  # this test's own workers
    workers = mooncake_calls._Workers()

    def refuse(self):  # noqa: ANN001
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't create new thread"):
        workers.submit(lambda: None)
    monkeypatch.undo()
    assert workers._stop_at_exit(0.1) is None


# -- round trips ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,mla", CASES)
def test_round_trip_every_layout(backend, layout, mla):
    host = host_pool(layout, mla, seed=1)
    src, dst = host.alloc(3 * PAGE), host.alloc(3 * PAGE)
    want = page_bytes(host, src)
    keys = keys_for(3, f"rt-{layout}-{mla}")
    before = backend.attach(host).stats()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_from(keys, src) == [True] * 3
    assert backend.batch_exists(keys) == 3
    assert backend.batch_get_into(keys, dst) == [True] * 3
    assert page_bytes(host, dst) == want
    # One object per page, its bytes in range order: the same page object every backend stores.
    assert [backend.get(k) for k in keys] == want
    st = backend.stats()
    assert st["hits"] - before["hits"] == 3 and st["sets"] - before["sets"] == 3
    assert st["bytes_read"] - before["bytes_read"] == 3 * host.page_bytes
    assert st["master_up"] == 1 and st["backend"] == "MooncakeBackend"
    # A second pool of the same geometry (another buffer, registered on attach) reads them too.
    other = host_pool(layout, mla, seed=2)
    dst2 = other.alloc(3 * PAGE)
    assert backend.attach(other).batch_get_into(keys, dst2) == [True] * 3
    assert page_bytes(other, dst2) == want


def test_many_ranges_per_page(backend):
    """layer_first with 40 layers: 80 ranges per page gathered into one object and scattered back."""
    host = host_pool("layer_first", seed=3, num_layers=40)
    src, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE)
    keys = keys_for(2, "many-ranges")
    backend.attach(host)
    assert len(host.page_ranges(src)[0]) == 80
    assert backend.batch_set_from(keys, src) == [True, True]
    assert backend.batch_get_into(keys, dst) == [True, True]
    assert page_bytes(host, dst) == page_bytes(host, src)


def test_batch_exists_counts_leading_keys(backend):
    host = host_pool(seed=4)
    src = host.alloc(4 * PAGE)
    keys = keys_for(4, "leading")
    backend.attach(host)
    assert backend.batch_exists(keys) == 0 and backend.batch_exists([]) == 0
    picked = torch.cat([src[: 2 * PAGE], src[3 * PAGE :]])
    assert backend.batch_set_from([keys[0], keys[1], keys[3]], picked) == [True] * 3
    assert backend.batch_exists(keys) == 2  # key 3 is present but not leading
    assert backend.batch_exists(keys[3:]) == 1 and backend.batch_exists(keys[2:]) == 0
    assert backend.exists(keys[0]) and not backend.exists(keys[2])


def test_keys_already_present_are_skipped(backend):
    host = host_pool("layer_first", seed=5)
    src, other, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE), host.alloc(3 * PAGE)
    keys = keys_for(3, "skip")
    backend.attach(host)
    assert backend.batch_set_from(keys[:2], src) == [True, True]
    skipped = backend.stats()["skipped"]
    # Other bytes under the same keys: reported stored, not written (a key names its bytes).
    assert backend.batch_set_from(keys[:2], other) == [True, True]
    assert backend.stats()["skipped"] == skipped + 2
    # A batch mixing a present key, a new key and that new key again.
    assert backend.batch_set_from([keys[0], keys[2], keys[2]], host.alloc(3 * PAGE)) == [True] * 3
    assert backend.stats()["skipped"] == skipped + 3
    assert backend.batch_get_into(keys[:2], dst[: 2 * PAGE]) == [True, True]
    assert page_bytes(host, dst[: 2 * PAGE]) == page_bytes(host, src)
    assert backend.set(keys[0], b"other bytes") is True and backend.get(keys[0]) == page_bytes(host, src)[0]


def test_per_key_failures_are_misses(backend):
    host = host_pool("page_first", seed=6)
    src, dst = host.alloc(3 * PAGE), host.alloc(3 * PAGE)
    keys = keys_for(3, "misses")
    backend.attach(host)
    assert backend.batch_set_from([keys[0], keys[2]], torch.cat([src[:PAGE], src[2 * PAGE :]])) == [True, True]
    before = backend.stats()
    assert backend.batch_get_into(keys, dst) == [True, False, True]  # key 1: OBJECT_NOT_FOUND
    want = page_bytes(host, src)
    got = page_bytes(host, dst)
    assert (got[0], got[2]) == (want[0], want[2])
    # Objects of another length (another geometry, a stray value) are misses, shorter or longer.
    short, long_ = keys_for(2, "wrong-size")
    assert backend.set(short, b"x" * 10) and backend.set(long_, b"y" * (host.page_bytes + 8))
    assert backend.batch_get_into([short, long_], dst[: 2 * PAGE]) == [False, False]
    st = backend.stats()
    assert st["misses"] - before["misses"] == 3 and st["hits"] - before["hits"] == 2
    assert st["not_found"] - before["not_found"] == 1 and st["errors"] - before["errors"] == 2
    assert backend.get(keys[1]) is None and backend.exists(keys[1]) is False
    assert st["master_up"] == 1  # per-key failures are not an outage


def test_batch_arguments_checked(master):
    be = make_backend(master.address)
    try:
        with pytest.raises(RuntimeError, match="attach"):
            be.batch_get_into(keys_for(1, "args"), torch.arange(PAGE))
        be.attach(host_pool())
        with pytest.raises(ValueError, match="2 keys for 1 pages"):
            be.batch_set_from(keys_for(2, "args"), torch.arange(PAGE))
        assert be.batch_get_into([], torch.arange(0)) == [] and be.batch_set_from([], torch.arange(0)) == []
    finally:
        be.close()
    with pytest.raises(RuntimeError, match="closed"):
        be.batch_set_from(keys_for(2, "args"), torch.arange(2 * PAGE))
    assert be.batch_exists(keys_for(1, "args")) == 0 and be.get(keys_for(1, "args")[0]) is None
    be.close()  # twice is fine


def test_created_by_module_class_spec(master):
    spec = "hicache.storage.mooncake:MooncakeBackend"
    config = {"master_server_address": master.address, "metadata_server": "P2PHANDSHAKE"}
    be = create_backend(
        spec, config, local_hostname="127.0.0.1", global_segment_size=32 << 20, local_buffer_size=8 << 20
    )
    try:
        host = host_pool("page_head", seed=7)
        src, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE)
        keys = keys_for(2, "by-spec")
        assert be.attach(host).batch_set_from(keys, src) == [True, True]
        assert be.batch_get_into(keys, dst) == [True, True]
        assert page_bytes(host, dst) == page_bytes(host, src)
    finally:
        be.close()


# -- two processes ----------------------------------------------------------------------------------------
def _reader(address: str, layout: str, keys: list[str], out: str) -> None:
    host = host_pool(layout, seed=21)
    host.alloc(3 * PAGE)
    dst = host.alloc(3 * PAGE)
    be = make_backend(address).attach(host)
    try:
        result = {"leading": be.batch_exists(keys), "ok": be.batch_get_into(keys, dst), "pages": page_bytes(host, dst)}
    finally:
        be.close()
    torch.save(result, out)


def test_second_process_reads_the_first_ones_pages(backend, master, tmp_path):
    host = host_pool("layer_first", seed=20)
    src = host.alloc(3 * PAGE)
    keys = keys_for(3, "two-processes")
    assert backend.attach(host).batch_set_from(keys, src) == [True] * 3  # in this process's segment
    p = mp.get_context("spawn").Process(
        target=_reader, args=(master.address, "layer_first", keys, str(tmp_path / "b.pt"))
    )
    p.start()
    p.join(timeout=120)
    assert p.exitcode == 0
    result = torch.load(tmp_path / "b.pt")
    assert result["leading"] == 3 and result["ok"] == [True] * 3
    assert result["pages"] == page_bytes(host, src)


# -- the master going away --------------------------------------------------------------------------------
def _all_misses(be, keys, src, dst) -> None:
    """Every kind of call returns (none hangs) a miss."""
    for fn, args, miss in [(be.batch_exists, (keys,), 0), (be.batch_get_into, (keys, dst), [False] * len(keys)),
                           (be.batch_set_from, (keys, src), [False] * len(keys)), (be.exists, (keys[0],), False),
                           (be.get, (keys[0],), None), (be.set, (keys[0], b"v"), False)]:  # fmt: skip
        assert returns(fn, *args) == miss, fn.__name__


def _wait_until_it_works(be, keys, src, dst, host, timeout: float = HANG_S) -> float:
    t0 = time.monotonic()
    while be.batch_set_from(keys, src) != [True] * len(keys):
        assert time.monotonic() - t0 < timeout, f"the backend did not recover: {be.stats()}"
        time.sleep(0.2)
    assert be.batch_get_into(keys, dst) == [True] * len(keys)
    assert page_bytes(host, dst) == page_bytes(host, src)
    return time.monotonic() - t0


def test_master_frozen_killed_and_restarted(master_binary, tmp_path, caplog):
    """Frozen (SIGSTOP) and killed masters make every call a miss, logged once per outage; against the
    frozen one the backend gives up on a call at timeout_s while the client is still in it (read from
    the counters: a timeout, and the call still running behind it); the same client works again once
    the master answers (thawed, or restarted on its ports: the client remounts its segment; what the
    old master knew is gone)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    m = Master(master_binary, tmp_path / "master.log").start()
    be = make_backend(m.address, metadata_server=m.metadata, timeout_s=TIMEOUT_S, retry_interval_s=0.2)
    try:
        host = host_pool("page_first", seed=30)
        src, dst = host.alloc(2 * PAGE), host.alloc(2 * PAGE)
        keys = keys_for(2, "fault-a")
        be.attach(host)
        assert be.batch_set_from(keys, src) == [True, True]

        def outages() -> list[str]:
            return [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]

        # Frozen: the client's RPCs would wait ~30 s; the backend gives up after timeout_s, so the call it
        # gave up on is still running in the client (abandoned) when the calls have all returned misses.
        m.signal(signal.SIGSTOP)
        for _ in range(3):
            _all_misses(be, keys, src, dst)
        st = be.stats()
        assert st["master_up"] == 0 and st["timeouts"] >= 1 and st["abandoned"] >= 1 and len(outages()) == 1, st
        m.signal(signal.SIGCONT)
        _wait_until_it_works(be, keys_for(2, "fault-thawed"), src, dst, host)  # late calls may remove `keys`
        assert be.stats()["master_up"] == 1

        # Killed: misses again, one more warning however many calls.
        m.stop()
        for _ in range(3):
            _all_misses(be, keys, src, dst)
        assert len(outages()) == 2 and be.stats()["outages"] == 2
        time.sleep(1.0)  # a while down: calls stay instant misses (none waits out its bound)
        timeouts = be.stats()["timeouts"]
        _all_misses(be, keys, src, dst)
        assert be.stats()["timeouts"] == timeouts

        # Restarted on the same ports: the same client works again (no new client needed).
        m.start()
        keys2 = keys_for(2, "fault-b")
        took = _wait_until_it_works(be, keys2, src, dst, host)
        assert be.batch_exists(keys) == 0  # the new master never heard of the old objects
        st = be.stats()
        assert st["master_up"] == 1 and st["outages"] == 2, st
        print(f"recovered {took:.1f} s after the restart; {st}")
    finally:
        try:
            returns(be.close)
        finally:
            m.stop()
    # Closing needed no bound: it neither timed out nor raised (either is logged).
    assert not [r.getMessage() for r in caplog.records if "closing the client" in r.getMessage()]


# -- through the cache ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,mla", [("page_first", False), ("layer_first", True)])
def test_two_caches_share_a_store(master, layout, mla):
    """Cache A computes a prompt and backs it up to the store; cache B (another client of the same
    master, a fresh tree) prefetches it, loads it to the device and reads A's KV byte for byte. A stays
    open meanwhile: Mooncake keeps objects in the segments of the clients that are up (A's among them)."""
    from hicache import DeviceKVPool as Dev
    from hicache import HiRadixCache
    from hicache import HostKVPool as Host
    from hicache.storage.tier import PrefetchPolicy

    from cachedata import HEAD_DIM, HEAD_NUM, NUM_LAYERS, check_kv, prefill

    tokens = [(11 * i + 5) % 997 for i in range(32)]

    def cache() -> HiRadixCache:
        dev = Dev(num_slots=64, num_layers=NUM_LAYERS, head_num=1 if mla else HEAD_NUM, head_dim=HEAD_DIM,
                  dtype=torch.float32, device="cpu", page_size=PAGE, mla=mla)  # fmt: skip
        host = Host(dev, layout=layout, ratio=3.0, safety_margin_gb=0.0)
        return HiRadixCache(dev, host, io_backend="direct", threaded=False, storage=make_backend(master.address),
                            model_id=f"shared-{layout}", load_back_threshold=1,
                            prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=PAGE))  # fmt: skip

    with cache() as a:
        prefill(a, tokens)
        a.flush()
        assert a.metrics.storage_pages_written == len(tokens) // PAGE
        with cache() as b:
            m = b.match_prefix(tokens)
            assert b.prefetch_from_storage("r", m.last_host_node, tokens)
            deadline = time.monotonic() + HANG_S  # a hang detector
            while not b.check_prefetch_progress("r"):
                assert time.monotonic() < deadline, f"the prefetch is still running after {HANG_S:g} s"
                time.sleep(0.001)
            assert b.metrics.storage_hit_tokens == len(tokens)
            m = b.match_prefix(tokens)
            assert b.load_back(m.last_host_node) is not None
            b.start_loading()
            b.flush()
            slots = b.match_prefix(tokens).device_indices
            check_kv(b, tokens, slots)  # A's bytes, never computed by B
            b.verify()
