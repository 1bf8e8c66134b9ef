"""GPU tests: every io-backend against the reference on CUDA pools and pinned host pools, CUDA-graph
capture, torch.compile, streams. Skipped cleanly without CUDA (conftest).

Under compute-sanitizer (see README): ``compute-sanitizer --tool memcheck python -m pytest -q
tests/kernels/test_ops_gpu.py -k "kernel and not compile"``.
"""

from __future__ import annotations

import pytest
import torch

from hicache_kernels import layouts, ops
from hicache_kernels.backends import AutoBackend, BatchBackend, KernelBackend, get_backend

from kvdata import expected_after, make_indices, make_pools

pytestmark = pytest.mark.gpu

BACKENDS = ["direct", "batch", "kernel", "triton", "auto"]
LAYOUT_KINDS = [(layout, False) for layout in layouts.LAYOUTS] + [(layout, True) for layout in layouts.MLA_LAYOUTS]
LAYOUT_IDS = [f"{layout}-{'mla' if mla else 'mha'}" for layout, mla in LAYOUT_KINDS]


def gpu_case(backend, layout, mla, dtype, page_size, direction, layer_id, *, stacked=True, indices="random",
             stream=None, **shape):  # fmt: skip
    pools = make_pools(layout=layout, mla=mla, dtype=dtype, page_size=page_size, direction=direction,
                       stacked=stacked, device="cuda", pin=True, **shape)  # fmt: skip
    n_dev = pools.layers(pools.device_k)[0].shape[0]
    kv = pools.layers(pools.device_k)
    n_host = pools.host.numel() // ((1 if mla else 2) * len(kv) * kv[0].shape[1] * kv[0].shape[2])
    d_idx, h_idx = make_indices(indices, n_dev, n_host, page_size, count=40, seed=page_size)
    expected = expected_after(pools, direction, d_idx, h_idx, layer_id)
    ops.transfer(direction, pools.device_k, pools.device_v, pools.host, d_idx.cuda(), h_idx.cuda(), layout=layout,
                 page_size=page_size, layer_id=layer_id, backend=backend, stream=stream)  # fmt: skip
    torch.cuda.synchronize()
    assert pools.equal(expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("layer_id", [None, 1], ids=["all", "layer1"])
def test_backends_match_reference_on_gpu(backend, layout, mla, dtype, page_size, direction, layer_id):
    stream = torch.cuda.Stream() if backend == "batch" else None  # batch refuses the legacy stream
    # A private batch instance, so that its last_fallback tells about this call alone.
    chosen = BatchBackend() if backend == "batch" else backend
    gpu_case(chosen, layout, mla, dtype, page_size, direction, layer_id, stacked=page_size != 16, stream=stream)
    if backend == "batch":  # on a side stream the batch call itself must have run, not 'direct'
        assert chosen.last_fallback is None, f"batch fell back to direct: {chosen.last_fallback}"


@pytest.mark.parametrize("backend", [*BACKENDS, "kernel-bulk", "staged"])
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_runs_crossing_host_pages_on_gpu(backend, layout, mla, page_size, direction):
    """Runs consecutive on both sides that cross a host page boundary, on every GPU backend."""
    stream = torch.cuda.Stream() if backend in ("batch", "staged") else None
    chosen = KernelBackend(design="bulk") if backend == "kernel-bulk" else backend
    gpu_case(chosen, layout, mla, torch.bfloat16, page_size, direction, None, indices="crossing", stream=stream)


# (head_num, head_dim, dtype): item sizes 2, 6, 15, 656, 1030 bytes (16-byte vectors only for 656).
ODD = [(1, 1, torch.float16), (1, 3, torch.float16), (3, 5, torch.uint8), (2, 164, torch.float16),
       (5, 103, torch.float16)]  # fmt: skip


@pytest.mark.parametrize("backend", ["kernel", "triton", "direct"])
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("head_num", "head_dim", "dtype"), ODD, ids=str)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_odd_items_on_gpu(backend, layout, mla, head_num, head_dim, dtype, direction):
    gpu_case(backend, layout, mla, dtype, 4, direction, None, head_num=head_num, head_dim=head_dim, indices="pages")


