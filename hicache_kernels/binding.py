"""Pool bindings: the device pool, host pool, layout and page size validated once, and everything
that does not change between transfers prepared once.

A :class:`KVBinding` holds, for a pair of pools, their geometry, the device pool's per-layer address
table, the host pool's byte layout and, per (direction, layer range), the
:class:`~hicache_kernels.plan.Route` every io-backend reads; the backends keep with each route what
they derive from it (device tables uploaded once, the host pool's device alias, kernel descriptors
and vector width: :mod:`hicache_kernels.launch`). A transfer then checks only its indices (and, with
``check_indices=True``, their range and repeats: one sync for CUDA indices) and issues one launch.
A caller that issues one batch in parts (a cache controller loading layer by layer) prepares it once
(:meth:`KVBinding.batch_plan`) and runs each layer's part (:meth:`KVBinding.layer_plan`).

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

from typing import Any

import torch

from . import _custom_ops
from ._validate import DevicePool, int_arg
from .backends import IOBackend, get_backend
from .backends.base import device_indices as indices_on_device
from .backends.base import plan_stream
from .bound_pools import BoundPools, bound_pools, cached_bindings, check_direction, pool_tensors
from .plan import TransferPlan

__all__ = ["BoundPools", "KVBinding", "bound_pools", "cached_bindings", "check_direction", "pool_tensors"]


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
    >>> from hicache_kernels.backends import get_backend
    >>> direct = get_backend("direct")
    >>> batch = pools.batch_plan("h2d", torch.tensor([9, 10]), torch.tensor([0, 1]), backend=direct)
    >>> for layer in range(pools.num_layers):
    ...     direct.run(pools.layer_plan(batch, layer))  # that layer's copy only
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
            p = self._pools
            _custom_ops.call(direction, self.device_k, self.device_v, self.host, device_indices, host_indices,
                             layout=p.layout, page_size=p.page_size, layer_id=layer_id, backend=backend,
                             stream=stream, check_indices=check_indices)  # fmt: skip
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

    def warm(self, backend: str | IOBackend = "auto", *, stream: Any = None) -> int:
        """Compile (``triton``) or load (``kernel``: CUDA loads a kernel's module at its first launch)
        now what this binding's transfers will launch, so the first backup, load-back or layer load of
        a serving process does not stall on it. One launch per direction over every layer and over one
        layer, each of one index pair outside both pools (int64, as every transfer's indices), which
        those kernels skip: nothing is read or written. Backends with nothing to compile or load
        (``direct``, ``batch``, ``staged``; ``auto`` where it picks them) launch nothing. Asynchronous
        like a transfer, on ``stream``. Returns the launches made."""
        if not isinstance(backend, (str, IOBackend)):
            raise TypeError(f"backend: expected a backend name (str) or an IOBackend, got {type(backend).__name__}")
        be = get_backend(backend)
        outside = torch.tensor([-1], dtype=torch.int64)
        launched = 0
        for direction in ("d2h", "h2d"):
            for layer_id in (None, 0):
                plan = self.plan(direction, outside, outside, layer_id=layer_id, check_indices=False, stream=stream)
                launched += bool(be.warm(plan))
        return launched

    def batch_plan(
        self,
        direction: str,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        *,
        backend: str | IOBackend = "auto",
        stream: Any = None,
        check_indices: bool = True,
    ) -> TransferPlan:
        """The plan of one batch of slot pairs over every layer, made ready to be issued in parts
        (:meth:`layer_plan`): the per-batch work is done here, once.

        Parameters
        ----------
        direction : ``"d2h"`` (backup) or ``"h2d"`` (load).
        device_indices, host_indices : the batch's slot pairs, as for :meth:`transfer`.
        backend : the backend that will run the plan's parts (a name or an :class:`IOBackend`): it
            decides where the indices go.
        stream : the stream the parts go to; None: on a GPU, the current stream of the pool's device
            now (fixed for every part).
        check_indices : check the indices' range and repeats (one sync for CUDA indices).

        Returns
        -------
        TransferPlan
            Over every layer, with its indices where ``backend`` reads them (on the host for the copy
            engines: one copy of CUDA indices instead of one per part; otherwise on the pool's device,
            uploaded on the plan's stream, so ordered before every launch on it) and, on a GPU, its
            stream fixed and checked to be on the pool's device.

        Raises
        ------
        TypeError, ValueError, IndexError
            As :meth:`transfer` for the indices, ``backend`` and ``stream``; nothing is issued then.
        """
        if not isinstance(backend, (str, IOBackend)):
            raise TypeError(f"backend: expected a backend name (str) or an IOBackend, got {type(backend).__name__}")
        batch = self.plan(direction, device_indices, host_indices, check_indices=check_indices, stream=stream)
        route = batch.route
        if route.on_cuda:
            batch.stream = plan_stream(batch)  # checked to be on the pool's device; fixed for every part
        src, dst = batch.src_indices, batch.dst_indices
        if get_backend(backend).wants_host_indices(batch):
            batch.src_indices, batch.dst_indices = src.cpu(), dst.cpu()
        elif route.on_cuda:  # on that stream: ordered before every launch on it (host ones via the upload ring)
            batch.src_indices, batch.dst_indices = indices_on_device(batch, route.device, batch.stream)
        return batch

    def layer_plan(self, plan: TransferPlan, layer_id: int) -> TransferPlan:
        """Layer ``layer_id`` of ``plan``, a plan of these pools over every layer (:meth:`batch_plan`,
        :meth:`plan`): the same indices, stream and tensors, on that layer's route (built once per
        binding). Nothing is re-checked: ``backend.prepare`` of the result issues that layer only.

        Raises
        ------
        TypeError
            ``layer_id`` is not an integer.
        ValueError
            ``layer_id`` is outside ``[0, num_layers)``, or ``plan`` is not a plan of these pools over
            every layer.
        """
        pools = self._pools
        direction = plan.route.direction
        if plan.route is not pools.route(direction, None):  # the binding's one route over every layer
            raise ValueError("plan: expected a plan of this binding's pools over every layer (batch_plan, plan)")
        if type(layer_id) is not int:
            layer_id = int_arg(layer_id, "layer_id")
        return TransferPlan(pools.route(direction, layer_id), plan.src_indices, plan.dst_indices, plan.stream,
                            plan.src_tensors, plan.dst_tensors)  # fmt: skip
