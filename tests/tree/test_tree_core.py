"""The compiled tree core against the Python one (the reference): the same operations give the same
trees, results, errors and metrics, step by step.

The stress driver of ``test_cache_stress`` runs the same seeded operation sequence on a cache of
each core; after every step the whole tree (ids, parents, keys, device and host slots, locks, access
counters), the lost set and the counting metrics are recorded, and the two records must be equal.
Ids match because both cores number nodes in the same order (a split's upper node, then a new leaf).
"""

from __future__ import annotations

import array
import dataclasses
import random

import numpy as np
import pytest
import torch
from cachedriver import ALL_OPS, Driver, build

from hicache import DeviceKVPool, HiRadixCache, HostKVPool
from hicache.tree.core import CompiledNode, choose_core, compiled_core_status, token_source
from hicache.tree.nodes import page_key

COMPILED_OK, COMPILED_WHY = compiled_core_status()
needs_compiled = pytest.mark.skipif(not COMPILED_OK, reason=f"compiled tree core unavailable: {COMPILED_WHY}")


def snapshot(cache: HiRadixCache) -> tuple:
    rows = []
    for n in [cache.root, *cache.tree.nodes()]:
        p = n.parent
        rows.append(
            (
                n.id,
                None if p is None else p.id,
                tuple(n.key),
                None if n.value is None else n.value.tolist(),
                None if n.host_value is None else n.host_value.tolist(),
                n.lock_ref,
                n.hit_count,
                n.last_access_time,
                n.creation_time,
                n.priority,
            )
        )
    metrics = {
        k: v for k, v in dataclasses.asdict(cache.metrics).items() if isinstance(v, int) and not isinstance(v, bool)
    }
    return sorted(rows), sorted(cache.tree.lost), metrics, cache.device_pool.available_size()


@dataclasses.dataclass
class TracingDriver(Driver):
    trace: list = dataclasses.field(default_factory=list)

    def check(self) -> None:
        super().check()
        self.trace.append(snapshot(self.cache))


def run_traced(monkeypatch, core: str, config: dict, steps: int, seed: int, storage=None) -> TracingDriver:
    monkeypatch.setenv("HICACHE_TREE_CORE", core)

    def factory() -> HiRadixCache:
        return build(**config, **({} if storage is None else {"storage": storage}))

    d = TracingDriver(
        factory(), seed=seed, check_kv_every=8, max_pages=4 if config.get("page_size", 1) > 1 else 8, factory=factory
    )
    assert d.cache.tree_core == core
    d.run_random(steps, seed=seed + 1)
    d.drain(sample=3)
    d.cache.close()
    return d


CONFIGS = [
    dict(page_size=1, write_policy="write_through", eviction_policy="lru", device_slots=48, host_ratio=2.5),
    dict(page_size=4, write_policy="write_through_selective", eviction_policy="lfu", device_slots=64),
    dict(page_size=1, write_policy="write_back", eviction_policy="slru", device_slots=32, host_ratio=3.0),
    dict(page_size=4, write_policy="write_back", eviction_policy="priority", device_slots=48, host_ratio=1.25),
    dict(page_size=2, write_policy="write_through_selective", eviction_policy="fifo", device_slots=32),
]


@needs_compiled
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"ps{c['page_size']}-{c['write_policy']}")
def test_compiled_core_matches_python_step_by_step(monkeypatch, config):
    seed = 7 + config["page_size"] * 10 + len(config["write_policy"])
    ref = run_traced(monkeypatch, "python", config, 600, seed)
    got = run_traced(monkeypatch, "compiled", config, 600, seed)
    assert ref.counts == got.counts
    assert len(ref.trace) == len(got.trace)
    for step, (a, b) in enumerate(zip(ref.trace, got.trace, strict=True)):
        assert a == b, f"step {step}: the compiled core differs from the Python core"
    # The run reached the interesting states (so the comparison covered them).
    for key in ("load_back_done", "bad_insert_refused", "load_back_raced", "evict", "evict_host", "drain_loaded"):
        assert ref.counts[key] > 0, key
    assert set(ref.counts) >= set(ALL_OPS) - {"close"}


@needs_compiled
@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: f"ps{c['page_size']}-{c['write_policy']}")
def test_compiled_core_matches_python_with_storage(monkeypatch, tmp_path, config):
    """The same with a storage tier: prefetched pages become host-only nodes in both cores alike (each
    core's run has its own store, so the second run does not find the first one's pages)."""
    ref = run_traced(monkeypatch, "python", config, 600, 21, storage=tmp_path / "python")
    got = run_traced(monkeypatch, "compiled", config, 600, 21, storage=tmp_path / "compiled")
    assert ref.counts == got.counts and ref.counts["prefetch_done"] > 0
    for step, (a, b) in enumerate(zip(ref.trace, got.trace, strict=True)):
        assert a == b, f"step {step}: the compiled core differs from the Python core"
    assert ref.trace[-1][2]["storage_hit_tokens"] > 0 or ref.metric("storage_hit_tokens") > 0


