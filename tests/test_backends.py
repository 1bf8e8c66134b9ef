"""Backend plumbing on CPU: auto's choice and persisted thresholds, batch's fallbacks, the device
each launch runs on, what an old CUDA driver makes unavailable, and the arguments the kernel backend
hands to the extension (a recording fake stands in for CUDA, and one for torch.cuda.device)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import hicache_kernels
from hicache_kernels import BackendUnavailableError, _ext, backends, ops
from hicache_kernels.backends import AutoBackend, BatchBackend, DirectBackend, KernelBackend, get_backend

from kvdata import expected_after, make_indices, make_pools

needs_extension = pytest.mark.skipif(
    not hicache_kernels.build_info()["cuda_built"], reason="the CUDA extension was not built (HICACHE_SKIP_CUDA)"
)


def plan_for(layout="page_first", page_size=1, mla=False, direction="d2h"):
    pools = make_pools(layout=layout, mla=mla, dtype=torch.float16, page_size=page_size, direction=direction)
    d_idx, h_idx = make_indices("pages", 96, 48 if page_size == 1 else 4 * page_size, page_size, count=8, seed=0)
    plan = ops.build_plan(direction, pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout=layout,
                          page_size=page_size)  # fmt: skip
    return plan, pools


class FakeStream:
    def __init__(self, handle: int, device: torch.device | None = None) -> None:
        self.cuda_stream = handle
        self.device = device


class CurrentDevice:
    """Stands in for the class ``torch.cuda.device`` (torch itself checks ``isinstance`` against it):
    a guard that makes its device current and restores the previous one on exit. ``current`` is per
    subclass, so each test gets its own (``cuda:0`` to start, see :func:`pretend_cuda`)."""

    current = torch.device("cuda", 0)

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def __enter__(self) -> None:
        self.previous = type(self).current
        type(self).current = self.device

    def __exit__(self, *exc: object) -> None:
        type(self).current = self.previous


def pretend_cuda(monkeypatch, handle=7, runtime_ok=True):
    """Make backends treat the (CPU) plan as a CUDA one with the given stream handle. The extension's
    runtime counts as runnable unless ``runtime_ok`` is None (then the real check decides). Returns
    the fake current device."""
    monkeypatch.setattr(backends, "_stream", lambda plan: FakeStream(handle))
    monkeypatch.setattr(backends, "_cuda_reason", lambda plan: None)
    monkeypatch.setattr(backends, "_pinned_reason", lambda plan: None)
    monkeypatch.setattr(backends.Side, "is_cuda", property(lambda self: True))
    if runtime_ok is not None:
        monkeypatch.setattr(backends, "cuda_runtime_status", lambda: (True, "ok"))
    current = type("CurrentDeviceOfThisTest", (CurrentDevice,), {"current": torch.device("cuda", 0)})
    monkeypatch.setattr(torch.cuda, "device", current)
    return current


ERROR_NAMES = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    36: "cudaErrorCallRequiresNewerDriver",
    400: "cudaErrorInvalidResourceHandle",
    801: "cudaErrorNotSupported",
}


class RecordingExt:
    """Records each call, and in ``devices`` which device the fake guard had made current then."""

    def __init__(self, batch_code=0, current: type[CurrentDevice] | None = None):
        self.calls = []
        self.devices = []
        self.batch_code = batch_code
        self.current = current

    def __getattr__(self, name):
        def record(*args):
            self.calls.append((name, args))
            self.devices.append(None if self.current is None else self.current.current)
            if name == "memcpy_batch":
                return self.batch_code
            if name == "error_name":
                return ERROR_NAMES[args[0]]
            if name == "host_device_pointer":
                return args[0]
            return None

        return record


def test_auto_thresholds_round_trip(tmp_path):
    path = tmp_path / "auto.json"
    auto = AutoBackend(thresholds={"kernel_max_fragment_bytes": 4096}, path=path)
    assert auto.save() == path
    assert json.loads(path.read_text()) == {"kernel_max_fragment_bytes": 4096}
    assert AutoBackend(path=path).thresholds["kernel_max_fragment_bytes"] == 4096


def test_auto_config_from_environment(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"kernel_max_fragment_bytes": 123}))
    monkeypatch.setenv("HICACHE_AUTO_CONFIG", str(path))
    assert AutoBackend().thresholds["kernel_max_fragment_bytes"] == 123


def test_auto_rejects_unknown_thresholds(tmp_path):
    with pytest.raises(ValueError, match="thresholds: unknown keys"):
        AutoBackend(thresholds={"fragment": 1})
    bad = tmp_path / "auto.json"
    bad.write_text(json.dumps({"kernel_max": 1}))
    with pytest.raises(ValueError, match="unknown auto thresholds"):
        AutoBackend(path=bad)


def test_auto_on_cpu_uses_direct():
    plan, _ = plan_for()
    auto = AutoBackend(thresholds={})
    auto.run(plan)
    assert auto.last_choice == "direct"


@pytest.mark.parametrize(
    ("page_size", "threshold", "handle", "expected"),
    [
        (1, 4096, 7, "kernel"),  # 32-byte fragments (one fp16 item of 2 x 8), below the threshold
        (16, 64, 7, "batch"),  # fragments above it, on a side stream
        (16, 64, 0, "direct"),  # above it, on the legacy default stream that batch refuses
        (16, 64, 1, "direct"),  # the same through the cudaStreamLegacy handle
    ],
)
def test_auto_choice(monkeypatch, page_size, threshold, handle, expected):
    pretend_cuda(monkeypatch, handle)
    plan, _ = plan_for(layout="page_first_direct", page_size=page_size)
    auto = AutoBackend(thresholds={"kernel_max_fragment_bytes": threshold})
    assert auto.choose(plan).name == expected


def test_batch_issues_one_call_with_all_pieces(monkeypatch):
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    plan, _ = plan_for(layout="layer_first", page_size=1)
    BatchBackend().run(plan)
    (name, args), = ext.calls  # fmt: skip
    assert name == "memcpy_batch"
    count, direction, stream = args[3], args[4], args[5]
    assert (direction, stream) == (0, 7)
    assert count == 2 * 3 * 2  # 2 runs of 4 slots x 3 layers x K/V; layer-first runs are contiguous


@pytest.mark.parametrize(
    ("handle", "code", "reason", "called"),
    [
        (0, 0, "legacy default stream", False),  # the NULL stream: recognised, never handed to the call
        (1, 0, "legacy default stream", False),  # cudaStreamLegacy, likewise
        (7, 801, "cudaErrorNotSupported", True),
        (7, 36, "cudaErrorCallRequiresNewerDriver", True),
    ],
)
def test_batch_falls_back_to_direct_and_says_so(monkeypatch, handle, code, reason, called):
    pretend_cuda(monkeypatch, handle)
    ext = RecordingExt(batch_code=code)
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    plan, _ = plan_for()
    batch = BatchBackend()
    with pytest.warns(RuntimeWarning, match=reason):
        batch.run(plan)
    assert reason in batch.last_fallback
    assert ("memcpy_batch" in [name for name, _ in ext.calls]) is called
    assert ext.calls[-1][0] == "memcpy_fragments"


@pytest.mark.parametrize("code", [1, 400, 2], ids=lambda c: ERROR_NAMES[c])
def test_batch_raises_on_other_errors(monkeypatch, recwarn, code):
    """A misused call (cudaErrorInvalidValue, cudaErrorInvalidResourceHandle) or any other failure
    raises, naming the error: it must not pass for a working backend by falling back."""
    pretend_cuda(monkeypatch)
    ext = RecordingExt(batch_code=code)
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    plan, _ = plan_for()
    batch = BatchBackend()
    with pytest.raises(RuntimeError, match=f"cudaMemcpyBatchAsync failed: {ERROR_NAMES[code]}"):
        batch.run(plan)
    assert not [w for w in recwarn if "fell back" in str(w.message)]
    assert batch.last_fallback is None
    assert "memcpy_fragments" not in [name for name, _ in ext.calls]


@pytest.mark.parametrize(
    ("layout", "head_num", "head_dim", "align"), [("page_first", 2, 8, 16), ("page_head", 3, 3, 2)]
)
def test_kernel_backend_passes_geometry_and_alignment(monkeypatch, layout, head_num, head_dim, align):
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    table = torch.zeros(6, dtype=torch.int64)
    monkeypatch.setattr(KernelBackend, "device_table", lambda self, side: table)
    pools = make_pools(layout=layout, mla=False, dtype=torch.float16, page_size=4, head_num=head_num,
                       head_dim=head_dim)  # fmt: skip
    d_idx, h_idx = make_indices("random", 96, 16, 4, count=5, seed=1)
    plan = ops.build_plan("h2d", pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout=layout,
                          page_size=4, layer_id=2)  # fmt: skip
    KernelBackend(num_blocks=3, warps_per_block=8).run(plan)
    name, args = ext.calls[-1]
    assert name == "transfer"
    src_desc, src_table, dst_desc, dst_table = args[:4]
    assert (src_table, dst_table) == (False, True)
    assert src_desc[0] == pools.host.data_ptr() and src_desc[1:] == plan.src.desc()[1:]
    assert dst_desc[0] == table.data_ptr() and dst_desc[1:] == plan.dst.desc()[1:]
    n, layer_begin, layer_count, num_kv, num_chunks, chunk_bytes, got_align, blocks, warps = args[6:15]
    assert (n, layer_begin, layer_count, num_kv, num_chunks) == (5, 2, 1, 2, plan.num_chunks)
    assert chunk_bytes == plan.chunk_bytes and (blocks, warps) == (3, 8)
    # The greatest common divisor of every address, stride and size the kernel will use.
    used = [pools.host.data_ptr(), *plan.dst.table, chunk_bytes, *plan.src.desc()[2:7], *plan.dst.desc()[2:7]]
    assert got_align == math.gcd(*used)
    assert got_align % align == 0


def test_kernel_backend_passes_a_skip_counter_only_when_asked(monkeypatch):
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    monkeypatch.setattr(KernelBackend, "device_table", lambda self, side: torch.zeros(6, dtype=torch.int64))
    plan, _ = plan_for()
    KernelBackend().run(plan)
    assert ext.calls[-1][1][15] == 0
    counting = KernelBackend(count_skipped=True)
    counting.run(plan)
    counter = counting._skipped[plan.src.device]
    assert ext.calls[-1][1][15] == counter.data_ptr()
    counter.fill_(7)  # as the kernel would after skipping units
    assert counting.skipped() == 7 and counting.skipped() == 0
    with pytest.raises(ValueError, match="count_skipped"):
        KernelBackend().skipped()


def test_registry():
    assert get_backend("direct") is get_backend("direct")
    assert get_backend("kernel", num_blocks=2) is not get_backend("kernel")
    assert isinstance(get_backend("auto"), AutoBackend)
    with pytest.raises(ValueError, match="backend: expected one of direct, batch, kernel, triton, auto"):
        get_backend("nvme")


# ------------------------------------------------------------- the device each launch runs on (#5)


def on_second_gpu(monkeypatch):
    """The plan's device pool (its table side) counts as living on cuda:1; the host pool stays on the CPU."""
    second = torch.device("cuda", 1)
    monkeypatch.setattr(
        backends.Side, "device", property(lambda self: second if self.is_table else torch.device("cpu"))
    )


