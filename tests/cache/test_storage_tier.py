"""The storage tier through the cache: host copies backed up to a backend, prefetched back into a
fresh cache, byte-identical; policies, faults (corrupt, foreign, raising, hanging, full store), misuse,
two processes sharing a directory. Every test runs on both tree cores."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from storagedata import object_bytes, page_bytes

from hicache import DeviceKVPool, HiRadixCache, HostKVPool
from hicache.storage import FileBackend, StorageBackend, page_keys
from hicache.storage.tier import PrefetchPolicy

from cachedata import HEAD_DIM, HEAD_NUM, NUM_LAYERS, check_kv, prefill
from kvdata import random_bytes_

pytestmark = pytest.mark.usefixtures("each_tree_core")

TOKENS = [(7 * i + 3) % 1000 for i in range(48)]  # 12 pages of 4


def make(backend: StorageBackend, *, layout: str = "page_first", mla: bool = False, page_size: int = 4,
         policy: str = "wait_complete", model_id: str = "test-model", write_policy: str = "write_through",
         threshold: int = 8, threaded: bool = False, **policy_kw) -> HiRadixCache:  # fmt: skip
    dev = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS, head_num=1 if mla else HEAD_NUM, head_dim=HEAD_DIM,
                       dtype=torch.float32, device="cpu", page_size=page_size, mla=mla)  # fmt: skip
    host = HostKVPool(dev, layout=layout, ratio=3.0, safety_margin_gb=0.0)
    return HiRadixCache(dev, host, io_backend="direct", write_policy=write_policy, threaded=threaded, storage=backend,
                        load_back_threshold=1,
                        model_id=model_id, prefetch_policy=PrefetchPolicy(policy, threshold_tokens=threshold,
                                                                          **policy_kw))  # fmt: skip


def store(backend: StorageBackend, tokens: list[int] = TOKENS, **kw) -> dict:
    """A first instance computes ``tokens`` and backs them up (host, then storage); returns its metrics."""
    with make(backend, **kw) as a:
        prefill(a, tokens)
        a.flush()
        a.verify()
        m = a.metrics.as_dict()
    return m


def prefetch(cache: HiRadixCache, tokens: list[int], rid: str = "r", timeout: float = 10.0) -> int:
    """match -> prefetch -> poll until admitted; returns the tokens the prefetch brought into the tree
    (0 also when none was requested: below the threshold)."""
    before = cache.metrics.storage_hit_tokens
    m = cache.match_prefix(tokens)
    if not cache.prefetch_from_storage(rid, m.last_host_node, tokens):
        return 0
    t0 = time.perf_counter()
    while not cache.check_prefetch_progress(rid):
        assert time.perf_counter() - t0 < timeout, "prefetch never finished"
        time.sleep(0.001)
    assert rid not in cache.storage_ops.prefetches
    return cache.metrics.storage_hit_tokens - before


def load_and_check(cache: HiRadixCache, tokens: list[int]) -> int:
    """Load the host hit to the device and check every loaded byte; returns the tokens on the device."""
    m = cache.match_prefix(tokens)
    if m.host_hit_length:
        assert cache.load_back(m.last_host_node) is not None
        cache.start_loading()
        cache.flush()
    slots = cache.match_prefix(tokens).device_indices
    check_kv(cache, tokens[: len(slots)], slots)
    cache.verify()
    return len(slots)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first", "page_head"])
@pytest.mark.parametrize("mla", [False, True])
def test_round_trip_through_storage(tmp_path, layout, mla):
    if mla and layout == "page_head":
        pytest.skip("page_head is MHA only")
    m = store(FileBackend(tmp_path), layout=layout, mla=mla)
    assert m["storage_pages_written"] == len(TOKENS) // 4 and m["storage_backups_failed"] == 0
    with make(FileBackend(tmp_path), layout=layout, mla=mla) as b:  # a fresh instance: nothing cached
        assert prefetch(b, TOKENS) == len(TOKENS) and b.metrics.storage_pages_read == 12
        assert load_and_check(b, TOKENS) == len(TOKENS)  # byte-identical, not recomputed
        assert b.metrics.prefetch_latency_s and b.metrics.prefetches_cut == {}
        assert b.metrics.storage_bytes_read == 12 * b.host_pool.page_bytes and b.metrics.storage_read_gbps > 0


def test_pages_already_stored_are_not_written_again(tmp_path):
    store(FileBackend(tmp_path))
    m = store(FileBackend(tmp_path))
    assert m["storage_pages_written"] == 0 and m["storage_pages_skipped"] == 12


def test_prefetch_continues_a_host_hit_and_keeps_the_chain(tmp_path):
    store(FileBackend(tmp_path))
    with make(FileBackend(tmp_path)) as b:
        prefill(b, TOKENS[:16])  # b computes the first 4 pages itself
        assert prefetch(b, TOKENS) == 32
        assert load_and_check(b, TOKENS) == 48
        # The prefetched node's keys continue the chain: extending it stores under the same keys.
        longer = TOKENS + [5, 6, 7, 8]
        prefill(b, longer)
        b.flush()
        assert b.metrics.storage_pages_written == 1  # only the new page; the rest was already stored


def test_another_model_or_salt_never_reads_the_pages(tmp_path):
    store(FileBackend(tmp_path))
    with make(FileBackend(tmp_path), model_id="other-model") as b:
        assert prefetch(b, TOKENS) == 0 and b.metrics.prefetches == 0  # queried, nothing stored: no read
        b.verify()
    with make(FileBackend(tmp_path), mla=True) as b:  # other geometry: other namespace
        assert prefetch(b, TOKENS) == 0


def test_below_threshold_nothing_starts(tmp_path):
    store(FileBackend(tmp_path))
    with make(FileBackend(tmp_path), threshold=64) as b:
        m = b.match_prefix(TOKENS)
        assert not b.prefetch_from_storage("r", m.last_host_node, TOKENS)  # 48 tokens < 64: not requested
        assert b.metrics.prefetches == 0 and not b.storage_ops.prefetches
        b.verify()


def test_corrupt_page_ends_the_prefix_and_nothing_wrong_is_loaded(tmp_path):
    store(FileBackend(tmp_path))
    files = sorted(Path(tmp_path).rglob("*.kv"))
    assert len(files) == 12 * HEAD_NUM  # an object per page and head (storage_head_group=1)
    # The 6th page's last head's object, named by the key chain rooted in the cache's namespace: flip a
    # payload byte (the page's other heads are intact: a page is a hit only when all of them are).
    with make(FileBackend(tmp_path)) as b:
        keys = page_keys(TOKENS, 4, prev_digest=b.storage.root_digest)
        prefill(b, TOKENS[:4])
        assert b.storage_ops.keys_of(b.match_prefix(TOKENS[:4]).last_device_node) == keys[:1]
        objects = b.storage.objects.keys(keys)
    assert HEAD_NUM > 1 and len(objects) == 12 * HEAD_NUM
    victim = next(f for f in files if f.stem == objects[5 * HEAD_NUM + HEAD_NUM - 1])
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    with make(FileBackend(tmp_path)) as b:
        assert prefetch(b, TOKENS) == 20  # pages 0-4; the corrupt one and all after are misses
        assert b.metrics.prefetches_cut == {"wait_complete": 1}
        assert load_and_check(b, TOKENS) == 20
    assert not victim.exists()  # a corrupt object is removed


def test_truncated_page_is_a_miss(tmp_path):
    store(FileBackend(tmp_path))
    for f in Path(tmp_path).rglob("*.kv"):
        f.write_bytes(f.read_bytes()[:40])
    with make(FileBackend(tmp_path)) as b:
        assert prefetch(b, TOKENS) == 0
        assert load_and_check(b, TOKENS) == 0


def test_full_store_stores_nothing_and_says_so(tmp_path):
    m = store(FileBackend(tmp_path, capacity_bytes=0))
    assert m["storage_pages_written"] == 0 and m["storage_backups_failed"] == 0
    with make(FileBackend(tmp_path)) as b:
        assert prefetch(b, TOKENS) == 0


class Flaky(FileBackend):
    """A file backend whose calls raise for chosen methods."""

    def __init__(self, path, fail: set[str]) -> None:
        super().__init__(path)
        self.fail = fail

    def batch_exists(self, keys):
        if "exists" in self.fail:
            raise OSError("store down (exists)")
        return super().batch_exists(keys)

    def batch_get_into(self, keys, host_slots):
        if "get" in self.fail:
            raise OSError("store down (get)")
        return super().batch_get_into(keys, host_slots)

    def batch_set_from(self, keys, host_slots):
        if "set" in self.fail:
            raise OSError("store down (set)")
        return super().batch_set_from(keys, host_slots)


def test_a_raising_backend_is_a_miss_never_an_exception(tmp_path, caplog):
    m = store(Flaky(tmp_path, {"set"}))
    assert m["storage_backups_failed"] == 1 and m["storage_pages_written"] == 0
    assert "hicache storage backup failed" in caplog.text
    store(FileBackend(tmp_path))
    with make(Flaky(tmp_path, {"exists"})) as b:
        assert prefetch(b, TOKENS) == 0 and b.metrics.prefetches == 0
        b.verify()
    with make(Flaky(tmp_path, {"get"})) as b:
        assert prefetch(b, TOKENS) == 0 and b.metrics.prefetches == 1
        assert load_and_check(b, TOKENS) == 0


class Gated(FileBackend):
    """Reads wait for ``gate`` (a hung store until it is set); one page per call."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.gate = threading.Event()
        self.calls = 0

    def batch_get_into(self, keys, host_slots):
        self.calls += 1
        if self.calls > 2:  # the first two pages come at once, then the store hangs
            self.gate.wait(30)
        return super().batch_get_into(keys, host_slots)


