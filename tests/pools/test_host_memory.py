"""Tests of hicache.pools.host_memory through HostKVPool: a pinned pool pins exactly its bytes (rounded up to OS
pages only, never to a power of two), aliases that memory, is unregistered when its last tensor goes, and
its RAM check counts what the allocation takes.

Without a GPU the CUDA runtime's register calls are a recording fake (the one thing a CPU cannot reach);
the memory, its mapping and the tensor over it are real. The ``gpu`` test pins for real."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap

import pytest
import torch

from hicache.pools import DeviceKVPool, HostKVPool, host_memory
from hicache_kernels import layouts, ops

from kvdata import random_bytes_, same_bytes

PAGE = mmap.PAGESIZE
GIB = 1 << 30
BIG_RAM = 1 << 40  # mem_available_bytes for pools whose RAM check is not under test
MAPPED = 0x02  # cudaHostRegisterMapped: the zero-copy kernels read the pool at its host address


class FakeCudart:
    """``torch.cuda.cudart()`` on a machine without CUDA: records register / unregister calls."""

    def __init__(self, fail_with: int = 0) -> None:
        self.fail_with = fail_with
        self.registered: list[tuple[int, int, int]] = []  # (ptr, nbytes, flags)
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - the CUDA name
        if self.fail_with:
            return self.fail_with
        self.registered.append((ptr, nbytes, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, err: int) -> str:  # noqa: N802
        return {2: "out of memory"}.get(int(err), "unknown error")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def dev_pool(*, num_slots=32, page_size=4, mla=False, head_dim=8, device="cpu") -> DeviceKVPool:
    return DeviceKVPool(num_slots=num_slots, num_layers=3, head_num=1 if mla else 2, head_dim=head_dim,
                        dtype=torch.float16, device=device, page_size=page_size, mla=mla)  # fmt: skip


def rounded(nbytes: int) -> int:
    return (nbytes + PAGE - 1) // PAGE * PAGE


def flat_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


# Pools whose bytes are not a whole number of OS pages (the rounding shows) and one that is.
SIZES = [(2.5, 8), (2.0, 8), (2.0, 2048)]  # (ratio, head_dim): 80 x 192, 64 x 192, 64 x 49152 bytes


@pytest.mark.parametrize("ratio, head_dim", SIZES, ids=["80x192B", "64x192B", "64x48KiB"])
@pytest.mark.parametrize("layout, mla", [("page_first", False), ("layer_first", False), ("page_first", True)])
def test_pinned_pool_registers_exactly_its_bytes(fake_cuda, ratio, head_dim, layout, mla):
    dev = dev_pool(mla=mla, head_dim=head_dim)
    host = HostKVPool(dev, layout=layout, ratio=ratio, pin_memory=True, mem_available_bytes=BIG_RAM)
    total = host.size * dev.bytes_per_slot
    assert host.total_bytes == total

    ((ptr, nbytes, flags),) = fake_cuda.registered
    assert nbytes == rounded(total) and nbytes - total < PAGE  # whole OS pages, never a power of two
    assert ptr % PAGE == 0 and flags & MAPPED
    assert host.pinned and host.pinned_bytes == host.allocated_bytes == nbytes
    assert f"pinned {nbytes} bytes" in repr(host)

    # The tensor is that memory: the pool's shape, dtype and layout, contiguous, starting at the register.
    buf = host.buffer
    shape = layouts.host_shape(layout, mla=mla, num_layers=3, num_slots=host.size, page_size=4,
                               head_num=dev.head_num, head_dim=head_dim)  # fmt: skip
    assert tuple(buf.shape) == tuple(shape) and buf.dtype == torch.float16 and buf.device.type == "cpu"
    assert buf.is_contiguous() and buf.data_ptr() == ptr
    assert buf.untyped_storage().nbytes() == total
    random_bytes_(buf, torch.Generator().manual_seed(1))
    assert ctypes.string_at(ptr, total) == flat_bytes(buf)  # written through the tensor, read at ptr
    ctypes.memset(ptr, 0x5A, total)
    assert flat_bytes(buf) == b"\x5a" * total  # written at ptr, read through the tensor
    assert fake_cuda.unregistered == []


def test_pinned_pool_round_trips_kv(fake_cuda):
    """The ops read and write the registered buffer as they would torch's pinned memory."""
    dev = dev_pool(num_slots=32, page_size=4)
    host = HostKVPool(dev, layout="page_first_direct", ratio=2.5, pin_memory=True, mem_available_bytes=BIG_RAM)
    gen = torch.Generator().manual_seed(3)
    random_bytes_(dev.k, gen)
    random_bytes_(dev.v, gen)
    d, h, d2 = dev.alloc(8), host.alloc(8), dev.alloc(8)
    kw = dict(layout=host.layout, page_size=host.page_size, backend="direct")
    ops.backup_all_layers(dev.device_k, dev.device_v, host.buffer, d, h, **kw)
    ops.load_all_layers(dev.device_k, dev.device_v, host.buffer, d2, h, **kw)
    for pool in (dev.k, dev.v):
        assert same_bytes(pool[:, d2], pool[:, d])