@needs_compiled
@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"ps{c['page_size']}-{c['write_policy']}")
def test_compiled_core_matches_python_long(monkeypatch, config):
    ref = run_traced(monkeypatch, "python", config, 4000, 99)
    got = run_traced(monkeypatch, "compiled", config, 4000, 99)
    assert ref.trace == got.trace


# ---------------------------------------------------------------------------------------------------
# Choosing the core
# ---------------------------------------------------------------------------------------------------


def small_cache(**kw) -> HiRadixCache:
    dev = DeviceKVPool(num_slots=64, num_layers=1, head_num=1, head_dim=2, dtype=torch.float32, device="cpu")
    host = HostKVPool(dev, layout="page_first", ratio=2.0)
    return HiRadixCache(dev, host, io_backend="direct", threaded=False, **kw)


def test_choose_core(monkeypatch):
    monkeypatch.delenv("HICACHE_TREE_CORE", raising=False)
    assert choose_core("python") == ("python", "asked for (tree_core=python)")
    with pytest.raises(ValueError, match="tree_core: expected one of auto, compiled, python, got 'rust'"):
        choose_core("rust")
    monkeypatch.setenv("HICACHE_TREE_CORE", "fast")
    with pytest.raises(ValueError, match="HICACHE_TREE_CORE: expected one of"):
        small_cache()
    monkeypatch.setenv("HICACHE_TREE_CORE", "python")
    c = small_cache()
    assert c.tree_core == "python" and "HICACHE_TREE_CORE=python" in c.tree_core_reason
    c.close()
    c = small_cache(tree_core="auto")  # the argument wins over the environment
    assert c.tree_core == ("compiled" if COMPILED_OK else "python")
    assert c.tree_core_reason
    c.close()


def test_compiled_core_unavailable_says_why(monkeypatch):
    import hicache.tree.core as tc

    monkeypatch.setattr(tc, "compiled_core_status", lambda: (False, "hicache._core is not built: test"))
    with pytest.raises(RuntimeError, match="tree_core: the compiled tree core cannot be used: hicache._core is not"):
        small_cache(tree_core="compiled")
    c = small_cache(tree_core="auto")
    assert c.tree_core == "python"
    assert c.tree_core_reason == "the compiled core cannot be used: hicache._core is not built: test"
    c.match_prefix([1, 2, 3])
    c.close()


# ---------------------------------------------------------------------------------------------------
# Tokens: the same conversions and refusals in both cores
# ---------------------------------------------------------------------------------------------------

CORES = ["python", pytest.param("compiled", marks=needs_compiled)]


@pytest.mark.parametrize("core", CORES)
def test_token_forms_agree(core):
    c = small_cache(tree_core=core)
    big = [2**40, -5, 0, 2**63 - 1, -(2**63), 7]
    slots = c.device_pool.alloc(len(big))
    assert c.insert(big, slots) == 0
    for form in (big, tuple(big), np.array(big, dtype=np.int64), torch.tensor(big), [np.int64(t) for t in big]):
        m = c.match_prefix(form)
        assert torch.equal(m.device_indices, slots), type(form)
    small = [3, 4, 5]
    for form in (np.array(small, np.int32), np.array(small, np.uint16), torch.tensor(small, dtype=torch.int16)):
        assert len(c.match_prefix(form).device_indices) == 0
    assert c.insert(np.array(small, dtype=np.int32), c.device_pool.alloc(3)) == 0
    assert len(c.match_prefix(range(3, 6)).device_indices) == 3
    c.verify()
    c.close()


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize(
    "tokens, error, match",
    [
        ([2.5, 1, 3], TypeError, "tokens: expected integer token ids"),
        ([1, 2, 3.0], TypeError, "tokens: expected integer token ids"),
        (torch.tensor([1.0, 2.0]), TypeError, "tokens: expected integer token ids|tokens: expected a 1-D integer"),
        (np.array([1.0, 2.0]), TypeError, "tokens: expected a 1-D integer"),
        (np.array([[1, 2]]), TypeError, "tokens: expected a 1-D integer"),
        (["a", "b"], TypeError, "tokens: expected integer token ids"),
    ],
)
def test_bad_tokens_refused(core, tokens, error, match):
    c = small_cache(tree_core=core)
    before = snapshot(c)
    with pytest.raises(error, match=match):
        c.match_prefix(tokens)
    with pytest.raises(error, match=match):
        c.insert(tokens, torch.arange(len(tokens), dtype=torch.int64))
    assert snapshot(c)[:2] == before[:2]
    c.close()


