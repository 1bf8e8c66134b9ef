"""The model served over the cache: every request's tokens and logits equal a full recompute's, bit for
bit on CPU float32, whatever tier its prefix came from (device, host loaded layer by layer, storage),
for every host layout and the io-backends usable on CPU (Triton under its interpreter)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hicache import HiRadixCache, HostKVPool
from hicache.serving.engine import Engine, ModelConfig, TinyLM
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

    from hicache.controller.layer_counter import LayerDoneCounter

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
    # A prefill after a cached prefix (its mask offset by the prefix) and a batch beside a decode step.
    pool = CFG.pool(256, PAGE)
    with make_cache(pool, threaded=False) as cache:
        engine = Engine(fast, pool, cache)
        first = engine.generate(list(range(10, 40)), 6)
        turn = list(range(10, 40)) + first.tokens + list(range(50, 61))
        got = engine.generate_batch([turn, list(range(70, 83))], 4)
        assert got[0].device_hit > 0
    for prompt, g in zip([turn, list(range(70, 83))], got, strict=True):
        want = Engine(exact, CFG.pool(256, PAGE)).generate(prompt, 4)
        assert g.tokens == want.tokens
        assert torch.allclose(g.logits, want.logits, atol=1e-4, rtol=1e-4)


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
            cache.flush()  # the last round's backups landed: their nodes are evictable, all three fit
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


# ---------------------------------------------------------------------- the serving loop (Engine.serve)
class FakeClock:
    """The loop's clock: moves only when the loop idles or a forward runs (``step_s`` each)."""

    def __init__(self, step_s: float = 1.0) -> None:
        self.t = 0.0
        self.step_s = step_s
        self.forwards: list[list[int]] = []  # each forward's sequence lengths (new tokens per sequence)

    def __call__(self) -> float:
        return self.t

    def idle(self, s: float) -> None:
        assert s >= 0
        self.t += s

    def attach(self, model: TinyLM, monkeypatch) -> None:
        real = model.forward_batch

        def forward_batch(pool, seqs, *args, **kwargs):
            self.forwards.append([len(t) for t, _, _ in seqs])
            self.t += self.step_s
            return real(pool, seqs, *args, **kwargs)

        monkeypatch.setattr(model, "forward_batch", forward_batch)


def assert_nothing_held(cache, pool) -> None:
    """After an error: every copy landed, the tree is consistent, nothing is locked, and every device
    slot is free or in an evictable node (no request holds any)."""
    cache.flush()
    cache.verify()
    assert cache.protected_size() == 0
    assert pool.available_size() + cache.evictable_size() == pool.size


def check_against_recompute(model: TinyLM, reqs: list, results: list) -> None:
    ref = Engine(model, model.cfg.pool(1024, PAGE))
    by_rid = {r.rid: r for r in results}
    assert sorted(by_rid) == sorted(q.rid for q in reqs)
    for q in reqs:
        want, got = ref.generate(q.prompt, q.max_new_tokens), by_rid[q.rid]
        assert got.tokens == want.tokens, q.rid
        assert torch.equal(got.logits, want.logits), q.rid


