"""Backend plumbing on CPU: auto's choice and persisted thresholds, batch's fallbacks and the
arguments the kernel backend hands to the extension (a recording fake stands in for CUDA)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hicache_kernels import backends, ops
from hicache_kernels.backends import AutoBackend, BatchBackend, KernelBackend, get_backend

from kvdata import make_indices, make_pools


def plan_for(layout="page_first", page_size=1, mla=False, direction="d2h"):
    pools = make_pools(layout=layout, mla=mla, dtype=torch.float16, page_size=page_size, direction=direction)
    d_idx, h_idx = make_indices("pages", 96, 48 if page_size == 1 else 4 * page_size, page_size, count=8, seed=0)
    plan = ops.build_plan(direction, pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout=layout,
                          page_size=page_size)  # fmt: skip
    return plan, pools


class FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


def pretend_cuda(monkeypatch, handle=7):
    """Make backends treat the (CPU) plan as a CUDA one with the given stream handle."""
    monkeypatch.setattr(backends, "_stream", lambda plan: FakeStream(handle))
    monkeypatch.setattr(backends, "_cuda_reason", lambda plan: None)
    monkeypatch.setattr(backends, "_pinned_reason", lambda plan: None)
    monkeypatch.setattr(backends.Side, "is_cuda", property(lambda self: True))


class RecordingExt:
    def __init__(self, batch_code=0):
        self.calls = []
        self.batch_code = batch_code

    def __getattr__(self, name):
        def record(*args):
            self.calls.append((name, args))
            if name == "memcpy_batch":
                return self.batch_code
            if name == "error_name":
                return {801: "cudaErrorNotSupported", 2: "cudaErrorMemoryAllocation"}[args[0]]
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
    ],
)
def test_auto_choice(monkeypatch, page_size, threshold, handle, expected):
    pretend_cuda(monkeypatch, handle)
    monkeypatch.setattr(backends, "extension_status", lambda: (True, "ok"))
    monkeypatch.setattr(KernelBackend, "unavailable", lambda self, plan: None)
    plan, _ = plan_for(layout="page_first_direct", page_size=page_size)
    auto = AutoBackend(thresholds={"kernel_max_fragment_bytes": threshold})
    assert auto.choose(plan).name == expected


def test_batch_issues_one_call_with_all_pieces(monkeypatch):
    pretend_cuda(monkeypatch)
    ext = RecordingExt()
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    monkeypatch.setattr(backends, "extension_status", lambda: (True, "ok"))
    plan, _ = plan_for(layout="layer_first", page_size=1)
    BatchBackend().run(plan)
    (name, args), = ext.calls  # fmt: skip
    assert name == "memcpy_batch"
    count, direction, stream = args[3], args[4], args[5]
    assert (direction, stream) == (0, 7)
    assert count == 2 * 3 * 2  # 2 runs of 4 slots x 3 layers x K/V; layer-first runs are contiguous


@pytest.mark.parametrize(("handle", "code", "reason"), [(0, 0, "legacy default stream"), (7, 801, "NotSupported")])
def test_batch_falls_back_to_direct_and_says_so(monkeypatch, handle, code, reason):
    pretend_cuda(monkeypatch, handle)
    ext = RecordingExt(batch_code=code)
    monkeypatch.setattr(backends, "load_extension", lambda: ext)
    monkeypatch.setattr(backends, "extension_status", lambda: (True, "ok"))
    plan, _ = plan_for()
    batch = BatchBackend()
    with pytest.warns(RuntimeWarning, match=reason):
        batch.run(plan)
    assert reason in batch.last_fallback
    assert ext.calls[-1][0] == "memcpy_fragments"


def test_batch_raises_on_other_errors(monkeypatch):
    pretend_cuda(monkeypatch)
    monkeypatch.setattr(backends, "load_extension", lambda: RecordingExt(batch_code=2))
    monkeypatch.setattr(backends, "extension_status", lambda: (True, "ok"))
    plan, _ = plan_for()
    with pytest.raises(RuntimeError, match="cudaErrorMemoryAllocation"):
        BatchBackend().run(plan)


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
