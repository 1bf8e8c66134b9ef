"""hicache.integrations.sglang.HiCacheKernelsStorage driven by SGLang 0.5.23's own code: its storage
factory loads the class from the extra config, its MHA and MLA host pools (every layout each supports
here) hold the pages, its own page helpers (``get_data_page``, ``get_dummy_flat_data_page``,
``set_from_flat_data_page``) make and check the copying interface's pages, and its failure injector
wraps the backend. Pages are random bytes; readers' slots are poisoned first; comparisons are exact.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import need

need([
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "hicache.integrations.sglang",
])  # fmt: skip

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang_pools import DTYPE, LAYERS, PAGE, mamba_pools, mha_pools, mla_pools, random_bytes  # noqa: E402

from hicache.integrations.sglang import MHA_LAYOUTS, MLA_LAYOUTS, HiCacheKernelsStorage  # noqa: E402
from hicache.storage import FileBackend, StorageBackend  # noqa: E402


def mha_host(layout: str, heads: int = 2, head_dim: int = 8, dtype: torch.dtype = DTYPE):
    return mha_pools(layout, heads, head_dim, dtype)[1]


def mla_host(layout: str, dtype: torch.dtype = DTYPE):
    return mla_pools(layout, dtype)[1]


def fill_random(host, seed: int) -> None:
    random_bytes(host.kv_buffer, seed)


def poison(host, slots: torch.Tensor) -> None:
    for first in slots[::PAGE].tolist():
        page = host.get_dummy_flat_data_page()
        page.view(torch.uint8).fill_(0xA5)
        host.set_from_flat_data_page(first, page)


def pages_of(host, slots: torch.Tensor) -> list[torch.Tensor]:
    """SGLang's own view of each page, as bytes (random bytes hold NaNs, which never compare equal)."""
    return [
        host.get_data_page(first, flat=True).contiguous().view(torch.uint8).clone() for first in slots[::PAGE].tolist()
    ]


def config(*, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, model: str = "m", metrics: bool = False,
           extra: dict | None = None, tp_lcm_size: int | None = None,
           dcp_size: int = 1) -> HiCacheStorageConfig:  # fmt: skip
    dcp = {} if dcp_size == 1 else {"dcp_size": dcp_size, "dcp_rank": tp_rank % dcp_size,
                                    "logical_page_size": PAGE * dcp_size}  # fmt: skip
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
                                is_page_first_layout=True, model_name=model, tp_lcm_size=tp_lcm_size,
                                should_split_heads=tp_lcm_size is not None,
                                extra_config={"interface_v1": 1, **(extra or {})}, **dcp)  # fmt: skip


def storage(tmp_path, host, **kw) -> HiCacheKernelsStorage:
    extra = {
        "hicache_backend": "file",
        "hicache_backend_config": {"path": str(tmp_path / "store")},
        **kw.pop("extra", {}),
    }
    s = HiCacheKernelsStorage(config(extra=extra, **kw))
    s.register_mem_pool_host(host)
    return s


KEYS = [f"{i:064x}" for i in range(1, 6)]  # SGLang's keys are hex hash chains; any string works


def test_sglang_factory_loads_the_backend_from_its_extra_config(tmp_path):
    host = mha_host("page_first")
    extra = {"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
             "class_name": "HiCacheKernelsStorage", "interface_v1": 1, "hicache_backend": "file",
             "hicache_backend_config": {"path": str(tmp_path / "store")}}  # fmt: skip
    cfg = config(extra=extra)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert isinstance(backend, HiCacheKernelsStorage) and isinstance(backend.backend, FileBackend)
    backend.register_mem_pool_host(host)  # what SGLang's cache controller does next
    fill_random(host, 1)
    slots = host.alloc(2 * PAGE)
    assert backend.batch_set_v1(KEYS[:2], slots) == [True, True]
    assert backend.batch_exists(KEYS) == 2
    backend.close()