LAUNCHES = {KernelBackend: "transfer", DirectBackend: "memcpy_fragments", BatchBackend: "memcpy_batch"}


@pytest.mark.parametrize("backend", LAUNCHES, ids=lambda b: b.name)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_launches_run_on_the_device_pools_device(monkeypatch, backend, direction):
    """With cuda:0 current and the device pool on cuda:1, every extension call runs with cuda:1
    current, and cuda:0 is current again afterwards."""
    current = pretend_cuda(monkeypatch)
    ext = RecordingExt(current=current)
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    monkeypatch.setattr(KernelBackend, "device_table", lambda self, side: torch.zeros(6, dtype=torch.int64))
    # Moving the indices to a CUDA device is what the CPU cannot do: the launch gets them as they are.
    as_they_are = staticmethod(lambda plan, device, stream: [plan.src_indices, plan.dst_indices])
    monkeypatch.setattr(KernelBackend, "_launch_indices", as_they_are)
    on_second_gpu(monkeypatch)
    plan, _ = plan_for(direction=direction)
    backend().run(plan)
    assert LAUNCHES[backend] in [name for name, _ in ext.calls]
    assert ext.devices and all(d == torch.device("cuda", 1) for d in ext.devices), ext.devices
    assert current.current == torch.device("cuda", 0)


