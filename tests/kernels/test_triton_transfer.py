"""Triton backend (hicache_kernels.backends.triton) against the pure-torch reference.

CPU tests run the kernel under Triton's interpreter (conftest sets TRITON_INTERPRET=1), so pools and
grids are small. Data is random bytes (never zeros) and every destination starts as a poison pattern,
so a slot written by mistake or left unwritten shows; comparisons are bit-exact on uint8 views.
Tests marked ``gpu`` run the same kernel compiled on a CUDA device with a pinned host pool.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import itertools
import math
import os
import sys
import weakref
from dataclasses import dataclass

import pytest
import torch

from hicache_kernels import BackendUnavailableError, launch, layouts, ops
from hicache_kernels.backends import triton as tt
from hicache_kernels.reference import reference_transfer

POISON = 0xA5
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8)


@dataclass(frozen=True)
class Case:
    layout: str
    mla: bool
    dtype: torch.dtype
    page_size: int
    head_num: int
    head_dim: int
    layer_id: int | None  # None: all layers
    direction: str
    num_layers: int = 3
    dev_slots: int = 40
    host_slots: int = 48  # a multiple of 16, so every page size here fits
    n: int = 11

    def __str__(self) -> str:
        kind = "mla" if self.mla else "mha"
        layers = "all" if self.layer_id is None else f"l{self.layer_id}"
        dt = str(self.dtype).removeprefix("torch.")
        return f"{self.layout}-{kind}-{dt}-p{self.page_size}-h{self.head_num}d{self.head_dim}-{layers}-{self.direction}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _filled(shape: tuple[int, ...], dtype: torch.dtype, *, random: bool, device: str = "cpu") -> torch.Tensor:
    """Random bytes (or the poison byte) viewed as ``dtype``: every bit pattern, NaNs included."""
    raw_shape = (*shape[:-1], shape[-1] * dtype.itemsize)
    if random:
        raw = torch.randint(0, 256, raw_shape, dtype=torch.uint8)
    else:
        raw = torch.full(raw_shape, POISON, dtype=torch.uint8)
    raw = raw.to(device)
    return raw if dtype == torch.uint8 else raw.view(dtype)


@dataclass
class Pools:
    k: list[torch.Tensor]
    v: list[torch.Tensor] | None
    host: torch.Tensor

    def all(self) -> list[torch.Tensor]:
        return [*self.k, *(self.v or []), self.host]

    def clone(self) -> Pools:
        return Pools(
            [t.clone() for t in self.k], None if self.v is None else [t.clone() for t in self.v], self.host.clone()
        )


def _pools(case: Case, device: str = "cpu") -> Pools:
    """The source side random, the destination side poisoned."""
    d2h = case.direction == "d2h"
    heads = 1 if case.mla else case.head_num
    dev_shape = (case.dev_slots, heads, case.head_dim)
    k = [_filled(dev_shape, case.dtype, random=d2h, device=device) for _ in range(case.num_layers)]
    v = (
        None
        if case.mla
        else [_filled(dev_shape, case.dtype, random=d2h, device=device) for _ in range(case.num_layers)]
    )
    shape = layouts.host_shape(
        case.layout,
        mla=case.mla,
        num_layers=case.num_layers,
        num_slots=case.host_slots,
        page_size=case.page_size,
        head_num=heads,
        head_dim=case.head_dim,
    )
    host = _filled(shape, case.dtype, random=not d2h)
    if device != "cpu":
        host = host.pin_memory()
    return Pools(k, v, host)


def _indices(case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct device and host slots (a repeated destination would be a race)."""
    g = torch.Generator().manual_seed(seed)
    dev = torch.randperm(case.dev_slots, generator=g)[: case.n]
    host = torch.randperm(case.host_slots, generator=g)[: case.n]
    return dev, host


def _expected(case: Case, pools: Pools, dev_idx: torch.Tensor, host_idx: torch.Tensor) -> Pools:
    want = pools.clone()
    layers = range(case.num_layers) if case.layer_id is None else [case.layer_id]
    reference_transfer(
        direction=case.direction,
        device_k=want.k,
        device_v=want.v,
        host=want.host,
        device_indices=dev_idx,
        host_indices=host_idx,
        layout=case.layout,
        page_size=case.page_size,
        layers=layers,
    )
    return want


