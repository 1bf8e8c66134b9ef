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
  is responsible for the indices.
- A destination that shares memory with a source (one tensor on both sides, overlapping views of one
  buffer, a pointer table naming a layer on both sides or inside a destination tensor) raises
  ``ValueError`` naming both arguments, before anything is written: the kernels read sources through
  the non-coherent cache (``ld.global.nc``), under which such a copy is undefined. Disjoint views of
  one buffer are fine.
- Pointer tables are read back to the host when a call's route is built (one sync for a CUDA table),
  and the route serves later calls while the table holds the same addresses. A CPU table's entries
  are compared on every call, so any rewrite is followed (numpy, DLPack, ``.data``). A CUDA table's
  are not (that would synchronise the host with the stream on every call): its in-place version
  stands for them, which torch's in-place ops bump but a kernel or a DLPack alias writing the table
  does not; after such a rewrite call ``torch.autograd.graph.increment_version(table)``.
- A bad argument raises :class:`ArgumentError` (a ``ValueError``) or :class:`ArgumentTypeError` (a
  ``TypeError``) naming it, before anything is written. Both are ``RuntimeError`` too, which is what
  sgl-kernel's ``TORCH_CHECK`` raises, so code written against sgl-kernel
  (``pytest.raises(RuntimeError, match="same length")``) catches them unchanged.
- ``transfer_kv_all_layer_direct_lf_pf`` / ``transfer_kv_per_layer_direct_pf_lf`` (``page_first_direct``
  host buffers ``[P, L, page, H, D]`` per K/V) move each index pair's token slot, so whole-page index
  groups (what sgl-kernel requires: it reads only the first index of each page) give sgl-kernel's
  result, and any other grouping is still copied slot by slot rather than by the page it starts.

The backend defaults to ``kernel``; :func:`use_backend` selects another (``triton`` runs the same
transfers on CPU tensors under the Triton interpreter, which is how they are tested without a GPU).
The ``*_direct*`` functions (:mod:`hicache_kernels.compat._direct`) always use the ``direct``
(copy-engine) backend, as in sgl-kernel.

On CPU tensors, the functions taking pointer tables (``*_layers`` arguments:
``transfer_kv_all_layer``, ``transfer_kv_all_layer_lf_pf``, ``transfer_kv_all_layer_lf_ph`` and their
``_mla`` variants) run only on the ``triton`` backend: the other backends copy CPU memory through views
of the transfer's tensors, and a pointer table names none. They raise ``BackendUnavailableError``
there, before touching memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .._validate import int_arg
from ..backends import IOBackend, KernelBackend, get_backend
from ..launch import device_alias
from ..plan import Route
from ._direct import (  # wrapped and exported below (_FUNCTIONS)
    transfer_embedding_ranges_direct,  # noqa: F401
    transfer_kv_all_layer_direct_lf_pf,  # noqa: F401
    transfer_kv_direct,  # noqa: F401
    transfer_kv_per_layer_direct_pf_lf,  # noqa: F401
)
from ._routes import (
    cached_route,
    layer_arg,
    lf_side,
    make_route,
    page_size_arg,
    pf_side,
    ph_side,
    pointer_tables,
    run_route,
)

_F = TypeVar("_F", bound=Callable[..., Any])


class ArgumentError(ValueError, RuntimeError):
    """A bad argument to a compat function: a ``ValueError`` naming it, and a ``RuntimeError`` as
    sgl-kernel's ``TORCH_CHECK`` failures are."""


class ArgumentTypeError(TypeError, RuntimeError):
    """An argument of the wrong type to a compat function: a ``TypeError`` naming it, and a
    ``RuntimeError`` as sgl-kernel's ``TORCH_CHECK`` failures are."""


