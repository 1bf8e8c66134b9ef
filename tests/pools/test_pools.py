"""Tests of hicache.pools: the device pool and its allocator, host pool sizing, the host slot state
machine (including a hypothesis model check), and compatibility with hicache_kernels.ops."""

from __future__ import annotations

import random
import re
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.pools import DeviceKVPool, HostKVPool, SlotState
from hicache_kernels import layouts, ops

from kvdata import Pools, expected_after, poison_, random_bytes_, same_bytes

GIB = 1 << 30
S = SlotState


def dev_pool(
    *, num_slots=32, page_size=4, mla=False, stacked=True, dtype=torch.float16, num_layers=3, head_dim=8, device="cpu"
) -> DeviceKVPool:
    return DeviceKVPool(
        num_slots=num_slots,
        num_layers=num_layers,
        head_num=1 if mla else 2,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        page_size=page_size,
        mla=mla,
        stacked=stacked,
    )


def host_pool(page_size=4, ratio=2.0, **kw) -> HostKVPool:
    return HostKVPool(dev_pool(page_size=page_size), ratio=ratio, **kw)


def t(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def layer_list(pool) -> list[torch.Tensor]:
    return list(pool.unbind(0)) if isinstance(pool, torch.Tensor) else pool


# --------------------------------------------------------------------------------------------------
# Device pool: storage
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_device_storage(mla, stacked):
    pool = dev_pool(num_slots=16, mla=mla, stacked=stacked, dtype=torch.bfloat16, num_layers=3, head_dim=8)
    H = 1 if mla else 2
    assert (pool.size, pool.page_size, pool.num_layers, pool.head_num, pool.head_dim) == (16, 4, 3, H, 8)
    assert pool.mla is mla and pool.dtype == torch.bfloat16 and pool.device == torch.device("cpu")
    if mla:
        assert pool.k is None and pool.v is None and pool.device_v is None
        assert pool.device_k is pool.kv
    else:
        assert pool.kv is None and pool.device_k is pool.k and pool.device_v is pool.v
    for p in [pool.device_k] + ([] if mla else [pool.device_v]):
        if stacked:
            assert isinstance(p, torch.Tensor) and p.shape == (3, 16, H, 8) and p.is_contiguous()
        else:
            assert isinstance(p, list) and len(p) == 3
            assert all(x.shape == (16, H, 8) and x.is_contiguous() for x in p)
            # Separately allocated layers, not views of one buffer.
            assert len({x.untyped_storage().data_ptr() for x in p}) == 3
    assert pool.item_bytes == H * 8 * 2
    assert pool.bytes_per_slot == (1 if mla else 2) * 3 * H * 8 * 2
    assert pool.total_bytes == 16 * pool.bytes_per_slot
    assert pool.available_size() == 16
    assert "DeviceKVPool" in repr(pool)


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(num_slots=30), ValueError, "num_slots"),  # not a multiple of page_size 4
        (dict(num_slots=0), ValueError, "num_slots"),
        (dict(page_size=0), ValueError, "page_size"),
        (dict(num_layers=0), ValueError, "num_layers"),
        (dict(head_dim=-1), ValueError, "head_dim"),
        (dict(mla=True, head_num=2), ValueError, "head_num"),
        (dict(dtype=torch.int32), TypeError, "dtype"),
    ],
)
def test_device_constructor_refuses(kwargs, exc, name):
    args = dict(num_slots=32, num_layers=2, head_num=1, head_dim=8, dtype=torch.float16, device="cpu", page_size=4)
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        DeviceKVPool(**args)


# --------------------------------------------------------------------------------------------------
# Device pool: allocator
# --------------------------------------------------------------------------------------------------