def staggered_requests(seed: int = 1, n: int = 16, clients: int = 4):
    """Conversations (a shared system prefix; each turn extends the client's previous prompt) of
    different output lengths, the clients taking turns, arriving over time."""
    from hicache.serving.engine import Request

    r = random.Random(seed)
    system = [r.randrange(CFG.vocab) for _ in range(10)]
    prompts: list[list[int]] = []
    for i in range(n):
        base = list(prompts[i - clients]) if i >= clients else list(system)
        prompts.append(base + [r.randrange(CFG.vocab) for _ in range(r.randint(2, 9))])
    return [Request(p, r.randint(1, 6), arrival=0.7 * i, rid=i) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("cached", [False, True])
def test_serve_continuous_batching_equals_recompute(monkeypatch, cached):
    """Requests arriving over time with different output lengths: new prefills share forwards with the
    decode steps of running requests, requests leave when done and wait when the pool or the batch is
    full. Every result equals its recompute, bit for bit, and nothing leaks."""
    model = TinyLM(CFG)
    clock = FakeClock(step_s=0.5)
    clock.attach(model, monkeypatch)
    pool = CFG.pool(64, PAGE)  # a few requests at a time: the rest wait for room, the tree evicts to the host
    reqs = staggered_requests()
    if cached:
        with make_cache(pool, threaded=False) as cache:
            results = Engine(model, pool, cache).serve(reqs, max_running=3, clock=clock, idle=clock.idle)
            cache.flush()
            cache.verify()
            assert cache.metrics.load_backs > 0 and sum(r.host_hit for r in results) > 0
            assert sum(r.device_hit for r in results) > 0
    else:
        results = Engine(model, pool).serve(reqs, max_running=3, clock=clock, idle=clock.idle)
        assert pool.available_size() == pool.size
    check_against_recompute(model, reqs, results)
    assert max(len(f) for f in clock.forwards) == 3  # max_running
    mixed = [f for f in clock.forwards if 1 in f and any(x > 1 for x in f)]
    assert mixed, "no forward ran a prefill beside a running request's decode step"
    ends = [r.arrival_s + r.total_s for r in results]
    assert ends == sorted(ends)  # finishing order
    assert any(r.queued_s > 0 for r in results)  # some waited for room or for the batch
    for r, q in zip(sorted(results, key=lambda r: r.rid), reqs, strict=True):
        assert r.arrival_s == q.arrival and 0 <= r.queued_s < r.ttft_s <= r.total_s
        assert r.device_hit + r.host_hit + r.computed == len(q.prompt)


def test_serve_times_on_a_fake_clock(monkeypatch):
    """Times from arrival: waiting for the batch counts in ``queued_s`` and ``ttft_s``; an idle loop
    sleeps until the next arrival."""
    from hicache.serving.engine import Request

    model = TinyLM(CFG)
    clock = FakeClock(step_s=1.0)
    clock.attach(model, monkeypatch)
    reqs = [Request([1, 2, 3], 3, 0.0, "a"), Request([4, 5], 2, 0.5, "b"), Request([6, 7, 8, 9], 1, 10.0, "c")]
    engine = Engine(model, CFG.pool(64, PAGE))
    out = {r.rid: r for r in engine.serve(reqs, max_running=1, clock=clock, idle=clock.idle)}
    # a: steps [0,1] [1,2] [2,3]. b waits for a (admitted at 3), steps [3,4] [4,5]. Idle until c at 10.
    assert (out["a"].queued_s, out["a"].ttft_s, out["a"].total_s) == (0.0, 1.0, 3.0)
    assert (out["b"].queued_s, out["b"].ttft_s, out["b"].total_s) == (2.5, 3.5, 4.5)
    assert (out["c"].queued_s, out["c"].ttft_s, out["c"].total_s) == (0.0, 1.0, 1.0)
    assert clock.forwards == [[3], [1], [1], [2], [1], [4]]


def test_serve_prefill_budget(monkeypatch):
    """``max_prefill_tokens`` bounds the prompt tokens prefilled in one step; a larger prompt still goes
    in, alone."""
    from hicache.serving.engine import Request

    model = TinyLM(CFG)
    clock = FakeClock()
    clock.attach(model, monkeypatch)
    reqs = [Request(list(range(i, i + 8)), 2, 0.0, i) for i in range(3)] + [Request(list(range(30)), 2, 0.0, 9)]
    results = Engine(model, CFG.pool(256, PAGE)).serve(
        reqs, max_running=4, max_prefill_tokens=12, clock=clock, idle=clock.idle
    )
    prefills = [[x for x in f if x > 1] for f in clock.forwards]
    assert [p for p in prefills if p] == [[8], [8], [8], [30]]
    check_against_recompute(model, reqs, results)


def test_serve_waits_for_room_and_refuses_what_never_fits(monkeypatch):
    """A pool that holds one request at a time serves them one after another; a request larger than the
    whole pool raises MemoryError naming it, with every slot and lock given back."""
    from hicache.serving.engine import Request

    model = TinyLM(CFG)
    clock = FakeClock()
    clock.attach(model, monkeypatch)
    pool = CFG.pool(24, PAGE)
    with make_cache(pool, threaded=False) as cache:
        engine = Engine(model, pool, cache)
        reqs = [Request(list(range(3 * i, 3 * i + 14)), 3, 0.0, i) for i in range(3)]
        results = engine.serve(reqs, max_running=3, clock=clock, idle=clock.idle)
        check_against_recompute(model, reqs, results)
        assert max(len(f) for f in clock.forwards) == 1  # never two at once: no room
        big = Request(list(range(40)), 2, 0.0, "big")
        with pytest.raises(MemoryError, match="request 'big' needs 41 slots"):
            engine.serve([Request([1, 2, 3], 4, 0.0, "small"), big], max_running=2, clock=clock, idle=clock.idle)
        assert_nothing_held(cache, pool)


def test_serve_gives_back_everything_when_a_forward_fails(monkeypatch):
    """A forward that raises mid-run: the error reaches the caller, the running and new requests' slots
    and locks are given back, and the engine serves correctly afterwards."""
    model = TinyLM(CFG)
    pool = CFG.pool(128, PAGE)
    real = model.forward_batch
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("injected forward failure")
        return real(*args, **kwargs)

    reqs = staggered_requests(seed=3, n=6)
    with make_cache(pool, threaded=False) as cache:
        engine = Engine(model, pool, cache)
        monkeypatch.setattr(model, "forward_batch", flaky)
        with pytest.raises(RuntimeError, match="injected forward failure"):
            engine.serve([dataclasses.replace(q, arrival=0.0) for q in reqs], max_running=3)
        assert_nothing_held(cache, pool)
        monkeypatch.setattr(model, "forward_batch", real)
        results = engine.serve([dataclasses.replace(q, arrival=0.0) for q in reqs], max_running=3)
        check_against_recompute(model, reqs, results)


def test_serve_refusals():
    from hicache.serving.engine import Request

    engine = Engine(TinyLM(CFG), CFG.pool(64, PAGE))
    for bad in (0, True, "2", 1.5):
        with pytest.raises(ValueError, match="max_running: expected an int >= 1"):
            engine.serve([], max_running=bad)
    with pytest.raises(ValueError, match="max_prefill_tokens: expected None or an int >= 1"):
        engine.serve([], max_prefill_tokens=0)
    with pytest.raises(ValueError, match="prompt: expected at least one token"):
        Request([], 2)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="max_new_tokens: expected an int >= 1"):
            Request([1], bad)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="arrival: expected seconds >= 0"):
            Request([1], 1, bad)
    assert engine.serve([]) == []


