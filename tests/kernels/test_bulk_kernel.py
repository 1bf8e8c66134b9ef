"""The bulk-copy transfer kernel (``csrc/transfer_bulk.cuh``), all without a GPU.

- Compiled for sm_90, sm_100 and sm_120 with ``-Xptxas -v``: every (source side, destination side)
  instantiation exists with no stack frame and no spills, and its SASS moves data with the bulk-copy
  engine (``UBLKCP.S.G`` global->shared, ``UBLKCP.G.S`` shared->global), orders the ring with
  mbarriers (``SYNCS.*``), commits and drains bulk groups (``UTMACMDFLUSH``, ``DEPBAR.LE``) and has
  no local-memory or register-path data access. Compiled for sm_80 (and that PTX JIT-compiled for
  sm_90, as an "8.0+PTX" build reaches an H100), every kernel traps (``BPT.TRAP``).
- Argument checks of ``transfer_bulk`` name the argument; anything not a multiple of 16 bytes is
  refused (the caller then uses the register kernel).
- The kernel's own schedule and address code, compiled for the host (``bulk_schedule``), applied to
  CPU pools through a model of the shared-memory ring, gives the reference result for every layout,
  MHA and MLA, both directions, chunks that are not a power of two or span several stages (odd run
  lengths), grids that wrap the ring many times, and out-of-range pairs (skipped and counted).
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kernel_quality import demangle

import hicache_kernels
from hicache_kernels import layouts, ops

from cudatools import CUDA_HOME, NVCC, cuobjdump
from kvdata import expected_after, make_indices, make_pools

ROOT = Path(__file__).resolve().parents[2]
SIDES = ("Affine", "Table")
ALL_KERNELS = {(s, d) for s in SIDES for d in SIDES}
KERNEL_RE = re.compile(r"void hicache::transfer_bulk_kernel<hicache::(\w+)Side, hicache::(\w+)Side>")
ARCHS = ("sm_90", "sm_100", "sm_120")

needs_nvcc = pytest.mark.skipif(not NVCC.exists(), reason=f"no nvcc under {CUDA_HOME}")
needs_extension = pytest.mark.skipif(
    not hicache_kernels.build_info()["cuda_built"], reason="the CUDA extension was not built (HICACHE_SKIP_CUDA)"
)


# ------------------------------------------------------------------------------------ compiled code


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(ptxas -v report, SASS) of csrc/transfer_bulk.cu for one arch, with setup.py's device flags."""
    arch = request.param
    out = tmp_path_factory.mktemp("bulk") / f"transfer_bulk_{arch}.cubin"
    cmd = [
        str(NVCC), "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", f"-I{ROOT / 'csrc'}",
        f"-I{CUDA_HOME / 'include'}", f"-arch={arch}", "-cubin", "-Xptxas", "-v",
        str(ROOT / "csrc" / "transfer_bulk.cu"), "-o", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sass = subprocess.run([cuobjdump(), "-sass", str(out)], capture_output=True, text=True, check=True).stdout
    return proc.stdout + proc.stderr, sass


def kernel_key(demangled: str) -> tuple[str, str] | None:
    m = KERNEL_RE.search(demangled)
    return (m.group(1), m.group(2)) if m else None


def sass_opcodes(sass: str) -> dict[tuple[str, str], list[str]]:
    sections = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)
    names = demangle(sections[1::2])
    funcs = {}
    for name, body in zip(sections[1::2], sections[2::2], strict=True):
        key = kernel_key(names[name])
        if key is not None:
            funcs[key] = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", body)
    return funcs


@needs_nvcc
def test_every_instantiation_has_no_local_memory(compiled: tuple[str, str]) -> None:
    found = re.findall(
        r"Function properties for (\S+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
        compiled[0],
    )
    names = demangle([f[0] for f in found])
    props = {kernel_key(names[n]): tuple(int(x) for x in rest) for n, *rest in found}
    props.pop(None, None)
    assert set(props) == ALL_KERNELS
    assert all(v == (0, 0, 0) for v in props.values()), props


