"""The sliding-window layers' pool (hicache.pools.window_pool.WindowKVPool) and the cache around it: rows
only for the KV pages some window needs, freed with their KV pages, backed up and loaded back with them
(byte for byte, only the pages that have rows), and matches cut where a prefix's window is not whole.
Runs on both tree cores and, in CI's seeded runs, under the deferred device model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache import DeviceKVPool, HiRadixCache, HostKVPool
from hicache.pools.window_pool import WindowKVPool
from hicache.streams import KVRegion

from cachedata import HEAD_DIM, HEAD_NUM, NUM_LAYERS, check_kv, host_reads, queued_device, write_kv

pytestmark = pytest.mark.usefixtures("each_tree_core")

PAGE = 4
WINDOW = 6  # a resume reads the 5 tokens before it: the 2 pages before a page boundary
TOKENS = [(11 * i + 5) % 900 for i in range(32)]  # 8 pages


def make(window_slots: int = 32, layout: str = "page_first", window: int = WINDOW, **kw) -> tuple:
    dev = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS, head_num=HEAD_NUM, head_dim=HEAD_DIM,
                       dtype=torch.float32, device="cpu", page_size=PAGE)  # fmt: skip
    host = HostKVPool(dev, layout=layout, ratio=2.0, safety_margin_gb=0.0)
    pool = WindowKVPool(dev, num_slots=window_slots, num_layers=2, window=window)
    cache = HiRadixCache(dev, host, io_backend="direct", write_policy="write_through", threaded=False,
                         load_back_threshold=1, window=pool, **kw)  # fmt: skip
    return cache, pool


def row_value(token: int, position: int, layer: int) -> torch.Tensor:
    """A window row (K and V of one token and windowed layer): random, distinct per key."""
    g = torch.Generator().manual_seed((token * 1009 + position) * 8 + layer)
    return torch.randn(2, HEAD_NUM, HEAD_DIM, generator=g)


def write_rows(cache, window, tokens, slots, start=0) -> None:
    """What a forward would write into the window rows of ``slots`` (their pages have rows)."""
    at = window.slots(slots)

    def write() -> None:
        for i, w in enumerate(at.tolist()):
            for layer in range(window.pool.num_layers):
                kv = row_value(tokens[i], start + i, layer)
                window.pool.k[layer][w], window.pool.v[layer][w] = kv[0], kv[1]

    device = queued_device(cache)
    if device is None:
        write()
    else:
        device.launch(device.current_stream(), lambda _: write(), writes=[KVRegion(window.pool, at)],
                      what="the test's forward writing window rows")  # fmt: skip


def check_rows(cache, window, tokens, slots, start=0) -> None:
    host_reads(cache)
    at = window.slots(slots)
    for i, w in enumerate(at.tolist()):
        for layer in range(window.pool.num_layers):
            kv = row_value(tokens[i], start + i, layer)
            assert torch.equal(window.pool.k[layer][w], kv[0]), (start + i, layer)
            assert torch.equal(window.pool.v[layer][w], kv[1]), (start + i, layer)


def cache_sequence(cache, window, tokens, rows_from: int) -> torch.Tensor:
    """Compute ``tokens`` into fresh slots, with window rows from position ``rows_from`` on, and cache them."""
    slots = cache.device_pool.alloc(len(tokens))
    write_kv(cache, tokens, slots)
    assert window.alloc_for(slots[rows_from:])
    write_rows(cache, window, tokens[rows_from:], slots[rows_from:], start=rows_from)
    assert cache.insert(tokens, slots) == 0
    return slots


def test_pool_rows_follow_their_kv_pages():
    """Rows are given per KV page, freed with the KV page (the KV pool's free listener), trimmed on
    request, moved between pages without data; a page without rows has no window slots."""
    dev = DeviceKVPool(num_slots=32, num_layers=1, head_num=1, head_dim=4, dtype=torch.float32, device="cpu",
                       page_size=PAGE)  # fmt: skip
    window = WindowKVPool(dev, num_slots=8, num_layers=1, window=WINDOW)
    a = dev.alloc(12)
    assert window.alloc_for(a[4:]) and window.available_pages() == 0
    assert window.has_rows(a).tolist() == [False, True, True]
    assert not window.alloc_for(a[:4])  # full: nothing given
    assert window.has_rows(a).tolist() == [False, True, True]
    with pytest.raises(ValueError, match=f"kv_slots: slot {int(a[0])}'s page has no window rows"):
        window.slots(a[:4])
    w = window.slots(a[4:])
    assert len(set(w.tolist())) == 8 and all(int(x) % PAGE == i % PAGE for i, x in enumerate(w.tolist()))
    dev.free(a[8:])  # the KV page goes: its rows with it
    assert window.has_rows(a).tolist() == [False, True] + [False] and window.available_pages() == 1
    assert window.adopt(a[4:8], a[:4]) == 1  # rows move to a page without: no data moves
    assert window.has_rows(a[:8]).tolist() == [True, False]
    assert torch.equal(window.slots(a[:4]), w[:4])
    window.trim(a[:8])
    assert window.available_pages() == 2 and not window.has_rows(a[:8]).any()
    with pytest.raises(ValueError, match="kv_slots: expected whole KV pages"):
        window.alloc_for(a[1:3])


@pytest.mark.parametrize(
    ("present", "usable"),
    [([], 0), ([True] * 4, 16), ([False, False, True, True], 16), ([True, True, False, True], 8),
     ([True, False, True, True, False], 16), ([False] * 3, 0), ([False, True], 0)],
)  # fmt: skip
def test_usable_prefix_needs_the_window_before_it(present, usable):
    """A prefix is usable up to the longest page boundary whose window - 1 tokens before it (2 pages
    here) all have rows; 0 is always usable."""
    dev = DeviceKVPool(num_slots=8, num_layers=1, head_num=1, head_dim=4, dtype=torch.float32, device="cpu",
                       page_size=PAGE)  # fmt: skip
    window = WindowKVPool(dev, num_slots=8, num_layers=1, window=WINDOW)
    assert window.usable(np.array(present, dtype=bool)) == usable


def test_match_is_cut_where_the_window_is_gone():
    """A sequence cached with rows for its last pages only: a match of the whole sequence is usable; a
    match of a shorter prefix, whose window is gone, is cut back to where a window is whole (here: not
    at all), counted in window_cut_tokens; the tree keeps the nodes."""
    cache, window = make()
    with cache:
        cache_sequence(cache, window, TOKENS, rows_from=24)  # rows for pages 6 and 7 only
        assert len(cache.match_prefix(TOKENS).device_indices) == 32
        m = cache.match_prefix(TOKENS[:20] + [1, 2, 3, 4])
        assert len(m.device_indices) == 0 and m.host_hit_length == 0
        assert cache.metrics.window_cut_tokens == 20
        assert len(cache.match_prefix(TOKENS).device_indices) == 32  # still there, whole
        cache.verify()


def test_rows_are_backed_up_and_loaded_back_with_their_pages():
    """Write-through backs up the rows of the pages that have them (and flags the rest as without);
    evicted and loaded back, the pages with rows get rows again, byte for byte, and a match through the
    host copy is cut where the host copy's windows are not whole."""
    cache, window = make()
    with cache:
        cache_sequence(cache, window, TOKENS, rows_from=24)
        cache.flush()
        cache.evict(64)
        assert window.available_pages() == 8  # every row went with its KV page
        for layer in range(window.pool.num_layers):  # poison: only loaded rows may match
            window.pool.k[layer].fill_(float("nan"))
            window.pool.v[layer].fill_(float("nan"))
        m = cache.match_prefix(TOKENS)
        assert len(m.device_indices) == 0 and m.host_hit_length == 32
        assert cache.window_rows_to_load(m.last_host_node) == 8
        loaded = cache.load_back(m.last_host_node)
        assert loaded is not None and window.has_rows(loaded).tolist() == [False] * 6 + [True] * 2
        cache.start_loading()
        cache.flush()
        slots = cache.match_prefix(TOKENS).device_indices
        check_kv(cache, TOKENS, slots)
        check_rows(cache, window, TOKENS[24:], slots[24:], start=24)
        cache.flush()
        cache.evict(64)
        cut = cache.match_prefix(TOKENS[:16] + [7] * 4)  # its window's host copy has no rows
        assert len(cut.device_indices) == 0 and cut.host_hit_length == 0
        cache.verify()


def test_a_load_back_without_room_for_its_rows_does_not_go():
    """The window pool cannot hold the rows a load-back brings: the load-back does not go (its device
    slots go back), and nothing is half loaded."""
    cache, window = make(window_slots=8)
    with cache:
        cache_sequence(cache, window, TOKENS, rows_from=24)
        cache.flush()
        cache.evict(64)
        other = cache.device_pool.alloc(8)
        assert window.alloc_for(other)  # the rows are taken by someone else
        free = cache.device_pool.available_size()
        m = cache.match_prefix(TOKENS)
        assert cache.load_back(m.last_host_node) is None
        assert cache.device_pool.available_size() == free and window.available_pages() == 0
        cache.device_pool.free(other)
        cache.verify()


def test_window_refusals():
    dev = DeviceKVPool(num_slots=16, num_layers=1, head_num=1, head_dim=4, dtype=torch.float32, device="cpu",
                       page_size=PAGE, mla=True)  # fmt: skip
    with pytest.raises(ValueError, match="kv_pool: sliding-window layers are served with MHA/GQA pools"):
        WindowKVPool(dev, num_slots=8, num_layers=1, window=WINDOW)
    with pytest.raises(TypeError, match="kv_pool: expected a DeviceKVPool"):
        WindowKVPool("x", num_slots=8, num_layers=1, window=WINDOW)
    cache, window = make()
    cache.close()
    for bad in (0, -1, 1.5):
        with pytest.raises((ValueError, TypeError), match="window"):
            WindowKVPool(cache.device_pool, num_slots=8, num_layers=1, window=bad)
    with pytest.raises(ValueError, match="window: a storage tier stores window rows only where"):
        dev = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS, head_num=2, head_dim=HEAD_DIM, dtype=torch.float32,
                           device="cpu", page_size=PAGE)  # fmt: skip
        HiRadixCache(dev, HostKVPool(dev, layout="page_first", ratio=2.0, safety_margin_gb=0.0), io_backend="direct",
                     threaded=False, window=WindowKVPool(dev, num_slots=8, num_layers=1, window=WINDOW),
                     storage="file", storage_config={"path": "/tmp/unused"}, model_id="m")  # fmt: skip
    other = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS, head_num=HEAD_NUM, head_dim=HEAD_DIM,
                         dtype=torch.float32, device="cpu", page_size=PAGE)  # fmt: skip
    with pytest.raises(TypeError, match="window: expected a WindowKVPool over the device pool"):
        HiRadixCache(other, HostKVPool(other, ratio=2.0, safety_margin_gb=0.0), io_backend="direct",
                     threaded=False, window=window)  # fmt: skip
    with pytest.raises(ValueError, match="host_kv: this window pool has its host pool already"):
        window.attach_host(cache.host_pool)