def _plan(case: Case, pools: Pools, dev_idx: torch.Tensor, host_idx: torch.Tensor, **kw):
    return ops.build_plan(
        case.direction,
        pools.k,
        pools.v,
        pools.host,
        dev_idx,
        host_idx,
        layout=case.layout,
        page_size=case.page_size,
        layer_id=case.layer_id,
        **kw,
    )


def _assert_pools_equal(got: Pools, want: Pools) -> None:
    names = [f"k[{i}]" for i in range(len(got.k))] + [f"v[{i}]" for i in range(len(got.v or []))] + ["host"]
    for name, a, b in zip(names, got.all(), want.all(), strict=True):
        a, b = _bits(a).cpu(), _bits(b).cpu()
        if not torch.equal(a, b):
            bad = (a != b).nonzero()
            raise AssertionError(f"{name}: {bad.shape[0]} of {a.numel()} bytes differ, first at {bad[0].tolist()}")


def _check(case: Case, seed: int = 0) -> None:
    torch.manual_seed(seed)
    pools = _pools(case)
    dev_idx, host_idx = _indices(case, seed)
    want = _expected(case, pools, dev_idx, host_idx)
    tt.run_triton(_plan(case, pools, dev_idx, host_idx))
    _assert_pools_equal(pools, want)


def _matrix() -> list[Case]:
    """Every layout x MHA/MLA x page size {1, 16} x direction x one/all layers; the dtype rotates so each
    (layout, kind) meets several dtypes without running the full product."""
    cases = []
    combos = [(lay, mla) for lay in layouts.LAYOUTS for mla in (False, True) if not mla or lay in layouts.MLA_LAYOUTS]
    for i, ((layout, mla), page, direction, layer_id) in enumerate(
        itertools.product(combos, (1, 16), ("d2h", "h2d"), (None, 1))
    ):
        dtype = DTYPES[i % len(DTYPES)]
        heads, dim = (1, 16) if mla else (2, 8)
        cases.append(Case(layout, mla, dtype, page, heads, dim, layer_id, direction))
    return cases


def _odd_items() -> list[Case]:
    """Items whose size forces a narrow copy unit, and model-sized odd items (656-byte fp8 MLA)."""
    cases = []
    for layout, direction in itertools.product(layouts.LAYOUTS, ("d2h", "h2d")):
        # head_dim 3 fp16: 6-byte heads, 18-byte items -> int16 copies; page_head splits them in 3 chunks
        cases.append(Case(layout, False, torch.float16, 16, 3, 3, None, direction))
    for layout, direction in itertools.product(("layer_first", "page_head"), ("d2h", "h2d")):
        cases.append(Case(layout, False, torch.uint8, 16, 3, 5, 2, direction))  # 5-byte heads: uint8 copies
    for layout, direction in itertools.product(layouts.MLA_LAYOUTS, ("d2h", "h2d")):
        dtype = torch.float8_e4m3fn if direction == "d2h" else torch.uint8
        cases.append(Case(layout, True, dtype, 16, 1, 656, None, direction))  # 656-byte latent items
    return cases


@pytest.mark.parametrize("case", _matrix(), ids=str)
def test_matches_reference(case: Case) -> None:
    _check(case)


@pytest.mark.parametrize("case", _odd_items(), ids=str)
def test_odd_item_sizes(case: Case) -> None:
    _check(case, seed=1)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_multiple_row_blocks_and_block_loop(monkeypatch: pytest.MonkeyPatch, layout: str, direction: str) -> None:
    """Tiny tile and block caps: several row programs, and a block loop that crosses chunk boundaries."""
    monkeypatch.setattr(tt, "MAX_BLOCK", 4)
    monkeypatch.setattr(tt, "TILE_BYTES", 16)
    case = Case(layout, False, torch.float16, 16, 3, 3, None, direction, num_layers=2, n=7)
    assert tt.launch_shape(9, 2)[:2] == (2, 4)  # 9-element items: 3 iterations, 2 rows per program
    _check(case, seed=2)


