"""Pool bindings (hicache_kernels.binding): KVBinding and its per-layer plans against the reference,
the ops' cache of bindings (found again only for the same, unchanged pools; gone with them), routes
built once, and compat's route cache following pointer tables rewritten in place.

Sources hold random bits and destinations a poison pattern; every comparison is byte for byte."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from hicache_kernels import KVBinding, launch, layouts, ops
from hicache_kernels.backends import get_backend
from hicache_kernels.binding import bound_pools, cached_bindings
from hicache_kernels.compat import sgl_kernel as sk

from kvdata import expected_after, make_indices, make_pools, poison_, random_bytes_, same_bytes

LAYOUT_KINDS = [(layout, False) for layout in layouts.LAYOUTS] + [(layout, True) for layout in layouts.MLA_LAYOUTS]
LAYOUT_IDS = [f"{layout}-{'mla' if mla else 'mha'}" for layout, mla in LAYOUT_KINDS]


def host_slots(pools) -> int:
    kv = pools.layers(pools.device_k)
    return pools.host.numel() // ((1 if pools.device_v is None else 2) * len(kv) * kv[0].shape[1] * kv[0].shape[2])


def bind(pools) -> KVBinding:
    return KVBinding(pools.device_k, pools.device_v, pools.host, layout=pools.layout, page_size=pools.page_size)


# ---------------------------------------------------------------------------------------------- KVBinding
@pytest.mark.parametrize("backend", ["direct", "batch", "triton", "auto"])
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_binding_matches_reference(backend, layout, mla, direction):
    """Every layer, then one layer, with new indices each time, through one binding."""
    pools = make_pools(layout=layout, mla=mla, dtype=torch.bfloat16, page_size=4, direction=direction,
                       stacked=layout != "page_first", device_slots=24, host_pages=3)  # fmt: skip
    b = bind(pools)
    copy = b.backup if direction == "d2h" else b.load
    for seed, layer_id in ((1, None), (2, 1)):
        d_idx, h_idx = make_indices("random", 24, 12, 4, count=6, seed=seed)
        expected = expected_after(pools, direction, d_idx, h_idx, layer_id)
        copy(d_idx, h_idx, layer_id=layer_id, backend=backend)
        assert pools.equal(expected)


@pytest.mark.parametrize("backend", ["direct", "triton"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_layer_plans_of_a_batch_copy_exactly_their_layer(backend, stacked, direction):
    """batch_plan once, then one layer's plan at a time: each run copies its layer only."""
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.float16, page_size=4, direction=direction,
                       stacked=stacked, num_layers=4, device_slots=24, host_pages=3)  # fmt: skip
    b = bind(pools)
    d_idx, h_idx = make_indices("pages", 24, 12, 4, count=8, seed=3)
    run = get_backend(backend).run
    batch = b.batch_plan(direction, d_idx, h_idx, backend=backend)
    assert (batch.layer_begin, batch.layer_count, batch.direction) == (0, 4, direction)
    run(b.layer_plan(batch, 2))
    run(b.layer_plan(batch, np.int64(0)))  # numpy integers work like ints
    partial = expected_after(expected_after(pools, direction, d_idx, h_idx, 2), direction, d_idx, h_idx, 0)
    assert pools.equal(partial)  # layers 1 and 3 untouched
    for layer in (3, 1):
        one = b.layer_plan(batch, layer)
        assert (one.layer_begin, one.layer_count) == (layer, 1)
        assert one.route is b.layer_plan(batch, layer).route  # each layer's route built once
        run(one)
    assert pools.equal(expected_after(pools, direction, d_idx, h_idx, None))
    with pytest.raises(ValueError, match=r"layer_id: expected an int in \[0, 4\), got 4"):
        b.layer_plan(batch, 4)
    with pytest.raises(TypeError, match="layer_id"):
        b.layer_plan(batch, 1.0)