def _torch_check_errors(fn: _F) -> _F:
    """Re-raise ``fn``'s ValueError / TypeError (which are raised before anything is written) as
    :class:`ArgumentError` / :class:`ArgumentTypeError`, message unchanged."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError:
            raise
        except ValueError as e:
            raise ArgumentError(str(e)) from e
        except TypeError as e:
            raise ArgumentTypeError(str(e)) from e

    return wrapper  # type: ignore[return-value]


_backend_name = "kernel"
_kernel_backends: dict[tuple[int, int], KernelBackend] = {}


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
    backend = _kernel_backends.get(key)
    if backend is None:
        backend = _kernel_backends[key] = KernelBackend(num_blocks=block_quota, warps_per_block=num_warps_per_block)
    return backend


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
    src, dst = (src_k, src_v), (dst_k, dst_v)

    def build() -> Route:
        return make_route(
            lf_side(list(src), ["src_k", "src_v"], item_size, 1),
            lf_side(list(dst), ["dst_k", "dst_v"], item_size, 1),
            src,
            dst,
            names=(["src_k", "src_v"], ["dst_k", "dst_v"]),
            layer_begin=0,
            layer_count=1,
            item_size=item_size,
        )

    route = cached_route("per_layer", (*src, *dst), (item_size,), build)
    run_route(route, src, dst, src_indices, dst_indices, _backend(block_quota, num_warps_per_block))


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
    src, dst = (src_k, src_v), (dst_k, dst_v)

    def build() -> Route:
        side = pf_side(list(src), ["src_k", "src_v"], item_size, src_layout_dim)
        layer = layer_arg(layer_id, side.num_layers)
        return make_route(
            side,
            lf_side(list(dst), ["dst_k", "dst_v"], item_size, side.num_layers),
            src,
            dst,
            names=(["src_k", "src_v"], ["dst_k", "dst_v"]),
            layer_begin=layer,
            layer_count=1,
            item_size=item_size,
        )

    route = cached_route("per_layer_pf_lf", (*src, *dst), (layer_id, item_size, src_layout_dim), build)
    run_route(route, src, dst, src_indices, dst_indices, _backend(block_quota, num_warps_per_block))


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
    src, dst = (src_k, src_v), (dst_k, dst_v)

    def build() -> Route:
        side = ph_side(list(src), ["src_k", "src_v"], item_size, src_layout_dim, page_size_arg(page_size), head_num)
        lf = lf_side(list(dst), ["dst_k", "dst_v"], item_size, side.num_layers, item_size // head_num)
        return make_route(
            side,
            lf,
            src,
            dst,
            names=(["src_k", "src_v"], ["dst_k", "dst_v"]),
            layer_begin=layer_arg(layer_id, side.num_layers),
            layer_count=1,
            item_size=item_size,
            head_num=head_num,
        )

    scalars = (layer_id, item_size, src_layout_dim, page_size, head_num)
    route = cached_route("per_layer_ph_lf", (*src, *dst), scalars, build)
    run_route(route, src, dst, src_indices, dst_indices, _backend(block_quota, num_warps_per_block))


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
    src, dst = (src_k_layers, src_v_layers), (dst_k_layers, dst_v_layers)

    def build() -> Route:
        return make_route(
            pointer_tables(list(src), ["src_k_layers", "src_v_layers"], num_layers, item_size),
            pointer_tables(list(dst), ["dst_k_layers", "dst_v_layers"], num_layers, item_size),
            src,
            dst,
            names=(["src_k_layers", "src_v_layers"], ["dst_k_layers", "dst_v_layers"]),
            layer_begin=0,
            layer_count=num_layers,
            item_size=item_size,
            memory=(),
        )

    route = cached_route("all_layer", (*src, *dst), (item_size, num_layers), build, tables=4, num_layers=num_layers)
    run_route(route, src, dst, src_indices, dst_indices, _backend(block_quota, num_warps_per_block))


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
    src, dst = (src_k_layers, src_v_layers), (dst_k, dst_v)

    def build() -> Route:
        return make_route(
            pointer_tables(list(src), ["src_k_layers", "src_v_layers"], num_layers, item_size),
            pf_side(list(dst), ["dst_k", "dst_v"], item_size, dst_layout_dim),
            src,
            dst,
            names=(["src_k_layers", "src_v_layers"], ["dst_k", "dst_v"]),
            layer_begin=0,
            layer_count=num_layers,
            item_size=item_size,
            memory=dst,
        )

    scalars = (item_size, dst_layout_dim, num_layers)
    route = cached_route("all_layer_lf_pf", (*dst, *src), scalars, build, tables=2, num_layers=num_layers)
    run_route(route, src, dst, src_indices, dst_indices, _backend(block_quota, num_warps_per_block))


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
    src, dst = (src_k_layers, src_v_layers), (dst_k, dst_v)

    def build() -> Route:
        ph = ph_side(list(dst), ["dst_k", "dst_v"], item_size, dst_layout_dim, page_size_arg(page_size), head_num)
        tables = pointer_tables(
            list(src), ["src_k_layers", "src_v_layers"], num_layers, item_size, item_size // head_num
        )
        return make_route(
            tables,
            ph,
            src,
            dst,
            names=(["src_k_layers", "src_v_layers"], ["dst_k", "dst_v"]),
            layer_begin=0,
            layer_count=num_layers,
            item_size=item_size,
            head_num=head_num,
            memory=dst,
        )

    scalars = (item_size, dst_layout_dim, num_layers, page_size, head_num)
    route = cached_route("all_layer_lf_ph", (*dst, *src), scalars, build, tables=2, num_layers=num_layers)
    run_route(route, src, dst, src_indices, dst_indices, _backend(block_quota, num_warps_per_block))


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

    def build() -> Route:
        return make_route(
            lf_side([src], ["src"], item_size, 1),
            lf_side([dst], ["dst"], item_size, 1),
            (src,),
            (dst,),
            names=(["src"], ["dst"]),
            layer_begin=0,
            layer_count=1,
            item_size=item_size,
        )

    route = cached_route("per_layer_mla", (src, dst), (item_size,), build)
    run_route(route, (src,), (dst,), src_indices, dst_indices, _backend(block_quota, num_warps_per_block))


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

    def build() -> Route:
        side = pf_side([src], ["src"], item_size, src_layout_dim)
        layer = layer_arg(layer_id, side.num_layers)
        return make_route(
            side,
            lf_side([dst], ["dst"], item_size, side.num_layers),
            (src,),
            (dst,),
            names=(["src"], ["dst"]),
            layer_begin=layer,
            layer_count=1,
            item_size=item_size,
        )

    route = cached_route("per_layer_mla_pf_lf", (src, dst), (layer_id, item_size, src_layout_dim), build)
    run_route(route, (src,), (dst,), src_indices, dst_indices, _backend(block_quota, num_warps_per_block))


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

    def build() -> Route:
        return make_route(
            pointer_tables([src_layers], ["src_layers"], num_layers, item_size),
            pointer_tables([dst_layers], ["dst_layers"], num_layers, item_size),
            (src_layers,),
            (dst_layers,),
            names=(["src_layers"], ["dst_layers"]),
            layer_begin=0,
            layer_count=num_layers,
            item_size=item_size,
            memory=(),
        )

    scalars = (item_size, num_layers)
    route = cached_route("all_layer_mla", (src_layers, dst_layers), scalars, build, tables=2, num_layers=num_layers)
    backend = _backend(block_quota, num_warps_per_block)
    run_route(route, (src_layers,), (dst_layers,), src_indices, dst_indices, backend)


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

    def build() -> Route:
        return make_route(
            pointer_tables([src_layers], ["src_layers"], num_layers, item_size),
            pf_side([dst], ["dst"], item_size, dst_layout_dim),
            (src_layers,),
            (dst,),
            names=(["src_layers"], ["dst"]),
            layer_begin=0,
            layer_count=num_layers,
            item_size=item_size,
            memory=(dst,),
        )

    scalars = (item_size, dst_layout_dim, num_layers)
    route = cached_route("all_layer_mla_lf_pf", (dst, src_layers), scalars, build, tables=1, num_layers=num_layers)
    backend = _backend(block_quota, num_warps_per_block)
    run_route(route, (src_layers,), (dst,), src_indices, dst_indices, backend)


def get_device_accessible_ptr(tensor: torch.Tensor, device_index: int = 0) -> int:
    """The address a kernel on GPU ``device_index`` reads ``tensor``'s memory at (SGLang builds its
    host pools' pointer tables with it): a CUDA tensor's own address; for host memory (pinned, or
    registered with ``cudaHostRegister``) the device alias the CUDA runtime gives, which equals the host
    address under UVA. Without a CUDA driver, the host address (what this package's CPU paths read, and
    what SGLang uses when sgl-kernel lacks this function)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    device_index = int_arg(device_index, "device_index")
    if device_index < 0:
        raise ValueError(f"device_index: expected a GPU index >= 0, got {device_index}")
    if tensor.is_cuda:
        return int(tensor.data_ptr())
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor: expected CPU or CUDA memory, got a {tensor.device.type} tensor")
    return device_alias(int(tensor.data_ptr()))