@pytest.mark.parametrize("max_programs", [1, 3, 7, 64])
@pytest.mark.parametrize("layout", ["page_first", "page_head"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_a_capped_grid_moves_everything(monkeypatch, max_programs, layout, direction) -> None:
    """A persistent grid: fewer programs than work items (row blocks x (kv, layer) units), each looping
    over its share; the launch runs exactly min(work, max_programs) programs."""
    monkeypatch.setattr(tt, "TILE_BYTES", 16)  # 2 rows per program: 6 row blocks of 11 indices
    case = Case(layout, False, torch.float16, 16, 2, 4, None, direction, num_layers=3, n=11)
    grids = []
    kernel = tt._kernel

    def recording(interpret: bool):
        jitted = kernel(interpret)

        class Launch:
            def __getitem__(self, grid):
                grids.append(grid)
                return jitted[grid]

        return Launch()

    monkeypatch.setattr(tt, "_kernel", recording)
    torch.manual_seed(4)
    pools = _pools(case)
    dev_idx, host_idx = _indices(case, 4)
    want = _expected(case, pools, dev_idx, host_idx)
    tt.run_triton(_plan(case, pools, dev_idx, host_idx), max_programs)
    _assert_pools_equal(pools, want)
    rows = tt.launch_shape(2 * 4, 2)[0]
    work = -(-case.n // rows) * 2 * case.num_layers
    assert work > 7 and grids == [(min(work, max_programs),)]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, 2**31, "8"])
def test_max_programs_checked(bad) -> None:
    with pytest.raises(ValueError, match="max_programs: expected an int"):
        tt.TritonBackend(max_programs=bad)
    case = Case("page_first", False, torch.float16, 16, 2, 4, None, "h2d", num_layers=2, n=5)
    pools = _pools(case)
    dev_idx, host_idx = _indices(case, 5)
    before = pools.clone()
    with pytest.raises(ValueError, match="max_programs: expected an int"):
        tt.run_triton(_plan(case, pools, dev_idx, host_idx), bad)
    _assert_pools_equal(pools, before)  # nothing written


def test_the_backend_passes_its_cap(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(tt, "run_triton", lambda plan, max_programs=None: seen.append(max_programs))
    backend = tt.TritonBackend(max_programs=5)
    backend._run(object())
    assert seen == [5] and tt.TritonBackend().max_programs == tt.DEFAULT_MAX_PROGRAMS


def test_item_longer_than_max_block() -> None:
    # 4097 uint8 bytes: width 1, so the block loop runs twice; 2 rows per program, 3 row programs
    case = Case("page_first", True, torch.uint8, 1, 1, 4097, None, "d2h", num_layers=2, dev_slots=8, host_slots=16, n=5)
    assert tt.launch_shape(4097, 1)[:2] == (2, tt.MAX_BLOCK)
    _check(case, seed=3)


def test_stacked_device_pool() -> None:
    case = Case("page_first_direct", False, torch.bfloat16, 16, 2, 8, None, "h2d")
    torch.manual_seed(4)
    pools = _pools(case)
    k, v = torch.stack(pools.k), torch.stack(pools.v)
    pools = Pools(list(k.unbind(0)), list(v.unbind(0)), pools.host)  # views into the stacked tensors
    dev_idx, host_idx = _indices(case, 4)
    want = _expected(case, pools, dev_idx, host_idx)
    plan = ops.build_plan(
        "h2d", k, v, pools.host, dev_idx, host_idx, layout=case.layout, page_size=case.page_size, layer_id=None
    )
    tt.run_triton(plan)
    _assert_pools_equal(pools, want)


# -- element width ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "width"),
    [([], 8), ([0], 8), ([16, 0, 8], 8), ([656], 8), ([12, 8], 4), ([6], 2), ([4096, 18], 2), ([5], 1), ([8, 3], 1)],
)
def test_pick_width(values: list[int], width: int) -> None:
    assert tt.pick_width(math.gcd(*values)) == width


@pytest.mark.parametrize(
    ("layout", "mla", "dtype", "heads", "dim", "width"),
    [
        ("page_first", False, torch.bfloat16, 2, 8, 8),  # 32-byte items
        ("page_first", False, torch.float16, 2, 3, 4),  # 12-byte items
        ("page_head", False, torch.float16, 3, 3, 2),  # 6-byte chunks
        ("layer_first", False, torch.uint8, 1, 5, 1),  # 5-byte items
        ("page_first_direct", False, torch.float32, 1, 3, 4),  # 12-byte items
        ("page_first", True, torch.float8_e4m3fn, 1, 656, 8),  # 656 = 8 * 82
        ("layer_first", True, torch.uint8, 1, 658, 2),  # 658 = 2 * 329
    ],
)
def test_element_width_of_plans(layout: str, mla: bool, dtype: torch.dtype, heads: int, dim: int, width: int) -> None:
    case = Case(layout, mla, dtype, 16, heads, dim, None, "d2h")
    pools = _pools(case)
    dev_idx, host_idx = _indices(case, 0)
    assert tt.element_width(_plan(case, pools, dev_idx, host_idx)) == width


def test_misaligned_table_entry_narrows_width_and_still_copies() -> None:
    """A layer at an odd address forces byte copies; the transfer stays exact."""
    case = Case("page_first", False, torch.uint8, 1, 2, 8, None, "d2h", num_layers=2)
    torch.manual_seed(5)
    pools = _pools(case)
    n_bytes = case.dev_slots * case.head_num * case.head_dim
    buf = torch.randint(0, 256, (n_bytes + 1,), dtype=torch.uint8)
    pools.k[1] = buf[1:].view(case.dev_slots, case.head_num, case.head_dim)  # data_ptr is odd
    dev_idx, host_idx = _indices(case, 5)
    want = _expected(case, pools, dev_idx, host_idx)
    plan = _plan(case, pools, dev_idx, host_idx)
    assert tt.element_width(plan) == 1
    tt.run_triton(plan)
    _assert_pools_equal(pools, want)


# -- guards -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_out_of_range_pairs_write_nothing_when_unchecked(layout: str, direction: str) -> None:
    case = Case(layout, False, torch.float16, 16, 2, 8, None, direction, n=10)
    torch.manual_seed(6)
    pools = _pools(case)
    dev_idx, host_idx = _indices(case, 6)
    big = 2**40
    dev_idx[[1, 4, 7]] = torch.tensor([-1, case.dev_slots, big])
    host_idx[[2, 5, 8]] = torch.tensor([case.host_slots, -big, -(case.page_size + 1)])
    valid = (dev_idx >= 0) & (dev_idx < case.dev_slots) & (host_idx >= 0) & (host_idx < case.host_slots)
    assert int(valid.sum()) == 4
    want = _expected(case, pools, dev_idx[valid], host_idx[valid])
    plan = _plan(case, pools, dev_idx, host_idx, check_indices=False)
    tt.run_triton(plan)
    _assert_pools_equal(pools, want)


def test_empty_transfer_launches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case("page_head", False, torch.float16, 16, 2, 8, None, "h2d", n=0)
    pools = _pools(case)
    before = pools.clone()
    empty = torch.empty(0, dtype=torch.int64)
    plan = _plan(case, pools, empty, empty)

    def no_launch(interpret: bool):
        raise AssertionError("an empty transfer must not launch a kernel")

    monkeypatch.setattr(tt, "_kernel", no_launch)
    tt.run_triton(plan)
    _assert_pools_equal(pools, before)


def _small_plan():
    case = Case("layer_first", True, torch.float16, 1, 1, 8, None, "d2h", num_layers=1, n=2)
    pools = _pools(case)
    dev_idx, host_idx = _indices(case, 0)
    return _plan(case, pools, dev_idx, host_idx)


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _small_plan()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        tt.run_triton(plan)


def test_missing_triton_raises_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _small_plan()
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    with pytest.raises(BackendUnavailableError, match="triton"):
        tt.run_triton(plan)


def test_mismatched_index_lengths_raise() -> None:
    plan = _small_plan()
    bad = dataclasses.replace(plan, dst_indices=plan.dst_indices[:1])
    with pytest.raises(ValueError, match="dst_indices"):
        tt.run_triton(bad)


# -- device tables: each lives exactly as long as the memory of the pool it describes -------------------
# The lifetime logic is device-independent: CPU tensors stand in for CUDA pools and the builder makes CPU
# tables, so these run without a GPU; test_gpu_captured_table_outlives_many_other_pools runs it for real.

CPU = torch.device("cpu")


def _tables() -> tuple[launch.DeviceTables, list[tuple[int, ...]]]:
    """A fresh cache with a recording CPU builder: ``built`` lists every table it had to make."""
    built: list[tuple[int, ...]] = []

    def build(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
        built.append(addresses)
        return torch.tensor(addresses, dtype=torch.int64, device=device)

    return launch.DeviceTables(build), built


def _layer_pool(layers: int = 2) -> list[torch.Tensor]:
    """A per-layer pool: one tensor (one storage) per (kv, layer)."""
    return [torch.empty(4, dtype=torch.int64) for _ in range(layers)]


def _addresses(pool: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in pool)


def test_device_tables_keep_every_live_pool() -> None:
    """More live pools than the old cache's 256 entries: every table stays and is built once."""
    cache, built = _tables()
    pools = [_layer_pool() for _ in range(300)]
    first = [cache.get(_addresses(p), CPU, p) for p in pools]
    again = [cache.get(_addresses(p), CPU, p) for p in pools]
    assert len(cache) == 300 and len(built) == 300
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert all(t.tolist() == list(_addresses(p)) for t, p in zip(again, pools, strict=True))


def test_device_table_released_with_its_pool() -> None:
    cache, built = _tables()
    pool = _layer_pool()
    table = weakref.ref(cache.get(_addresses(pool), CPU, pool))
    gc.collect()
    assert len(cache) == 1 and table() is not None
    pool.pop()  # one layer's memory gone: the entry stays while any of the pool's memory lives
    gc.collect()
    assert len(cache) == 1 and table() is not None
    del pool
    gc.collect()
    assert len(cache) == 0 and table() is None


def test_device_table_of_stacked_pool_outlives_its_views() -> None:
    """A stacked pool reaches the cache as fresh per-layer views each call: its storage is what counts."""
    cache, built = _tables()
    stacked = torch.empty(4, 3, 2)  # [kv * L, N, item]

    def get(pool: torch.Tensor) -> torch.Tensor:
        views = list(pool.unbind(0))
        return cache.get(_addresses(views), CPU, views)

    first = weakref.ref(get(stacked))
    gc.collect()  # the views are gone
    assert len(cache) == 1 and first() is get(stacked) and len(built) == 1
    del stacked
    gc.collect()
    assert len(cache) == 0 and first() is None


def test_device_table_for_recycled_addresses() -> None:
    """Pools made again over the same bytes have the same addresses and a new storage each time (what a
    new pool at a dead one's addresses looks like). The table is right for whoever asks, and a dead
    pool's release never takes the table of a live one at the same addresses."""
    cache, built = _tables()
    buf = bytearray(64)

    def pool_on_buf() -> list[torch.Tensor]:
        whole = torch.frombuffer(buf, dtype=torch.int64)
        return [whole[:4], whole[4:]]

    old = pool_on_buf()
    addrs = _addresses(old)
    cache.get(addrs, CPU, old)
    del old
    gc.collect()
    assert len(cache) == 0  # released with the old pool, not kept for its addresses
    new = pool_on_buf()
    assert _addresses(new) == addrs
    table = cache.get(addrs, CPU, new)
    assert table.tolist() == list(addrs) and len(built) == 2

    # Two live storages at the same addresses share the entry; the first one's death keeps it.
    other = pool_on_buf()
    assert cache.get(addrs, CPU, other) is table and len(built) == 2
    del new
    gc.collect()
    assert len(cache) == 1 and cache.get(addrs, CPU, other) is table and len(built) == 2
    del other
    gc.collect()
    assert len(cache) == 0


def test_device_table_is_not_built_under_capture() -> None:
    """Under CUDA-graph capture the blocking upload cannot run: a missing table is an error naming the
    fix, a cached one is returned."""
    cache, built = _tables()
    pool = _layer_pool()
    with pytest.raises(RuntimeError, match="before capturing"):
        cache.get(_addresses(pool), CPU, pool, capturing=True)
    assert len(cache) == 0 and built == []
    table = cache.get(_addresses(pool), CPU, pool)
    assert cache.get(_addresses(pool), CPU, pool, capturing=True) is table


def test_gpu_side_ties_the_table_to_the_plans_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch hands the table cache the plan's tensors: the table of a stacked device pool lives as
    long as that pool (not the per-call plan), and is made once for every route over it."""
    cache, built = _tables()
    monkeypatch.setattr(launch, "device_tables", cache)
    case = Case("page_first", False, torch.float16, 1, 2, 8, None, "h2d", num_layers=2, n=3)
    pools = _pools(case)
    k, v = torch.stack(pools.k), torch.stack(pools.v)
    dev_idx, host_idx = _indices(case, 0)

    def table(k: torch.Tensor, v: torch.Tensor, layer_id: int | None = None) -> torch.Tensor:
        plan = ops.build_plan("h2d", k, v, pools.host, dev_idx, host_idx, layout=case.layout, page_size=1,
                              layer_id=layer_id)  # fmt: skip
        return launch.gpu_route(plan, capturing=False).dst.table

    first = table(k, v)
    gc.collect()
    assert table(k, v) is first and table(k, v, layer_id=1) is first and len(cache) == 1 and len(built) == 1
    assert first.tolist() == [t.data_ptr() for t in [*k.unbind(0), *v.unbind(0)]]
    first = None
    del k
    gc.collect()
    assert len(cache) == 1  # v's storage still lives
    del v
    gc.collect()
    assert len(cache) == 0


# -- GPU (compiled kernel, zero-copy pinned host pool) --------------------------------------------------

needs_compiled = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="compiled Triton on CUDA: needs TRITON_INTERPRET unset (conftest unsets it when a GPU is visible)",
)


@pytest.mark.gpu
@needs_compiled
@pytest.mark.parametrize(
    "case",
    [
        Case(
            "page_first",
            False,
            torch.bfloat16,
            1,
            8,
            128,
            None,
            "d2h",
            num_layers=4,
            dev_slots=256,
            host_slots=512,
            n=100,
        ),
        Case(
            "page_head", False, torch.float16, 16, 8, 128, 2, "h2d", num_layers=4, dev_slots=256, host_slots=512, n=100
        ),
        Case(
            "page_first_direct", True, torch.float8_e4m3fn, 16, 1, 656, None, "h2d", dev_slots=256, host_slots=512, n=64
        ),
        Case("layer_first", False, torch.float16, 16, 3, 3, None, "d2h", dev_slots=256, host_slots=512, n=64),
    ],
    ids=str,
)
def test_gpu_zero_copy_matches_reference(case: Case) -> None:
    torch.manual_seed(7)
    pools = _pools(case, device="cuda")
    dev_idx, host_idx = _indices(case, 7)
    cpu = Pools([t.cpu() for t in pools.k], None if pools.v is None else [t.cpu() for t in pools.v], pools.host.clone())
    want = _expected(case, cpu, dev_idx, host_idx)
    stream = torch.cuda.Stream()
    plan = _plan(case, pools, dev_idx.cuda(), host_idx.cuda(), check_indices=False, stream=stream)
    tt.run_triton(plan)
    stream.synchronize()
    _assert_pools_equal(pools, want)


@pytest.mark.gpu
@needs_compiled
def test_gpu_rejects_pageable_host() -> None:
    case = Case("page_first", False, torch.float16, 1, 2, 8, None, "d2h")
    pools = _pools(case, device="cuda")
    pools.host = pools.host.clone()  # clone of a pinned tensor is pageable
    assert not pools.host.is_pinned()
    dev_idx, host_idx = _indices(case, 0)
    with pytest.raises(ValueError, match="host"):
        tt.run_triton(_plan(case, pools, dev_idx.cuda(), host_idx.cuda()))


@pytest.mark.gpu
@needs_compiled
def test_gpu_graph_capture_replays_the_transfer() -> None:
    case = Case("page_first", False, torch.bfloat16, 1, 2, 64, 1, "h2d", dev_slots=64, host_slots=64, n=16)
    torch.manual_seed(8)
    pools = _pools(case, device="cuda")
    dev_idx, host_idx = (t.cuda() for t in _indices(case, 8))
    plan = _plan(case, pools, dev_idx, host_idx, check_indices=False)
    tt.run_triton(plan)  # warm-up: compiles the kernel and caches the device table
    torch.cuda.synchronize()
    for t in pools.k + pools.v:
        _bits(t).fill_(POISON)
    cpu = Pools([t.cpu() for t in pools.k], [t.cpu() for t in pools.v], pools.host.clone())
    want = _expected(case, cpu, dev_idx.cpu(), host_idx.cpu())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tt.run_triton(plan)
    graph.replay()
    torch.cuda.synchronize()
    _assert_pools_equal(pools, want)


@pytest.mark.gpu
@pytest.mark.gpu_smoke
@needs_compiled
def test_gpu_captured_table_outlives_many_other_pools() -> None:
    """A load captured in a CUDA graph reads its pool's device table on every replay, however many
    other pools come by: the old cache (an LRU of 256 tables) freed it, the next table of the same size
    took its memory, and the replay wrote into another pool."""
    case = Case("page_first", False, torch.bfloat16, 1, 2, 64, 1, "h2d", dev_slots=64, host_slots=64, n=16)
    torch.manual_seed(9)
    pools = _pools(case, device="cuda")
    dev_idx, host_idx = (t.cuda() for t in _indices(case, 9))
    plan = _plan(case, pools, dev_idx, host_idx, check_indices=False)
    tt.run_triton(plan)  # warm-up: compiles the kernel and makes the pool's device table
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tt.run_triton(plan)
    torch.cuda.synchronize()
    gc.collect()
    tables = len(launch.device_tables)

    others = _loaded_other_pools(case, pools.host, dev_idx, host_idx, count=400)
    torch.cuda.synchronize()
    assert len(launch.device_tables) == tables + len(others)
    loaded = [t.clone() for o in others for t in o.k + o.v]

    for t in pools.k + pools.v:
        _bits(t).fill_(POISON)
    cpu = Pools([t.cpu() for t in pools.k], [t.cpu() for t in pools.v], pools.host.clone())
    want = _expected(case, cpu, dev_idx.cpu(), host_idx.cpu())
    graph.replay()
    torch.cuda.synchronize()
    _assert_pools_equal(pools, want)
    layers = [t for o in others for t in o.k + o.v]
    written = [i for i, (a, b) in enumerate(zip(layers, loaded, strict=True)) if not torch.equal(_bits(a), _bits(b))]
    assert not written, f"the replay wrote into other pools' layers {written}"

    # One of the other pools' storages, to name what still holds it if its table stays (under
    # compute-sanitizer on the H200, 2026-12-04, all 400 tables stayed; without it they went).
    probe = weakref.ref(others[0].k[0].untyped_storage())
    del others, layers, loaded
    gc.collect()
    alive = probe()
    holders = [] if alive is None else sorted({type(r).__name__ for r in gc.get_referrers(alive)})
    del alive
    assert len(launch.device_tables) == tables, (
        f"{len(launch.device_tables) - tables} tables outlived their pools; a dead pool's storage "
        f"{'was freed' if not holders else 'is still referenced by ' + ', '.join(holders)}"
    )  # their tables went with them


def _loaded_other_pools(
    case: Case, host: torch.Tensor, dev_idx: torch.Tensor, host_idx: torch.Tensor, count: int
) -> list[Pools]:
    """``count`` per-layer device pools shaped like ``case``'s (so their tables are the same size),
    poisoned, each loaded once from ``host`` with the same indices."""
    shape = (case.dev_slots, case.head_num, case.head_dim)
    out = []
    for _ in range(count):
        k = [_filled(shape, case.dtype, random=False, device="cuda") for _ in range(case.num_layers)]
        v = [_filled(shape, case.dtype, random=False, device="cuda") for _ in range(case.num_layers)]
        other = Pools(k, v, host)
        tt.run_triton(_plan(case, other, dev_idx, host_idx, check_indices=False))
        out.append(other)
    return out


def test_interpreted_launches_from_two_threads_at_once():
    """Triton's interpreter keeps the running grid in process-wide state; a cache controller launches
    from a write and a load thread at once. Launches are serialized under the interpreter: every copy
    lands where it should."""
    import os
    import threading

    import torch

    from hicache.pools import DeviceKVPool, HostKVPool
    from hicache_kernels import ops

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's thread safety: CPU only")
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            g = torch.Generator().manual_seed(seed)
            dev = DeviceKVPool(num_slots=64, num_layers=3, head_num=2, head_dim=8, dtype=torch.float32, device="cpu",
                               page_size=4)  # fmt: skip
            dev.k.copy_(torch.randn(dev.k.shape, generator=g))
            dev.v.copy_(torch.randn(dev.v.shape, generator=g))
            host = HostKVPool(dev, layout="page_first_direct", ratio=2.0, safety_margin_gb=0.0)
            for _ in range(30):
                pages = torch.randperm(16, generator=g)[:12]
                d = (pages[:, None] * 4 + torch.arange(4)).flatten()
                h = (torch.randperm(32, generator=g)[:12][:, None] * 4 + torch.arange(4)).flatten()
                host.buffer.fill_(float("nan"))
                ops.backup_all_layers(dev.k, dev.v, host.buffer, d, h, layout="page_first_direct", page_size=4,
                                      backend="triton")  # fmt: skip
                back = torch.full_like(dev.k, float("nan")), torch.full_like(dev.v, float("nan"))
                ops.load_all_layers(back[0], back[1], host.buffer, d, h, layout="page_first_direct", page_size=4,
                                    backend="triton")  # fmt: skip
                assert torch.equal(back[0][:, d], dev.k[:, d]) and torch.equal(back[1][:, d], dev.v[:, d])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


def _compile_keys():
    """The specialization key Triton computes for a launch of the transfer kernel on an sm_90 GPU (its
    binder needs no GPU); None, saying why, where this Triton's binder is not reachable so."""
    try:
        import triton.language as language
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        tt._import_triton()  # binds ``tl`` for the kernel's annotations
        # What _kernel decorates, compiled (not interpreted: the interpreter specializes nothing).
        kernel = JITFunction(tt._transfer_kernel, do_not_specialize=tt.PER_CALL_ARGS)
        binder = create_function_from_signature(
            kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32))
        )
    except Exception as exc:  # noqa: BLE001 - another Triton's internals
        return None, f"this Triton's launch binder is not reachable without a GPU ({type(exc).__name__}: {exc})"
    anchor = torch.zeros(16, dtype=torch.int64)

    def key(n: int, layer_begin: int, layer_count: int) -> str:
        scalars = [64, 64, *([61, 1 << 20, 1 << 14, 1 << 8, 0, 0, 1, 4096] * 2)]
        out = binder(anchor, anchor, anchor, anchor, anchor, 1, 1, n, layer_begin, layer_count, 2 * layer_count,
                     *scalars,
                     SRC_TABLE=False, DST_TABLE=True, MULTI_CHUNK=False, ELEM=language.int64, WIDTH=8, VEC=2,
                     ROWS=4, BLOCK=32, debug=False)  # fmt: skip
        return repr(out[1])  # (bound arguments, specialization, options)

    try:
        key(5, 0, 1)
    except Exception as exc:  # noqa: BLE001 - another Triton's internals
        return None, f"this Triton's launch binder takes other arguments ({type(exc).__name__}: {exc})"
    return key, None