def test_stored_pages_carry_their_window_rows(tmp_path):
    """A page stored with a window pool carries its window rows and the flag saying whether it has them
    (in each head group's object): a fresh cache prefetches the pages, loads them back with rows where
    the writer had rows, byte for byte, and cuts a match where the stored pages had none; a cache
    without a window pool, or with another window, reads none of those pages."""
    from hicache.storage import FileBackend
    from hicache.storage.tier import PrefetchPolicy

    def stored(**kw):
        return make(layout="page_head", storage=FileBackend(tmp_path), model_id="m",
                    prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=PAGE), **kw)  # fmt: skip

    a, wa = stored()
    with a:
        cache_sequence(a, wa, TOKENS, rows_from=24)
        a.flush()
        a.check_storage()
        a.flush()
    b, wb = stored()
    with b:
        assert b.prefetch_from_storage("r", b.root, TOKENS) is True
        while not b.check_prefetch_progress("r"):
            pass
        for layer in range(wb.pool.num_layers):  # poison: only loaded rows may match
            wb.pool.k[layer].fill_(float("nan"))
            wb.pool.v[layer].fill_(float("nan"))
        m = b.match_prefix(TOKENS)
        assert m.host_hit_length == 32 and b.window_rows_to_load(m.last_host_node) == 8
        assert b.load_back(m.last_host_node) is not None
        b.start_loading()
        b.flush()
        slots = b.match_prefix(TOKENS).device_indices
        check_kv(b, TOKENS, slots)
        assert wb.has_rows(slots).tolist() == [False] * 6 + [True] * 2
        check_rows(b, wb, TOKENS[24:], slots[24:], start=24)
        cut = b.match_prefix(TOKENS[:16] + [7] * 4)  # the stored pages' window before position 16 had no rows
        assert len(cut.device_indices) == 0 and cut.host_hit_length == 0
        b.verify()
    dev = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS, head_num=HEAD_NUM, head_dim=HEAD_DIM,
                       dtype=torch.float32, device="cpu", page_size=PAGE)  # fmt: skip
    plain = HiRadixCache(dev, HostKVPool(dev, layout="page_head", ratio=2.0, safety_margin_gb=0.0),
                         io_backend="direct", threaded=False, storage=FileBackend(tmp_path), model_id="m",
                         prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=PAGE))  # fmt: skip
    for other in (stored(window=WINDOW + 1)[0], plain):
        with other:
            assert other.prefetch_from_storage("r", other.root, TOKENS) is True
            while not other.check_prefetch_progress("r"):
                pass
            assert other.match_prefix(TOKENS).host_hit_length == 0
