"""Copy-engine planning: turn a transfer into few, large memcpy fragments.

Index pairs are sorted by source slot, then runs where both the source and the destination slot
advance by one (and neither crosses a page boundary of its layout) are merged. Each run becomes, per
(kv, layer, chunk), one *fragment*: ``height`` rows of ``width`` bytes, rows ``src_pitch`` /
``dst_pitch`` bytes apart — a plain ``cudaMemcpyAsync`` when both sides are contiguous, else one
``cudaMemcpy2DAsync``. :func:`split_rows` flattens fragments into 1-D pieces for
``cudaMemcpyBatchAsync``, which only takes 1-D copies.

Everything here is vectorised numpy on the host; the indices must be on the host (a CUDA index
tensor is copied over, which synchronises).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .plan import Side, TransferPlan


@dataclass
class Fragments:
    """Parallel int64 arrays, one entry per fragment; addresses and sizes in bytes."""

    dst: np.ndarray
    dst_pitch: np.ndarray
    src: np.ndarray
    src_pitch: np.ndarray
    width: np.ndarray
    height: np.ndarray

    def __len__(self) -> int:
        return int(self.dst.shape[0])

    @property
    def total_bytes(self) -> int:
        return int((self.width * self.height).sum())


def _row_pitch(side: Side) -> int:
    """Bytes between consecutive slots of one page (consecutive slots when there are no pages)."""
    return side.s_in_page if side.page_size > 1 else side.s_page


def find_runs(src_idx: np.ndarray, dst_idx: np.ndarray, src_page: int, dst_page: int) -> tuple[np.ndarray, ...]:
    """Sort pairs by source slot and merge consecutive ones.

    Returns ``(src_start, dst_start, length)`` arrays. A run continues while both indices advance by
    exactly one and neither side enters a new page (page sizes of 1 mean no pages).
    """
    if src_idx.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    order = np.argsort(src_idx, kind="stable")
    s, d = src_idx[order], dst_idx[order]
    cont = (np.diff(s) == 1) & (np.diff(d) == 1)
    if src_page > 1:
        cont &= s[1:] % src_page != 0
    if dst_page > 1:
        cont &= d[1:] % dst_page != 0
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.diff(np.append(starts, s.size))
    return s[starts], d[starts], lengths.astype(np.int64)


def host_indices(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.int64).numpy()


def plan_fragments(plan: TransferPlan) -> Fragments:
    """Merge the plan's index pairs into fragments (see module docstring)."""
    src_idx, dst_idx = host_indices(plan.src_indices), host_indices(plan.dst_indices)
    # Guard every access, as the kernels do: an out-of-range pair (possible when the plan was not
    # checked) is dropped, never copied.
    ok = (src_idx >= 0) & (src_idx < plan.src.num_slots) & (dst_idx >= 0) & (dst_idx < plan.dst.num_slots)
    s0, d0, length = find_runs(src_idx[ok], dst_idx[ok], plan.src.page_size, plan.dst.page_size)
    layers = np.arange(plan.layer_begin, plan.layer_begin + plan.layer_count, dtype=np.int64)
    kv, layer, chunk = (
        a.reshape(-1) for a in np.meshgrid(np.arange(plan.num_kv), layers, np.arange(plan.num_chunks), indexing="ij")
    )
    # Every run x every (kv, layer, chunk): runs outermost so that one run's pieces are adjacent.
    R, U = s0.size, kv.size
    rs, rd, rl = (np.repeat(a, U) for a in (s0, d0, length))
    kv, layer, chunk = (np.tile(a, R) for a in (kv, layer, chunk))
    n = R * U
    return Fragments(
        dst=plan.dst.addresses(kv, layer, rd, chunk),
        dst_pitch=np.full(n, _row_pitch(plan.dst), dtype=np.int64),
        src=plan.src.addresses(kv, layer, rs, chunk),
        src_pitch=np.full(n, _row_pitch(plan.src), dtype=np.int64),
        width=np.full(n, plan.chunk_bytes, dtype=np.int64),
        height=rl,
    )


def split_rows(f: Fragments) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """1-D pieces ``(dst, src, size)`` covering the fragments: a fragment whose rows are contiguous on
    both sides stays one piece, any other becomes one piece per row."""
    contiguous = (f.height == 1) | ((f.src_pitch == f.width) & (f.dst_pitch == f.width))
    rows = np.where(contiguous, 1, f.height)
    rep = np.repeat(np.arange(len(f)), rows)
    # Row number within its fragment: position minus the fragment's first position.
    first = np.repeat(np.cumsum(rows) - rows, rows)
    r = np.arange(rep.size, dtype=np.int64) - first
    size = np.where(contiguous, f.width * f.height, f.width)[rep]
    return f.dst[rep] + r * f.dst_pitch[rep], f.src[rep] + r * f.src_pitch[rep], size


class TensorMemory:
    """Executes fragments with torch copies between views of the transfer's tensors.

    This is the ``direct`` backend on CPU tensors (and on CUDA when the extension is not built), and
    the CPU check of the copy-engine plans: with the extension the GPU path issues the very same
    fragments to ``cudaMemcpy2DAsync`` / ``cudaMemcpyBatchAsync``.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self._spans = sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t) for t in tensors if t.numel()
        )

    def _view(self, addr: int, rows: int, width: int, pitch: int) -> torch.Tensor:
        for lo, hi, t in self._spans:
            if lo <= addr < hi:
                end = addr + (rows - 1) * pitch + width
                if end > hi:
                    raise IndexError(f"fragment at {addr:#x} (+{end - addr} B) runs past its tensor")
                flat = t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)
                # as_strided's offset counts from the storage's start, not the view's.
                return flat.as_strided((rows, width), (pitch, 1), flat.storage_offset() + addr - lo)
        raise IndexError(f"address {addr:#x} is in none of the transfer's tensors")

    def copy(self, f: Fragments) -> None:
        for i in range(len(f)):
            h, w = int(f.height[i]), int(f.width[i])
            dst = self._view(int(f.dst[i]), h, w, int(f.dst_pitch[i]))
            dst.copy_(self._view(int(f.src[i]), h, w, int(f.src_pitch[i])), non_blocking=True)

    def copy_pieces(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> None:
        for a, b, n in zip(dst.tolist(), src.tolist(), size.tolist(), strict=True):
            self._view(a, 1, n, n).copy_(self._view(b, 1, n, n), non_blocking=True)
