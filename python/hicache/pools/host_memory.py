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

Set-up at serving size (:class:`HostSetup`): a pool of hundreds of GB spends its start-up faulting in
and zeroing pages, which the registration (or the first copies) would otherwise do on one thread. The
mapping's pages are instead populated by ``threads`` threads at once (``madvise(MADV_POPULATE_WRITE)``
over a share each, outside the GIL; a strided write where the kernel lacks it, Linux < 5.14), then
registered; optionally on transparent huge pages (``madvise(MADV_HUGEPAGE)``) and bound to one NUMA node
(``mbind``, so the pages sit next to the GPU's socket whichever thread touches them). What it took is
a :class:`SetupReport` (:func:`make_host`; ``HostKVPool.setup_report``); ``python -m
hicache.bench.host_setup`` measures it against a single-threaded memset of the same size.

Units: bytes throughout; seconds for times.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import platform
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "PAGE_BYTES",
    "HostSetup",
    "SetupReport",
    "allocated_bytes",
    "empty_host",
    "make_host",
    "mem_available_bytes",
    "numa_nodes",
    "page_rounded",
]

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


def _unregister(cudart: Any, ptr: int, device_index: int | None) -> None:
    """Runs when the last tensor over the memory is gone; nothing is left to tell about a failure. A pool
    dropped with copies still queued on its device (no ``close()``: its controller collected with them)
    would have them read or write memory that is no longer there, so the device's queued work lands
    first: a wait for the device (the pool's; None: the current one) once per pool dropped."""
    try:
        torch.cuda.synchronize(device_index)
    except Exception:  # noqa: BLE001 - a broken context must not keep the memory registered
        pass
    cudart.cudaHostUnregister(ptr)


# ----------------------------------------------------------------------------------------------- set-up
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault in (and zero) the range's pages, writable
_MPOL_BIND = 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}  # the mbind system call's number
_NODES = Path("/sys/devices/system/node")
_SMALL_BYTES = 64 << 20  # below this one thread populates: starting threads costs more than it saves


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)  # calls release the GIL: the populating threads run in parallel
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def numa_nodes() -> list[int]:
    """The NUMA nodes that have memory (``/sys/devices/system/node/has_memory``); [] where not known."""
    try:
        text = (_NODES / "has_memory").read_text().strip()
    except OSError:
        return []
    nodes: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes


def _default_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


@dataclass(frozen=True)
class HostSetup:
    """How a host buffer's memory is made ready (module docstring).

    Parameters
    ----------
    threads : threads that populate the pages, each a contiguous share (default: the CPUs this process
        may run on, at most 8). Buffers under 64 MiB use one.
    huge_pages : advise transparent huge pages (``MADV_HUGEPAGE``) before populating: fewer faults and
        TLB misses. Honoured where the kernel's THP mode is ``always`` or ``madvise``; the report says.
    numa_node : bind the pages to this NUMA node (``mbind``, strict); None: the kernel's default
        (first touch). ``ValueError`` naming it when the node has no memory here.
    """

    threads: int | None = None
    huge_pages: bool = False
    numa_node: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(f"threads: expected a positive int or None, got {self.threads!r}")
        if not isinstance(self.huge_pages, bool):
            raise TypeError(f"huge_pages: expected a bool, got {type(self.huge_pages).__name__}")
        if self.numa_node is not None:
            if isinstance(self.numa_node, bool) or not isinstance(self.numa_node, int) or self.numa_node < 0:
                raise ValueError(f"numa_node: expected a node number >= 0 or None, got {self.numa_node!r}")
            nodes = numa_nodes()
            if self.numa_node not in nodes:
                raise ValueError(f"numa_node: node {self.numa_node} has no memory here (nodes with memory: {nodes})")


@dataclass(frozen=True)
class SetupReport:
    """What making a host buffer took.

    Attributes
    ----------
    nbytes : bytes mapped (whole OS pages).
    threads : threads that populated them.
    populate : ``"madvise"`` (``MADV_POPULATE_WRITE``), ``"write"`` (a strided write, the kernel lacks
        it) or ``"none"`` (an empty buffer).
    populate_s : seconds to populate every page (zeroed and resident).
    register_s : seconds ``cudaHostRegister`` took (0.0 when not pinned).
    huge_pages : whether transparent huge pages were advised and the kernel's mode honours the advice.
    huge_pages_note : why not, when asked for and not honoured; else "".
    numa_node : the node the pages are bound to, or None.
    """

    nbytes: int
    threads: int
    populate: str
    populate_s: float
    register_s: float
    huge_pages: bool
    huge_pages_note: str
    numa_node: int | None

    @property
    def populate_gbps(self) -> float:
        """Populated bytes per second, in GB/s (1e9 bytes)."""
        return self.nbytes / self.populate_s / 1e9 if self.populate_s > 0 else 0.0


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def _advise_huge(libc: Any, ptr: int, size: int) -> tuple[bool, str]:
    mode = _thp_mode()
    if mode == "never":
        return False, "transparent huge pages are off here (/sys/kernel/mm/transparent_hugepage/enabled: never)"
    if libc.madvise(ptr, size, _MADV_HUGEPAGE) != 0:
        return False, f"madvise(MADV_HUGEPAGE) failed: {os.strerror(ctypes.get_errno())}"
    return True, ""