def test_a_stream_on_another_device_is_refused(monkeypatch):
    monkeypatch.setattr(backends.Side, "is_cuda", property(lambda self: True))
    on_second_gpu(monkeypatch)
    plan, _ = plan_for()
    plan = dataclasses.replace(plan, stream=FakeStream(7, torch.device("cuda", 0)))
    with pytest.raises(
        ValueError, match=r"stream: expected a stream on the device pool's device cuda:1, got one on cuda:0"
    ):
        backends._stream(plan)
    assert backends._stream(dataclasses.replace(plan, stream=FakeStream(7, torch.device("cuda", 1)))).cuda_stream == 7


# --------------------------------------------------------------- what an old driver allows (#6)

# Versions chosen for a CUDA 13 build: 12.4 and 12.9 drivers cannot run its static runtime, 13.x can.
needs_cuda13_build = pytest.mark.skipif(
    not hicache_kernels.build_info().get("cuda_version", 0) // 1000 == 13,
    reason="needs the extension built with CUDA 13",
)


def driver(monkeypatch, version: int) -> None:
    """Make the package see a driver supporting CUDA ``version`` (0: no driver)."""
    monkeypatch.setattr(_ext, "driver_version", lambda: version)


@needs_cuda13_build
@pytest.mark.parametrize(
    ("version", "ok", "says"),
    [
        (0, False, "no CUDA driver is installed (cudaDriverGetVersion returned 0); the extension's static CUDA 13.0 "
                   "runtime needs an NVIDIA driver supporting CUDA 13.0 or newer"),
        (12040, False, "the NVIDIA driver supports CUDA 12.4, older than the CUDA 13.0 the extension's static CUDA "
                       "13.0 runtime needs: update the driver"),
        (12090, False, "the NVIDIA driver supports CUDA 12.9, older than the CUDA 13.0"),
        (13000, True, "ok"),
        (13020, True, "ok"),  # minor-version compatibility: any 13.x driver runs a 13.x runtime
    ],
)  # fmt: skip
def test_cuda_runtime_status_names_the_driver(monkeypatch, version, ok, says):
    driver(monkeypatch, version)
    got_ok, reason = _ext.cuda_runtime_status()
    assert got_ok is ok and reason.startswith(says)
    if version == 0:
        assert "older" not in reason
    if not ok:
        with pytest.raises(BackendUnavailableError) as refused:
            _ext.load_cuda_extension()
        assert str(refused.value) == reason


