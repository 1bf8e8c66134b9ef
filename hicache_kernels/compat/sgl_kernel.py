"""Drop-in replacements for sgl-kernel's ``kvcacheio`` functions, on this package's kernels.

Same names, argument order and units as ``sgl_kernel.kvcacheio``: ``item_size`` and the
``*_layout_dim`` arguments are in **bytes** (``*_layout_dim`` is the byte stride between two token
slots of a page-first buffer, ``num_layers * item_size``); indices are int64 token slots;
``*_layers`` arguments are int64 tensors of per-layer base addresses; ``block_quota`` and
``num_warps_per_block`` size the grid (``block_quota`` blocks of ``num_warps_per_block`` warps).

Differences, all in the direction of safety:
- Any ``item_size`` works (sgl-kernel requires a multiple of 8 bytes); 16-byte vectors are used when
  addresses and sizes allow.
- Indices may be on the CPU or the GPU (copied over when needed).
- With tensors (not pointer tables) on both sides every access is bounds-checked in the kernel: an
  out-of-range index is skipped. Pointer tables carry no sizes, so there (as in sgl-kernel) the caller
  is responsible for the indices. Pointer tables are read back to the host once per table tensor (one
  sync for a CUDA table) and cached while that tensor lives and is not modified in place.
- ``transfer_kv_all_layer_direct_lf_pf`` / ``transfer_kv_per_layer_direct_pf_lf`` (``page_first_direct``
  host buffers ``[P, L, page, H, D]`` per K/V) move each index pair's token slot, so whole-page index
  groups (what sgl-kernel requires: it reads only the first index of each page) give sgl-kernel's
  result, and any other grouping is still copied slot by slot rather than by the page it starts.

The backend defaults to ``kernel``; :func:`use_backend` selects another (``triton`` runs the same
transfers on CPU tensors under the Triton interpreter, which is how they are tested without a GPU).
The ``*_direct*`` functions always use the ``direct`` (copy-engine) backend, as in sgl-kernel.

On CPU tensors, the functions taking pointer tables (``*_layers`` arguments:
``transfer_kv_all_layer``, ``transfer_kv_all_layer_lf_pf``, ``transfer_kv_all_layer_lf_ph`` and their
``_mla`` variants) run only on the ``triton`` backend: the other backends copy CPU memory through views
of the transfer's tensors, and a pointer table names none. They raise ``BackendUnavailableError``
there, before touching memory.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from .._ext import BackendUnavailableError
from ..backends import IOBackend, KernelBackend, get_backend
from ..ops import check_memory, int_arg
from ..plan import Side, TransferPlan

_NO_BOUND = 1 << 62  # pointer tables carry no pool sizes
_backend_name = "kernel"
_kernel_backends: dict[tuple[int, int], KernelBackend] = {}
_table_cache: dict[int, tuple[weakref.ref, tuple[int, int], tuple[int, ...]]] = {}


def use_backend(name: str) -> None:
    """Run the compatibility functions on another io-backend (``kernel`` by default)."""
    global _backend_name
    if not isinstance(name, str):
        raise TypeError(f"name: expected a backend name (str), got {type(name).__name__}")
    get_backend(name)  # validates the name
    _backend_name = name


def _backend(block_quota: int, num_warps_per_block: int) -> IOBackend:
    if _backend_name != "kernel":
        return get_backend(_backend_name)
    key = (block_quota, num_warps_per_block)
    if key not in _kernel_backends:
        _kernel_backends[key] = KernelBackend(num_blocks=block_quota, warps_per_block=num_warps_per_block)
    return _kernel_backends[key]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensor(t: Any, name: str) -> torch.Tensor:
    """``t`` if it is a tensor in addressable memory (CPU or CUDA), else TypeError/ValueError naming it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    check_memory(t, name)
    return t


