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

The backend defaults to ``kernel``; :func:`use_backend` selects another (``triton`` runs the same
transfers on CPU tensors under the Triton interpreter, which is how they are tested without a GPU).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..backends import IOBackend, KernelBackend, get_backend
from ..plan import Side, TransferPlan

_NO_BOUND = 1 << 62  # pointer tables carry no pool sizes
_backend_name = "kernel"
_kernel_backends: dict[tuple[int, int], KernelBackend] = {}
_table_cache: dict[int, tuple[weakref.ref, tuple[int, int], tuple[int, ...]]] = {}


def use_backend(name: str) -> None:
    """Run the compatibility functions on another io-backend (``kernel`` by default)."""
    global _backend_name
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


def _table_values(t: torch.Tensor, name: str, num_layers: int) -> tuple[int, ...]:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.uint64):
        raise TypeError(f"{name}: expected an int64 tensor of layer addresses, got {getattr(t, 'dtype', type(t))}")
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


def _lf(tensors: list[torch.Tensor], item_size: int, num_layers: int, head_bytes: int = 0) -> Side:
    """One layer-first tensor per kv, used for every layer id (the per-layer functions' device side)."""
    _check_sizes(item_size)
    return _side(
        [[t.data_ptr()] * num_layers for t in tensors], tuple(tensors), item_size,
        min(_nbytes(t) for t in tensors) // item_size, s_chunk=head_bytes,
    )  # fmt: skip


def _pf(tensors: list[torch.Tensor], item_size: int, layout_dim: int) -> Side:
    """Page-first buffers ``[N, L, item]`` per kv: layer ``l`` starts ``l * item_size`` into a slot."""
    _check_sizes(item_size, layout_dim)
    num_layers = layout_dim // item_size
    bases = [[t.data_ptr() + layer * item_size for layer in range(num_layers)] for t in tensors]
    return _side(bases, tuple(tensors), layout_dim, min(_nbytes(t) for t in tensors) // layout_dim)


def _ph(tensors: list[torch.Tensor], item_size: int, layout_dim: int, page_size: int, head_num: int) -> Side:
    """Page-head buffers ``[P, H, page, L, D]`` per kv; chunk ``c`` is head ``c``."""
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
    block_quota: int,
    num_warps_per_block: int,
    head_num: int = 1,
) -> None:
    for name, t in (("src_indices", src_indices), ("dst_indices", dst_indices)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise TypeError(f"{name}: expected a 1-D torch.int64 tensor, got {getattr(t, 'dtype', type(t))}")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"dst_indices: expected {src_indices.numel()} indices like src_indices, got {dst_indices.numel()}"
        )
    _check_sizes(item_size, None, head_num)
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
    _backend(block_quota, num_warps_per_block).run(plan)


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
        _lf([src_k, src_v], item_size, 1), _lf([dst_k, dst_v], item_size, 1), src_indices, dst_indices,
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
    src = _pf([src_k, src_v], item_size, src_layout_dim)
    _run(
        src, _lf([dst_k, dst_v], item_size, src.num_layers), src_indices, dst_indices,
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
    src = _ph([src_k, src_v], item_size, src_layout_dim, page_size, head_num)
    _run(
        src, _lf([dst_k, dst_v], item_size, src.num_layers, item_size // head_num), src_indices, dst_indices,
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
        src, _pf([dst_k, dst_v], item_size, dst_layout_dim), src_indices, dst_indices, layer_begin=0,
        layer_count=num_layers, item_size=item_size, block_quota=block_quota, num_warps_per_block=num_warps_per_block,
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
        src, _ph([dst_k, dst_v], item_size, dst_layout_dim, page_size, head_num), src_indices, dst_indices,
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
        _lf([src], item_size, 1), _lf([dst], item_size, 1), src_indices, dst_indices, layer_begin=0, layer_count=1,
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
    side = _pf([src], item_size, src_layout_dim)
    _run(
        side, _lf([dst], item_size, side.num_layers), src_indices, dst_indices, layer_begin=layer_id, layer_count=1,
        item_size=item_size, block_quota=block_quota, num_warps_per_block=num_warps_per_block,
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
        _tables([src_layers], ["src_layers"], num_layers, item_size), _pf([dst], item_size, dst_layout_dim),
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
    ``dst_layers[i][dst_indices] = src_layers[i][src_indices]``. Runs of consecutive slots are merged
    into single copies (``page_size`` is accepted for signature compatibility; runs are found from the
    indices themselves). Always uses the ``direct`` backend, whatever :func:`use_backend` says."""
    if len(src_layers) != len(dst_layers) or not src_layers:
        raise ValueError(f"dst_layers: expected {len(src_layers)} tensors like src_layers, got {len(dst_layers)}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    for i, (s, d) in enumerate(zip(src_layers, dst_layers, strict=True)):
        if s.dtype != d.dtype or s.shape[1:] != d.shape[1:]:
            raise ValueError(f"dst_layers[{i}]: rows {tuple(d.shape[1:])} {d.dtype} differ from src_layers[{i}]'s "
                             f"{tuple(s.shape[1:])} {s.dtype}")  # fmt: skip
        if not s.is_contiguous() or not d.is_contiguous():
            raise ValueError(f"src_layers[{i}]/dst_layers[{i}]: expected contiguous tensors")
    row = src_layers[0][0].numel() * src_layers[0].element_size()
    L = len(src_layers)

    def side(layers: list[torch.Tensor]) -> Side:
        rows = [t.shape[0] for t in layers]
        if any(t[0].numel() * t.element_size() != row for t in layers):
            raise ValueError("src_layers/dst_layers: every layer must have the same row size")
        return _side([[t.data_ptr() for t in layers]], tuple(layers), row, min(rows))

    src, dst = side(list(src_layers)), side(list(dst_layers))
    plan = TransferPlan(
        direction="d2h" if dst.tensors[0].device.type == "cpu" else "h2d", src=src, dst=dst,
        src_indices=src_indices, dst_indices=dst_indices, layer_begin=0,
        layer_count=L, num_kv=1, num_chunks=1, chunk_bytes=row, item_bytes=row, checked=False,
        extras={"page_size": page_size, "compat": True},
    )  # fmt: skip
    get_backend("direct").run(plan)


__all__: list[Any] = [
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "use_backend",
]
