"""sgl-kernel's ``*_direct*`` kvcacheio functions (:mod:`hicache_kernels.compat.sgl_kernel` exports them):
copy-engine transfers of whole pages between per-layer tensors and ``page_first_direct`` host
buffers ``[P, L, page, H, D]``, always on the ``direct`` backend, as in sgl-kernel.

Each index pair's token slot is moved, so whole-page index groups (what sgl-kernel requires: it reads
only the first index of each page) give sgl-kernel's result, and any other grouping is still copied
slot by slot; the index count must be a multiple of ``page_size``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from .._ext import cuda_runtime_status
from .._validate import int_arg
from ..backends import get_backend
from ..backends.copy_engine import DirectBackend
from ..fragments import Fragments, TensorMemory
from ..plan import Route, Side
from ._routes import (
    cached_route,
    direct_device,
    direct_host,
    make_route,
    on_host,
    page_size_arg,
    run_route,
    table_side,
    tensor_arg,
    tensor_list,
)

__all__ = [
    "transfer_embedding_ranges_direct",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
]


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Copy-engine copy of token slots between paired per-layer tensors: for each ``i``,
    ``dst_layers[i][dst_indices] = src_layers[i][src_indices]``. As in sgl-kernel the index count must
    be a multiple of ``page_size`` (whole pages); runs of consecutive slots are merged into single
    copies, found from the indices themselves. Always uses the ``direct`` backend, whatever
    :func:`~hicache_kernels.compat.sgl_kernel.use_backend` says."""
    page_size = page_size_arg(page_size)

    def build() -> Route:
        src = tensor_list(src_layers, "src_layers")
        dst = tensor_list(dst_layers, "dst_layers", (len(src),))
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            if s.dim() < 1 or d.dim() < 1 or s.dtype != d.dtype or s.shape[1:] != d.shape[1:]:
                raise ValueError(
                    f"dst_layers[{i}]: rows {tuple(d.shape[1:])} {d.dtype} differ from src_layers[{i}]'s "
                    f"{tuple(s.shape[1:])} {s.dtype}"
                )
        row = src[0][0].numel() * src[0].element_size()

        def side(layers: list[torch.Tensor], name: str) -> Side:
            if any(t[0].numel() * t.element_size() != row for t in layers):
                raise ValueError(f"{name}: every layer must have the same row size")
            return table_side(
                [[t.data_ptr() for t in layers]], row, min(t.shape[0] for t in layers), is_host=on_host(layers)
            )

        return make_route(
            side(src, "src_layers"),
            side(dst, "dst_layers"),
            tuple(src),
            tuple(dst),
            names=("src_layers", "dst_layers"),
            layer_begin=0,
            layer_count=len(src),
            item_size=row,
        )

    route = cached_route("direct", (src_layers, dst_layers), (), build)
    run_route(
        route,
        tuple(src_layers),
        tuple(dst_layers),
        src_indices,
        dst_indices,
        get_backend("direct"),
        whole_pages=page_size,
    )


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Every layer from per-layer device tensors into ``page_first_direct`` host buffers (copy engines).

    ``src_ptrs``: ``L`` K layers then ``L`` V layers, each ``[N, H, D]`` (MLA: ``L`` layers
    ``[N, 1, kv_dim]``); ``dst_ptrs``: ``[host_k, host_v]``, each ``[P, L', page, H, D]`` with
    ``L' >= L`` (MLA: ``[host_kv]``); layers ``0..L-1`` are written. The index count must be a multiple
    of ``page_size`` (whole pages). Always uses the ``direct`` backend.
    """
    page_size = page_size_arg(page_size)

    def build() -> Route:
        dst = tensor_list(dst_ptrs, "dst_ptrs", (1, 2))
        src = tensor_list(src_ptrs, "src_ptrs")
        num_kv = len(dst)
        n = len(src) // num_kv
        host, L = direct_host(dst, "dst_ptrs", page_size, 0, n)
        if host is None:
            raise ValueError(f"src_ptrs: {n} layers per K/V, more than the {L} layers of dst_ptrs[0]")
        dev = direct_device(src, "src_ptrs", num_kv, dst[0], "dst_ptrs[0]")
        return make_route(dev, host, tuple(src), tuple(dst), names=("src_ptrs", "dst_ptrs"), layer_begin=0,
                          layer_count=n, item_size=host.s_in_page)  # fmt: skip

    route = cached_route("all_layer_direct_lf_pf", (dst_ptrs, src_ptrs), (page_size,), build)
    run_route(
        route, tuple(src_ptrs), tuple(dst_ptrs), src_indices, dst_indices, get_backend("direct"), whole_pages=page_size
    )


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Layer ``layer_id`` from ``page_first_direct`` host buffers into device layers (copy engines).

    ``src_ptrs``: ``[host_k, host_v]``, each ``[P, L, page, H, D]`` (MLA: ``[host_kv]``); ``dst_ptrs``:
    the device layer(s) to write, ``[k_layer, v_layer]`` (MLA: ``[kv_layer]``), each ``[N, H, D]``.
    Given ``n`` layers per K/V (K first), host layers ``layer_id .. layer_id + n - 1`` are copied. The
    index count must be a multiple of ``page_size`` (whole pages). Always uses the ``direct`` backend.
    """
    page_size = page_size_arg(page_size)
    layer_id = int_arg(layer_id, "layer_id")

    def build() -> Route:
        src = tensor_list(src_ptrs, "src_ptrs", (1, 2))
        dst = tensor_list(dst_ptrs, "dst_ptrs")
        num_kv = len(src)
        n = len(dst) // num_kv
        host, L = direct_host(src, "src_ptrs", page_size, max(layer_id, 0), n)
        if layer_id < 0 or host is None:
            raise ValueError(f"layer_id: expected an int in [0, {L - n + 1}) for {n} layer(s) per K/V, got {layer_id}")
        dev = direct_device(dst, "dst_ptrs", num_kv, src[0], "src_ptrs[0]")
        return make_route(host, dev, tuple(src), tuple(dst), names=("src_ptrs", "dst_ptrs"), layer_begin=0,
                          layer_count=n, item_size=host.s_in_page)  # fmt: skip

    route = cached_route("per_layer_direct_pf_lf", (src_ptrs, dst_ptrs), (layer_id, page_size), build)
    run_route(
        route, tuple(src_ptrs), tuple(dst_ptrs), src_indices, dst_indices, get_backend("direct"), whole_pages=page_size
    )


def _row_tensor(t: Any, name: str) -> tuple[torch.Tensor, int]:
    t = tensor_arg(t, name)
    if t.dim() < 1 or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor of rows (dim 0), got shape {tuple(t.shape)} "
                         f"strides {tuple(t.stride())}")  # fmt: skip
    return t, (t[0].numel() * t.element_size() if t.shape[0] else 0)


