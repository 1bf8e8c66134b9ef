"""Sidecar pools (a sparse-attention indexer's per-token FP8 keys and scales, in rows of any byte size)
beside the KV: backups and load-backs move them with the KV in one acknowledged copy, byte for byte,
on every tier move, and a copy that fails for the sidecar fails for the page. Runs on both tree cores
and, in CI's seeded runs, under the deferred device model."""

from __future__ import annotations

import pytest
import torch

from hicache import CopyError, DeviceKVPool, HiRadixCache, HostKVPool
from hicache.streams import KVRegion

from cachedata import HEAD_DIM, HEAD_NUM, NUM_LAYERS, check_kv, host_reads, queued_device, slot_key, write_kv

pytestmark = pytest.mark.usefixtures("each_tree_core")

PAGE = 4
SIDE_ELEMS = 328  # 656-byte bf16 rows (sglang#31600's indexer rows)
TOKENS = [(13 * i + 7) % 800 for i in range(32)]


def make(layout: str = "page_first", io_backend: str = "direct", sidecar_layout: str = "page_first", *,
         mla: bool = False, side_elems: int = SIDE_ELEMS, with_sidecar: bool = True, side_layers: int = NUM_LAYERS,
         **kw):  # fmt: skip
    dev = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS, head_num=1 if mla else HEAD_NUM, head_dim=HEAD_DIM,
                       dtype=torch.float32, device="cpu", page_size=PAGE, mla=mla)  # fmt: skip
    host = HostKVPool(dev, layout=layout, ratio=2.0, safety_margin_gb=0.0)
    side_dev = DeviceKVPool(num_slots=64, num_layers=side_layers, head_num=1, head_dim=side_elems,
                            dtype=torch.bfloat16, device="cpu", page_size=PAGE, mla=True)  # fmt: skip
    side_host = HostKVPool(side_dev, layout=sidecar_layout, ratio=2.0, safety_margin_gb=0.0)
    cache = HiRadixCache(dev, host, io_backend=io_backend, write_policy="write_through", threaded=False,
                         load_back_threshold=1, sidecars=[(side_dev, side_host)] if with_sidecar else [],
                         **kw)  # fmt: skip
    return cache, side_dev, side_host


def side_value(token: int, position: int, layer: int) -> torch.Tensor:
    """A sidecar row's bytes for (token, position, layer): random, distinct per key."""
    g = torch.Generator().manual_seed(slot_key(token, position) * 8 + layer)
    return torch.randint(0, 256, (2 * SIDE_ELEMS,), dtype=torch.uint8, generator=g).view(torch.bfloat16)


def write_side(cache, side_dev, tokens, slots, start=0) -> None:
    rows = [(int(s), pos, t) for pos, (t, s) in enumerate(zip(tokens, slots.tolist(), strict=True), start=start)]

    def write() -> None:
        for slot, pos, tok in rows:
            for layer in range(side_dev.num_layers):
                side_dev.device_k[layer][slot, 0] = side_value(tok, pos, layer)

    device = queued_device(cache)
    if device is None or not rows:
        write()
    else:
        device.launch(device.current_stream(), lambda _: write(), writes=[KVRegion(side_dev, slots)],
                      what="the test's forward writing the sidecar")  # fmt: skip


def check_side(cache, side_dev, tokens, slots) -> None:
    host_reads(cache)
    for pos, (tok, slot) in enumerate(zip(tokens, slots.tolist(), strict=True)):
        for layer in range(side_dev.num_layers):
            got = side_dev.device_k[layer][slot, 0].view(torch.uint8)
            assert torch.equal(got, side_value(tok, pos, layer).view(torch.uint8)), (pos, layer)


def prefill(cache, side_dev, tokens) -> torch.Tensor:
    m = cache.match_prefix(tokens)
    hit = len(m.device_indices)
    slots = cache.device_pool.alloc(len(tokens) - hit)
    write_kv(cache, tokens[hit:], slots, start=hit)
    write_side(cache, side_dev, tokens[hit:], slots, start=hit)
    full = torch.cat([m.device_indices, slots])
    assert cache.insert(tokens, full) == hit
    return full


@pytest.mark.parametrize(("layout", "sidecar_layout"), [("page_first", "page_first"), ("layer_first", "page_first"),
                                                        ("page_first_direct", "layer_first")])  # fmt: skip
@pytest.mark.parametrize("io_backend", ["direct", "triton"])
def test_sidecar_rows_travel_with_their_kv(layout, sidecar_layout, io_backend):
    cache, side_dev, side_host = make(layout, io_backend, sidecar_layout)
    with cache:
        prefill(cache, side_dev, TOKENS)
        cache.flush()  # write-through: KV and sidecar on the host
        cache.evict(cache.device_pool.size)
        load_back_and_check(cache, side_dev)


@pytest.mark.parametrize("layer_wise", [True, False])
def test_a_sidecar_of_fewer_layers_travels_with_its_kv(layer_wise):
    """A one-layer sidecar (a recurrent layer's state checkpoints) beside a multi-layer KV pool: backed up
    and loaded back with the KV, its one layer loaded with the KV's first (in place before any layer of
    the KV can be read), byte for byte."""
    cache, side_dev, _ = make(side_layers=1)
    with cache:
        cache.controller.layer_wise = layer_wise  # the cache builds its controller layer-wise
        assert side_dev.num_layers == 1 < cache.device_pool.num_layers
        prefill(cache, side_dev, TOKENS)
        cache.flush()
        cache.evict(cache.device_pool.size)
        load_back_and_check(cache, side_dev)


