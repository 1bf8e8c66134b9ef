"""Bound pools: a device pool, host pool, layout and page size validated once (:class:`BoundPools`),
with the :class:`~hicache_kernels.plan.Route` of each (direction, layer range) built on first use, and
the ops' cache of them keyed by the pools' identity (:func:`bound_pools`): a call with the same pool
objects finds its binding after O(1) checks (each tensor's ``data_ptr``, shape, strides and dtype; for
a pool given as a list of per-layer tensors, the first layer's metadata and every layer's identity;
:mod:`hicache_kernels.identity_cache`). The cache holds no tensor: an entry goes when any of its pool
objects dies. Binding also checks, once, that the device pool and the host pool share no memory.

Below :mod:`hicache_kernels.binding` (the public :class:`~hicache_kernels.binding.KVBinding`), the
registered custom ops and :mod:`hicache_kernels.ops`, which all use it.
"""

from __future__ import annotations

from typing import Any

import torch

from . import launch, layouts
from ._validate import (
    DevicePool,
    check_disjoint,
    device_pool,
    host_pool,
    index_tensor,
    index_values,
    int_arg,
    layout_arg,
    page_size_arg,
    pool_spans,
    tensor_span,
)
from .identity_cache import IdentityCache, arg_key
from .plan import Route, Side, TransferPlan


def check_direction(direction: Any) -> str:
    if direction != "d2h" and direction != "h2d":
        raise ValueError(f"direction: expected 'd2h' or 'h2d', got {direction!r}")
    return direction


def pool_tensors(device_k: DevicePool, device_v: DevicePool | None) -> tuple[torch.Tensor, ...]:
    """The tensors holding a device pool's memory: the stacked tensors, or every layer of the lists."""
    k = (device_k,) if isinstance(device_k, torch.Tensor) else tuple(device_k)
    if device_v is None:
        return k
    return k + ((device_v,) if isinstance(device_v, torch.Tensor) else tuple(device_v))