def test_timeout_policy_admits_at_the_deadline_keeping_what_landed(tmp_path, monkeypatch):
    """The deadline is read from a clock the test moves (a busy machine cannot make "before the
    deadline" false)."""
    import types

    import hicache.cache.storage_ops as so

    clock = [1000.0]
    monkeypatch.setattr(so, "time", types.SimpleNamespace(perf_counter=lambda: clock[0], sleep=time.sleep))
    monkeypatch.setattr(so, "IO_GRACE_S", 0.05)
    store(FileBackend(tmp_path))
    backend = Gated(tmp_path)
    with make(backend, policy="timeout", timeout_base_s=0.3, timeout_per_1k_tokens_s=0.0, batch_pages=1,
              threaded=True) as b:  # fmt: skip
        m = b.match_prefix(TOKENS)
        assert b.prefetch_from_storage("r", m.last_host_node, TOKENS)
        while backend.calls < 3:  # the first checks agree the query's hit and start the read
            assert not b.check_prefetch_progress("r")
            time.sleep(0.001)
        assert not b.check_prefetch_progress("r")  # before the deadline, the store still hung
        b.verify()
        clock[0] += 0.35  # past the 0.3 s deadline
        assert b.check_prefetch_progress("r")
        assert b.metrics.storage_hit_tokens == 8 and b.metrics.prefetches_cut == {"timeout": 1}
        assert len(b.storage_ops.zombies) == 1  # the hung call still holds the rest of the slots
        b.verify()
        free_before = b.host_pool.available_size()
        backend.gate.set()
        deadline = time.perf_counter() + 10
        while not b.storage_ops.zombies[0].finished.is_set():
            assert time.perf_counter() < deadline
            time.sleep(0.001)
        b.storage_ops.reap()
        assert b.host_pool.available_size() == free_before + 40 and not b.storage_ops.zombies
        assert load_and_check(b, TOKENS) == 8