def test_serve_lets_requests_pass_a_slow_prefetch(tmp_path):
    """A request whose pages come from the store waits for its prefetch without holding up the loop:
    a later request that needs nothing from the store is served meanwhile (the store's read is held
    until that one has finished), then the first is served from the store, equal to its recompute."""
    import threading

    from hicache.serving.engine import Request

    model = TinyLM(CFG)
    policy = PrefetchPolicy("wait_complete", threshold_tokens=PAGE)
    r = random.Random(7)
    stored = [r.randrange(CFG.vocab) for _ in range(40)]
    pool = CFG.pool(200, PAGE)
    with make_cache(pool, storage=FileBackend(tmp_path), model_id="tiny", prefetch_policy=policy) as first:
        Engine(model, pool, first).generate(stored, 3)
        first.flush()
    other_done = threading.Event()
    reads = []

    class SlowStore(FileBackend):
        def batch_get_into(self, keys, host_slots):
            reads.append(len(keys))
            assert other_done.wait(30), "the loop waited for the prefetch instead of serving the other request"
            return super().batch_get_into(keys, host_slots)

    class Source:  # two requests at once; tells the store when the second is done
        def __init__(self):
            self.reqs = [Request(stored + [1, 2, 3], 3, 0.0, "from store"),
                         Request([r.randrange(CFG.vocab) for _ in range(9)], 3, 0.0, "fresh")]  # fmt: skip

        def poll(self, now):
            out, self.reqs = self.reqs, []
            return out

        def next_arrival(self):
            return None

        def exhausted(self):
            return not self.reqs

        def finished(self, result):
            if result.rid == "fresh":
                other_done.set()

    source = Source()
    asked = list(source.reqs)
    pool = CFG.pool(200, PAGE)
    with make_cache(pool, storage=SlowStore(tmp_path), model_id="tiny", prefetch_policy=policy) as second:
        results = Engine(model, pool, second).serve(source, max_running=2)
        assert [x.rid for x in results] == ["fresh", "from store"]
        assert reads and results[1].host_hit >= 40 - 40 % PAGE and second.metrics.storage_hit_tokens > 0
        second.flush()
        second.verify()
    check_against_recompute(model, asked, results)


