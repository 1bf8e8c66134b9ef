"""Argument checks of the transfer ops: the pools (once, when they are bound) and a call's indices
(every call). Every error is a ``TypeError``/``ValueError`` (``IndexError`` for an out-of-range
slot) whose message starts with the argument's name; nothing is written before they pass."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import layouts

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


def page_size_arg(page_size: Any) -> int:
    page_size = int_arg(page_size, "page_size")
    if page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    return page_size


def layout_arg(layout: Any) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected a str, got {type(layout).__name__}")
    return layout


def check_memory(t: torch.Tensor, name: str) -> None:
    """Pools must live in memory the backends can address: the CPU or a CUDA device."""
    if t.device.type not in ("cpu", "cuda"):
        why = " (meta tensors hold no memory)" if t.device.type == "meta" else ""
        raise ValueError(f"{name}: expected a tensor on the CPU or a CUDA device, got one on {t.device}{why}")


# A tensor's memory for the overlap check: [first byte, end byte) and the argument's name. CPU and CUDA
# addresses share one space (CUDA's unified addressing: pinned host memory is seen by kernels at its
# host address, and no device allocation overlaps a host one), so spans of any devices are compared.
Span = tuple[int, int, str]


def tensor_span(t: torch.Tensor, name: str) -> Span | None:
    """The bytes ``t`` addresses, ``[data_ptr, data_ptr + extent)`` over its strides; None when empty."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    if t.is_contiguous():
        return (start, start + t.nbytes, name)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))  # torch strides are >= 0
    return (start, start + (last + 1) * t.element_size(), name)


def check_disjoint(sources: Iterable[Span | None], destinations: Iterable[Span | None]) -> None:
    """ValueError, naming both arguments, when a destination's bytes overlap a source's.

    The kernels read sources through the non-coherent cache (``ld.global.nc``), which assumes the
    memory is not written while the kernel runs: a copy onto (part of) its own source is undefined, so
    it is refused before anything is written. Ranges, not slots: a source and a destination that share
    any byte are refused, whatever the indices. One sort of the spans (O(n log n)).
    """
    spans = sorted((*span, side) for side, group in enumerate((sources, destinations)) for span in group if span)
    furthest: list[tuple | None] = [None, None]  # per side, the span seen so far that reaches furthest
    for span in spans:
        start, end, name, side = span
        other = furthest[1 - side]
        if other is not None and other[1] > start:
            src, dst = (other, span) if side else (span, other)
            raise ValueError(
                f"{dst[2]}: its memory [{dst[0]:#x}, {dst[1]:#x}) overlaps {src[2]}'s [{src[0]:#x}, {src[1]:#x}); "
                "a transfer's source and destination must not share memory (the kernels read sources through "
                "the non-coherent cache, ld.global.nc: a copy onto its own source is undefined)"
            )
        if furthest[side] is None or end > furthest[side][1]:
            furthest[side] = span


@dataclass(frozen=True)
class PoolFacts:
    """A validated layer-first device pool: ``num_layers`` layers of ``[num_slots, head_num, head_dim]``
    at ``addresses`` (one per layer), and the tensors holding that memory (the stacked tensor, or the
    layers of a list)."""

    num_layers: int
    num_slots: int
    head_num: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    addresses: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]


def device_pool(pool: Any, name: str) -> PoolFacts:
    """Check a stacked ``[L, N, H, D]`` tensor or a list of ``L`` ``[N, H, D]`` tensors."""
    if isinstance(pool, torch.Tensor):
        if pool.dim() != 4:
            raise ValueError(
                f"{name}: expected a stacked [L, N, H, D] tensor or a list of [N, H, D], got {pool.dim()}-D"
            )
        if pool.shape[0] == 0:
            raise ValueError(f"{name}: expected at least one layer, got shape {tuple(pool.shape)}")
        if not pool.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor (strides {tuple(pool.stride())})")
        first, tensors = pool, (pool,)
        layer_shape = tuple(pool.shape[1:])
    elif isinstance(pool, (list, tuple)):
        if not pool:
            raise ValueError(f"{name}: expected at least one layer, got an empty list")
        tensors = tuple(pool)
        first = tensors[0]
        for i, t in enumerate(tensors):
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
        layer_shape = tuple(first.shape)
    else:
        raise TypeError(f"{name}: expected a torch.Tensor or a list of tensors, got {type(pool).__name__}")
    if first.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name}: dtype {first.dtype} is not supported; expected one of {supported}")
    check_memory(first, name)  # every layer is on first's device (checked above)
    n, h, d = layer_shape
    if n * h * d == 0:
        raise ValueError(f"{name}: expected N, H and D all positive, got layers of shape {layer_shape}")
    if len(tensors) == 1 and first.dim() == 4:  # stacked: layer l starts l * N * H * D elements in
        layer_bytes = n * h * d * first.element_size()
        addresses = tuple(first.data_ptr() + layer * layer_bytes for layer in range(first.shape[0]))
    else:
        addresses = tuple(t.data_ptr() for t in tensors)
    return PoolFacts(len(addresses), n, h, d, first.dtype, first.device, addresses, tensors)


