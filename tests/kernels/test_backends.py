"""Backend plumbing on CPU: auto's choice and persisted thresholds, batch's fallbacks, the device
each launch runs on, what an old CUDA driver makes unavailable, and the arguments the kernel backend
hands to the extension (a recording fake stands in for CUDA, one for torch.cuda.device, and a CPU
table builder for the device tables)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable

import pytest
import torch

import hicache_kernels
from hicache_kernels import BackendUnavailableError, _ext, launch, ops
from hicache_kernels.backends import (
    AutoBackend,
    BatchBackend,
    DirectBackend,
    KernelBackend,
    base,
    copy_engine,
    get_backend,
)
from hicache_kernels.backends import kernel as kernel_module

from kvdata import expected_after, make_indices, make_pools

needs_extension = pytest.mark.skipif(
    not hicache_kernels.build_info()["cuda_built"], reason="the CUDA extension was not built (HICACHE_SKIP_CUDA)"
)

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def as_cuda(plan, device=CUDA0):
    """``plan`` as if its device pool were on ``device`` with a pinned host pool (the CPU tensors stay
    where they are: the fakes below stand in for everything that would touch them as CUDA memory)."""
    return dataclasses.replace(plan, route=dataclasses.replace(plan.route, device=device, gpu_addressable=True))


def plan_for(layout="page_first", page_size=1, mla=False, direction="d2h", device=None):
    """A plan over fresh pools (on the CPU, or ``device`` for pretend-CUDA tests, see :func:`as_cuda`)."""
    pools = make_pools(layout=layout, mla=mla, dtype=torch.float16, page_size=page_size, direction=direction)
    d_idx, h_idx = make_indices("pages", 96, 48 if page_size == 1 else 4 * page_size, page_size, count=8, seed=0)
    plan = ops.build_plan(direction, pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout=layout,
                          page_size=page_size)  # fmt: skip
    return (plan if device is None else as_cuda(plan, device)), pools


class FakeStream:
    def __init__(self, handle: int, device: torch.device | None = None) -> None:
        self.cuda_stream = handle
        self.device = device


class CurrentDevice:
    """Stands in for the class ``torch.cuda.device`` (torch itself checks ``isinstance`` against it):
    a guard that makes its device current and restores the previous one on exit. ``current`` is per
    subclass, so each test gets its own (``cuda:0`` to start, see :func:`pretend_cuda`)."""

    current = torch.device("cuda", 0)

    def __init__(self, device: torch.device | int) -> None:
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)

    def __enter__(self) -> None:
        self.previous = type(self).current
        type(self).current = self.device

    def __exit__(self, *exc: object) -> None:
        type(self).current = self.previous


class Tables:
    """Device tables built on the CPU, recording each build (``built``) and each (table, stream
    handle) the launch told the allocator about (``streams``)."""

    def __init__(self) -> None:
        self.built: list[torch.Tensor] = []
        self.streams: list[tuple[torch.Tensor, int]] = []
        self.cache = launch.DeviceTables(self.build)

    def build(self, addresses, device) -> torch.Tensor:
        self.built.append(torch.tensor(addresses, dtype=torch.int64))
        return self.built[-1]


def pretend_cuda(monkeypatch, handle=7, runtime_ok=True, stream=None):
    """Make backends treat plans made with ``device=CUDA0`` (or :func:`as_cuda`) as CUDA ones, launched
    on the given stream handle (``stream``, or a :class:`FakeStream` of it). The extension's runtime counts
    as runnable unless ``runtime_ok`` is None (then the real check decides). Returns the fake current
    device and the fake tables."""
    stream = FakeStream(handle) if stream is None else stream
    monkeypatch.setattr(copy_engine, "plan_stream", lambda plan: stream)
    monkeypatch.setattr(base, "stream_handle", lambda plan: (handle, stream))
    if runtime_ok is not None:
        monkeypatch.setattr(kernel_module, "cuda_runtime_status", lambda: (True, "ok"))
        monkeypatch.setattr(copy_engine, "cuda_runtime_status", lambda: (True, "ok"))
        monkeypatch.setattr(launch, "cuda_runtime_status", lambda: (True, "ok"))
    monkeypatch.setattr(launch, "capturing", lambda: False)
    tables = Tables()
    monkeypatch.setattr(launch, "device_tables", tables.cache)
    monkeypatch.setattr(launch, "record_stream", lambda t, s: tables.streams.append((t, s.cuda_stream)))
    # Moving indices to a CUDA device is what the CPU cannot do: the launch gets them as they are.
    monkeypatch.setattr(KernelBackend, "_launch_indices", staticmethod(lambda plan, device, stream: (
        plan.src_indices, plan.dst_indices)))  # fmt: skip
    current = type("CurrentDeviceOfThisTest", (CurrentDevice,), {"current": torch.device("cuda", 0)})
    monkeypatch.setattr(torch.cuda, "device", current)
    return current, tables


def pretend_gpu(monkeypatch, capability: tuple[int, int], image: tuple[int, int] | None = None) -> None:
    """The device pool's GPU is sm_<capability>, and the driver loads the bulk kernel for it as ``image``
    ((binaryVersion, ptxVersion); default: code built for that GPU, as an extension built for its arch)."""
    arch = 10 * capability[0] + capability[1]
    monkeypatch.setattr(kernel_module, "_compute_capability", lambda device: capability)
    monkeypatch.setattr(kernel_module, "_bulk_image", lambda device: image or (arch, arch))


def patch_plan_fragments(monkeypatch, fn) -> None:
    """Replace the fragment planner where the copy-engine backends (direct, batch) call it."""
    monkeypatch.setattr(copy_engine, "plan_fragments", fn)


def use_ext(monkeypatch, ext) -> None:
    """Every extension call (launches, host aliases) goes to ``ext``."""
    monkeypatch.setattr(kernel_module, "load_extension", lambda: ext)
    monkeypatch.setattr(copy_engine, "load_extension", lambda: ext)
    monkeypatch.setattr(launch, "load_extension", lambda: ext)


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
                return args[0] + 4096  # an alias that differs from the host address (and keeps its alignment)
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
    plan, _ = plan_for(layout="page_first_direct", page_size=page_size, device=CUDA0)
    auto = AutoBackend(thresholds={"kernel_max_fragment_bytes": threshold})
    assert auto.choose(plan).name == expected


# The plans below (plan_for, page_first_direct) move 32-byte items: fragments of 32 B at page size 1,
# 128 B at 4 and 512 B at 16.
TABLE = {
    "d2h": {"32": ["kernel", "batch", "direct"], "512": ["kernel-bulk", "staged", "batch", "direct"]},
    "h2d": {"128": ["staged", "kernel", "direct"]},
}


def tabled_auto(tmp_path, table=TABLE, **settings):
    return AutoBackend(thresholds={"kernel_max_fragment_bytes": 64, "table": table, **settings},
                       path=tmp_path / "auto.json")  # fmt: skip


@pytest.mark.parametrize(
    ("direction", "page_size", "capability", "expected", "why"),
    [
        ("d2h", 1, (9, 0), "kernel", "d2h table, bucket 32 B (nearest to 32 B fragments)"),
        ("d2h", 16, (9, 0), "kernel-bulk", "d2h table, bucket 512 B"),
        ("d2h", 16, (8, 0), "staged", "kernel-bulk skipped: the GPU is sm_80"),  # bulk needs sm_90: next in rank
        ("d2h", 4, (9, 0), "kernel", "bucket 32 B (nearest to 128 B"),  # 32 and 512 B equally far: the smaller
        ("h2d", 1, (9, 0), "staged", "h2d table, bucket 128 B (nearest to 32 B"),  # the only h2d bucket
        ("h2d", 16, (9, 0), "staged", "h2d table, bucket 128 B"),
    ],
)
def test_auto_consults_the_table_per_direction_and_bucket(monkeypatch, tmp_path, direction, page_size, capability,
                                                          expected, why):  # fmt: skip
    pretend_cuda(monkeypatch)
    pretend_gpu(monkeypatch, capability)
    plan, _ = plan_for(layout="page_first_direct", page_size=page_size, direction=direction, device=CUDA0)
    name, reason = tabled_auto(tmp_path).decide(plan)
    assert (name, tabled_auto(tmp_path).choose(plan).name) == (expected, expected.removesuffix("-bulk"))
    assert why in reason


def test_auto_falls_back_along_the_ranking(monkeypatch, tmp_path):
    """An unpinned host pool: no kernel design and no staged; the legacy stream: no batch either."""
    pretend_cuda(monkeypatch, handle=7)
    plan, _ = plan_for(layout="page_first_direct", page_size=16, device=CUDA0)
    plan = dataclasses.replace(plan, route=dataclasses.replace(plan.route, gpu_addressable=False))
    name, why = tabled_auto(tmp_path).decide(plan)
    assert name == "batch"
    assert "kernel-bulk skipped: host: reads and writes host memory directly" in why
    assert "staged skipped: host:" in why
    pretend_cuda(monkeypatch, handle=0)
    name, why = tabled_auto(tmp_path).decide(plan)
    assert name == "direct" and "batch skipped: the legacy default stream" in why
    # A ranking without direct still ends there: direct always runs.
    name, why = tabled_auto(tmp_path, table={"d2h": {"512": ["kernel", "batch"]}}).decide(plan)
    assert name == "direct" and "kernel skipped" in why and "batch skipped" in why


def test_auto_uses_the_threshold_for_a_direction_the_table_lacks(monkeypatch, tmp_path):
    pretend_cuda(monkeypatch)
    auto = tabled_auto(tmp_path, table={"h2d": TABLE["h2d"]})
    small, _ = plan_for(layout="page_first_direct", page_size=1, device=CUDA0)  # d2h, 32 B < 64 B
    large, _ = plan_for(layout="page_first_direct", page_size=16, device=CUDA0)
    assert auto.decide(small) == ("kernel", "no d2h table: threshold rule, 32 B fragments vs 64 B")
    assert auto.decide(large)[0] == "batch"


def test_auto_runs_and_records_the_bulk_kernel(monkeypatch, tmp_path):
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    use_ext(monkeypatch, ext)
    pretend_gpu(monkeypatch, (9, 0))
    plan, _ = plan_for(layout="page_first_direct", page_size=16, device=CUDA0)
    auto = tabled_auto(tmp_path, sm_budget=2)
    auto.run(plan)
    (name, args), = [c for c in ext.calls if c[0].startswith("transfer")]  # fmt: skip
    assert name == "transfer_bulk" and args[13] == 2  # num_blocks: the table's SM budget
    assert auto.last_choice == "kernel-bulk" and auto.last_reason.startswith("d2h table, bucket 512 B")
    small, _ = plan_for(layout="page_first_direct", page_size=1, device=CUDA0)
    auto.run(small)
    assert ext.calls[-1][0] == "transfer" and auto.last_choice == "kernel"


class MisalignedAliases(RecordingExt):
    """Host aliases 8 bytes off the host addresses: the launch's alignment falls below 16 bytes."""

    def __getattr__(self, name):
        record = super().__getattr__(name)
        if name == "host_device_pointer":
            return lambda address: record(address) - 4096 + 8
        return record