def test_pinned_memory_unregistered_when_its_last_tensor_goes(fake_cuda):
    host = HostKVPool(dev_pool(), ratio=2.5, pin_memory=True, mem_available_bytes=BIG_RAM)
    ((ptr, nbytes, _),) = fake_cuda.registered
    view = host.buffer[1]  # a view outlives the pool: the memory must stay mapped and pinned under it
    view.fill_(7)
    del host
    gc.collect()
    assert fake_cuda.unregistered == []
    assert bool((view == 7).all())
    del view
    gc.collect()
    assert fake_cuda.unregistered == [ptr]

    host = HostKVPool(dev_pool(), ratio=2.5, pin_memory=True, mem_available_bytes=BIG_RAM)
    ptr2 = fake_cuda.registered[1][0]
    del host
    gc.collect()
    assert fake_cuda.unregistered == [ptr, ptr2]


@pytest.mark.parametrize("device, synced", [(None, None), (torch.device("cuda", 1), 1)], ids=["current", "cuda:1"])
def test_a_dropped_pinned_buffer_waits_for_its_device_before_it_is_unregistered(fake_cuda, monkeypatch, device, synced):
    """Copies still queued on the device may use the memory of a pool dropped without close(): its
    device's work lands before the memory is unregistered (and then unmapped)."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: events.append(("synchronize", index)))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    unregister = fake_cuda.cudaHostUnregister
    monkeypatch.setattr(fake_cuda, "cudaHostUnregister", lambda ptr: (events.append(("unregister", ptr)),
                                                                      unregister(ptr))[1])  # fmt: skip
    buf = host_memory.empty_host((4, 1024), torch.float16, pin=True, device=device)
    ((ptr, _, _),) = fake_cuda.registered
    assert events == []
    del buf
    gc.collect()
    assert events == [("synchronize", synced), ("unregister", ptr)]


def test_failed_register_raises_naming_it(monkeypatch):
    fake = FakeCudart(fail_with=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    dev = dev_pool()
    total = 80 * dev.bytes_per_slot
    with pytest.raises(
        RuntimeError,
        match=rf"pin_memory: cudaHostRegister of {rounded(total)} bytes \({total} bytes .* failed: out of memory "
        r"\(cudaError 2\)",
    ):
        HostKVPool(dev, ratio=2.5, pin_memory=True, mem_available_bytes=BIG_RAM)
    gc.collect()
    assert fake.registered == [] and fake.unregistered == []  # nothing registered, nothing to undo


def test_ram_check_counts_the_pinned_pages(fake_cuda):
    dev = dev_pool()
    total = 80 * dev.bytes_per_slot  # 15360 bytes: pinned, 16384
    assert total % PAGE and rounded(total) > total
    with pytest.raises(
        ValueError, match=rf"ratio: host pool of .* \(80 slots x 192 bytes, {rounded(total)} bytes pinned in whole"
    ):
        HostKVPool(dev, ratio=2.5, pin_memory=True, mem_available_bytes=total + 2 * GIB)
    assert fake_cuda.registered == []  # refused before anything was allocated
    host = HostKVPool(dev, ratio=2.5, pin_memory=True, mem_available_bytes=rounded(total) + 2 * GIB)
    assert host.allocated_bytes == rounded(total)
    # A pageable pool of the same size takes exactly its bytes, so the unrounded RAM is enough for it.
    assert HostKVPool(dev, ratio=2.5, mem_available_bytes=total + 2 * GIB).allocated_bytes == total


def test_pageable_pool_takes_exactly_its_bytes(fake_cuda):
    host = HostKVPool(dev_pool(), ratio=2.5, mem_available_bytes=BIG_RAM)
    assert not host.pinned and host.pinned_bytes == 0
    assert host.allocated_bytes == host.total_bytes == host.buffer.untyped_storage().nbytes() == 80 * 192
    assert fake_cuda.registered == []
    assert repr(host).endswith("pageable)")


@pytest.mark.gpu
@pytest.mark.parametrize("ratio, head_dim", SIZES, ids=["80x192B", "64x192B", "64x48KiB"])
def test_cuda_pinned_pool_is_pinned_and_exact(ratio, head_dim):
    dev = dev_pool(head_dim=head_dim, device="cuda")
    host = HostKVPool(dev, layout="page_first_direct", ratio=ratio)  # pinned by default for a CUDA pool
    total = host.size * dev.bytes_per_slot
    assert host.pinned and host.buffer.is_pinned()
    assert host.buffer.data_ptr() % PAGE == 0 and host.buffer.untyped_storage().nbytes() == total
    assert host.pinned_bytes == rounded(total)
    torch.manual_seed(5)
    for pool in (dev.k, dev.v):
        pool.view(torch.uint8).random_(0, 256)
    d, h, d2 = dev.alloc(8), host.alloc(8), dev.alloc(8)
    for backend in ("direct", "kernel"):
        kw = dict(layout=host.layout, page_size=host.page_size, backend=backend)
        ops.backup_all_layers(dev.device_k, dev.device_v, host.buffer, d.cuda(), h.cuda(), **kw)
        ops.load_all_layers(dev.device_k, dev.device_v, host.buffer, d2.cuda(), h.cuda(), **kw)
        torch.cuda.synchronize()
        for pool in (dev.k, dev.v):
            assert same_bytes(pool[:, d2.cuda()], pool[:, d.cuda()])


def test_cache_metrics_report_the_pinned_bytes(fake_cuda):
    from hicache.controller import HiCacheController

    dev = dev_pool()
    host = HostKVPool(dev, layout="page_first", ratio=2.5, pin_memory=True, mem_available_bytes=BIG_RAM)
    ctrl = HiCacheController(dev, host, io_backend="direct", threaded=False)
    assert ctrl.metrics.host_pinned_bytes == host.pinned_bytes == rounded(host.total_bytes)
    assert ctrl.metrics.as_dict()["host_pinned_bytes"] == host.pinned_bytes
    ctrl.close()
    pageable = HostKVPool(dev, layout="page_first", ratio=2.5, mem_available_bytes=BIG_RAM)
    assert HiCacheController(dev, pageable, io_backend="direct", threaded=False).metrics.host_pinned_bytes == 0


def test_pinned_memory_is_registered_with_the_pools_device_current(fake_cuda, monkeypatch):
    """cudaHostRegister acts on the current device's context: a TP rank whose pools are on cuda:1 and
    that never made cuda:1 current must not register (and create a context) on GPU 0."""
    current = ["cuda:0"]
    seen = []

    class Device:  # stands in for torch.cuda.device: makes its device current for the block
        def __init__(self, device):
            self.device, self.before = str(device), None

        def __enter__(self):
            self.before, current[0] = current[0], self.device

        def __exit__(self, *exc):
            current[0] = self.before

    real_register = fake_cuda.cudaHostRegister
    monkeypatch.setattr(fake_cuda, "cudaHostRegister", lambda *a: seen.append(current[0]) or real_register(*a))
    monkeypatch.setattr(torch.cuda, "device", Device)
    buf = host_memory.empty_host((4, 1024), torch.float16, pin=True, device=torch.device("cuda", 1))
    assert seen == ["cuda:1"] and current == ["cuda:0"] and buf.shape == (4, 1024)
    host_memory.empty_host((4, 1024), torch.float16, pin=True)  # no device named: the current one
    assert seen == ["cuda:1", "cuda:0"]


# ---------------------------------------------------------------------------------------------------
# Set-up at serving size: pages populated by several threads before the pool is pinned (issue 32 #7)
# ---------------------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


def resident(ptr: int, nbytes: int) -> list[int]:
    """Per OS page of ``[ptr, ptr + nbytes)``: 1 when it is in RAM (mincore), else 0."""
    vec = (ctypes.c_ubyte * (nbytes // PAGE))()
    assert _libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return [v & 1 for v in vec]


def test_mincore_sees_pages_not_yet_touched():
    """The control for the tests below: a fresh mapping is not resident until written."""
    mem = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    assert resident(ptr, 8 * PAGE) == [0] * 8
    mem[3 * PAGE] = 1
    assert resident(ptr, 8 * PAGE) == [0, 0, 0, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("populate", ["madvise", "write"])
def test_threads_populate_every_page(monkeypatch, threads, populate):
    """Every page of the mapping (the last one's tail too) is resident and zero after set-up, with any
    thread count, also where the kernel lacks MADV_POPULATE_WRITE (the strided write)."""
    monkeypatch.setattr(host_memory, "_SMALL_BYTES", 0)  # several threads even for a small buffer
    if populate == "write":
        monkeypatch.setattr(host_memory, "_MADV_POPULATE_WRITE", 0x7FFF)  # EINVAL, as before Linux 5.14
    shape = (37, 1000)  # 74,000 bytes: 19 OS pages, the last one partly
    buf, report = host_memory.make_host(shape, torch.float16, pin=False, setup=host_memory.HostSetup(threads=threads))
    assert report.nbytes == rounded(buf.numel() * 2) and report.threads == threads
    assert report.populate == populate and report.populate_s > 0 and report.register_s == 0.0
    assert resident(buf.data_ptr(), report.nbytes) == [1] * (report.nbytes // PAGE)
    assert not buf.any()
    random_bytes_(buf, torch.Generator().manual_seed(5))
    assert ctypes.string_at(buf.data_ptr(), buf.numel() * 2) == flat_bytes(buf)


def test_a_pinned_pool_is_populated_before_it_is_registered(fake_cuda, monkeypatch):
    """cudaHostRegister finds every page resident: the threads did the faulting, not the registration."""
    seen = []
    register = fake_cuda.cudaHostRegister

    def looking(ptr: int, nbytes: int, flags: int) -> int:
        seen.append(resident(ptr, nbytes))
        return register(ptr, nbytes, flags)

    monkeypatch.setattr(fake_cuda, "cudaHostRegister", looking)
    monkeypatch.setattr(host_memory, "_SMALL_BYTES", 0)
    host = HostKVPool(dev_pool(), ratio=2.5, pin_memory=True, mem_available_bytes=BIG_RAM,
                      setup=host_memory.HostSetup(threads=2))  # fmt: skip
    ((ptr, nbytes, _),) = fake_cuda.registered
    assert seen == [[1] * (nbytes // PAGE)]
    r = host.setup_report
    assert (r.nbytes, r.threads, r.populate) == (nbytes, 2, "madvise") and r.register_s > 0


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(threads=0), ValueError, "threads"),
        (dict(threads=-2), ValueError, "threads"),
        (dict(threads=True), ValueError, "threads"),
        (dict(threads=2.0), ValueError, "threads"),
        (dict(huge_pages="yes"), TypeError, "huge_pages"),
        (dict(numa_node=-1), ValueError, "numa_node"),
        (dict(numa_node=4096), ValueError, "numa_node: node 4096 has no memory here"),
    ],
)
def test_setup_arguments_checked(kw, error, match):
    with pytest.raises(error, match=match):
        host_memory.HostSetup(**kw)


def test_a_pool_refuses_a_setup_of_the_wrong_type(fake_cuda):
    with pytest.raises(TypeError, match="setup: expected a host_memory.HostSetup"):
        HostKVPool(dev_pool(), ratio=2.5, pin_memory=True, mem_available_bytes=BIG_RAM, setup={"threads": 2})
    assert fake_cuda.registered == []  # nothing pinned


def vm_flags(ptr: int) -> list[str]:
    """The VmFlags /proc/self/smaps lists for the mapping that starts at ``ptr``."""
    found = False
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split(" ")[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            found = head.split("-")[0] == f"{ptr:x}"
        elif found and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping starts at {ptr:#x} in /proc/self/smaps")


def test_numa_node_binds_the_whole_mapping_before_it_is_populated(monkeypatch):
    """Machine-independent: the node is bound over the whole mapping while no page is resident yet
    (a page faulted in before the binding stays where it landed)."""
    calls = []
    monkeypatch.setattr(host_memory, "numa_nodes", lambda: [0, 3])
    monkeypatch.setattr(host_memory, "_bind", lambda libc, ptr, size, node: calls.append(
        (ptr, size, node, sum(resident(ptr, size)))))  # fmt: skip
    buf, report = host_memory.make_host((3, 5000), torch.float16, pin=False,
                                        setup=host_memory.HostSetup(numa_node=3))  # fmt: skip
    assert calls == [(buf.data_ptr(), report.nbytes, 3, 0)] and report.numa_node == 3


@pytest.mark.skipif(0 not in host_memory.numa_nodes(), reason="no NUMA node 0 with memory here")
def test_pages_bound_to_the_numa_node():
    buf, report = host_memory.make_host((64, 1024), torch.float16, pin=False,
                                        setup=host_memory.HostSetup(numa_node=0))  # fmt: skip
    assert report.numa_node == 0
    lines = open("/proc/self/numa_maps").read().splitlines()
    mine = [x.split() for x in lines if x.startswith(f"{buf.data_ptr():x} ")]
    assert len(mine) == 1 and mine[0][1] == "bind:0", mine
    assert not buf.any()


def test_huge_pages_advised_where_the_kernel_honours_it():
    buf, report = host_memory.make_host((64, 1024), torch.float16, pin=False,
                                        setup=host_memory.HostSetup(huge_pages=True))  # fmt: skip
    mode = host_memory._thp_mode()
    if mode in ("always", "madvise"):
        assert report.huge_pages and report.huge_pages_note == ""
        assert "hg" in vm_flags(buf.data_ptr())  # the kernel recorded the advice on this mapping
    else:
        assert not report.huge_pages and report.huge_pages_note
    plain = host_memory.make_host((64, 1024), torch.float16, pin=False)[1]
    assert not plain.huge_pages and plain.huge_pages_note == ""