@pytest.mark.parametrize(("mla", "layout"), [(False, x) for x in MHA_LAYOUTS] + [(True, x) for x in MLA_LAYOUTS])
def test_zero_copy_round_trip_through_sglangs_host_pools(tmp_path, mla, layout):
    host = mla_host(layout) if mla else mha_host(layout)
    fill_random(host, 2)
    src = host.alloc(3 * PAGE)
    want = pages_of(host, src)
    writer = storage(tmp_path, host, mla=mla)
    assert writer.batch_set_v1(KEYS[:3], src) == [True] * 3
    dst = host.alloc(3 * PAGE)
    poison(host, dst)
    reader = storage(tmp_path, host, mla=mla)  # another instance over the same store
    assert reader.batch_exists(KEYS) == 3
    assert reader.batch_get_v1(KEYS[:3], dst) == [True] * 3
    got = pages_of(host, dst)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert reader.batch_get_v1([KEYS[3]], host.alloc(PAGE)) == [False]  # never stored: a miss


@pytest.mark.parametrize(("mla", "layout"), [(False, x) for x in MHA_LAYOUTS] + [(True, x) for x in MLA_LAYOUTS])
def test_copying_interface_round_trip_with_sglangs_flat_pages(tmp_path, mla, layout):
    host = mla_host(layout) if mla else mha_host(layout)
    fill_random(host, 3)
    src = host.alloc(2 * PAGE)
    want = pages_of(host, src)
    s = storage(tmp_path, host, mla=mla, extra={"interface_v1": 0})
    assert s.batch_set(KEYS[:2], [host.get_data_page(f, flat=True) for f in src[::PAGE].tolist()])
    targets = [host.get_dummy_flat_data_page() for _ in range(3)]
    out = s.batch_get(KEYS[:3], targets)
    assert out[2] is None and all(out[i] is targets[i] for i in range(2))
    dst = host.alloc(2 * PAGE)
    poison(host, dst)
    for first, page in zip(dst[::PAGE].tolist(), out[:2], strict=True):
        host.set_from_flat_data_page(first, page)
    assert all(torch.equal(a, b) for a, b in zip(pages_of(host, dst), want, strict=True))
    assert s.get(KEYS[0], host.get_dummy_flat_data_page()) is not None and s.exists(KEYS[1])
    assert s.get(KEYS[4]) is None and not s.exists(KEYS[4])


def test_the_two_interfaces_never_read_each_others_objects(tmp_path):
    """MHA layer_first: the buffer meta's order (per layer K, V) is not the flat page's (K of every
    layer, then V): the interface is in the namespace, so a page written one way is a miss the other."""
    host = mha_host("layer_first")
    fill_random(host, 4)
    v1 = storage(tmp_path, host)
    assert v1.batch_set_v1(KEYS[:1], host.alloc(PAGE)) == [True]
    flat = storage(tmp_path, host, extra={"interface_v1": 0})
    assert flat.batch_exists(KEYS[:1]) == 0 and flat.get(KEYS[0]) is None


@pytest.mark.parametrize("what", ["dtype", "model", "salt", "layout", "head_dim"])
def test_namespace_keeps_deployments_apart(tmp_path, what):
    host = mha_host("page_first")
    fill_random(host, 5)
    assert storage(tmp_path, host).batch_set_v1(KEYS[:2], host.alloc(2 * PAGE)) == [True, True]
    same = storage(tmp_path, mha_host("page_first"))
    assert same.batch_exists(KEYS) == 2  # the control: an identical deployment reads them
    other = {
        "dtype": lambda: storage(tmp_path, mha_host("page_first", dtype=torch.float16)),
        "model": lambda: storage(tmp_path, mha_host("page_first"), model="other"),
        "salt": lambda: storage(tmp_path, mha_host("page_first"), extra={"hicache_namespace": "tenant-b"}),
        "layout": lambda: storage(tmp_path, mha_host("page_first_direct")),
        "head_dim": lambda: storage(tmp_path, mha_host("page_first", head_dim=16)),
    }[what]()
    assert other.batch_exists(KEYS) == 0


