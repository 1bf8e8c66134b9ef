"""hicache.integrations.vllm driven by vLLM 0.34.0's own code: ``TieringOffloadingSpec`` builds its CPU
primary tier (a real shared mmap region) and, through ``SecondaryTierFactory``, this package's tier from
the connector's extra config; ``TieringOffloadingManager`` cascades stored chunks to the tier and
promotes them back. Bytes are compared row by row against what was written, in a second manager (a
fresh region, poisoned first) over the same store.

Needs vLLM's Python code (``bash scripts/fetch_vllm.sh DIR`` and ``HICACHE_VLLM_PATH``); skips without it
(fails under ``HICACHE_REQUIRE_CLIENTS=1``).
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
import torch
from conftest import need, need_here

need(["vllm.v1.kv_offload.tiering.spec", "vllm.v1.kv_offload.tiering.factory"], first=(),
     hint="scripts/fetch_vllm.sh")  # fmt: skip

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadingKVEventsConfig,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from hicache.integrations.vllm import HiCacheSecondaryTier, HiCacheTieringSpec, VLLMChunkObjects  # noqa: E402
from hicache.storage import StorageBackend  # noqa: E402
from hicache.storage.file import FileBackend  # noqa: E402

BLOCK_BYTES = 4096  # one worker's KV bytes per block (vLLM aligns a chunk row to 4 KiB)
CHUNKS = 12
TIER = {"type": "HiCacheSecondaryTier", "module_path": "hicache.integrations.vllm"}
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_engines = itertools.count()


def offloading_config(tier: dict, *, model: str = "m", dtype: str = "bfloat16", tp: int = 1, agnostic: bool = False,
                      events: bool = False, chunks: int = CHUNKS) -> OffloadingConfig:  # fmt: skip
    """vLLM's normalized offloading config for a TieringOffloadingSpec with ``tier`` as its one
    secondary tier; each call is a new engine (its own /dev/shm region)."""
    parallel = OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                        is_parallelism_agnostic=agnostic)  # fmt: skip
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0", "layers.1"), group_id=0),),
        worker_kv_bytes_per_block=BLOCK_BYTES // tp, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": BLOCK_BYTES * chunks, "secondary_tiers": [{**TIER, **tier}]},
        engine_id=f"hicache-test-{time.monotonic_ns()}-{next(_engines)}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1), parallel=parallel,
    )  # fmt: skip


def with_extra(config: OffloadingConfig, extra: dict) -> OffloadingConfig:
    """``config`` with another ``extra_config`` (the connector's JSON)."""
    return OffloadingConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__}, "extra_config": extra})


def file_tier(tmp_path, **kw) -> dict:
    return {"hicache_backend": "file", "hicache_backend_config": {"path": str(tmp_path / "kv")}, **kw}


def manager(tier: dict, **kw) -> TieringOffloadingManager:
    mgr = TieringOffloadingSpec(offloading_config(tier, **kw)).get_manager()
    assert isinstance(mgr.secondary_tiers[0], HiCacheSecondaryTier)
    return mgr


def rows(mgr: TieringOffloadingManager) -> np.ndarray:
    return np.asarray(mgr.primary_tier.get_kv_memoryview()).view(np.uint8)


def keys_of(ns: range, group: int = 0) -> list:
    return [make_offload_key(n.to_bytes(8, "big"), group) for n in ns]


def store(mgr: TieringOffloadingManager, keys: list, seed: int, req: str = "w") -> dict:
    """vLLM's store path: prepare_store, the worker's copy into the rows (random bytes here),
    complete_store (the cascade to the tier), steps until the tier is done. Returns key -> row bytes."""
    ctx = ReqContext(req)
    mgr.on_new_request(ctx)
    out = mgr.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == keys
    region = rows(mgr)
    rng = np.random.default_rng(seed)
    expect = {}
    for key, chunk in zip(keys, out.store_spec.chunk_ids, strict=True):
        region[chunk] = rng.integers(0, 256, region.shape[1], dtype=np.uint8)
        expect[key] = region[chunk].copy()
    mgr.complete_store(keys, ctx)
    mgr.on_request_finished(ctx)
    settle(mgr)
    return expect