def _table_values(t: torch.Tensor, name: str, num_layers: int) -> tuple[int, ...]:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.uint64):
        raise TypeError(f"{name}: expected an int64 tensor of layer addresses, got {getattr(t, 'dtype', type(t))}")
    check_memory(t, name)
    if t.numel() < num_layers:
        raise ValueError(f"{name}: expected {num_layers} layer addresses, got {t.numel()}")
    # Cached per tensor object and its in-place version counter, never per address: a freed table's
    # address is soon reused by a different one.
    entry = _table_cache.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == (t._version, num_layers):
        return entry[2]
    values = tuple(int(x) for x in t[:num_layers].view(torch.int64).tolist())  # one sync for a CUDA table
    for key in [k for k, e in _table_cache.items() if e[0]() is None]:
        del _table_cache[key]
    _table_cache[id(t)] = (weakref.ref(t), (t._version, num_layers), values)
    return values


def _side(
    bases: list[list[int]],
    tensors: tuple[torch.Tensor, ...],
    slot_bytes: int,
    num_slots: int,
    *,
    page_size: int = 1,
    s_in_page: int = 0,
    s_chunk: int = 0,
) -> Side:
    """A table side: ``bases[kv][layer]`` plus the per-slot strides."""
    return Side(
        is_table=True, base=0, table=tuple(a for kv in bases for a in kv), num_layers=len(bases[0]),
        s_kv=0, s_layer=0, s_page=slot_bytes, s_in_page=s_in_page, s_chunk=s_chunk, page_size=page_size,
        num_slots=num_slots, tensors=tensors,
    )  # fmt: skip


def _check_sizes(item_size: int, layout_dim: int | None = None, head_num: int = 1) -> None:
    if not isinstance(item_size, int) or item_size <= 0 or item_size % head_num:
        raise ValueError(f"item_size: expected a positive byte count divisible by head_num {head_num}, got {item_size}")
    if layout_dim is not None and (not isinstance(layout_dim, int) or layout_dim <= 0 or layout_dim % item_size):
        raise ValueError(f"layout_dim: expected a positive multiple of item_size {item_size} bytes, got {layout_dim}")


def _lf(tensors: list[torch.Tensor], names: list[str], item_size: int, num_layers: int, head_bytes: int = 0) -> Side:
    """One layer-first tensor per kv, used for every layer id (the per-layer functions' device side)."""
    for t, name in zip(tensors, names, strict=True):
        _tensor(t, name)
    _check_sizes(item_size)
    return _side(
        [[t.data_ptr()] * num_layers for t in tensors], tuple(tensors), item_size,
        min(_nbytes(t) for t in tensors) // item_size, s_chunk=head_bytes,
    )  # fmt: skip


