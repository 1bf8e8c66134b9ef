"""LayerLoads (hicache.controller.layer_loads): one batch of slot pairs loaded layer by layer on the bound pools,
against the reference: exactly the layers issued are written, each layer is prepared once and copies
the host pool's current contents when issued again, the indices are checked once before anything is
written, and on a GPU every layer lands on a busy side stream.

Sources hold random bits and destinations a poison pattern; every comparison is byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.controller.layer_loads import LayerLoads
from hicache_kernels import KVBinding
from hicache_kernels.backends import DirectBackend

from kvdata import expected_after, make_indices, make_pools, random_bytes_


def bind(pools) -> KVBinding:
    return KVBinding(pools.device_k, pools.device_v, pools.host, layout=pools.layout, page_size=pools.page_size)


@pytest.mark.parametrize("backend", ["direct", "triton"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_layer_loads_write_exactly_the_layers_issued(backend, stacked):
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.float16, page_size=4, direction="h2d",
                       stacked=stacked, num_layers=4, device_slots=24, host_pages=3)  # fmt: skip
    b = bind(pools)
    d_idx, h_idx = make_indices("pages", 24, 12, 4, count=8, seed=3)
    loads = LayerLoads(b, d_idx, h_idx, backend=backend)
    assert len(loads) == 4
    loads(2)
    loads(np.int64(0))  # numpy integers work like ints
    partial = expected_after(expected_after(pools, "h2d", d_idx, h_idx, 2), "h2d", d_idx, h_idx, 0)
    assert pools.equal(partial)  # layers 1 and 3 still poisoned
    loads(3)
    loads(1)
    assert pools.equal(expected_after(pools, "h2d", d_idx, h_idx, None))
    with pytest.raises(ValueError, match=r"layer_id: expected an int in \[0, 4\), got 4"):
        loads(4)
    with pytest.raises(TypeError, match="layer_id"):
        loads(1.0)


def test_layer_loads_prepare_each_layer_once_and_copy_current_contents():
    """A layer issued again copies what the host pool holds then, without preparing again."""

    class Counting(DirectBackend):
        prepared: list[int] = []

        def _prepare(self, plan):
            self.prepared.append(plan.layer_begin)
            return super()._prepare(plan)

    pools = make_pools(layout="page_first", mla=True, dtype=torch.float32, page_size=1, direction="h2d")
    b = bind(pools)
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=10, seed=4)
    backend = Counting()
    loads = LayerLoads(b, d_idx, h_idx, backend=backend)
    for layer in range(3):
        loads(layer)
    random_bytes_(pools.host, torch.Generator().manual_seed(5))
    expected = expected_after(pools, "h2d", d_idx, h_idx, 1)
    loads(1)
    assert pools.equal(expected)
    assert backend.prepared == [0, 1, 2]


def test_layer_loads_check_the_indices_once_before_anything_is_written():
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, direction="h2d")
    before = pools.clone()
    b = bind(pools)
    with pytest.raises(IndexError, match="host_indices: index 48"):
        LayerLoads(b, torch.tensor([0, 1]), torch.tensor([0, 48]), backend="direct")
    with pytest.raises(ValueError, match="device_indices: destination slot 3 appears more than once"):
        LayerLoads(b, torch.tensor([3, 3]), torch.tensor([0, 1]), backend="direct")
    assert pools.equal(before)


def test_layer_loads_refuse_a_backend_that_is_not_one():
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, direction="h2d")
    with pytest.raises(TypeError, match="backend: expected a backend name"):
        LayerLoads(bind(pools), torch.tensor([0]), torch.tensor([0]), backend=object())


def test_layer_loads_keep_the_indices_where_the_backend_reads_them():
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, direction="h2d")
    b = bind(pools)
    loads = LayerLoads(b, torch.tensor([4, 5]), torch.tensor([6, 7]), backend="direct")
    assert loads.binding is b and loads.stream is None and isinstance(loads.backend, DirectBackend)
    assert loads.device_indices.tolist() == [4, 5] and loads.host_indices.tolist() == [6, 7]


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["kernel", "direct", "triton"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_gpu_layer_loads_on_a_side_stream(backend, stacked):
    """CPU indices moved once to where the backend reads them, every layer issued on a busy side
    stream: each lands as the reference says."""
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.bfloat16, page_size=16, direction="h2d",
                       stacked=stacked, device="cuda", pin=True, num_layers=4, host_pages=4)  # fmt: skip
    d_idx, h_idx = make_indices("pages", 96, 64, 16, count=32, seed=12)
    expected = expected_after(pools, "h2d", d_idx, h_idx, None)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)
    loads = LayerLoads(bind(pools), d_idx, h_idx, backend=backend, stream=side)
    for layer in range(4):
        loads(layer)
    torch.cuda.synchronize()
    assert pools.equal(expected)