@pytest.mark.parametrize("backend", ["kernel", "triton"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_fast_mode_skips_bad_pairs_on_gpu(backend, direction):
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, direction=direction,
                       device_slots=16, host_pages=1, device="cuda", pin=True)  # fmt: skip
    d_idx = torch.tensor([1, 2, 3, 16, -1, 5])
    h_idx = torch.tensor([0, 48, 7, 8, 9, -3])
    good = torch.tensor([True, False, True, False, False, False])
    expected = expected_after(pools, direction, d_idx[good], h_idx[good], None)
    ops.transfer(direction, pools.device_k, pools.device_v, pools.host, d_idx.cuda(), h_idx.cuda(),
                 layout="page_first", page_size=1, backend=backend, check_indices=False)  # fmt: skip
    torch.cuda.synchronize()
    assert pools.equal(expected)


def test_kernel_counts_skipped_units_without_a_sync():
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, device="cuda", pin=True,
                       num_layers=3)  # fmt: skip
    backend = get_backend("kernel", count_skipped=True)
    d_idx, h_idx = torch.tensor([0, 1, 500], device="cuda"), torch.tensor([2, 3, 4], device="cuda")
    ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="page_first",
                          page_size=1, backend=backend, check_indices=False)  # fmt: skip
    assert backend.skipped() == 1 * 2 * 3  # one bad pair x K/V x 3 layers
    assert backend.skipped() == 0


def test_kernel_skip_count_waits_for_a_busy_side_stream():
    """The counting kernel runs on a side stream (a controller's copy stream) still busy with earlier work
    when skipped() reads on the current stream: the read waits for it, and the reset precedes the next."""
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, device="cuda", pin=True,
                       num_layers=3)  # fmt: skip
    backend = get_backend("kernel", count_skipped=True)
    d_idx, h_idx = torch.tensor([0, 1, 500], device="cuda"), torch.tensor([2, 3, 4], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the pools and indices are ready
    for _ in range(2):
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # keeps the side stream busy: the launch below queues behind it
        ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="page_first",
                              page_size=1, backend=backend, check_indices=False, stream=side)  # fmt: skip
        assert backend.skipped() == 1 * 2 * 3  # one bad pair x K/V x 3 layers, counted once
    side.synchronize()
    assert backend.skipped() == 0


@pytest.mark.parametrize("backend", ["kernel", "triton"])
def test_cuda_graph_capture_and_replay(backend):
    """Capture a backup + load pair; replays follow new data and new indices written in place."""
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.bfloat16, page_size=16, device="cuda",
                       pin=True, host_pages=4)  # fmt: skip
    d_idx, h_idx = (t.cuda() for t in make_indices("pages", 96, 64, 16, count=32, seed=1))
    kw = dict(layout="page_first_direct", page_size=16, backend=backend, check_indices=False)
    k, v, host = pools.device_k, pools.device_v, pools.host
    ops.backup_all_layers(k, v, host, d_idx, h_idx, **kw)  # warm-up: tables, Triton compile
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ops.backup_all_layers(k, v, host, d_idx, h_idx, **kw)
    k.add_(1)
    new_d, new_h = (t.cuda() for t in make_indices("pages", 96, 64, 16, count=32, seed=2))
    d_idx.copy_(new_d)
    h_idx.copy_(new_h)
    expected = expected_after(pools, "d2h", new_d.cpu(), new_h.cpu(), None)
    graph.replay()
    torch.cuda.synchronize()
    assert pools.equal(expected)


