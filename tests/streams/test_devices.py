"""The stream devices' streams: the controller's load stream asks for the highest priority (a forward
waits for its layers), its write stream for the default (backups are not on the forward's path)."""

from __future__ import annotations

import pytest
import torch

from hicache.controller import HiCacheController
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.streams import CudaDevice
from hicache.streams.deferred import DeferredDevice
from hicache.streams.devices import HIGHEST_PRIORITY


def pools(device="cpu", pin=False):
    dev = DeviceKVPool(num_slots=32, num_layers=2, head_num=2, head_dim=4, dtype=torch.float16, device=device)
    return dev, HostKVPool(dev, layout="page_first", ratio=2.0, pin_memory=pin)


def test_the_cuda_device_asks_torch_for_the_highest_priority(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: made.append(kw) or object())
    d = CudaDevice(torch.device("cuda", 1))
    d.new_stream("load", high_priority=True)
    d.new_stream("write")
    gpu1 = torch.device("cuda", 1)
    assert made == [dict(device=gpu1, priority=HIGHEST_PRIORITY), dict(device=gpu1)]
    assert HIGHEST_PRIORITY < -100  # below any device's range: clamped to its highest


@pytest.mark.parametrize("threaded", [False, True])
def test_the_controller_loads_on_a_high_priority_stream(threaded):
    dev, host = pools()
    model = DeferredDevice(0)
    ctrl = HiCacheController(dev, host, io_backend="direct", threaded=threaded, device_model=model)
    try:
        assert ctrl._load_stream.high_priority and not ctrl._write_stream.high_priority
    finally:
        ctrl.close()


@pytest.mark.gpu
def test_gpu_the_load_stream_has_the_devices_highest_priority():
    dev, host = pools("cuda", pin=True)
    ctrl = HiCacheController(dev, host, io_backend="kernel", threaded=False)
    try:
        least, greatest = torch.cuda.Stream.priority_range()
        assert ctrl._load_stream.priority == greatest and ctrl._write_stream.priority == 0
        assert greatest < least  # the device has priorities: the load stream's is above the default
    finally:
        ctrl.close()
