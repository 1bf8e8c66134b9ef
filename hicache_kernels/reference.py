"""Pure-torch reference for every transfer: plain indexing of the layout shapes.

This deliberately does not use :mod:`hicache_kernels.layouts`' strides: it indexes the shapes of the
layout table directly, so a stride mistake cannot hide in both the backends and the reference. It
works on any device and dtype (it copies bytes through ``uint8`` views).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _host_items(hv: torch.Tensor, layout: str, layer: int, slots: torch.Tensor, page_size: int):
    """Index expression selecting ``[n, H, D*elem]`` bytes of ``layer`` at host ``slots``."""
    if layout == "layer_first":  # [L, N, H, D]
        return (layer, slots)
    if layout == "page_first":  # [N, L, H, D]
        return (slots, layer)
    pages, offs = slots // page_size, slots % page_size
    if layout == "page_first_direct":  # [P, L, page, H, D]
        return (pages, layer, offs)
    if layout == "page_head":  # [P, H, page, L, D]; the broadcast index dim goes first: [n, H, D]
        return (pages, slice(None), offs, layer)
    raise ValueError(f"layout: unknown {layout!r}")


def host_items(
    host: torch.Tensor, layout: str, page_size: int, layer: int, slots: torch.Tensor, kv: int | None
) -> torch.Tensor:
    """The bytes of ``layer`` at host ``slots``: ``[n, H, D * elem]`` uint8 (``kv`` 0/1 for MHA, None
    for MLA). Plain indexing of the layout's shape, like :func:`reference_transfer`."""
    hv = _bytes(host if kv is None else host[kv])
    return hv[_host_items(hv, layout, layer, slots.to(host.device), page_size)]


def reference_transfer(
    *,
    direction: str,
    device_k: Sequence[torch.Tensor],
    device_v: Sequence[torch.Tensor] | None,
    host: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    layout: str,
    page_size: int,
    layers: Sequence[int],
) -> None:
    """Copy token slots between a layer-first device pool and a host pool, in place.

    Parameters
    ----------
    direction : ``"d2h"`` writes ``host`` from the device pool; ``"h2d"`` writes the device pool.
    device_k, device_v : per-layer tensors ``[N_dev, H, D]``; ``device_v`` is None for MLA.
    host : the host pool in ``layout`` (see :mod:`hicache_kernels.layouts`), any device.
    device_indices, host_indices : 1-D int64 slot indices of equal length; pair ``i`` moves device
        slot ``device_indices[i]`` to/from host slot ``host_indices[i]``.
    layers : the layer ids to move.
    """
    kvs = [device_k] if device_v is None else [device_k, device_v]
    d_idx = device_indices.to(device_k[0].device)
    h_idx = host_indices.to(host.device)
    for kv, dev_layers in enumerate(kvs):
        hv = _bytes(host if device_v is None else host[kv])
        for layer in layers:
            dev = _bytes(dev_layers[layer])
            where = _host_items(hv, layout, layer, h_idx, page_size)
            if direction == "d2h":
                hv[where] = dev[d_idx].to(hv.device)
            elif direction == "h2d":
                dev[d_idx] = hv[where].to(dev.device)
            else:
                raise ValueError(f"direction: expected 'd2h' or 'h2d', got {direction!r}")