def test_serve_waits_for_prefetches_before_calling_the_pool_too_small(tmp_path):
    """Nothing runs and the head request does not fit because a prefetch in flight locks the device
    copy eviction would take: the loop waits for the prefetch (then serves both) instead of raising
    MemoryError."""
    import threading
    import time

    from hicache.serving.engine import Request

    model = TinyLM(CFG)
    policy = PrefetchPolicy("wait_complete", threshold_tokens=PAGE)
    r = random.Random(9)
    x = [r.randrange(CFG.vocab) for _ in range(24)]
    y = [r.randrange(CFG.vocab) for _ in range(16)]
    pool = CFG.pool(200, PAGE)
    with make_cache(pool, storage=FileBackend(tmp_path), model_id="tiny", prefetch_policy=policy) as first:
        Engine(model, pool, first).generate(x + y + [5], 1)  # x and y go to the store
        first.flush()
    gate = threading.Event()

    class GatedStore(FileBackend):
        def batch_get_into(self, keys, host_slots):
            assert gate.wait(30)
            return super().batch_get_into(keys, host_slots)

    def idle(s):  # the loop waits: now the store may answer
        gate.set()
        time.sleep(s)

    pool = CFG.pool(48, PAGE)
    with make_cache(pool, storage=GatedStore(tmp_path), model_id="tiny", prefetch_policy=policy) as second:
        engine = Engine(model, pool, second)
        gate.set()
        engine.generate(x + [7], 1)  # x on the device (and host) now, unlocked: 24 of 48 slots
        second.flush()
        gate.clear()
        reqs = [Request(x + y + [1, 2, 3], 2, 0.0, "prefetch"), Request([r.randrange(CFG.vocab) for _ in range(31)],
                                                                       2, 0.0, "fresh")]  # fmt: skip
        results = engine.serve(reqs, max_running=2, idle=idle)
        assert sorted(res.rid for res in results) == ["fresh", "prefetch"]
        assert {res.rid: res for res in results}["prefetch"].host_hit >= 16
        second.flush()
        second.verify()
    check_against_recompute(model, reqs, results)


def test_serve_gives_back_the_locks_of_a_request_whose_admission_raised(monkeypatch):
    """A load-back (or eviction) that raises while a request is being admitted: the error reaches the
    caller and the locks that request had taken are released (nothing stays protected)."""
    model = TinyLM(CFG)
    pool = CFG.pool(64, PAGE)
    reqs = staggered_requests(seed=2, n=12)
    with make_cache(pool, threaded=False) as cache:
        engine = Engine(model, pool, cache)

        def load_back(node, mem_quota=None, **kw):
            raise RuntimeError("injected load-back failure")

        monkeypatch.setattr(cache, "load_back", load_back)
        with pytest.raises(RuntimeError, match="injected load-back failure"):
            engine.serve([dataclasses.replace(q, arrival=0.0) for q in reqs], max_running=3)
        assert_nothing_held(cache, pool)