def assert_whole_pages(slots: torch.Tensor, page_size: int) -> None:
    assert slots.dtype == torch.int64 and slots.device.type == "cpu" and slots.dim() == 1
    pages = slots.view(-1, page_size)
    assert torch.equal(pages - pages[:, :1], torch.arange(page_size).expand_as(pages))  # consecutive in a page
    assert torch.equal(pages[:, 0] % page_size, torch.zeros(len(pages), dtype=torch.int64))  # page aligned


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_free_round_trip(page_size):
    pool = dev_pool(num_slots=32, page_size=page_size)
    a = pool.alloc(2 * page_size)
    assert a.tolist() == list(range(2 * page_size))  # fresh pools hand out ascending pages
    b = pool.alloc(3 * page_size)
    assert_whole_pages(a, page_size)
    assert_whole_pages(b, page_size)
    assert not set(a.tolist()) & set(b.tolist())
    assert pool.available_size() == 32 - 5 * page_size
    assert pool.is_allocated(torch.cat([a, b])).all()
    assert int(pool.is_allocated().sum()) == 5 * page_size
    pool.free(a)
    assert pool.available_size() == 32 - 3 * page_size
    assert not pool.is_allocated(a).any()
    # Freed pages are reused first.
    assert sorted(pool.alloc(2 * page_size).tolist()) == sorted(a.tolist())
    assert pool.alloc(0).numel() == 0
    # Everything out, then nothing left.
    rest = pool.alloc(pool.available_size())
    assert pool.available_size() == 0 and pool.is_allocated().all()
    assert pool.alloc(page_size) is None
    pool.free(rest)
    pool.free(b[page_size:])  # pages can be freed separately from how they were allocated
    pool.free(b[:page_size].flip(0))  # order within the given slots does not matter
    assert pool.available_size() == 32 - 2 * page_size


def test_alloc_none_when_too_few_allocates_nothing():
    pool = dev_pool(num_slots=16, page_size=4)
    pool.alloc(12)
    before = pool.is_allocated()
    assert pool.alloc(8) is None
    assert pool.available_size() == 4 and torch.equal(pool.is_allocated(), before)
    assert pool.alloc(4) is not None


@pytest.mark.parametrize("num_tokens", [3, -4, 4.0, True, "4"])
def test_alloc_refuses_bad_num_tokens(num_tokens):
    pool = dev_pool(page_size=4)
    with pytest.raises(ValueError, match="num_tokens"):
        pool.alloc(num_tokens)
    assert pool.available_size() == 32


@pytest.mark.parametrize(
    "make_slots, match",
    [
        (lambda a: a, "double free: slot\\(s\\) \\[0, 1, 2, 3, \\.\\.\\.\\] \\(8 slots\\) are FREE"),
        (lambda a: t(16, 17, 18, 19), "never allocated: slot\\(s\\) \\[16, 17, 18, 19\\] are FREE"),
        (lambda a: t(8, 9), "partial page\\(s\\) \\[2\\]"),
        (lambda a: t(8, 9, 10, 11, 12), "partial page\\(s\\) \\[3\\]"),
        (lambda a: t(8, 9, 10, 32), "slot\\(s\\) \\[32\\] out of range \\[0, 32\\)"),
        (lambda a: t(-1, 8, 9, 10), "slot\\(s\\) \\[-1\\] out of range"),
        (lambda a: t(8, 9, 10, 11, 8), "repeated slot\\(s\\) \\[8\\]"),
        (lambda a: torch.cat([t(8, 9, 10, 11), a]), "double free"),  # mixed: one good page, two freed
    ],
    ids=["double", "never", "partial", "partial2", "range", "negative", "repeated", "mixed"],
)
def test_device_free_refuses_and_changes_nothing(make_slots, match):
    pool = dev_pool(num_slots=32, page_size=4)
    a = pool.alloc(8)  # pages 0, 1
    pool.alloc(8)  # pages 2, 3
    pool.free(a)
    before, avail = pool.is_allocated(), pool.available_size()
    with pytest.raises(ValueError, match=match) as e:
        pool.free(make_slots(a))
    assert str(e.value).startswith("free: ")
    assert torch.equal(pool.is_allocated(), before) and pool.available_size() == avail


@pytest.mark.parametrize(
    "slots, exc",
    [([0, 1, 2, 3], TypeError), (torch.arange(4.0), TypeError), (torch.arange(4).view(2, 2), ValueError)],
)
def test_device_free_refuses_bad_types(slots, exc):
    pool = dev_pool(num_slots=32, page_size=4)
    pool.alloc(4)
    with pytest.raises(exc, match="free: slots"):
        pool.free(slots)
    assert pool.available_size() == 28


