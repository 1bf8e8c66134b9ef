"""The torch.library custom ops: schema and declared mutation (opcheck), and torch.compile."""

from __future__ import annotations

import pytest
import torch

from hicache_kernels import ops

from kvdata import expected_after, make_indices, make_pools


def op_args(pools, d_idx, h_idx, layer_id=-1):
    k = [pools.device_k] if isinstance(pools.device_k, torch.Tensor) else pools.device_k
    v = (
        []
        if pools.device_v is None
        else ([pools.device_v] if isinstance(pools.device_v, torch.Tensor) else pools.device_v)
    )
    return (k, v, pools.host, d_idx, h_idx, pools.layout, pools.page_size, layer_id, "direct", True)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("stacked", [True, False])
def test_opcheck(direction, stacked):
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.float16, page_size=4, direction=direction,
                       stacked=stacked, device_slots=16, host_pages=2)  # fmt: skip
    d_idx, h_idx = make_indices("random", 16, 8, 4, count=5, seed=0)
    op = ops.backup_op if direction == "d2h" else ops.load_op
    torch.library.opcheck(op, op_args(pools, d_idx, h_idx))


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_custom_op_writes_like_reference(direction):
    pools = make_pools(layout="page_head", mla=False, dtype=torch.bfloat16, page_size=4, direction=direction)
    d_idx, h_idx = make_indices("pages", 96, 16, 4, count=8, seed=1)
    expected = expected_after(pools, direction, d_idx, h_idx, 2)
    op = torch.ops.hicache_kernels.backup if direction == "d2h" else torch.ops.hicache_kernels.load
    op(*op_args(pools, d_idx, h_idx, layer_id=2))
    assert pools.equal(expected)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_torch_compile_fullgraph(direction):
    """Under torch.compile the ops dispatch to the custom ops: no graph break, writes kept."""
    pools = make_pools(layout="page_first", mla=True, dtype=torch.float16, page_size=1, direction=direction)
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=10, seed=2)
    expected = expected_after(pools, direction, d_idx, h_idx, None)
    fn = ops.backup_all_layers if direction == "d2h" else ops.load_all_layers

    def step(k, host, di, hi):
        fn(k, None, host, di, hi, layout="page_first", page_size=1, backend="direct")
        return host.sum() if direction == "d2h" else k.sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(pools.device_k, pools.host, d_idx, h_idx)
    assert pools.equal(expected)


def test_compile_rejects_backend_instances():
    from hicache_kernels.backends import get_backend

    pools = make_pools(layout="page_first", mla=True, dtype=torch.float16, page_size=1)
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=4, seed=2)

    def step(k, host, di, hi):
        ops.backup_all_layers(k, None, host, di, hi, layout="page_first", page_size=1, backend=get_backend("direct"))
        return host

    torch._dynamo.reset()
    with pytest.raises(Exception, match="backend: pass a backend name"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(pools.device_k, pools.host, d_idx, h_idx)