def load_back_and_check(cache, side_dev) -> None:
    """Poison the device sidecar, load TOKENS' host copy back, check every KV and sidecar byte."""
    for layer in range(side_dev.num_layers):  # only loaded rows may match
        side_dev.device_k[layer].view(torch.uint8).fill_(0xA5)
    m = cache.match_prefix(TOKENS)
    assert len(m.device_indices) == 0 and m.host_hit_length == len(TOKENS)
    assert cache.load_back(m.last_host_node) is not None
    cache.start_loading()
    cache.flush()
    slots = cache.match_prefix(TOKENS).device_indices
    check_kv(cache, TOKENS, slots)
    check_side(cache, side_dev, TOKENS, slots)
    cache.verify()


def test_a_failed_sidecar_copy_fails_the_page(monkeypatch):
    """The sidecar's backup raises: the whole backup is rolled back (the node is not on the host), so a
    later eviction deletes it instead of keeping a host copy without its sidecar rows."""
    cache, side_dev, _ = make()
    with cache:
        binding = cache.controller.pool_pairs[1][0]

        def broken(*a, **k):
            raise OSError("sidecar copy failed")

        monkeypatch.setattr(binding, "backup", broken)
        prefill(cache, side_dev, TOKENS[:8])
        with pytest.raises(CopyError):
            cache.flush()
        monkeypatch.undo()
        m = cache.match_prefix(TOKENS[:8])
        assert len(m.device_indices) == 8 and m.last_device_node.host_value is None
        cache.evict(cache.device_pool.size)
        m = cache.match_prefix(TOKENS[:8])
        assert len(m.device_indices) == 0 and m.host_hit_length == 0
        cache.verify()


def _stored(tmp_path, **kw):
    from hicache.storage import FileBackend
    from hicache.storage.tier import PrefetchPolicy

    kw.setdefault("mla", True)
    return dict(storage=FileBackend(tmp_path), model_id="m",
                prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=PAGE), **kw)  # fmt: skip


@pytest.mark.parametrize(("mla", "layout", "side_layers"), [(True, "page_first", NUM_LAYERS),
                         (False, "page_head", NUM_LAYERS), (False, "page_head", 1)])  # fmt: skip
def test_stored_pages_carry_their_sidecar_rows(tmp_path, mla, layout, side_layers):
    """Pages with an indexer sidecar (or a one-layer state sidecar) stored by one cache come back into a
    fresh cache with their sidecar rows, byte for byte: MLA pages (one object a page, the rows after the
    KV) and MHA pages (each head group's object carries the rows after its K/V); a cache without the
    sidecar, or with another (another row size, or the same bytes in another host layout, which would
    land in another order), reads none of them."""
    kw = dict(mla=mla, layout=layout, side_layers=side_layers)
    a, side_a, _ = make(**_stored(tmp_path, **kw))
    with a:
        prefill(a, side_a, TOKENS)
        a.flush()
        a.check_storage()
        a.flush()
    for other in ({"with_sidecar": False}, {"side_elems": SIDE_ELEMS + 2}, {"sidecar_layout": "layer_first"}):
        c, _, _ = make(**_stored(tmp_path, **kw, **other))
        with c:
            assert c.prefetch_from_storage("r", c.root, TOKENS) is True
            while not c.check_prefetch_progress("r"):
                pass
            assert c.match_prefix(TOKENS).host_hit_length == 0, other
    b, side_b, _ = make(**_stored(tmp_path, **kw))
    with b:
        assert b.prefetch_from_storage("r", b.root, TOKENS) is True
        while not b.check_prefetch_progress("r"):
            pass
        load_back_and_check(b, side_b)


def test_sidecars_must_match_the_kv_pools():
    cache, side_dev, side_host = make()
    cache.close()
    dev, host = cache.device_pool, cache.host_pool
    small = DeviceKVPool(num_slots=32, num_layers=NUM_LAYERS, head_num=1, head_dim=8, dtype=torch.bfloat16,
                         device="cpu", page_size=PAGE, mla=True)  # fmt: skip
    deep = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS + 1, head_num=1, head_dim=8, dtype=torch.bfloat16,
                        device="cpu", page_size=PAGE, mla=True)  # fmt: skip
    cases = [
        ([(deep, HostKVPool(deep, ratio=2.0, safety_margin_gb=0.0))], ValueError, r"sidecars\[0\]: num_layers"),
        ([(side_dev,)], TypeError, r"sidecars\[0\]"),
        ([(side_dev, host)], TypeError, r"sidecars\[0\]"),  # a host pool over another device pool
        ([(small, HostKVPool(small, ratio=4.0, safety_margin_gb=0.0))], ValueError, r"sidecars\[0\]: device slots 32"),
        ((side_dev, side_host), TypeError, r"sidecars\[0\]"),  # a pair, not a list of pairs
        ("x", TypeError, "sidecars: expected a list"),
    ]
    for sidecars, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            HiRadixCache(dev, host, io_backend="direct", threaded=False, sidecars=sidecars)
    with pytest.raises(ValueError, match="sidecars: a storage tier stores sidecar rows with MHA pages only where"):
        HiRadixCache(dev, host, io_backend="direct", threaded=False, sidecars=[(side_dev, side_host)],
                     storage="file", storage_config={"path": "/tmp/unused"}, model_id="m")  # fmt: skip