def test_allocated_of_reads_states_of_checked_slots():
    pool = dev_pool(page_size=4)
    a = pool.alloc(8)
    probe = np.array([0, 7, 8, 31], dtype=np.int64)
    assert pool.allocated_of(probe).tolist() == [True, True, False, False]
    assert pool.allocated_of(probe).tolist() == pool.is_allocated(torch.from_numpy(probe)).tolist()
    pool.free(a)
    assert not pool.allocated_of(probe).any()


def test_free_accepts_int32_and_empty():
    pool = dev_pool(num_slots=8, page_size=4)
    a = pool.alloc(4)
    pool.free(a.to(torch.int32))
    pool.free(torch.empty(0, dtype=torch.int64))
    assert pool.available_size() == 8


def run_threads(worker, n: int) -> None:
    errors: list[BaseException] = []

    def wrapped(i):
        try:
            worker(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so the pools' critical sections interleave
    try:
        threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    if errors:
        raise errors[0]


class Owners:
    """Who holds each slot, to catch the same slot handed to two threads at once."""

    def __init__(self, size: int) -> None:
        self.owner = np.full(size, -1)
        self.lock = threading.Lock()

    def take(self, slots: torch.Tensor, who: int) -> None:
        with self.lock:
            s = slots.numpy()
            assert (self.owner[s] == -1).all(), f"slots {s[self.owner[s] != -1]} handed out twice"
            self.owner[s] = who

    def give(self, slots: torch.Tensor, who: int) -> None:
        with self.lock:
            assert (self.owner[slots.numpy()] == who).all()
            self.owner[slots.numpy()] = -1


def test_device_allocator_thread_safety():
    pool = dev_pool(num_slots=256, page_size=4)
    owners = Owners(pool.size)

    def worker(i):
        rng = np.random.default_rng(i)
        held: list[torch.Tensor] = []
        for _ in range(300):
            if held and (rng.random() < 0.5 or len(held) > 4):
                slots = held.pop(rng.integers(len(held)))
                owners.give(slots, i)
                pool.free(slots)
            else:
                slots = pool.alloc(4 * int(rng.integers(0, 5)))
                if slots is not None:
                    owners.take(slots, i)
                    held.append(slots)
        for slots in held:
            owners.give(slots, i)
            pool.free(slots)

    run_threads(worker, 8)
    assert pool.available_size() == pool.size and not pool.is_allocated().any()
    assert sorted(pool.alloc(pool.size).tolist()) == list(range(pool.size))  # every page back exactly once


def test_host_state_machine_thread_safety():
    host = host_pool(page_size=2, ratio=8.0)  # 256 slots
    owners = Owners(host.size)

    def worker(i):
        rng = np.random.default_rng(100 + i)
        for _ in range(150):
            slots = host.alloc(2 * int(rng.integers(1, 4)))
            if slots is None:
                continue
            owners.take(slots, i)
            host.mark_writing(slots)
            host.mark_synced(slots)
            if rng.random() < 0.5:
                host.mark_loading(slots)
                host.mark_synced(slots)
            assert (host.state(slots) == S.SYNCED).all()
            owners.give(slots, i)
            host.free(slots)

    run_threads(worker, 8)
    assert host.available_size() == host.size and (host.state() == S.FREE).all()


# --------------------------------------------------------------------------------------------------
# Compatibility with hicache_kernels.ops
# --------------------------------------------------------------------------------------------------

LAYOUT_CASES = [(layout, False) for layout in layouts.LAYOUTS] + [(layout, True) for layout in layouts.MLA_LAYOUTS]
LAYOUT_IDS = [f"{layout}-{'mla' if mla else 'mha'}" for layout, mla in LAYOUT_CASES]


def fill_random(pool: DeviceKVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in [pool.device_k] + ([] if pool.mla else [pool.device_v]):
        for x in layer_list(p):
            random_bytes_(x, gen)


def pools_of(dev: DeviceKVPool, host: HostKVPool) -> Pools:
    return Pools(dev.device_k, dev.device_v, host.buffer, host.layout, host.page_size)


def round_trip(dev: DeviceKVPool, host: HostKVPool, backend: str, index_device=None) -> None:
    """Back up two pages, load them into two other device pages, comparing with the reference."""
    n = 2 * dev.page_size
    d, h, d2 = dev.alloc(n), host.alloc(n), dev.alloc(n)
    assert d is not None and h is not None and d2 is not None
    on = (lambda x: x.to(index_device)) if index_device is not None else (lambda x: x)
    poison_(host.buffer)
    kw = dict(layout=host.layout, page_size=host.page_size, backend=backend)

    expected = expected_after(pools_of(dev, host).clone(), "d2h", d, h, None)
    host.mark_writing(h)
    ops.backup_all_layers(dev.device_k, dev.device_v, host.buffer, on(d), on(h), **kw)
    if index_device is not None:
        torch.cuda.synchronize()
    host.mark_synced(h)
    assert pools_of(dev, host).equal(expected)

    expected = expected_after(pools_of(dev, host).clone(), "h2d", d2, h, None)
    host.mark_loading(h)
    ops.load_all_layers(dev.device_k, dev.device_v, host.buffer, on(d2), on(h), **kw)
    if index_device is not None:
        torch.cuda.synchronize()
    host.mark_synced(h)
    assert pools_of(dev, host).equal(expected)
    for p in [dev.device_k] + ([] if dev.mla else [dev.device_v]):
        for x in layer_list(p):
            assert same_bytes(x[d2.to(x.device)], x[d.to(x.device)])  # the data made the round trip
    host.free(h)
    dev.free(torch.cat([d, d2]))


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("layout, mla", LAYOUT_CASES, ids=LAYOUT_IDS)
def test_pools_fit_ops(layout, mla, page_size, stacked):
    dev = dev_pool(num_slots=16, page_size=page_size, mla=mla, stacked=stacked, dtype=torch.bfloat16)
    host = HostKVPool(dev, layout=layout, ratio=2.0)
    assert host.buffer.shape == layouts.host_shape(
        layout,
        mla=mla,
        num_layers=dev.num_layers,
        num_slots=host.size,
        page_size=page_size,
        head_num=dev.head_num,
        head_dim=dev.head_dim,
    )
    assert host.buffer.dtype == dev.dtype and host.buffer.is_contiguous()
    d, h = dev.alloc(2 * page_size), host.alloc(2 * page_size)
    for direction in ("d2h", "h2d"):
        plan = ops.build_plan(
            direction, dev.device_k, dev.device_v, host.buffer, d, h, layout=layout, page_size=page_size
        )
        assert plan.num_kv == (1 if mla else 2) and plan.layer_count == dev.num_layers
        assert plan.item_bytes == dev.item_bytes
    host.free(h)
    dev.free(d)
    fill_random(dev, seed=page_size)
    round_trip(dev, host, "direct")


# --------------------------------------------------------------------------------------------------
# Host pool: sizing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio, size", [(2.0, 64), (2.5, 80), (2.2, 68), (2.1, 64), (1.2, 36)])
def test_host_size_by_ratio(ratio, size):
    host = host_pool(page_size=4, ratio=ratio)  # device: 32 slots, pages of 4; rounded down to pages
    assert host.size == size and host.available_size() == size
    assert host.page_size == 4 and host.size % 4 == 0
    assert host.bytes_per_slot == host.device_pool.bytes_per_slot
    assert host.total_bytes == host.buffer.numel() * host.buffer.element_size() == size * host.bytes_per_slot


def test_host_size_by_size_gb_wins_over_ratio():
    dev = dev_pool(page_size=4)
    per_slot = dev.bytes_per_slot
    host = HostKVPool(dev, size_gb=(43 * per_slot + 5) / GIB, ratio=100.0)  # 43 slots, rounded to 40
    assert host.size == 40
    host = HostKVPool(dev, size_gb=64 * per_slot / GIB, ratio=None)
    assert host.size == 64


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ratio=1.0), r"ratio: host pool \(32 slots\) must be larger than the device pool \(32 slots\)"),
        (dict(ratio=1.1), r"ratio: host pool \(32 slots\) must be larger"),  # 35 slots round down to 32
        (dict(ratio=0.5), r"ratio: host pool \(16 slots\) must be larger"),
        (dict(size_gb=1e-6), r"size_gb: host pool \(\d+ slots\) must be larger than the device pool \(32 slots\)"),
        (dict(ratio=0.0), "ratio: expected a positive"),
        (dict(ratio=-2.0), "ratio: expected a positive"),
        (dict(size_gb=0.0), "size_gb: expected a positive"),
        (dict(size_gb=-1.0), "size_gb: expected a positive"),
        (dict(ratio=None), "size_gb / ratio"),
        (dict(safety_margin_gb=-1.0), "safety_margin_gb"),
    ],
)
def test_host_size_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HostKVPool(dev_pool(page_size=4), **kwargs)