def test_auto_says_when_bulk_ran_the_register_kernel(monkeypatch, tmp_path):
    pretend_cuda(monkeypatch)
    ext = MisalignedAliases()
    use_ext(monkeypatch, ext)
    pretend_gpu(monkeypatch, (9, 0))
    plan, _ = plan_for(layout="page_first_direct", page_size=16, device=CUDA0)
    auto = tabled_auto(tmp_path)
    auto.run(plan)  # the host pool's addresses are 16-byte aligned, so the table's kernel-bulk is picked
    assert ext.calls[-1][0] == "transfer" and auto.last_choice == "kernel"
    assert "kernel-bulk ran the register kernel" in auto.last_reason
    name, why = auto.decide(plan)  # the route's launch alignment is known now: the next in the ranking
    assert name == "staged" and "kernel-bulk skipped: addresses, strides and chunks are 8-byte aligned" in why


def test_auto_table_round_trip_and_the_old_format(tmp_path):
    path = tmp_path / "auto.json"
    auto = AutoBackend(thresholds={"kernel_max_fragment_bytes": 4096, "sm_budget": 8, "table": TABLE}, path=path)
    auto.save()
    saved = json.loads(path.read_text())
    assert saved == {"kernel_max_fragment_bytes": 4096, "sm_budget": 8, "table": TABLE}
    loaded = AutoBackend(path=path)
    assert (loaded.thresholds, loaded.sm_budget, loaded.settings()) == ({"kernel_max_fragment_bytes": 4096}, 8, saved)
    assert loaded.table["d2h"][512] == ("kernel-bulk", "staged", "batch", "direct")
    assert (loaded.kernel.num_blocks, loaded.kernel_bulk.num_blocks, loaded.kernel_bulk.design) == (32, 8, "bulk")
    path.write_text(json.dumps({"kernel_max_fragment_bytes": 123}))  # the format before the table
    old = AutoBackend(path=path)
    assert (old.thresholds, old.table, old.sm_budget) == ({"kernel_max_fragment_bytes": 123}, {}, 4)
    old.save()
    assert json.loads(path.read_text()) == {"kernel_max_fragment_bytes": 123}  # written back as it was


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"up": {}}, "table: expected d2h/h2d mapping buckets to rankings, got 'up'"),
        ({"d2h": {"48": ["kernel"]}}, r"table\[d2h\]: bucket '48' is not a power of two"),
        ({"d2h": {"64": ["kernel", "tma"]}}, r"table\[d2h\]\[64\]: expected distinct designs"),
        ({"h2d": {"64": ["kernel", "kernel"]}}, r"table\[h2d\]\[64\]: expected distinct designs"),
        ({"h2d": {"64": []}}, r"table\[h2d\]\[64\]: expected distinct designs"),
        ({"h2d": {"big": ["kernel"]}}, r"table\[h2d\]: bucket 'big' is not a power of two"),
        (["kernel"], "table: expected an object of directions"),
    ],
)
def test_auto_rejects_a_bad_table(tmp_path, table, message):
    with pytest.raises(ValueError, match=f"thresholds: {message}"):
        AutoBackend(thresholds={"table": table})
    bad = tmp_path / "auto.json"
    bad.write_text(json.dumps({"table": table}))
    with pytest.raises(ValueError, match=f"{re.escape(str(bad))}: {message}"):
        AutoBackend(path=bad)