def test_serve_gives_back_the_requests_admitted_before_one_whose_admission_raised(monkeypatch):
    """The second admission of a step raises: the first request, already admitted in that step (slots
    allocated, prefix locked), gives back what it holds too. Before, it was in neither the running batch
    nor the unwound one, and its slots and locks leaked."""
    model = TinyLM(CFG)
    pool = CFG.pool(128, PAGE)
    reqs = staggered_requests(seed=2, n=6)
    with make_cache(pool, threaded=False) as cache:
        engine = Engine(model, pool, cache)
        engine.serve([dataclasses.replace(q, arrival=0.0) for q in reqs], max_running=3)  # cached prefixes
        real = Engine._admit
        calls = [0]

        def admit(self, req, budget):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected admission failure")
            return real(self, req, budget)

        monkeypatch.setattr(Engine, "_admit", admit)
        with pytest.raises(RuntimeError, match="injected admission failure"):
            engine.serve([dataclasses.replace(q, arrival=0.0) for q in reqs], max_running=3)
        assert_nothing_held(cache, pool)


@pytest.mark.parametrize("mode", ["hierarchical", "storage"])
def test_tenants_sharing_a_system_prompt_never_hit_each_others_pages(tmp_path, mode):
    """The multitenant workload (hicache.serving.workloads.multitenant): four tenants' clients send the
    same system prompt, each request with its tenant's cache salt, one request at a time. A tenant's
    first request hits nothing although other tenants cached that prompt before it (on the device, the
    host, and with a storage tier a second instance's store); later requests hit their own tenant's
    pages; every answer equals recompute's, bit for bit."""
    import argparse

    from hicache.serving.workloads import Clients, multitenant

    args = argparse.Namespace(clients=8, rounds=2, system_len=16, turn_len=6, output_len=3, rate=0.0,
                              vocab=CFG.vocab, tenants=4)  # fmt: skip
    turns, prompt_of = multitenant(args, random.Random(3))
    model = TinyLM(CFG)
    pool = CFG.pool(96, PAGE)
    kw = {}
    unseen = set(range(4))  # tenants whose first request may hit nothing at all
    if mode == "storage":  # a first instance stores tenants 0 and 1's pages; the served one starts empty
        kw = dict(storage=FileBackend(tmp_path), model_id="m",
                  prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=PAGE))  # fmt: skip
        first_pool = CFG.pool(512, PAGE)
        stored = [t for t in turns if t.tenant in (0, 1)]
        with make_cache(first_pool, threaded=False, **kw) as first:
            Engine(model, first_pool, first).serve(Clients(stored, prompt_of, 1), max_running=1)
            first.flush()
            first.check_storage()
            first.flush()
        kw["storage"] = FileBackend(tmp_path)
        unseen = {2, 3}
    with make_cache(pool, threaded=False, **kw) as cache:
        source = Clients(turns, prompt_of, 1)
        results = Engine(model, pool, cache).serve(source, max_running=1)
        cache.flush()
        cache.verify()
        assert len(cache.namespaces) == 4
    tenant = {(t.client, t.round): t.tenant for t in turns}
    seen: set[int] = set()
    hits = {t: 0 for t in range(4)}
    for r in sorted(results, key=lambda r: r.arrival_s):
        t = tenant[r.rid]
        got = r.device_hit + r.host_hit
        if t not in seen and t in unseen:
            assert got == 0, f"tenant {t}'s first request hit {got} tokens another tenant cached"
        if t not in seen and t not in unseen:
            assert r.host_hit > 0, f"tenant {t}'s first request found none of its stored pages"
        seen.add(t)
        hits[t] += got
    assert all(h > 0 for h in hits.values()), hits  # each tenant reuses its own pages
    prompts = {(t.client, t.round): prompt_of(t, source.answers) for t in turns}
    from hicache.serving.engine import Request

    reqs = [Request(prompts[k], 3, rid=k) for k in prompts]
    check_against_recompute(model, reqs, results)