def test_batch_plan_checks_everything_before_anything_is_written():
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, direction="h2d")
    before = pools.clone()
    b = bind(pools)
    with pytest.raises(IndexError, match="host_indices: index 48"):
        b.batch_plan("h2d", torch.tensor([0, 1]), torch.tensor([0, 48]), backend="direct")
    with pytest.raises(ValueError, match="device_indices: destination slot 3 appears more than once"):
        b.batch_plan("h2d", torch.tensor([3, 3]), torch.tensor([0, 1]), backend="direct")
    with pytest.raises(TypeError, match="backend: expected a backend name"):
        b.batch_plan("h2d", torch.tensor([0, 1]), torch.tensor([0, 1]), backend=3)
    with pytest.raises(ValueError, match="direction"):
        b.batch_plan("x2y", torch.tensor([0, 1]), torch.tensor([0, 1]), backend="direct")
    # Unchecked on request: the plan is made (nothing is written until a backend runs a part of it).
    b.batch_plan("h2d", torch.tensor([3, 3]), torch.tensor([0, 1]), backend="direct", check_indices=False)
    assert pools.equal(before)


def test_layer_plan_takes_only_a_plan_of_its_binding_over_every_layer():
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, direction="h2d")
    b, other = bind(pools), bind(pools)
    d_idx, h_idx = torch.tensor([0, 1]), torch.tensor([2, 3])
    batch = b.batch_plan("h2d", d_idx, h_idx, backend="direct")
    with pytest.raises(ValueError, match="plan: expected a plan of this binding's pools over every layer"):
        other.layer_plan(batch, 0)  # the same tensors, bound again: another binding
    with pytest.raises(ValueError, match="plan: expected a plan of this binding's pools over every layer"):
        b.layer_plan(b.layer_plan(batch, 1), 0)  # a one-layer plan
    with pytest.raises(ValueError, match="plan: expected a plan of this binding's pools over every layer"):
        b.layer_plan(ops.build_plan("h2d", pools.device_k, pools.device_v, pools.host, d_idx, h_idx,
                                    layout=pools.layout, page_size=1), 0)  # fmt: skip
    assert b.layer_plan(b.plan("h2d", d_idx, h_idx), 1).layer_begin == 1  # a plain plan over every layer works


@pytest.mark.parametrize(
    ("changes", "exc", "pattern"),
    [
        ({"layout": "head_first"}, ValueError, "layout: expected one of"),
        ({"page_size": 0}, ValueError, "page_size: expected a positive int"),
        ({"page_size": True}, TypeError, "page_size: expected an int, got bool"),
        ({"host": "pool"}, TypeError, "host: expected a torch.Tensor"),
        ({"device_v": None}, ValueError, "device_k: an MLA pool"),
    ],
)
def test_binding_refuses_bad_pools(changes, exc, pattern):
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=4)
    args = dict(device_k=pools.device_k, device_v=pools.device_v, host=pools.host, layout="page_first", page_size=4)
    args.update(changes)
    with pytest.raises(exc, match=pattern):
        KVBinding(args.pop("device_k"), args.pop("device_v"), args.pop("host"), **args)


def test_binding_checks_each_calls_indices_and_writes_nothing_on_error():
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.float16, page_size=4)
    before = pools.clone()
    b = bind(pools)
    with pytest.raises(IndexError, match="device_indices: index 96"):
        b.backup(torch.tensor([96]), torch.tensor([0]), backend="direct")
    with pytest.raises(ValueError, match="host_indices: destination slot 5 appears more than once"):
        b.backup(torch.tensor([0, 1]), torch.tensor([5, 5]), backend="direct")
    with pytest.raises(TypeError, match="device_indices: expected dtype torch.int64"):
        b.backup(torch.tensor([0], dtype=torch.int32), torch.tensor([0]), backend="direct")
    with pytest.raises(ValueError, match="direction: expected 'd2h' or 'h2d'"):
        b.transfer("up", torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(TypeError, match="backend: expected a backend name"):
        b.backup(torch.tensor([0]), torch.tensor([0]), backend=None)
    assert pools.equal(before)


def test_routes_are_built_once_per_direction_and_layer_range():
    pools = make_pools(layout="page_head", mla=False, dtype=torch.float16, page_size=4)
    b = bind(pools)
    plans = [b.plan("d2h", *make_indices("random", 96, 16, 4, count=3, seed=s), layer_id=1) for s in range(3)]
    assert plans[0].route is plans[1].route is plans[2].route
    assert plans[0].src_indices is not plans[1].src_indices
    other = b.plan("d2h", *make_indices("random", 96, 16, 4, count=3, seed=0), layer_id=2)
    load = b.plan("h2d", *make_indices("random", 96, 16, 4, count=3, seed=0), layer_id=1)
    assert other.route is not plans[0].route and other.route.src is plans[0].route.src  # the sides are shared
    assert load.route.dst is plans[0].route.src


# ---------------------------------------------------------------------------------------------- the ops' cache
def test_ops_find_their_binding_again_only_for_the_same_pools():
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, stacked=False)
    k, v, host = pools.device_k, pools.device_v, pools.host
    first = bound_pools(k, v, host, "page_first", 1)
    assert bound_pools(k, v, host, "page_first", 1) is first
    assert bound_pools(list(k), tuple(v), host, "page_first", np.int64(1)) is first  # new lists, same layers
    assert bound_pools(k, v, host, "page_first", 1) is not bound_pools(k[::-1], v, host, "page_first", 1)
    with pytest.raises(TypeError, match="page_size: expected an int, got bool"):
        bound_pools(k, v, host, "page_first", True)  # equal to 1 as a key: must not find page_size 1's binding