@needs_nvcc
def test_sass_moves_data_with_bulk_copies_ordered_by_mbarriers(compiled: tuple[str, str]) -> None:
    funcs = sass_opcodes(compiled[1])
    assert set(funcs) == ALL_KERNELS
    for key, ops_ in funcs.items():
        ops_set = set(ops_)
        assert "UBLKCP.S.G" in ops_set, (key, "no global->shared bulk copy")  # cp.async.bulk.shared::cluster.global
        assert "UBLKCP.G.S" in ops_set, (key, "no shared->global bulk copy")  # cp.async.bulk.global.shared::cta
        assert "UTMACMDFLUSH" in ops_set, (key, "no cp.async.bulk.commit_group")
        assert ops_.count("DEPBAR.LE") >= 2, (key, "no cp.async.bulk.wait_group.read 1 / wait_group 0")
        assert "SYNCS.EXCH.64" in ops_set, (key, "no mbarrier.init")
        assert "SYNCS.PHASECHK.TRANS64.TRYWAIT" in ops_set, (key, "no mbarrier.try_wait.parity")
        assert any(op.startswith("SYNCS.ARRIVE.TRANS64") for op in ops_), (key, "no mbarrier arrive / expect_tx")
        assert not [op for op in ops_ if op.startswith(("LDL", "STL"))], key
        # Data never passes through registers: no global stores at all, and the only global loads are
        # 64-bit index/table reads (no 128-bit vector path).
        assert not [op for op in ops_ if op.startswith("STG")], key
        assert not [op for op in ops_ if op.startswith("LDG") and ".128" in op], key