def test_batch_issues_one_call_with_all_pieces(monkeypatch):
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    use_ext(monkeypatch, ext)
    plan, _ = plan_for(layout="layer_first", page_size=1, device=CUDA0)
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
    use_ext(monkeypatch, ext)
    plan, _ = plan_for(device=CUDA0)
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
    use_ext(monkeypatch, ext)
    plan, _ = plan_for(device=CUDA0)
    batch = BatchBackend()
    with pytest.raises(RuntimeError, match=f"cudaMemcpyBatchAsync failed: {ERROR_NAMES[code]}"):
        batch.run(plan)
    assert not [w for w in recwarn if "fell back" in str(w.message)]
    assert batch.last_fallback is None
    assert "memcpy_fragments" not in [name for name, _ in ext.calls]


def test_kernel_backend_default_shape_is_small_ctas_worth_four_sms(monkeypatch):
    """The register kernel's default grid: 16 CTAs of 8 warps (the warps of 4 full SMs in CTAs that
    fit beside another kernel's); the bulk kernel's: 4 CTAs. An SM budget scales both."""
    from hicache_kernels.backends.kernel import DEFAULT_SM_BUDGET, blocks_for_sm_budget

    assert DEFAULT_SM_BUDGET == 4
    k = KernelBackend()
    assert (k.num_blocks, k.warps_per_block) == (16, 8)
    assert KernelBackend(design="bulk").num_blocks == 4
    assert KernelBackend(warps_per_block=32).num_blocks == 4  # the same warps in 1024-thread CTAs
    assert KernelBackend(warps_per_block=6).num_blocks == 22  # rounded up to whole CTAs
    assert KernelBackend(num_blocks=3).num_blocks == 3
    b = KernelBackend.for_sm_budget(2, warps_per_block=4)
    assert (b.num_blocks, b.warps_per_block, b.design) == (16, 4, "register")
    assert KernelBackend.for_sm_budget(6, design="bulk", count_skipped=True).num_blocks == 6
    assert [blocks_for_sm_budget(s) for s in (1, 2, 3)] == [4, 8, 12]
    for bad, name in [
        ((0,), "sm_budget"),
        ((True,), "sm_budget"),
        ((2, "cuda"), "design"),
        ((2, "register", 33), "warps_per_block"),
    ]:
        with pytest.raises(ValueError, match=name):
            blocks_for_sm_budget(*bad)
    with pytest.raises(ValueError, match="warps_per_block"):
        KernelBackend(warps_per_block=0)


