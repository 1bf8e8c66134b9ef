"""Stored pages shared across TP sizes: two gloo ranks (spawned processes) serving a head-parallel model
(``TinyLM(tp_group=...)``: one K/V head each) and a TP=1 server (both heads) of the same model use one
store, on the file backend and on Mooncake.

- TP=2 serves a prompt with write-through to the store (its tokens and logits equal a TP=1 recompute, bit
  for bit, on both ranks); a fresh TP=1 engine serves it from the store with the recompute's tokens and
  logits (the engine's check), every page of its prompt from storage.
- A TP=1 engine serves another prompt into the store; fresh TP=2 ranks serve it from the store, equal to
  the recompute, and each rank's device KV of the prompt equals its heads of the model's KV, byte for byte.
- The same for an MLA model (every rank holds the whole latent; only rank 0 writes), a hybrid: its
  FP8 indexer keys and recurrent checkpoints are sidecar rows in each page's object.
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
from mooncakedata import make_backend
from test_engine import CFG, PAGE
from test_hybrid_models import sidecars_for
from tpharness import rank_report, run_ranks

from hicache import HiRadixCache, HostKVPool
from hicache.serving.engine import Engine, TinyLM
from hicache.serving.model import index_pool, state_pool
from hicache.storage.tier import PrefetchPolicy

WORLD = 2
TIMEOUT_S = 300  # a hang detector, not a speed limit
# The MLA model is a hybrid: a DeepSeek V3.2-style FP8 indexer and a recurrent branch, their sidecar
# pools stored with each page (every rank holds the same rows; rank 0 writes).
CFG_MLA = dataclasses.replace(CFG, mla=True, kv_lora=12, indexer_dim=8, index_topk=4, recurrent_dim=8,
                              recurrent_layer=1)  # fmt: skip
MLA_LAYOUT = "page_first"  # an MLA page object is in its host layout's order: every side uses one
PROMPT_A = [(5 * i + 2) % CFG.vocab for i in range(41)]  # written by TP=2: 10 whole pages before the last token
PROMPT_B = [(7 * i + 4) % CFG.vocab for i in range(41)]  # written by TP=1
NEW = 5  # generated tokens


def backend_of(spec: tuple[str, str]):
    kind, where = spec
    if kind == "file":
        from hicache.storage import FileBackend

        return FileBackend(where)
    return make_backend(where)


def full_kv(cfg, tokens: list[int]) -> list[torch.Tensor]:
    """The model's K and V (or latent) of ``tokens``, ``[L, n, H, D]`` each, from one TP=1 forward."""
    model = TinyLM(cfg)
    pool = cfg.pool(64, PAGE)
    slots = pool.alloc(len(tokens))
    side = {}
    if cfg.indexer_dim:
        side["index"] = index_pool(cfg, 64, PAGE)
    if cfg.recurrent_dim:
        side["state"] = state_pool(cfg, 64, PAGE)
    model.forward_batch(pool, [(tokens, 0, slots)], **side)
    return [t[:, slots].clone() for t in ((pool.kv,) if cfg.mla else (pool.k, pool.v))]


def heads_of(kv: list[torch.Tensor], cfg, rank: int, world: int) -> list[torch.Tensor]:
    if cfg.mla:
        return kv
    h = cfg.num_kv_heads // world
    return [t[:, :, rank * h : (rank + 1) * h] for t in kv]


def pool_kv(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    return [t[:, slots] for t in ((pool.kv,) if pool.mla else (pool.k, pool.v))]


def make_cache(model: TinyLM, layout: str, storage, group=None) -> HiRadixCache:
    """A cache over ``model``'s pool (this rank's heads) with write-through to ``storage``."""
    pool = model.pool(128, PAGE)
    host = HostKVPool(pool, layout=layout, ratio=4.0, safety_margin_gb=0.0)
    return HiRadixCache(pool, host, io_backend="direct", threaded=False, tp_group=group, storage=storage,
                        model_id="tiny-tp", load_back_threshold=1, write_through_threshold=1,
                        prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=PAGE),
                        sidecars=sidecars_for(model.cfg, pool, ratio=4.0))  # fmt: skip


