"""The ``staged`` io-backend: copy engines through a bounded, double-buffered GPU staging buffer.

A backup (``d2h``) packs the selected layer-first device items into a staging buffer in device memory,
in *host address order*, so that every run of consecutive host bytes is one contiguous copy out of the
buffer; the copy engines then write those runs to the host pool. A load (``h2d``) is the reverse:
whole host runs into the buffer, then a scatter into the device pool. Nothing here knows the host
layouts: a unit is one chunk (``chunk_bytes``) of one (pair, kv, layer, chunk), its host address comes
from the route's host :class:`~hicache_kernels.plan.Side` (the one formula), and units whose host
addresses follow each other merge into one run. So ``page_first_direct`` moves whole host pages (all
layers, per K/V) in one copy, ``layer_first`` one run of slots per (kv, layer), ``page_head`` whatever
the layer range makes contiguous.

Work is split into blocks of at most the buffer's capacity (``staging_pages`` host pages of the
route: ``page_size * item_bytes * num_kv * layer_count`` bytes each). Two buffers alternate: on CUDA
the pack (or scatter) of block ``i + 1`` runs on the launch stream while the copy engines move block
``i`` on the backend's copy stream, ordered by events; a buffer is reused only after the work reading
it finished. The whole copy is ordered after the work already on the launch stream, and work queued
on it afterwards sees the result. Host copies go through the extension's ``memcpy_fragments`` (one
``cudaMemcpyAsync`` per run) when its runtime works here, else through torch copies.

The pack is torch ``index_select``/``index_copy_`` on ``uint8`` views: one per block and device tensor
(two per block for stacked K/V pools, ``2 * L`` for per-layer lists). On CPU tensors the same blocks
run with the same ops and torch copies, which is how every layout and direction is tested without a
GPU.

A CUDA device pool needs a pinned host pool: with pageable memory ``cudaMemcpyAsync`` is synchronous
with the host, so the overlap this backend exists for cannot happen (use ``direct`` there). The staging
buffers are owned by the backend, one pair per (device, direction), grown when a route needs more; a
prepared copy keeps its pair alive. Issuing is serialised per pair (a lock), so threads may share a
backend. Not capturable in CUDA graphs (its events live across calls).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._ext import cuda_runtime_status
from ..fragments import Fragments, TensorMemory, host_indices
from ..plan import TransferPlan
from .base import IOBackend, nothing, pinned_reason, plan_stream
from .copy_engine import DirectBackend

__all__ = ["StagedBackend", "plan_units"]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.dtype == torch.uint8 else t.reshape(-1).view(torch.uint8)


class _Staging:
    """Two staging buffers of ``nbytes`` on one device, the events ordering their reuse, the copy
    stream (CUDA), and the lock serialising issues that use them."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self.lock = threading.Lock()
        if device.type == "cuda":
            with torch.cuda.device(device.index):
                self.copy_stream = torch.cuda.Stream(device)
                with torch.cuda.stream(self.copy_stream):  # allocated for the copy stream; pack streams recorded
                    self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
            self.ready = [torch.cuda.Event() for _ in range(2)]  # block i's data is in buffer i % 2
            self.free = [torch.cuda.Event() for _ in range(2)]  # buffer i may be overwritten
            self.start, self.end = torch.cuda.Event(), torch.cuda.Event()  # a call's first and last copy
        else:
            self.copy_stream = None
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]


@dataclass
class _Group:
    """Units of one block that live in one device tensor: ``rows`` of ``device`` (a ``[rows,
    chunk_bytes]`` byte view) at staging rows ``pos`` (or the contiguous range ``span``)."""

    device: torch.Tensor
    rows: torch.Tensor
    pos: torch.Tensor
    span: tuple[int, int] | None


@dataclass
class _Block:
    buffer: int
    groups: list[_Group]
    copies: Fragments  # host runs: staging -> host (d2h) or host -> staging (h2d), one 1-D copy each


