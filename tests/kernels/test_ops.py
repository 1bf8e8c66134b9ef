"""Every CPU-capable io-backend equals the pure-torch reference, byte for byte.

Sources hold random bits, destinations a poison pattern, so a slot written wrongly or written when it
should not be shows. ``kernel`` needs a GPU (tests/kernels/test_ops_gpu.py); ``triton`` runs under the
interpreter on a smaller matrix (it costs ~1 ms per program).
"""

from __future__ import annotations

import pytest
import torch

from hicache_kernels import layouts, ops

from kvdata import expected_after, make_indices, make_pools, same_bytes

LAYOUT_KINDS = [(layout, False) for layout in layouts.LAYOUTS] + [(layout, True) for layout in layouts.MLA_LAYOUTS]
LAYOUT_IDS = [f"{layout}-{'mla' if mla else 'mha'}" for layout, mla in LAYOUT_KINDS]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8]


def run_case(backend, layout, mla, dtype, page_size, direction, layer_id, *, stacked=True, indices="random", **shape):
    pools = make_pools(
        layout=layout, mla=mla, dtype=dtype, page_size=page_size, direction=direction, stacked=stacked, **shape
    )
    n_dev = pools.layers(pools.device_k)[0].shape[0]
    n_host = layouts_host_slots(pools, mla)
    d_idx, h_idx = make_indices(indices, n_dev, n_host, page_size, count=20, seed=page_size)
    expected = expected_after(pools, direction, d_idx, h_idx, layer_id)
    ops.transfer(
        direction, pools.device_k, pools.device_v, pools.host, d_idx, h_idx,
        layout=layout, page_size=page_size, layer_id=layer_id, backend=backend,
    )  # fmt: skip
    assert pools.equal(expected)
    return pools


def layouts_host_slots(pools, mla: bool) -> int:
    kv = pools.layers(pools.device_k)
    L, (_, H, D) = len(kv), kv[0].shape
    return pools.host.numel() // ((1 if mla else 2) * L * H * D)


@pytest.mark.parametrize("backend", ["direct", "batch"])
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("layer_id", [None, 1], ids=["all", "layer1"])
def test_copy_engine_backends_match_reference(backend, layout, mla, dtype, page_size, direction, layer_id):
    stacked = (page_size + len(layout)) % 2 == 0  # alternate stacked / list pools across the matrix
    run_case(backend, layout, mla, dtype, page_size, direction, layer_id, stacked=stacked)