@pytest.mark.parametrize(
    ("layout", "head_num", "head_dim", "align"), [("page_first", 2, 8, 16), ("page_head", 3, 3, 2)]
)
def test_kernel_backend_passes_geometry_and_alignment(monkeypatch, layout, head_num, head_dim, align):
    _, tables = pretend_cuda(monkeypatch)
    ext = RecordingExt()
    use_ext(monkeypatch, ext)
    pools = make_pools(layout=layout, mla=False, dtype=torch.float16, page_size=4, head_num=head_num,
                       head_dim=head_dim)  # fmt: skip
    d_idx, h_idx = make_indices("random", 96, 16, 4, count=5, seed=1)
    plan = as_cuda(ops.build_plan("h2d", pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout=layout,
                                  page_size=4, layer_id=2))  # fmt: skip
    KernelBackend(num_blocks=3, warps_per_block=8).run(plan)
    name, args = ext.calls[-1]
    assert name == "transfer"
    alias = pools.host.data_ptr() + 4096  # what the fake host_device_pointer answers
    assert ("host_device_pointer", (pools.host.data_ptr(),)) in ext.calls
    src_desc, src_table, dst_desc, dst_table = args[:4]
    assert (src_table, dst_table) == (False, True)
    assert src_desc[0] == alias and src_desc[1:] == plan.src.desc()[1:]  # the host pool through its alias
    (table,) = tables.built  # the device pool's layer addresses, K then V
    layer_bytes = pools.device_k[0].nbytes
    assert table.tolist() == [pool.data_ptr() + i * layer_bytes for pool in (pools.device_k, pools.device_v)
                              for i in range(3)]  # fmt: skip
    assert dst_desc[0] == table.data_ptr() and dst_desc[1:] == plan.dst.desc()[1:]
    n, layer_begin, layer_count, num_kv, num_chunks, chunk_bytes, got_align, blocks, warps = args[6:15]
    assert (n, layer_begin, layer_count, num_kv, num_chunks) == (5, 2, 1, 2, plan.num_chunks)
    assert chunk_bytes == plan.chunk_bytes and (blocks, warps) == (3, 8)
    # The greatest common divisor of every address, stride and size the kernel will use.
    used = [pools.host.data_ptr(), alias, *plan.dst.table, chunk_bytes, *plan.src.desc()[2:7], *plan.dst.desc()[2:7]]
    assert got_align == math.gcd(*used)
    assert got_align % align == 0


def test_kernel_backend_prepares_a_route_once(monkeypatch):
    """What does not change between calls is built by the first launch of a pool pair: later launches
    (new indices, other layers) upload no table, ask no alias, record no stream: they only launch."""
    _, tables = pretend_cuda(monkeypatch)
    ext = RecordingExt()
    use_ext(monkeypatch, ext)
    pools = make_pools(layout="page_first_direct", mla=True, dtype=torch.bfloat16, page_size=4)
    kernel = KernelBackend()

    def plan(layer_id, seed):
        d_idx, h_idx = make_indices("random", 96, 16, 4, count=5, seed=seed)
        return ops.build_plan("h2d", pools.device_k, None, pools.host, d_idx, h_idx, layout="page_first_direct",
                              page_size=4, layer_id=layer_id)  # fmt: skip

    first = as_cuda(plan(1, 0))
    kernel.run(first)
    assert [c for c, _ in ext.calls] == ["host_device_pointer", "transfer"]
    (table,) = tables.built
    assert tables.streams == [(table, 7)]
    again = plan(1, 1)
    assert again.route is plan(1, 2).route  # the ops found the binding and its route again
    kernel.run(dataclasses.replace(again, route=first.route))  # that route as the first launch left it
    kernel.run(as_cuda(plan(2, 3)))  # another layer: a new route over the same, prepared sides
    assert [c for c, _ in ext.calls[2:]] == ["transfer", "transfer"]
    assert len(tables.built) == 1 and tables.streams == [(table, 7)]
    assert ext.calls[-2][1][5] == again.dst_indices.data_ptr()  # each launch reads its own call's indices
    assert ext.calls[-1][1][7:9] == (2, 1)  # layer_begin, layer_count