OTHER = [1000 + (11 * i + 5) % 1000 for i in range(48)]  # another prompt: no page in common with TOKENS
HANG_S = 60.0  # a hang detector, not a speed limit


def test_a_late_mooncake_read_never_lands_in_reused_host_slots(fake_mooncake):
    """A prefetch read that Mooncake gives up on at timeout_s is a miss, but the client may still write
    the pages into their host slots later: the cache keeps those slots out of the host pool until the
    call returns, so another node's host copy, taken meanwhile, is never overwritten."""
    # page_head: the backend reads straight into the host slots (zero copy; staged layouts read into a
    # staging area instead, test_a_busy_staging_area_is_never_reused).
    store(fake_mooncake.backend(), layout="page_head")  # a first instance backs TOKENS' 12 pages up to the store
    be = fake_mooncake.backend(timeout_s=0.05, retry_interval_s=3600)  # down after the timeout: no more calls
    with make(be, batch_pages=12, layout="page_head") as b:
        random_bytes_(b.host_pool.buffer, torch.Generator().manual_seed(50))  # poison every host slot
        reads: list[torch.Tensor] = []
        real = be.batch_get_into
        be.batch_get_into = lambda keys, slots: (reads.append(slots.clone()), real(keys, slots))[1]
        stall = fake_mooncake.stall("get")
        try:
            assert prefetch(b, TOKENS) == 0  # gave up at timeout_s: nothing inserted, the client goes on
            (late,) = reads
            assert len(late) == 48 and bool((late < b.host_pool.size).all())  # host slots: zero copy
            b.verify()
            prefill(b, OTHER)
            b.flush()  # OTHER's host copy takes host slots meanwhile
            other = b.match_prefix(OTHER).last_device_node.host_value
            assert len(other) == 48
            before = page_bytes(b.host_pool, other)
            free = b.host_pool.available_size()
            b.verify()
        finally:
            stall.release.set()
        assert stall.done.wait(HANG_S)  # the late read has written its pages
        assert page_bytes(b.host_pool, other) == before, "a late storage read overwrote another node's host copy"
        keys = b.storage.objects.keys(page_keys(TOKENS, 4, prev_digest=b.storage.root_digest))
        landed = object_bytes(b.host_pool, late)
        assert landed == [fake_mooncake.objects[k] for k in keys]  # it landed where held
        assert not torch.isin(other, late).any()
        assert not be.slots_busy(late, timeout=HANG_S)
        b.check_storage()  # the held slots go back to the pool once the call returned
        assert b.host_pool.available_size() == free + 48 and not b.storage_ops.held.held
        b.verify()
        assert b.evict(b.device_pool.size) == 48
        assert load_and_check(b, OTHER) == 48  # OTHER's KV back from its host copy, byte for byte


