"""The ``direct`` io-backend: the copy engines, one ``cudaMemcpyAsync`` (or 2-D copy) per run of
consecutive slots, layer, K/V and chunk; torch copies of the same fragments on CPU tensors or without a
usable extension. The baseline the others are measured against."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ._ext import cuda_runtime_status, load_extension
from .fragments import Fragments, TensorMemory, plan_fragments
from .iobackend import IOBackend, nothing, plan_stream
from .plan import TransferPlan


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
    def issuer(f: Fragments) -> Callable[[Any], None]:
        """A callable issuing ``f`` on a given stream through the extension, its arrays built now."""
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (f.dst, f.dst_pitch, f.src, f.src_pitch, f.width,
                                                                   f.height)]  # fmt: skip
        pointers = [a.ctypes.data for a in arrays]
        count = len(f)
        ext = load_extension()

        def issue(stream: Any) -> None:
            ext.memcpy_fragments(*pointers, count, stream.cuda_stream)
            _ = arrays  # the pointers above point into these: keep them alive with the callable

        return issue