@pytest.mark.parametrize("where", ["stacked", "list-first", "list-middle", "host"])
def test_a_pool_changed_under_the_cache_is_bound_again(where):
    """The same pool objects pointing at other memory (``set_``), or a list with another layer: the
    next call must write the memory the pools hold now, not the memory bound before."""
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, stacked=where == "stacked")
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=8, seed=6)
    kw = dict(layout="page_first", page_size=1, backend="direct")
    ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, **kw)  # binds
    new_bytes = torch.Generator().manual_seed(7)
    old_host = pools.host.view(-1)  # keeps the host pool's first memory in view
    if where == "stacked":
        pools.device_k.set_(random_bytes_(torch.empty_like(pools.device_k), new_bytes))
    elif where == "host":
        pools.host.set_(poison_(torch.empty_like(pools.host)))
    else:
        i = 0 if where == "list-first" else 1
        replaced = pools.device_k[i]  # still alive: the cache must notice the list changed, not that it died
        pools.device_k[i] = random_bytes_(torch.empty_like(replaced), new_bytes)
    poison_(old_host)
    poison_(pools.host)
    expected = expected_after(pools, "d2h", d_idx, h_idx, None)
    ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, **kw)
    assert pools.equal(expected)
    if where == "host":
        assert (old_host.view(torch.uint8) == 0xA5).all()  # the memory bound before was not written
    if where.startswith("list"):
        assert replaced.data_ptr() != pools.device_k[i].data_ptr()


def test_the_cache_holds_no_pool_and_forgets_dead_ones():
    gc.collect()  # other tests' dead pools leave now, not during this test
    before = cached_bindings()
    pools = make_pools(layout="page_first_direct", mla=True, dtype=torch.bfloat16, page_size=4, stacked=False)
    d_idx, h_idx = make_indices("random", 96, 16, 4, count=4, seed=8)
    ops.backup_all_layers(pools.device_k, None, pools.host, d_idx, h_idx, layout="page_first_direct", page_size=4,
                          backend="direct")  # fmt: skip
    assert cached_bindings() == before + 1
    layer = weakref.ref(pools.device_k[1])
    host = weakref.ref(pools.host)
    del pools
    gc.collect()
    assert layer() is None and host() is None  # nothing kept the pools alive
    assert cached_bindings() == before


def test_pools_made_again_at_recycled_ids_are_bound_afresh():
    """Pools die and new ones of other shapes take their place (and often their ids): every call must
    use the pools it is given."""
    for round_ in range(20):
        layers = 2 + round_ % 3
        pools = make_pools(layout="layer_first", mla=round_ % 2 == 0, dtype=torch.float16, page_size=1,
                           num_layers=layers, device_slots=16 + 8 * (round_ % 4), seed=round_)  # fmt: skip
        d_idx, h_idx = make_indices("random", 16, 48, 1, count=5, seed=round_)
        expected = expected_after(pools, "d2h", d_idx, h_idx, None)
        ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="layer_first",
                              page_size=1, backend="direct")  # fmt: skip
        assert pools.equal(expected), f"round {round_}"
        del pools, expected
        gc.collect()


def test_custom_op_with_new_lists_finds_one_binding():
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, stacked=False)
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=4, seed=9)
    before = cached_bindings()
    for _ in range(4):  # the dispatcher hands the op a new list every call
        torch.ops.hicache_kernels.backup(list(pools.device_k), list(pools.device_v), pools.host, d_idx, h_idx,
                                         "page_first", 1, -1, "direct", True)  # fmt: skip
    assert cached_bindings() == before + 1