def test_an_mha_rank_never_reads_another_ranks_shard(tmp_path):
    host0, host1 = mha_host("page_first"), mha_host("page_first")
    fill_random(host0, 6)
    r0 = storage(tmp_path, host0, tp_rank=0, tp_size=2)
    r1 = storage(tmp_path, host1, tp_rank=1, tp_size=2)
    assert r0.batch_set_v1(KEYS[:2], host0.alloc(2 * PAGE)) == [True, True]
    assert r1.batch_exists(KEYS) == 0 and r1.batch_get_v1(KEYS[:1], host1.alloc(PAGE)) == [False]
    assert storage(tmp_path, mha_host("page_first"), tp_rank=0, tp_size=2).batch_exists(KEYS) == 2


def test_mla_only_the_writer_rank_stores_and_every_rank_reads(tmp_path):
    host0, host1 = mla_host("page_first"), mla_host("page_first")
    fill_random(host0, 7)
    fill_random(host1, 8)
    r0 = storage(tmp_path, host0, mla=True, tp_rank=0, tp_size=2)
    r1 = storage(tmp_path, host1, mla=True, tp_rank=1, tp_size=2)
    s1 = host1.alloc(PAGE)
    assert r1.batch_set_v1(KEYS[:1], s1) == [True] and r1.stats()["skipped_sets"] == 1
    assert r0.batch_exists(KEYS) == 0  # the non-writer stored nothing
    s0 = host0.alloc(PAGE)
    want = pages_of(host0, s0)
    assert r0.batch_set_v1(KEYS[:1], s0) == [True]
    dst = host1.alloc(PAGE)
    poison(host1, dst)
    assert r1.batch_get_v1(KEYS[:1], dst) == [True]
    assert torch.equal(pages_of(host1, dst)[0], want[0])


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
@pytest.mark.parametrize("interface_v1", [1, 0])
def test_mla_dcp_ranks_keep_their_own_shards(tmp_path, layout, interface_v1):
    """Decode context parallelism (DCP=2, TP=2): each rank holds its own share of every logical page
    (SGLang's host pool maps the logical slots), both ranks are writers, and each reads back its own
    bytes, never the other's, under the same page keys."""
    hosts = [mla_pools(layout, dcp_size=2, dcp_rank=r)[1] for r in range(2)]
    ranks = [storage(tmp_path, h, mla=True, tp_rank=r, tp_size=2, dcp_size=2, extra={"interface_v1": interface_v1})
             for r, h in enumerate(hosts)]  # fmt: skip
    logical = PAGE * 2
    wants = []
    for r, (h, s) in enumerate(zip(hosts, ranks, strict=True)):
        fill_random(h, 20 + r)
        assert s.writer and h.logical_page_size == logical
        src = h.alloc(2 * logical)
        firsts = src[::logical].tolist()
        wants.append([h.get_data_page(f, flat=True).contiguous().view(torch.uint8).clone() for f in firsts])
        if interface_v1:
            assert s.batch_set_v1(KEYS[:2], src) == [True, True]
        else:
            assert s.batch_set(KEYS[:2], [h.get_data_page(f, flat=True) for f in firsts]) is True
    assert not torch.equal(wants[0][0], wants[1][0])  # the shards differ: a shared key would mix them
    for r, (h, s) in enumerate(zip(hosts, ranks, strict=True)):
        dst = h.alloc(2 * logical)
        for f in dst[::logical].tolist():
            page = h.get_dummy_flat_data_page()
            page.view(torch.uint8).fill_(0xA5)
            h.set_from_flat_data_page(f, page)
        if interface_v1:
            assert s.batch_get_v1(KEYS[:2], dst) == [True, True]
        else:
            got = s.batch_get(KEYS[:2], [h.get_dummy_flat_data_page() for _ in range(2)])
            for f, page in zip(dst[::logical].tolist(), got, strict=True):
                h.set_from_flat_data_page(f, page)
        have = [h.get_data_page(f, flat=True).contiguous().view(torch.uint8) for f in dst[::logical].tolist()]
        assert all(torch.equal(a, b) for a, b in zip(have, wants[r], strict=True)), f"rank {r} read other bytes"