def stored_by_a_first_manager(tier: dict, keys: list, seed: int, **kw) -> dict:
    """:func:`store` in a manager of its own, shut down afterwards (its store's objects stay)."""
    a = manager(tier, **kw)
    try:
        return store(a, keys, seed=seed)
    finally:
        a.shutdown()


def settle(mgr: TieringOffloadingManager) -> None:
    for tier in mgr.secondary_tiers:
        tier.drain_jobs()
    mgr.on_schedule_end(END)


HANG_S = 60.0  # lookups that have not settled by then never will (a hang guard, not a speed bound)


def steps(mgr: TieringOffloadingManager):
    """Scheduler steps until HANG_S has passed: yields, then lets the tier finish its jobs and ends the
    step (promotions submitted, lookups flushed to the probe thread)."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        yield
        settle(mgr)
        time.sleep(0.005)


def load(mgr: TieringOffloadingManager, keys: list, req: str = "r") -> dict | list:
    """vLLM's load path: lookups step by step until every key is a primary HIT (promotions from the
    tier in between), then prepare_load: key -> the row's bytes. Returns the last lookups on a miss."""
    ctx = ReqContext(req)
    mgr.on_new_request(ctx)
    region = rows(mgr)
    region[:] = np.random.default_rng(99).integers(0, 256, region.shape, dtype=np.uint8)  # poison
    for _ in steps(mgr):
        res = [mgr.lookup(k, ctx) for k in keys]
        if all(r is LookupResult.HIT for r in res):
            break
        if any(r is LookupResult.MISS for r in res):
            mgr.on_request_finished(ctx)
            return res
    else:
        pytest.fail(f"lookups never settled: {res}")
    spec = mgr.prepare_load(keys, ctx)
    got = {k: region[c].copy() for k, c in zip(keys, spec.chunk_ids, strict=True)}
    mgr.complete_load(keys, ctx)
    mgr.on_request_finished(ctx)
    return got


def same(got: dict, expect: dict) -> bool:
    return got.keys() == expect.keys() and all(np.array_equal(got[k], expect[k]) for k in expect)


# -- loading by vLLM's factory -------------------------------------------------------------------------
def test_vllms_factory_builds_the_tier_from_its_config(tmp_path):
    assert SecondaryTierFactory.get_tier_class(dict(TIER)) is HiCacheSecondaryTier
    region = np.zeros((4, BLOCK_BYTES), dtype=np.int8)
    spec = TieringOffloadingSpec(offloading_config(file_tier(tmp_path)))
    tier = SecondaryTierFactory.create_secondary_tier(
        {**TIER, **file_tier(tmp_path, io_threads=3, locality="LOCAL", hicache_namespace="tenant-a"),
         "backpressure": {"backpressure_cls": "EMABackpressureDetector"}},
        memoryview(region), spec,
    )  # fmt: skip
    try:
        assert isinstance(tier.backend, FileBackend) and tier.tier_type == "HiCacheSecondaryTier"
        assert tier.block_size_bytes == BLOCK_BYTES and tier.objects.page_bytes == BLOCK_BYTES
        assert tier.locality.name == "LOCAL" and tier.bp_detector is not None and tier._pool._max_workers == 3
        assert tier.config_info() == {"hicache_backend": "file"}
        assert TieringOffloadingSpec.config_info_keys(spec.extra_config).count("hicache_backend") == 1
    finally:
        tier.shutdown()