def test_concurrent_callers_share_the_cache():
    """Two threads (a controller's write and load workers) back up disjoint pages of the same pools,
    each passing new lists of the same layers every call: every copy lands as the reference says."""
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.float16, page_size=4, stacked=False,
                       device_slots=64, host_pages=16)  # fmt: skip
    src = pools.clone()
    kw = dict(layout="page_first_direct", page_size=4, backend="direct")
    errors: list[BaseException] = []

    def worker(pages: range) -> None:
        try:
            for i in range(4 * len(pages)):
                slots = torch.arange(4) + 4 * pages[i % len(pages)]
                ops.backup_all_layers(list(pools.device_k), list(pools.device_v), pools.host, slots, slots, **kw)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(pages,)) for pages in (range(0, 8), range(8, 16))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    every = torch.arange(64)
    assert pools.equal(expected_after(src, "d2h", every, every, None))


# ---------------------------------------------------------------------------------------------- compat's cache
@pytest.fixture
def triton_on_cpu():
    sk.use_backend("triton")
    yield
    sk.use_backend("kernel")


def test_compat_follows_a_pointer_table_rewritten_in_place(triton_on_cpu):
    """The route of a *_layers call is derived from the table's contents: rewriting the table in place
    (same tensor) must send the next copy to the layers it names now."""
    L, N, H, D = 3, 16, 2, 4
    item = H * D * 2
    gen = torch.Generator().manual_seed(10)
    first = [random_bytes_(torch.empty(N, H, D, dtype=torch.float16), gen) for _ in range(2 * L)]
    second = [random_bytes_(torch.empty(N, H, D, dtype=torch.float16), gen) for _ in range(2 * L)]
    k_table = torch.tensor([t.data_ptr() for t in first[:L]])
    v_table = torch.tensor([t.data_ptr() for t in first[L:]])
    host = poison_(torch.empty(2, N, L, H, D, dtype=torch.float16))
    hk, hv = host[0], host[1]  # the same tensors every call: the second call finds the first one's route
    d_idx, h_idx = torch.tensor([1, 5, 9]), torch.tensor([0, 2, 4])

    def check(layers):
        want = poison_(torch.empty_like(host))
        for kv in range(2):
            for layer in range(L):
                want[kv][h_idx, layer] = layers[kv * L + layer][d_idx]
        assert same_bytes(host, want)

    sk.transfer_kv_all_layer_lf_pf(k_table, hk, v_table, hv, d_idx, h_idx, item, L * item, L)
    check(first)
    k_table.copy_(torch.tensor([t.data_ptr() for t in second[:L]]))
    v_table.copy_(torch.tensor([t.data_ptr() for t in second[L:]]))
    poison_(host)
    sk.transfer_kv_all_layer_lf_pf(k_table, hk, v_table, hv, d_idx, h_idx, item, L * item, L)
    check(second)


def _numpy_write(table, values):
    table.numpy()[:] = values.numpy()


def _dlpack_write(table, values):
    torch.utils.dlpack.from_dlpack(table).copy_(values)  # another tensor object: its own version counter


def _data_write(table, values):
    table.data.copy_(values)  # .data: the same memory, a detached version counter