class QueuedStream(FakeStream):
    """A stream whose work runs only when something waits for it (an event recorded after the work, or
    ``synchronize``), as on a GPU where the stream is still busy: kernels queue their effects here."""

    def __init__(self, handle: int) -> None:
        super().__init__(handle)
        self.queue: list[Callable[[], None]] = []
        self.done = 0

    def run_until(self, mark: int) -> None:
        while self.done < mark:
            self.queue[self.done]()
            self.done += 1

    def wait_event(self, event: QueuedEvent) -> None:
        event.synchronize()  # what ran before the event has run before anything this stream issues next

    def synchronize(self) -> None:
        self.run_until(len(self.queue))


class QueuedEvent:
    """Stands in for ``torch.cuda.Event``: complete once its stream ran what was queued before it."""

    def record(self, stream: QueuedStream) -> None:
        self.stream, self.mark = stream, len(stream.queue)

    def query(self) -> bool:
        return self.stream.done >= self.mark

    def synchronize(self) -> None:
        self.stream.run_until(self.mark)


class SkippingExt(RecordingExt):
    """A transfer kernel that skips ``units`` units: it adds them to the counter it is given when its
    stream runs it, not when it is launched."""

    def __init__(self, streams: dict[int, QueuedStream], counter: torch.Tensor, units: int) -> None:
        super().__init__()
        self.streams, self.counter, self.units = streams, counter, units

    def __getattr__(self, name):
        record = super().__getattr__(name)
        if name != "transfer":
            return record

        def transfer(*args):
            record(*args)
            assert args[15] == self.counter.data_ptr()
            self.streams[args[16]].queue.append(lambda: self.counter.add_(self.units))

        return transfer


