"""The storage tier's objects (:mod:`hicache.storage.objects`): per layout, heads and group size, the bytes
an object's ranges hold (zero copy) or a staging area holds after a gather equal the head-major reference
(tensor indexing through the layout, :func:`storagedata.object_bytes`); a scatter puts them back; keys;
bad inputs."""

from __future__ import annotations

import ctypes

import pytest
import torch
from storagedata import PAGE, object_bytes

from hicache.pools import DeviceKVPool, HostKVPool
from hicache.storage import page_keys
from hicache.storage.objects import StoredObjects, group_key
from hicache_kernels.layouts import LAYOUTS, MLA_LAYOUTS

from kvdata import random_bytes_


def pool(layout: str, heads: int, mla: bool = False, seed: int = 0) -> HostKVPool:
    dev = DeviceKVPool(num_slots=32, num_layers=3, head_num=1 if mla else heads, head_dim=8 if not mla else 12,
                       dtype=torch.bfloat16, device="cpu", page_size=PAGE, mla=mla)  # fmt: skip
    host = HostKVPool(dev, layout=layout, ratio=2.0, safety_margin_gb=0.0)
    random_bytes_(host.buffer, torch.Generator().manual_seed(seed))
    return host


def read(ranges: list[tuple[int, int]]) -> bytes:
    return b"".join(ctypes.string_at(a, n) for a, n in ranges)


def write(ranges: list[tuple[int, int]], data: bytes) -> None:
    """``data`` into ``ranges``, in order."""
    pos = 0
    for a, n in ranges:
        ctypes.memmove(a, data[pos : pos + n], n)
        pos += n
    assert pos == len(data)


def slots_of(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


CASES = [(layout, heads, group) for layout in LAYOUTS for heads, group in [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4)]]


@pytest.mark.parametrize("layout,heads,group", CASES)
def test_objects_hold_the_heads_head_major(layout, heads, group):
    host = pool(layout, heads)
    objects = StoredObjects(host, tp_rank=1, tp_size=3, head_group=group)
    per = heads // group
    assert objects.objects_per_page == per and objects.first_group == per  # rank 1: the model's groups per..2per
    assert objects.page_bytes * per == host.page_bytes
    # Zero copy where an object is at most two runs of the pool: page_head, or one head a token and layer.
    assert objects.zero_copy == (layout == "page_head" or heads == 1 and layout == "page_first")
    pages = [5, 0, 3]  # out of order: a batch's pages come in key order
    slots = slots_of(pages)
    want = object_bytes(host, slots, group)
    held = objects.gather("backup", slots)
    assert torch.equal(held, slots) == objects.zero_copy  # staged: staging slots, numbered past the pool
    if not objects.zero_copy:
        assert int(held.min()) >= host.size
    ranges = objects.page_ranges(held)
    assert len(ranges) == len(pages) * per
    assert [read(r) for r in ranges] == want
    if not objects.zero_copy:
        # What a read leaves in the prefetch area goes into other pages: exactly their objects' bytes.
        area = objects.store_slots("prefetch", slots)
        for r, data in zip(objects.page_ranges(area), want, strict=True):
            write(r, data)
        before = host.buffer.clone()
        dst = slots_of([1, 7, 2])
        objects.scatter("prefetch", dst)
        assert object_bytes(host, dst, group) == want
        untouched = slots_of([0, 3, 4, 5, 6])
        assert object_bytes(host, untouched, group) == object_bytes(_with(host, before), untouched, group)


def _with(host: HostKVPool, buffer: torch.Tensor) -> HostKVPool:
    """A stand-in of ``host`` over another buffer (for the reference indexing only)."""
    other = object.__new__(HostKVPool)
    other.__dict__.update(host.__dict__)
    other.buffer = buffer
    return other


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_objects_are_the_pages(layout):
    host = pool(layout, 1, mla=True)
    objects = StoredObjects(host, tp_rank=1, tp_size=2, head_group=5)  # no heads to group: ignored
    assert objects.zero_copy and objects.objects_per_page == 1 and objects.page_bytes == host.page_bytes
    slots = slots_of([2, 6])
    assert objects.gather("backup", slots) is slots
    assert objects.page_ranges(slots) == host.page_ranges(slots)
    keys = page_keys(list(range(2 * PAGE)), PAGE)
    assert objects.keys(keys) == keys