@pytest.mark.parametrize("rewrite", [_numpy_write, _dlpack_write, _data_write], ids=["numpy", "dlpack", "data"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_compat_follows_a_pointer_table_rewritten_without_a_version_bump(triton_on_cpu, rewrite, mla):
    """A table rewritten in place through an alias that torch's version counter does not see (numpy,
    DLPack, ``.data``; on a GPU, a kernel) must still send the next copy to the layers it names now:
    routes are keyed on the table's contents, not its ``_version``. Both sides tables, destinations
    poisoned, compared with plain indexing."""
    L, N, H, D = 3, 16, 1 if mla else 2, 4
    item = H * D * 2
    gen = torch.Generator().manual_seed(12)
    kinds = 1 if mla else 2
    src = [[random_bytes_(torch.empty(N, H, D, dtype=torch.float16), gen) for _ in range(L)] for _ in range(kinds)]
    first = [[poison_(torch.empty(N, H, D, dtype=torch.float16)) for _ in range(L)] for _ in range(kinds)]
    second = [[poison_(torch.empty(N, H, D, dtype=torch.float16)) for _ in range(L)] for _ in range(kinds)]

    def addresses(layers):
        return torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)

    src_tables = [addresses(layers) for layers in src]
    dst_tables = [addresses(layers) for layers in first]
    si, di = torch.tensor([1, 5, 9, 14]), torch.tensor([0, 2, 4, 15])

    def copy():
        if mla:
            sk.transfer_kv_all_layer_mla(src_tables[0], dst_tables[0], si, di, item, L)
        else:
            sk.transfer_kv_all_layer(src_tables[0], dst_tables[0], src_tables[1], dst_tables[1], si, di, item, L)

    def check(written, untouched):
        for kv in range(kinds):
            for layer in range(L):
                want = poison_(torch.empty(N, H, D, dtype=torch.float16))
                want[di] = src[kv][layer][si]
                assert same_bytes(written[kv][layer], want), (kv, layer)
                assert same_bytes(untouched[kv][layer], poison_(torch.empty_like(want))), (kv, layer)

    copy()
    check(first, second)
    for kv in range(kinds):
        for t in first[kv]:
            poison_(t)
        version = dst_tables[kv]._version
        rewrite(dst_tables[kv], addresses(second[kv]))
        assert dst_tables[kv]._version == version  # the rewrite is invisible to the version counter
        assert dst_tables[kv].tolist() == addresses(second[kv]).tolist()
    copy()
    check(second, first)


def test_compat_per_layer_calls_use_the_tensors_they_are_given(triton_on_cpu):
    """One cached route per (function, tensors, sizes): alternating between two layers' tensors must
    write each call's own destination."""
    gen = torch.Generator().manual_seed(11)
    src = [random_bytes_(torch.empty(16, 1, 8, dtype=torch.float16), gen) for _ in range(2)]
    dst = [poison_(torch.empty(16, 1, 8, dtype=torch.float16)) for _ in range(2)]
    si, di = torch.tensor([0, 3, 7]), torch.tensor([2, 4, 6])
    for i in (0, 1, 0, 1):
        sk.transfer_kv_per_layer_mla(src[i], dst[i], si, di, 16)
    for i in range(2):
        want = poison_(torch.empty_like(dst[i]))
        want[di] = src[i][si]
        assert same_bytes(dst[i], want)
    with pytest.raises(ValueError, match="item_size"):
        sk.transfer_kv_per_layer_mla(src[0], dst[0], si, di, 0)


def test_compat_layer_id_is_checked(triton_on_cpu):
    host = torch.zeros(8, 3, 1, 4, dtype=torch.float16)  # page-first [N, L, item]: 3 layers of 8 bytes
    dst = torch.zeros(8, 1, 4, dtype=torch.float16)
    i = torch.tensor([0])
    with pytest.raises(ValueError, match=r"layer_id: expected an int in \[0, 3\)"):
        sk.transfer_kv_per_layer_mla_pf_lf(host, dst, i, i, 3, 8, 24)
    with pytest.raises(TypeError, match="layer_id"):
        sk.transfer_kv_per_layer_mla_pf_lf(host, dst, i, i, 1.0, 8, 24)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["kernel", "direct", "triton"])
def test_gpu_batch_plan_puts_indices_where_the_backend_reads_them_and_fixes_the_stream(backend):
    """CPU or CUDA indices end where the backend reads them (the copy engines: the host; the kernels:
    the pool's device), the stream is fixed (given, or current at the call), and the layer plans of
    the batch, issued on a busy side stream, land as the reference says."""
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.bfloat16, page_size=16, direction="h2d",
                       device="cuda", pin=True, num_layers=4, host_pages=4)  # fmt: skip
    d_idx, h_idx = make_indices("pages", 96, 64, 16, count=32, seed=12)
    b = bind(pools)
    want = "cpu" if backend == "direct" else "cuda"
    for given in ((d_idx, h_idx), (d_idx.cuda(), h_idx.cuda())):
        current = b.batch_plan("h2d", *given, backend=backend)
        assert current.stream == torch.cuda.current_stream()
        assert current.src_indices.device.type == current.dst_indices.device.type == want
    expected = expected_after(pools, "h2d", d_idx, h_idx, None)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)
    batch = b.batch_plan("h2d", d_idx, h_idx, backend=backend, stream=side)
    assert batch.stream is side
    for layer in range(4):
        get_backend(backend).run(b.layer_plan(batch, layer))
    torch.cuda.synchronize()
    assert pools.equal(expected)