@needs_cuda13_build
@pytest.mark.parametrize("backend", [KernelBackend, BatchBackend], ids=lambda b: b.name)
def test_kernel_and_batch_say_the_driver_is_too_old(monkeypatch, backend):
    pretend_cuda(monkeypatch, runtime_ok=None)
    ext = RecordingExt()
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    plan, _ = plan_for()
    driver(monkeypatch, 12040)
    assert "the NVIDIA driver supports CUDA 12.4, older than the CUDA 13.0" in backend().unavailable(plan)
    with pytest.raises(
        BackendUnavailableError, match=rf"io-backend '{backend.name}': the NVIDIA driver supports CUDA 12\.4"
    ):
        backend().run(plan)
    assert ext.calls == []  # refused before anything reached the extension
    driver(monkeypatch, 13000)
    assert backend().unavailable(plan) is None


@needs_cuda13_build
@pytest.mark.parametrize(
    ("version", "small", "large"), [(12040, "direct", "direct"), (0, "direct", "direct"), (13000, "kernel", "batch")]
)
def test_auto_picks_what_the_driver_can_run(monkeypatch, version, small, large):
    pretend_cuda(monkeypatch, runtime_ok=None)
    driver(monkeypatch, version)
    small_plan, _ = plan_for(layout="page_first_direct", page_size=1)  # 32-byte fragments
    large_plan, _ = plan_for(layout="page_first_direct", page_size=16)  # 512-byte fragments
    auto = AutoBackend(thresholds={"kernel_max_fragment_bytes": 64})
    assert (auto.choose(small_plan).name, auto.choose(large_plan).name) == (small, large)


@needs_cuda13_build
@pytest.mark.parametrize(("version", "through_extension"), [(12040, False), (13000, True)])
def test_direct_copies_with_torch_when_the_driver_is_too_old(monkeypatch, version, through_extension):
    pretend_cuda(monkeypatch, runtime_ok=None)
    ext = RecordingExt()
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    driver(monkeypatch, version)
    plan, pools = plan_for()
    expected = expected_after(pools, "d2h", plan.src_indices, plan.dst_indices, None)
    DirectBackend().run(plan)
    assert ("memcpy_fragments" in [name for name, _ in ext.calls]) is through_extension
    if not through_extension:  # the torch copies really ran (on these CPU tensors)
        assert pools.equal(expected)


@pytest.mark.parametrize("backend", [DirectBackend, BatchBackend, AutoBackend], ids=lambda b: b.name)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_cpu_tensors_need_no_driver(monkeypatch, backend, direction):
    """CPU pools are copied with torch whatever the driver: none at all here."""
    monkeypatch.setattr(_ext, "driver_version", lambda: 0)
    plan, pools = plan_for(direction=direction)
    d_idx, h_idx = (plan.src_indices, plan.dst_indices) if direction == "d2h" else (plan.dst_indices, plan.src_indices)
    expected = expected_after(pools, direction, d_idx, h_idx, None)
    b = backend(thresholds={}) if backend is AutoBackend else backend()
    assert b.unavailable(plan) is None
    b.run(plan)
    assert pools.equal(expected)


