"""The ``triton`` io-backend: one gather/scatter kernel that performs any :class:`~hicache_kernels.plan.TransferPlan`.

The kernel implements the plan's byte formulas exactly (see :mod:`hicache_kernels.plan`)::

    affine: base            + kv * s_kv + l * s_layer + (n // page) * s_page + (n % page) * s_in_page + c * s_chunk
    table:  table[kv*L + l]                            + (n // page) * s_page + (n % page) * s_in_page + c * s_chunk

It copies in the widest integer type (8, 4, 2 or 1 bytes) that divides the route's alignment
(:meth:`~hicache_kernels.plan.Route.alignment`: every address, stride and ``chunk_bytes``), so every
dtype (fp16, bf16, fp32, fp8, uint8) and every item size (6-byte items, 656-byte items) moves
bit-exactly; all strides reach the kernel in elements of that type.
When every address and stride is also 16-byte aligned (``VEC > 1``), every address is formed from one
aligned ``anchor`` pointer with alignment hints, so the compiled kernel uses 16-byte vector loads and
stores (``ld/st.global.v2.b64`` or ``.v4.b32``; tests/kernels/test_triton_quality.py checks the PTX).

Work split
----------
A work item ``w`` is row block ``r = w % cdiv(n, ROWS)`` (rows ``[r * ROWS, (r + 1) * ROWS)`` of the
index pairs) of unit ``u = w // cdiv(n, ROWS)``, one (kv, layer) pair: ``kv = u // layer_count``,
``l = layer_begin + u % layer_count``. Its tile is ``ROWS x BLOCK`` elements: ``BLOCK`` is the item
size in elements rounded up to a power of two (capped at :data:`MAX_BLOCK`; longer items loop), and
``ROWS`` packs several small items into one program so each tile is about :data:`TILE_BYTES`. The grid
is persistent and one-dimensional: ``min(cdiv(n, ROWS) * units, max_programs)`` programs (default
:data:`DEFAULT_MAX_PROGRAMS`), program ``p`` taking work items ``p, p + P, ...``; ``n == 0`` launches
nothing. Offsets are int64 throughout. A pair whose source or destination index
is outside ``[0, num_slots)`` of its side (negative too) is masked out: nothing is read or written for
it, whether or not the plan was checked.

Devices
-------
- CPU tensors run under Triton's interpreter and need ``TRITON_INTERPRET=1`` set before Triton is
  imported (tests/conftest.py does this). Affine sides are passed as ``uint8`` aliases of their
  tensor's storage starting at the side's base address; tables as CPU int64 tensors.
- CUDA: the launch is prepared as the kernel backend's is
  (:func:`~hicache_kernels.backends.base.prepare_gpu_launch`): tables become CUDA int64 tensors
  (:class:`hicache_kernels.launch.DeviceTables`, the one table cache of the package), kept for exactly
  as long as the memory of the tensors they were taken from lives, so repeated calls and CUDA-graph
  capture reuse them and a captured graph's table is never freed under it (the first call for a
  route uploads its table, which cannot happen under capture: make it before capturing). The launch
  goes to ``plan.stream`` if given (on the device pool's device), else the current stream, and never
  synchronises. Index tensors on the CPU are copied to the device first, on the launch stream (use
  device indices under graph capture).
- **Zero-copy host access (untested: no GPU run has exercised this path yet).** A host side whose
  tensor is a *pinned* CPU tensor is not copied: the kernel reads or writes the pinned pages directly
  over PCIe/NVLink. Triton receives a small object exposing ``data_ptr()`` and ``dtype`` in place of
  the CPU tensor; ``data_ptr()`` returns the device alias of the host address
  (:func:`hicache_kernels.launch.device_alias`: the extension's ``host_device_pointer`` when it can
  run, else the host address itself, which is valid under unified virtual addressing; Triton's
  launcher further resolves it with ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``).
  A non-pinned host tensor is rejected with ``ValueError`` naming ``host``: pageable memory cannot be
  addressed by the GPU.

Triton is imported on the first call only; without it :func:`run_triton` raises
:class:`~hicache_kernels.BackendUnavailableError` with the reason. :class:`TritonBackend` is the
io-backend running :func:`run_triton`.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import torch

from .._ext import BackendUnavailableError
from ..plan import Route, Side, TransferPlan
from .base import IOBackend, device_indices, pinned_reason, prepare_gpu_launch

__all__ = ["DEFAULT_MAX_PROGRAMS", "MAX_BLOCK", "TILE_BYTES", "TritonBackend", "check_max_programs", "element_width",
           "grid_programs", "launch_shape", "pick_width", "run_triton"]  # fmt: skip

# Filled by _import_triton(); the kernel resolves ``tl`` from this module's globals when it compiles.
tl: Any = None

TILE_BYTES = 8192
"""Bytes one program moves per loop iteration (``ROWS * BLOCK * width``) when items are small."""
MAX_BLOCK = 4096
"""Largest ``BLOCK`` (elements per row per iteration); longer items loop inside the program."""
DEFAULT_MAX_PROGRAMS = 64
"""Programs a launch runs at most (a persistent grid: each takes row blocks of (kv, layer) units in turn).
Bounded so a transfer occupies a few SMs beside the model's kernels rather than flooding every SM (an
uncapped grid of ``cdiv(n, ROWS) x units`` programs slowed a GEMM beside it 1.63x in tokenspeed#150);
64 programs of 4 warps are twice the ``kernel`` backend's default 16 CTAs x 8 warps."""
MAX_PROGRAMS_LIMIT = 2**31 - 1
"""CUDA's limit on grid dimension 0."""