@pytest.mark.parametrize("arg", ["ratio", "size_gb"])
def test_host_size_above_available_ram_refused(arg):
    dev = dev_pool(page_size=4)
    need = 64 * dev.bytes_per_slot
    kw = dict(ratio=2.0) if arg == "ratio" else dict(size_gb=need / GIB)
    # Exactly enough: available minus the default 2 GiB margin.
    assert HostKVPool(dev, mem_available_bytes=need + 2 * GIB, **kw).size == 64
    with pytest.raises(ValueError, match=rf"{arg}: host pool of 0\.00 GiB .* available RAM 2\.00 GiB .* 2\.00 GiB"):
        HostKVPool(dev, mem_available_bytes=need + 2 * GIB - 1, **kw)
    with pytest.raises(ValueError, match=r"available RAM 1\.50 GiB minus the safety margin 0\.50 GiB"):
        HostKVPool(dev, mem_available_bytes=3 * GIB // 2, safety_margin_gb=0.5, size_gb=1.25)
    assert HostKVPool(dev, mem_available_bytes=need, safety_margin_gb=0.0, **kw).size == 64


def test_host_size_checked_against_real_ram():
    # A pool of a petabyte cannot fit on any test machine: /proc/meminfo is read and the request refused.
    with pytest.raises(ValueError, match="size_gb: host pool of .* GiB .* available RAM"):
        HostKVPool(dev_pool(page_size=4), size_gb=2.0**20)


def test_host_layout_checked():
    with pytest.raises(ValueError, match="layout"):
        HostKVPool(dev_pool(mla=True), layout="page_head")
    with pytest.raises(ValueError, match="layout"):
        HostKVPool(dev_pool(), layout="head_first")
    with pytest.raises(TypeError, match="device_pool"):
        HostKVPool(object())  # type: ignore[arg-type]


def test_host_pin_memory_default_on_cpu():
    host = host_pool()
    assert host.pinned is False and not host.buffer.is_pinned()
    assert "pageable" in repr(host)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_host_pin_memory_refused_without_cuda():
    with pytest.raises(ValueError, match="pin_memory"):
        host_pool(pin_memory=True)


# --------------------------------------------------------------------------------------------------
# Host pool: slot states
# --------------------------------------------------------------------------------------------------


def slots_in(host: HostKVPool, state: SlotState, n: int = 4) -> torch.Tensor:
    """``n`` newly allocated slots driven to ``state`` (FREE: allocated then freed)."""
    s = host.alloc(n)
    if state == S.FREE:
        host.free(s)
    if state >= S.WRITING:
        host.mark_writing(s)
    if state >= S.SYNCED:
        host.mark_synced(s)
    if state == S.LOADING:
        host.mark_loading(s)
    assert (host.state(s) == state).all()
    return s


def test_legal_transitions():
    host = host_pool(page_size=4)
    s = host.alloc(8)
    assert (host.state(s) == S.RESERVED).all() and host.available_size() == host.size - 8
    host.free(s)  # RESERVED -> FREE (a backup never issued)
    assert (host.state(s) == S.FREE).all() and host.available_size() == host.size
    s = host.alloc(8)
    host.mark_writing(s)
    assert (host.state(s) == S.WRITING).all()
    host.mark_synced(s)
    assert (host.state(s) == S.SYNCED).all()
    host.mark_loading(s[:4])  # per-slot marks: part of an allocation may load
    assert host.state(s).tolist() == [S.LOADING] * 4 + [S.SYNCED] * 4
    host.mark_synced(s[:4])
    host.mark_loading(s)
    host.mark_synced(s)
    host.free(s)  # SYNCED -> FREE
    assert (host.state() == S.FREE).all() and host.available_size() == host.size
    s = host.alloc(8)
    host.mark_writing(s)
    host.abort_write(s)  # WRITING -> RESERVED: the backup failed, the slots hold nothing valid
    assert (host.state(s) == S.RESERVED).all()
    host.free(s)
    for method in (host.mark_writing, host.mark_synced, host.mark_loading, host.abort_write, host.free):
        method(torch.empty(0, dtype=torch.int64))  # empty: no-op
    assert host.state().dtype == torch.uint8 and host.state().shape == (host.size,)


ILLEGAL = [
    ("mark_writing", S.FREE, "slot not allocated"),
    ("mark_writing", S.WRITING, "a backup is already in flight"),
    ("mark_writing", S.SYNCED, "already holds valid data"),
    ("mark_writing", S.LOADING, "a load from it is in flight"),
    ("mark_synced", S.FREE, "slot not allocated"),
    ("mark_synced", S.RESERVED, "no backup was started"),
    ("mark_synced", S.SYNCED, "no transfer in flight"),
    ("mark_loading", S.FREE, "slot not allocated"),
    ("mark_loading", S.RESERVED, "holds no valid data yet"),
    ("mark_loading", S.WRITING, "its backup is still in flight"),
    ("mark_loading", S.LOADING, "a load is already in flight"),
    ("abort_write", S.FREE, "slot not allocated"),
    ("abort_write", S.RESERVED, "no backup was started"),
    ("abort_write", S.SYNCED, "its backup already completed"),
    ("abort_write", S.LOADING, "a load from it is in flight"),
    ("free", S.FREE, "double free"),
    ("free", S.WRITING, r"free of a slot in flight \(WRITING\)"),
    ("free", S.LOADING, r"free of a slot in flight \(LOADING\)"),
]


@pytest.mark.parametrize("method, state, reason", ILLEGAL, ids=[f"{m}-{s.name}" for m, s, _ in ILLEGAL])
def test_illegal_transition_all_or_nothing(method, state, reason):
    host = host_pool(page_size=4)
    # A legal page for the method first, then the offending page: a mixed set.
    legal_state = {
        "mark_writing": S.RESERVED, "mark_synced": S.WRITING, "mark_loading": S.SYNCED, "abort_write": S.WRITING,
        "free": S.SYNCED,
    }  # fmt: skip
    good = slots_in(host, legal_state[method])
    bad = slots_in(host, state)
    before, avail = host.state(), host.available_size()
    with pytest.raises(ValueError) as e:
        getattr(host, method)(torch.cat([good, bad]))
    msg = str(e.value)
    assert msg.startswith(f"{method}: ")
    assert f"slot(s) {bad.tolist()} are {state.name}" in msg
    assert "no slot was changed" in msg
    assert re.search(reason, msg), msg
    assert torch.equal(host.state(), before) and host.available_size() == avail
    getattr(host, method)(good)  # the legal part alone still works afterwards


def test_never_allocated_host_slot_and_many_bad_slots():
    host = host_pool(page_size=4)
    with pytest.raises(ValueError, match=r"mark_writing: never allocated: slot\(s\) \[0, 1, 2, 3, \.\.\.\] \(12"):
        host.mark_writing(torch.arange(12))
    with pytest.raises(ValueError, match=r"free: never allocated: slot\(s\) \[4, 5, 6, 7\] are FREE"):
        host.free(torch.arange(4, 8))
    # Two kinds of wrong at once: both named.
    w, r = slots_in(host, S.WRITING), slots_in(host, S.RESERVED)
    with pytest.raises(ValueError, match=r"no backup was started: .* are RESERVED.*expected WRITING or LOADING"):
        host.mark_synced(torch.cat([w, r, torch.tensor([60, 61])]))
    assert (host.state(w) == S.WRITING).all() and (host.state(r) == S.RESERVED).all()


@pytest.mark.parametrize(
    "slots, match",
    [
        (t(0, 1), "partial page"),
        (t(0, 1, 2, 3, 3), "repeated slot"),
        (t(0, 1, 2, 64), r"out of range \[0, 64\)"),
    ],
)
def test_host_free_checks_slots(slots, match):
    host = host_pool(page_size=4)
    s = slots_in(host, S.SYNCED)
    with pytest.raises(ValueError, match=f"free: .*{match}"):
        host.free(slots)
    assert (host.state(s) == S.SYNCED).all() and host.available_size() == host.size - 4
    with pytest.raises(ValueError, match=r"state: slot\(s\) \[64\] out of range"):
        host.state(t(64))


# --------------------------------------------------------------------------------------------------
# Host pool: hypothesis model check of the state machine
# --------------------------------------------------------------------------------------------------

TRANSITIONS = {
    "mark_writing": ({S.RESERVED}, S.WRITING),
    "mark_synced": ({S.WRITING, S.LOADING}, S.SYNCED),
    "mark_loading": ({S.SYNCED}, S.LOADING),
    "abort_write": ({S.WRITING}, S.RESERVED),
    "free": ({S.RESERVED, S.SYNCED}, S.FREE),
}


@pytest.mark.parametrize("path", ["compiled", "numpy"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_state_machine_matches_model(path, data):
    """The state machine against a model, through the compiled transitions (when built) and the numpy
    path of pure-Python builds: the same states, the same refusals."""
    page = 2
    host = HostKVPool(dev_pool(num_slots=4, page_size=page, num_layers=1, head_dim=2, dtype=torch.uint8), ratio=3.0)
    if path == "compiled" and host._slots._move is None:
        pytest.skip("the extension is not built: only the numpy path exists")
    if path == "numpy":
        host._slots._move = None
    n = host.size  # 12 slots, 6 pages
    model = dict.fromkeys(range(n), S.FREE)
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(st.sampled_from(["alloc", *TRANSITIONS]), label="op")
        if op == "alloc":
            k = page * data.draw(st.integers(0, n // page + 1), label="pages")
            free = [s for s, v in model.items() if v == S.FREE]
            got = host.alloc(k)
            if k > len(free):
                assert got is None
            else:
                assert got is not None and got.numel() == k
                assert_whole_pages(got, page)
                for s in got.tolist():
                    assert model[s] == S.FREE
                    model[s] = S.RESERVED
        else:
            sources, target = TRANSITIONS[op]
            if data.draw(st.booleans(), label="legal"):
                if op == "free":  # whole pages whose every slot may be freed
                    pages = [p for p in range(n // page) if all(model[p * page + i] in sources for i in range(page))]
                    chosen = data.draw(st.lists(st.sampled_from(pages), unique=True), label="pages") if pages else []
                    slots = [p * page + i for p in chosen for i in range(page)]
                else:
                    ok = [s for s, v in model.items() if v in sources]
                    slots = data.draw(st.lists(st.sampled_from(ok), unique=True), label="slots") if ok else []
            else:  # anything, including an out-of-range slot (n) and partial pages
                slots = data.draw(st.lists(st.integers(0, n), unique=True, max_size=6), label="slots")
            in_range = all(s < n for s in slots)
            legal = in_range and all(model[s] in sources for s in slots)
            if op == "free" and legal:
                legal = len(slots) == page * len({s // page for s in slots})  # unique slots: whole pages
            if legal:
                getattr(host, op)(torch.tensor(slots, dtype=torch.int64))
                for s in slots:
                    model[s] = target
            else:
                with pytest.raises(ValueError, match=op):
                    getattr(host, op)(torch.tensor(slots, dtype=torch.int64))
        assert host.state().tolist() == [model[s] for s in range(n)]
        assert host.available_size() == sum(v == S.FREE for v in model.values())


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("layout, mla", LAYOUT_CASES, ids=LAYOUT_IDS)
def test_cuda_pools_kernel_round_trip(layout, mla, stacked):
    dev = dev_pool(num_slots=256, page_size=16, mla=mla, stacked=stacked, dtype=torch.bfloat16, device="cuda")
    assert dev.device.type == "cuda"
    host = HostKVPool(dev, layout=layout, ratio=2.0)
    assert host.pinned and host.buffer.is_pinned()  # pinned by default for a CUDA device pool
    fill_random(dev, seed=7)
    round_trip(dev, host, "kernel", index_device=dev.device)
    assert dev.available_size() == dev.size and host.available_size() == host.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_device_alloc_free_match_a_page_stack_model(page_size):
    """Frees of whole pages in any page order (the O(n) path) and with slots out of order inside a page
    (the general path) keep the same free-page stack: freed pages come back ascending, last freed first."""
    r = random.Random(page_size)
    pool = dev_pool(num_slots=64, page_size=page_size)
    stack = list(range(64 // page_size - 1, -1, -1))  # top at the end
    held: list[int] = []  # allocated pages
    for _ in range(300):
        if held and r.random() < 0.5:
            pages = r.sample(held, r.randint(1, len(held)))
            slots = [p * page_size + o for p in pages for o in range(page_size)]
            if page_size > 1 and r.random() < 0.3:
                slots[:page_size] = slots[:page_size][::-1]  # inside a page out of order: still whole pages
            pool.free(torch.tensor(slots, dtype=r.choice([torch.int64, torch.int32])))
            held = [p for p in held if p not in pages]
            stack.extend(sorted(pages, reverse=True))
        else:
            n = r.randint(0, 5)
            got = pool.alloc(n * page_size)
            if n > len(stack):
                assert got is None
                continue
            want = stack[len(stack) - n :][::-1]
            del stack[len(stack) - n :]
            assert got.tolist() == [p * page_size + o for p in want for o in range(page_size)]
            held += want
        assert pool.available_size() == len(stack) * page_size
        alloc = pool.is_allocated().view(-1, page_size)
        assert alloc.all(dim=1).tolist() == [p in held for p in range(64 // page_size)]
        assert (alloc.all(dim=1) == alloc.any(dim=1)).all()


def test_device_free_of_a_repeated_whole_page_is_refused():
    pool = dev_pool(num_slots=32, page_size=4)
    a = pool.alloc(8)
    with pytest.raises(ValueError, match="repeated slot"):
        pool.free(torch.cat([a, a[:4]]))
    assert pool.is_allocated(a).all() and pool.available_size() == 24


@pytest.mark.parametrize(
    "layout,mla", [(lay, False) for lay in layouts.LAYOUTS] + [(lay, True) for lay in layouts.MLA_LAYOUTS]
)
def test_page_ranges_tile_the_buffer(layout, mla):
    """Every page's ranges, over all pages, cover the host buffer exactly once."""
    host = HostKVPool(dev_pool(mla=mla, page_size=4), layout=layout, ratio=2.0)
    base, total = host.buffer.data_ptr(), host.buffer.numel() * host.buffer.element_size()
    covered = np.zeros(total, dtype=np.int64)
    for ranges in host.page_ranges(torch.arange(host.size)):
        assert sum(n for _, n in ranges) == host.page_bytes
        for addr, n in ranges:
            covered[addr - base : addr - base + n] += 1
    assert (covered == 1).all()
    with pytest.raises(ValueError, match="page-aligned"):
        host.page_ranges(torch.tensor([4, 5, 7, 6]))
    with pytest.raises(ValueError, match="out of range"):
        host.page_ranges(torch.arange(host.size, host.size + 4))
    with pytest.raises(TypeError):
        host.page_ranges(torch.zeros(4))


@pytest.mark.parametrize("page_size", [1, 4])
def test_compiled_and_numpy_alloc_paths_agree(page_size):
    """alloc pops pages in one compiled call when the extension is built; the numpy path (pure-Python
    builds) must give the same slots and leave the same state, call for call."""
    pools = []
    for compiled in (True, False):
        p = DeviceKVPool(num_slots=64, num_layers=1, head_num=1, head_dim=2, dtype=torch.float32, device="cpu",
                         page_size=page_size)  # fmt: skip
        if not compiled:
            p._slots._pop = None
        pools.append(p)
    if pools[0]._slots._pop is None:
        pytest.skip("the extension is not built: only the numpy path exists")
    r = random.Random(page_size)
    held: list[list[torch.Tensor]] = [[], []]
    for _ in range(300):
        if held[0] and r.random() < 0.45:
            i = r.randrange(len(held[0]))
            for p, h in zip(pools, held, strict=True):
                p.free(h.pop(i))
        else:
            n = page_size * r.randint(0, 6)
            got = [p.alloc(n) for p in pools]
            assert (got[0] is None) == (got[1] is None)
            if got[0] is not None:
                assert got[0].dtype == got[1].dtype == torch.int64 and torch.equal(got[0], got[1])
                for h, g in zip(held, got, strict=True):
                    h.append(g)
        a, b = (p._slots for p in pools)
        assert np.array_equal(a._states, b._states) and np.array_equal(a._ever, b._ever)
        assert a._num_free == b._num_free and np.array_equal(a._stack[: a._num_free], b._stack[: b._num_free])