class BusyStaging(FileBackend):
    """A file backend that says a transfer it gave up on still holds the staging slots while ``busy``."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.busy = False
        self.asked: list[torch.Tensor] = []

    def slots_busy(self, host_slots, timeout=0.0):
        self.asked.append(host_slots.clone())
        return self.busy and bool((host_slots >= self.host_pool.host_pool.size).any())


def test_a_busy_staging_area_is_never_reused(tmp_path):
    """Staged objects (page_first, two heads a rank): a backend that still holds a staging area (a call it
    gave up on) gets no new batch through it: the backup fails and the prefetch misses, nothing lands in
    the host pages; once it lets go both work. Host slots are never held for it (it never touched them)."""
    backend = BusyStaging(tmp_path)
    with make(backend) as a:
        assert not a.storage.objects.zero_copy
        backend.busy = True
        prefill(a, TOKENS)
        a.flush()
        assert a.metrics.storage_backups_failed == 1 and a.metrics.storage_pages_written == 0
        assert not list(Path(tmp_path).rglob("*.kv")) and not a.storage_ops.held.held
        backend.busy = False
        a.evict(a.device_pool.size)
        a.evict_host(a.host_pool.size)
        prefill(a, TOKENS)
        a.flush()
        assert a.metrics.storage_pages_written == 12
    backend = BusyStaging(tmp_path)
    with make(backend) as b:
        backend.busy = True
        free = b.host_pool.available_size()
        assert prefetch(b, TOKENS) == 0 and b.metrics.storage_read_time_s >= 0
        assert b.host_pool.available_size() == free and not b.storage_ops.held.held  # host slots back at once
        assert any(bool((s >= b.host_pool.size).all()) for s in backend.asked)  # it asked about the staging slots
        backend.busy = False
        assert prefetch(b, TOKENS, rid="again") == 48
        assert load_and_check(b, TOKENS) == 48


def test_a_late_mooncake_write_stores_the_pages_it_was_given(fake_mooncake):
    """A backup put that Mooncake gives up on at timeout_s is a failed backup, but the client may still
    read the pages from their host slots later: the cache keeps those slots out of the host pool (the
    node's host copy is evicted meanwhile) until the call returns, so the put stores the node's pages,
    never another node's under its keys."""
    be = fake_mooncake.backend(timeout_s=0.05, retry_interval_s=3600)
    with make(be, layout="page_head") as a:  # zero copy: the put reads the host slots themselves
        random_bytes_(a.host_pool.buffer, torch.Generator().manual_seed(51))
        stall = fake_mooncake.stall("put")
        try:
            prefill(a, TOKENS)
            a.flush()  # the host copy, then its backup: the put outlives timeout_s (told False), the node unlocks
            assert a.metrics.storage_pages_written == 0 and not a.storage_ops.backups
            slots = a.match_prefix(TOKENS).last_device_node.host_value.clone()
            want = object_bytes(a.host_pool, slots)
            assert a.evict(a.device_pool.size) == 48 and a.evict_host(a.host_pool.size) == 48  # gone from both
            a.verify()
            prefill(a, OTHER)
            a.flush()  # another node's host copy meanwhile
            other = a.match_prefix(OTHER).last_device_node.host_value
            a.verify()
        finally:
            stall.release.set()
        assert stall.done.wait(HANG_S)  # the late put has read its pages
        keys = a.storage.objects.keys(page_keys(TOKENS, 4, prev_digest=a.storage.root_digest))
        assert [fake_mooncake.puts[k] for k in keys] == want, "a late put stored other bytes under the keys"
        assert not torch.isin(other, slots).any() and len(a.storage_ops.held.held) == 1  # held until the put returned
        assert not be.slots_busy(slots, timeout=HANG_S)
        free = a.host_pool.available_size()
        a.check_storage()
        assert a.host_pool.available_size() == free + 48 and not a.storage_ops.held.held
        a.verify()


def test_best_effort_admits_at_once(tmp_path):
    store(FileBackend(tmp_path))
    backend = Gated(tmp_path)
    backend.gate.set()
    with make(backend, policy="best_effort", batch_pages=1, threaded=True) as b:
        m = b.match_prefix(TOKENS)
        assert b.prefetch_from_storage("r", m.last_host_node, TOKENS)
        b.storage_ops.prefetches["r"].queried.wait(10)  # the request reaches the scheduler after the query
        assert b.check_prefetch_progress("r")  # the first call admits; what landed by then is kept
        landed = b.metrics.storage_hit_tokens
        assert landed % 4 == 0 and landed <= 48 and b.metrics.prefetches == 1
        assert load_and_check(b, TOKENS) == landed
        # Reached before its query was done: admitted at once with nothing, the node unlocked.
        backend2 = Gated(tmp_path)
        with make(backend2, policy="best_effort", threaded=True) as c:
            slow = threading.Event()
            real = c.storage._query_one
            c.storage._query_one = lambda p: (slow.wait(10), real(p))
            m = c.match_prefix(TOKENS)
            assert c.prefetch_from_storage("r", m.last_host_node, TOKENS)
            assert c.check_prefetch_progress("r") and c.metrics.prefetches == 0 and not c.storage_ops.prefetches
            slow.set()
            c.verify()


def test_host_eviction_waits_for_the_storage_backup_device_eviction_does_not(tmp_path):
    """A storage backup in flight host-pins its node: its host copy stays (the backend reads it), but
    its device copy may go at once (a slow store must not hold device memory)."""

    class SlowSet(FileBackend):
        def __init__(self, path) -> None:
            super().__init__(path)
            self.gate = threading.Event()

        def batch_set_from(self, keys, host_slots):
            self.gate.wait(30)
            return super().batch_set_from(keys, host_slots)

    backend = SlowSet(tmp_path)
    with make(backend, threaded=True) as a:
        prefill(a, TOKENS)
        a.controller.flush()
        a.check_writes()  # host copy landed: the storage backup is queued (blocked), the node host-pinned
        assert a.storage_ops.backups and a.protected_size() == 0
        assert a.evict(a.device_pool.size) == 48  # the device copy goes while the store is still writing
        assert a.evict_host(a.host_pool.size) == 0  # the host copy stays: the backend reads it
        a.verify()
        backend.gate.set()
        a.flush()
        assert not a.storage_ops.backups and not a.tree.host_pins
        assert a.evict_host(a.host_pool.size) == 48
        a.verify()
    assert len(list(Path(tmp_path).rglob("*.kv"))) == 12 * HEAD_NUM


def test_prefetch_discarded_when_the_tree_caught_up(tmp_path):
    store(FileBackend(tmp_path))
    with make(FileBackend(tmp_path)) as b:
        m = b.match_prefix(TOKENS)
        assert b.prefetch_from_storage("r", m.last_host_node, TOKENS)
        prefill(b, TOKENS)  # the request was computed meanwhile (the prefetch still only queried)
        while not b.check_prefetch_progress("r"):
            time.sleep(0.001)
        assert b.metrics.prefetches_discarded == 1 and b.metrics.storage_hit_tokens == 0
        b.verify()


def test_misuse_is_refused_and_changes_nothing(tmp_path):
    dev = DeviceKVPool(num_slots=32, num_layers=1, head_num=1, head_dim=2, dtype=torch.float32, device="cpu")
    host = HostKVPool(dev, ratio=2.0, safety_margin_gb=0.0)
    with HiRadixCache(dev, host, io_backend="direct", threaded=False) as plain:
        with pytest.raises(RuntimeError, match="prefetch_from_storage: this HiRadixCache has no storage tier"):
            plain.prefetch_from_storage("r", plain.root, [1, 2, 3])
    with pytest.raises(ValueError, match="model_id: the storage tier needs"):
        HiRadixCache(dev, host, io_backend="direct", threaded=False, storage=FileBackend(tmp_path))
    with pytest.raises(ValueError, match="prefetch_policy: expected one of"):
        make(FileBackend(tmp_path), policy="eager")
    with pytest.raises(TypeError, match="storage: expected a StorageBackend"):
        HiRadixCache(dev, host, io_backend="direct", threaded=False, storage=object(), model_id="m")
    store(FileBackend(tmp_path))
    with make(FileBackend(tmp_path)) as b:
        with pytest.raises(ValueError, match="request_id: no prefetch in flight for 'nope'"):
            b.check_prefetch_progress("nope")
        m = b.match_prefix(TOKENS)
        assert b.prefetch_from_storage("r", m.last_host_node, TOKENS)
        with pytest.raises(ValueError, match="request_id: 'r' already has a prefetch in flight"):
            b.prefetch_from_storage("r", m.last_host_node, TOKENS)
        b.verify()
    # Closed with the prefetch in flight: it is stopped, nothing inserted, every slot back.
    assert b.host_pool.available_size() == b.host_pool.size
    with pytest.raises(RuntimeError, match="closed"):
        b.prefetch_from_storage("s", b.root, TOKENS)


def test_backend_by_name_with_a_config(tmp_path):
    dev = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS, head_num=HEAD_NUM, head_dim=HEAD_DIM,
                       dtype=torch.float32, device="cpu", page_size=4)  # fmt: skip
    host = HostKVPool(dev, ratio=3.0, safety_margin_gb=0.0)
    with HiRadixCache(dev, host, io_backend="direct", threaded=False, storage="file",
                      storage_config={"path": str(tmp_path)}, model_id="test-model") as a:  # fmt: skip
        prefill(a, TOKENS)
        a.flush()
        assert a.metrics.storage_pages_written == 12


