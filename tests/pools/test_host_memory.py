"""Tests of hicache.pools.host_memory through HostKVPool: a pinned pool pins exactly its bytes (rounded up to OS
pages only, never to a power of two), aliases that memory, is unregistered when its last tensor goes, and
its RAM check counts what the allocation takes.

Without a GPU the CUDA runtime's register calls are a recording fake (the one thing a CPU cannot reach);
the memory, its mapping and the tensor over it are real. The ``gpu`` test pins for real."""

from __future__ import annotations

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