def pool_spans(pool: PoolFacts, name: str) -> list[Span | None]:
    """The memory of a device pool's tensors, named as the caller gave them (``device_k`` for a stacked
    tensor, ``device_k[i]`` for layer ``i`` of a list)."""
    if len(pool.tensors) == 1 and pool.tensors[0].dim() == 4:
        return [tensor_span(pool.tensors[0], name)]
    return [tensor_span(t, f"{name}[{i}]") for i, t in enumerate(pool.tensors)]


def host_pool(host: Any, dtype: torch.dtype, layout: str, mla: bool, num_layers: int, page_size: int, H: int,
              D: int) -> int:  # fmt: skip
    """Check the host pool against the device pool's geometry; returns its number of slots."""
    if not isinstance(host, torch.Tensor):
        raise TypeError(f"host: expected a torch.Tensor, got {type(host).__name__}")
    if host.dtype != dtype:
        raise TypeError(f"host: dtype {host.dtype} differs from the device pool's {dtype}")
    if host.device.type != "cpu":
        raise ValueError(f"host: expected a CPU (pinned) tensor, got one on {host.device}")
    if not host.is_contiguous():
        raise ValueError(f"host: expected a contiguous tensor (strides {tuple(host.stride())})")
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


def index_tensor(t: Any, name: str, pool_device: torch.device) -> torch.Tensor:
    """A call's index tensor: 1-D int64 on the CPU or the pool's device, contiguous.

    The kernels read indices through ``data_ptr()`` at stride 1, so a strided view (``slots[::2]``, a
    column of a 2-D tensor, an ``expand``) is copied contiguous here: on the host, or for CUDA indices
    on the current stream, where the caller made them (a launch on another stream is ordered after it)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype is not torch.int64:
        raise TypeError(f"{name}: expected dtype torch.int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
    if not t.is_cpu and t.device != pool_device:
        raise ValueError(f"{name}: expected a CPU tensor or one on {pool_device}, got {t.device}")
    return t if t.is_contiguous() else t.contiguous()


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


def _index_faults() -> Any:
    """The compiled one-pass check of CPU indices (``hicache_kernels._C.index_faults``), or None."""
    global _INDEX_FAULTS
    if _INDEX_FAULTS is False:
        from ._ext import optional_attr  # noqa: PLC0415

        _INDEX_FAULTS = optional_attr("index_faults")
    return _INDEX_FAULTS


_INDEX_FAULTS: Any = False  # not looked up yet


def _raise_fault(direction: str, name: str, kind: int, value: int, n: int) -> None:
    if kind == 1:
        raise IndexError(f"{name}: index {value} is outside the pool's {n} slots [0, {n})")
    raise ValueError(
        f"{name}: destination slot {value} appears more than once; the slots a "
        f"{'backup' if direction == 'd2h' else 'load'} writes must be distinct (a repeated destination is a race)"
    )


def index_values(direction: str, dev_idx: torch.Tensor, n_dev: int, host_idx: torch.Tensor, n_host: int) -> None:
    """IndexError for a slot outside its pool, ValueError for a repeated destination slot; at most one
    device-to-host transfer (one sync for CUDA indices), whatever the index devices. CPU indices take
    one compiled pass when the extension is built (the same faults, in the same order)."""
    if dev_idx.numel() == 0:
        return
    d2h = direction == "d2h"
    if dev_idx.is_cpu and host_idx.is_cpu:
        check = _index_faults()
        if check is not None:
            fault = check(dev_idx.numpy(), n_dev, host_idx.numpy(), n_host, d2h)
            if fault is not None:
                side, kind, value = fault
                name, n = ("device_indices", n_dev) if side == 0 else ("host_indices", n_host)
                _raise_fault(direction, name, kind, value, n)
            return
    sides = (("device_indices", dev_idx, n_dev, not d2h), ("host_indices", host_idx, n_host, d2h))
    stats = [_index_stats(idx, is_dst) for _, idx, _, is_dst in sides]
    if stats[0].device == stats[1].device:
        values = torch.cat(stats).tolist()  # the single sync for CUDA indices
    else:  # one side on the CPU: only the other one syncs
        values = stats[0].tolist() + stats[1].tolist()
    parts = (values[: stats[0].numel()], values[stats[0].numel() :])
    for (name, _, n, _), (lo, hi, *_) in zip(sides, parts, strict=True):
        if lo < 0 or hi >= n:
            _raise_fault(direction, name, 1, lo if lo < 0 else hi, n)
    for (name, _, n, is_dst), (_, _, *repeat) in zip(sides, parts, strict=True):
        if is_dst and repeat and repeat[0]:
            _raise_fault(direction, name, 2, repeat[1], n)
