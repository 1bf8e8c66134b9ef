"""The ``staged`` io-backend: every layout x direction x MHA/MLA x page size against the reference on
CPU tensors (the same blocks, packs and host copies the GPU issues), what its plan decides (host runs
contiguous, blocks bounded by the staging buffer, buffers alternating), options and refusals, and on
a GPU the real streams and events."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import numpy as np
import pytest
import torch

from hicache_kernels import BackendUnavailableError, layouts, ops
from hicache_kernels._names import IO_BACKENDS
from hicache_kernels.backends import get_backend, staged
from hicache_kernels.backends.staged import StagedBackend

from kvdata import expected_after, make_indices, make_pools

LAYOUT_KINDS = [(layout, False) for layout in layouts.LAYOUTS] + [(layout, True) for layout in layouts.MLA_LAYOUTS]
LAYOUT_IDS = [f"{layout}-{'mla' if mla else 'mha'}" for layout, mla in LAYOUT_KINDS]
# (head_num, head_dim, dtype): item sizes 6 and 15 bytes (odd), and 32.
SHAPES = [(1, 3, torch.float16), (3, 5, torch.uint8), (2, 8, torch.float16)]


def n_host(pools) -> int:
    kv = pools.layers(pools.device_k)
    return pools.host.numel() // ((1 if pools.device_v is None else 2) * len(kv) * kv[0].shape[1] * kv[0].shape[2])


def case(backend, layout, mla, page_size, direction, layer_id, *, kind="random", shape=SHAPES[2], stacked=True,
         device="cpu", count=40, seed=0, num_layers=3):  # fmt: skip
    head_num, head_dim, dtype = shape
    pools = make_pools(layout=layout, mla=mla, dtype=dtype, page_size=page_size, direction=direction,
                       head_num=head_num, head_dim=head_dim, stacked=stacked, device=device, pin=device != "cpu",
                       host_pages=6, seed=seed, num_layers=num_layers)  # fmt: skip
    d_idx, h_idx = make_indices(kind, 96, n_host(pools), page_size, count=count, seed=seed + page_size)
    expected = expected_after(pools, direction, d_idx, h_idx, layer_id)
    plan = ops.build_plan(direction, pools.device_k, pools.device_v, pools.host, d_idx.to(device), h_idx.to(device),
                          layout=layout, page_size=page_size, layer_id=layer_id)  # fmt: skip
    return plan, pools, expected


@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layer_id", [None, 1], ids=["all", "layer1"])
@pytest.mark.parametrize("kind", ["random", "pages", "crossing"])
@pytest.mark.parametrize("shape", SHAPES, ids=["item6", "item15", "item32"])
def test_matches_reference(layout, mla, direction, page_size, layer_id, kind, shape):
    # One staging page: many blocks, so both buffers are used and runs are cut at block ends.
    backend = StagedBackend(staging_pages=1)
    plan, pools, expected = case(backend, layout, mla, page_size, direction, layer_id, kind=kind, shape=shape,
                                 stacked=page_size != 4)  # fmt: skip
    issue = backend.prepare(plan)
    assert len(issue.blocks) > 1
    issue()
    assert pools.equal(expected)


@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("num_layers", [1, 2, 4])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_layer_counts_and_pool_forms(layout, mla, num_layers, stacked, page_size, direction):
    """Runs of staging rows are found per (layer) tensor: list pools put each layer in its own tensor,
    stacked pools one tensor for all, and the row runs differ with the layer count."""
    backend = StagedBackend(staging_pages=1)
    plan, pools, expected = case(backend, layout, mla, page_size, direction, None, kind="random", stacked=stacked,
                                 num_layers=num_layers, count=24)  # fmt: skip
    backend.prepare(plan)()
    assert pools.equal(expected)


@pytest.mark.parametrize("options", [{}, {"staging_pages": 1000}, {"double_buffer": False, "staging_pages": 1}],
                         ids=["default", "one-block", "single-buffer"])  # fmt: skip
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_options_match_reference(options, direction):
    backend = get_backend("staged", **options)
    plan, pools, expected = case(backend, "page_first_direct", False, 4, direction, None, stacked=False)
    issue = backend.prepare(plan)
    assert {blk.buffer for blk in issue.blocks} == ({0} if options.get("double_buffer") is False else
                                                    {0, 1} if len(issue.blocks) > 1 else {0})  # fmt: skip
    issue()
    assert pools.equal(expected)


@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("staging_pages", [1, 3])
def test_blocks_bounded_runs_contiguous(layout, mla, direction, staging_pages):
    backend = StagedBackend(staging_pages=staging_pages)
    plan, _, _ = case(backend, layout, mla, 4, direction, None, kind="pages", count=24)
    blocks = backend.prepare(plan).blocks
    limit = backend.staging_bytes(plan)
    buffers = backend._staging[(plan.route.device, direction)].buffers
    host = plan.route.host_side
    moved = 0
    for i, blk in enumerate(blocks):
        f = blk.copies
        assert blk.buffer == i % 2
        assert (f.height == 1).all() and (f.width == f.src_pitch).all() and (f.width == f.dst_pitch).all()
        total = int(f.width.sum())
        assert 0 < total <= limit
        moved += total
        host_addr = f.dst if direction == "d2h" else f.src
        stage_addr = f.src if direction == "d2h" else f.dst
        # Staging holds the runs back to back from its start, in host address order.
        order = np.argsort(host_addr)
        assert (np.diff(host_addr[order]) >= f.width[order][:-1]).all()
        assert (stage_addr[order] - stage_addr[order][0] == np.concatenate(([0], np.cumsum(f.width[order])[:-1]))).all()
        assert stage_addr[order][0] == buffers[blk.buffer].data_ptr()
    assert moved == plan.bytes_moved
    # page_first_direct, whole pages, every layer: one run per (page, K/V) at most, each a whole host page.
    if layout == "page_first_direct":
        page_bytes = host.s_page
        assert all((blk.copies.width % page_bytes == 0).all() for blk in blocks)


def test_whole_pages_one_run_per_page():
    """page_first_direct over whole, scattered host pages: a block's copies are whole host pages per K/V
    (consecutive pages merged), so the copy count is at most pages x K/V, not pages x layers x K/V."""
    backend = StagedBackend(staging_pages=64)
    plan, pools, expected = case(backend, "page_first_direct", False, 4, "d2h", None, kind="pages", count=16)
    issue = backend.prepare(plan)
    assert len(issue.blocks) == 1
    assert len(issue.blocks[0].copies) <= 4 * 2
    issue()
    assert pools.equal(expected)


def test_issue_again_copies_current_contents():
    backend = StagedBackend(staging_pages=1)
    plan, pools, expected = case(backend, "layer_first", False, 4, "d2h", None)
    issue = backend.prepare(plan)
    issue()
    assert pools.equal(expected)
    pools.device_k.view(torch.uint8).bitwise_not_()
    d_idx, h_idx = plan.src_indices, plan.dst_indices
    expected = expected_after(pools, "d2h", d_idx, h_idx, None)
    issue()
    assert pools.equal(expected)


def test_out_of_range_pairs_dropped_and_empty_plan():
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=4, direction="d2h", host_pages=6)
    d_idx, h_idx = torch.tensor([0, 1, 2, 500]), torch.tensor([3, -1, 5, 6])
    expected = expected_after(pools, "d2h", d_idx[[0, 2]], h_idx[[0, 2]], None)
    plan = ops.build_plan("d2h", pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="page_first",
                          page_size=4, check_indices=False)  # fmt: skip
    StagedBackend().run(plan)
    assert pools.equal(expected)
    empty = torch.zeros(0, dtype=torch.int64)
    plan = ops.build_plan("d2h", pools.device_k, pools.device_v, pools.host, empty, empty, layout="page_first",
                          page_size=4)  # fmt: skip
    before = pools.clone()
    StagedBackend().run(plan)
    assert pools.equal(before)


def test_ops_accept_the_name():
    assert "staged" in IO_BACKENDS
    assert isinstance(get_backend("staged"), StagedBackend)
    assert get_backend("staged") is get_backend("staged")
    assert get_backend("staged", staging_pages=2).staging_pages == 2
    pools = make_pools(layout="page_head", mla=False, dtype=torch.bfloat16, page_size=4, direction="h2d")
    d_idx, h_idx = make_indices("random", 96, 16, 4, count=10, seed=3)
    expected = expected_after(pools, "h2d", d_idx, h_idx, 2)
    ops.load_layer(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layer_id=2, layout="page_head",
                   page_size=4, backend="staged")  # fmt: skip
    assert pools.equal(expected)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "4", None])
def test_bad_staging_pages(value):
    with pytest.raises(ValueError, match="staging_pages"):
        StagedBackend(staging_pages=value)


def test_bad_double_buffer():
    with pytest.raises(TypeError, match="double_buffer"):
        StagedBackend(double_buffer=1)


def test_cuda_pool_needs_pinned_host():
    plan, _, _ = case(None, "page_first", False, 4, "d2h", None)
    pageable = dataclasses.replace(plan, route=dataclasses.replace(plan.route, device=torch.device("cuda", 0),
                                                                   gpu_addressable=False))  # fmt: skip
    backend = StagedBackend()
    assert "pinned" in backend.unavailable(pageable)
    with pytest.raises(BackendUnavailableError, match="staged.*pinned"):
        backend.prepare(pageable)
    assert backend.unavailable(plan) is None
    assert backend.wants_host_indices(plan)


# ------------------------------------------------------------------------------------------------------
# The CUDA schedule, on CPU: fakes stand in for streams and events (what the CPU cannot reach) and
# record what the backend ordered; packs and copies run for real on CPU tensors.
# ------------------------------------------------------------------------------------------------------
class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.cuda_stream = log, name, 1000 + len(name)

    def wait_event(self, event) -> None:
        self.log.append(("wait", event.name, self.name))


class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream) -> None:
        self.log.append(("record", self.name, stream.name))


def pretend_cuda_schedule(monkeypatch, backend, plan, capturing=False):
    """``plan`` as a CUDA one, issued on a fake launch stream, with the backend's staging pair built from
    CPU buffers and fake streams and events. Returns the plan and the log."""
    log: list = []
    launch, current = FakeStream(log, "launch"), {"stream": None}
    plan = dataclasses.replace(plan, route=dataclasses.replace(plan.route, device=torch.device("cuda", 0),
                                                               gpu_addressable=True))  # fmt: skip

    @contextlib.contextmanager
    def use_stream(stream):
        before, current["stream"] = current["stream"], stream
        yield
        current["stream"] = before

    monkeypatch.setattr(torch.cuda, "stream", use_stream)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(staged, "plan_stream", lambda plan: launch)
    monkeypatch.setattr(staged, "cuda_runtime_status", lambda: (False, "pretend: torch copies"))
    monkeypatch.setattr(staged, "_upload", lambda flat, device, stream, buffers: flat)
    for name in ("_pack_d2h", "_scatter_h2d"):
        real = getattr(staged, name)
        monkeypatch.setattr(staged, name, lambda g, s, real=real, name=name: (
            log.append((name, current["stream"].name)), real(g, s)))  # fmt: skip

    class Memory(staged.TensorMemory):
        def copy(self, f) -> None:
            log.append(("copy", current["stream"].name))
            super().copy(f)

    monkeypatch.setattr(staged, "TensorMemory", Memory)
    st = object.__new__(staged._Staging)
    st.device, st.nbytes, st.lock = plan.route.device, backend.staging_bytes(plan), threading.Lock()
    st.copy_stream = FakeStream(log, "copy")
    st.buffers = [torch.empty(st.nbytes, dtype=torch.uint8) for _ in range(2)]
    st.ready = [FakeEvent(log, f"ready{i}") for i in range(2)]
    st.free = [FakeEvent(log, f"free{i}") for i in range(2)]
    st.start, st.end = FakeEvent(log, "start"), FakeEvent(log, "end")
    backend._staging[(plan.route.device, plan.route.direction)] = st
    return plan, log


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("double_buffer", [True, False])
def test_cuda_schedule_orders_packs_copies_and_buffer_reuse(monkeypatch, direction, double_buffer):
    backend = StagedBackend(staging_pages=1, double_buffer=double_buffer)
    plan, pools, expected = case(backend, "page_first", False, 4, direction, None, count=30)
    plan, log = pretend_cuda_schedule(monkeypatch, backend, plan)
    issue = backend.prepare(plan)
    n = len(issue.blocks)
    assert n >= 3
    issue()
    assert pools.equal(expected)
    want = [("record", "start", "launch"), ("wait", "start", "copy")]
    for i in range(n):
        b = i % 2 if double_buffer else 0
        if direction == "d2h":  # pack on the launch stream once the buffer's last copy out is done, then copy
            want += [("wait", f"free{b}", "launch"), ("_pack_d2h", "launch"), ("record", f"ready{b}", "launch"),
                     ("wait", f"ready{b}", "copy"), ("copy", "copy"), ("record", f"free{b}", "copy")]  # fmt: skip
        else:  # copy in once the buffer's last scatter is done, then scatter on the launch stream
            want += [("wait", f"free{b}", "copy"), ("copy", "copy"), ("record", f"ready{b}", "copy")]
            want += [("wait", f"ready{b}", "launch"), ("_scatter_h2d", "launch"), ("record", f"free{b}", "launch")]
    want += [("record", "end", "copy"), ("wait", "end", "launch")]
    assert log == want


def test_cuda_capture_refused(monkeypatch):
    backend = StagedBackend()
    plan, pools, _ = case(backend, "layer_first", False, 4, "d2h", None)
    before = pools.clone()
    plan, log = pretend_cuda_schedule(monkeypatch, backend, plan, capturing=True)
    issue = backend.prepare(plan)
    with pytest.raises(RuntimeError, match="staged.*CUDA graph"):
        issue()
    assert log == [] and pools.equal(before)


# ------------------------------------------------------------------------------------------------------
# GPU: real streams, events and copy engines (skipped without CUDA, see conftest)
# ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layer_id", [None, 1], ids=["all", "layer1"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=["item15", "item32"])
def test_gpu_matches_reference(layout, mla, direction, page_size, layer_id, shape):
    backend = StagedBackend(staging_pages=1)
    plan, pools, expected = case(backend, layout, mla, page_size, direction, layer_id, shape=shape, device="cuda",
                                 stacked=page_size == 1)  # fmt: skip
    backend.run(plan)
    torch.cuda.synchronize()
    assert pools.equal(expected)


@pytest.mark.gpu
def test_gpu_side_stream_ordering_and_repeat():
    """On a side stream: a backup queued behind a slow write to the device pool on that stream sees the
    write, and a load queued behind zeroing the pool restores the slots, both staging buffers reused
    across the two calls."""
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.bfloat16, page_size=16,
                       direction="d2h", device="cuda", pin=True, host_pages=6)  # fmt: skip
    d_idx, h_idx = make_indices("pages", 96, 96, 16, count=64, seed=5)
    host_before = pools.host.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the pools' initial contents
    backend = StagedBackend(staging_pages=1)
    kw = dict(layout="page_first_direct", page_size=16, backend=backend, stream=side)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the backup must wait for the write below, queued behind a long kernel
        pools.device_k.fill_(3)
    ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, **kw)
    side.synchronize()
    expected = expected_after(dataclasses.replace(pools, host=host_before), "d2h", d_idx, h_idx, None)
    assert torch.equal(pools.host.view(torch.uint8), expected.host.view(torch.uint8))
    k_want, v_want = pools.device_k.clone(), pools.device_v.clone()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        pools.device_k.zero_()
        pools.device_v.zero_()
    ops.load_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, **kw)
    side.synchronize()
    rest = torch.ones(96, dtype=torch.bool, device="cuda")
    rest[d_idx.cuda()] = False
    for got, want in ((pools.device_k, k_want), (pools.device_v, v_want)):
        assert torch.equal(got[:, ~rest].view(torch.uint8), want[:, ~rest].view(torch.uint8))
        assert not got[:, rest].view(torch.uint8).any()