def test_the_readme_config_loads_through_vllms_spec_factory(tmp_path):
    """The README's --kv-transfer-config, as vLLM's OffloadingSpecFactory reads it (with a small region
    and a temporary path)."""
    import json
    import re
    from pathlib import Path

    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Use with vLLM", 1)[1]
    (text,) = re.findall(r"--kv-transfer-config '(.*?)'", section, flags=re.S)
    transfer = json.loads(text)
    assert transfer["kv_connector"] == "OffloadingConnector"
    extra = transfer["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = BLOCK_BYTES * 4
    extra["secondary_tiers"][0]["hicache_backend_config"]["path"] = str(tmp_path)
    spec = OffloadingSpecFactory.create_spec(with_extra(offloading_config({}), extra))
    mgr = spec.get_manager()
    try:
        assert isinstance(spec, TieringOffloadingSpec)
        (tier,) = mgr.secondary_tiers
        assert isinstance(tier, HiCacheSecondaryTier) and isinstance(tier.backend, FileBackend)
        assert tier.backend.stats()["capacity_bytes"] == 200000000000
    finally:
        mgr.shutdown()


# -- round trips through vLLM's managers ----------------------------------------------------------------
def test_a_second_manager_reads_what_the_first_stored_byte_for_byte(tmp_path):
    keys = keys_of(range(7))
    a = manager(file_tier(tmp_path))
    try:
        expect = store(a, keys, seed=1)
        assert a.secondary_tiers[0].stats()["stored"] == 7
    finally:
        a.shutdown()
    b = manager(file_tier(tmp_path))
    try:
        got = load(b, keys)
        assert same(got, expect)
        assert b.secondary_tiers[0].stats()["loaded"] == 7
    finally:
        b.shutdown()


def test_round_trip_over_nixl(tmp_path):
    from hicache.storage.nixl import install_hint, load_nixl

    try:
        load_nixl()
    except Exception:  # noqa: BLE001
        need_here(f"NIXL is not installed ({install_hint()})")
    tier = {"hicache_backend": "nixl", "hicache_backend_config": {"path": str(tmp_path / "kv")}}
    keys = keys_of(range(5))
    expect = stored_by_a_first_manager(tier, keys, seed=2)
    b = manager(tier)
    try:
        assert same(load(b, keys), expect)
    finally:
        b.shutdown()


def test_round_trip_over_mooncake(request):
    from mooncakedata import client_missing, master_binary_path

    need_here(client_missing() or (None if master_binary_path() else "no mooncake_master executable"))
    master = request.getfixturevalue("master")
    tier = {"hicache_backend": "mooncake",
            "hicache_backend_config": {"master_server_address": master.address, "local_hostname": "127.0.0.1",
                                       "global_segment_size": 16 << 20, "local_buffer_size": 4 << 20}}  # fmt: skip
    keys = keys_of(range(5))
    a = manager(tier)
    b = manager(tier)
    try:
        expect = store(a, keys, seed=3)  # a keeps its segment mounted: the objects live in it
        assert same(load(b, keys), expect)
    finally:
        b.shutdown()
        a.shutdown()


def test_chunks_already_stored_are_not_written_again(tmp_path):
    keys = keys_of(range(4))
    a = manager(file_tier(tmp_path))
    try:
        store(a, keys[:2], seed=4, req="first")
        a.reset_cache()  # the primary tier forgets them; the store keeps them
        store(a, keys, seed=5, req="second")
        st = a.secondary_tiers[0].stats()
        assert st["skipped_present"] == 2 and st["stored"] == 4 and st["sets"] == 4
    finally:
        a.shutdown()


# -- namespaces -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["model", "dtype", "tp", "salt", "group"])
def test_namespace_keeps_deployments_apart(tmp_path, what):
    keys = keys_of(range(3))
    stored_by_a_first_manager(file_tier(tmp_path), keys, seed=6)
    kw = {"model": {"model": "other"}, "dtype": {"dtype": "float8_e4m3fn"}, "tp": {"tp": 2}}.get(what, {})
    tier = file_tier(tmp_path, **({"hicache_namespace": "tenant-b"} if what == "salt" else {}))
    probe = keys_of(range(3), group=1) if what == "group" else keys
    b = manager(tier, **kw)
    try:
        assert load(b, probe) == [LookupResult.MISS] * 3
        assert b.secondary_tiers[0].stats()["loaded"] == 0
    finally:
        b.shutdown()


def test_parallelism_agnostic_rows_are_shared_across_tp_sizes(tmp_path):
    keys = keys_of(range(3))
    expect = stored_by_a_first_manager(file_tier(tmp_path), keys, seed=7, tp=2, agnostic=True)
    b = manager(file_tier(tmp_path), tp=4, agnostic=True)
    try:
        assert same(load(b, keys), expect)
    finally:
        b.shutdown()


# -- faults are failed jobs, never exceptions or wrong bytes ----------------------------------------------
class Faulty(StorageBackend):
    """A file backend whose reads of chosen keys miss, raise or tear; writes may raise."""

    def __init__(self, inner: FileBackend, bad_reads: set[str] = frozenset(), mode: str = "miss",
                 raise_sets: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.inner, self.bad, self.mode, self.raise_sets = inner, set(bad_reads), mode, raise_sets

    def exists(self, key):
        return self.inner.exists(key)

    def get(self, key):
        if key in self.bad:
            if self.mode == "raise":
                raise OSError("injected read fault")
            if self.mode == "torn":
                return self.inner.get(key)[:-1]
            return None
        return self.inner.get(key)

    def set(self, key, value):
        if self.raise_sets:
            raise OSError("injected write fault")
        return self.inner.set(key, value)


def direct_tier(backend: StorageBackend, chunks: int = 8, **kw) -> tuple[HiCacheSecondaryTier, np.ndarray]:
    region = np.random.default_rng(11).integers(0, 256, (chunks, BLOCK_BYTES), dtype=np.uint8)
    spec = TieringOffloadingSpec(offloading_config({}))
    return HiCacheSecondaryTier(spec, memoryview(region), "hicache", backend=backend, **kw), region


def job(job_id: int, keys: list, chunk_ids: list[int], promotion: bool = False) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunk_ids, dtype=np.int32),
                       is_promotion=promotion, req_context=ReqContext("t"))  # fmt: skip


