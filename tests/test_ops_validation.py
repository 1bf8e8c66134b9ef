"""Bad inputs raise a clear error naming the argument, and nothing is written."""

from __future__ import annotations

import pytest
import torch

from hicache_kernels import BackendUnavailableError, ops

from kvdata import make_pools


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


BAD = [
    # (id, changes, exception, message fragments)
    ("direction", {"direction": "up"}, ValueError, ["direction", "'up'"]),
    ("layout-unknown", {"layout": "head_first"}, ValueError, ["layout", "head_first"]),
    ("layout-type", {"layout": 3}, TypeError, ["layout"]),
    ("page-size-zero", {"page_size": 0}, ValueError, ["page_size", "0"]),
    ("page-size-bool", {"page_size": True}, ValueError, ["page_size"]),
    ("page-size-float", {"page_size": 4.0}, ValueError, ["page_size"]),
    ("page-size-mismatch", {"page_size": 3}, ValueError, ["host", "page_size 3"]),
    ("device-k-3d", {"device_k": lambda a: a["device_k"][0]}, ValueError, ["device_k", "3-D"]),
    ("device-k-type", {"device_k": lambda a: a["device_k"].numpy()}, TypeError, ["device_k", "ndarray"]),
    ("device-k-empty", {"device_k": []}, ValueError, ["device_k", "empty"]),
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
    ("backend-name", {"backend": "dma"}, ValueError, ["backend", "dma"]),
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
