"""The copy-engine io-backends: ``direct`` and ``batch``.

``direct`` issues one ``cudaMemcpyAsync`` (or 2-D copy) per run of consecutive slots, layer, K/V and
chunk; torch copies of the same fragments on CPU tensors or without a usable extension. The baseline
the others are measured against. ``batch`` issues the same fragments, split into 1-D pieces, in one
``cudaMemcpyBatchAsync`` (CUDA >= 12.8), falling back to ``direct`` where that call cannot run.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._ext import cuda_runtime_status, load_extension
from ..fragments import Fragments, TensorMemory, plan_fragments, split_rows
from ..plan import TransferPlan
from .base import IOBackend, nothing, plan_stream

__all__ = ["BatchBackend", "DirectBackend", "legacy_stream_reason"]

# Stream handles cudaMemcpyBatchAsync refuses: the NULL (legacy default) stream and cudaStreamLegacy.
_LEGACY_STREAM_HANDLES = (0, 1)

# cudaMemcpyBatchAsync errors that mean "not here" (not built in, driver too old), after which
# per-fragment copies are the documented fallback. Any other error (cudaErrorInvalidValue,
# cudaErrorInvalidResourceHandle, ...) is a broken call and raises: it must not pass for a backend
# that works. The legacy stream, which the call refuses, is recognised before calling.
_BATCH_FALLBACK_ERRORS = ("cudaErrorNotSupported", "cudaErrorCallRequiresNewerDriver")

_LEGACY_STREAM_REFUSED = "the legacy default stream is refused by cudaMemcpyBatchAsync"


def legacy_stream_reason(plan: TransferPlan) -> str | None:
    """Why ``cudaMemcpyBatchAsync`` refuses ``plan``'s stream (the legacy default stream), or None.

    ``batch`` falls back to ``direct`` there; ``auto`` does not choose ``batch`` for it.
    """
    if plan_stream(plan).cuda_stream in _LEGACY_STREAM_HANDLES:
        return _LEGACY_STREAM_REFUSED
    return None


class DirectBackend(IOBackend):
    """Copy-engine baseline (see module docstring)."""

    name = "direct"

    def wants_host_indices(self, plan: TransferPlan) -> bool:
        return True

    def _prepare(self, plan: TransferPlan) -> Callable[[], None]:
        frags = plan_fragments(plan)
        if len(frags) == 0:
            return nothing
        if not plan.route.on_cuda:
            return functools.partial(TensorMemory(plan.tensors).copy, frags)
        stream = plan_stream(plan)
        device = plan.route.device.index
        if not cuda_runtime_status()[0]:
            # Without a usable extension (not built, or a driver older than its static runtime): the
            # same fragments as torch copies (cudaMemcpyAsync underneath); info says so.
            memory = TensorMemory(plan.tensors)

            def torch_copies() -> None:
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    memory.copy(frags)

            return torch_copies
        issue = self.issuer(frags)

        def copies() -> None:
            with torch.cuda.device(device):  # the extension issues on the current device
                issue(stream)
            _ = plan  # keeps the pools the fragments point into alive with the callable

        return copies

    @staticmethod
    def issuer(fragments: Fragments) -> Callable[[Any], None]:
        """A callable issuing ``fragments`` on a given stream through the extension, its arrays built now."""
        f = fragments
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (f.dst, f.dst_pitch, f.src, f.src_pitch, f.width,
                                                                   f.height)]  # fmt: skip
        pointers = [a.ctypes.data for a in arrays]
        count = len(f)
        ext = load_extension()

        def issue(stream: Any) -> None:
            ext.memcpy_fragments(*pointers, count, stream.cuda_stream)
            _ = arrays  # the pointers above point into these: keep them alive with the callable

        return issue


class BatchBackend(IOBackend):
    """All fragments in one ``cudaMemcpyBatchAsync``.

    Falls back to ``direct`` on the legacy default stream (which the call refuses) or when the driver
    does not support the call, and says so with a warning (once per reason) and in ``last_fallback``;
    any other error raises. On CPU tensors the pieces are copied with torch.
    """

    name = "batch"

    def __init__(self) -> None:
        self.last_fallback: str | None = None
        self._warned: set[str] = set()

    def unavailable(self, plan: TransferPlan) -> str | None:
        if not plan.route.on_cuda:
            return None  # CPU tensors: the pieces are copied with torch
        ok, reason = cuda_runtime_status()
        return None if ok else reason

    def wants_host_indices(self, plan: TransferPlan) -> bool:
        return True

    def _fallback(self, reason: str, issue_direct: Callable[[Any], None], stream: Any) -> None:
        self.last_fallback = reason
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"io-backend 'batch' fell back to 'direct': {reason}", RuntimeWarning, stacklevel=4)
        issue_direct(stream)

    def _prepare(self, plan: TransferPlan) -> Callable[[], None]:
        frags = plan_fragments(plan)
        if len(frags) == 0:
            return nothing
        dst, src, size = split_rows(frags)
        if not plan.route.on_cuda:
            memory = TensorMemory(plan.tensors)

            def pieces() -> None:
                self.last_fallback = None
                memory.copy_pieces(dst, src, size)

            return pieces
        ext = load_extension()
        stream = plan_stream(plan)
        device = plan.route.device.index
        issue_direct = DirectBackend.issuer(frags)  # the fallback, ready without planning again
        if stream.cuda_stream in _LEGACY_STREAM_HANDLES:

            def legacy() -> None:
                with torch.cuda.device(device):
                    self._fallback(_LEGACY_STREAM_REFUSED, issue_direct, stream)
                _ = plan  # keeps the pools alive with the callable

            return legacy
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, size)]
        pointers = [a.ctypes.data for a in arrays]
        count, h2d = int(arrays[2].size), int(plan.direction == "h2d")

        def batch() -> None:
            self.last_fallback = None
            with torch.cuda.device(device):
                code = ext.memcpy_batch(*pointers, count, h2d, stream.cuda_stream)
                if code != 0:
                    name = ext.error_name(code)
                    if name not in _BATCH_FALLBACK_ERRORS:
                        raise RuntimeError(f"io-backend 'batch': cudaMemcpyBatchAsync failed: {name} (error {code})")
                    self._fallback(f"cudaMemcpyBatchAsync returned {name}", issue_direct, stream)
            _ = arrays, plan  # keep the arrays the pointers point into, and the pools, alive with the callable

        return batch