def test_torch_compile_inductor_with_kernel_backend():
    pools = make_pools(layout="page_first", mla=True, dtype=torch.float16, page_size=1, device="cuda", pin=True)
    d_idx, h_idx = (t.cuda() for t in make_indices("random", 96, 48, 1, count=16, seed=3))
    expected = expected_after(pools, "d2h", d_idx.cpu(), h_idx.cpu(), 0)

    def step(kv, host, di, hi):
        ops.backup_layer(kv, None, host, di, hi, layer_id=0, layout="page_first", page_size=1, backend="kernel",
                         check_indices=False)  # fmt: skip
        return kv.float().sum()

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(pools.device_k, pools.host, d_idx, h_idx)
    torch.cuda.synchronize()
    assert pools.equal(expected)


def test_batch_falls_back_on_legacy_stream_and_says_so():
    backend = BatchBackend()
    pools = make_pools(layout="layer_first", mla=False, dtype=torch.float16, page_size=1, device="cuda", pin=True)
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=8, seed=4)
    expected = expected_after(pools, "d2h", d_idx, h_idx, None)
    with pytest.warns(RuntimeWarning, match="legacy default stream"):
        ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="layer_first",
                              page_size=1, backend=backend)  # fmt: skip
    torch.cuda.synchronize()
    assert backend.last_fallback and pools.equal(expected)


def test_auto_picks_kernel_for_small_fragments():
    auto = AutoBackend(thresholds={"kernel_max_fragment_bytes": 1 << 20})
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, device="cuda", pin=True)
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=8, seed=5)
    ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="page_first",
                          page_size=1, backend=auto)  # fmt: skip
    assert auto.last_choice == "kernel"


def test_kernel_grid_options():
    for num_blocks, warps in [(1, 1), (1, 32), (2, 8), (16, 32)]:
        backend = get_backend("kernel", num_blocks=num_blocks, warps_per_block=warps)
        gpu_case(backend, "page_head", False, torch.float16, 16, "d2h", None)


def test_host_device_pointer_resolves_views_and_refuses_pageable():
    from hicache_kernels._ext import load_extension

    ext = load_extension()
    pinned = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    base = ext.host_device_pointer(pinned.data_ptr())
    assert ext.host_device_pointer(pinned[100:].data_ptr()) == base + 100
    with pytest.raises(RuntimeError, match="InvalidHostPointer"):
        ext.host_device_pointer(torch.empty(4096, dtype=torch.uint8).data_ptr())


def test_kernel_backend_with_host_indices_on_a_side_stream():
    """CPU indices are copied on the launch stream, so a busy side stream cannot race the kernel."""
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, device="cuda", pin=True,
                       direction="h2d")  # fmt: skip
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=32, seed=6)
    expected = expected_after(pools, "h2d", d_idx, h_idx, None)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # keep the side stream busy for a while
    ops.load_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="page_first", page_size=1,
                        backend="kernel", stream=side)  # fmt: skip
    torch.cuda.synchronize()
    assert pools.equal(expected)


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@needs_two_gpus
@pytest.mark.parametrize("backend", ["kernel", "direct", "batch"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_pool_on_another_gpu_runs_there_and_keeps_the_current_device(backend, direction):
    """A pool on cuda:1 while cuda:0 is current: the launch runs on cuda:1 (a kernel or copy issued
    on cuda:0 with cuda:1's stream would fail) and cuda:0 is still current afterwards."""
    torch.cuda.set_device(0)
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, direction=direction,
                       device="cuda:1", pin=True)  # fmt: skip
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=16, seed=7)
    expected = expected_after(pools, direction, d_idx, h_idx, None)
    chosen = BatchBackend() if backend == "batch" else backend
    stream = torch.cuda.Stream(device=1) if backend == "batch" else None
    ops.transfer(direction, pools.device_k, pools.device_v, pools.host, d_idx.to("cuda:1"), h_idx.to("cuda:1"),
                 layout="page_first", page_size=1, backend=chosen, stream=stream)  # fmt: skip
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert pools.equal(expected)
    if backend == "batch":
        assert chosen.last_fallback is None, f"batch fell back to direct: {chosen.last_fallback}"


