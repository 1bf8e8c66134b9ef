"""Stored pages shared across TP sizes: two gloo ranks (spawned processes, one K/V head each) and a
TP=1 server (both heads) of the same model use one store, on the file backend and on Mooncake.

- TP=2 writes a prompt; a fresh TP=1 engine serves it from the store with the recompute's tokens and
  logits (the engine's check), its host hit coming from storage.
- A TP=1 engine writes another prompt; the TP=2 ranks prefetch it and load it back, and each rank's
  device KV equals its heads of the model's KV, byte for byte (a rank holds half the heads, so no engine
  runs there: the KV is what any engine would read).
- The same for an MLA model (every rank holds the whole latent; only rank 0 writes).
- Host layouts differ between writer and reader (staged ``page_first`` / ``layer_first`` against zero
  copy ``page_head``): MHA objects are head-major whatever the layout. (MLA objects keep their host
  layout's order, in the namespace: every side uses one layout there.)
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_engine import CFG, PAGE
from test_storage_mooncake import make_backend, master, master_binary  # noqa: F401 - fixtures
from tpharness import rank_report, run_ranks

from hicache import DeviceKVPool, HiRadixCache, HostKVPool
from hicache.engine import Engine, TinyLM
from hicache.storage.tier import PrefetchPolicy

WORLD = 2
TIMEOUT_S = 300  # a hang detector, not a speed limit
CFG_MLA = dataclasses.replace(CFG, mla=True, kv_lora=12)
MLA_LAYOUT = "page_first"  # an MLA page object is in its host layout's order: every side uses one
PROMPT_A = [(5 * i + 2) % CFG.vocab for i in range(41)]  # written by TP=2: 10 whole pages before the last token
PROMPT_B = [(7 * i + 4) % CFG.vocab for i in range(41)]  # written by TP=1


def backend_of(spec: tuple[str, str]):
    kind, where = spec
    if kind == "file":
        from hicache.storage import FileBackend

        return FileBackend(where)
    return make_backend(where)


def full_kv(model: TinyLM, tokens: list[int]) -> list[torch.Tensor]:
    """The model's K and V (or latent) of ``tokens``, ``[L, n, H, D]`` each, from one forward."""
    pool = model.cfg.pool(64, PAGE)
    slots = pool.alloc(len(tokens))
    model.forward(pool, tokens, 0, slots)
    return [t[:, slots].clone() for t in ((pool.kv,) if model.cfg.mla else (pool.k, pool.v))]


def shard_cache(cfg, rank: int, world: int, layout: str, storage, group) -> HiRadixCache:
    """Rank ``rank``'s cache of ``world``: ``num_kv_heads / world`` heads (MLA: the whole latent)."""
    heads = 1 if cfg.mla else cfg.num_kv_heads // world
    dev = DeviceKVPool(num_slots=64, num_layers=cfg.num_layers, head_num=heads,
                       head_dim=cfg.kv_lora if cfg.mla else cfg.head_dim, dtype=cfg.dtype, device="cpu",
                       page_size=PAGE, mla=cfg.mla)  # fmt: skip
    host = HostKVPool(dev, layout=layout, ratio=4.0, safety_margin_gb=0.0)
    return HiRadixCache(dev, host, io_backend="direct", threaded=False, tp_group=group, storage=storage,
                        model_id="tiny-tp", load_back_threshold=1,
                        prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=PAGE))  # fmt: skip


def heads_of(kv: list[torch.Tensor], cfg, rank: int, world: int) -> list[torch.Tensor]:
    if cfg.mla:
        return kv
    h = cfg.num_kv_heads // world
    return [t[:, :, rank * h : (rank + 1) * h] for t in kv]


def pool_kv(pool: DeviceKVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    return [t[:, slots] for t in ((pool.kv,) if pool.mla else (pool.k, pool.v))]


def write_shard(cache: HiRadixCache, kv: list[torch.Tensor], tokens: list[int]) -> None:
    """Insert ``tokens`` with this rank's share ``kv`` of their KV, and back them up to the store."""
    pool = cache.device_pool
    slots = pool.alloc(len(tokens))
    for dst, src in zip(pool_kv(pool, slots), kv, strict=True):
        assert dst.shape == src.shape
    for name, src in zip(("kv",) if pool.mla else ("k", "v"), kv, strict=True):
        getattr(pool, name)[:, slots] = src
    cache.insert(tokens, slots)
    cache.flush()  # the host copy, then its storage backup, agreed by both ranks


def read_shard(cache: HiRadixCache, tokens: list[int]) -> torch.Tensor:
    """Prefetch ``tokens`` from the store, load them to the device; their device slots."""
    m = cache.match_prefix(tokens)
    assert len(m.device_indices) == 0 and m.host_hit_length == 0  # a fresh cache: nothing but the store
    assert cache.prefetch_from_storage("r", m.last_host_node, tokens)
    deadline = time.monotonic() + 60
    while not cache.check_prefetch_progress("r"):
        assert time.monotonic() < deadline, "prefetch never finished"
    m = cache.match_prefix(tokens)
    assert m.host_hit_length == len(tokens), (m.host_hit_length, len(tokens))
    assert cache.load_back(m.last_host_node) is not None
    cache.start_loading()
    cache.flush()
    slots = cache.match_prefix(tokens).device_indices
    assert len(slots) == len(tokens)
    return slots


def rank_main(rank: int, init_file: str, specs, layouts, written, tp1_done, out) -> None:
    def work() -> dict:
        group = dist.group.WORLD
        w_layout, r_layout = layouts
        caches = []
        # Phase 1: write PROMPT_A's whole pages (MHA and MLA), each rank its heads.
        for cfg, spec in zip((CFG, CFG_MLA), specs, strict=True):
            model = TinyLM(cfg)
            n = (len(PROMPT_A) - 1) // PAGE * PAGE
            cache = shard_cache(cfg, rank, WORLD, MLA_LAYOUT if cfg.mla else w_layout, backend_of(spec), group)
            write_shard(cache, heads_of(full_kv(model, PROMPT_A[:n]), cfg, rank, WORLD), PROMPT_A[:n])
            m = cache.metrics
            assert m.storage_backups_failed == 0 and m.storage_pages_written == (
                n // PAGE if rank == 0 or not cfg.mla else 0
            ), m.storage_pages_written
            caches.append(cache)  # open to the end: a Mooncake client's segment goes with it
        dist.barrier()
        if rank == 0:
            written.set()
        assert tp1_done.wait(TIMEOUT_S), "the TP=1 side never finished"
        # Phase 2: read PROMPT_B (written by TP=1) into fresh caches; compare with this rank's heads.
        equal = []
        for cfg, spec in zip((CFG, CFG_MLA), specs, strict=True):
            model = TinyLM(cfg)
            n = (len(PROMPT_B) - 1) // PAGE * PAGE
            with shard_cache(cfg, rank, WORLD, MLA_LAYOUT if cfg.mla else r_layout, backend_of(spec), group) as cache:
                slots = read_shard(cache, PROMPT_B[:n])
                got = pool_kv(cache.device_pool, slots)
                want = heads_of(full_kv(model, PROMPT_B[:n]), cfg, rank, WORLD)
                equal.append(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))
                assert cache.metrics.storage_hit_tokens == n
                cache.verify()
        # Closed only now: a Mooncake store keeps objects in the segments of the clients that are up,
        # any client's (the TP=1 writer's objects may live in ours).
        for cache in caches:
            cache.close()
        return {"equal": equal}

    rank_report(rank, WORLD, init_file, 120, out, work)