WRITER = """
import sys, torch
sys.path.insert(0, {tests!r})
from cachedata import HEAD_DIM, HEAD_NUM, NUM_LAYERS, prefill
from hicache import DeviceKVPool, HiRadixCache, HostKVPool
dev = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS, head_num=HEAD_NUM, head_dim=HEAD_DIM,
                   dtype=torch.float32, device="cpu", page_size=4)
host = HostKVPool(dev, layout="page_first", ratio=3.0, safety_margin_gb=0.0)
with HiRadixCache(dev, host, io_backend="direct", threaded=False, storage="file",
                  storage_config={{"path": {path!r}}}, model_id="test-model") as c:
    prefill(c, {tokens!r})
    c.flush()
    c.verify()
    print("stored", c.metrics.storage_pages_written)
"""


def test_two_processes_share_a_directory(tmp_path, each_tree_core):
    script = WRITER.format(tests=str(Path(__file__).parents[1]), path=str(tmp_path), tokens=TOKENS)
    env = {**os.environ, "HICACHE_TREE_CORE": each_tree_core}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "stored 12" in out.stdout
    with make(FileBackend(tmp_path)) as b:  # this process never computed TOKENS
        assert prefetch(b, TOKENS)
        assert load_and_check(b, TOKENS) == 48


def tp_cache(backend: StorageBackend, **kw) -> HiRadixCache:
    """A cache over ``backend`` whose TP group is the initialized WORLD (of one, in these tests)."""
    dev = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS, head_num=HEAD_NUM, head_dim=HEAD_DIM,
                       dtype=torch.float32, device="cpu", page_size=4)  # fmt: skip
    host = HostKVPool(dev, layout="page_first", ratio=3.0, safety_margin_gb=0.0)
    return HiRadixCache(dev, host, io_backend="direct", storage=backend, model_id="test-model",
                        tp_group=torch.distributed.group.WORLD, **kw)  # fmt: skip