@needs_two_gpus
def test_a_stream_on_another_gpu_is_refused():
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, device="cuda:1", pin=True)
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=4, seed=8)
    with pytest.raises(ValueError, match="stream: expected a stream on the device pool's device cuda:1"):
        ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="page_first",
                              page_size=1, backend="kernel", stream=torch.cuda.Stream(device=0))  # fmt: skip


@needs_two_gpus
def test_kernel_image_probe_keeps_the_current_device():
    from hicache_kernels._ext import load_extension

    torch.cuda.set_device(0)
    binary, _ = load_extension().kernel_image_versions(1)
    major, minor = torch.cuda.get_device_capability(1)
    assert torch.cuda.current_device() == 0
    assert 0 < binary <= 10 * major + minor


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("backend", ["kernel", "kernel-bulk", "triton", "direct", "staged"])
@pytest.mark.parametrize("kind", ["step", "column", "expand"])
def test_strided_cuda_indices_on_gpu(backend, kind):
    """CUDA index views that are not contiguous move what their values name, on every GPU backend (the
    kernels read indices at stride 1; a stride-0 ``expand`` would read past its allocation)."""
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.bfloat16, page_size=4, direction="d2h",
                       device="cuda", pin=True, device_slots=48, host_pages=4)  # fmt: skip
    d_vals, h_vals = torch.tensor([5, 9, 2, 40, 17, 33]), torch.tensor([3, 0, 11, 7, 14, 8])
    expected = expected_after(pools, "d2h", d_vals[:1].expand(6) if kind == "expand" else d_vals, h_vals, None)

    def view(values, how):
        if how == "step":
            wide = torch.full((2 * values.numel(),), -7, dtype=torch.int64, device="cuda")
            wide[::2] = values.cuda()
            return wide[::2]
        if how == "column":
            wide = torch.full((values.numel(), 3), -7, dtype=torch.int64, device="cuda")
            wide[:, 1] = values.cuda()
            return wide[:, 1]
        return values[:1].cuda().expand(values.numel())

    chosen = KernelBackend(design="bulk") if backend == "kernel-bulk" else backend
    stream = torch.cuda.Stream() if backend == "staged" else None
    ops.transfer("d2h", pools.device_k, pools.device_v, pools.host, view(d_vals, kind),
                 view(h_vals, "step" if kind == "expand" else kind), layout="page_first_direct", page_size=4,
                 backend=chosen, stream=stream)  # fmt: skip
    torch.cuda.synchronize()
    assert pools.equal(expected)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("backend", ["kernel", "triton"])
def test_a_side_stream_copy_waits_for_the_indices_its_caller_is_still_making(backend):
    """The caller's current stream is busy (~25 ms) when it makes the indices, and drops them at once
    (their memory goes back to its allocator, which hands it to junk at once); the copy goes to a side
    stream without an index check (no sync). It must wait for the indices and keep their memory."""
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.bfloat16, page_size=16, direction="h2d",
                       device="cuda", pin=True, device_slots=96, host_pages=4)  # fmt: skip
    d_vals, h_vals = make_indices("pages", 96, 64, 16, count=32, seed=3)
    expected = expected_after(pools, "h2d", d_vals, h_vals, None)
    d_src, h_src = d_vals.cuda(), h_vals.cuda()
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the current stream is busy: what follows on it runs late
    d_idx, h_idx = torch.full_like(d_src, -1), torch.full_like(h_src, -1)
    d_idx.copy_(d_src)
    h_idx.copy_(h_src)
    ops.transfer("h2d", pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="page_first_direct",
                 page_size=16, backend=backend, stream=side, check_indices=False)  # fmt: skip
    del d_idx, h_idx
    junk = [torch.full((32,), 95, dtype=torch.int64, device="cuda") for _ in range(4)]  # may reuse their memory
    torch.cuda.synchronize()
    assert pools.equal(expected)
    del junk