@needs_compiled
def test_token_too_large_for_int64():
    c = small_cache(tree_core="compiled")
    # The compiled core converts every token; the Python core checks only the first and last ones
    # (a float inside is kept as a token no int equals: a miss, never a wrong hit).
    with pytest.raises(TypeError, match="tokens: expected integer token ids, got float at position 1"):
        c.match_prefix([1, 2.5, 3])
    with pytest.raises(ValueError, match="tokens: token id at position 1 does not fit in int64"):
        c.match_prefix([1, 2**64])
    c.close()


def test_token_source_and_page_key_agree():
    r = random.Random(3)
    for _ in range(50):
        toks = [r.randrange(-(2**40), 2**40) for _ in range(r.randrange(0, 40))]
        for ps in (1, 4):
            key = page_key(toks, ps)
            assert list(key) == toks[: len(toks) - len(toks) % ps]
            assert list(token_source(torch.tensor(toks, dtype=torch.int64))) == toks
            assert list(token_source(array.array("q", toks))) == toks  # read in place: no int objects


# ---------------------------------------------------------------------------------------------------
# Handles
# ---------------------------------------------------------------------------------------------------


@needs_compiled
def test_handles_are_canonical_and_removed_nodes_read_as_detached():
    c = small_cache(tree_core="compiled", write_policy="write_back")
    a = c.device_pool.alloc(6)
    c.insert([1, 2, 3, 4, 5, 6], a)
    c.insert([1, 2, 3, 9, 9], torch.cat([a[:3], c.device_pool.alloc(2)]))
    (upper,) = c.root.children.values()
    assert isinstance(upper, CompiledNode)
    assert upper is c.match_prefix([1, 2, 3]).last_device_node  # one handle per node
    assert upper.key == (1, 2, 3) and upper.num_tokens == 3 and upper.parent is c.root
    assert {k: n.key for k, n in upper.children.items()} == {(4,): (4, 5, 6), (9,): (9, 9)}
    leaf = upper.children[(9,)]
    assert torch.equal(leaf.value, c.match_prefix([1, 2, 3, 9, 9]).device_indices[3:])
    assert c.evict(5) == 5  # both leaves leave the device (written back first)...
    assert c.evict_host(5) == 5  # ...and the host: deleted
    assert leaf.parent is None and leaf.value is None and leaf.key == () and leaf.children == {}
    assert "removed" in repr(leaf)
    with pytest.raises(ValueError, match="node: .* is no longer in the tree"):
        c.load_back(leaf)
    c.verify()
    c.close()


@needs_compiled
def test_load_back_refuses_a_node_of_another_cache():
    c1, c2 = small_cache(tree_core="compiled"), small_cache(tree_core="compiled")
    c1.insert([1, 2], c1.device_pool.alloc(2))
    (node,) = c1.root.children.values()
    with pytest.raises(ValueError, match="no longer in the tree"):
        c2.load_back(node)
    py = small_cache(tree_core="python")
    with pytest.raises(ValueError, match="no longer in the tree"):
        py.load_back(node)
    for c in (c1, c2, py):
        c.close()


@needs_compiled
def test_insert_fast_check_falls_back_to_the_full_check():
    """The core's one-pass check refuses what is unusual; the full check then names the fault or lets
    a legitimate call through (the caller's own unowned slots where the tree already caches)."""
    c = small_cache(tree_core="compiled", write_policy="write_back")
    dev = c.device_pool
    a = dev.alloc(4)
    c.insert([1, 2, 3, 4], a)
    mine = dev.alloc(4)  # the caller's own slots for tokens the tree already caches: allowed
    assert c.insert([1, 2, 3, 4], mine) == 4
    dev.free(mine)
    with pytest.raises(ValueError, match="device_indices: slot\\(s\\) .* are not allocated"):
        c.insert([7, 8], torch.tensor([60, 61]))
    with pytest.raises(ValueError, match="device_indices: repeated slot"):
        s = dev.alloc(1)
        c.insert([7, 8], torch.cat([s, s]))
    with pytest.raises(ValueError, match="already hold the KV of other cached tokens"):
        c.insert([7, 8, 9], torch.cat([s, a[:2]]))
    c.verify(external_device=s)
    c.close()