def _pf(tensors: list[torch.Tensor], names: list[str], item_size: int, layout_dim: int) -> Side:
    """Page-first buffers ``[N, L, item]`` per kv: layer ``l`` starts ``l * item_size`` into a slot."""
    for t, name in zip(tensors, names, strict=True):
        _tensor(t, name)
    _check_sizes(item_size, layout_dim)
    num_layers = layout_dim // item_size
    bases = [[t.data_ptr() + layer * item_size for layer in range(num_layers)] for t in tensors]
    return _side(bases, tuple(tensors), layout_dim, min(_nbytes(t) for t in tensors) // layout_dim)


def _ph(
    tensors: list[torch.Tensor], names: list[str], item_size: int, layout_dim: int, page_size: int, head_num: int
) -> Side:
    """Page-head buffers ``[P, H, page, L, D]`` per kv; chunk ``c`` is head ``c``."""
    for t, name in zip(tensors, names, strict=True):
        _tensor(t, name)
    _check_sizes(item_size, layout_dim, head_num)
    hb = item_size // head_num
    num_layers = layout_dim // item_size
    bases = [[t.data_ptr() + layer * hb for layer in range(num_layers)] for t in tensors]
    return _side(
        bases, tuple(tensors), page_size * layout_dim, min(_nbytes(t) for t in tensors) // layout_dim,
        page_size=page_size, s_in_page=layout_dim // head_num, s_chunk=page_size * layout_dim // head_num,
    )  # fmt: skip


def _tables(tables: list[torch.Tensor], names: list[str], num_layers: int, item_size: int, head_bytes: int = 0):
    _check_sizes(item_size)
    bases = [list(_table_values(t, n, num_layers)) for t, n in zip(tables, names, strict=True)]
    return _side(bases, tuple(tables), item_size, _NO_BOUND, s_chunk=head_bytes)


def _run(
    src: Side,
    dst: Side,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    layer_begin: int,
    layer_count: int,
    item_size: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
    head_num: int = 1,
    backend: IOBackend | None = None,
    whole_pages: int | None = None,
) -> None:
    """Check the indices and run. ``backend`` None: the one :func:`use_backend` selected;
    ``whole_pages``: the page size the index count must be a multiple of (sgl-kernel's direct functions)."""
    _check_indices(src_indices, dst_indices, whole_pages)
    _check_sizes(item_size, None, head_num)
    if backend is None:
        backend = _backend(block_quota, num_warps_per_block)
    if _NO_BOUND in (src.num_slots, dst.num_slots) and backend.name != "triton":
        if not any(t.is_cuda for t in src.tensors + dst.tensors):
            raise BackendUnavailableError(
                f"io-backend {backend.name!r}: pointer tables (the *_layers arguments) on the CPU run only on "
                "the triton backend (use_backend('triton')); the others copy CPU memory through views of the "
                "transfer's tensors, and a pointer table names none"
            )
    num_kv = len(src.table) // src.num_layers
    # Backends take the stream and device from the "device side": the destination unless it is host
    # memory, then the source.
    direction = "d2h" if dst.tensors[0].device.type == "cpu" else "h2d"
    plan = TransferPlan(
        direction=direction, src=src, dst=dst, src_indices=src_indices, dst_indices=dst_indices,
        layer_begin=layer_begin, layer_count=layer_count, num_kv=num_kv, num_chunks=head_num,
        chunk_bytes=item_size // head_num, item_bytes=item_size, checked=False,
        extras={"page_size": src.page_size, "compat": True},
    )  # fmt: skip
    backend.run(plan)


def _check_indices(src_indices: Any, dst_indices: Any, whole_pages: int | None) -> None:
    for name, t in (("src_indices", src_indices), ("dst_indices", dst_indices)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise TypeError(f"{name}: expected a 1-D torch.int64 tensor, got {getattr(t, 'dtype', type(t))}")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"dst_indices: expected {src_indices.numel()} indices like src_indices, got {dst_indices.numel()}"
        )
    if whole_pages is not None and src_indices.numel() % whole_pages:
        raise ValueError(
            f"src_indices: expected whole pages, a multiple of page_size {whole_pages} indices, "
            f"got {src_indices.numel()}"
        )


def _page_size(page_size: Any) -> int:
    page_size = int_arg(page_size, "page_size")
    if page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size}")
    return page_size