def serve(model: TinyLM, cache: HiRadixCache, prompt: list[int], from_store: bool) -> None:
    """Serve ``prompt`` through ``cache`` and check it against a TP=1 recompute (tokens and logits, bit for
    bit); ``from_store``: every whole page of its prompt came from storage (a fresh cache)."""
    cfg = model.cfg
    got = Engine(model, cache.device_pool, cache).generate(prompt, NEW)
    want = Engine(TinyLM(cfg), cfg.pool(128, PAGE)).generate(prompt, NEW)
    assert got.tokens == want.tokens and torch.equal(got.logits, want.logits)
    n = (len(prompt) - 1) // PAGE * PAGE
    if from_store:
        assert got.host_hit == n and cache.metrics.storage_hit_tokens == n, (got.host_hit, n)
        # This rank's heads of the prompt's KV, as loaded from the store, byte for byte.
        slots = cache.match_prefix(prompt[:n]).device_indices
        assert len(slots) == n
        got_kv = pool_kv(cache.device_pool, slots)
        want_kv = heads_of(full_kv(cfg, prompt[:n]), cfg, model.tp_rank, model.tp_size)
        assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv, strict=True))
    else:
        cache.flush()  # the host copy, then its storage backup (agreed by the ranks)
        m = cache.metrics
        written = n // PAGE if model.tp_rank == 0 or not cfg.mla else 0  # MLA: rank 0 writes
        assert m.storage_backups_failed == 0 and m.storage_pages_written >= written, m.storage_pages_written
    cache.verify()


def rank_main(rank: int, init_file: str, specs, layouts, written, tp1_done, out) -> None:
    def work() -> dict:
        group = dist.group.WORLD
        w_layout, r_layout = layouts
        with pytest.raises(ValueError, match="tp_group: 2 ranks do not divide the model's 1 K/V heads"):
            TinyLM(dataclasses.replace(CFG, num_kv_heads=1), tp_group=group)
        with pytest.raises(ValueError, match="tp_group: 2 ranks do not divide the model's 3 query heads"):
            TinyLM(dataclasses.replace(CFG_MLA, num_heads=3, num_kv_heads=1), tp_group=group)
        with pytest.raises(ValueError, match="pool: not shaped for this model"):
            Engine(TinyLM(CFG, tp_group=group), CFG.pool(64, PAGE))  # the whole model's heads on one rank
        caches = []
        # Phase 1: serve PROMPT_A (MHA and MLA) into the store, each rank its heads.
        for cfg, spec in zip((CFG, CFG_MLA), specs, strict=True):
            model = TinyLM(cfg, tp_group=group)
            cache = make_cache(model, MLA_LAYOUT if cfg.mla else w_layout, backend_of(spec), group)
            serve(model, cache, PROMPT_A, from_store=False)
            caches.append(cache)  # open to the end: a Mooncake client's segment goes with it
        dist.barrier()
        if rank == 0:
            written.set()
        assert tp1_done.wait(TIMEOUT_S), "the TP=1 side never finished"
        # Phase 2: serve PROMPT_B (written by TP=1) from the store in fresh caches.
        for cfg, spec in zip((CFG, CFG_MLA), specs, strict=True):
            model = TinyLM(cfg, tp_group=group)
            with make_cache(model, MLA_LAYOUT if cfg.mla else r_layout, backend_of(spec), group) as cache:
                serve(model, cache, PROMPT_B, from_store=True)
        # Closed only now: a Mooncake store keeps objects in the segments of the clients that are up,
        # any client's (the TP=1 writer's objects may live in ours).
        for cache in caches:
            cache.close()
        return {"served": 4}

    rank_report(rank, WORLD, init_file, 120, out, work)


def run(specs, layouts) -> None:
    """TP=2 writes, TP=1 reads; TP=1 writes, TP=2 reads: one pair of ranks throughout."""
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
            model = TinyLM(cfg)
            with make_cache(model, MLA_LAYOUT if cfg.mla else r_layout, backend_of(spec)) as reader:
                serve(model, reader, PROMPT_A, from_store=True)
            writer = make_cache(model, MLA_LAYOUT if cfg.mla else w_layout, backend_of(spec))
            writers.append(writer)  # open until the TP=2 ranks have read (Mooncake)
            serve(model, writer, PROMPT_B, from_store=False)
    finally:
        tp1_done.set()
        t.join(TIMEOUT_S + 60)
        for cache in writers:
            cache.close()
    assert not errors, errors[0]
    assert results == {0: {"served": 4}, 1: {"served": 4}}, results


LAYOUTS = [("page_first", "page_head"), ("page_head", "layer_first")]  # (writers', readers')


@pytest.mark.parametrize("layouts", LAYOUTS, ids=["-".join(x) for x in LAYOUTS])
def test_tp2_and_tp1_share_a_file_store(tmp_path, layouts):
    run((("file", str(tmp_path / "mha")), ("file", str(tmp_path / "mla"))), layouts)


def test_tp2_and_tp1_share_a_mooncake_store(master):  # noqa: F811 - the fixture
    run((("mooncake", master.address), ("mooncake", master.address)), LAYOUTS[0])