def test_one_route_compiles_once_over_a_61_layer_load_of_any_batch():
    """Every layer of a 61-layer load, for batch sizes 1 to 300, and the all-layer form: Triton computes
    one specialization for them all (``n``, ``layer_begin``, ``layer_count`` and the index strides are
    not specialized), so nothing compiles mid-serving once a route has run."""
    key, why = _compile_keys()
    if key is None:
        pytest.skip(why)
    keys = {key(n, layer, 1) for n in (1, 2, 3, 16, 17, 32, 100, 128, 300) for layer in range(61)}
    keys |= {key(n, 0, 61) for n in (1, 16, 300)}
    assert len(keys) == 1, len(keys)


def test_the_kernel_is_jitted_without_specializing_per_call_arguments(monkeypatch):
    seen = {}

    def jit(fn, **kwargs):
        seen.update(kwargs, fn=fn)
        return fn

    triton = tt._import_triton()
    monkeypatch.setattr(triton, "jit", jit)
    tt._kernel.cache_clear()
    try:
        assert tt._kernel(True) is tt._transfer_kernel
    finally:
        tt._kernel.cache_clear()
    assert seen["do_not_specialize"] == tt.PER_CALL_ARGS
    assert set(tt.PER_CALL_ARGS) == {"n", "layer_begin", "layer_count", "units", "src_idx_stride", "dst_idx_stride"}