@pytest.mark.parametrize("backend", ["direct", "batch"])
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("indices", ["random", "pages", "crossing"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_runs_and_pool_forms(backend, layout, mla, indices, stacked, direction):
    run_case(backend, layout, mla, torch.bfloat16, 16, direction, None, stacked=stacked, indices=indices)


@pytest.mark.parametrize("backend", ["direct", "batch", "triton", "auto"])
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_runs_crossing_host_pages(backend, layout, mla, page_size, direction):
    """Runs consecutive on both sides that cross a host page boundary: every backend splits them there
    (in page_first_direct and page_head the next page is elsewhere in memory)."""
    run_case(backend, layout, mla, torch.float16, page_size, direction, None, indices="crossing", num_layers=2,
             device_slots=32, host_pages=4)  # fmt: skip


def test_crossing_indices_cross_host_pages():
    """The ``crossing`` index kind does what the tests above rely on: every run crosses one boundary."""
    for page_size in (4, 16, 64):
        d, h = make_indices("crossing", 256, 4 * page_size, page_size, count=40, seed=page_size)
        assert len(set(d.tolist())) == d.numel() and len(set(h.tolist())) == h.numel()
        inside = (d[1:] == d[:-1] + 1) & (h[1:] == h[:-1] + 1)  # pairs continuing a run on both sides
        crossings = int((inside & (h[1:] % page_size == 0)).sum())
        assert crossings == d.numel() // page_size >= 2


# (head_num, head_dim, dtype): item sizes of 2, 6, 15, 656 and 1030 bytes.
ODD_ITEMS = [(1, 1, torch.float16), (1, 3, torch.float16), (3, 5, torch.uint8), (2, 164, torch.float16),
             (5, 103, torch.float16)]  # fmt: skip


@pytest.mark.parametrize("backend", ["direct", "batch"])
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("head_num", "head_dim", "dtype"), ODD_ITEMS, ids=lambda x: str(x))
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_odd_item_sizes(backend, layout, mla, head_num, head_dim, dtype, direction):
    run_case(backend, layout, mla, dtype, 4, direction, None, head_num=head_num, head_dim=head_dim)


@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize(("layer_id", "page_size", "dtype"), [(None, 1, torch.float16), (2, 16, torch.float8_e4m3fn)])
def test_triton_matches_reference(layout, mla, direction, layer_id, page_size, dtype):
    run_case("triton", layout, mla, dtype, page_size, direction, layer_id, num_layers=3, device_slots=40, host_pages=2)


def test_triton_odd_item(layout="page_head"):
    run_case("triton", layout, False, torch.float16, 4, "d2h", None, head_num=3, head_dim=3, device_slots=24)


@pytest.mark.parametrize("backend", ["direct", "batch", "triton", "auto"])
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
def test_round_trip(backend, layout, mla):
    """backup_all_layers then load_all_layers into a poisoned pool reproduces the original bytes."""
    pools = make_pools(layout=layout, mla=mla, dtype=torch.bfloat16, page_size=4, device_slots=24, host_pages=3)
    original = pools.clone()
    d_idx, h_idx = make_indices("random", 24, 12, 4, count=10, seed=3)
    kw = dict(layout=layout, page_size=4, backend=backend)
    ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, **kw)
    for t in pools.layers(pools.device_k) + ([] if mla else pools.layers(pools.device_v)):
        t.view(torch.uint8).fill_(0x5A)
    ops.load_all_layers(pools.device_k, pools.device_v, pools.host, d_idx, h_idx, **kw)
    for got, want in zip(pools.layers(pools.device_k), original.layers(original.device_k), strict=True):
        assert same_bytes(got[d_idx], want[d_idx])
        untouched = torch.ones(24, dtype=torch.bool)
        untouched[d_idx] = False
        assert (got[untouched].view(torch.uint8) == 0x5A).all()


@pytest.mark.parametrize("backend", ["direct", "batch", "triton"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_fast_mode_skips_out_of_range_pairs(backend, direction):
    """check_indices=False: no sync and no check, yet nothing outside the pools is touched and the
    in-range pairs are still copied."""
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=1, direction=direction,
                       device_slots=16, host_pages=1)  # fmt: skip
    d_idx = torch.tensor([1, 2, 3, 16, -1, 5])
    h_idx = torch.tensor([0, 48, 7, 8, 9, -3])
    good = torch.tensor([True, False, True, False, False, False])
    expected = expected_after(pools, direction, d_idx[good], h_idx[good], None)
    ops.transfer(direction, pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="page_first",
                 page_size=1, backend=backend, check_indices=False)  # fmt: skip
    assert pools.equal(expected)


@pytest.mark.parametrize("backend", ["direct", "batch", "triton", "auto"])
def test_empty_index_set_is_a_no_op(backend):
    pools = make_pools(layout="page_head", mla=False, dtype=torch.float16, page_size=4)
    before = pools.clone()
    empty = torch.empty(0, dtype=torch.int64)
    ops.backup_all_layers(pools.device_k, pools.device_v, pools.host, empty, empty, layout="page_head", page_size=4,
                          backend=backend)  # fmt: skip
    assert pools.equal(before)


def test_indices_on_host_and_views_of_one_pool():
    """Per-layer views of one stacked pool passed as a list behave like the stacked tensor."""
    pools = make_pools(layout="layer_first", mla=False, dtype=torch.float32, page_size=1)
    d_idx, h_idx = make_indices("random", 96, 48, 1, count=12, seed=9)
    expected = expected_after(pools, "d2h", d_idx, h_idx, None)
    ops.backup_all_layers(list(pools.device_k.unbind(0)), list(pools.device_v.unbind(0)), pools.host, d_idx, h_idx,
                          layout="layer_first", page_size=1, backend="direct")  # fmt: skip
    assert pools.equal(expected)
