"""Hybrid models served over the cache (issue 34): a recurrent branch (Mamba / linear-attention style, its
state checkpointed at every page boundary in a one-layer sidecar pool), beside MHA attention in one layer,
together with MLA and a DeepSeek V3.2-style FP8 indexer (two sidecar pools of different depths), or as a
layer of its own without attention among sliding-window and full layers (Jamba / Nemotron-H style); and
sliding-window layers, their K/V in the KV pool or in a window pool of their own. Every
request's tokens and logits equal a full recompute's, bit for bit, whatever tier its prefix came from
(device, host, a second instance's store) and in continuous batching, where each request's state is
carried from one decode step to the next. A prefix resumed from a missing or misplaced checkpoint
would give other logits. Runs in CI's seeded runs under the deferred device model too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine import (
    CFG,
    PAGE,
    FakeClock,
    check_against_recompute,
    make_cache,
    serve_and_compare,
    staggered_requests,
)

from hicache import HostKVPool
from hicache.serving.engine import Engine, TinyLM
from hicache.serving.model import index_pool, state_pool
from hicache.storage import FileBackend
from hicache.storage.tier import PrefetchPolicy

RECURRENT = dataclasses.replace(CFG, recurrent_dim=16, recurrent_layer=1)
MLA_FULL = dataclasses.replace(CFG, mla=True, indexer_dim=12, index_topk=4, recurrent_dim=8, recurrent_layer=2)
SLIDING = dataclasses.replace(CFG, sliding_window=6, full_every=3)  # layers 0, 1 windowed, layer 2 full
# "sliding-window": its windowed layers' K/V in the KV pool with the full ones; "window-pool": in a
# WindowKVPool of three quarters of the KV pool's slots, rows only where a window needs them.
# "recurrent-layer": layer 0 a recurrent layer with no attention (Jamba / Nemotron-H style), layers 1 and 3
# full attention, layer 2 windowed (in a window pool).
RECURRENT_LAYER = dataclasses.replace(CFG, num_layers=4, recurrent_dim=16, recurrent_layer=0, recurrent_only=True,
                                      sliding_window=6, full_every=2)  # fmt: skip
MODELS = {"recurrent": RECURRENT, "mla-indexer-recurrent": MLA_FULL, "sliding-window": SLIDING, "window-pool": SLIDING,
          "recurrent-layer": RECURRENT_LAYER}  # fmt: skip
WINDOW_POOLS = {"window-pool", "recurrent-layer"}


def sidecars_for(cfg, pool, ratio: float = 8.0) -> list:
    """The model's sidecar pools over ``pool``'s slots, each with its host pool (``ratio``: the KV host
    pool's, whose slots they share)."""
    out = []
    if cfg.indexer_dim:
        side = index_pool(cfg, pool.size, PAGE)
        out.append((side, HostKVPool(side, ratio=ratio, safety_margin_gb=0.0)))
    if cfg.recurrent_dim:
        side = state_pool(cfg, pool.size, PAGE)
        out.append((side, HostKVPool(side, ratio=ratio, safety_margin_gb=0.0)))
    return out


def hybrid_cache(cfg, pool, **kw):
    return make_cache(pool, threaded=False, sidecars=sidecars_for(cfg, pool), **kw)


def pool_and_cache_kw(name: str, model: TinyLM, slots: int, window_slots: int | None = None) -> tuple:
    """The model's device pool of ``slots`` slots and what its cache needs beside it (sidecars, or a
    window pool of ``window_slots``, default three quarters of the slots)."""
    cfg = model.cfg
    pool = model.pool(slots, PAGE, windowed=name in WINDOW_POOLS)
    kw = {"sidecars": sidecars_for(cfg, pool)}
    if name in WINDOW_POOLS:
        kw["window"] = cfg.window_pool(pool, window_slots or slots // 2 + slots // 4 // PAGE * PAGE)
    return pool, kw


@pytest.mark.parametrize("name", list(MODELS))
def test_hybrid_model_served_from_device_and_host_equals_recompute(name):
    model = TinyLM(MODELS[name])
    pool, kw = pool_and_cache_kw(name, model, 48)  # small: earlier turns are evicted to the host between turns
    with make_cache(pool, threaded=False, **kw) as cache:
        stats = serve_and_compare(Engine(model, pool, cache), model, clients=3, turns=3)
        cache.flush()
        cache.verify()
    assert sum(r.host_hit for r in stats) > 0, "nothing came back from the host"
    assert sum(r.device_hit for r in stats) > 0, "nothing was reused on the device"
    if name in WINDOW_POOLS:  # shorter prefixes whose windows are gone were cut, not used
        assert cache.metrics.window_cut_tokens > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_hybrid_model_served_from_a_second_instances_store_equals_recompute(tmp_path, name):
    """MLA + FP8 indexer + recurrent branch: a page's object carries its KV, its index rows and its
    checkpoint rows; a second instance resumes the recurrence from a stored checkpoint. GQA + recurrent
    branch: each head group's object carries the checkpoint rows (a head-grouped host layout). Sliding-
    window layers in the KV pool: their pages stored like full layers'; in a window pool: each head
    group's object carries its heads' window rows and the page's rows flag."""
    cfg = MODELS[name]
    model = TinyLM(cfg)
    kw = dict(storage=FileBackend(tmp_path), model_id="m",
              prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=PAGE))  # fmt: skip
    if not cfg.mla:
        kw["layout"] = "page_head"
    first_pool, first_kw = pool_and_cache_kw(name, model, 512)
    with make_cache(first_pool, threaded=False, **first_kw, **kw) as first:
        serve_and_compare(Engine(model, first_pool, first), model, clients=3, turns=3)
        first.flush()
        first.check_storage()
        first.flush()
    kw["storage"] = FileBackend(tmp_path)
    pool, pool_kw = pool_and_cache_kw(name, model, 48)
    with make_cache(pool, threaded=False, **pool_kw, **kw) as cache:
        stats = serve_and_compare(Engine(model, pool, cache), model, clients=3, turns=3)
        cache.flush()
        cache.verify()
        assert cache.metrics.storage_hit_tokens > 0 and sum(r.host_hit for r in stats) > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_hybrid_continuous_batching_equals_recompute(monkeypatch, name):
    """Prefills beside other requests' decode steps: each running request's recurrent state goes from
    one step to the next (a decode step starts mid-page, where no checkpoint exists), and the pages a
    request completes while decoding get their checkpoints then."""
    model = TinyLM(MODELS[name])
    clock = FakeClock(step_s=0.5)
    clock.attach(model, monkeypatch)
    pool, kw = pool_and_cache_kw(name, model, 64)
    reqs = staggered_requests()
    with make_cache(pool, threaded=False, **kw) as cache:
        results = Engine(model, pool, cache).serve(reqs, max_running=3, clock=clock, idle=clock.idle)
        cache.flush()
        cache.verify()
        assert sum(r.host_hit for r in results) > 0 and sum(r.device_hit for r in results) > 0
    check_against_recompute(model, reqs, results)
    assert any(1 in f and any(x > 1 for x in f) for f in clock.forwards), "no prefill beside a decode step"


def test_a_checkpoint_is_the_state_at_its_page_boundary():
    """The rows of each cached page hold the recurrent state after that page's last token: equal to the
    state a fresh forward over exactly that prefix ends with."""
    cfg = RECURRENT
    model = TinyLM(cfg)
    pool = cfg.pool(64, PAGE)
    tokens = [(7 * i + 3) % cfg.vocab for i in range(4 * PAGE + 2)]
    with hybrid_cache(cfg, pool) as cache:
        engine = Engine(model, pool, cache)
        engine.generate(tokens, 3)
        cached = cache.match_prefix(tokens).device_indices
        assert len(cached) == 4 * PAGE
        scratch = cfg.pool(64, PAGE)
        for end in range(PAGE, len(cached) + 1, PAGE):
            states = [None]
            model.forward_batch(scratch, [(tokens[:end], 0, torch.arange(end))], state=state_pool(cfg, 64, PAGE),
                                states=states)  # fmt: skip
            got = engine.state.kv[0][cached[end - PAGE : end]].reshape(-1)
            assert torch.equal(got, states[0]), end


def test_windowed_layers_read_only_their_window():
    """A windowed layer's K/V outside the last ``sliding_window`` positions is never read: poisoned (NaN)
    in the pool before a request resumes, the logits still equal recompute's; poisoning a full layer's
    rows, or a windowed layer's rows inside the window, changes them. And the window changes the model
    (another one than the all-full model's)."""
    cfg = SLIDING
    model = TinyLM(cfg)
    tokens = [(5 * i + 1) % cfg.vocab for i in range(6 * PAGE + 1)]
    want = Engine(model, cfg.pool(64, PAGE)).generate(tokens, 3)
    full = Engine(TinyLM(dataclasses.replace(cfg, sliding_window=0)), cfg.pool(64, PAGE)).generate(tokens, 3)
    assert not torch.equal(full.logits, want.logits)

    def resumed(poison) -> torch.Tensor:
        pool = cfg.pool(64, PAGE)
        with make_cache(pool, threaded=False) as cache:
            engine = Engine(model, pool, cache)
            engine.generate(tokens[:-1] + [0], 1)  # caches the first 6 pages
            slots = cache.match_prefix(tokens[:-1]).device_indices
            assert len(slots) == 6 * PAGE
            cache.flush()  # the backups read those rows: they land first (the poison is the test's, not a forward's)
            poison(pool, slots)
            return engine.generate(tokens, 3).logits

    outside = slice(0, len(tokens) - 1 - cfg.sliding_window)  # positions no query of this request sees

    def windowed_outside(pool, slots):
        for layer in (0, 1):
            pool.k[layer][slots[outside]] = float("nan")
            pool.v[layer][slots[outside]] = float("nan")

    assert torch.equal(resumed(windowed_outside), want.logits)

    def full_outside(pool, slots):
        pool.k[2][slots[outside]] = float("nan")

    def windowed_inside(pool, slots):
        pool.k[0][slots[-1:]] = float("nan")

    for poison in (full_outside, windowed_inside):
        assert not torch.equal(resumed(poison), want.logits), poison.__name__


def test_hybrid_refusals():
    """A recurrent model without its checkpoint pool in the cache, a page size that does not divide the
    state, a resume from mid-page without a state, a state list of the wrong length, a bad config: each
    a clear error naming what is wrong."""
    pool = RECURRENT.pool(64, PAGE)
    with make_cache(pool, threaded=False) as cache, pytest.raises(ValueError, match="checkpoint pool in the cache"):
        Engine(TinyLM(RECURRENT), pool, cache)
    with pytest.raises(ValueError, match="page_size: 3 does not divide recurrent_dim 16"):
        state_pool(RECURRENT, 60, 3)
    with pytest.raises(ValueError, match="no recurrent branch"):
        state_pool(CFG, 64, PAGE)
    model = TinyLM(RECURRENT)
    side = state_pool(RECURRENT, 64, PAGE)
    with pytest.raises(ValueError, match="state: this model has a recurrent branch"):
        model.forward_batch(pool, [([1, 2], 0, torch.arange(2))])
    with pytest.raises(ValueError, match="states: sequence 0 starts at 2, not a page boundary"):
        model.forward_batch(pool, [([1, 2], 2, torch.arange(4))], state=side)
    with pytest.raises(ValueError, match="states: expected one per sequence"):
        model.forward_batch(pool, [([1, 2], 0, torch.arange(2))], state=side, states=[None, None])
    for bad, what in ((dict(recurrent_dim=-1), "recurrent_dim"),
                      (dict(recurrent_dim=8, recurrent_layer=CFG.num_layers), "recurrent_layer"),
                      (dict(sliding_window=-1), "sliding_window"), (dict(full_every=0), "full_every"),
                      (dict(sliding_window=4, mla=True), "sliding_window"),
                      (dict(sliding_window=4, indexer_dim=8), "sliding_window"),
                      (dict(recurrent_only=True), "recurrent_only"),
                      (dict(recurrent_only=True, recurrent_dim=8, mla=True), "recurrent_only")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            dataclasses.replace(CFG, **bad)
    with pytest.raises(ValueError, match="no attention layer for the KV pool"):
        dataclasses.replace(CFG, num_layers=1, recurrent_dim=8, recurrent_only=True).pool(8, PAGE)
    with pytest.raises(ValueError, match="no windowed attention layer"):
        no_windowed = dataclasses.replace(CFG, num_layers=2, sliding_window=4, full_every=1)
        no_windowed.window_pool(no_windowed.pool(8, PAGE), 8)


@pytest.mark.parametrize("new_tokens", [1, 2, 3, 5])
def test_cached_sequences_keep_their_last_window(new_tokens):
    """With a window pool, every finished request's cached sequence can be resumed at its end: its last
    window's rows are kept (the engine's trims stop short of them, whatever the output length), also when
    part of that window lies in pages another request cached first (its copies' rows move there), and
    pages before the window keep none."""
    model = TinyLM(SLIDING)
    pool, kw = pool_and_cache_kw("window-pool", model, 64)
    system = [(3 * i + 2) % SLIDING.vocab for i in range(10)]
    # The first caches the system prompt's pages without rows (its window lies past them); the next two
    # recompute those pages (their matches are cut) and their last windows reach back into them.
    prompts = [system + [1] * 9, system + [7, 8], system + [9, 10, 11]]
    with make_cache(pool, threaded=False, **kw) as cache:
        engine = Engine(model, pool, cache)
        for prompt in prompts:
            out = engine.generate(prompt, new_tokens).tokens
            fed = len(prompt) + new_tokens - 1
            key_len = fed - fed % PAGE
            before = cache.metrics.window_cut_tokens
            m = cache.match_prefix((prompt + out)[:fed])
            assert len(m.device_indices) == key_len and cache.metrics.window_cut_tokens == before, prompt
            rows = engine.window.has_rows(m.device_indices)
            assert rows[(key_len - SLIDING.sliding_window + 1) // PAGE :].all()
        all_rows = engine.window.has_rows(torch.arange(pool.size))
        assert all_rows.sum() < pool.size // PAGE // 2  # most cached pages hold no window rows