def finish(tier: HiCacheSecondaryTier) -> list[JobResult]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


@pytest.mark.parametrize("mode", ["miss", "raise", "torn"])
def test_a_failed_read_fails_the_promotion_and_names_the_keys_that_loaded(tmp_path, mode):
    inner = FileBackend(str(tmp_path / "kv"))
    backend = Faulty(inner, mode=mode)
    tier, region = direct_tier(backend)
    keys = keys_of(range(3))
    try:
        tier.submit_store(job(1, keys, [0, 1, 2]))
        assert [r.success for r in finish(tier)] == [True]
        expect = region[:3].copy()
        backend.bad = {tier.object_key(keys[1])}
        region[4:7] = 0xAB  # poison
        tier.submit_load(job(2, keys, [4, 5, 6], promotion=True))
        (res,) = finish(tier)
        assert res.job_id == 2 and not res.success
        # A read that raises fails its whole batch (the backend's batch call raised); otherwise the
        # other keys loaded. Every key said to have loaded holds its bytes.
        loaded = [] if mode == "raise" else [keys[0], keys[2]]
        assert list(res.successful_keys) == loaded
        for k in loaded:
            i = keys.index(k)
            assert np.array_equal(region[4 + i], expect[i])
        assert tier.stats()["failed_loads"] == 1
    finally:
        tier.shutdown()


def test_a_failed_promotion_turns_the_tiers_lookup_into_a_miss(tmp_path):
    """vLLM's livelock guard (mark_miss): after a failed load the manager's lookup misses, so the request
    recomputes the chunk instead of promoting it again and again."""
    keys = keys_of(range(2))
    stored_by_a_first_manager(file_tier(tmp_path), keys, seed=8)
    b = manager(file_tier(tmp_path))
    tier = b.secondary_tiers[0]
    tier.backend = Faulty(tier.backend, bad_reads={tier.object_key(keys[1])}).attach(tier.objects)
    try:
        ctx = ReqContext("r")
        b.on_new_request(ctx)
        seen = []
        for _ in steps(b):
            res = [b.lookup(k, ctx) for k in keys]
            seen.append(res)
            if res[1] is LookupResult.MISS:
                break
        assert res == [LookupResult.HIT, LookupResult.MISS], seen[-5:]
        b.on_request_finished(ctx)
    finally:
        b.shutdown()


def test_a_write_fault_fails_the_store_job_without_raising(tmp_path):
    tier, _ = direct_tier(Faulty(FileBackend(str(tmp_path / "kv")), raise_sets=True))
    try:
        tier.submit_store(job(1, keys_of(range(2)), [0, 1]))
        (res,) = finish(tier)
        assert not res.success and tier.stats()["failed_stores"] == 1 and tier.stats()["faults"] >= 1
    finally:
        tier.shutdown()


def test_a_job_whose_keys_and_chunks_differ_fails(tmp_path):
    tier, _ = direct_tier(FileBackend(str(tmp_path / "kv")))
    try:
        tier.submit_store(job(1, keys_of(range(2)), [0]))
        assert [(r.job_id, r.success) for r in finish(tier)] == [(1, False)]
        assert tier.backend.stats()["sets"] == 0
    finally:
        tier.shutdown()


