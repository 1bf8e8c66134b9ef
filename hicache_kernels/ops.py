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
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import layouts
from .backends import IOBackend, get_backend
from .plan import TransferPlan, affine_side, table_side

SUPPORTED_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
)

DevicePool = torch.Tensor | Sequence[torch.Tensor]


def int_arg(value: Any, name: str) -> int:
    """``value`` as an int with :func:`operator.index` semantics (numpy integers accepted).

    ``bool`` (an int subclass, almost always a mistake here), floats, tensors (a CUDA one would sync)
    and anything else without ``__index__`` raise ``TypeError`` naming ``name``.
    """
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_, torch.Tensor)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}") from None


def check_memory(t: torch.Tensor, name: str) -> None:
    """Pools must live in memory the backends can address: the CPU or a CUDA device."""
    if t.device.type not in ("cpu", "cuda"):
        why = " (meta tensors hold no memory)" if t.device.type == "meta" else ""
        raise ValueError(f"{name}: expected a tensor on the CPU or a CUDA device, got one on {t.device}{why}")


def _layers(pool: DevicePool, name: str) -> list[torch.Tensor]:
    """Per-layer ``[N, H, D]`` tensors of a stacked ``[L, N, H, D]`` tensor or a list, validated."""
    if isinstance(pool, torch.Tensor):
        if pool.dim() != 4:
            raise ValueError(
                f"{name}: expected a stacked [L, N, H, D] tensor or a list of [N, H, D], got {pool.dim()}-D"
            )
        if pool.shape[0] == 0:
            raise ValueError(f"{name}: expected at least one layer, got shape {tuple(pool.shape)}")
        if not pool.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor (strides {tuple(pool.stride())})")
        layers = list(pool.unbind(0))
    elif isinstance(pool, (list, tuple)):
        layers = list(pool)
        if not layers:
            raise ValueError(f"{name}: expected at least one layer, got an empty list")
    else:
        raise TypeError(f"{name}: expected a torch.Tensor or a list of tensors, got {type(pool).__name__}")
    first = layers[0]
    for i, t in enumerate(layers):
        where = f"{name}[{i}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{where}: expected a [N, H, D] tensor, got shape {tuple(t.shape)}")
        if t.dtype != first.dtype:
            raise TypeError(f"{where}: dtype {t.dtype} differs from {name}[0]'s {first.dtype}")
        if t.shape != first.shape:
            raise ValueError(f"{where}: shape {tuple(t.shape)} differs from {name}[0]'s {tuple(first.shape)}")
        if t.device != first.device:
            raise ValueError(f"{where}: device {t.device} differs from {name}[0]'s {first.device}")
        if not t.is_contiguous():
            raise ValueError(f"{where}: expected a contiguous tensor (strides {tuple(t.stride())})")
    if first.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name}: dtype {first.dtype} is not supported; expected one of {supported}")
    check_memory(first, name)  # every layer is on first's device (checked above)
    if first.numel() == 0:
        raise ValueError(f"{name}: expected N, H and D all positive, got layers of shape {tuple(first.shape)}")
    return layers