def older_arch_sass(tmp_path: Path, jit_for_sm90: bool) -> str:
    """SASS of csrc/transfer_bulk.cu built for sm_80: its sm_80 cubin, or (``jit_for_sm90``) its compute_80
    PTX compiled for sm_90 by ptxas, as the driver JIT-compiles the PTX of an "8.0+PTX" build on an H100."""
    base = [str(NVCC), "-O3", "-std=c++17", "--expt-relaxed-constexpr", f"-I{ROOT / 'csrc'}",
            str(ROOT / "csrc" / "transfer_bulk.cu")]  # fmt: skip
    cubin = tmp_path / "bulk.cubin"
    if jit_for_sm90:
        ptx = tmp_path / "bulk80.ptx"
        steps = [[*base, "-arch=compute_80", "-ptx", "-o", str(ptx)],
                 [str(CUDA_HOME / "bin" / "ptxas"), "-arch=sm_90", str(ptx), "-o", str(cubin)]]  # fmt: skip
    else:
        steps = [[*base, "-arch=sm_80", "-cubin", "-o", str(cubin)]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


@needs_nvcc
@pytest.mark.parametrize("jit_for_sm90", [False, True], ids=["sm80-cubin", "compute80-ptx-jit-for-sm90"])
def test_older_archs_trap_instead_of_copying_nothing(tmp_path: Path, jit_for_sm90: bool) -> None:
    """Code compiled for an arch below sm_90 has no bulk-copy body (the launcher refuses those GPUs), but
    an "8.0+PTX" build reaches an H100 as that code, JIT-compiled: each kernel traps there (the launch
    fails) rather than returning at once, as if it had copied everything."""
    funcs = sass_opcodes(older_arch_sass(tmp_path, jit_for_sm90))
    assert set(funcs) == ALL_KERNELS
    for key, ops_ in funcs.items():
        assert "BPT.TRAP" in ops_, (key, ops_)
        assert not [op for op in ops_ if op.startswith(("UBLKCP", "SYNCS", "LDG", "STG"))], (key, ops_)


# ------------------------------------------------------------------------------------ argument checks


@pytest.fixture(scope="module")
def C():
    from hicache_kernels._ext import load_extension

    return load_extension()


def side(base=1 << 20, num_layers=4, page_size=1, num_slots=64, item=256, **strides) -> tuple[int, ...]:
    s = dict(s_kv=num_layers * num_slots * item, s_layer=num_slots * item, s_page=item, s_in_page=0, s_chunk=0)
    s.update(strides)
    return (base, num_layers, s["s_kv"], s["s_layer"], s["s_page"], s["s_in_page"], s["s_chunk"], page_size, num_slots)


def bulk_args(**over: object) -> dict[str, object]:
    args: dict[str, object] = dict(
        src_desc=side(), src_table=False, dst_desc=side(base=1 << 24), dst_table=False,
        src_idx_ptr=1 << 12, dst_idx_ptr=1 << 13, n=8, layer_begin=0, layer_count=4, num_kv=2, num_chunks=1,
        chunk_bytes=256, align_bytes=0, num_blocks=4, warps_per_block=2, oob_count_ptr=0, stream=0,
    )  # fmt: skip
    args.update(over)
    return args


def refused(message: str):
    return pytest.raises(ValueError, match=f"^{re.escape(message)}$")


BULK_CHECKS = {
    "n": ({"n": -1}, "n must be >= 0, got -1"),
    "num_blocks": ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
    "warps_per_block": ({"warps_per_block": 33}, "warps_per_block must be in [1, 32], got 33"),
    "dst_desc.base": ({"dst_desc": side(base=0)}, "dst_desc.base must not be 0"),
    "layers": ({"layer_begin": 3, "layer_count": 2},
               "layer_begin + layer_count must be <= src_desc.num_layers (4), got 3 + 2"),
    "chunk-not-16": ({"chunk_bytes": 40}, "chunk_bytes, align_bytes, the affine bases and the strides used must be "
                     "multiples of 16 bytes for bulk copies (use launch_transfer), their gcd is 8"),
    "base-not-16": ({"src_desc": side(base=(1 << 20) + 8)}, "chunk_bytes, align_bytes, the affine bases and the "
                    "strides used must be multiples of 16 bytes for bulk copies (use launch_transfer), their gcd is 8"),
    "stride-not-16": ({"dst_desc": side(item=264)}, "chunk_bytes, align_bytes, the affine bases and the strides "
                      "used must be multiples of 16 bytes for bulk copies (use launch_transfer), their gcd is 8"),
    "table-align": ({"align_bytes": 4}, "chunk_bytes, align_bytes, the affine bases and the strides used must be "
                    "multiples of 16 bytes for bulk copies (use launch_transfer), their gcd is 4"),
    "src_idx": ({"src_idx_ptr": 0}, "src_idx must not be null when n > 0 (n = 8)"),
}  # fmt: skip


@needs_extension
@pytest.mark.parametrize("case", BULK_CHECKS)
def test_transfer_bulk_names_the_bad_argument(C, case: str) -> None:
    over, message = BULK_CHECKS[case]
    with refused(f"launch_transfer_bulk: {message}"):
        C.transfer_bulk(**bulk_args(**over))


@needs_extension
@pytest.mark.parametrize("case", ["chunk-not-16", "n", "layers"])
def test_bulk_schedule_checks_like_the_launcher(C, case: str) -> None:
    over, message = BULK_CHECKS[case]
    args = bulk_args(**over)
    del args["oob_count_ptr"], args["stream"]
    with refused(f"bulk_schedule: {message}"):
        C.bulk_schedule(**args)


@needs_extension
def test_transfer_bulk_with_no_pairs_launches_nothing(C) -> None:
    """n == 0 returns before any CUDA call: here, where any CUDA call fails (no driver), it returns; with a
    pair to move the same call reaches CUDA and fails. On a GPU the empty call must leave the stream idle."""
    if torch.cuda.is_available():
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        C.transfer_bulk(**bulk_args(n=0, src_idx_ptr=0, dst_idx_ptr=0, stream=stream.cuda_stream))
        assert stream.query()  # nothing was enqueued on it
        return
    assert C.transfer_bulk(**bulk_args(n=0, src_idx_ptr=0, dst_idx_ptr=0)) is None
    with pytest.raises(RuntimeError, match="launch_transfer_bulk failed: cuda"):
        C.transfer_bulk(**bulk_args(n=1))


# ------------------------------------------------------------------------------------ host emulation


def tensor_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


def inside(ranges: list[tuple[int, int]], address: int, size: int) -> bool:
    return any(lo <= address and address + size <= hi for lo, hi in ranges)


def run_schedule(C, plan, num_blocks: int, src_ranges, dst_ranges) -> tuple[dict, list]:
    """bulk_schedule over the plan's CPU pools (table sides get a host table), checked and applied
    through a model of each CTA's ring: per round, every load into the ring slot, then every store."""
    route = plan.route
    keep = []

    def desc(side_) -> tuple[int, ...]:
        d = list(side_.desc())
        if side_.is_table:
            table = side_.table_array.copy()
            keep.append(table)
            d[0] = table.ctypes.data
        return tuple(d)

    src_idx = plan.src_indices.to(torch.int64).contiguous()
    dst_idx = plan.dst_indices.to(torch.int64).contiguous()
    n = src_idx.numel()
    sched = C.bulk_schedule(
        desc(route.src), route.src.is_table, desc(route.dst), route.dst.is_table, src_idx.data_ptr(),
        dst_idx.data_ptr(), n, route.layer_begin, route.layer_count, route.num_kv, route.num_chunks,
        route.chunk_bytes, route.alignment(), num_blocks, 2,
    )  # fmt: skip
    stages, stage_bytes = sched["stages"], sched["stage_bytes"]
    assert 1 <= sched["blocks"] <= num_blocks
    check_ring(sched, route.chunk_bytes)
    rings = {b: np.zeros(stages * stage_bytes, dtype=np.uint8) for b in range(sched["blocks"])}
    by_round: dict[tuple[int, int], list[tuple]] = {}
    for copy in sched["copies"]:
        block, rnd, slot, parity, off, src, dst, size = copy
        assert slot == rnd % stages and parity == (rnd // stages) & 1, copy
        assert slot * stage_bytes <= off and off + size <= (slot + 1) * stage_bytes, copy
        assert off % 16 == 0 and size % 16 == 0 and src % 16 == 0 and dst % 16 == 0 and size > 0, copy
        assert inside(src_ranges, src, size) and inside(dst_ranges, dst, size), copy
        by_round.setdefault((block, rnd), []).append(copy)
    for (block, rnd), copies in sorted(by_round.items()):
        spans = sorted((c[4], c[4] + c[7]) for c in copies)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), (block, rnd, "ring pieces overlap")
        ring = rings[block]
        for *_, off, src, _dst, size in copies:  # loader: global -> ring slot
            ctypes.memmove(ring.ctypes.data + off, src, size)
        for *_, off, _src, dst, size in copies:  # storer: ring slot -> global
            ctypes.memmove(dst, ring.ctypes.data + off, size)
    for block in rings if sched["oob_count"] == 0 else ():  # rounds 0, 1, 2, ... (one batch each)
        rounds = sorted(r for b, r in by_round if b == block)
        assert rounds == list(range(len(rounds))), block
    return sched, keep


def check_ring(sched: dict, chunk_bytes: int) -> None:
    """The launch's ring (its dynamic shared memory) is as small as its work allows: one stage per
    round a CTA runs, up to the most stages, and a stage only as large as its pieces, rounded up to
    128 bytes (never over the largest stage)."""
    copies = sched["copies"]
    stages, stage_bytes = sched["stages"], sched["stage_bytes"]
    rounds = 1 + max(c[1] for c in copies)
    assert stages == min(sched["max_stages"], rounds), (stages, rounds)
    assert stage_bytes % 128 == 0 and 0 < stage_bytes <= sched["max_stage_bytes"], stage_bytes
    piece_stride = min(chunk_bytes, sched["max_stage_bytes"])
    per_stage = sched["max_stage_bytes"] // piece_stride
    total_pieces = len({(c[1], c[0], c[4]) for c in copies})  # every piece lands once (no skips here)
    if sched["oob_count"] == 0:
        used = min(per_stage, total_pieces) * piece_stride
        assert stage_bytes == -(-used // 128) * 128, (stage_bytes, used)


CASES = [
    (layout, mla) for layout in layouts.LAYOUTS for mla in (False, True) if not mla or layout in layouts.MLA_LAYOUTS
]


@needs_extension
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize(("layout", "mla"), CASES)
@pytest.mark.parametrize(
    ("page_size", "head_dim", "num_blocks"),
    [
        (1, 8, 3),  # small chunks, many per stage
        (4, 520, 1),  # 1040-byte heads: 7 pieces per stage and a ragged last batch; one CTA wraps the ring
        (2, 2056, 5),  # 4112-byte heads, 8224-byte items: pieces span two stages with a 32-byte tail
    ],
)
def test_emulated_schedule_matches_the_reference(C, direction, layout, mla, page_size, head_dim, num_blocks) -> None:
    pools = make_pools(layout=layout, mla=mla, dtype=torch.float16, page_size=page_size, head_dim=head_dim,
                       direction=direction, host_pages=12, seed=head_dim)  # fmt: skip
    n_host = 12 * page_size if page_size > 1 else 48
    d_idx, h_idx = make_indices("random", 96, n_host, page_size, count=23, seed=page_size)  # odd count
    plan = ops.build_plan(direction, pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout=layout,
                          page_size=page_size)  # fmt: skip
    expected = expected_after(pools, direction, d_idx, h_idx, None)
    device = pools.layers(pools.device_k) + ([] if pools.device_v is None else pools.layers(pools.device_v))
    src_t, dst_t = (device, [pools.host]) if direction == "d2h" else ([pools.host], device)
    sched, _ = run_schedule(C, plan, num_blocks, tensor_ranges(src_t), tensor_ranges(dst_t))
    assert sched["oob_count"] == 0
    assert sum(c[7] for c in sched["copies"]) == plan.route.chunk_bytes * plan.route.num_chunks * plan.route.num_kv * (
        plan.route.layer_count * len(d_idx)
    )
    if head_dim == 520:
        assert max(c[1] for c in sched["copies"]) >= sched["stages"], "the ring never wrapped"
    assert pools.equal(expected)


@needs_extension
@pytest.mark.parametrize(
    ("page_size", "head_dim", "count", "num_blocks", "stages"),
    [
        (1, 8, 3, 4, 1),  # 12 pieces of 32 bytes: one batch, one CTA, one stage of 384 bytes
        (1, 8, 40, 1, 1),  # 160 pieces of 32 bytes: a stage holds 256, so one round
        (4, 520, 23, 1, 4),  # 2080-byte pieces, 3 a stage: 31 rounds on one CTA wrap the full ring
        (4, 520, 4, 3, 2),  # 16 pieces, 6 batches on 3 CTAs: 2 rounds each, so 2 stages
    ],
)
def test_ring_is_sized_to_the_launch(C, page_size, head_dim, count, num_blocks, stages) -> None:
    """A launch's dynamic shared memory is its ring: one stage per round a CTA runs (at most the
    largest ring's) of only the bytes its pieces take, so a small launch asks for far less than the
    32 KiB maximum."""
    pools = make_pools(layout="layer_first", mla=False, dtype=torch.float16, page_size=page_size, head_dim=head_dim,
                       direction="d2h", host_pages=12, num_layers=2)  # fmt: skip
    d_idx, h_idx = make_indices("random", 96, 12 * page_size if page_size > 1 else 48, page_size, count=count, seed=1)
    assert len(d_idx) == count
    plan = ops.build_plan("d2h", pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout="layer_first",
                          page_size=page_size)  # fmt: skip
    device = pools.layers(pools.device_k) + pools.layers(pools.device_v)
    sched, _ = run_schedule(C, plan, num_blocks, tensor_ranges(device), tensor_ranges([pools.host]))
    chunk = plan.route.chunk_bytes
    pieces = count * 2 * 2 * plan.route.num_chunks
    used = min(pieces, sched["max_stage_bytes"] // chunk) * chunk
    assert sched["stages"] == stages
    assert sched["stage_bytes"] == -(-used // 128) * 128 < sched["max_stage_bytes"]
    assert pools.equal(expected_after(pools, "d2h", d_idx, h_idx, None))


@needs_extension
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_emulated_schedule_skips_and_counts_out_of_range_pairs(C, direction) -> None:
    page_size = 4
    pools = make_pools(layout="page_first", mla=False, dtype=torch.float16, page_size=page_size, head_dim=520,
                       direction=direction, host_pages=12)  # fmt: skip
    d_idx, h_idx = make_indices("random", 96, 48, page_size, count=9, seed=3)
    bad_d, bad_h = d_idx.clone(), h_idx.clone()
    bad_d[2], bad_h[5] = 96, 48 + 7  # one past the device pool, beyond the host pool
    plan = ops.build_plan(direction, pools.device_k, pools.device_v, pools.host, bad_d, bad_h, layout="page_first",
                          page_size=page_size, check_indices=False)  # fmt: skip
    keep = torch.ones(len(d_idx), dtype=torch.bool)
    keep[[2, 5]] = False
    expected = expected_after(pools, direction, d_idx[keep], h_idx[keep], None)
    device = pools.layers(pools.device_k) + pools.layers(pools.device_v)
    src_t, dst_t = (device, [pools.host]) if direction == "d2h" else ([pools.host], device)
    sched, _ = run_schedule(C, plan, 2, tensor_ranges(src_t), tensor_ranges(dst_t))
    route = plan.route
    assert sched["oob_count"] == 2 * route.num_kv * route.layer_count * route.num_chunks
    assert pools.equal(expected)