def _int_list(v: Any, name: str, n: int | None) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
            raise TypeError(f"{name}: expected a 1-D tensor of ints, got {v.dtype} {tuple(v.shape)}")
        v = v.cpu().numpy()
    elif isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected a 1-D array of ints, got {v.dtype} {v.shape}")
    elif isinstance(v, (list, tuple)):
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in v):
            raise TypeError(f"{name}: expected a list of ints")
    else:
        raise TypeError(f"{name}: expected a list, numpy array or tensor of ints, got {type(v).__name__}")
    out = np.asarray(v, dtype=np.int64).reshape(-1)
    if n is not None and out.shape[0] != n:
        raise ValueError(f"{name}: expected {n} entries like src_starts (the same length), got {out.shape[0]}")
    if (out < 0).any():
        raise ValueError(f"{name}: expected non-negative row counts, got {int(out.min())}")
    return out


def transfer_embedding_ranges_direct(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_starts: Any,
    dst_starts: Any,
    lengths: Any,
) -> None:
    """Copy-engine copy of row ranges: for each ``i``,
    ``dst[dst_starts[i] : dst_starts[i] + lengths[i]] = src[src_starts[i] : src_starts[i] + lengths[i]]``,
    rows along dim 0 (SGLang's multimodal embedding cache and its MiniMax NVFP4 host pool use it).

    ``src`` and ``dst``: contiguous tensors (CPU or CUDA) with rows of the same byte size; the starts
    and lengths: lists, numpy arrays or tensors of ints, in rows. Every range is checked against both
    tensors before anything is copied. Each range is one ``cudaMemcpyAsync`` on the current stream of
    the CUDA side's device (a torch copy between CPU tensors); zero-length ranges are skipped.
    """
    src, src_row = _row_tensor(src, "src")
    dst, dst_row = _row_tensor(dst, "dst")
    if src_row != dst_row:
        raise ValueError(f"dst: rows of {dst_row} bytes differ from src's {src_row}")
    s0 = _int_list(src_starts, "src_starts", None)
    d0 = _int_list(dst_starts, "dst_starts", s0.shape[0])
    n = _int_list(lengths, "lengths", s0.shape[0])
    for name, starts, t in (("src_starts", s0, src), ("dst_starts", d0, dst)):
        over = np.nonzero(starts + n > t.shape[0])[0]
        if over.size:
            i = int(over[0])
            raise ValueError(f"{name}[{i}]: rows {int(starts[i])}..{int(starts[i] + n[i])} run past the "
                             f"{t.shape[0]} rows of {name[:3]}")  # fmt: skip
    gpus = {t.device for t in (src, dst) if t.is_cuda}
    if len(gpus) > 1:
        raise ValueError(f"dst: src and dst are on two GPUs ({', '.join(sorted(map(str, gpus)))})")
    keep = n > 0
    s0, d0, n = s0[keep], d0[keep], n[keep]
    if n.size == 0:
        return
    width = n * src_row
    frags = Fragments(dst=dst.data_ptr() + d0 * src_row, dst_pitch=width, src=src.data_ptr() + s0 * src_row,
                      src_pitch=width, width=width, height=np.ones_like(width))  # fmt: skip
    if not gpus or not cuda_runtime_status()[0]:
        with torch.cuda.device(next(iter(gpus))) if gpus else contextlib.nullcontext():
            TensorMemory((src, dst)).copy(frags)  # torch copies (cudaMemcpyAsync on a CUDA side)
        return
    (device,) = gpus
    with torch.cuda.device(device):
        DirectBackend.issuer(frags)(torch.cuda.current_stream(device))
