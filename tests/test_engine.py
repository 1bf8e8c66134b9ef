"""The model served over the cache: every request's tokens and logits equal a full recompute's, bit for
bit on CPU float32, whatever tier its prefix came from (device, host loaded layer by layer, storage),
for every host layout and the io-backends usable on CPU (Triton under its interpreter)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hicache import HiRadixCache, HostKVPool
from hicache.engine import Engine, ModelConfig, TinyLM
from hicache.storage import FileBackend
from hicache.storage.tier import PrefetchPolicy

from cachedata import wrap_copies

CFG = ModelConfig(num_layers=3, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn=64, vocab=97)
PAGE = 4


def conversations(seed: int = 0, clients: int = 4, turns: int = 4):
    """Multi-turn prompts: a shared system prompt, then each client's questions and the answers the
    model gave (fed back by the caller)."""
    r = random.Random(seed)
    system = [r.randrange(CFG.vocab) for _ in range(12)]
    history = [list(system) for _ in range(clients)]
    for _ in range(turns):
        for c in range(clients):
            history[c] += [r.randrange(CFG.vocab) for _ in range(r.randint(3, 9))]
            answer = yield c, list(history[c])
            history[c] += answer


def make_cache(pool, *, layout="page_first", io_backend="direct", write_policy="write_through", threaded=True,
               **kw) -> HiRadixCache:  # fmt: skip
    host = HostKVPool(pool, layout=layout, ratio=8.0, safety_margin_gb=0.0)
    return HiRadixCache(pool, host, io_backend=io_backend, write_policy=write_policy, threaded=threaded,
                        load_back_threshold=1, **kw)  # fmt: skip


def serve_and_compare(engine: Engine, model: TinyLM, new_tokens: int = 5, **conv) -> list:
    """Serve the conversations through ``engine`` and a recompute engine; every result equal."""
    ref = Engine(model, model.cfg.pool(512, PAGE))
    stats = []
    gen = conversations(**conv)
    msg = None
    while True:
        try:
            c, prompt = gen.send(msg)
        except StopIteration:
            break
        want = ref.generate(prompt, new_tokens)
        got = engine.generate(prompt, new_tokens)
        assert got.tokens == want.tokens
        assert torch.equal(got.logits, want.logits), (got.logits - want.logits).abs().max()
        stats.append(got)
        msg = got.tokens
    return stats


@pytest.mark.parametrize("io_backend", ["direct", "staged", "triton"])
@pytest.mark.parametrize(
    "layout,mla",
    [("page_first", False), ("layer_first", False), ("page_first_direct", False), ("page_head", False),
     ("page_first", True), ("layer_first", True), ("page_first_direct", True)],
)  # fmt: skip
def test_served_equals_recompute_every_layout(layout, mla, io_backend):
    cfg = dataclasses.replace(CFG, mla=mla, kv_lora=12)
    model = TinyLM(cfg)
    pool = cfg.pool(100, PAGE)  # about a third of the working set: the device tier evicts to the host
    with make_cache(pool, layout=layout, io_backend=io_backend) as cache:
        stats = serve_and_compare(Engine(model, pool, cache), model)
        assert sum(s.device_hit for s in stats) > 0 and sum(s.host_hit for s in stats) > 0
        assert cache.metrics.load_backs > 0 and cache.metrics.device_evicted_tokens > 0
        cache.flush()
        cache.verify()


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
def test_served_equals_recompute_every_write_policy(write_policy):
    model = TinyLM(CFG)
    pool = CFG.pool(100, PAGE)
    with make_cache(pool, write_policy=write_policy, threaded=False) as cache:
        stats = serve_and_compare(Engine(model, pool, cache), model, seed=1)
        assert sum(s.host_hit for s in stats) > 0
        cache.verify()


def test_a_delayed_layer_load_is_waited_for(monkeypatch):
    """Layer 1 of every load-back is issued only once the forward is already waiting for it: the forward
    must block on the layer counter and then read the right bytes (one that did not wait would read
    stale K/V, and its logits would differ from the recompute's). No timing: the order is forced."""
    import threading

    from hicache.layer_counter import LayerDoneCounter

    events: list[str] = []
    waiting = threading.Event()
    real_wait = LayerDoneCounter.wait_until

    def wait_until(self, layer, *args, **kwargs):
        if layer == 1:
            events.append("forward waits for layer 1")
            waiting.set()
        return real_wait(self, layer, *args, **kwargs)

    def around(issue, call):
        if call.layer_id == 1:
            assert waiting.wait(10), "the forward never waited for layer 1"
            waiting.clear()
            events.append("layer 1 issued")
        return issue()

    monkeypatch.setattr(LayerDoneCounter, "wait_until", wait_until)
    wrap_copies(monkeypatch, "load_layer", around)
    model = TinyLM(CFG)
    pool = CFG.pool(100, PAGE)
    with make_cache(pool) as cache:
        stats = serve_and_compare(Engine(model, pool, cache), model)
        loads = sum(1 for s in stats if s.host_hit)
        assert loads > 0
        assert events[: 2 * loads] == ["forward waits for layer 1", "layer 1 issued"] * loads
        cache.flush()
        cache.verify()


def test_storage_tier_serves_a_second_instance(tmp_path):
    """A first server's conversations are backed up to a store; a second, fresh server (its own tree
    and pools) gets their prefixes from the store, with the recompute's tokens and logits."""
    model = TinyLM(CFG)
    policy = PrefetchPolicy("wait_complete", threshold_tokens=PAGE)
    kw = dict(storage=FileBackend(tmp_path), model_id="tiny", prefetch_policy=policy)
    pool = CFG.pool(400, PAGE)
    with make_cache(pool, **kw) as first:
        serve_and_compare(Engine(model, pool, first), model, turns=2)
        first.flush()
        assert first.metrics.storage_pages_written > 0
    pool = CFG.pool(400, PAGE)
    kw["storage"] = FileBackend(tmp_path)
    with make_cache(pool, **kw) as second:
        engine = Engine(model, pool, second)
        ref = Engine(model, CFG.pool(512, PAGE))
        gen = conversations(turns=2)
        c, prompt = next(gen)  # the first client's first turn again: in the store, not in this tree
        got, want = engine.generate(prompt, 5), ref.generate(prompt, 5)
        assert got.tokens == want.tokens and torch.equal(got.logits, want.logits)
        assert got.host_hit > 0 and second.metrics.storage_hit_tokens > 0
        second.verify()


def test_recompute_engine_and_refusals():
    model = TinyLM(CFG)
    pool = CFG.pool(64, PAGE)
    engine = Engine(model, pool)
    r = engine.generate([1, 2, 3], 4)
    assert len(r.tokens) == 4 and r.logits.shape == (4, CFG.vocab) and r.computed == 3
    assert pool.available_size() == pool.size  # recompute keeps nothing
    with pytest.raises(ValueError, match="max_new_tokens: expected >= 1"):
        engine.generate([1], 0)
    with pytest.raises(ValueError, match="prompt: expected at least one token"):
        engine.generate([], 3)
    with pytest.raises(ValueError, match="pool: not shaped for this model"):
        Engine(model, ModelConfig(num_kv_heads=4).pool(64, PAGE))
    with pytest.raises(ValueError, match="pool: not shaped for this model"):
        Engine(model, dataclasses.replace(CFG, mla=True).pool(64, PAGE))
    mla = TinyLM(dataclasses.replace(CFG, mla=True, kv_lora=12))
    assert mla.cfg.pool(16, PAGE).mla and Engine(mla, mla.cfg.pool(64, PAGE)).generate([5, 6], 2).logits.shape == (
        2, CFG.vocab)  # fmt: skip
    with pytest.raises(ValueError, match="num_kv_heads: expected a divisor"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    other = CFG.pool(64, PAGE)
    with make_cache(other) as cache, pytest.raises(ValueError, match="cache: its device pool"):
        Engine(model, pool, cache)


def test_fast_path_agrees_with_the_exact_one():
    """``exact=False`` (matmuls, fused attention; for benchmarks) computes the same model: close to the
    exact path, the same greedy tokens here."""
    import dataclasses

    exact, fast = TinyLM(CFG), TinyLM(dataclasses.replace(CFG, exact=False))
    a = Engine(exact, CFG.pool(128, PAGE)).generate(list(range(10, 40)), 6)
    b = Engine(fast, CFG.pool(128, PAGE)).generate(list(range(10, 40)), 6)
    assert a.tokens == b.tokens
    assert torch.allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mla", [False, True])
def test_batches_equal_recompute(mla):
    """A round's requests served as one batch (one load-back batch, one prefill, a decode step each),
    the same prompt twice in a batch included: each equals its own recompute."""
    cfg = dataclasses.replace(CFG, mla=mla, kv_lora=12)
    model = TinyLM(cfg)
    ref = Engine(model, cfg.pool(512, PAGE))
    pool = cfg.pool(120, PAGE)  # the cold conversations leave the device between their rounds
    r = random.Random(4)
    system = [r.randrange(cfg.vocab) for _ in range(12)]
    history = [list(system) for _ in range(4)]
    with make_cache(pool, threaded=False) as cache:  # inline copies: which nodes get evicted is reproducible
        engine = Engine(model, pool, cache)
        loaded = 0
        for turn in range(6):
            pair = [turn % 4, (turn + 1) % 4]  # two conversations a round: the others go cold meanwhile
            for c in pair:
                history[c] += [r.randrange(cfg.vocab) for _ in range(r.randint(3, 9))]
            prompts = [list(history[c]) for c in pair] + [list(history[pair[0]])]  # the first one twice
            got = engine.generate_batch(prompts, 4)
            for p, g in zip(prompts, got, strict=True):
                want = ref.generate(p, 4)
                assert g.tokens == want.tokens and torch.equal(g.logits, want.logits)
                assert g.extra["batch"] == 3
            loaded += sum(g.host_hit for g in got)
            for c, g in zip(pair, got, strict=False):
                history[c] += g.tokens
        assert loaded > 0 and cache.metrics.load_backs > 0
        cache.flush()
        cache.verify()
    with pytest.raises(ValueError, match="prompt: expected at least one token"):
        engine.generate_batch([[1, 2], []], 2)
