"""Bad inputs raise a clear error naming the argument, and nothing is written."""

from __future__ import annotations

import collections
import random
import warnings

import numpy as np
import pytest
import torch

from hicache_kernels import BackendUnavailableError, _validate, ops

from kvdata import Pools, expected_after, make_pools, poison_, random_bytes_


def base_args(direction="d2h", layout="page_first", mla=False, page_size=4):
    pools = make_pools(layout=layout, mla=mla, dtype=torch.float16, page_size=page_size, direction=direction,
                       device_slots=16, host_pages=2)  # fmt: skip
    args = dict(
        direction=direction, device_k=pools.device_k, device_v=pools.device_v, host=pools.host,
        device_indices=torch.tensor([0, 1, 2]), host_indices=torch.tensor([4, 5, 6]),
        layout=layout, page_size=page_size, backend="direct",
    )  # fmt: skip
    return pools, args


def call(args):
    a = dict(args)
    ops.transfer(a.pop("direction"), a.pop("device_k"), a.pop("device_v"), a.pop("host"), a.pop("device_indices"),
                 a.pop("host_indices"), **a)  # fmt: skip


def noncontig_stacked(args):
    k = args["device_k"]
    return k.transpose(2, 3).contiguous().transpose(2, 3)


def both(fn):
    """Changes applying ``fn`` to device_k and device_v."""
    return {"device_k": lambda a: fn(a["device_k"]), "device_v": lambda a: fn(a["device_v"])}