@pytest.mark.gpu
def test_gpu_binding_load_captured_in_a_graph():
    pools = make_pools(layout="page_first_direct", mla=True, dtype=torch.bfloat16, page_size=16, direction="h2d",
                       device="cuda", pin=True, host_pages=4)  # fmt: skip
    b = bind(pools)
    d_idx, h_idx = (t.cuda() for t in make_indices("pages", 96, 64, 16, count=32, seed=13))
    b.load(d_idx, h_idx, layer_id=2, backend="kernel", check_indices=False)  # warm-up: the route's table and alias
    torch.cuda.synchronize()
    poison_(pools.device_k)
    expected = expected_after(pools, "h2d", d_idx.cpu(), h_idx.cpu(), 2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b.load(d_idx, h_idx, layer_id=2, backend="kernel", check_indices=False)
    graph.replay()
    torch.cuda.synchronize()
    assert pools.equal(expected)


@pytest.mark.gpu
@pytest.mark.gpu_smoke
@pytest.mark.parametrize("rewrite", ["copy_", "data+increment_version"])
def test_gpu_compat_follows_a_cuda_pointer_table_rewritten_in_place(rewrite):
    """A CUDA pointer table is not read back on every call (that would synchronise): its in-place
    version stands for its contents. Rewritten by an in-place op (which bumps it), or behind torch's
    back followed by ``torch.autograd.graph.increment_version`` (the documented contract), the next
    call must copy into the layers the table names now, on the kernel backend, and leave the old
    layers alone."""
    L, N, H, D = 3, 64, 2, 8
    item = H * D * 2
    gen = torch.Generator().manual_seed(21)

    def layers(fill):
        out = [torch.empty(N, H, D, dtype=torch.float16) for _ in range(L)]
        return [(random_bytes_(t, gen) if fill == "random" else poison_(t)).cuda() for t in out]

    def addresses(ls):
        return torch.tensor([t.data_ptr() for t in ls], dtype=torch.int64, device="cuda")

    src, first, second = layers("random"), layers("poison"), layers("poison")
    src_table, dst_table = addresses(src), addresses(first)
    si = torch.tensor([1, 5, 9, 14, 33], device="cuda")
    di = torch.tensor([0, 2, 4, 15, 63], device="cuda")

    def check(written, untouched):
        for layer in range(L):
            want = poison_(torch.empty(N, H, D, dtype=torch.float16))
            want[di.cpu()] = src[layer].cpu()[si.cpu()]
            assert same_bytes(written[layer].cpu(), want), layer
            assert same_bytes(untouched[layer].cpu(), poison_(torch.empty_like(want))), layer

    sk.transfer_kv_all_layer_mla(src_table, dst_table, si, di, item, L)
    torch.cuda.synchronize()
    check(first, second)
    for t in first:
        poison_(t)
    if rewrite == "copy_":
        dst_table.copy_(addresses(second))
    else:
        version = dst_table._version
        dst_table.data.copy_(addresses(second))  # .data: a detached version counter
        assert dst_table._version == version
        torch.autograd.graph.increment_version(dst_table)
    sk.transfer_kv_all_layer_mla(src_table, dst_table, si, di, item, L)
    torch.cuda.synchronize()
    check(second, first)


@pytest.mark.gpu
def test_gpu_tables_go_with_their_pools():
    before = len(launch.device_tables)
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, device="cuda", pin=True,
                       stacked=False)  # fmt: skip
    d_idx, h_idx = (t.cuda() for t in make_indices("random", 96, 48, 1, count=8, seed=14))
    for layer_id in (None, 0, 1):  # three routes, one table
        ops.transfer("d2h", pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="page_first",
                     page_size=1, layer_id=layer_id, backend="kernel")  # fmt: skip
    torch.cuda.synchronize()
    assert len(launch.device_tables) == before + 1
    del pools
    gc.collect()
    assert len(launch.device_tables) == before