def counting_on_queued_streams(monkeypatch, launch: QueuedStream) -> tuple[KernelBackend, torch.Tensor, QueuedStream]:
    """A counting KernelBackend launching on ``launch`` (a controller's copy stream, say) while the
    pools' device's current stream is another queued stream; its counter a CPU tensor."""
    pretend_cuda(monkeypatch, launch.cuda_stream, stream=launch)
    current = QueuedStream(0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Event", QueuedEvent)
    counting = KernelBackend(count_skipped=True)
    counter = torch.zeros(1, dtype=torch.int32)  # a CUDA counter, on the CPU
    counting._skipped[CUDA0] = kernel_module._SkipCounter(counter)
    return counting, counter, current


def test_kernel_backend_passes_a_skip_counter_only_when_asked(monkeypatch):
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    use_ext(monkeypatch, ext)
    plan, _ = plan_for(device=CUDA0)
    KernelBackend().run(plan)
    assert ext.calls[-1][1][15] == 0
    counting, counter, _ = counting_on_queued_streams(monkeypatch, QueuedStream(7))
    counting.run(plan)
    assert ext.calls[-1][1][15] == counter.data_ptr()
    counter.fill_(7)  # as the kernel would after skipping units
    assert counting.skipped() == 7 and counting.skipped() == 0
    with pytest.raises(ValueError, match="count_skipped"):
        KernelBackend().skipped()


def test_skipped_waits_for_counting_kernels_on_the_copy_streams(monkeypatch):
    """Counting kernels run on side streams (the controller's copy streams) that are still busy when
    ``skipped()`` reads on the current stream: the read must wait for each of them."""
    copy_a, copy_b = QueuedStream(7), QueuedStream(8)
    counting, counter, current = counting_on_queued_streams(monkeypatch, copy_a)
    use_ext(monkeypatch, SkippingExt({7: copy_a, 8: copy_b}, counter, units=3))
    plan, _ = plan_for(device=CUDA0)
    counting.run(plan)
    assert counter.item() == 0  # the kernel is still queued on its copy stream
    assert counting.skipped() == 3
    counting.run(plan)
    monkeypatch.setattr(base, "stream_handle", lambda plan: (8, copy_b))
    counting.run(plan)
    counting.run(plan)
    assert counting.skipped() == 9  # one launch on copy stream 7, two on 8: all waited for
    assert (copy_a.done, copy_b.done) == (2, 2) and counting.skipped() == 0
    counting.run(plan)  # after the reset: counted into the next read, not lost to it
    assert counting.skipped() == 3


def test_registry():
    assert get_backend("direct") is get_backend("direct")
    assert get_backend("kernel", num_blocks=2) is not get_backend("kernel")
    assert isinstance(get_backend("auto"), AutoBackend)
    with pytest.raises(ValueError, match="backend: expected one of direct, batch, kernel, triton, auto"):
        get_backend("nvme")


# ------------------------------------------------------------- the device each launch runs on (#5)


LAUNCHES = {KernelBackend: "transfer", DirectBackend: "memcpy_fragments", BatchBackend: "memcpy_batch"}


@pytest.mark.parametrize("backend", LAUNCHES, ids=lambda b: b.name)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_launches_run_on_the_device_pools_device(monkeypatch, backend, direction):
    """With cuda:0 current and the device pool on cuda:1, every extension call (the kernel's first
    one asks the host pool's alias) runs with cuda:1 current, and cuda:0 is current again afterwards."""
    current, _ = pretend_cuda(monkeypatch)
    ext = RecordingExt(current=current)
    use_ext(monkeypatch, ext)
    plan, _ = plan_for(direction=direction, device=CUDA1)
    backend().run(plan)
    assert LAUNCHES[backend] in [name for name, _ in ext.calls]
    assert ext.devices and all(d == CUDA1 for d in ext.devices), ext.devices
    assert current.current == CUDA0


def test_a_stream_on_another_device_is_refused():
    plan, _ = plan_for(device=CUDA1)
    wrong = dataclasses.replace(plan, stream=FakeStream(7, CUDA0))
    for stream_of in (base.plan_stream, base.stream_handle):  # copy engines, kernel
        with pytest.raises(
            ValueError, match=r"stream: expected a stream on the device pool's device cuda:1, got one on cuda:0"
        ):
            stream_of(wrong)
    right = dataclasses.replace(plan, stream=FakeStream(7, CUDA1))
    assert base.plan_stream(right).cuda_stream == 7 and base.stream_handle(right) == (7, right.stream)


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
    use_ext(monkeypatch, ext)
    plan, _ = plan_for(device=CUDA0)
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
    small_plan, _ = plan_for(layout="page_first_direct", page_size=1, device=CUDA0)  # 32-byte fragments
    large_plan, _ = plan_for(layout="page_first_direct", page_size=16, device=CUDA0)  # 512-byte fragments
    auto = AutoBackend(thresholds={"kernel_max_fragment_bytes": 64})
    assert (auto.choose(small_plan).name, auto.choose(large_plan).name) == (small, large)


@needs_cuda13_build
@pytest.mark.parametrize(("version", "through_extension"), [(12040, False), (13000, True)])
def test_direct_copies_with_torch_when_the_driver_is_too_old(monkeypatch, version, through_extension):
    pretend_cuda(monkeypatch, runtime_ok=None)
    ext = RecordingExt()
    use_ext(monkeypatch, ext)
    driver(monkeypatch, version)
    plan, pools = plan_for(device=CUDA0)
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
    real_plan = copy_engine.plan_fragments
    patch_plan_fragments(monkeypatch, lambda p: planned.append(p) or real_plan(p))
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
    plan, _ = plan_for(page_size=4, device=CUDA1)
    current, _ = pretend_cuda(monkeypatch)
    ext = RecordingExt(current=current)
    use_ext(monkeypatch, ext)
    copy = get_backend(name).prepare(plan)
    launches = {"direct": "memcpy_fragments", "batch": "memcpy_batch", "kernel": "transfer"}[name]
    assert [c for c, _ in ext.calls if c == launches] == []  # nothing issued by prepare
    before = len(ext.calls)
    patch_plan_fragments(monkeypatch, lambda p: pytest.fail("planned at issue"))
    monkeypatch.setattr(launch, "gpu_route", lambda plan, capturing: pytest.fail("described at issue"))
    monkeypatch.setattr(launch, "device_alias", lambda ptr: pytest.fail("aliased at issue"))
    copy()
    copy()
    issued = ext.calls[before:]
    assert [c for c, _ in issued] == [launches, launches]  # issue: the launch, nothing else
    assert issued[0] == issued[1]  # the same arguments (arrays built once, kept alive)
    # Each issue ran with the pool's device made current (the fake guard starts on cuda:0).
    assert ext.devices[before:] == [CUDA1] * 2


def test_prepare_refuses_an_unavailable_backend_before_any_work(monkeypatch):
    plan, _ = plan_for()
    patch_plan_fragments(monkeypatch, lambda p: pytest.fail("planned for a backend that cannot run"))
    with pytest.raises(BackendUnavailableError, match="io-backend 'kernel'"):
        get_backend("kernel").prepare(plan)


# ---------------------------------------------------------------------------------------------- old drivers elsewhere
@needs_extension
def test_host_alias_asks_the_extension_only_when_its_runtime_can_run(monkeypatch):
    asked = []

    class Ext:
        @staticmethod
        def host_device_pointer(p: int) -> int:
            asked.append(p)
            return p + 1

    monkeypatch.setattr(launch, "load_extension", lambda: Ext)
    monkeypatch.setattr(_ext, "driver_version", lambda: 12040)  # too old for the CUDA 13 runtime
    assert launch.device_alias(4096) == 4096 and asked == []  # UVA: the host address, no call
    monkeypatch.setattr(_ext, "driver_version", lambda: 13000)
    assert launch.device_alias(4096) == 4097 and asked == [4096]


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


# ---------------------------------------------------------------------------------------------- kernel designs
@pytest.mark.parametrize(
    ("head_dim", "capability", "launched"),
    [
        (8, (9, 0), "transfer_bulk"),  # 16-byte items on an H100/H200: bulk copies
        (8, (10, 0), "transfer_bulk"),
        (8, (8, 0), "transfer"),  # an A100: the register kernel
        (3, (9, 0), "transfer"),  # 6-byte items: not 16-byte aligned
    ],
)
def test_bulk_design_is_used_where_it_can_run(monkeypatch, head_dim, capability, launched):
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    use_ext(monkeypatch, ext)
    pretend_gpu(monkeypatch, capability)
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=4, head_num=1,
                       head_dim=head_dim)  # fmt: skip
    d_idx, h_idx = make_indices("random", 96, 16, 4, count=5, seed=1)
    plan = as_cuda(ops.build_plan("d2h", pools.device_k, pools.device_v, pools.host, d_idx, h_idx,
                                  layout="page_first", page_size=4))  # fmt: skip
    kernel = KernelBackend(design="bulk")
    kernel.run(plan)
    name, args = ext.calls[-1]
    assert name == launched and kernel.last_design == ("bulk" if launched == "transfer_bulk" else "register")
    assert (kernel.last_design_reason is None) == (launched == "transfer_bulk")
    register = RecordingExt()
    use_ext(monkeypatch, register)
    # the default design on the same grid: the same arguments to the register kernel (and dst_host)
    KernelBackend(num_blocks=kernel.num_blocks).run(plan)
    assert register.calls[-1] == ("transfer", args[:17] + (True,))