# -- threads: vLLM's scheduler thread never waits on a copy -------------------------------------------------
class Gated(FileBackend):
    """A file backend whose batch calls wait for ``gate``, then report their slots busy until ``free``."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.gate, self.free, self.entered = threading.Event(), threading.Event(), threading.Event()

    def batch_set_from(self, keys, host_slots):
        self.entered.set()
        assert self.gate.wait(30)
        return super().batch_set_from(keys, host_slots)

    def slots_busy(self, host_slots, timeout=0.0):
        return not self.free.wait(timeout)


def test_submit_returns_at_once_and_the_result_waits_for_the_backend_to_let_go(tmp_path):
    backend = Gated(str(tmp_path / "kv"))
    tier, _ = direct_tier(backend)
    try:
        tier.submit_store(job(1, keys_of(range(2)), [0, 1]))  # returns while the copy is held
        assert backend.entered.wait(30) and tier.has_pending_work() and list(tier.get_finished_jobs()) == []
        backend.gate.set()  # the copy ends, but the backend still holds the rows
        time.sleep(0.05)
        assert list(tier.get_finished_jobs()) == [] and tier.has_pending_work()
        backend.free.set()
        assert [r.success for r in finish(tier)] == [True] and not tier.has_pending_work()
    finally:
        backend.gate.set()
        backend.free.set()
        tier.shutdown()


# -- events, shutdown, bad configuration --------------------------------------------------------------------
def test_kv_events_for_stored_chunks(tmp_path):
    region = np.zeros((4, BLOCK_BYTES), dtype=np.uint8)
    spec = TieringOffloadingSpec(offloading_config({}, events=True))
    spec.kv_events_config = OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False)
    tier = HiCacheSecondaryTier(spec, memoryview(region), "hicache", hicache_backend_config={"path": str(tmp_path)},
                                enable_kv_events=True, locality="REMOTE")  # fmt: skip
    try:
        keys = keys_of(range(2))
        tier.submit_store(job(1, keys, [0, 1]))
        finish(tier)
        (event,) = list(tier.take_events())
        assert event.keys == keys and not event.removed and event.medium is tier.medium
        assert event.locality.name == "REMOTE" and list(tier.take_events()) == []
    finally:
        tier.shutdown()


def test_shutdown_lets_vllm_unmap_its_region_and_later_jobs_fail(tmp_path):
    mgr = manager(file_tier(tmp_path))
    region = mgr.primary_tier._mmap_region
    tier = mgr.secondary_tiers[0]
    store(mgr, keys_of(range(2)), seed=9)
    mgr.shutdown()
    assert region.mmap_obj is None or region.mmap_obj.closed  # no export of ours kept it mapped
    tier.shutdown()  # idempotent
    tier.submit_load(job(5, keys_of(range(1)), [0], promotion=True))
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs() if r.job_id == 5] == [(5, False)]
    assert tier.lookup(keys_of(range(1))[0], ReqContext("late")) is LookupResult.MISS  # not RETRY forever


def test_a_spec_the_namespace_cannot_read_fails_before_a_backend_is_built(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr("hicache.integrations.vllm.create_backend", lambda *a: built.append(a))
    spec = TieringOffloadingSpec(offloading_config({}))
    spec.config = None  # vLLM's own tests pass a MagicMock spec; this tier needs the real config
    with pytest.raises(AttributeError):
        HiCacheSecondaryTier(spec, memoryview(np.zeros((2, BLOCK_BYTES), dtype=np.uint8)), "hicache",
                             hicache_backend_config={"path": str(tmp_path)})  # fmt: skip
    assert built == []


@pytest.mark.parametrize(
    ("kw", "exc", "name"),
    [
        ({"io_threads": 0}, ValueError, "io_threads"),
        ({"hicache_backend_config": ["path"]}, TypeError, "hicache_backend_config"),
        ({"hicache_namespace": 3}, TypeError, "hicache_namespace"),
        ({"hicache_backend": "nope"}, ValueError, "storage backend"),
        ({"hicache_backend": 7}, TypeError, "hicache_backend"),
        ({"backend": object()}, TypeError, "backend"),
        ({"locality": "nearby"}, ValueError, "Locality"),
    ],
)
def test_bad_configuration_names_the_setting(tmp_path, kw, exc, name):
    region = np.zeros((2, BLOCK_BYTES), dtype=np.uint8)
    spec = TieringOffloadingSpec(offloading_config({}))
    kw = {"hicache_backend_config": {"path": str(tmp_path)}, **kw}
    with pytest.raises(exc, match=name):
        HiCacheSecondaryTier(spec, memoryview(region), "hicache", **kw)


@pytest.mark.parametrize(
    "view",
    [memoryview(bytearray(64)), memoryview(np.zeros((2, 8), dtype=np.float32)),
     memoryview(np.zeros((4, 8), dtype=np.uint8)[:, :4]), b"rows"],
)  # fmt: skip
def test_a_view_that_is_not_byte_rows_is_refused(view):
    with pytest.raises((TypeError, ValueError), match="primary_kv_view"):
        VLLMChunkObjects(view)


def test_chunk_ids_outside_the_region_are_refused():
    objects = VLLMChunkObjects(memoryview(np.zeros((3, 16), dtype=np.uint8)))
    assert objects.page_ranges(torch.tensor([2, 0])) == [[(objects.buffer.data_ptr() + 32, 16)],
                                                         [(objects.buffer.data_ptr(), 16)]]  # fmt: skip
    with pytest.raises(ValueError, match="chunk_ids"):
        objects.page_ranges([3])


# -- HiCacheTieringSpec: vLLM's worker copies on this package's pointer-list copy -----------------------
def test_vllms_factory_loads_the_spec_and_its_worker_copies_with_copy_ranges(tmp_path, monkeypatch):
    """vLLM's OffloadingSpecFactory builds HiCacheTieringSpec from spec_name / spec_module_path; its
    create_worker puts copy_ranges into the three handlers of vLLM's worker. A CPUOffloadingWorker needs
    CUDA, so vLLM's create_worker is replaced by one returning handlers of the same shape; the swapped
    function then copies vLLM-style descriptor tensors byte for byte (triton backend, its interpreter)."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    base = offloading_config(file_tier(tmp_path))
    extra = {**base.extra_config, "spec_name": "HiCacheTieringSpec", "spec_module_path": "hicache.integrations.vllm",
             "hicache_io_backend": "triton"}  # fmt: skip
    spec = OffloadingSpecFactory.create_spec(with_extra(base, extra))
    assert type(spec) is HiCacheTieringSpec and spec.io_backend == "triton"

    def handler(gpu_to_cpu):
        return SimpleNamespace(gpu_to_cpu=gpu_to_cpu, _swap_blocks_batch=None)

    fake = SimpleNamespace(_store_handler=handler(True), _load_handler=handler(False),
                           _expedited_load_handler=handler(False))  # fmt: skip
    monkeypatch.setattr(TieringOffloadingSpec, "create_worker", lambda self, kv: fake)
    assert spec.create_worker(None) is fake
    for h in (fake._store_handler, fake._load_handler, fake._expedited_load_handler):
        assert h._swap_blocks_batch.hicache_backend == "triton"
    src = torch.randint(0, 256, (3, 256), dtype=torch.uint8)
    dst = torch.full((3, 256), 0xA5, dtype=torch.uint8)
    ptrs = [t.data_ptr() + r * 256 for t in (src, dst) for r in (2, 0)]
    fake._load_handler._swap_blocks_batch(torch.tensor(ptrs[:2]), torch.tensor(ptrs[2:]), torch.tensor([256, 128]),
                                          is_src_access_order_any=True)  # fmt: skip
    assert torch.equal(dst[2], src[2]) and torch.equal(dst[0, :128], src[0, :128])
    assert (dst[0, 128:] == 0xA5).all() and (dst[1] == 0xA5).all()


def test_an_unknown_io_backend_names_the_setting(tmp_path):
    base = offloading_config(file_tier(tmp_path))
    with pytest.raises(ValueError, match="backend"):
        HiCacheTieringSpec(with_extra(base, {**base.extra_config, "hicache_io_backend": "warp-drive"}))