@pytest.mark.parametrize("packed", [True, False])
def test_list_identity_check_with_and_without_the_extension(monkeypatch, packed):
    """A cached per-layer list is found again only for a list or tuple of the very same tensors, in
    order; the extension's packed check and the pure-Python one agree."""
    from hicache_kernels import identity_cache

    if packed and identity_cache._same_items is None:
        pytest.skip("the extension is not built")
    if not packed:
        monkeypatch.setattr(identity_cache, "_same_items", None)
    layers = [torch.randn(4, 2) for _ in range(5)]
    same = identity_cache._Same(layers)
    assert (same.packed is not None) == packed
    assert same(layers) and same(list(layers)) and same(tuple(layers))
    assert not same(layers[:4]) and not same([*layers, layers[0]])
    assert not same([layers[1], layers[0], *layers[2:]])
    assert not same([torch.randn(4, 2), *layers[1:]])
    assert not same({0: layers[0]}) and not same(iter(layers))


# ---------------------------------------------------------------------------------------------- warm
@pytest.mark.parametrize(("layout", "mla"), [("page_first", False), ("page_head", False), ("layer_first", True)])
def test_warm_launches_every_route_once_and_writes_nothing(monkeypatch, layout, mla):
    """Triton: one launch per direction, over every layer and over one, each of one pair outside both
    pools, in the kernel itself (masked there): every pool byte stays as it was."""
    from hicache_kernels.backends import triton as tt

    pools = make_pools(layout=layout, mla=mla, dtype=torch.float16, page_size=4, device_slots=24, host_pages=3)
    poison_(pools.host)  # both sides hold bytes a stray write would change
    before = pools.clone()
    seen = []
    run = tt.run_triton

    def recording(plan, max_programs=None):
        r = plan.route
        seen.append((r.direction, r.layer_begin, r.layer_count, plan.src_indices.tolist(),
                     plan.dst_indices.tolist(), plan.src_indices.dtype))  # fmt: skip
        run(plan, max_programs)

    monkeypatch.setattr(tt, "run_triton", recording)
    assert bind(pools).warm("triton") == 4
    L = 3
    assert seen == [(d, 0, n, [-1], [-1], torch.int64) for d in ("d2h", "h2d") for n in (L, 1)]
    assert pools.equal(before)


@pytest.mark.parametrize("backend", ["direct", "batch", "staged", "auto", "kernel"])
def test_warm_launches_nothing_where_there_is_nothing_to_compile(backend):
    """direct / batch / staged compile nothing; auto picks direct for CPU pools; kernel cannot run here
    (no CUDA): no launch, nothing written."""
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=4, device_slots=24,
                       host_pages=3)  # fmt: skip
    before = pools.clone()
    assert bind(pools).warm(backend) == 0
    assert pools.equal(before)


def test_warm_arguments_checked():
    b = bind(make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=4, device_slots=24,
                        host_pages=3))  # fmt: skip
    with pytest.raises(TypeError, match="backend: expected a backend name"):
        b.warm(3)
    with pytest.raises(ValueError, match="unknown|backend"):
        b.warm("no-such-backend")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["kernel", "triton"])
def test_gpu_warm_writes_nothing_counts_nothing_and_leaves_nothing_to_compile(backend):
    """On a GPU: warm launches every route (nothing written; the kernel backend's skip counter untouched);
    afterwards a Triton load of a batch size not seen before compiles no new variant."""
    from hicache_kernels.backends import triton as tt

    pools = make_pools(layout="page_first", mla=False, dtype=torch.bfloat16, page_size=4, device="cuda", pin=True,
                       device_slots=64, host_pages=8)  # fmt: skip
    b = bind(pools)
    be = get_backend("kernel", count_skipped=True) if backend == "kernel" else get_backend("triton")
    before = pools.clone()
    assert b.warm(be) == 4
    torch.cuda.synchronize()
    assert pools.equal(before)
    if backend == "kernel":
        assert be.skipped() == 0
        return
    kernel = tt._kernel(False)
    caches = getattr(kernel, "device_caches", None)  # device -> (compiled kernels, ...) in Triton 3.x

    def count():
        return None if caches is None else sum(len(c[0]) for c in caches.values())

    compiled = count()
    assert compiled != 0  # warm compiled the routes
    d_idx, h_idx = make_indices("random", 64, 32, 4, count=7, seed=9)
    b.load(d_idx.cuda(), h_idx.cuda(), backend=be)
    b.load(d_idx.cuda(), h_idx.cuda(), layer_id=2, backend=be)
    torch.cuda.synchronize()
    assert count() == compiled
