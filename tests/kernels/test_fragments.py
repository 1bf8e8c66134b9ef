"""Copy-engine planning: run merging, page boundaries, 1-D splitting, fragment counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache_kernels import ops
from hicache_kernels.fragments import Fragments, find_runs, plan_fragments, split_rows

from kvdata import make_indices, make_pools


def runs(src, dst, sp=1, dp=1):
    s, d, n = find_runs(np.array(src), np.array(dst), sp, dp)
    return list(zip(s.tolist(), d.tolist(), n.tolist(), strict=True))


def test_find_runs_merges_consecutive_pairs():
    assert runs([5, 6, 7, 10], [0, 1, 2, 3]) == [(5, 0, 3), (10, 3, 1)]


def test_find_runs_sorts_by_source_first():
    assert runs([7, 5, 6], [2, 0, 1]) == [(5, 0, 3)]


def test_find_runs_needs_both_sides_consecutive():
    assert runs([1, 2, 3], [0, 2, 3]) == [(1, 0, 1), (2, 2, 2)]


def test_find_runs_breaks_at_page_boundaries():
    # Source pages of 4: slot 4 starts a new page. Destination pages of 2: slot 2 does.
    assert runs([2, 3, 4, 5], [10, 11, 12, 13], sp=4) == [(2, 10, 2), (4, 12, 2)]
    assert runs([0, 1, 2, 3], [1, 2, 3, 4], dp=2) == [(0, 1, 1), (1, 2, 2), (3, 4, 1)]


def test_find_runs_empty():
    assert runs([], []) == []


def test_split_rows_keeps_contiguous_fragments_whole():
    f = Fragments(
        dst=np.array([1000, 5000]), dst_pitch=np.array([16, 64]), src=np.array([0, 200]), src_pitch=np.array([16, 16]),
        width=np.array([16, 16]), height=np.array([3, 3]),
    )  # fmt: skip
    dst, src, size = split_rows(f)
    assert dst.tolist() == [1000, 5000, 5064, 5128]
    assert src.tolist() == [0, 200, 216, 232]
    assert size.tolist() == [48, 16, 16, 16]


@pytest.mark.parametrize(("layout", "expected_per_run"), [("layer_first", 1), ("page_first", 1), ("page_head", 2)])
def test_whole_pages_give_one_fragment_per_run_layer_and_kv(layout, expected_per_run):
    pools = make_pools(layout=layout, mla=False, dtype=torch.float16, page_size=8, host_pages=4, num_layers=3)
    d_idx, h_idx = make_indices("pages", 96, 32, 8, count=16, seed=4)  # 2 pages of 8 slots
    plan = ops.build_plan("d2h", pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout=layout, page_size=8)
    f = plan_fragments(plan)
    pages = 2
    assert len(f) == pages * 3 * 2 * expected_per_run  # runs x layers x kv x chunks
    assert f.total_bytes == plan.bytes_moved
    assert (f.height == 8).all()


def test_layer_first_pages_are_plain_memcpys():
    pools = make_pools(layout="layer_first", mla=True, dtype=torch.float16, page_size=8, host_pages=4)
    d_idx, h_idx = make_indices("pages", 96, 32, 8, count=8, seed=5)
    plan = ops.build_plan("h2d", pools.device_k, None, pools.host, d_idx, h_idx, layout="layer_first", page_size=8)
    dst, src, size = split_rows(plan_fragments(plan))
    assert size.tolist() == [8 * plan.item_bytes] * 3  # one 1-D piece per layer


def test_fragments_cover_exactly_the_bytes_moved():
    pools = make_pools(layout="page_first_direct", mla=False, dtype=torch.float32, page_size=16, host_pages=3)
    d_idx, h_idx = make_indices("random", 96, 48, 16, count=20, seed=6)
    plan = ops.build_plan("d2h", pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="page_first_direct",
                          page_size=16, layer_id=0)  # fmt: skip
    f = plan_fragments(plan)
    assert f.total_bytes == plan.bytes_moved == 20 * 2 * plan.item_bytes
    assert int(split_rows(f)[2].sum()) == plan.bytes_moved