def test_a_step_agrees_its_copies_and_storage_backups_in_one_collective(tmp_path, monkeypatch):
    """check_acks takes the landed backups, load-backs AND the storage tier's landed backups with ONE
    all-reduce (a TP group of one here; the tier used to agree its own count in a second)."""
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        cache = tp_cache(FileBackend(str(tmp_path / "s")), threaded=False)
        calls = []
        real = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1])
        prefill(cache, TOKENS)
        cache.controller.flush()
        assert cache.check_acks() >= 1  # the host backups land; their storage backups start
        cache.storage.wait_backups()
        cache.check_acks()  # the storage backups landed: taken here at the latest
        assert len(calls) == 2  # one per step: copies and storage backups in one vector
        monkeypatch.undo()
        assert cache.storage.landed_backups() == 0 and not cache.storage_ops.backups
        assert cache.metrics.storage_pages_written == len(TOKENS) // 4
        cache.verify()
        cache.close()
        del cache
    finally:
        gc.collect()  # what still holds the group goes before it (see tests/tpharness.py)
        dist.destroy_process_group()


CONVERSATIONS = [[(11 * i + 97 * c + 5) % 1000 for i in range(12)] for c in range(4)]  # 3 pages each


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_check_prefetches_admits_like_one_call_per_request(tmp_path, policy):
    """Several prefetches checked in one call end as each checked alone would: the same requests admitted
    (in the given order) and the same pages in the tree, read byte for byte."""
    with make(FileBackend(tmp_path), threshold=8) as a:
        for toks in CONVERSATIONS:
            prefill(a, toks)
        a.flush()
    outcomes = []
    for batched in (True, False):
        with make(FileBackend(tmp_path), policy=policy, threshold=8) as b:
            rids = []
            for c, toks in enumerate(CONVERSATIONS):
                assert b.prefetch_from_storage(f"r{c}", b.match_prefix(toks).last_host_node, toks)
                rids.append(f"r{c}")
            for p in b.storage_ops.prefetches.values():
                assert p.queried.wait(10)  # the queries are done: what a check does next is deterministic
            admitted: list[str] = []
            t0 = time.perf_counter()
            while len(admitted) < len(rids):
                assert time.perf_counter() - t0 < 10, "prefetches never finished"
                left = [r for r in rids if r not in admitted]
                got = b.check_prefetches(left) if batched else [r for r in left if b.check_prefetch_progress(r)]
                assert got == [r for r in left if r in got]  # the given order
                admitted += got
                time.sleep(0.001)
            hits = [b.match_prefix(toks).host_hit_length for toks in CONVERSATIONS]
            if policy != "best_effort":
                assert hits == [len(t) for t in CONVERSATIONS]  # every page read
                for toks in CONVERSATIONS:
                    assert load_and_check(b, toks) == len(toks)
            b.verify()
            outcomes.append((sorted(admitted), hits if policy != "best_effort" else None))
    assert outcomes[0] == outcomes[1]