def _ranges(tensors: tuple[torch.Tensor, ...]) -> tuple[np.ndarray, np.ndarray, list[torch.Tensor]]:
    ts = sorted((t for t in tensors if t.numel()), key=lambda t: t.data_ptr())
    lo = np.array([t.data_ptr() for t in ts], dtype=np.int64)
    hi = np.array([t.data_ptr() + t.numel() * t.element_size() for t in ts], dtype=np.int64)
    return lo, hi, ts


def plan_units(plan: TransferPlan) -> tuple[np.ndarray, np.ndarray]:
    """``(host_addr, device_addr)`` of every unit (pair x kv x layer x chunk), sorted by host address.
    Out-of-range pairs are dropped, as every backend does."""
    route = plan.route
    src_idx, dst_idx = host_indices(plan.src_indices), host_indices(plan.dst_indices)
    ok = (src_idx >= 0) & (src_idx < plan.src.num_slots) & (dst_idx >= 0) & (dst_idx < plan.dst.num_slots)
    src_idx, dst_idx = src_idx[ok], dst_idx[ok]
    d2h = route.direction == "d2h"
    host_slot, dev_slot = (dst_idx, src_idx) if d2h else (src_idx, dst_idx)
    dev_side = route.src if d2h else route.dst
    layers = np.arange(route.layer_begin, route.layer_begin + route.layer_count, dtype=np.int64)
    kv, layer, chunk = (
        a.reshape(1, -1)
        for a in np.meshgrid(np.arange(route.num_kv), layers, np.arange(route.num_chunks), indexing="ij")
    )
    h, d = host_slot.reshape(-1, 1), dev_slot.reshape(-1, 1)
    host_addr = route.host_side.addresses(kv, layer, h, chunk).reshape(-1)
    dev_addr = dev_side.addresses(kv, layer, d, chunk).reshape(-1)
    order = np.argsort(host_addr, kind="stable")
    return host_addr[order], dev_addr[order]