def test_keys_name_the_model_groups_whatever_the_tp_size():
    keys = page_keys(list(range(3 * PAGE)), PAGE)
    one = StoredObjects(pool("page_first", 4), head_group=1)  # TP=1: the model's 4 heads
    assert one.keys(keys) == [group_key(k, g) for k in keys for g in range(4)]
    shards = [StoredObjects(pool("page_head", 2), tp_rank=r, tp_size=2, head_group=1) for r in range(2)]
    # Rank r of TP=2 keys groups 2r, 2r+1 of each page: together, TP=1's keys.
    assert sorted(shards[0].keys(keys) + shards[1].keys(keys)) == sorted(one.keys(keys))
    assert shards[1].keys(keys)[:2] == [group_key(keys[0], 2), group_key(keys[0], 3)]
    assert len(set(one.keys(keys))) == 12 and not set(one.keys(keys)) & set(keys)


@pytest.mark.parametrize("group", [3, 0, -2, True, 2.0])
def test_bad_head_group(group):
    with pytest.raises(ValueError, match="head_group"):
        StoredObjects(pool("page_first", 4), head_group=group)


def test_bad_slots_and_staging_misuse():
    staged = StoredObjects(pool("page_first", 4), head_group=1, max_pages=2)
    assert not staged.zero_copy and staged.stage_pages == 2
    with pytest.raises(ValueError, match="3 pages, more than the staging area's 2"):
        staged.gather("backup", slots_of([0, 1, 2]))
    with pytest.raises(ValueError, match="staging slots"):
        staged.page_ranges(slots_of([0]))  # staged objects are never read from host slots
    with pytest.raises(ValueError, match="not page-aligned"):
        staged.gather("backup", torch.arange(1, 1 + PAGE))
    zero = StoredObjects(pool("page_head", 4))
    with pytest.raises(ValueError, match="out of range"):
        zero.page_ranges(torch.arange(zero.host_pool.size, zero.host_pool.size + PAGE))
    with pytest.raises(TypeError, match="slots"):
        zero.page_ranges(torch.zeros(PAGE, dtype=torch.float32))


def test_writers_of_two_tp_sizes_store_the_same_objects_at_once(tmp_path):
    """A TP=1 writer (both heads, page_first: staged) and rank 1 of a TP=2 deployment (its head,
    page_head: zero copy) write the same pages' head-1 objects into one directory at the same time,
    round after round: every object is whole and holds the model's head 1, whichever write won."""
    import threading

    from hicache.storage import FileBackend

    heads = 2
    tp1 = pool("page_first", heads, seed=1)
    tp2 = pool("page_head", 1, seed=2)
    pages = [0, 2, 5]
    slots = slots_of(pages)
    # Rank 1's pool holds the same KV as TP=1's head 1: copy it over, head-major through the reference.
    want = object_bytes(tp1, slots)[1::heads]  # head 1 of each page
    one = StoredObjects(tp1, head_group=1)
    two = StoredObjects(tp2, tp_rank=1, tp_size=2, head_group=1)
    for r, data in zip(two.page_ranges(slots), want, strict=True):
        write(r, data)
    assert object_bytes(tp2, slots) == want
    keys = page_keys(list(range(3 * PAGE)), PAGE)
    assert one.keys(keys)[1::heads] == two.keys(keys)
    a, b = FileBackend(tmp_path).attach(one), FileBackend(tmp_path).attach(two)
    try:
        for _ in range(5):
            for k in two.keys(keys):
                (tmp_path / k[:2] / f"{k}.kv").unlink(missing_ok=True)
            start = threading.Barrier(2)
            results: dict = {}

            def store(name, backend, objects, ks, start=start, results=results):
                start.wait()
                results[name] = backend.batch_set_from(ks, objects.gather("backup", slots))

            threads = [threading.Thread(target=store, args=("a", a, one, one.keys(keys))),
                       threading.Thread(target=store, args=("b", b, two, two.keys(keys)))]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert results == {"a": [True] * 6, "b": [True] * 3}
            reader = pool("page_head", 1, seed=3)
            objects = StoredObjects(reader, tp_rank=1, tp_size=2)
            with FileBackend(tmp_path) as c:
                assert c.attach(objects).batch_get_into(two.keys(keys), slots) == [True] * 3
            assert object_bytes(reader, slots) == want
    finally:
        a.close()
        b.close()