@pytest.mark.parametrize(("tier", "fp8"), [("host", True), ("host", False), ("storage", True)])
def test_indexer_model_served_equals_recompute(tmp_path, tier, fp8):
    """An MLA model with a DeepSeek V3.2-style indexer (index keys in a sidecar pool, FP8 with a scale
    per token or unquantized; each query attends to its top-4 earlier tokens by index score): its
    prefixes come back from the host, or from a second instance's store, with their index keys, and
    every token and logit equals recompute's, bit for bit. A prefix loaded without its index keys would
    pick other tokens."""
    from hicache.serving.model import index_pool

    cfg = dataclasses.replace(CFG, mla=True, indexer_dim=12, index_topk=4, indexer_fp8=fp8)
    assert index_pool(cfg, 8, PAGE).dtype == (torch.uint8 if fp8 else cfg.dtype)
    model = TinyLM(cfg)

    def cache_over(pool, **kw):
        side = index_pool(cfg, pool.size, PAGE)
        sidecars = [(side, HostKVPool(side, ratio=8.0, safety_margin_gb=0.0))]
        return make_cache(pool, threaded=False, sidecars=sidecars, **kw)

    kw = {}
    if tier == "storage":
        kw = dict(storage=FileBackend(tmp_path), model_id="m",
                  prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=PAGE))  # fmt: skip
        first_pool = cfg.pool(512, PAGE)
        with cache_over(first_pool, **kw) as first:
            serve_and_compare(Engine(model, first_pool, first), model, clients=3, turns=3)
            first.flush()
            first.check_storage()
            first.flush()
        kw["storage"] = FileBackend(tmp_path)
    pool = cfg.pool(48, PAGE)  # small: earlier turns are evicted to the host between turns
    with cache_over(pool, **kw) as cache:
        stats = serve_and_compare(Engine(model, pool, cache), model, clients=3, turns=3)
        cache.flush()
        cache.verify()
        assert sum(r.host_hit for r in stats) > 0, "nothing came back from the host"
        if tier == "storage":
            assert cache.metrics.storage_hit_tokens > 0


def test_fp8_index_keys_pack_and_unpack():
    """The FP8 index rows: ``D`` e4m3 bytes then the row's float32 scale (``amax / 448``); unpacking gives
    the e4m3 values times the scale, within e4m3's precision of the keys; packing is deterministic (a key
    recomputed later packs to the same bytes, which bit-exact serving needs)."""
    from hicache.serving.model import dequantize_index_keys, quantize_index_keys

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(9, 12, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    rows = quantize_index_keys(keys)
    assert rows.dtype == torch.uint8 and rows.shape == (9, 16)
    scale = rows[:, 12:].contiguous().view(torch.float32)
    assert torch.equal(scale, keys.abs().amax(-1, keepdim=True) / 448.0)
    fp8 = rows[:, :12].contiguous().view(torch.float8_e4m3fn)
    assert torch.equal(fp8, (keys / scale).to(torch.float8_e4m3fn))
    back = dequantize_index_keys(rows)
    assert torch.equal(back, fp8.float() * scale)
    assert ((back - keys).abs() <= keys.abs() * 2**-4 + scale * 2**-9).all()  # e4m3: 3 mantissa bits
    assert torch.equal(quantize_index_keys(keys.clone()), rows)


def test_engine_refuses_an_index_pool_of_the_wrong_kind():
    """An FP8 indexer model over a cache whose sidecar holds unquantized keys (or the other way round):
    ValueError naming the cache, before anything is served."""
    from hicache.serving.model import index_pool

    for fp8 in (True, False):
        cfg = dataclasses.replace(CFG, mla=True, indexer_dim=12, index_topk=4, indexer_fp8=fp8)
        other = dataclasses.replace(cfg, indexer_fp8=not fp8)
        pool = cfg.pool(64, PAGE)
        side = index_pool(other, pool.size, PAGE)
        cache = make_cache(pool, threaded=False, sidecars=[(side, HostKVPool(side, ratio=8.0, safety_margin_gb=0.0))])
        with cache, pytest.raises(ValueError, match="cache: the model's indexer needs a sidecar pool"):
            Engine(TinyLM(cfg), pool, cache)