class StagedBackend(IOBackend):
    """Copy engines through a double-buffered device staging buffer (see module docstring).

    ``staging_pages``: each of the two buffers holds this many host pages of the route (all its layers
    and K/V). ``double_buffer=False`` uses one buffer (no overlap: a baseline for measuring it).
    """

    name = "staged"

    def __init__(self, staging_pages: int = 16, double_buffer: bool = True) -> None:
        if isinstance(staging_pages, bool) or not isinstance(staging_pages, int | np.integer) or staging_pages < 1:
            raise ValueError(f"staging_pages: expected a positive int, got {staging_pages!r}")
        staging_pages = int(staging_pages)
        if type(double_buffer) is not bool:
            raise TypeError(f"double_buffer: expected a bool, got {type(double_buffer).__name__}")
        self.staging_pages = staging_pages
        self.double_buffer = double_buffer
        self._staging: dict[tuple[torch.device, str], _Staging] = {}
        self._lock = threading.Lock()

    def unavailable(self, plan: TransferPlan) -> str | None:
        if not plan.route.on_cuda:
            return None
        return pinned_reason(plan)

    def wants_host_indices(self, plan: TransferPlan) -> bool:
        return True

    def staging_bytes(self, plan: TransferPlan) -> int:
        """Bytes of one staging buffer for ``plan``'s route."""
        r = plan.route
        return self.staging_pages * r.page_size * r.item_bytes * r.num_kv * r.layer_count

    def _staging_for(self, device: torch.device, direction: str, nbytes: int) -> _Staging:
        with self._lock:
            st = self._staging.get((device, direction))
            if st is None or st.nbytes < nbytes:
                st = _Staging(device, nbytes)  # an older pair lives on in the copies prepared with it
                self._staging[(device, direction)] = st
            return st

    def _prepare(self, plan: TransferPlan) -> Callable[[], None]:
        host_addr, dev_addr = plan_units(plan)
        if host_addr.size == 0:
            return nothing
        route = plan.route
        cb = route.chunk_bytes
        capacity = self.staging_bytes(plan) // cb  # units per buffer (one page holds at least one)
        st = self._staging_for(route.device, route.direction, capacity * cb)
        stream = plan_stream(plan) if route.on_cuda else None
        d2h = route.direction == "d2h"
        dev_tensors = plan.src_tensors if d2h else plan.dst_tensors
        lo, hi, tensors = _ranges(dev_tensors)
        which = np.searchsorted(lo, dev_addr, side="right") - 1
        if (which < 0).any() or (dev_addr + cb > hi[which]).any():
            raise ValueError("plan: a device address lies outside the plan's device tensors")
        offset = dev_addr - lo[which]
        if (offset % cb).any():
            raise ValueError(f"plan: device items are not laid out in rows of chunk_bytes ({cb})")
        views = [_flat_bytes(t)[: (t.numel() * t.element_size()) // cb * cb].view(-1, cb) for t in tensors]
        stage_views = [b[: capacity * cb].view(capacity, cb) for b in st.buffers]
        n_buffers = 2 if self.double_buffer else 1

        # Per block: staging row = position in the block; host runs break where addresses do.
        n = host_addr.size
        block_of = np.arange(n, dtype=np.int64) // capacity
        pos_all = np.arange(n, dtype=np.int64) % capacity
        starts = np.flatnonzero(np.concatenate(([True], (np.diff(host_addr) != cb) | (np.diff(block_of) != 0))))
        run_len = np.diff(np.append(starts, n)) * cb
        index_parts: list[np.ndarray] = []
        index_size = 0
        pending: list[tuple[int, int, int, int, tuple[int, int] | None]] = []  # block, tensor, rows at, n, span
        blocks: list[_Block] = []
        for b in range(int(block_of[-1]) + 1):
            lo_u, hi_u = b * capacity, min(n, (b + 1) * capacity)
            buf = b % n_buffers
            base = st.buffers[buf].data_ptr()
            i0, i1 = np.searchsorted(starts, (lo_u, hi_u))
            r, length = starts[i0:i1], run_len[i0:i1]
            stage_addr = base + pos_all[r] * cb
            dst, src = (host_addr[r], stage_addr) if d2h else (stage_addr, host_addr[r])
            copies = Fragments(dst=dst, dst_pitch=length, src=src, src_pitch=length, width=length,
                               height=np.ones_like(length))  # fmt: skip
            blocks.append(_Block(buf, [], copies))
            w = which[lo_u:hi_u]
            order = np.argsort(w, kind="stable")
            w_sorted = w[order]
            cuts = np.flatnonzero(np.concatenate(([True], np.diff(w_sorted) != 0, [True])))
            for g0, g1 in zip(cuts[:-1], cuts[1:], strict=True):
                units = order[g0:g1]
                pos = pos_all[lo_u:hi_u][units]
                span = (int(pos[0]), int(pos[-1]) + 1) if pos[-1] - pos[0] == pos.size - 1 else None
                index_parts += [offset[lo_u:hi_u][units] // cb, pos]
                pending.append((b, int(w_sorted[g0]), index_size, pos.size, span))
                index_size += 2 * pos.size
        # One upload of every index array, on the launch stream (where the pack reads them).
        flat = torch.from_numpy(np.concatenate(index_parts))
        if route.on_cuda:
            flat = _upload(flat, route.device, stream, st.buffers)
        for b, t, at, count, span in pending:
            blocks[b].groups.append(_Group(views[t], flat[at : at + count], flat[at + count : at + 2 * count], span))
        pack = _pack_d2h if d2h else _scatter_h2d
        if not route.on_cuda:
            memory = TensorMemory((*st.buffers, *plan.tensors))

            def cpu_issue() -> None:
                with st.lock:
                    for blk in blocks:
                        stage = stage_views[blk.buffer]
                        if d2h:
                            pack(blk.groups, stage)
                            memory.copy(blk.copies)
                        else:
                            memory.copy(blk.copies)
                            pack(blk.groups, stage)
                _ = plan  # keeps the pools alive with the callable

            cpu_issue.blocks = blocks  # type: ignore[attr-defined]  # what tests inspect
            return cpu_issue
        return self._cuda_issue(plan, st, stream, blocks, stage_views, d2h)

    @staticmethod
    def _cuda_issue(plan: TransferPlan, st: _Staging, stream: Any, blocks: list[_Block],
                    stage_views: list[torch.Tensor], d2h: bool) -> Callable[[], None]:  # fmt: skip
        device = plan.route.device.index
        copy_stream = st.copy_stream
        if cuda_runtime_status()[0]:
            issuers = [DirectBackend.issuer(blk.copies) for blk in blocks]
        else:  # the extension cannot run here: the same copies through torch (cudaMemcpyAsync underneath)
            memory = TensorMemory((*st.buffers, *plan.tensors))
            issuers = [lambda s, f=blk.copies: memory.copy(f) for blk in blocks]

        def issue() -> None:
            with st.lock, torch.cuda.device(device):
                with torch.cuda.stream(stream):
                    if torch.cuda.is_current_stream_capturing():
                        raise RuntimeError("io-backend 'staged' cannot be captured in a CUDA graph")
                st.start.record(stream)
                copy_stream.wait_event(st.start)  # host memory: ordered after the launch stream's earlier work
                for blk, copies in zip(blocks, issuers, strict=True):
                    i = blk.buffer
                    stage = stage_views[i]
                    if d2h:
                        stream.wait_event(st.free[i])  # the previous copy out of this buffer finished
                        with torch.cuda.stream(stream):
                            _pack_d2h(blk.groups, stage)
                        st.ready[i].record(stream)
                        copy_stream.wait_event(st.ready[i])
                        with torch.cuda.stream(copy_stream):
                            copies(copy_stream)
                        st.free[i].record(copy_stream)
                    else:
                        copy_stream.wait_event(st.free[i])  # the previous scatter from this buffer finished
                        with torch.cuda.stream(copy_stream):
                            copies(copy_stream)
                        st.ready[i].record(copy_stream)
                        stream.wait_event(st.ready[i])
                        with torch.cuda.stream(stream):
                            _scatter_h2d(blk.groups, stage)
                        st.free[i].record(stream)
                st.end.record(copy_stream)
                stream.wait_event(st.end)  # later work on the launch stream sees every host copy done
            _ = plan  # keeps the pools alive with the callable

        issue.blocks = blocks  # type: ignore[attr-defined]
        return issue


def _upload(flat: torch.Tensor, device: torch.device, stream: Any, buffers: list[torch.Tensor]) -> torch.Tensor:
    """``flat`` (host indices) on ``device``, copied and allocated on ``stream``, where the packs read
    it; the staging buffers (allocated for the copy stream) marked as used on ``stream`` too, so the
    allocator never hands their memory out while either stream may still use it."""
    with torch.cuda.device(device.index), torch.cuda.stream(stream):
        for buf in buffers:
            buf.record_stream(stream)
        return flat.to(device, non_blocking=True)


def _pack_d2h(groups: list[_Group], stage: torch.Tensor) -> None:
    for g in groups:
        if g.span is not None:
            torch.index_select(g.device, 0, g.rows, out=stage[g.span[0] : g.span[1]])
        else:
            stage.index_copy_(0, g.pos, g.device.index_select(0, g.rows))


def _scatter_h2d(groups: list[_Group], stage: torch.Tensor) -> None:
    for g in groups:
        src = stage[g.span[0] : g.span[1]] if g.span is not None else stage.index_select(0, g.pos)
        g.device.index_copy_(0, g.rows, src)