def _tensor_list(tensors: Any, name: str, counts: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    """A non-empty list of contiguous tensors of one dtype (and, with ``counts``, one of those lengths)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name}: expected a list of tensors, got {type(tensors).__name__}")
    if not tensors or (counts is not None and len(tensors) not in counts):
        expected = "at least one" if counts is None else " or ".join(map(str, counts))
        raise ValueError(f"{name}: expected {expected} tensor(s), got {len(tensors)}")
    for i, t in enumerate(tensors):
        _tensor(t, f"{name}[{i}]")
        if t.dtype != tensors[0].dtype:
            raise TypeError(f"{name}[{i}]: dtype {t.dtype} differs from {name}[0]'s {tensors[0].dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}]: expected a contiguous tensor (strides {tuple(t.stride())})")
    return list(tensors)


def _direct_host(host: list[torch.Tensor], name: str, page_size: int, layer_begin: int, layer_count: int):
    """``page_first_direct`` buffers ``[P, L, page, *item]`` (one per K/V) as a table side over layers
    ``[layer_begin, layer_begin + layer_count)`` (None when ``L`` is too small), and ``L``."""
    first = host[0]
    for i, t in enumerate(host):
        if t.dim() < 4 or t.shape != first.shape:
            raise ValueError(
                f"{name}[{i}]: expected a page_first_direct buffer [P, L, page, H, D] like {name}[0]'s "
                f"{tuple(first.shape)}, got {tuple(t.shape)}"
            )
    P, L, page = first.shape[:3]
    if page != page_size:
        raise ValueError(
            f"page_size: {page_size} differs from the page dimension {page} of {name}[0] {tuple(first.shape)}"
        )
    if layer_count > L - layer_begin:
        return None, L
    item = math.prod(first.shape[3:]) * first.element_size()
    bases = [[t.data_ptr() + (layer_begin + j) * page * item for j in range(layer_count)] for t in host]
    side = _side(bases, tuple(host), L * page * item, P * page, page_size=page, s_in_page=item)
    return side, L


def _direct_device(layers: list[torch.Tensor], name: str, num_kv: int, host: torch.Tensor, host_name: str) -> Side:
    """Per-layer device tensors ``[N, *item]``, K layers then V layers, matching the host's items."""
    if len(layers) % num_kv:
        raise ValueError(f"{name}: expected K layers then V layers (an even count), got {len(layers)} tensors")
    for i, t in enumerate(layers):
        if t.dim() < 1 or t.shape[1:] != host.shape[3:]:
            raise ValueError(
                f"{name}[{i}]: expected [N, {', '.join(map(str, host.shape[3:]))}] like {host_name}'s items, "
                f"got {tuple(t.shape)}"
            )
    if layers[0].dtype != host.dtype:
        raise TypeError(f"{name}: dtype {layers[0].dtype} differs from {host_name}'s {host.dtype}")
    n = len(layers) // num_kv
    item = math.prod(host.shape[3:]) * host.element_size()
    bases = [[t.data_ptr() for t in layers[kv * n : (kv + 1) * n]] for kv in range(num_kv)]
    return _side(bases, tuple(layers), item, min(t.shape[0] for t in layers))


def transfer_kv_per_layer(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """One layer, layer-first to layer-first: ``dst[dst_indices] = src[src_indices]`` for K and V,
    items of ``item_size`` bytes."""
    _run(
        _lf([src_k, src_v], ["src_k", "src_v"], item_size, 1), _lf([dst_k, dst_v], ["dst_k", "dst_v"], item_size, 1),
        src_indices, dst_indices,
        layer_begin=0, layer_count=1, item_size=item_size, block_quota=block_quota,
        num_warps_per_block=num_warps_per_block,
    )  # fmt: skip


def transfer_kv_per_layer_pf_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """Layer ``layer_id`` from page-first buffers (token stride ``src_layout_dim`` bytes) into
    layer-first ``dst_k``/``dst_v``."""
    src = _pf([src_k, src_v], ["src_k", "src_v"], item_size, src_layout_dim)
    _run(
        src, _lf([dst_k, dst_v], ["dst_k", "dst_v"], item_size, src.num_layers), src_indices, dst_indices,
        layer_begin=layer_id, layer_count=1, item_size=item_size, block_quota=block_quota,
        num_warps_per_block=num_warps_per_block,
    )  # fmt: skip


def transfer_kv_per_layer_ph_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    page_size: int,
    head_num: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """Layer ``layer_id`` from page-head buffers ``[P, H, page, L, D]`` into layer-first tensors."""
    src = _ph([src_k, src_v], ["src_k", "src_v"], item_size, src_layout_dim, page_size, head_num)
    dst = _lf([dst_k, dst_v], ["dst_k", "dst_v"], item_size, src.num_layers, item_size // head_num)
    _run(
        src, dst, src_indices, dst_indices,
        layer_begin=layer_id, layer_count=1, item_size=item_size, block_quota=block_quota,
        num_warps_per_block=num_warps_per_block, head_num=head_num,
    )  # fmt: skip


def transfer_kv_all_layer(
    src_k_layers: torch.Tensor,
    dst_k_layers: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """All layers, layer-first to layer-first, both sides given as per-layer address tables."""
    names = ["src_k_layers", "src_v_layers"]
    src = _tables([src_k_layers, src_v_layers], names, num_layers, item_size)
    dst = _tables([dst_k_layers, dst_v_layers], ["dst_k_layers", "dst_v_layers"], num_layers, item_size)
    _run(
        src, dst, src_indices, dst_indices, layer_begin=0, layer_count=num_layers, item_size=item_size,
        block_quota=block_quota, num_warps_per_block=num_warps_per_block,
    )  # fmt: skip


def transfer_kv_all_layer_lf_pf(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """All layers from layer-first pools (address tables) into page-first buffers."""
    src = _tables([src_k_layers, src_v_layers], ["src_k_layers", "src_v_layers"], num_layers, item_size)
    _run(
        src, _pf([dst_k, dst_v], ["dst_k", "dst_v"], item_size, dst_layout_dim), src_indices, dst_indices,
        layer_begin=0, layer_count=num_layers, item_size=item_size, block_quota=block_quota,
        num_warps_per_block=num_warps_per_block,
    )  # fmt: skip


def transfer_kv_all_layer_lf_ph(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    page_size: int,
    head_num: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """All layers from layer-first pools (address tables) into page-head buffers."""
    hb = item_size // head_num
    src = _tables([src_k_layers, src_v_layers], ["src_k_layers", "src_v_layers"], num_layers, item_size, hb)
    _run(
        src, _ph([dst_k, dst_v], ["dst_k", "dst_v"], item_size, dst_layout_dim, page_size, head_num),
        src_indices, dst_indices,
        layer_begin=0, layer_count=num_layers, item_size=item_size, block_quota=block_quota,
        num_warps_per_block=num_warps_per_block, head_num=head_num,
    )  # fmt: skip


def transfer_kv_per_layer_mla(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """MLA :func:`transfer_kv_per_layer`: one latent buffer instead of K and V."""
    _run(
        _lf([src], ["src"], item_size, 1), _lf([dst], ["dst"], item_size, 1), src_indices, dst_indices,
        layer_begin=0, layer_count=1,
        item_size=item_size, block_quota=block_quota, num_warps_per_block=num_warps_per_block,
    )  # fmt: skip


def transfer_kv_per_layer_mla_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """MLA :func:`transfer_kv_per_layer_pf_lf`."""
    side = _pf([src], ["src"], item_size, src_layout_dim)
    _run(
        side, _lf([dst], ["dst"], item_size, side.num_layers), src_indices, dst_indices, layer_begin=layer_id,
        layer_count=1, item_size=item_size, block_quota=block_quota, num_warps_per_block=num_warps_per_block,
    )  # fmt: skip


def transfer_kv_all_layer_mla(
    src_layers: torch.Tensor,
    dst_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """MLA :func:`transfer_kv_all_layer`."""
    _run(
        _tables([src_layers], ["src_layers"], num_layers, item_size),
        _tables([dst_layers], ["dst_layers"], num_layers, item_size), src_indices, dst_indices, layer_begin=0,
        layer_count=num_layers, item_size=item_size, block_quota=block_quota, num_warps_per_block=num_warps_per_block,
    )  # fmt: skip


def transfer_kv_all_layer_mla_lf_pf(
    src_layers: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """MLA :func:`transfer_kv_all_layer_lf_pf`."""
    _run(
        _tables([src_layers], ["src_layers"], num_layers, item_size), _pf([dst], ["dst"], item_size, dst_layout_dim),
        src_indices, dst_indices, layer_begin=0, layer_count=num_layers, item_size=item_size,
        block_quota=block_quota, num_warps_per_block=num_warps_per_block,
    )  # fmt: skip


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Copy-engine copy of token slots between paired per-layer tensors: for each ``i``,
    ``dst_layers[i][dst_indices] = src_layers[i][src_indices]``. As in sgl-kernel the index count must
    be a multiple of ``page_size`` (whole pages); runs of consecutive slots are merged into single
    copies, found from the indices themselves. Always uses the ``direct`` backend, whatever
    :func:`use_backend` says."""
    src_layers = _tensor_list(src_layers, "src_layers")
    dst_layers = _tensor_list(dst_layers, "dst_layers", (len(src_layers),))
    page_size = _page_size(page_size)
    for i, (s, d) in enumerate(zip(src_layers, dst_layers, strict=True)):
        if s.dim() < 1 or d.dim() < 1 or s.dtype != d.dtype or s.shape[1:] != d.shape[1:]:
            raise ValueError(f"dst_layers[{i}]: rows {tuple(d.shape[1:])} {d.dtype} differ from src_layers[{i}]'s "
                             f"{tuple(s.shape[1:])} {s.dtype}")  # fmt: skip
    row = src_layers[0][0].numel() * src_layers[0].element_size()

    def side(layers: list[torch.Tensor], name: str) -> Side:
        if any(t[0].numel() * t.element_size() != row for t in layers):
            raise ValueError(f"{name}: every layer must have the same row size")
        return _side([[t.data_ptr() for t in layers]], tuple(layers), row, min(t.shape[0] for t in layers))

    _run(
        side(src_layers, "src_layers"), side(dst_layers, "dst_layers"), src_indices, dst_indices, layer_begin=0,
        layer_count=len(src_layers), item_size=row, backend=get_backend("direct"), whole_pages=page_size,
    )  # fmt: skip


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Every layer from per-layer device tensors into ``page_first_direct`` host buffers (copy engines).

    ``src_ptrs``: ``L`` K layers then ``L`` V layers, each ``[N, H, D]`` (MLA: ``L`` layers
    ``[N, 1, kv_dim]``); ``dst_ptrs``: ``[host_k, host_v]``, each ``[P, L', page, H, D]`` with
    ``L' >= L`` (MLA: ``[host_kv]``); layers ``0..L-1`` are written. The index count must be a multiple
    of ``page_size`` (whole pages). Always uses the ``direct`` backend.
    """
    dst_ptrs = _tensor_list(dst_ptrs, "dst_ptrs", (1, 2))
    src_ptrs = _tensor_list(src_ptrs, "src_ptrs")
    page_size = _page_size(page_size)
    num_kv = len(dst_ptrs)
    n = len(src_ptrs) // num_kv
    host, L = _direct_host(dst_ptrs, "dst_ptrs", page_size, 0, n)
    if host is None:
        raise ValueError(f"src_ptrs: {n} layers per K/V, more than the {L} layers of dst_ptrs[0]")
    dev = _direct_device(src_ptrs, "src_ptrs", num_kv, dst_ptrs[0], "dst_ptrs[0]")
    _run(
        dev, host, src_indices, dst_indices, layer_begin=0, layer_count=n, item_size=host.s_in_page,
        backend=get_backend("direct"), whole_pages=page_size,
    )  # fmt: skip


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Layer ``layer_id`` from ``page_first_direct`` host buffers into device layers (copy engines).

    ``src_ptrs``: ``[host_k, host_v]``, each ``[P, L, page, H, D]`` (MLA: ``[host_kv]``); ``dst_ptrs``:
    the device layer(s) to write, ``[k_layer, v_layer]`` (MLA: ``[kv_layer]``), each ``[N, H, D]``.
    Given ``n`` layers per K/V (K first), host layers ``layer_id .. layer_id + n - 1`` are copied. The
    index count must be a multiple of ``page_size`` (whole pages). Always uses the ``direct`` backend.
    """
    src_ptrs = _tensor_list(src_ptrs, "src_ptrs", (1, 2))
    dst_ptrs = _tensor_list(dst_ptrs, "dst_ptrs")
    page_size = _page_size(page_size)
    layer_id = int_arg(layer_id, "layer_id")
    num_kv = len(src_ptrs)
    n = len(dst_ptrs) // num_kv
    host, L = _direct_host(src_ptrs, "src_ptrs", page_size, max(layer_id, 0), n)
    if layer_id < 0 or host is None:
        raise ValueError(f"layer_id: expected an int in [0, {L - n + 1}) for {n} layer(s) per K/V, got {layer_id}")
    dev = _direct_device(dst_ptrs, "dst_ptrs", num_kv, src_ptrs[0], "src_ptrs[0]")
    _run(
        host, dev, src_indices, dst_indices, layer_begin=0, layer_count=n, item_size=host.s_in_page,
        backend=get_backend("direct"), whole_pages=page_size,
    )  # fmt: skip


__all__: list[Any] = [
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "use_backend",
]
