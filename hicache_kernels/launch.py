"""What a CUDA launch of a :class:`~hicache_kernels.plan.Route` needs, prepared once and shared by the
``kernel`` and ``triton`` io-backends.

- :class:`DeviceTables`: device copies of table sides' address lists, **the** table cache of the
  package, each kept exactly as long as the memory it describes (safe for CUDA-graph replays).
- :func:`device_alias`: the device address of pinned host memory.
- :func:`gpu_route`: per route, the descriptors with the addresses the GPU uses (device table, host
  alias) and the alignment the copy width comes from; cached in ``route.launch_state``, per side in
  ``side.launch_state``, so a call after the first builds nothing.

Under CUDA-graph capture nothing can be uploaded: the first launch of a route must run before
capturing (:class:`DeviceTables` raises otherwise, naming the fix).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._ext import cuda_runtime_status, load_extension
from .plan import Side, TransferPlan

TableKey = tuple[torch.device, tuple[int, ...]]


class DeviceTables:
    """Device copies of table sides' address lists, each kept exactly as long as the memory it describes.

    Key ``(device, addresses)``: a table's content *is* its key, so a cached table is never stale. A
    pool allocated at the addresses of a dead one gets a table that is right for it, whether it is
    built afresh or the old entry is still there (its release pending): equal addresses, equal content.

    Lifetime: each :meth:`get` names the tensors its addresses were taken from (a plan's
    ``src_tensors``/``dst_tensors``: the pool's layers or stacked tensor; for sgl-kernel-style pointer
    tables, the caller's table tensor); the entry holds a weak reference (:func:`weakref.finalize`) to
    each distinct storage among them and is dropped when the last of them dies. Storages, not
    tensors: a pool may arrive as fresh views on every call, which die right after it, while its
    storage is the memory itself (torch keeps one Python object per storage, finalized when the
    memory goes). Pools that share an entry (aliases of one buffer, a new pool at a dead one's
    addresses) each add their storages, so one's death never frees a table another live pool reads,
    and a table read by a captured CUDA graph lives as long as the pool the graph writes. Memory is
    bounded by live storages: each entry holds at least one.

    ``build(addresses, device)`` makes a table; it is injectable so the lifetimes can be tested on CPU.
    """

    def __init__(self, build: Callable[[tuple[int, ...], torch.device], torch.Tensor]) -> None:
        self._build = build
        # Re-entrant: a release runs from a finalizer, possibly from a garbage collection that get()
        # itself triggers while it holds the lock.
        self._lock = threading.RLock()
        self._tables: dict[TableKey, torch.Tensor] = {}
        self._owners: dict[TableKey, set[int]] = {}  # id() of each live storage keeping the entry

    def __len__(self) -> int:
        return len(self._tables)

    def get(
        self,
        addresses: tuple[int, ...],
        device: torch.device,
        owners: Iterable[torch.Tensor],
        *,
        capturing: bool = False,
    ) -> torch.Tensor:
        """The table of ``addresses`` on ``device``, kept while any storage of ``owners`` lives.

        Raises ``RuntimeError`` when it must be built while ``capturing`` (a CUDA-graph capture cannot
        contain the blocking upload) and ``ValueError`` when ``owners`` is empty.
        """
        storages = {id(s): s for s in (t.untyped_storage() for t in owners)}
        if not storages:
            raise ValueError("owners: a device table needs the tensors whose memory it describes")
        key = (device, addresses)
        with self._lock:
            table = self._tables.get(key)
            if table is None:
                if capturing:
                    raise RuntimeError(
                        "this pool's device table is made by its first transfer, which cannot run under "
                        "CUDA-graph capture; run one transfer with the same pool before capturing"
                    )
                table = self._build(addresses, device)
            held = self._owners.get(key, set())
            for sid, storage in storages.items():
                if sid not in held:  # an id is unique while its storage lives; its finalizer runs before reuse
                    weakref.finalize(storage, self._release, key, sid).atexit = False
                    held.add(sid)
            # (Re)inserted last: a collection triggered above may have finalized this entry's other owners
            # and dropped it; the owners just added keep it.
            self._tables[key] = table
            self._owners[key] = held
            return table

    def _release(self, key: TableKey, sid: int) -> None:
        with self._lock:
            held = self._owners.get(key)
            if held is None:
                return
            held.discard(sid)
            if not held:
                del self._owners[key], self._tables[key]


def _upload_table(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # A blocking copy from pageable memory: complete on return, so any stream may read it afterwards.
    return torch.tensor(addresses, dtype=torch.int64, device=device)


device_tables = DeviceTables(_upload_table)


def device_alias(host_ptr: int) -> int:
    """Device address of pinned host memory: the extension's ``host_device_pointer`` when it can run
    (the alias equals the host address under UVA on Linux x86-64, not everywhere, so ask), else the
    host address itself (no extension, or a driver older than its static runtime: torch, which runs,
    relies on UVA there too). Asked once per bound host pool (:func:`gpu_side`), which lives no longer
    than the pinned buffer it describes."""
    if not cuda_runtime_status()[0]:
        return host_ptr
    return int(load_extension().host_device_pointer(host_ptr))


def capturing() -> bool:
    """Whether the current stream of the current device is capturing a CUDA graph."""
    return torch.cuda.is_current_stream_capturing()


class GpuSide:
    """A side as the GPU addresses it: ``base`` (the device table's address for a table side, the
    host alias or device address of an affine one), the table tensor, ``alignment`` (the gcd of every
    address it stands for, host addresses and their aliases alike), and the streams its table was
    recorded on (:meth:`GpuRoute.use_tables_on`)."""

    __slots__ = ("alignment", "base", "recorded", "table")

    def __init__(self, base: int, table: torch.Tensor | None, alignment: int) -> None:
        self.base = base
        self.table = table
        self.alignment = alignment
        self.recorded: set[int] = set()


def gpu_side(side: Side, tensors: tuple[torch.Tensor, ...], device: torch.device, *, capturing: bool) -> GpuSide:
    """``side`` on ``device``: aliases of its host addresses asked once, its table uploaded once (and
    kept while ``tensors``' memory lives). Cached in ``side.launch_state``."""
    g = side.launch_state.get(device)
    if g is not None:
        return g
    addresses = side.table if side.is_table else (side.base,)
    if side.is_host:
        addresses = tuple(device_alias(a) for a in addresses)
    if side.is_table:
        table = device_tables.get(addresses, device, tensors, capturing=capturing)
        base = table.data_ptr()
    else:
        table, base = None, addresses[0]
    g = GpuSide(base, table, side.alignment if not side.is_host else math.gcd(side.alignment, *addresses))
    side.launch_state[device] = g
    return g


class GpuRoute:
    """A route's CUDA launch arguments: both sides' descriptors (``Side.desc()`` with the GPU's base
    addresses), the alignment (:meth:`~hicache_kernels.plan.Route.alignment` over the addresses the
    GPU uses) and the device tables the launch reads."""

    __slots__ = ("align", "dst", "dst_desc", "recorded", "src", "src_desc")

    def __init__(self, src: GpuSide, dst: GpuSide, src_side: Side, dst_side: Side, align: int) -> None:
        self.src, self.dst = src, dst
        self.src_desc = (src.base, *src_side.desc()[1:])
        self.dst_desc = (dst.base, *dst_side.desc()[1:])
        self.align = align
        self.recorded: set[int] = set()  # streams every table of this route was recorded on

    def use_tables_on(self, handle: int, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` reads the tables, once per table and stream: a
        table is freed when its pool's memory dies, which may be before a launch queued on another
        stream has run; the allocator then waits for the work queued on each recorded stream. Not for
        graph capture (a captured graph's table lives as long as the pool it writes). ``stream`` None:
        the device's current stream, whose handle is ``handle``."""
        if handle in self.recorded:
            return
        for side in (self.src, self.dst):
            if side.table is not None and handle not in side.recorded:
                if stream is None:
                    stream = torch.cuda.current_stream(side.table.device)
                record_stream(side.table, stream)
                side.recorded.add(handle)
        self.recorded.add(handle)


def record_stream(table: torch.Tensor, stream: Any) -> None:
    table.record_stream(stream)


def follow_caller(stream: Any, device: torch.device, tensors: Any) -> bool:
    """Order a launch on ``stream`` after the caller's CUDA ``tensors`` (a call's index tensors).

    The caller made them on its current stream; a launch on another stream is ordered after nothing
    there, and once the caller drops a temporary tensor its memory is the current stream's allocator's
    to hand out again while the copy may still read it. So ``stream`` waits for the current stream (an
    event, no host sync) and each tensor is recorded on ``stream`` (not under CUDA-graph capture, where
    the graph's memory pool keeps it). Nothing happens when ``stream`` is the current stream or no tensor
    is on a GPU. Returns whether it ordered anything."""
    cuda = [t for t in tensors if t.is_cuda]
    if stream is None or not cuda:
        return False
    current = torch.cuda.current_stream(device)
    if stream.cuda_stream == current.cuda_stream:
        return False
    stream.wait_stream(current)
    if not capturing():
        for t in cuda:
            record_stream(t, stream)
    return True


def gpu_route(plan: TransferPlan, *, capturing: bool) -> GpuRoute:
    """The CUDA launch arguments of ``plan.route`` (cached in ``route.launch_state``)."""
    route = plan.route
    g = route.launch_state.get("gpu")
    if g is None:
        device = route.device
        src = gpu_side(route.src, plan.src_tensors, device, capturing=capturing)
        dst = gpu_side(route.dst, plan.dst_tensors, device, capturing=capturing)
        g = GpuRoute(src, dst, route.src, route.dst, route.alignment(src.alignment, dst.alignment))
        route.launch_state["gpu"] = g
    return g