def _check_index(t: Any, name: str, pool_device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise TypeError(f"{name}: expected dtype torch.int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
    if t.device.type != "cpu" and t.device != pool_device:
        raise ValueError(f"{name}: expected a CPU tensor or one on {pool_device}, got {t.device}")
    return t


def _index_stats(idx: torch.Tensor, is_dst: bool) -> torch.Tensor:
    """``[min, max]`` of ``idx`` on its device, without a sync; for a destination with at least two
    indices also ``[has_repeat, a repeated slot]``, found by sorting and comparing neighbours."""
    if not is_dst or idx.numel() < 2:
        lo, hi = torch.aminmax(idx)
        return torch.stack([lo, hi])
    s = torch.sort(idx).values
    same = s[1:] == s[:-1]
    first = same.to(torch.uint8).argmax().view(1)  # index_select: s[t] with a 0-dim t may read t on the host
    return torch.cat([s[:1], s[-1:], same.any().view(1).to(torch.int64), s[1:].index_select(0, first)])


def _check_indices(direction: str, dev_idx: torch.Tensor, n_dev: int, host_idx: torch.Tensor, n_host: int) -> None:
    """IndexError for a slot outside its pool, ValueError for a repeated destination slot; at most one
    device-to-host transfer (one sync for CUDA indices), whatever the index devices."""
    if dev_idx.numel() == 0:
        return
    d2h = direction == "d2h"
    sides = (("device_indices", dev_idx, n_dev, not d2h), ("host_indices", host_idx, n_host, d2h))
    stats = [_index_stats(idx, is_dst) for _, idx, _, is_dst in sides]
    if stats[0].device == stats[1].device:
        values = torch.cat(stats).tolist()  # the single sync for CUDA indices
    else:  # one side on the CPU: only the other one syncs
        values = stats[0].tolist() + stats[1].tolist()
    parts = (values[: stats[0].numel()], values[stats[0].numel() :])
    for (name, _, n, _), (lo, hi, *_) in zip(sides, parts, strict=True):
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{name}: index {bad} is outside the pool's {n} slots [0, {n})")
    for (name, _, _, is_dst), (_, _, *repeat) in zip(sides, parts, strict=True):
        if is_dst and repeat and repeat[0]:
            raise ValueError(
                f"{name}: destination slot {repeat[1]} appears more than once; the slots a "
                f"{'backup' if d2h else 'load'} writes must be distinct (a repeated destination is a race)"
            )


def _host_slots(host: torch.Tensor, layout: str, mla: bool, num_layers: int, page_size: int, H: int, D: int) -> int:
    """Number of host slots N implied by ``host``'s shape; ValueError naming ``host`` when it fits no N."""
    per_slot = (1 if mla else 2) * num_layers * H * D
    n = host.numel() // per_slot
    ok = n > 0 and n % page_size == 0
    expected = (
        layouts.host_shape(
            layout, mla=mla, num_layers=num_layers, num_slots=n, page_size=page_size, head_num=H, head_dim=D
        )
        if ok
        else None
    )
    if expected != tuple(host.shape):
        formula = layouts.shape_formula(layout, mla).format(L=num_layers, H=H, D=D, page=page_size)
        raise ValueError(
            f"host: expected a {'MLA' if mla else 'MHA'} {layout!r} pool of shape {formula} with N a positive "
            f"multiple of page_size {page_size}, got {tuple(host.shape)}"
        )
    return n


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
    destination slot, before any memory is touched.
    """
    if direction not in ("d2h", "h2d"):
        raise ValueError(f"direction: expected 'd2h' or 'h2d', got {direction!r}")
    mla = device_v is None
    page_size = int_arg(page_size, "page_size")
    if page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected a str, got {type(layout).__name__}")
    layouts.check_layout(layout, mla)
    k_layers = _layers(device_k, "device_k")
    v_layers = [] if mla else _layers(device_v, "device_v")
    L = len(k_layers)
    n_dev, H, D = k_layers[0].shape
    dtype, dev = k_layers[0].dtype, k_layers[0].device
    if not mla:
        if len(v_layers) != L:
            raise ValueError(f"device_v: expected {L} layers like device_k, got {len(v_layers)}")
        if v_layers[0].shape != k_layers[0].shape or v_layers[0].dtype != dtype or v_layers[0].device != dev:
            raise ValueError(
                f"device_v: expected layers like device_k's {tuple(k_layers[0].shape)} {dtype} on {dev}, "
                f"got {tuple(v_layers[0].shape)} {v_layers[0].dtype} on {v_layers[0].device}"
            )
    elif H != 1:
        raise ValueError(
            f"device_k: an MLA pool (device_v=None) has one latent head, expected [N, 1, kv_dim], got H={H}"
        )
    if not isinstance(host, torch.Tensor):
        raise TypeError(f"host: expected a torch.Tensor, got {type(host).__name__}")
    if host.dtype != dtype:
        raise TypeError(f"host: dtype {host.dtype} differs from the device pool's {dtype}")
    if host.device.type != "cpu":
        raise ValueError(f"host: expected a CPU (pinned) tensor, got one on {host.device}")
    if not host.is_contiguous():
        raise ValueError(f"host: expected a contiguous tensor (strides {tuple(host.stride())})")
    n_host = _host_slots(host, layout, mla, L, page_size, H, D)
    if layer_id is not None:
        layer_id = int_arg(layer_id, "layer_id")
        if not 0 <= layer_id < L:
            raise ValueError(f"layer_id: expected an int in [0, {L}), got {layer_id!r}")
    dev_idx = _check_index(device_indices, "device_indices", dev)
    host_idx = _check_index(host_indices, "host_indices", dev)
    if dev_idx.numel() != host_idx.numel():
        raise ValueError(
            f"host_indices: expected as many indices as device_indices ({dev_idx.numel()}), got {host_idx.numel()}"
        )
    if check_indices:
        _check_indices(direction, dev_idx, n_dev, host_idx, n_host)
    elem = dtype.itemsize
    geom = layouts.host_geometry(
        layout, mla=mla, num_layers=L, num_slots=n_host, page_size=page_size, head_num=H, head_dim=D, elem_bytes=elem
    )
    num_kv = 1 if mla else 2
    dev_side = table_side(k_layers + v_layers, num_kv, H * D * elem, geom.chunk_bytes, geom.num_chunks)
    host_side = affine_side(host, geom)
    d2h = direction == "d2h"
    return TransferPlan(
        direction=direction,
        src=dev_side if d2h else host_side,
        dst=host_side if d2h else dev_side,
        src_indices=dev_idx if d2h else host_idx,
        dst_indices=host_idx if d2h else dev_idx,
        layer_begin=0 if layer_id is None else layer_id,
        layer_count=L if layer_id is None else 1,
        num_kv=num_kv,
        num_chunks=geom.num_chunks,
        chunk_bytes=geom.chunk_bytes,
        item_bytes=geom.item_bytes,
        checked=check_indices,
        stream=stream,
        extras={"layout": layout, "page_size": page_size, "mla": mla, "geometry": geom},
    )


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
        if stream is not None:
            raise ValueError("stream: not supported under torch.compile; the current stream is used")
        page_size = int_arg(page_size, "page_size")
        if layer_id is not None:
            layer_id = int_arg(layer_id, "layer_id")
            if layer_id < 0:  # -1 is the op's "every layer"; the upper bound is checked inside the op
                raise ValueError(f"layer_id: expected a non-negative int, got {layer_id}")
        op = torch.ops.hicache_kernels.backup if direction == "d2h" else torch.ops.hicache_kernels.load
        op(
            _as_list(device_k), [] if device_v is None else _as_list(device_v), host, device_indices, host_indices,
            layout, page_size, -1 if layer_id is None else layer_id, _backend_name(backend), check_indices,
        )  # fmt: skip
        return
    plan = build_plan(
        direction, device_k, device_v, host, device_indices, host_indices,
        layout=layout, page_size=page_size, layer_id=layer_id, check_indices=check_indices, stream=stream,
    )  # fmt: skip
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


def _as_list(pool: DevicePool) -> list[torch.Tensor]:
    return [pool] if isinstance(pool, torch.Tensor) else list(pool)


def _from_list(pools: list[torch.Tensor]) -> DevicePool:
    return pools[0] if len(pools) == 1 and pools[0].dim() == 4 else pools


def _backend_name(backend: str | IOBackend) -> str:
    if isinstance(backend, IOBackend):
        raise ValueError("backend: pass a backend name (not an instance) under torch.compile")
    return backend


def _custom_op_body(direction: str):
    def body(
        device_k: list[torch.Tensor],
        device_v: list[torch.Tensor],
        host: torch.Tensor,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        layout: str,
        page_size: int,
        layer_id: int,
        backend: str,
        check_indices: bool,
    ) -> None:
        plan = build_plan(
            direction, _from_list(device_k), _from_list(device_v) if device_v else None, host,
            device_indices, host_indices, layout=layout, page_size=page_size,
            layer_id=None if layer_id == -1 else layer_id, check_indices=check_indices,
        )  # fmt: skip
        get_backend(backend).run(plan)

    return body


# Registered custom ops: the mutated arguments are declared, so torch.compile and functionalization
# see the writes; the fake implementations have nothing to compute (no outputs).
backup_op = torch.library.custom_op("hicache_kernels::backup", mutates_args=("host",))(_custom_op_body("d2h"))
load_op = torch.library.custom_op("hicache_kernels::load", mutates_args=("device_k", "device_v"))(
    _custom_op_body("h2d")
)


@backup_op.register_fake
def _(device_k, device_v, host, device_indices, host_indices, layout, page_size, layer_id, backend, check_indices):
    return None


@load_op.register_fake
def _(device_k, device_v, host, device_indices, host_indices, layout, page_size, layer_id, backend, check_indices):
    return None