def test_check_prefetches_refuses_unknown_and_repeated_ids(tmp_path):
    store(FileBackend(tmp_path))
    with make(FileBackend(tmp_path)) as b:
        assert b.prefetch_from_storage("r", b.match_prefix(TOKENS).last_host_node, TOKENS)
        with pytest.raises(ValueError, match="request_id: no prefetch in flight for 'nope'"):
            b.check_prefetches(["r", "nope"])
        with pytest.raises(ValueError, match="request_ids: an id appears more than once"):
            b.check_prefetches(["r", "r"])
        assert "r" in b.storage_ops.prefetches and b.storage_ops.prefetches["r"].state == "query"  # nothing changed
        assert b.check_prefetches([]) == []
        t0 = time.perf_counter()
        while not b.check_prefetches(["r"]):
            assert time.perf_counter() - t0 < 10
        b.verify()


def test_check_prefetches_agrees_all_requests_in_one_collective(tmp_path, monkeypatch):
    """With a TP group (of one here), a step's check of many prefetches whose reads are still going
    costs one all-reduce (one per request per check before), and the step that ends them at most four."""
    store_dir = tmp_path / "s"
    with make(FileBackend(store_dir), threshold=8) as a:
        for toks in CONVERSATIONS:
            prefill(a, toks)
        a.flush()
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:  # reads on the I/O thread (threaded by default)
        b = tp_cache(FileBackend(store_dir), prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=8))
        gate = threading.Event()
        real_read = b.storage.backend.batch_get_into

        def held(*args, **kw):  # reads wait for the gate: the prefetches stay in flight
            gate.wait(10)
            return real_read(*args, **kw)

        monkeypatch.setattr(b.storage.backend, "batch_get_into", held)
        rids = [f"r{c}" for c in range(len(CONVERSATIONS))]
        for rid, toks in zip(rids, CONVERSATIONS, strict=True):
            assert b.prefetch_from_storage(rid, b.match_prefix(toks).last_host_node, toks)
        for p in b.storage_ops.prefetches.values():
            assert p.queried.wait(10)
        calls = []
        real = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1])
        assert b.check_prefetches(rids) == []  # every read starts (two collectives) and none is done (a third)
        assert len(calls) == 3 and all(p.state == "read" for p in b.storage_ops.prefetches.values())
        calls.clear()
        assert b.check_prefetches(rids) == []  # reads in flight: one collective for all four
        assert calls == [len(rids)]
        gate.set()
        for p in b.storage_ops.prefetches.values():
            assert p.finished.wait(10)
        calls.clear()
        assert b.check_prefetches(rids) == rids  # done everywhere: [done], then [landed]
        assert len(calls) == 2
        monkeypatch.undo()
        assert b.metrics.storage_hit_tokens == sum(map(len, CONVERSATIONS))
        b.verify()
        b.close()
        del b
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.parametrize("group", [3, 0, True])
def test_a_head_group_that_does_not_divide_the_heads_is_refused_first(tmp_path, group):
    """``storage_head_group`` must divide the rank's K/V heads: a clear error at construction, before the
    backend is built (its directory is never created)."""
    dev = DeviceKVPool(num_slots=16, num_layers=NUM_LAYERS, head_num=HEAD_NUM, head_dim=HEAD_DIM, dtype=torch.float32,
                       device="cpu", page_size=4)  # fmt: skip
    host = HostKVPool(dev, layout="page_head", ratio=2.0, safety_margin_gb=0.0)
    path = tmp_path / "store"
    with pytest.raises(ValueError, match="head_group"):
        HiRadixCache(dev, host, io_backend="direct", threaded=False, storage="file", storage_config={"path": str(path)},
                     model_id="m", storage_head_group=group)  # fmt: skip
    assert not path.exists()
    with HiRadixCache(dev, host, io_backend="direct", threaded=False, storage="file",
                      storage_config={"path": str(path)}, model_id="m", storage_head_group=HEAD_NUM) as ok:  # fmt: skip
        assert ok.storage.objects.objects_per_page == 1 and ok.storage.objects.page_bytes == host.page_bytes