_WIDTH_DTYPES: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


# --------------------------------------------------------------------------------------------------
# The kernel. Plain function here; decorated with triton.jit lazily so importing this module does not
# import Triton, and so the interpreter/compiled choice follows TRITON_INTERPRET at first use.
# --------------------------------------------------------------------------------------------------
def _transfer_kernel(
    anchor,  # a 16-byte-aligned ELEM pointer every address is taken relative to (see below)
    src,  # SRC_TABLE: int64 [num_kv * L] base addresses; else pointer to the pool's first byte
    dst,  # same, for the destination side
    src_idx,  # [n] source slot indices (any integer dtype), stride src_idx_stride elements
    dst_idx,  # [n] destination slot indices
    src_idx_stride,
    dst_idx_stride,
    n,
    layer_begin,
    layer_count,
    units,  # num_kv * layer_count: the (kv, layer) units to move
    item_elems,  # num_chunks * chunk_elems
    chunk_elems,
    # Per side: every stride below is in elements of ELEM, not bytes.
    src_num_layers,
    src_s_kv,
    src_s_layer,
    src_s_page,
    src_s_in_page,
    src_s_chunk,
    src_page_size,
    src_num_slots,
    dst_num_layers,
    dst_s_kv,
    dst_s_layer,
    dst_s_page,
    dst_s_in_page,
    dst_s_chunk,
    dst_page_size,
    dst_num_slots,
    SRC_TABLE: tl.constexpr,
    DST_TABLE: tl.constexpr,
    MULTI_CHUNK: tl.constexpr,  # False: the item is contiguous on both sides, skip the chunk split
    ELEM: tl.constexpr,  # tl.int64 / int32 / int16 / uint8: the copy unit
    WIDTH: tl.constexpr,  # bytes of ELEM
    VEC: tl.constexpr,  # ELEMs per 16 bytes when every address and stride is 16-byte aligned, else 1
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # A persistent grid: program p takes work items p, p + P, ... (P programs, capped by the launcher),
    # each one row block of one (kv, layer) unit, unit-major: the programs sweep a layer's rows together.
    pid = tl.program_id(0).to(tl.int64)
    num_programs = tl.num_programs(0).to(tl.int64)
    row_blocks = (n.to(tl.int64) + ROWS - 1) // ROWS
    origin = anchor.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for work in range(pid, row_blocks * units, num_programs):
        unit = work // row_blocks
        row_block = work - unit * row_blocks
        kv = unit // layer_count
        layer = layer_begin + unit % layer_count

        # Base of this (kv, layer) on each side, in ELEMs from ``anchor``: a table lookup, or the affine
        # base plus kv/layer strides. Addressing everything from one pointer whose alignment Triton knows
        # lets the alignment hints below reach the loads and stores (16-byte vectors when VEC > 1); a
        # pointer read from a table or cast from an integer carries no alignment of its own.
        if SRC_TABLE:
            src_base = (tl.load(src + kv * src_num_layers + layer) - origin) // WIDTH
        else:
            src_base = (src.to(tl.int64) - origin) // WIDTH + kv * src_s_kv + layer * src_s_layer
        if DST_TABLE:
            dst_base = (tl.load(dst + kv * dst_num_layers + layer) - origin) // WIDTH
        else:
            dst_base = (dst.to(tl.int64) - origin) // WIDTH + kv * dst_s_kv + layer * dst_s_layer

        rows = row_block * ROWS + tl.arange(0, ROWS).to(tl.int64)
        in_n = rows < n
        s = tl.load(src_idx + rows * src_idx_stride, mask=in_n, other=0).to(tl.int64)
        d = tl.load(dst_idx + rows * dst_idx_stride, mask=in_n, other=0).to(tl.int64)
        # Out-of-range pairs are masked even for unchecked plans: never touch memory outside the pools.
        ok = in_n & (s >= 0) & (s < src_num_slots) & (d >= 0) & (d < dst_num_slots)
        s_row = src_base + (s // src_page_size) * src_s_page + (s % src_page_size) * src_s_in_page
        d_row = dst_base + (d // dst_page_size) * dst_s_page + (d % dst_page_size) * dst_s_in_page
        # Every base and stride is a multiple of VEC ELEMs (the launcher checked): each row starts aligned.
        s_row = tl.multiple_of(s_row, VEC)
        d_row = tl.multiple_of(d_row, VEC)

        for start in range(0, item_elems, BLOCK):
            e = start + cols  # int32: an item is far below 2**31 elements
            if MULTI_CHUNK:
                # Chunk c of an item sits s_chunk apart on each side; split in int32, widen before scaling.
                c = e // chunk_elems
                j = (e - c * chunk_elems).to(tl.int64)
                # Chunks and chunk strides are multiples of VEC: runs of VEC contiguous, aligned elements.
                s_col = tl.max_contiguous(tl.multiple_of(c.to(tl.int64) * src_s_chunk + j, VEC), VEC)
                d_col = tl.max_contiguous(tl.multiple_of(c.to(tl.int64) * dst_s_chunk + j, VEC), VEC)
            else:
                s_col = e.to(tl.int64)
                d_col = e.to(tl.int64)
            # item_elems is a multiple of VEC: testing the start of e's VEC-group gives the same mask, and
            # one that is visibly constant over each group (needed for vector accesses).
            mask = ok[:, None] & ((e // VEC) * VEC < item_elems)[None, :]
            vals = tl.load(anchor + s_row[:, None] + s_col[None, :], mask=mask)
            tl.store(anchor + d_row[:, None] + d_col[None, :], vals, mask=mask)


def _import_triton() -> Any:
    """Import Triton (and bind ``tl`` for the kernel) or raise BackendUnavailableError saying why."""
    global tl
    try:
        import triton
        import triton.language as language
    except Exception as exc:  # ImportError, or a broken install failing at import time
        raise BackendUnavailableError(
            f"the triton backend needs the triton package, which does not import: {exc!r}"
        ) from exc
    tl = language
    return triton


_INTERPRETER_LOCK = threading.Lock()  # one interpreted launch at a time (see the CPU branch of transfer)


# Arguments that change from call to call of one route: Triton would specialize each on being 1 or a
# multiple of 16 and compile another variant for each combination it meets (a stall of hundreds of
# milliseconds each, the first time one shows up mid-serving). Everything else is fixed per route.
PER_CALL_ARGS = ("src_idx_stride", "dst_idx_stride", "n", "layer_begin", "layer_count", "units")


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool) -> Any:
    """The jitted kernel; keyed by interpreter mode because ``triton.jit`` reads it when decorating."""
    triton = _import_triton()
    return triton.jit(_transfer_kernel, do_not_specialize=PER_CALL_ARGS)


# --------------------------------------------------------------------------------------------------
# Element width and launch shape
# --------------------------------------------------------------------------------------------------
def pick_width(align: int) -> int:
    """Largest of 8, 4, 2, 1 bytes dividing ``align`` (0, no constraint: 8)."""
    for width in (8, 4, 2):
        if align % width == 0:
            return width
    return 1


def element_width(plan: TransferPlan) -> int:
    """Bytes per element the kernel copies ``plan`` in on the CPU (a CUDA launch also counts the host
    pool's device alias): the largest of 8/4/2/1 dividing the plan's alignment
    (:meth:`~hicache_kernels.plan.Route.alignment`: every address, stride and ``chunk_bytes``).

    Copying in integers of this width moves any dtype bit-exactly: e.g. fp16 items of head_dim 3
    (6 bytes) move as int16, 656-byte items as int64, odd-sized uint8 items as uint8.
    """
    return pick_width(plan.route.alignment())


def launch_shape(item_elems: int, width: int) -> tuple[int, int, int]:
    """``(ROWS, BLOCK, num_warps)`` for items of ``item_elems`` elements of ``width`` bytes.

    BLOCK covers the item (power of two, at most :data:`MAX_BLOCK`); ROWS packs items so a tile is
    about :data:`TILE_BYTES`; num_warps gives each thread ~64 bytes per iteration (1 to 8 warps).
    """
    block = min(_next_power_of_2(max(item_elems, 1)), MAX_BLOCK)
    rows = max(1, TILE_BYTES // width // block)
    tile_bytes = rows * block * width
    num_warps = min(8, max(1, tile_bytes // 2048))
    return rows, block, num_warps


def _next_power_of_2(x: int) -> int:
    """Smallest power of two >= ``x`` (as ``triton.next_power_of_2``, without importing Triton)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


class _Shape:
    """A route's launch constants for one alignment (cached per route): copy width, vector width,
    tile, chunking and both sides' strides in elements."""

    __slots__ = ("block", "chunk_elems", "dst_scalars", "item_elems", "multi_chunk", "num_warps", "rows",
                 "src_scalars", "vec", "width")  # fmt: skip

    def __init__(self, route: Route, align: int) -> None:
        width = pick_width(align)
        self.width = width
        self.vec = 16 // width if align % 16 == 0 else 1  # the anchor itself is 16-byte aligned
        self.chunk_elems = route.chunk_bytes // width
        self.item_elems = self.chunk_elems * route.num_chunks
        self.rows, self.block, self.num_warps = launch_shape(self.item_elems, width)
        # Chunks laid end to end on both sides are one contiguous run: skip the per-element chunk split.
        src, dst = route.src, route.dst
        self.multi_chunk = route.num_chunks > 1 and not (src.s_chunk == dst.s_chunk == route.chunk_bytes)
        self.src_scalars = _side_scalars(src, width)
        self.dst_scalars = _side_scalars(dst, width)


def _side_scalars(side: Side, width: int) -> tuple[int, ...]:
    return (side.num_layers, side.s_kv // width, side.s_layer // width, side.s_page // width,
            side.s_in_page // width, side.s_chunk // width, side.page_size, side.num_slots)  # fmt: skip


def _shape(route: Route, align: int) -> _Shape:
    key = ("triton", align)
    shape = route.launch_state.get(key)
    if shape is None:
        shape = route.launch_state[key] = _Shape(route, align)
    return shape


# --------------------------------------------------------------------------------------------------
# Arguments per device
# --------------------------------------------------------------------------------------------------
class _RawPointer:
    """A pointer argument for Triton's launcher: ``data_ptr()`` and ``dtype`` are all it reads.

    Used on CUDA for affine sides (their base address, not their tensor's first element) and for
    zero-copy pinned host memory, whose CPU tensor Triton must not see as a tensor.
    """

    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self._ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._ptr

    def __repr__(self) -> str:
        return f"_RawPointer(0x{self._ptr:x}, {self.dtype})"


def _cpu_alias(side: Side, tensors: tuple[torch.Tensor, ...], name: str) -> torch.Tensor:
    """A uint8 tensor on the storage holding the side's base address, whose ``data_ptr()`` is that address.

    The interpreter accepts only real tensors (it stages each argument's storage), and CPU storages
    are used in place, so the raw addresses the kernel computes point into the caller's memory.
    """
    for t in tensors:
        storage = t.untyped_storage()
        offset = side.base - storage.data_ptr()
        if 0 <= offset < max(storage.nbytes(), 1):
            return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (storage.nbytes() - offset,))
    raise ValueError(f"{name}: base address 0x{side.base:x} lies outside its tensors' storage")


def _cpu_arg(route: Route, side: Side, tensors: tuple[torch.Tensor, ...], name: str) -> torch.Tensor:
    if not side.is_table:
        return _cpu_alias(side, tensors, name)
    key = ("triton-cpu-table", name)
    table = route.launch_state.get(key)
    if table is None:  # the addresses as a CPU tensor; not a pool, so the route may keep it
        table = route.launch_state[key] = torch.tensor(side.table, dtype=torch.int64)
    return table


# --------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------
def check_max_programs(max_programs: Any) -> int:
    """``max_programs`` if it is an int in ``[1, 2**31 - 1]``; else ``ValueError`` naming it."""
    ok = isinstance(max_programs, int) and not isinstance(max_programs, bool)
    if not ok or not 1 <= max_programs <= MAX_PROGRAMS_LIMIT:
        raise ValueError(f"max_programs: expected an int in [1, {MAX_PROGRAMS_LIMIT}], got {max_programs!r}")
    return max_programs


def grid_programs(n: int, rows: int, units: int, max_programs: int) -> int:
    """Programs of a launch: one per work item (a row block of ``rows`` of one of ``units``), at most
    ``max_programs``; the kernel loops over the rest."""
    return min(_cdiv(n, rows) * units, max_programs)


def run_triton(plan: TransferPlan, max_programs: int | None = None) -> None:
    """Perform ``plan`` with one Triton kernel launch (none when there is nothing to move).

    Parameters
    ----------
    plan : TransferPlan
        From :func:`hicache_kernels.ops.build_plan` (or a :class:`~hicache_kernels.binding.KVBinding`).
        ``src``/``dst`` may be affine or table sides; ``src_indices``/``dst_indices`` are 1-D integer
        tensors of equal length ``n`` (slot indices). CPU-only plans run under the Triton interpreter;
        plans with a CUDA device pool run on that GPU with the host side addressed zero-copy (it
        must be pinned).
    max_programs : int, optional
        Programs the launch runs at most (default :data:`DEFAULT_MAX_PROGRAMS`); each loops over row
        blocks of (kv, layer) units until the transfer is done.

    Raises
    ------
    BackendUnavailableError
        Triton does not import; CPU tensors without ``TRITON_INTERPRET=1``; CUDA tensors with it.
    ValueError
        A host pool that is not pinned in a CUDA transfer (names ``host``); index tensors of
        different lengths or not 1-D; ``plan.stream`` on another device than the device pool;
        ``max_programs`` not a positive int.

    Notes
    -----
    Index pairs outside either side's ``[0, num_slots)`` are skipped (nothing read or written),
    whether or not the indices were checked. Destination indices must not repeat (a repeat is a
    race). The call is asynchronous on CUDA: it enqueues on ``plan.stream`` (or the current stream)
    and returns. A route's launch constants, device tables and host alias are derived by its first
    call and reused.

    Examples
    --------
    >>> plan = build_plan("d2h", k_layers, v_layers, host, dev_idx, host_idx,
    ...                   layout="page_first", page_size=1)  # doctest: +SKIP
    >>> run_triton(plan)  # doctest: +SKIP
    """
    _import_triton()
    route = plan.route
    on_cuda = route.on_cuda
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if on_cuda and interpret:
        raise BackendUnavailableError(
            "TRITON_INTERPRET=1 cannot run a transfer on CUDA tensors: the interpreter stages arguments "
            "on the host, while this kernel addresses the pools by raw device addresses; unset it"
        )
    if not on_cuda and not interpret:
        raise BackendUnavailableError(
            "the triton backend on CPU tensors needs TRITON_INTERPRET=1 (set before triton is imported)"
        )

    src_idx, dst_idx = plan.src_indices, plan.dst_indices
    for name, idx in (("src_indices", src_idx), ("dst_indices", dst_idx)):
        if idx.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(idx.shape)}")
    n = src_idx.numel()
    if dst_idx.numel() != n:
        raise ValueError(f"dst_indices: expected {n} indices like src_indices, got {dst_idx.numel()}")
    if not on_cuda:
        for name, idx in (("src_indices", src_idx), ("dst_indices", dst_idx)):
            if idx.device.type != "cpu":
                raise ValueError(f"{name}: a transfer between CPU pools needs CPU indices, got {idx.device}")
    elif not route.gpu_addressable:
        raise ValueError(
            "host: a transfer with a CUDA device pool reads/writes the host pool zero-copy, which needs "
            "pinned memory; got a non-pinned CPU tensor (allocate it with pin_memory=True)"
        )

    max_programs = check_max_programs(DEFAULT_MAX_PROGRAMS if max_programs is None else max_programs)
    units = route.num_kv * route.layer_count
    if n == 0 or units == 0 or route.num_chunks == 0 or route.chunk_bytes == 0:
        return  # nothing to move: launch nothing (a zero-sized grid is an error on CUDA)
    kernel = _kernel(interpret)

    def launch(shape: _Shape, device: torch.device | None, src_arg: Any, dst_arg: Any, s_idx: torch.Tensor,
               d_idx: torch.Tensor) -> None:  # fmt: skip
        width = shape.width
        kernel[(grid_programs(n, shape.rows, units, max_programs),)](
            _anchor(width, device),
            src_arg,
            dst_arg,
            s_idx,
            d_idx,
            s_idx.stride(0),
            d_idx.stride(0),
            n,
            route.layer_begin,
            route.layer_count,
            units,
            shape.item_elems,
            shape.chunk_elems,
            *shape.src_scalars,
            *shape.dst_scalars,
            SRC_TABLE=route.src.is_table,
            DST_TABLE=route.dst.is_table,
            MULTI_CHUNK=shape.multi_chunk,
            ELEM=_tl_elem(width),
            WIDTH=width,
            VEC=shape.vec,
            ROWS=shape.rows,
            BLOCK=shape.block,
            num_warps=shape.num_warps,
        )

    if not on_cuda:
        src_arg = _cpu_arg(route, route.src, plan.src_tensors, "plan.src")
        dst_arg = _cpu_arg(route, route.dst, plan.dst_tensors, "plan.dst")
        # Triton's interpreter keeps the running grid in process-wide state: two threads interpreting
        # at once (e.g. a cache controller's write and load workers) corrupt each other's program ids.
        with _INTERPRETER_LOCK:
            launch(_shape(route, route.alignment()), None, src_arg, dst_arg, src_idx, dst_idx)
        return

    device = route.device
    g, _, stream = prepare_gpu_launch(plan)  # as the kernel backend's launch: tables, host alias, streams
    shape = _shape(route, g.align)
    elem = _WIDTH_DTYPES[shape.width]
    src_arg = g.src.table if g.src.table is not None else _RawPointer(g.src.base, elem)
    dst_arg = g.dst.table if g.dst.table is not None else _RawPointer(g.dst.base, elem)
    s_idx, d_idx = device_indices(plan, device, stream)  # on the launch stream: ordered before the kernel
    with torch.cuda.device(device.index), torch.cuda.stream(stream):  # Triton launches on the current stream
        launch(shape, device, src_arg, dst_arg, s_idx, d_idx)


_anchors: dict[tuple[str, int], torch.Tensor] = {}


def _anchor(width: int, device: torch.device | None) -> torch.Tensor:
    """A small 16-byte-aligned tensor of the copy's element type on the launch device: the pointer
    the kernel forms every address from (it is never read or written itself)."""
    key = (str(device or "cpu"), width)
    t = _anchors.get(key)
    if t is None:
        t = torch.zeros(16 // width if width < 16 else 1, dtype=_WIDTH_DTYPES[width], device=device or "cpu")
        if t.data_ptr() % 16:
            raise RuntimeError("triton backend: the allocator returned a tensor not aligned to 16 bytes")
        _anchors[key] = t
    return t


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def _tl_elem(width: int) -> Any:
    return {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}[width]


class TritonBackend(IOBackend):
    """Triton gather/scatter (:func:`run_triton`): on a CUDA device pool with a pinned host pool, or on
    CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``). All its work happens at issue.

    Parameters
    ----------
    max_programs : int
        Programs a launch runs at most (default :data:`DEFAULT_MAX_PROGRAMS`): a persistent grid, so a
        transfer takes a bounded share of the SMs whatever its size (``get_backend("triton",
        max_programs=16)``).
    """

    name = "triton"

    def __init__(self, max_programs: int = DEFAULT_MAX_PROGRAMS) -> None:
        super().__init__()
        self.max_programs = check_max_programs(max_programs)

    def unavailable(self, plan: TransferPlan) -> str | None:
        if plan.route.on_cuda:
            return pinned_reason(plan)
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing triton"
        return None

    def _run(self, plan: TransferPlan) -> None:
        run_triton(plan, self.max_programs)

    def warm(self, plan: TransferPlan) -> bool:
        """Compile the kernel for ``plan``'s route (compiled Triton on CUDA; the interpreter compiles
        nothing but runs it the same): one launch whose out-of-range pairs are masked."""
        if self.unavailable(plan) is not None:
            return False
        self.run(plan)
        return True