def transfer_kv_mamba_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    num_warps_per_item: int = 32,
) -> None:
    """SGLang's Mamba state load (``sglang.kernels.ops.mamba.transfer_mamba``): one layer's state
    slots from a page-first host buffer ``[slots, L, ...]`` (``src_layout_dim = L * item_size`` bytes
    between slots) into the device layer ``[slots, ...]``, ``item_size`` bytes a slot. The same bytes
    as :func:`transfer_kv_per_layer_mla_pf_lf`; ``num_warps_per_item`` is accepted for SGLang's
    signature (this package sizes its own grid)."""
    int_arg(num_warps_per_item, "num_warps_per_item")
    transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim)


def transfer_kv_mamba_lf_pf(
    src_ptrs: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    num_warps_per_item: int = 32,
) -> None:
    """SGLang's Mamba state backup: every layer's state slots, from the device layers named by the
    pointer table ``src_ptrs`` (``num_layers`` addresses), into a page-first host buffer
    ``[slots, L, ...]``. The same bytes as :func:`transfer_kv_all_layer_mla_lf_pf`."""
    int_arg(num_warps_per_item, "num_warps_per_item")
    transfer_kv_all_layer_mla_lf_pf(src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers)


#: The functions: each raises ArgumentError / ArgumentTypeError for a bad argument (_torch_check_errors).
_FUNCTIONS = (
    "get_device_accessible_ptr",
    "transfer_embedding_ranges_direct",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_mamba_lf_pf",
    "transfer_kv_mamba_pf_lf",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "use_backend",
)
for _name in _FUNCTIONS:
    globals()[_name] = _torch_check_errors(globals()[_name])
del _name

__all__: list[Any] = ["ArgumentError", "ArgumentTypeError", *_FUNCTIONS]
