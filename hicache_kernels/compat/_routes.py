"""How sgl-kernel's arguments become transfers (:mod:`hicache_kernels.compat.sgl_kernel`): argument
checks, table sides for each buffer kind (layer-first tensors, page-first and page-head buffers,
pointer tables, ``page_first_direct`` buffers), routes, and the cache that finds a function's route
again from the identity of its arguments."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._ext import BackendUnavailableError
from .._validate import Span, check_disjoint, check_memory, int_arg, tensor_span
from ..backends import IOBackend
from ..identity_cache import IdentityCache, arg_key
from ..plan import NO_BOUND, Route, Side, TransferPlan, cpu_pointer_tables_reason

# Each function's route (sides, geometry, device), built by its first call with given tensors and sizes
# and found again by their identity (pointer tables also by their contents, which are the route: see
# identity_cache._Same). Holds no tensor; an entry goes when one of its tensors dies.
_routes = IdentityCache()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensor_arg(t: Any, name: str) -> torch.Tensor:
    """``t`` if it is a tensor in addressable memory (CPU or CUDA), else TypeError/ValueError naming it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    check_memory(t, name)
    return t


def table_values(t: Any, name: str, num_layers: int) -> tuple[int, ...]:
    """The first ``num_layers`` addresses of a pointer table (one sync for a CUDA table; the route
    built from them is cached while the table lives with these contents)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.uint64):
        raise TypeError(f"{name}: expected an int64 tensor of layer addresses, got {getattr(t, 'dtype', type(t))}")
    check_memory(t, name)
    num_layers = int_arg(num_layers, "num_layers")
    if num_layers < 1:
        raise ValueError(f"num_layers: expected a positive int, got {num_layers}")
    if t.numel() < num_layers:
        raise ValueError(f"{name}: expected {num_layers} layer addresses, got {t.numel()}")
    return tuple(int(x) for x in t[:num_layers].view(torch.int64).tolist())


def table_side(
    bases: list[list[int]],
    slot_bytes: int,
    num_slots: int,
    *,
    is_host: bool,
    page_size: int = 1,
    s_in_page: int = 0,
    s_chunk: int = 0,
) -> Side:
    """A table side: ``bases[kv][layer]`` plus the per-slot strides."""
    return Side(
        is_table=True,
        base=0,
        table=tuple(a for kv in bases for a in kv),
        num_layers=len(bases[0]),
        s_kv=0,
        s_layer=0,
        s_page=slot_bytes,
        s_in_page=s_in_page,
        s_chunk=s_chunk,
        page_size=page_size,
        num_slots=num_slots,
        is_host=is_host,
    )


def on_host(tensors: list[torch.Tensor]) -> bool:
    return not tensors[0].is_cuda


def check_sizes(item_size: int, layout_dim: int | None = None, head_num: int = 1) -> None:
    if not isinstance(item_size, int) or item_size <= 0 or item_size % head_num:
        raise ValueError(f"item_size: expected a positive byte count divisible by head_num {head_num}, got {item_size}")
    if layout_dim is not None and (not isinstance(layout_dim, int) or layout_dim <= 0 or layout_dim % item_size):
        raise ValueError(f"layout_dim: expected a positive multiple of item_size {item_size} bytes, got {layout_dim}")


def lf_side(
    tensors: list[torch.Tensor], names: list[str], item_size: int, num_layers: int, head_bytes: int = 0
) -> Side:
    """One layer-first tensor per kv, used for every layer id (the per-layer functions' device side)."""
    for t, name in zip(tensors, names, strict=True):
        tensor_arg(t, name)
    check_sizes(item_size)
    return table_side(
        [[t.data_ptr()] * num_layers for t in tensors],
        item_size,
        min(nbytes(t) for t in tensors) // item_size,
        is_host=on_host(tensors),
        s_chunk=head_bytes,
    )


def pf_side(tensors: list[torch.Tensor], names: list[str], item_size: int, layout_dim: int) -> Side:
    """Page-first buffers ``[N, L, item]`` per kv: layer ``l`` starts ``l * item_size`` into a slot."""
    for t, name in zip(tensors, names, strict=True):
        tensor_arg(t, name)
    check_sizes(item_size, layout_dim)
    num_layers = layout_dim // item_size
    bases = [[t.data_ptr() + layer * item_size for layer in range(num_layers)] for t in tensors]
    return table_side(bases, layout_dim, min(nbytes(t) for t in tensors) // layout_dim, is_host=on_host(tensors))


def ph_side(
    tensors: list[torch.Tensor], names: list[str], item_size: int, layout_dim: int, page_size: int, head_num: int
) -> Side:
    """Page-head buffers ``[P, H, page, L, D]`` per kv; chunk ``c`` is head ``c``."""
    for t, name in zip(tensors, names, strict=True):
        tensor_arg(t, name)
    check_sizes(item_size, layout_dim, head_num)
    hb = item_size // head_num
    num_layers = layout_dim // item_size
    bases = [[t.data_ptr() + layer * hb for layer in range(num_layers)] for t in tensors]
    return table_side(
        bases,
        page_size * layout_dim,
        min(nbytes(t) for t in tensors) // layout_dim,
        is_host=on_host(tensors),
        page_size=page_size,
        s_in_page=layout_dim // head_num,
        s_chunk=page_size * layout_dim // head_num,
    )


def pointer_tables(tables: list[torch.Tensor], names: list[str], num_layers: int, item_size: int, head_bytes: int = 0):
    """Pointer tables (the ``*_layers`` arguments): their addresses are used as given, as sgl-kernel does."""
    check_sizes(item_size)
    bases = [list(table_values(t, n, num_layers)) for t, n in zip(tables, names, strict=True)]
    return table_side(bases, item_size, NO_BOUND, is_host=False, s_chunk=head_bytes)


def layer_arg(layer_id: Any, num_layers: int, count: int = 1) -> int:
    layer_id = int_arg(layer_id, "layer_id")
    if not 0 <= layer_id <= num_layers - count:
        raise ValueError(
            f"layer_id: expected an int in [0, {num_layers - count + 1}) for {count} layer(s) per K/V, got {layer_id}"
        )
    return layer_id


def side_spans(
    side: Side, tensors: tuple[torch.Tensor, ...], names: Sequence[str], memory: tuple[torch.Tensor, ...], item: int
) -> list[Span | None]:
    """The memory a side is known to touch, for the overlap check: each tensor's bytes when the tensors
    are pool memory; for pointer tables (which carry no sizes), the first ``item`` bytes of every layer
    they name (entry ``kv * L + l`` of ``side.table`` comes from table ``kv``)."""
    if any(t is m for t in tensors for m in memory):
        return [tensor_span(t, n) for t, n in zip(tensors, names, strict=True)]
    L = side.num_layers
    return [(a, a + item, f"{names[j // L]}[{j % L}]") for j, a in enumerate(side.table)]


def arg_names(name: str | Sequence[str], count: int) -> Sequence[str]:
    """The names of a side's tensors: as given, or ``name[i]`` for the items of one list argument."""
    return [f"{name}[{i}]" for i in range(count)] if isinstance(name, str) else name


def make_route(
    src: Side,
    dst: Side,
    src_tensors: tuple[torch.Tensor, ...],
    dst_tensors: tuple[torch.Tensor, ...],
    *,
    names: tuple[str | Sequence[str], str | Sequence[str]],
    layer_begin: int,
    layer_count: int,
    item_size: int,
    head_num: int = 1,
    memory: tuple[torch.Tensor, ...] | None = None,
) -> Route:
    """A route between two sides. ``names``: the argument names of the source and destination tensors
    (a list argument's name for its items). ``memory``: the tensors that are pool memory (default: all
    of them; pointer tables are not), whose CPU ones must be pinned for a zero-copy launch on a GPU.
    Refuses a destination that overlaps a source (:func:`hicache_kernels._validate.check_disjoint`)."""
    check_sizes(item_size, None, head_num)
    tensors = src_tensors + dst_tensors
    gpus = {t.device for t in tensors if t.is_cuda}
    if len(gpus) > 1:
        raise ValueError(f"src_indices: the tensors of one transfer must be on one GPU, got {sorted(map(str, gpus))}")
    device = gpus.pop() if gpus else torch.device("cpu")
    memory = tensors if memory is None else memory
    check_disjoint(
        side_spans(src, src_tensors, arg_names(names[0], len(src_tensors)), memory, item_size),
        side_spans(dst, dst_tensors, arg_names(names[1], len(dst_tensors)), memory, item_size),
    )
    return Route(
        # Backends take the stream and device from the "device side": the destination unless it is host
        # memory, then the source.
        direction="d2h" if dst_tensors[0].device.type == "cpu" else "h2d",
        src=src,
        dst=dst,
        layer_begin=layer_begin,
        layer_count=layer_count,
        num_kv=len(src.table) // src.num_layers,
        num_chunks=head_num,
        chunk_bytes=item_size // head_num,
        item_bytes=item_size,
        page_size=src.page_size,
        device=device,
        gpu_addressable=device.type != "cuda" or all(t.is_pinned() for t in memory if not t.is_cuda),
    )


def cached_route(
    name: str, args: tuple, scalars: tuple, build: Callable[[], Route], tables: int = 0, num_layers: int = 0
) -> Route:
    """``name``'s route for these arguments: built by ``build`` on the first call, then found again by
    the arguments' identity. ``scalars`` are part of the key when they are plain ints (anything else
    is validated by ``build`` on every call); the last ``tables`` of ``args`` are pointer tables, of
    which the route uses the first ``num_layers`` entries: it is found again only while they hold the
    same addresses (read on every call for a CPU table; a CUDA table's in-place version stands for
    them, see :class:`hicache_kernels.identity_cache._Same`)."""
    if not all(type(x) is int for x in scalars):
        return build()
    key = (name, *map(arg_key, args), *scalars)
    route = _routes.get(key, args)
    if route is None:
        route = build()
        _routes.put(key, args, route, (0,) * (len(args) - tables) + (num_layers,) * tables)
    return route


def run_route(
    route: Route,
    src_tensors: tuple[torch.Tensor, ...],
    dst_tensors: tuple[torch.Tensor, ...],
    src_indices: Any,
    dst_indices: Any,
    backend: IOBackend,
    *,
    whole_pages: int | None = None,
) -> None:
    """Check the indices and run on ``backend``. ``whole_pages``: the page size the index count must
    be a multiple of (sgl-kernel's direct functions)."""
    check_indices(src_indices, dst_indices, whole_pages)
    # The kernels read indices at stride 1 (data_ptr): strided views are copied contiguous (CUDA ones on
    # the current stream, where the caller made them).
    src_indices, dst_indices = (t if t.is_contiguous() else t.contiguous() for t in (src_indices, dst_indices))
    why = cpu_pointer_tables_reason(route, backend.name, "the *_layers arguments")
    if why:
        raise BackendUnavailableError(why)
    backend.run(TransferPlan(route, src_indices, dst_indices, None, src_tensors, dst_tensors))


def check_indices(src_indices: Any, dst_indices: Any, whole_pages: int | None) -> None:
    for name, t in (("src_indices", src_indices), ("dst_indices", dst_indices)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise TypeError(f"{name}: expected a 1-D torch.int64 tensor, got {getattr(t, 'dtype', type(t))}")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"dst_indices: expected {src_indices.numel()} indices like src_indices (the two must have the same "
            f"length), got {dst_indices.numel()}"
        )
    if whole_pages is not None and src_indices.numel() % whole_pages:
        raise ValueError(
            f"src_indices: expected whole pages, a multiple of page_size {whole_pages} indices, "
            f"got {src_indices.numel()}"
        )


def page_size_arg(page_size: Any) -> int:
    page_size = int_arg(page_size, "page_size")
    if page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size}")
    return page_size


def tensor_list(tensors: Any, name: str, counts: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    """A non-empty list of contiguous tensors of one dtype (and, with ``counts``, one of those lengths)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name}: expected a list of tensors, got {type(tensors).__name__}")
    if not tensors or (counts is not None and len(tensors) not in counts):
        expected = "at least one" if counts is None else " or ".join(map(str, counts))
        raise ValueError(f"{name}: expected {expected} tensor(s), got {len(tensors)}")
    for i, t in enumerate(tensors):
        tensor_arg(t, f"{name}[{i}]")
        if t.dtype != tensors[0].dtype:
            raise TypeError(f"{name}[{i}]: dtype {t.dtype} differs from {name}[0]'s {tensors[0].dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}]: expected a contiguous tensor (strides {tuple(t.stride())})")
    return list(tensors)


def direct_host(host: list[torch.Tensor], name: str, page_size: int, layer_begin: int, layer_count: int):
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
    side = table_side(bases, L * page * item, P * page, is_host=on_host(host), page_size=page, s_in_page=item)
    return side, L


def direct_device(layers: list[torch.Tensor], name: str, num_kv: int, host: torch.Tensor, host_name: str) -> Side:
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
    return table_side(bases, item, min(t.shape[0] for t in layers), is_host=on_host(layers))