def serve_from_store(cfg, spec, layout: str) -> None:
    """A fresh TP=1 engine serves PROMPT_A, written by the TP=2 ranks: equal to recompute, from storage."""
    model = TinyLM(cfg)
    pool = cfg.pool(128, PAGE)
    host = HostKVPool(pool, layout=layout, ratio=4.0, safety_margin_gb=0.0)
    with HiRadixCache(pool, host, io_backend="direct", threaded=False, storage=backend_of(spec), model_id="tiny-tp",
                      load_back_threshold=1,
                      prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=PAGE)) as cache:  # fmt: skip
        got = Engine(model, pool, cache).generate(PROMPT_A, 5)
        want = Engine(model, cfg.pool(128, PAGE)).generate(PROMPT_A, 5)
        assert got.tokens == want.tokens and torch.equal(got.logits, want.logits)
        n = (len(PROMPT_A) - 1) // PAGE * PAGE
        assert got.host_hit == n and cache.metrics.storage_hit_tokens == n  # every page from the store
        cache.verify()


def write_from_tp1(cfg, spec, layout: str) -> HiRadixCache:
    """A TP=1 engine serves PROMPT_B with write-through to the store; its cache (still open) is returned."""
    model = TinyLM(cfg)
    pool = cfg.pool(128, PAGE)
    host = HostKVPool(pool, layout=layout, ratio=4.0, safety_margin_gb=0.0)
    cache = HiRadixCache(pool, host, io_backend="direct", threaded=False, storage=backend_of(spec),
                         model_id="tiny-tp", write_through_threshold=1)  # fmt: skip
    Engine(model, pool, cache).generate(PROMPT_B, 5)
    cache.flush()
    assert cache.metrics.storage_pages_written >= (len(PROMPT_B) - 1) // PAGE
    assert cache.metrics.storage_backups_failed == 0
    return cache


def run(specs, layouts) -> None:
    """TP=2 writes, TP=1 reads (engine), TP=1 writes, TP=2 reads (KV) — one pair of ranks throughout."""
    ctx = mp.get_context("spawn")
    written, tp1_done = ctx.Event(), ctx.Event()
    results: dict = {}
    errors: list[BaseException] = []

    def ranks() -> None:
        try:
            import tempfile

            with tempfile.TemporaryDirectory() as d:
                results.update(run_ranks(rank_main, (f"{d}/init", specs, layouts, written, tp1_done), WORLD,
                                         TIMEOUT_S, 30))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=ranks, daemon=True)
    t.start()
    writers = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not written.wait(0.2):
            assert not errors and time.monotonic() < deadline, errors or "the TP=2 writers never finished"
        w_layout, r_layout = layouts
        for cfg, spec in zip((CFG, CFG_MLA), specs, strict=True):
            serve_from_store(cfg, spec, MLA_LAYOUT if cfg.mla else r_layout)
            writers.append(write_from_tp1(cfg, spec, MLA_LAYOUT if cfg.mla else w_layout))
    finally:
        tp1_done.set()
        t.join(TIMEOUT_S + 60)
        for cache in writers:
            cache.close()
    assert not errors, errors[0]
    assert results[0]["equal"] == [True, True] and results[1]["equal"] == [True, True], results


LAYOUTS = [("page_first", "page_head"), ("page_head", "layer_first")]  # (writers', readers')


@pytest.mark.parametrize("layouts", LAYOUTS, ids=["-".join(x) for x in LAYOUTS])
def test_tp2_and_tp1_share_a_file_store(tmp_path, layouts):
    run((("file", str(tmp_path / "mha")), ("file", str(tmp_path / "mla"))), layouts)


def test_tp2_and_tp1_share_a_mooncake_store(master):  # noqa: F811 - the fixture
    run((("mooncake", master.address), ("mooncake", master.address)), LAYOUTS[0])