def test_the_kernel_compiles_for_sm_90_without_a_gpu():
    """The interpreter runs what the compiler may refuse (the persistent loop's int64 bounds, the nested
    block loop): the kernel compiles to sm_90 PTX here (Triton's own ptxas, no GPU), with both loops."""
    try:
        import triton
        import triton.language as language
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction
    except Exception as exc:  # noqa: BLE001 - another Triton's internals
        pytest.skip(f"this Triton's compiler API is not reachable ({type(exc).__name__}: {exc})")
    tt._import_triton()
    names = list(inspect.signature(tt._transfer_kernel).parameters)
    consts = dict(SRC_TABLE=False, DST_TABLE=True, MULTI_CHUNK=True, ELEM=language.int64, WIDTH=8, VEC=2, ROWS=4,
                  BLOCK=32)  # fmt: skip
    pointers = {"anchor", "src", "dst", "src_idx", "dst_idx"}
    sig = {nm: "*i64" if nm in pointers else "constexpr" if nm in consts else "i64" for nm in names}
    jitted = JITFunction(tt._transfer_kernel, do_not_specialize=tt.PER_CALL_ARGS)  # compiled, not interpreted
    src = ASTSource(jitted, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    try:
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    except TypeError as exc:  # another Triton's ASTSource / compile signature
        pytest.skip(f"this Triton compiles with other arguments ({exc})")
    assert ".target sm_90" in ptx and ptx.count("bra") >= 2