@pytest.mark.parametrize(
    ("image", "loaded"),
    [
        ((90, 80), "compute_80 PTX JIT-compiled for sm_90 (binaryVersion 90, ptxVersion 80)"),  # an "8.0+PTX" build
        ((80, 80), "sm_80 code (binaryVersion 80, ptxVersion 80)"),
    ],
)
def test_bulk_design_refuses_an_image_without_sm90_code(monkeypatch, tmp_path, image, loaded):
    """On an H100, a build without sm_90 code runs the bulk kernel's older-arch body, which only traps:
    the backend runs the register kernel instead and says why, and auto ranks kernel-bulk out."""
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    use_ext(monkeypatch, ext)
    pretend_gpu(monkeypatch, (9, 0), image=image)
    plan, _ = plan_for(layout="page_first_direct", page_size=16, device=CUDA0)  # 16-byte aligned, kernel-bulk's bucket
    kernel = KernelBackend(design="bulk")
    kernel.run(plan)
    assert ext.calls[-1][0] == "transfer" and kernel.last_design == "register"
    refusal = f"bulk copies need sm_90 SASS; the bulk kernel's image for cuda:0 is {loaded}"
    assert kernel.last_design_reason.startswith(refusal)
    name, why = tabled_auto(tmp_path).decide(plan)
    assert name == "staged" and f"kernel-bulk skipped: {refusal}" in why


class BulkImage(RecordingExt):
    """Answers bulk_image_versions with ``image``, or raises what the driver would without one."""

    def __init__(self, image: tuple[int, int] | None):
        super().__init__()
        self.image = image

    def __getattr__(self, name):
        record = super().__getattr__(name)
        if name != "bulk_image_versions":
            return record

        def versions(device: int) -> tuple[int, int]:
            record(device)
            if self.image is None:
                raise RuntimeError("bulk_image_versions (cuKernelGetAttribute) failed: cudaErrorNoKernelImageForDevice")
            return self.image

        return versions


@pytest.fixture
def fresh_bulk_image():
    """The per-device answer of ``_bulk_image`` is cached: each test asks afresh, and leaves nothing cached."""
    kernel_module._bulk_image.cache_clear()
    yield
    kernel_module._bulk_image.cache_clear()


@pytest.mark.parametrize(
    ("image", "launched"), [((90, 90), "transfer_bulk"), ((90, 80), "transfer"), (None, "transfer")]
)
def test_bulk_design_asks_the_extension_for_the_loaded_image(monkeypatch, fresh_bulk_image, image, launched):
    pretend_cuda(monkeypatch)
    ext = BulkImage(image)
    use_ext(monkeypatch, ext)
    monkeypatch.setattr(kernel_module, "_compute_capability", lambda device: (9, 0))
    plan, _ = plan_for(layout="page_first_direct", page_size=16, device=CUDA0)
    kernel = KernelBackend(design="bulk")
    kernel.run(plan)
    kernel.run(plan)
    assert [c for c in ext.calls if c[0] == "bulk_image_versions"] == [("bulk_image_versions", (0,))]  # asked once
    assert ext.calls[-1][0] == launched
    if image is None:
        assert kernel.last_design_reason == (
            "the driver has no bulk-kernel image for cuda:0: bulk_image_versions (cuKernelGetAttribute) failed: "
            "cudaErrorNoKernelImageForDevice"
        )


