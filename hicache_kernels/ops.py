"""Public transfer ops: back up KV slots from a layer-first device pool to a host pool, and load them
back, one layer or all layers at a time, on a chosen io-backend.

Shapes (see :mod:`hicache_kernels.layouts` for the host layouts)
-----------------------------------------------------------------
- ``device_k`` / ``device_v``: one stacked tensor ``[L, N_dev, H, D]`` or a list of ``L`` tensors
  ``[N_dev, H, D]``, each contiguous, on one device. MLA: ``device_k`` holds the latent pool
  ``[L, N_dev, 1, kv_dim]`` (or a list of ``[N_dev, 1, kv_dim]``) and ``device_v`` is ``None``.
- ``host``: contiguous, of :func:`hicache_kernels.layouts.host_shape` for ``layout``; pinned when the
  device pool is on a GPU and the backend reads it directly (``kernel``, ``triton``).
- ``device_indices`` / ``host_indices``: 1-D ``torch.int64`` token-slot indices (not pages, not
  bytes) of equal length; pair ``i`` moves device slot ``device_indices[i]`` to or from host slot
  ``host_indices[i]``. Destination slots (``host_indices`` for a backup, ``device_indices`` for a
  load) must not repeat: two pairs writing one slot race on a GPU. Two slots of one page are two
  slots; only the same token slot twice is a repeat.
- Integer arguments (``layer_id``, ``page_size``) take a Python int or a numpy integer; ``bool``,
  floats and tensors are refused with ``TypeError``.
- dtypes: float16, bfloat16, float32, float8_e4m3fn, float8_e5m2, uint8; device and host pools share
  it. Items of any size move bit-exactly.
- The device and host pools must not share memory (e.g. overlapping views of one CPU buffer): the
  kernels read sources through the non-coherent cache, so a copy onto its own source is undefined.
  Checked when the pools are bound (``ValueError`` naming both); disjoint views of one buffer are fine.

Index checking
--------------
With ``check_indices=True`` (the default) every index is checked against its pool before anything is
touched: an out-of-range one raises ``IndexError`` and a repeated destination slot ``ValueError``, with
the destination unchanged. For CUDA indices both checks together cost one device-to-host
synchronisation (the destination indices are sorted on the device, and their minimum, maximum and
first repeat come back with the source's minimum and maximum in one transfer).
``check_indices=False`` is the fast mode (no sync, and the mode to use under CUDA-graph capture): the
kernels still skip any out-of-range pair, so nothing outside the pools is ever read or written, but a
bad pair is silently not copied, and repeated destination slots are not detected: which of the
competing sources lands in such a slot is undefined (a race).

Validate once
-------------
The pools, layout and page size are validated on their first use and remembered, with everything
derived from them (address tables, byte geometry, and what the backends build on the first launch:
device tables, the host pool's device alias, kernel descriptors), for as long as the pool objects
live (:func:`hicache_kernels.binding.bound_pools`; the cache holds no tensor). A later call with the
same objects costs O(1) checks (each tensor's ``data_ptr``, shape, strides and dtype; for per-layer
lists, every layer's identity) plus its index checks, whatever the number of layers. A caller moving
data between the same pools many times can also bind them explicitly:
:class:`~hicache_kernels.binding.KVBinding` (also ``hicache_kernels.KVBinding``), whose
``batch_plan`` prepares a batch once and ``layer_plan`` gives each layer's part of it.

Custom ops (``torch.compile``) live in :mod:`hicache_kernels._custom_ops`, argument checks in
:mod:`hicache_kernels._validate`; this module is the public API.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _custom_ops
from ._validate import SUPPORTED_DTYPES, DevicePool, check_memory, int_arg
from .backends import IOBackend, get_backend
from .binding import KVBinding
from .bound_pools import bound_pools, check_direction, pool_tensors
from .plan import TransferPlan

# The registered custom ops (torch.compile sees their writes): hicache_kernels::backup / ::load.
backup_op = _custom_ops.backup_op
load_op = _custom_ops.load_op

__all__ = [
    "SUPPORTED_DTYPES",
    "DevicePool",
    "KVBinding",
    "backup_all_layers",
    "backup_layer",
    "backup_op",
    "build_plan",
    "check_memory",
    "int_arg",
    "load_all_layers",
    "load_layer",
    "load_op",
    "transfer",
]


def build_plan(
    direction: str,
    device_k: DevicePool,
    device_v: DevicePool | None,
    host: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    layout: str,
    page_size: int,
    layer_id: int | None = None,
    check_indices: bool = True,
    stream: Any = None,
) -> TransferPlan:
    """Validate a transfer and describe it in bytes (:class:`~hicache_kernels.plan.TransferPlan`).

    ``direction`` is ``"d2h"`` (backup) or ``"h2d"`` (load); ``layer_id`` None moves every layer.
    Raises ``TypeError``/``ValueError`` naming the argument for a malformed input, and (when
    ``check_indices``) ``IndexError`` for an out-of-range index and ``ValueError`` for a repeated
    destination slot, before any memory is touched. The pools are validated on their first use and
    remembered while they live (:func:`hicache_kernels.binding.bound_pools`); later calls with the
    same pool objects check only the indices.
    """
    check_direction(direction)
    pools = bound_pools(device_k, device_v, host, layout, page_size)
    return pools.plan(direction, device_indices, host_indices, layer_id, check_indices, stream,
                      pool_tensors(device_k, device_v), (host,))  # fmt: skip


def transfer(
    direction: str,
    device_k: DevicePool,
    device_v: DevicePool | None,
    host: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    layout: str,
    page_size: int,
    layer_id: int | None = None,
    backend: str | IOBackend = "auto",
    stream: Any = None,
    check_indices: bool = True,
) -> None:
    """Move token slots between the device pool and the host pool (``direction`` ``"d2h"``/``"h2d"``).

    The named functions below are the usual entry points; this is their common implementation.
    Under ``torch.compile`` it dispatches to the custom ops ``hicache_kernels::backup`` /
    ``hicache_kernels::load`` so the mutation is visible to the compiler.
    """
    if not isinstance(backend, (str, IOBackend)):
        raise TypeError(f"backend: expected a backend name (str) or an IOBackend, got {type(backend).__name__}")
    if torch.compiler.is_compiling():
        _custom_ops.call(direction, device_k, device_v, host, device_indices, host_indices, layout=layout,
                         page_size=page_size, layer_id=layer_id, backend=backend, stream=stream,
                         check_indices=check_indices)  # fmt: skip
        return
    plan = build_plan(direction, device_k, device_v, host, device_indices, host_indices, layout=layout,
                      page_size=page_size, layer_id=layer_id, check_indices=check_indices, stream=stream)  # fmt: skip
    get_backend(backend).run(plan)


def backup_layer(
    device_k: DevicePool,
    device_v: DevicePool | None,
    host: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    layer_id: int,
    layout: str,
    page_size: int,
    backend: str | IOBackend = "auto",
    stream: Any = None,
    check_indices: bool = True,
) -> None:
    """Copy one layer's K/V (or MLA latent) of the given device slots into host slots.

    Parameters
    ----------
    device_k, device_v : layer-first device pool, ``[L, N_dev, H, D]`` or a list of ``L`` ``[N_dev, H, D]``
        tensors (contiguous); ``device_v=None`` for MLA (``device_k`` is then ``[L, N_dev, 1, kv_dim]``).
    host : host pool in ``layout`` (:func:`hicache_kernels.layouts.host_shape`), same dtype; pinned for
        the zero-copy backends. Written in place: only the named slots of layer ``layer_id`` change.
    device_indices, host_indices : 1-D ``torch.int64`` token-slot indices, equal length, on the CPU or
        the pool's GPU; ``host_indices`` (the destination) must not repeat.
    layer_id : the layer to copy, an int (or numpy integer) in ``[0, L)``; never None.
    layout : ``"layer_first"``, ``"page_first"``, ``"page_first_direct"`` or ``"page_head"`` (MHA only).
    page_size : tokens per page, an int (or numpy integer) >= 1; ``N_host`` must be a multiple of it.
    backend : ``"auto"`` (default), ``"kernel"``, ``"triton"``, ``"batch"``, ``"direct"`` or an
        :class:`~hicache_kernels.backends.IOBackend` instance.
    stream : a ``torch.cuda.Stream`` to run on; default the current stream. The host is never
        synchronised except to check indices (``check_indices``) or to plan copy-engine fragments from
        CUDA indices.
    check_indices : before touching memory, raise ``IndexError`` if an index is out of range and
        ``ValueError`` if a destination slot repeats (default; one sync for CUDA indices). ``False``
        skips both checks (no sync): out-of-range pairs are then skipped, never copied, and repeated
        destination slots are not detected (the result in such a slot is undefined, a race).

    Examples
    --------
    >>> import torch
    >>> from hicache_kernels import ops
    >>> L, N, H, D = 2, 32, 4, 8
    >>> k, v = torch.randn(L, N, H, D), torch.randn(L, N, H, D)
    >>> host = torch.zeros(2, 16, L, H, D)  # page_first: [2, N_host, L, H, D]
    >>> idx = torch.tensor([3, 4, 9])
    >>> ops.backup_layer(k, v, host, idx, torch.tensor([0, 1, 2]), layer_id=1, layout="page_first", page_size=1)
    >>> torch.equal(host[0, :3, 1], k[1, idx])
    True
    """
    _one_layer(layer_id, "backup")
    transfer(
        "d2h", device_k, device_v, host, device_indices, host_indices, layout=layout, page_size=page_size,
        layer_id=layer_id, backend=backend, stream=stream, check_indices=check_indices,
    )  # fmt: skip


def backup_all_layers(
    device_k: DevicePool,
    device_v: DevicePool | None,
    host: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    layout: str,
    page_size: int,
    backend: str | IOBackend = "auto",
    stream: Any = None,
    check_indices: bool = True,
) -> None:
    """Copy every layer of the given device slots into host slots. Arguments as :func:`backup_layer`.

    Examples
    --------
    >>> import torch
    >>> from hicache_kernels import ops
    >>> kv = torch.randn(3, 16, 1, 8)  # MLA: [L, N, 1, kv_dim]
    >>> host = torch.zeros(2, 3, 4, 1, 8)  # page_first_direct, page 4: [N_host/4, L, 4, 1, kv_dim]
    >>> ops.backup_all_layers(kv, None, host, torch.arange(4, 8), torch.arange(4),
    ...                       layout="page_first_direct", page_size=4)
    >>> torch.equal(host[0, :, :, 0], kv[:, 4:8, 0])
    True
    """
    transfer(
        "d2h", device_k, device_v, host, device_indices, host_indices, layout=layout, page_size=page_size,
        backend=backend, stream=stream, check_indices=check_indices,
    )  # fmt: skip


def load_layer(
    device_k: DevicePool,
    device_v: DevicePool | None,
    host: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    layer_id: int,
    layout: str,
    page_size: int,
    backend: str | IOBackend = "auto",
    stream: Any = None,
    check_indices: bool = True,
) -> None:
    """Copy one layer of the given host slots into device slots (the device pool is written in place;
    ``device_indices`` must not repeat). Arguments as :func:`backup_layer`.

    Examples
    --------
    >>> import torch
    >>> from hicache_kernels import ops
    >>> k, v = torch.zeros(2, 8, 2, 4), torch.zeros(2, 8, 2, 4)
    >>> host = torch.randn(2, 2, 8, 2, 4)  # layer_first: [2, L, N_host, H, D]
    >>> ops.load_layer(k, v, host, torch.tensor([5]), torch.tensor([7]), layer_id=0,
    ...                layout="layer_first", page_size=1)
    >>> torch.equal(v[0, 5], host[1, 0, 7])
    True
    """
    _one_layer(layer_id, "load")
    transfer(
        "h2d", device_k, device_v, host, device_indices, host_indices, layout=layout, page_size=page_size,
        layer_id=layer_id, backend=backend, stream=stream, check_indices=check_indices,
    )  # fmt: skip


def load_all_layers(
    device_k: DevicePool,
    device_v: DevicePool | None,
    host: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    layout: str,
    page_size: int,
    backend: str | IOBackend = "auto",
    stream: Any = None,
    check_indices: bool = True,
) -> None:
    """Copy every layer of the given host slots into device slots. Arguments as :func:`backup_layer`."""
    transfer(
        "h2d", device_k, device_v, host, device_indices, host_indices, layout=layout, page_size=page_size,
        backend=backend, stream=stream, check_indices=check_indices,
    )  # fmt: skip


def _one_layer(layer_id: Any, verb: str) -> None:
    # transfer() reads layer_id=None as "every layer": the per-layer ops must not pass it through.
    if layer_id is None:
        raise TypeError(f"layer_id: {verb}_layer moves one layer and needs an int, got None (use {verb}_all_layers)")
