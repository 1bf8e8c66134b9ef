"""A pointer-list copy: ``n`` byte ranges, ``src_ptrs[i]`` to ``dst_ptrs[i]``, ``sizes[i]`` bytes each.

This is the copy vLLM's CPU offloading worker makes with ``swap_blocks_batch`` (GPU blocks to and from
its pinned CPU region, one range per block and layer), here on any io-backend of this package:
``kernel`` (the gather/scatter kernel, one launch per distinct size), ``batch`` (one
``cudaMemcpyBatchAsync`` per distinct size), ``triton``, or ``auto`` (which picks by the ranges' size, as
it does for page transfers). A list of equal-size ranges is the package's transfer over two pointer
tables: one index, ``n`` "layers" whose table entries are the range addresses, so every backend,
alignment rule and check of the page transfers applies unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._ext import BackendUnavailableError
from .backends import get_backend
from .backends.base import IOBackend
from .plan import NO_BOUND, Route, Side, TransferPlan, cpu_pointer_tables_reason

__all__ = ["copy_ranges"]

_ZERO = torch.zeros(1, dtype=torch.int64)


def _ptr_array(t: Any, name: str, n: int | None) -> np.ndarray:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D torch.int64 CPU tensor, got {type(t).__name__}")
    if t.dtype != torch.int64 or t.dim() != 1 or t.device.type != "cpu":
        raise TypeError(f"{name}: expected a 1-D torch.int64 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name}: expected {n} entries like src_ptrs, got {t.numel()}")
    return t.numpy()


def _table(addresses: np.ndarray, is_host: bool) -> Side:
    return Side(is_table=True, base=0, table=tuple(addresses.tolist()), num_layers=len(addresses), s_kv=0,
                s_layer=0, s_page=0, s_in_page=0, s_chunk=0, page_size=1, num_slots=NO_BOUND,
                is_host=is_host)  # fmt: skip


def copy_ranges(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    *,
    direction: str,
    device: torch.device | str | None = None,
    backend: str | IOBackend = "auto",
    stream: Any = None,
) -> None:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every ``i``.

    Parameters
    ----------
    src_ptrs, dst_ptrs : torch.Tensor
        1-D ``torch.int64`` CPU tensors of ``n`` byte addresses (as vLLM's ``swap_blocks_batch`` takes
        them). Host addresses must be pinned memory for a GPU copy.
    sizes : torch.Tensor
        1-D ``torch.int64`` CPU tensor of ``n`` byte counts, ``>= 0`` (an empty range is skipped).
    direction : str
        ``"d2h"`` (the sources are device memory, the destinations host memory) or ``"h2d"``.
    device : torch.device or str, optional
        The GPU the copy runs on (default: the current CUDA device; ``"cpu"`` on a machine without
        one, where only the ``triton`` backend, under its interpreter, reaches raw addresses).
    backend : str or IOBackend
        ``"auto"`` (default), ``"kernel"``, ``"batch"``, ``"triton"``, or a backend object.
    stream : torch.cuda.Stream, optional
        The stream the copy is queued on (default: the device's current stream). Asynchronous like a
        page transfer: the caller orders its use of the bytes after the stream.

    Raises
    ------
    TypeError, ValueError
        For a bad argument, naming it, before anything is copied. Ranges must not overlap each
        other's destinations or any source (not checked: the addresses name no tensor).
    """
    src = _ptr_array(src_ptrs, "src_ptrs", None)
    n = src.size
    dst = _ptr_array(dst_ptrs, "dst_ptrs", n)
    size = _ptr_array(sizes, "sizes", n)
    if direction not in ("d2h", "h2d"):
        raise ValueError(f"direction: expected 'd2h' or 'h2d', got {direction!r}")
    if n and size.min() < 0:
        raise ValueError(f"sizes: expected sizes >= 0, got {int(size.min())} at {int(size.argmin())}")
    used = size > 0
    for name, a in (("src_ptrs", src), ("dst_ptrs", dst)):
        bad = used & (a <= 0)
        if bad.any():
            i = int(bad.argmax())
            raise ValueError(f"{name}: expected addresses > 0, got {int(a[i])} at {i}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    io = get_backend(backend) if isinstance(backend, str) else backend
    if not isinstance(io, IOBackend):
        raise TypeError(f"backend: expected a backend name or an IOBackend, got {type(backend).__name__}")
    if not used.any():
        return
    # The device tables a GPU launch uploads (hicache_kernels.launch.DeviceTables) are owned by this
    # call's token, not by the pointer tensors: callers reuse those buffers with new addresses (vLLM
    # pools them), which would keep every call's table alive. The token dies when the call returns; the
    # tables are recorded on the launch's stream, so their memory is reused only after it has run.
    token = torch.empty(1, dtype=torch.uint8)
    # One launch per distinct size: within it every range is a "layer" of two pointer tables.
    for nbytes in np.unique(size[used]).tolist():
        pick = np.flatnonzero(size == nbytes)
        route = Route(direction=direction, src=_table(src[pick], direction == "h2d"),
                      dst=_table(dst[pick], direction == "d2h"), layer_begin=0, layer_count=int(pick.size),
                      num_kv=1, num_chunks=1, chunk_bytes=int(nbytes), item_bytes=int(nbytes), page_size=1,
                      device=device, gpu_addressable=True)  # fmt: skip
        why = cpu_pointer_tables_reason(route, io.name, "src_ptrs and dst_ptrs")
        if why:
            raise BackendUnavailableError(why)
        io.run(TransferPlan(route, _ZERO, _ZERO, stream, (token,), (token,)))