def _global_heads(total: int, pages: int, seed: int) -> torch.Tensor:
    """[kv, page, head, token, layer, dim] bytes of the model's every head (page_head's order)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-100, 100, (2, pages, total, PAGE, LAYERS, 8), generator=gen).to(DTYPE)


def _rank_pool(total: int, tp: int, rank: int, data: torch.Tensor | None, slots_pages: int):
    heads = total // tp
    host = mha_host("page_head", heads=heads)
    slots = host.alloc(slots_pages * PAGE)
    if data is not None:
        for i, first in enumerate(slots[::PAGE].tolist()):
            host.kv_buffer[:, first // PAGE] = data[:, i, rank * heads : (rank + 1) * heads]
    return host, slots


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_page_head_pages_written_at_tp2_are_read_at_tp4(tmp_path, interface_v1):
    """With tp_lcm_size=4 over 8 heads, a page is stored as 4 groups of 2 heads, each under its own
    key; TP=2 ranks write 2 groups each and every TP=4 rank reads its own group."""
    total, pages = 8, 2
    data = _global_heads(total, pages, seed=9)
    extra = {"interface_v1": interface_v1}
    for rank in range(2):
        host, slots = _rank_pool(total, 2, rank, data, pages)
        s = storage(tmp_path, host, tp_rank=rank, tp_size=2, tp_lcm_size=4, extra=extra)
        if interface_v1:
            assert s.batch_set_v1(KEYS[:pages], slots) == [True] * pages
        else:
            assert s.batch_set(KEYS[:pages], pages_of(host, slots))
    for rank in range(4):
        host, slots = _rank_pool(total, 4, rank, None, pages)
        poison(host, slots)
        s = storage(tmp_path, host, tp_rank=rank, tp_size=4, tp_lcm_size=4, extra=extra)
        assert s.batch_exists(KEYS) == pages
        if interface_v1:
            assert s.batch_get_v1(KEYS[:pages], slots) == [True] * pages
        else:
            out = s.batch_get(KEYS[:pages], [host.get_dummy_flat_data_page() for _ in range(pages)])
            for first, page in zip(slots[::PAGE].tolist(), out, strict=True):
                host.set_from_flat_data_page(first, page)
        for i, first in enumerate(slots[::PAGE].tolist()):
            want = data[:, i, rank * 2 : (rank + 1) * 2]
            assert torch.equal(host.kv_buffer[:, first // PAGE], want), (rank, i)
    # without tp_lcm_size the rank's whole shard is one object: a TP=4 rank finds nothing of TP=2's
    host, _ = _rank_pool(total, 4, 0, None, 1)
    assert storage(tmp_path, host, tp_rank=0, tp_size=4).batch_exists(KEYS) == 0


class Exploding(StorageBackend):
    def exists(self, key):
        raise OSError("store down")

    def get(self, key):
        raise OSError("store down")

    def set(self, key, value):
        raise OSError("store down")

    def batch_get_into(self, keys, host_slots):
        raise OSError("store down")

    def batch_set_from(self, keys, host_slots):
        raise OSError("store down")


def test_store_faults_are_misses_never_exceptions(tmp_path):
    host = mha_host("page_first")
    s = HiCacheKernelsStorage(config(), backend=Exploding())
    s.register_mem_pool_host(host)
    slots = host.alloc(2 * PAGE)
    assert s.batch_set_v1(KEYS[:2], slots) == [False, False]
    assert s.batch_get_v1(KEYS[:2], slots) == [False, False]
    assert s.batch_exists(KEYS) == 0 and not s.exists(KEYS[0])
    assert s.batch_set(KEYS[:1], [host.get_dummy_flat_data_page()]) is False
    assert s.batch_get(KEYS[:1], [host.get_dummy_flat_data_page()]) == [None]
    assert s.stats()["faults"] == 6
    # a wrong-sized value or target is a miss too, and writes nothing
    good = storage(tmp_path, host)
    assert good.batch_set(KEYS[:1], [torch.zeros(3, dtype=torch.uint8)]) is False
    assert good.batch_exists(KEYS) == 0
    # after close: misses
    good.close()
    good.close()
    assert good.batch_get_v1(KEYS[:1], slots) == [False] and good.batch_exists(KEYS) == 0


def test_a_torn_object_in_the_store_is_a_miss(tmp_path):
    host = mha_host("page_first")
    fill_random(host, 10)
    s = storage(tmp_path, host)
    assert s.batch_set_v1(KEYS[:2], host.alloc(2 * PAGE)) == [True, True]
    for f in (tmp_path / "store").rglob("*"):
        if f.is_file() and f.stat().st_size > 64:
            with open(f, "r+b") as fh:
                fh.truncate(f.stat().st_size // 2)
            break
    res = s.batch_get_v1(KEYS[:2], host.alloc(2 * PAGE))
    assert res.count(False) == 1


def test_sglangs_failure_injector_gives_misses_never_wrong_bytes(tmp_path):
    host = mha_host("page_first")
    fill_random(host, 11)
    src = host.alloc(4 * PAGE)
    want = pages_of(host, src)
    inner = storage(tmp_path, host)
    assert inner.batch_set_v1(KEYS[:4], src) == [True] * 4
    wrapped = HiCacheStorageFailureInjector(inner, 0.0, 0.5)
    seen_ok = seen_fail = 0
    for trial in range(40):
        dst = host.alloc(4 * PAGE)
        poison(host, dst)
        res = wrapped.batch_get_v1(KEYS[:4], dst)
        got = pages_of(host, dst)
        for ok, a, b in zip(res, got, want, strict=True):
            if ok:
                assert torch.equal(a, b), trial
        seen_ok += any(res)
        seen_fail += not all(res)
        host.free(dst)
    assert seen_ok and seen_fail  # the injector did fail some calls, and the rest read right


def test_threads_write_and_read_at_once(tmp_path):
    """SGLang's prefetch and backup threads call the backend at the same time."""
    host = mha_host("page_first")
    fill_random(host, 12)
    s = storage(tmp_path, host)
    keys = [f"{i:064x}" for i in range(100, 140)]
    src = host.alloc(len(keys) * PAGE)
    want = pages_of(host, src)
    errors = []

    def write(part):
        if (
            s.batch_set_v1(
                keys[part::2], torch.cat([src[i * PAGE : (i + 1) * PAGE] for i in range(part, len(keys), 2)])
            )
            != [True] * 20
        ):  # noqa: E501
            errors.append(part)

    threads = [threading.Thread(target=write, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and s.batch_exists(keys) == len(keys)
    dst = host.alloc(len(keys) * PAGE)
    assert s.batch_get_v1(keys, dst) == [True] * len(keys)
    assert all(torch.equal(a, b) for a, b in zip(pages_of(host, dst), want, strict=True))


def test_storage_metrics_in_sglangs_format(tmp_path):
    host = mha_host("page_first")
    s = storage(tmp_path, host, metrics=True)
    assert s.batch_set_v1(KEYS[:2], host.alloc(2 * PAGE)) == [True, True]
    assert s.batch_get_v1(KEYS[:2], host.alloc(2 * PAGE)) == [True, True]
    m = s.get_stats()
    assert m.backup_pgs == [2] and m.prefetch_pgs == [2] and m.prefetch_bandwidth[0] > 0
    assert s.get_stats().prefetch_pgs == []  # since the last call
    assert storage(tmp_path, host).get_stats() is None  # metrics off


def test_bad_configuration_names_the_setting(tmp_path):
    with pytest.raises(TypeError, match="storage_config"):
        HiCacheKernelsStorage({"extra_config": {}})
    with pytest.raises(TypeError, match="hicache_backend_config"):
        HiCacheKernelsStorage(config(extra={"hicache_backend_config": [1]}))
    with pytest.raises(TypeError, match="hicache_namespace"):
        HiCacheKernelsStorage(config(extra={"hicache_namespace": 3}))
    with pytest.raises(ValueError, match="storage backend"):
        HiCacheKernelsStorage(config(extra={"hicache_backend": "no-such"}))
    with pytest.raises(TypeError, match="backend"):
        HiCacheKernelsStorage(config(), backend=object())
    s = HiCacheKernelsStorage(config(mla=True, extra={"hicache_backend_config": {"path": str(tmp_path)}}))
    with pytest.raises(ValueError, match="layout"):
        s.register_mem_pool_host(mha_host("page_head"))  # page_head is not an MLA layout
    s = HiCacheKernelsStorage(
        config(tp_size=2, tp_lcm_size=4, extra={"hicache_backend_config": {"path": str(tmp_path)}})
    )
    with pytest.raises(ValueError, match="tp_lcm_size"):
        s.register_mem_pool_host(mha_host("page_first"))  # head groups need page_head
    unbound = HiCacheKernelsStorage(config(extra={"hicache_backend_config": {"path": str(tmp_path)}}))
    assert unbound.batch_get_v1(KEYS[:1], torch.arange(PAGE)) == [False]  # before registration: a miss


# -- SGLang's v2 pool interface: a hybrid (Mamba) model's KV pool and its Mamba state pool ---------------
def hybrid(tmp_path, seed: int, interface_v1: int = 1):
    """SGLang's host pools of a hybrid model (its MHA KV pool and MambaPoolHost), registered through
    register_mem_host_pool_v2 as SGLang's host pool group registers them, random bytes in both."""
    kv, mamba = mha_host("page_first"), mamba_pools("page_first")[1]
    random_bytes(kv.kv_buffer, seed)
    for i, t in enumerate([mamba.temporal_buffer, *mamba.conv_buffer]):
        random_bytes(t, seed * 10 + i)
    s = HiCacheKernelsStorage(config(extra={"hicache_backend": "file", "interface_v1": interface_v1,
                                            "hicache_backend_config": {"path": str(tmp_path / "store")}}))  # fmt: skip
    s.register_mem_host_pool_v2(kv, PoolName.KV)
    s.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    return s, kv, mamba


def mamba_page(pool, slot: int) -> torch.Tensor:
    return pool.get_data_page(slot, flat=True).clone()


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_v2_hybrid_pages_and_their_mamba_state_round_trip(tmp_path, interface_v1):
    s, kv, mamba = hybrid(tmp_path, 31, interface_v1)
    kv_slots, state = kv.alloc(3 * PAGE), mamba.alloc(1)
    want_kv, want_state = pages_of(kv, kv_slots), mamba_page(mamba, int(state[0]))
    # The KV pages of three keys, and the Mamba state at the last one (SGLang's trailing-pages policy).
    sets = s.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=kv_slots, keys=KEYS[:3]),
                           PoolTransfer(PoolName.MAMBA, host_indices=state, keys=KEYS[2:3],
                                        hit_policy=PoolHitPolicy.TRAILING_PAGES)])  # fmt: skip
    assert sets == {"kv": [True] * 3, "mamba": [True]}
    r, kv2, mamba2 = hybrid(tmp_path, 32, interface_v1)  # a fresh instance, other bytes in its pools
    trailing = [PoolTransfer(PoolName.MAMBA, keys=KEYS[2:3], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    hit = r.batch_exists_v2(KEYS[:4], trailing)
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages, hit.restorable_prefix_pages) == (3, {"kv": 3, "mamba": 3}, [3])
    dst_kv, dst_state = kv2.alloc(3 * PAGE), mamba2.alloc(1)
    poison(kv2, dst_kv)
    got = r.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=dst_kv, keys=KEYS[:3]),
                          PoolTransfer(PoolName.MAMBA, host_indices=dst_state, keys=KEYS[2:3])])  # fmt: skip
    assert got == {"kv": [True] * 3, "mamba": [True]}
    assert all(torch.equal(a, b) for a, b in zip(pages_of(kv2, dst_kv), want_kv, strict=True))
    assert torch.equal(mamba_page(mamba2, int(dst_state[0])), want_state)


