"""Host memory for the KV pools: exact-size pinned buffers, and the RAM there is to take them from.

Why not ``torch.empty(..., pin_memory=True)``: that goes through torch's caching host allocator, which
rounds every request up to a power of two, so a 96 GiB host pool pins 128 GiB. :func:`empty_host`
instead pins exactly the pool's bytes, rounded up only to the OS page:

- an anonymous private mapping of ``page_rounded(nbytes)`` bytes (page-aligned by construction),
- registered with the CUDA runtime (``cudaHostRegister``, portable and mapped, so every device can
  DMA it and, with unified addressing, a kernel can read it at the host address, as
  :mod:`hicache_kernels.backends` ``kernel`` does),
- seen as a tensor of the pool's shape and dtype without a copy.

Lifetime: the tensor (and every view of it) keeps the memory alive; when the last one goes the
memory is unregistered, then unmapped. Pageable buffers are the same kind of anonymous mapping, not
registered: page-aligned too (``torch.empty`` aligns to 64 bytes only), so that the storage tier's
``O_DIRECT`` reads and writes (:mod:`hicache.storage.file`, ``direct_io=True``) can move pages straight
into and out of the pool. Their RAM is counted as the pool's bytes (:func:`allocated_bytes`): pageable
memory is committed page by page as it is touched, and the rounding of the last page is under one OS
page.

Units: bytes throughout.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["PAGE_BYTES", "allocated_bytes", "empty_host", "mem_available_bytes", "page_rounded"]

PAGE_BYTES = mmap.PAGESIZE
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every CUDA context, and mapped into the
# devices' address space (the zero-copy kernels read the host pool in place).
_REGISTER_FLAGS = 0x01 | 0x02


def page_rounded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole OS pages: what pinning ``nbytes`` takes."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def allocated_bytes(nbytes: int, pinned: bool) -> int:
    """Host RAM a buffer of ``nbytes`` takes: whole pages when pinned, exactly ``nbytes`` when not."""
    return page_rounded(nbytes) if pinned else nbytes


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else the free physical
    pages; None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _error_text(cudart: Any, err: Any) -> str:
    try:
        return f"{cudart.cudaGetErrorString(err)} (cudaError {int(err)})"
    except Exception:  # noqa: BLE001 - the code alone still says what failed
        return f"cudaError {int(err)}"


def _unregister(cudart: Any, ptr: int) -> None:
    # Runs when the last tensor over the memory is gone; nothing is left to tell about a failure.
    cudart.cudaHostUnregister(ptr)


def empty_host(
    shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool, device: torch.device | None = None
) -> torch.Tensor:
    """A contiguous CPU tensor of ``shape`` and ``dtype`` (zero-filled), page-aligned, pinned when ``pin``.

    An anonymous mapping of ``page_rounded(nbytes)`` bytes. Pinned: registered with the CUDA runtime,
    with ``device`` (a CUDA device: the pool's) current, so that a process that never made that device
    current (a TP rank) creates no context on GPU 0 for it; the caller checks that CUDA is there.
    ``RuntimeError`` naming ``cudaHostRegister``, the size and the CUDA error when the registration fails
    (then nothing stays mapped or registered).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    size = page_rounded(max(nbytes, 1))
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The array is the memory's one owner that tensors hold and a finalizer can watch; it holds the mapping.
    raw = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
    if not pin:
        return torch.from_numpy(raw).view(dtype).view(shape)
    ptr = raw.ctypes.data
    cudart = torch.cuda.cudart()
    on = torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()
    with on:
        err = cudart.cudaHostRegister(ptr, size, _REGISTER_FLAGS)
    if int(err) != 0:
        del raw
        mem.close()
        raise RuntimeError(
            f"pin_memory: cudaHostRegister of {size} bytes ({nbytes} bytes of pool rounded up to "
            f"{PAGE_BYTES}-byte pages) at {ptr:#x} failed: {_error_text(cudart, err)}"
        )
    weakref.finalize(raw, _unregister, cudart, ptr).atexit = False  # at exit the process releases it
    return torch.from_numpy(raw).view(dtype).view(shape)
