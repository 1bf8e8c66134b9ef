"""Pool bindings: the device pool, host pool, layout and page size validated once, and everything
that does not change between transfers prepared once.

A :class:`KVBinding` holds, for a pair of pools, their geometry, the device pool's per-layer address
table, the host pool's byte layout and, per (direction, layer range), the
:class:`~hicache_kernels.plan.Route` every io-backend reads; the backends keep with each route what
they derive from it (device tables uploaded once, the host pool's device alias, kernel descriptors
and vector width: :mod:`hicache_kernels.launch`). A transfer then checks only its indices (and, with
``check_indices=True``, their range and repeats: one sync for CUDA indices) and issues one launch.

The functions of :mod:`hicache_kernels.ops` use the same machinery through a cache of bindings keyed
by the pools' identity (:func:`bound_pools`): a call with the same pool objects finds its binding
after O(1) checks (each tensor's ``data_ptr``, shape, strides and dtype; for a pool given as a list of
per-layer tensors, the first layer's metadata and every layer's identity, one C-level pass of about
a microsecond for 61 layers; :mod:`hicache_kernels.identity_cache`). The cache holds no tensor: an
entry goes when any of its pool objects dies.

Binding also checks, once, that the device pool and the host pool share no memory: the kernels read
sources through the non-coherent cache, under which a copy onto its own source is undefined.

Assumptions (not re-checked per call): a pool's tensors are not resized or re-pointed in place
(``set_``, ``resize_``) while bound, except that the ops' cache does notice it for a stacked tensor,
the host pool and a list pool's first layer; and the layers of a list pool are not changed in place
behind a :class:`KVBinding` (the ops' cache does notice a list whose layers differ).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import layouts
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
from .backends import IOBackend, _stream, get_backend
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


# ------------------------------------------------------------------------------------------------------
# Public binding
# ------------------------------------------------------------------------------------------------------
class KVBinding:
    """A device pool and a host pool bound once: validated here, then every transfer checks only its
    indices and issues one launch.

    Parameters
    ----------
    device_k, device_v : the layer-first device pool, a stacked ``[L, N_dev, H, D]`` tensor or a list
        of ``L`` ``[N_dev, H, D]`` tensors (contiguous); ``device_v=None`` for MLA (``device_k`` is then
        ``[L, N_dev, 1, kv_dim]``).
    host : the host pool in ``layout`` (:func:`hicache_kernels.layouts.host_shape`), same dtype;
        pinned for the zero-copy backends when the device pool is on a GPU.
    layout : ``"layer_first"``, ``"page_first"``, ``"page_first_direct"`` or ``"page_head"`` (MHA only).
    page_size : tokens per page (int or numpy integer >= 1); ``N_host`` must be a multiple of it.

    The binding keeps its pools alive. Their tensors must not be resized or re-pointed in place
    (``set_``, ``resize_``) while bound, nor a list pool's layers replaced: bind again instead.
    Raises ``TypeError``/``ValueError`` naming the argument, as the :mod:`hicache_kernels.ops`
    functions do; ``ValueError`` naming both for a device pool and a host pool that share memory.

    Examples
    --------
    >>> import torch
    >>> from hicache_kernels import KVBinding
    >>> k, v = torch.randn(2, 32, 4, 8), torch.randn(2, 32, 4, 8)
    >>> host = torch.zeros(2, 16, 2, 4, 8)  # page_first: [2, N_host, L, H, D]
    >>> pools = KVBinding(k, v, host, layout="page_first", page_size=1)
    >>> pools.backup(torch.tensor([3, 4]), torch.tensor([0, 1]), backend="direct")
    >>> torch.equal(host[1, :2], v[:, [3, 4]].transpose(0, 1))
    True
    >>> loads = pools.layer_loads(torch.tensor([9, 10]), torch.tensor([0, 1]), backend="direct")
    >>> for layer in range(pools.num_layers):
    ...     loads(layer)  # issues that layer's copy only
    >>> torch.equal(k[1, 9], k[1, 3])
    True
    """

    def __init__(self, device_k: DevicePool, device_v: DevicePool | None, host: torch.Tensor, *, layout: str,
                 page_size: int) -> None:  # fmt: skip
        self._pools = BoundPools(device_k, device_v, host, layout, page_size)
        self.device_k, self.device_v, self.host = device_k, device_v, host
        self._device_tensors = pool_tensors(device_k, device_v)
        self._host_tensors = (host,)

    def __repr__(self) -> str:
        p = self._pools
        kind = "MLA" if p.mla else "MHA"
        return (
            f"KVBinding({kind}, L={p.num_layers}, N_dev={p.device_slots}, N_host={p.host_slots}, H={p.head_num}, "
            f"D={p.head_dim}, {p.dtype}, {p.device}, layout={p.layout!r}, page_size={p.page_size})"
        )

    layout = property(lambda self: self._pools.layout)
    page_size = property(lambda self: self._pools.page_size)
    mla = property(lambda self: self._pools.mla)
    num_layers = property(lambda self: self._pools.num_layers)
    device_slots = property(lambda self: self._pools.device_slots)
    host_slots = property(lambda self: self._pools.host_slots)
    dtype = property(lambda self: self._pools.dtype)
    device = property(lambda self: self._pools.device)

    def plan(
        self,
        direction: str,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        *,
        layer_id: int | None = None,
        check_indices: bool = True,
        stream: Any = None,
    ) -> TransferPlan:
        """The :class:`~hicache_kernels.plan.TransferPlan` of one transfer (what
        :func:`hicache_kernels.ops.build_plan` returns), for ``backend.prepare(plan)``."""
        check_direction(direction)
        return self._pools.plan(direction, device_indices, host_indices, layer_id, check_indices, stream,
                                self._device_tensors, self._host_tensors)  # fmt: skip

    def transfer(
        self,
        direction: str,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        *,
        layer_id: int | None = None,
        backend: str | IOBackend = "auto",
        stream: Any = None,
        check_indices: bool = True,
    ) -> None:
        """:func:`hicache_kernels.ops.transfer` on the bound pools (``layer_id`` None: every layer)."""
        if not isinstance(backend, (str, IOBackend)):
            raise TypeError(f"backend: expected a backend name (str) or an IOBackend, got {type(backend).__name__}")
        if torch.compiler.is_compiling():  # the registered custom ops make the writes visible to the compiler
            from . import ops

            p = self._pools
            ops.transfer(direction, self.device_k, self.device_v, self.host, device_indices, host_indices,
                         layout=p.layout, page_size=p.page_size, layer_id=layer_id, backend=backend, stream=stream,
                         check_indices=check_indices)  # fmt: skip
            return
        get_backend(backend).run(self.plan(direction, device_indices, host_indices, layer_id=layer_id,
                                           check_indices=check_indices, stream=stream))  # fmt: skip

    def backup(
        self,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        *,
        layer_id: int | None = None,
        backend: str | IOBackend = "auto",
        stream: Any = None,
        check_indices: bool = True,
    ) -> None:
        """Device slots to host slots: layer ``layer_id``, or every layer (None). Arguments as
        :func:`hicache_kernels.ops.backup_layer`."""
        self.transfer("d2h", device_indices, host_indices, layer_id=layer_id, backend=backend, stream=stream,
                      check_indices=check_indices)  # fmt: skip

    def load(
        self,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        *,
        layer_id: int | None = None,
        backend: str | IOBackend = "auto",
        stream: Any = None,
        check_indices: bool = True,
    ) -> None:
        """Host slots to device slots: layer ``layer_id``, or every layer (None)."""
        self.transfer("h2d", device_indices, host_indices, layer_id=layer_id, backend=backend, stream=stream,
                      check_indices=check_indices)  # fmt: skip

    def layer_loads(
        self,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        *,
        backend: str | IOBackend = "auto",
        stream: Any = None,
        check_indices: bool = True,
    ) -> LayerLoads:
        """A layer-wise load of one batch of slots (:class:`LayerLoads`): the indices are checked and
        moved where the backend reads them once, here; ``loads(layer_id)`` then issues that layer."""
        return LayerLoads(self, device_indices, host_indices, backend, stream, check_indices)


class LayerLoads:
    """Loads of one set of slot pairs, issued layer by layer (``loads(layer_id)``), for a controller
    that lets the model start on layer ``l`` while later layers are still in flight.

    Made by :meth:`KVBinding.layer_loads`, which does the per-batch work once: index checks (one sync
    for CUDA indices when ``check_indices``), and the move of the indices to where the backend reads
    them (to the GPU for ``kernel``/``triton``, on the launch stream; to the host for the copy
    engines). Each layer's copy is prepared by its first call (route, descriptors: nothing is
    re-validated) and issued; calling a layer again issues it again. Everything goes to ``stream``,
    or the stream current on the pool's device when the loads were made.
    """

    def __init__(self, binding: KVBinding, device_indices: Any, host_indices: Any, backend: Any, stream: Any,
                 check_indices: bool) -> None:  # fmt: skip
        if not isinstance(backend, (str, IOBackend)):
            raise TypeError(f"backend: expected a backend name (str) or an IOBackend, got {type(backend).__name__}")
        whole = binding.plan("h2d", device_indices, host_indices, check_indices=check_indices, stream=stream)
        self.backend = get_backend(backend)
        route = whole.route
        if route.on_cuda:
            stream = whole.stream = _stream(whole)  # checked to be on the pool's device; fixed for every layer
        h_idx, d_idx = whole.src_indices, whole.dst_indices
        if self.backend.wants_host_indices(whole):
            h_idx, d_idx = h_idx.cpu(), d_idx.cpu()  # one sync for CUDA indices, instead of one per layer
        elif route.on_cuda:
            with torch.cuda.stream(stream):  # ordered before every launch on that stream
                h_idx, d_idx = (t.to(route.device, non_blocking=True) for t in (h_idx, d_idx))
        self._pools = binding._pools
        self.binding, self.stream = binding, stream
        self.device_indices, self.host_indices = d_idx, h_idx  # where the backend reads them
        self._args = (h_idx, d_idx, stream, whole.src_tensors, whole.dst_tensors)
        self._issues: list[Callable[[], None] | None] = [None] * binding.num_layers

    def __len__(self) -> int:
        return len(self._issues)

    def __call__(self, layer_id: int) -> None:
        """Issue layer ``layer_id``'s load (asynchronous on a GPU)."""
        issue = self._issues[layer_id] if type(layer_id) is int and 0 <= layer_id < len(self._issues) else None
        if issue is None:
            layer_id = int_arg(layer_id, "layer_id")
            route = self._pools.route("h2d", layer_id)
            issue = self._issues[layer_id] = self.backend.prepare(TransferPlan(route, *self._args))
        issue()