def test_v2_a_prefix_without_its_sidecar_is_not_restorable(tmp_path):
    """KV pages stored without their Mamba state (or with it for a shorter prefix): that prefix is a
    miss, never a load without its state; an all-pages sidecar cuts the prefix at its first gap."""
    s, kv, mamba = hybrid(tmp_path, 41)
    slots = kv.alloc(4 * PAGE)
    assert s.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=slots, keys=KEYS[:4])]) == {"kv": [True] * 4}
    trailing = [PoolTransfer(PoolName.MAMBA, keys=KEYS[3:4], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert s.batch_exists_v2(KEYS[:4], trailing).kv_hit_pages == 0  # no state anywhere: nothing restorable
    state_at_2 = [PoolTransfer(PoolName.MAMBA, host_indices=mamba.alloc(1), keys=KEYS[1:2])]
    assert s.batch_set_v2(state_at_2)["mamba"] == [True]
    hit = s.batch_exists_v2(KEYS[:4], trailing)
    assert hit.kv_hit_pages == 2 and hit.restorable_prefix_pages == [2]  # only the prefix the state ends
    all_pages = [PoolTransfer(PoolName.MAMBA, keys=KEYS[:4], hit_policy=PoolHitPolicy.ALL_PAGES)]
    assert s.batch_exists_v2(KEYS[:4], all_pages).kv_hit_pages == 0  # page 0's state is missing


def test_v2_pools_are_namespaced_and_faults_are_misses(tmp_path):
    s, kv, mamba = hybrid(tmp_path, 51)
    state = mamba.alloc(1)
    assert s.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=state, keys=KEYS[:1])])["mamba"] == [True]
    # the same key in the KV pool's namespace is not the Mamba page
    assert s.batch_exists(KEYS[:1]) == 0
    # Mamba pools of another geometry read nothing of it: a wider state, and one of as many bytes in
    # another shape (which a size check alone would take)
    store = {"path": str(tmp_path / "store")}
    for shape in ((3, 6), (5, 3)):
        other = HiCacheKernelsStorage(config(extra={"hicache_backend": "file", "hicache_backend_config": store}))
        pool = mamba_pools("page_first", slots=8, conv_shape=shape)[1]
        other.register_mem_host_pool_v2(pool, PoolName.MAMBA)
        other.register_mem_host_pool_v2(mha_host("page_first"), PoolName.KV)
        got = other.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=pool.alloc(1), keys=KEYS[:1])])
        assert got == {"mamba": [False]} and other.stats()["faults"] == 0, shape  # a plain miss
    # wrong slot counts, unknown pools and a raising backend are misses, counted, never exceptions
    assert s.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=kv.alloc(PAGE), keys=KEYS[:1])]) == {"kv": [True]}
    before = s.stats()["faults"]
    assert s.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=mamba.alloc(2), keys=KEYS[:1])]) == {
        "mamba": [False]}  # fmt: skip
    assert s.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=state, keys=KEYS[:1])]) == {"swa": [False]}
    s.backend.exists = lambda key: (_ for _ in ()).throw(OSError("store down"))
    assert s.batch_exists_v2(KEYS[:1], [PoolTransfer(PoolName.MAMBA, keys=KEYS[:1])]).kv_hit_pages == 0
    assert s.stats()["faults"] == before + 3