# ---------------------------------------------------------------------------------------------- prepare
@pytest.mark.parametrize("name", ["direct", "batch"])
def test_prepared_copy_plans_once_and_copies_current_contents(monkeypatch, name):
    """CPU tensors: fragments are planned by prepare() alone; each issue copies what the source holds
    then, byte for byte as the reference does."""
    plan, pools = plan_for(page_size=4)
    planned = []
    real_plan = backends.plan_fragments
    monkeypatch.setattr(backends, "plan_fragments", lambda p: planned.append(p) or real_plan(p))
    copy = get_backend(name).prepare(plan)
    assert len(planned) == 1
    d_idx, h_idx = plan.src_indices, plan.dst_indices
    for round_ in range(3):
        for layer in pools.layers(pools.device_k):
            layer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(round_))
        expected = expected_after(pools, "d2h", d_idx, h_idx, None)
        copy()
        assert pools.equal(expected), f"issue {round_} did not copy the source's current bytes"
    assert len(planned) == 1  # issuing never planned again


@pytest.mark.parametrize("name", ["direct", "batch", "kernel"])
def test_prepare_does_the_host_work_and_issue_only_calls_the_extension(monkeypatch, name):
    plan, _ = plan_for(page_size=4)
    current = pretend_cuda(monkeypatch)
    ext = RecordingExt(current=current)
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    monkeypatch.setattr(KernelBackend, "_launch_indices", staticmethod(lambda plan, device, stream: [
        plan.src_indices, plan.dst_indices]))  # fmt: skip
    copy = get_backend(name).prepare(plan)
    launches = {"direct": "memcpy_fragments", "batch": "memcpy_batch", "kernel": "transfer"}[name]
    assert [c for c, _ in ext.calls if c == launches] == []  # nothing issued by prepare
    before = len(ext.calls)
    monkeypatch.setattr(backends, "plan_fragments", lambda p: pytest.fail("planned at issue"))
    monkeypatch.setattr(KernelBackend, "_desc", lambda self, side: pytest.fail("described at issue"))
    copy()
    copy()
    issued = ext.calls[before:]
    assert [c for c, _ in issued] == [launches, launches]  # issue: the launch, nothing else
    assert issued[0] == issued[1]  # the same arguments (arrays built once, kept alive)
    # Each issue ran with the pool's device made current (the fake guard starts on cuda:0).
    assert ext.devices[before:] == [backends._device_side(plan).device] * 2


def test_prepare_refuses_an_unavailable_backend_before_any_work(monkeypatch):
    plan, _ = plan_for()
    monkeypatch.setattr(backends, "plan_fragments", lambda p: pytest.fail("planned for a backend that cannot run"))
    with pytest.raises(BackendUnavailableError, match="io-backend 'kernel'"):
        get_backend("kernel").prepare(plan)


# ---------------------------------------------------------------------------------------------- old drivers elsewhere
@needs_extension
def test_triton_host_alias_asks_the_extension_only_when_its_runtime_can_run(monkeypatch):
    from hicache_kernels import triton_transfer

    asked = []

    class Ext:
        @staticmethod
        def host_device_pointer(p: int) -> int:
            asked.append(p)
            return p + 1

    monkeypatch.setattr(triton_transfer, "load_extension", lambda: Ext)
    monkeypatch.setattr(_ext, "driver_version", lambda: 12040)  # too old for the CUDA 13 runtime
    assert triton_transfer._device_alias(4096) == 4096 and asked == []  # UVA: the host address, no call
    monkeypatch.setattr(_ext, "driver_version", lambda: 13000)
    assert triton_transfer._device_alias(4096) == 4097 and asked == [4096]


@needs_extension
def test_pcie_says_the_driver_is_too_old_for_the_kernel(monkeypatch):
    from hicache_kernels import pcie

    monkeypatch.setattr(_ext, "driver_version", lambda: 12040)
    reason = pcie.kernel_unavailable(0)
    assert reason is not None and "12.4" in reason and "older than" in reason


@pytest.mark.parametrize("name", [["kernel"], {"kernel": 1}, None, 3])
def test_get_backend_names_its_argument(name):
    with pytest.raises(TypeError, match="backend: expected a backend name"):
        get_backend(name)