def _bind(libc: Any, ptr: int, size: int, node: int) -> None:
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        raise ValueError(f"numa_node: binding memory to a node is not supported on {platform.machine()}")
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    libc.syscall.restype = ctypes.c_long
    # maxnode counts one more than the mask's bits (the kernel drops the last one).
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(ptr), ctypes.c_ulong(size), ctypes.c_int(_MPOL_BIND),
                      mask, ctypes.c_ulong(words * 64 + 1), ctypes.c_uint(0))  # fmt: skip
    if rc != 0:
        raise ValueError(f"numa_node: mbind of {size} bytes to node {node} failed: {os.strerror(ctypes.get_errno())}")


def _populate(libc: Any, raw: np.ndarray, ptr: int, size: int, threads: int) -> str:
    """Fault in every page of ``[ptr, ptr + size)``, ``threads`` contiguous shares at once. Returns how."""
    pages = size // PAGE_BYTES
    bounds = [pages * i // threads * PAGE_BYTES for i in range(threads + 1)]
    shares = [(bounds[i], bounds[i + 1]) for i in range(threads) if bounds[i + 1] > bounds[i]]
    how = ["madvise"]
    errors: list[BaseException] = []

    def one(lo: int, hi: int) -> None:
        try:
            if how[0] == "madvise" and libc.madvise(ptr + lo, hi - lo, _MADV_POPULATE_WRITE) == 0:
                return
            how[0] = "write"  # EINVAL: the kernel predates MADV_POPULATE_WRITE
            raw[lo : min(hi, raw.size) : PAGE_BYTES] = 0
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread
            errors.append(exc)

    if len(shares) <= 1:
        for lo, hi in shares:
            one(lo, hi)
    else:
        workers = [threading.Thread(target=one, args=share, name="hicache-host-setup") for share in shares]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    if errors:
        raise errors[0]
    return how[0]


def make_host(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    pin: bool,
    device: torch.device | None = None,
    setup: HostSetup | None = None,
) -> tuple[torch.Tensor, SetupReport]:
    """:func:`empty_host` with its :class:`SetupReport`: the buffer's pages are populated by
    ``setup.threads`` threads (bound to ``setup.numa_node``, on huge pages when asked) before a pinned
    buffer is registered, so the registration finds them resident."""
    setup = HostSetup() if setup is None else setup
    nbytes = math.prod(shape) * dtype.itemsize
    size = page_rounded(max(nbytes, 1))
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The array is the memory's one owner that tensors hold and a finalizer can watch; it holds the mapping.
    # Over the whole mapping (the last page's tail too), viewed down to the pool's bytes.
    whole = np.frombuffer(mem, dtype=np.uint8)
    raw = whole[:nbytes]
    ptr = whole.ctypes.data
    libc = _libc()
    try:
        huge, note = _advise_huge(libc, ptr, size) if setup.huge_pages else (False, "")
        if setup.numa_node is not None:
            _bind(libc, ptr, size, setup.numa_node)
        threads = 1 if size < _SMALL_BYTES else (setup.threads or _default_threads())
        t0 = time.perf_counter()
        how = _populate(libc, whole, ptr, size, threads) if nbytes else "none"
        populate_s = time.perf_counter() - t0
    except BaseException:
        del whole, raw
        mem.close()
        raise
    del whole
    register_s = 0.0
    if pin:
        cudart = torch.cuda.cudart()
        on = torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()
        t0 = time.perf_counter()
        with on:
            err = cudart.cudaHostRegister(ptr, size, _REGISTER_FLAGS)
        register_s = time.perf_counter() - t0
        if int(err) != 0:
            del raw
            mem.close()
            raise RuntimeError(
                f"pin_memory: cudaHostRegister of {size} bytes ({nbytes} bytes of pool rounded up to "
                f"{PAGE_BYTES}-byte pages) at {ptr:#x} failed: {_error_text(cudart, err)}"
            )
        index = device.index if device is not None and device.type == "cuda" else None
        weakref.finalize(raw, _unregister, cudart, ptr, index).atexit = False  # at exit the process releases it
    report = SetupReport(size, threads, how, populate_s, register_s, huge, note, setup.numa_node)
    return torch.from_numpy(raw).view(dtype).view(shape), report


def empty_host(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    pin: bool,
    device: torch.device | None = None,
    setup: HostSetup | None = None,
) -> torch.Tensor:
    """A contiguous CPU tensor of ``shape`` and ``dtype`` (zero-filled), page-aligned, pinned when ``pin``.

    An anonymous mapping of ``page_rounded(nbytes)`` bytes, its pages populated as ``setup`` says
    (:class:`HostSetup`; default: several threads). Pinned: then registered with the CUDA runtime,
    with ``device`` (a CUDA device: the pool's) current, so that a process that never made that device
    current (a TP rank) creates no context on GPU 0 for it; the caller checks that CUDA is there.
    ``RuntimeError`` naming ``cudaHostRegister``, the size and the CUDA error when the registration fails
    (then nothing stays mapped or registered).
    """
    return make_host(shape, dtype, pin=pin, device=device, setup=setup)[0]