BAD = [
    # (id, changes, exception, message fragments)
    ("direction", {"direction": "up"}, ValueError, ["direction", "'up'"]),
    ("layout-unknown", {"layout": "head_first"}, ValueError, ["layout", "head_first"]),
    ("layout-type", {"layout": 3}, TypeError, ["layout"]),
    ("page-size-zero", {"page_size": 0}, ValueError, ["page_size", "0"]),
    ("page-size-bool", {"page_size": True}, TypeError, ["page_size", "bool"]),
    ("page-size-float", {"page_size": 4.0}, TypeError, ["page_size", "float"]),
    ("page-size-np-float", {"page_size": np.float64(4.0)}, TypeError, ["page_size", "float64"]),
    ("page-size-np-bool", {"page_size": np.bool_(True)}, TypeError, ["page_size", "bool"]),
    ("page-size-tensor", {"page_size": torch.tensor(4)}, TypeError, ["page_size", "Tensor"]),
    ("page-size-np-zero", {"page_size": np.int64(0)}, ValueError, ["page_size", "0"]),
    ("page-size-mismatch", {"page_size": 3}, ValueError, ["host", "page_size 3"]),
    ("device-k-3d", {"device_k": lambda a: a["device_k"][0]}, ValueError, ["device_k", "3-D"]),
    ("device-k-type", {"device_k": lambda a: a["device_k"].numpy()}, TypeError, ["device_k", "ndarray"]),
    ("device-k-empty", {"device_k": []}, ValueError, ["device_k", "empty"]),
    ("device-k-no-layers", {"device_k": lambda a: a["device_k"][:0]}, ValueError, ["device_k", "at least one layer"]),
    # Both pools emptied or moved alike, so the error must come from the pool itself, not a K/V mismatch.
    ("pools-no-slots", both(lambda t: t[:, :0]), ValueError, ["device_k", "all positive", "(0, 2, 8)"]),
    ("pools-no-heads", both(lambda t: t[:, :, :0]), ValueError, ["device_k", "all positive", "(16, 0, 8)"]),
    ("pools-head-dim-0", both(lambda t: t[..., :0]), ValueError, ["device_k", "all positive", "(16, 2, 0)"]),
    ("pools-meta", both(lambda t: t.to("meta")), ValueError, ["device_k", "meta tensors hold no memory"]),
    (
        "pools-meta-lists",
        both(lambda t: [x.to("meta") for x in t]),
        ValueError,
        ["device_k", "meta tensors hold no memory"],
    ),
    ("device-k-noncontig", {"device_k": noncontig_stacked}, ValueError, ["device_k", "contiguous"]),
    ("device-k-int32", {"device_k": lambda a: a["device_k"].to(torch.int32)}, TypeError, ["device_k", "int32"]),
    (
        "device-k-mixed-dtype",
        {"device_k": lambda a: [a["device_k"][0], a["device_k"][1].to(torch.bfloat16), a["device_k"][2]]},
        TypeError,
        ["device_k[1]", "bfloat16"],
    ),
    (
        "device-k-mixed-shape",
        {"device_k": lambda a: [a["device_k"][0], a["device_k"][1][:8], a["device_k"][2]]},
        ValueError,
        ["device_k[1]", "shape"],
    ),
    ("device-v-layers", {"device_v": lambda a: a["device_v"][:2]}, ValueError, ["device_v", "3 layers"]),
    ("device-v-dtype", {"device_v": lambda a: a["device_v"].to(torch.float32)}, ValueError, ["device_v", "float32"]),
    ("host-dtype", {"host": lambda a: a["host"].to(torch.bfloat16)}, TypeError, ["host", "bfloat16", "float16"]),
    ("host-shape", {"host": lambda a: a["host"][:, :6].contiguous()}, ValueError, ["host", "shape", "(2, 6, 3, 2, 8)"]),
    ("host-noncontig", {"host": lambda a: a["host"].transpose(3, 4)}, ValueError, ["host"]),
    ("host-type", {"host": "pool"}, TypeError, ["host", "str"]),
    (
        "idx-int32",
        {"device_indices": torch.tensor([0, 1, 2], dtype=torch.int32)},
        TypeError,
        ["device_indices", "int32"],
    ),
    ("idx-host-float", {"host_indices": torch.tensor([4.0, 5.0, 6.0])}, TypeError, ["host_indices", "float32"]),
    ("idx-2d", {"device_indices": torch.tensor([[0, 1, 2]])}, ValueError, ["device_indices", "1-D"]),
    ("idx-list", {"host_indices": [4, 5, 6]}, TypeError, ["host_indices", "list"]),
    ("idx-length", {"host_indices": torch.tensor([4, 5])}, ValueError, ["host_indices", "(3)", "got 2"]),
    ("idx-dev-range", {"device_indices": torch.tensor([0, 16, 2])}, IndexError, ["device_indices", "16", "16 slots"]),
    ("idx-dev-neg", {"device_indices": torch.tensor([0, -1, 2])}, IndexError, ["device_indices", "-1"]),
    ("idx-host-range", {"host_indices": torch.tensor([4, 5, 8])}, IndexError, ["host_indices", "8", "8 slots"]),
    ("layer-id", {"layer_id": 3}, ValueError, ["layer_id", "[0, 3)", "3"]),
    ("layer-id-neg", {"layer_id": -1}, ValueError, ["layer_id"]),
    ("layer-id-np-range", {"layer_id": np.int32(3)}, ValueError, ["layer_id", "[0, 3)"]),
    ("layer-id-bool", {"layer_id": False}, TypeError, ["layer_id", "bool"]),
    ("layer-id-float", {"layer_id": 1.0}, TypeError, ["layer_id", "float"]),
    ("layer-id-str", {"layer_id": "1"}, TypeError, ["layer_id", "str"]),
    ("backend-name", {"backend": "dma"}, ValueError, ["backend", "dma"]),
    ("backend-unhashable", {"backend": ["direct"]}, TypeError, ["backend", "list"]),
    ("backend-none", {"backend": None}, TypeError, ["backend", "NoneType"]),
    ("kernel-on-cpu", {"backend": "kernel"}, BackendUnavailableError, ["kernel"]),
]


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize(("changes", "exc", "fragments"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_and_writes_nothing(direction, changes, exc, fragments):
    pools, args = base_args(direction)
    before = pools.clone()
    for key, value in changes.items():
        args[key] = value(args) if callable(value) else value
    with pytest.raises(exc) as info:
        call(args)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value!s}"
    assert pools.equal(before), "a rejected call wrote to a pool"


def test_mla_rejects_page_head():
    pools, args = base_args(layout="page_first", mla=True)
    args["layout"] = "page_head"
    with pytest.raises(ValueError, match="layout: 'page_head' splits an item by head and MLA"):
        call(args)


def test_mla_pool_needs_one_head():
    pools, args = base_args(layout="page_first", mla=False)
    args["device_v"] = None
    with pytest.raises(ValueError, match=r"device_k: an MLA pool .* H=2"):
        call(args)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pools, args = base_args()
    before = pools.clone()
    args["backend"] = "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        call(args)
    assert pools.equal(before)


def test_kernel_backend_options_are_checked():
    from hicache_kernels.backends import get_backend

    with pytest.raises(ValueError, match="num_blocks"):
        get_backend("kernel", num_blocks=0)
    with pytest.raises(ValueError, match="warps_per_block"):
        get_backend("kernel", warps_per_block=33)
    with pytest.raises(ValueError, match="options"):
        get_backend(get_backend("direct"), num_blocks=1)


# A pool on the meta device used to segfault the process on the triton backend (it read address 0)
# and fail with an unrelated RuntimeError on the others.
@pytest.mark.parametrize("backend", ["triton", "direct", "batch", "auto"])
def test_meta_pool_is_refused_on_every_backend(backend):
    pools, args = base_args()
    before = pools.clone()
    args.update(backend=backend, device_k=pools.device_k.to("meta"), device_v=pools.device_v.to("meta"))
    with pytest.raises(ValueError, match=r"device_k: .* on meta \(meta tensors hold no memory\)"):
        call(args)
    assert pools.equal(before)


INTS = [np.int64, np.int32, np.uint8, int]


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("as_int", INTS, ids=[t.__name__ for t in INTS])
def test_numpy_integers_work_like_ints(direction, as_int):
    pools, args = base_args(direction)
    d_idx, h_idx = args["device_indices"], args["host_indices"]
    exp = expected_after(pools, direction, d_idx, h_idx, layer_id=1)
    args.update(layer_id=as_int(1), page_size=as_int(4))
    call(args)
    assert pools.equal(exp)


@pytest.mark.parametrize("name", ["backup_layer", "load_layer"])
def test_per_layer_ops_refuse_layer_id_none(name):
    """transfer() reads layer_id=None as every layer; the per-layer ops used to pass it through."""
    pools, args = base_args("d2h" if name.startswith("backup") else "h2d")
    before = pools.clone()
    fn = getattr(ops, name)
    with pytest.raises(TypeError, match=rf"layer_id: {name} moves one layer .* None"):
        fn(pools.device_k, pools.device_v, pools.host, args["device_indices"], args["host_indices"],
           layer_id=None, layout="page_first", page_size=4, backend="direct")  # fmt: skip
    assert pools.equal(before)


# Destination slots: host_indices for a backup (d2h), device_indices for a load (h2d).
DUPS = [
    # (id, destination slots, the repeated slot named in the error)
    ("adjacent", [4, 4, 5], 4),
    ("apart", [7, 5, 6, 7], 7),
    ("three", [6, 6, 6], 6),
    ("first-and-last", [0, 3, 2, 1, 0], 0),
]


@pytest.mark.parametrize("backend", ["direct", "triton"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize(("dst", "slot"), [d[1:] for d in DUPS], ids=[d[0] for d in DUPS])
def test_repeated_destination_slot_is_refused(direction, dst, slot, backend):
    pools, args = base_args(direction, layout="page_first_direct")
    before = pools.clone()
    src = torch.arange(1, 1 + len(dst))  # distinct, in range of either pool
    d2h = direction == "d2h"
    args.update(backend=backend, device_indices=src if d2h else torch.tensor(dst),
                host_indices=torch.tensor(dst) if d2h else src)  # fmt: skip
    name = "host_indices" if d2h else "device_indices"
    with pytest.raises(ValueError, match=rf"{name}: destination slot {slot} appears more than once"):
        call(args)
    assert pools.equal(before), "a rejected call wrote to a pool"


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_repeated_source_slots_and_slots_of_one_page_are_fine(direction):
    """Only a repeated destination token slot is a race: a source slot read twice, or several slots of
    one page (page_first_direct, page 4), are valid and land like the reference says."""
    pools, args = base_args(direction, layout="page_first_direct")
    src, dst = torch.tensor([3, 3, 1, 3]), torch.tensor([4, 5, 6, 7])  # dst: the four slots of page 1
    d_idx, h_idx = (src, dst) if direction == "d2h" else (dst, src)
    exp = expected_after(pools, direction, d_idx, h_idx, layer_id=None)
    args.update(device_indices=d_idx, host_indices=h_idx)
    call(args)
    assert pools.equal(exp)


def test_out_of_range_is_reported_before_a_repeat():
    pools, args = base_args()
    args.update(host_indices=torch.tensor([4, 4, 8]))
    with pytest.raises(IndexError, match="host_indices: index 8"):
        call(args)


def test_fast_mode_does_not_check_repeats():
    """check_indices=False costs no sync and is documented not to look for repeats: no error, the
    repeated slot holds one of its sources and every other slot is as the reference says."""
    pools, args = base_args()
    args.update(device_indices=torch.tensor([0, 1, 2]), host_indices=torch.tensor([4, 4, 5]), check_indices=False)
    one = expected_after(pools, "d2h", torch.tensor([0, 2]), torch.tensor([4, 5]), layer_id=None)
    other = expected_after(pools, "d2h", torch.tensor([1, 2]), torch.tensor([4, 5]), layer_id=None)
    call(args)
    assert pools.equal(one) or pools.equal(other)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["both-cuda", "device-cuda"])
def test_range_and_repeat_checks_share_one_sync(where):
    """CUDA indices: the range check and the repeat check together synchronise exactly once."""
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=4, direction="d2h",
                       device_slots=16, host_pages=2, device="cuda", pin=True)  # fmt: skip
    d_idx = torch.tensor([0, 1, 2], device="cuda")
    h_idx = torch.tensor([4, 5, 6], device="cuda" if where == "both-cuda" else "cpu")
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            ops.build_plan("d2h", pools.device_k, pools.device_v, pools.host, d_idx, h_idx,
                           layout="page_first", page_size=4)  # fmt: skip
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch also warns once per process that the debug mode is a prototype ("...does not yet detect all
    # synchronizing operations"): only the per-sync warning counts (seen on the H200, torch 2.11).
    syncs = [w for w in seen if "called a synchronizing cuda operation" in str(w.message).lower()]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize(("layer_id", "exc"), [(-1, ValueError), (-2, ValueError), (1.0, TypeError)])
def test_layer_id_is_checked_under_torch_compile(layer_id, exc):
    """The custom op reads layer_id -1 as "every layer": under torch.compile a negative layer_id used to
    reach it and move every layer instead of being refused. (Numpy integers are left to the eager
    tests: dynamo turns numpy scalars into tensors, and torch 2.11 then cannot trace index() on them.)"""
    pools, args = base_args()
    before = pools.clone()
    d_idx, h_idx = args["device_indices"], args["host_indices"]

    def step(k, v, host):
        ops.backup_layer(k, v, host, d_idx, h_idx, layer_id=layer_id, layout="page_first", page_size=4,
                         backend="direct")  # fmt: skip
        return host

    torch._dynamo.reset()
    with pytest.raises(Exception, match="layer_id") as info:
        torch.compile(step, backend="aot_eager", fullgraph=True)(pools.device_k, pools.device_v, pools.host)
    assert exc.__name__ in f"{type(info.value).__name__}: {info.value}"
    assert pools.equal(before)


# -- device and host pools sharing memory: refused where the pools are bound, before anything is written -----
# base_args' geometry: page_first host [2, 8, 3, 2, 8] and device pools [3, 16, 2, 8], 768 elements each.
SHARED = [
    # (id, device_k, device_v, host, the message's names) as views of one buffer of 3 * 768 elements
    ("device_k-is-the-host", lambda b: b[:768], lambda b: b[768:1536], lambda b: b[:768], ("host", "device_k")),
    (
        "a-device_v-layer-in-the-host",
        lambda b: b[:768],
        lambda b: [b[768:1024], b[1024:1280], b[1600:1856]],
        lambda b: b[1536:2304],
        ("host", r"device_v\[2\]"),
    ),
    (
        "host-straddles-device_v",
        lambda b: b[:768],
        lambda b: b[768:1536],
        lambda b: b[1500:2268],
        ("host", "device_v"),
    ),
]
ENTRY_POINTS = ["transfer", "named_op", "build_plan", "KVBinding", "custom_op"]


def shared_pools(case, direction):
    """The case's pools as views of one buffer: sources random, then destinations poisoned."""
    _, k, v, host, _ = case
    buf = torch.empty(3 * 768 + 64, dtype=torch.float16)
    random_bytes_(buf, torch.Generator().manual_seed(30))

    def shaped(t, layer_shape=(16, 2, 8)):
        return [x.view(layer_shape) for x in t] if isinstance(t, list) else t.view(3, *layer_shape)

    k, v, host = shaped(k(buf)), shaped(v(buf)), host(buf).view(2, 8, 3, 2, 8)
    for t in [host] if direction == "d2h" else ([k] + (v if isinstance(v, list) else [v])):
        poison_(t)
    return buf, k, v, host


def run_entry(entry, direction, k, v, host):
    d_idx, h_idx = torch.tensor([0, 1, 9]), torch.tensor([4, 5, 6])
    kw = {"layout": "page_first", "page_size": 4}
    if entry == "transfer":
        ops.transfer(direction, k, v, host, d_idx, h_idx, backend="direct", **kw)
    elif entry == "named_op":
        if direction == "d2h":
            ops.backup_all_layers(k, v, host, d_idx, h_idx, backend="triton", **kw)
        else:
            ops.load_layer(k, v, host, d_idx, h_idx, layer_id=2, backend="triton", **kw)
    elif entry == "build_plan":
        ops.build_plan(direction, k, v, host, d_idx, h_idx, **kw)
    elif entry == "KVBinding":
        ops.KVBinding(k, v, host, **kw).transfer(direction, d_idx, h_idx, backend="direct")
    else:
        op = ops.backup_op if direction == "d2h" else ops.load_op
        op(k if isinstance(k, list) else [k], v if isinstance(v, list) else [v], host, d_idx, h_idx, "page_first", 4,
           -1, "direct", True)  # fmt: skip


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("case", SHARED, ids=[c[0] for c in SHARED])
def test_device_and_host_pools_sharing_memory_are_refused(case, direction, entry):
    """The kernels read sources through the non-coherent cache, so a copy onto its own source is
    undefined: pools that share memory are refused with a ValueError naming both, and nothing is written."""
    buf, k, v, host = shared_pools(case, direction)
    before = buf.clone()
    dst, src = case[4]
    with pytest.raises(ValueError, match=rf"^{dst}: its memory .* overlaps {src}'s .* must not share memory"):
        run_entry(entry, direction, k, v, host)
    assert torch.equal(buf.view(torch.uint8), before.view(torch.uint8)), "a refused call wrote"


@pytest.mark.parametrize("backend", ["direct", "triton"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_pools_in_disjoint_views_of_one_buffer_are_fine(direction, backend):
    """Device and host pools may be views of one storage when their bytes do not overlap (here they
    touch: the host starts where device_v ends)."""
    buf = torch.empty(3 * 768, dtype=torch.float16)
    random_bytes_(buf, torch.Generator().manual_seed(31))
    k, v, host = buf[:768].view(3, 16, 2, 8), buf[768:1536].view(3, 16, 2, 8), buf[1536:].view(2, 8, 3, 2, 8)
    pools = Pools(k, v, host, "page_first", 4)
    d_idx, h_idx = torch.tensor([0, 1, 9]), torch.tensor([4, 5, 6])
    exp = expected_after(pools, direction, d_idx, h_idx, layer_id=None)
    ops.transfer(direction, k, v, host, d_idx, h_idx, layout="page_first", page_size=4, backend=backend)
    assert pools.equal(exp)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_compiled_and_torch_index_checks_agree(direction, monkeypatch):
    """CPU indices take one compiled pass when the extension is built; the torch path (CUDA indices,
    pure-Python builds) must refuse the same calls with the same message, range faults first."""
    compiled = _validate._index_faults()
    if compiled is None:
        pytest.skip("the extension is not built: only the torch path exists")
    rng = random.Random(direction)
    kinds = collections.Counter()
    for _ in range(400):
        n = rng.randint(1, 10)
        sorted_dst = rng.random() < 0.3  # ascending destinations take the compiled path's no-sort branch
        span = rng.choice([8, 40])  # a narrow span repeats destinations often

        def draw(size: int, span: int = span) -> int:
            return rng.choice([-1, size]) if rng.random() < 0.04 else rng.randrange(min(span, size))

        dev, host = [draw(20) for _ in range(n)], [draw(36) for _ in range(n)]
        if sorted_dst:
            (host if direction == "d2h" else dev).sort()
        outcomes = []
        for check in (compiled, None):
            monkeypatch.setattr(_validate, "_INDEX_FAULTS", check)
            try:
                _validate.index_values(direction, torch.tensor(dev), 20, torch.tensor(host), 36)
                outcomes.append(None)
            except (IndexError, ValueError) as exc:
                outcomes.append((type(exc), str(exc)))
        assert outcomes[0] == outcomes[1], (dev, host)
        kinds[None if outcomes[0] is None else outcomes[0][0]] += 1
    assert all(kinds[k] >= 20 for k in (None, IndexError, ValueError)), kinds