class BoundPools:
    """The validated facts of a pool pair, without the pools themselves (so a cache of these keeps no
    memory alive): geometry, sides, and routes built on first use. Plans take the call's tensors."""

    def __init__(self, device_k: Any, device_v: Any, host: Any, layout: Any, page_size: Any) -> None:
        page_size = page_size_arg(page_size)
        layout = layout_arg(layout)
        mla = device_v is None
        layouts.check_layout(layout, mla)
        k = device_pool(device_k, "device_k")
        if not mla:
            v = device_pool(device_v, "device_v")
            if v.num_layers != k.num_layers:
                raise ValueError(f"device_v: expected {k.num_layers} layers like device_k, got {v.num_layers}")
            k_layer, v_layer = (k.num_slots, k.head_num, k.head_dim), (v.num_slots, v.head_num, v.head_dim)
            if v_layer != k_layer or v.dtype != k.dtype or v.device != k.device:
                raise ValueError(
                    f"device_v: expected layers like device_k's {k_layer} {k.dtype} on {k.device}, "
                    f"got {v_layer} {v.dtype} on {v.device}"
                )
            addresses = k.addresses + v.addresses
        else:
            if k.head_num != 1:
                raise ValueError(
                    "device_k: an MLA pool (device_v=None) has one latent head, expected [N, 1, kv_dim], "
                    f"got H={k.head_num}"
                )
            addresses = k.addresses
        L, H, D = k.num_layers, k.head_num, k.head_dim
        n_host = host_pool(host, k.dtype, layout, mla, L, page_size, H, D)
        # Bound once, so checked once: the device pool and the host pool must not share memory.
        check_disjoint(pool_spans(k, "device_k") + ([] if mla else pool_spans(v, "device_v")),
                       [tensor_span(host, "host")])  # fmt: skip
        geom = layouts.host_geometry(
            layout, mla=mla, num_layers=L, num_slots=n_host, page_size=page_size, head_num=H, head_dim=D,
            elem_bytes=k.dtype.itemsize,
        )  # fmt: skip
        self.layout, self.page_size, self.mla = layout, page_size, mla
        self.num_kv = 1 if mla else 2
        self.num_layers, self.device_slots, self.host_slots = L, k.num_slots, n_host
        self.head_num, self.head_dim, self.dtype, self.device = H, D, k.dtype, k.device
        self.geometry = geom
        # Zero-copy backends need a pinned host pool when the device pool is on a GPU: asked once here.
        self.gpu_addressable = k.device.type != "cuda" or host.is_pinned()
        self.device_side = Side(
            is_table=True, base=0, table=addresses, num_layers=L, s_kv=0, s_layer=0, s_page=geom.item_bytes,
            s_in_page=0, s_chunk=geom.chunk_bytes if geom.num_chunks > 1 else 0, page_size=1,
            num_slots=k.num_slots,
        )  # fmt: skip
        self.host_side = Side(
            is_table=False, base=host.data_ptr(), table=(), num_layers=L, s_kv=geom.s_kv, s_layer=geom.s_layer,
            s_page=geom.s_page, s_in_page=geom.s_in_page, s_chunk=geom.s_chunk, page_size=geom.page_size,
            num_slots=n_host, is_host=True,
        )  # fmt: skip
        self._routes: dict[tuple[str, int | None], Route] = {}

    def route(self, direction: str, layer_id: int | None) -> Route:
        """The route of ``direction`` over layer ``layer_id`` (None: every layer), built once.
        ``layer_id`` must be an int (or None) already: bool/numpy values are converted by the caller."""
        route = self._routes.get((direction, layer_id))
        if route is not None:
            return route
        check_direction(direction)
        L = self.num_layers
        if layer_id is not None and not 0 <= layer_id < L:
            raise ValueError(f"layer_id: expected an int in [0, {L}), got {layer_id!r}")
        d2h = direction == "d2h"
        geom = self.geometry
        route = Route(
            direction=direction,
            src=self.device_side if d2h else self.host_side,
            dst=self.host_side if d2h else self.device_side,
            layer_begin=0 if layer_id is None else layer_id,
            layer_count=L if layer_id is None else 1,
            num_kv=self.num_kv,
            num_chunks=geom.num_chunks,
            chunk_bytes=geom.chunk_bytes,
            item_bytes=geom.item_bytes,
            page_size=self.page_size,
            device=self.device,
            gpu_addressable=self.gpu_addressable,
        )
        self._routes[(direction, layer_id)] = route
        return route

    def plan(
        self,
        direction: str,
        device_indices: Any,
        host_indices: Any,
        layer_id: Any,
        check_indices: bool,
        stream: Any,
        device_tensors: tuple[torch.Tensor, ...],
        host_tensors: tuple[torch.Tensor, ...],
    ) -> TransferPlan:
        """One call's plan: its indices checked (types, devices, lengths; range and repeats when
        ``check_indices``), nothing else derived."""
        if layer_id is not None and type(layer_id) is not int:
            layer_id = int_arg(layer_id, "layer_id")
        route = self._routes.get((direction, layer_id)) or self.route(direction, layer_id)
        device = self.device
        d_idx = index_tensor(device_indices, "device_indices", device)
        h_idx = index_tensor(host_indices, "host_indices", device)
        if d_idx.numel() != h_idx.numel():
            raise ValueError(
                f"host_indices: expected as many indices as device_indices ({d_idx.numel()}), got {h_idx.numel()}"
            )
        if check_indices:
            index_values(direction, d_idx, self.device_slots, h_idx, self.host_slots)
        if stream is not None and (d_idx.is_cuda or h_idx.is_cuda):  # caller-made CUDA indices, another stream
            launch.follow_caller(stream, device, (d_idx, h_idx))
        if direction == "d2h":
            return TransferPlan(route, d_idx, h_idx, stream, device_tensors, host_tensors)
        return TransferPlan(route, h_idx, d_idx, stream, host_tensors, device_tensors)


# ------------------------------------------------------------------------------------------------------
# The ops' cache of bindings
# ------------------------------------------------------------------------------------------------------
_pools_cache = IdentityCache()


def bound_pools(device_k: Any, device_v: Any, host: Any, layout: Any, page_size: Any) -> BoundPools:
    """The :class:`BoundPools` of these pool objects, validated on first use and cached while they
    all live. Raises ``TypeError``/``ValueError`` naming the argument for invalid pools."""
    if type(layout) is not str:
        layout = layout_arg(layout)
    if type(page_size) is not int:
        page_size = int_arg(page_size, "page_size")  # before the lookup: True must not find page_size 1
    key = (arg_key(device_k), arg_key(device_v), arg_key(host), layout, page_size)
    args = (device_k, device_v, host)
    pools = _pools_cache.get(key, args)
    if pools is None:
        pools = BoundPools(device_k, device_v, host, layout, page_size)
        _pools_cache.put(key, args, pools)
    return pools


def cached_bindings() -> int:
    """How many pool pairs the ops' cache holds (each goes when one of its pool objects dies)."""
    return len(_pools_cache)