@pytest.mark.parametrize(("direction", "dst_host"), [("d2h", True), ("h2d", False)])
def test_register_kernel_streams_its_stores_to_host_memory_only(monkeypatch, direction, dst_host):
    """The register kernel's store cache policy follows the destination (csrc/transfer.cuh): evict-first
    for a backup into host memory, write-back for a load into device memory, which attention reads next."""
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    use_ext(monkeypatch, ext)
    plan, _ = plan_for(direction=direction, device=CUDA0)
    KernelBackend().run(plan)
    name, args = ext.calls[-1]
    assert name == "transfer" and len(args) == 18 and args[17] is dst_host


def test_kernel_design_is_checked():
    with pytest.raises(ValueError, match="design: expected one of register, bulk"):
        KernelBackend(design="tma")


# ---------------------------------------------------------------------------------------- strided indices
def strided(kind: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` as a view that is not contiguous: every other element of a longer tensor, a column
    of a 2-D tensor, or (one value repeated) an ``expand``."""
    if kind == "step":
        out = torch.full((2 * values.numel(),), -7, dtype=torch.int64)
        out[::2] = values
        return out[::2]
    if kind == "column":
        out = torch.full((values.numel(), 3), -7, dtype=torch.int64)
        out[:, 1] = values
        return out[:, 1]
    assert kind == "expand"
    return values[:1].expand(values.numel())


def read_int64(address: int, n: int) -> list[int]:
    """What a kernel reading ``n`` int64 indices at stride 1 from ``address`` reads."""
    import ctypes

    return list((ctypes.c_int64 * n).from_address(address))


@pytest.mark.parametrize("kind", ["step", "column", "expand"])
def test_the_kernel_reads_strided_indices_as_their_values(monkeypatch, kind):
    """The kernel reads index tensors through ``data_ptr()`` at stride 1: a strided view handed over as
    it is reads other slots (or, at stride 0, past the allocation). What the launch reads must be the
    indices' values, whatever their strides."""
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    use_ext(monkeypatch, ext)
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1)
    d_vals, h_vals = torch.tensor([5, 9, 2, 40, 17]), torch.tensor([3, 0, 11, 7, 30])
    d_idx = strided(kind, d_vals)  # d2h: the device side is the source, which may repeat
    h_idx = strided("step" if kind == "expand" else kind, h_vals)
    assert not d_idx.is_contiguous() and not h_idx.is_contiguous()
    plan = as_cuda(ops.build_plan("d2h", pools.device_k, pools.device_v, pools.host, d_idx, h_idx,
                                  layout="page_first", page_size=1))  # fmt: skip
    KernelBackend().run(plan)
    name, args = ext.calls[-1]
    src_ptr, dst_ptr, n = args[4], args[5], args[6]
    assert name == "transfer" and n == 5
    assert read_int64(src_ptr, n) == d_idx.tolist() and read_int64(dst_ptr, n) == h_vals.tolist()


@pytest.mark.parametrize("backend", ["direct", "batch", "triton", "staged"])
@pytest.mark.parametrize("kind", ["step", "column", "expand"])
def test_strided_indices_move_what_their_values_say(backend, kind):
    """Every CPU backend, given strided index views, moves exactly what the same values contiguous move."""
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.bfloat16, page_size=4, device_slots=48,
                       host_pages=4)  # fmt: skip
    d_vals, h_vals = torch.tensor([5, 9, 2, 40, 17, 33]), torch.tensor([3, 0, 11, 7, 14, 8])
    expected = expected_after(pools, "d2h", d_vals[:1].expand(6) if kind == "expand" else d_vals, h_vals, None)
    ops.transfer("d2h", pools.device_k, pools.device_v, pools.host, strided(kind, d_vals),
                 strided("step" if kind == "expand" else kind, h_vals), layout="page_first_direct", page_size=4,
                 backend=backend)  # fmt: skip
    assert pools.equal(expected)


# ---------------------------------------------------------------------------------------- caller's streams
class WaitingStream(FakeStream):
    def __init__(self, handle: int) -> None:
        super().__init__(handle)
        self.waited_for: list[int] = []

    def wait_stream(self, other) -> None:
        self.waited_for.append(other.cuda_stream)


class CudaLooking:
    """An index tensor as :func:`launch.follow_caller` sees one on a GPU."""

    is_cuda = True


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "capture"])
def test_a_side_stream_follows_the_callers_stream_and_keeps_its_indices(monkeypatch, capture):
    """Caller-made CUDA indices and a launch on another stream: the launch stream waits for the caller's
    current stream, and (outside graph capture) records the indices, so their memory is not handed out
    again while the copy reads it. Nothing for the current stream itself, or for host indices."""
    current, side = FakeStream(7), WaitingStream(9)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(launch, "capturing", lambda: capture)
    recorded = []
    monkeypatch.setattr(launch, "record_stream", lambda t, s: recorded.append((t, s.cuda_stream)))
    idx = CudaLooking()
    host = torch.arange(3)
    assert launch.follow_caller(side, CUDA0, (idx, host))
    assert side.waited_for == [7]
    assert recorded == ([] if capture else [(idx, 9)])
    same = WaitingStream(7)
    assert not launch.follow_caller(same, CUDA0, (idx,)) and same.waited_for == []
    assert not launch.follow_caller(side, CUDA0, (host,)) and not launch.follow_caller(None, CUDA0, (idx,))
    assert side.waited_for == [7]
