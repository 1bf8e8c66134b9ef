"""The io-backend family's base (:mod:`hicache_kernels.backends` selects among them): :class:`IOBackend`
and the helpers every backend shares, for the stream a plan's copies go on, the device current for a
launch, and why a backend cannot run a plan."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ._ext import BackendUnavailableError
from .plan import TransferPlan

__all__ = ["IOBackend", "cuda_reason", "nothing", "on_device", "pinned_reason", "plan_stream", "stream_handle"]


def plan_stream(plan: TransferPlan) -> Any:
    """``plan.stream`` (which must be on the device pool's device) or that device's current stream."""
    device = plan.route.device
    if plan.stream is None:
        return torch.cuda.current_stream(device)
    if plan.stream.device != device:
        raise ValueError(
            f"stream: expected a stream on the device pool's device {device}, got one on {plan.stream.device}"
        )
    return plan.stream


def stream_handle(plan: TransferPlan) -> tuple[int, Any]:
    """``(handle, stream)`` of the launch stream: ``plan.stream`` (checked as :func:`plan_stream` does), or
    the device's current stream, then only its handle (``stream`` None), read without building a
    Stream object."""
    if plan.stream is None:
        return torch._C._cuda_getCurrentRawStream(plan.route.device.index), None
    stream = plan_stream(plan)
    return stream.cuda_stream, stream


def on_device(plan: TransferPlan) -> Any:
    """The device pool's device made current for a launch, and the caller's restored afterwards: the
    extension launches on the current device, and a pool on cuda:1 must not launch on cuda:0."""
    return torch.cuda.device(plan.route.device.index)


class IOBackend:
    """Base class: ``run(plan)`` executes a plan; ``unavailable(plan)`` says why it cannot, or None;
    ``prepare(plan)`` does the host-side work ahead and returns the copy to issue later. What does not
    change between calls (device tables, host aliases, kernel descriptors) is kept with the plan's
    route (``plan.route.launch_state``), so only the first call for a route builds it."""

    name = "base"

    def unavailable(self, plan: TransferPlan) -> str | None:
        return None

    def wants_host_indices(self, plan: TransferPlan) -> bool:
        """Whether this backend plans from indices on the host (CUDA index tensors are copied over, a
        sync): a caller issuing several copies with the same indices moves them once."""
        return False

    def run(self, plan: TransferPlan) -> None:
        self.prepare(plan)()

    def prepare(self, plan: TransferPlan) -> Callable[[], None]:
        """Check ``plan`` and do now the host-side work that does not depend on when the copy is issued
        (for the copy engines: planning fragments and building their pointer arrays); return a callable
        that issues the copy. ``run(plan)`` is ``prepare(plan)()``.

        The callable issues on ``plan.stream``, or the device's stream current when ``prepare`` was
        called, and may be called any number of times: it copies what the pools hold then. Indices:
        ``direct`` and ``batch`` plan from them here, once (host indices; device ones are copied to
        the host, a sync); ``kernel`` copies host indices to the device here and reads device index
        tensors at every issue (so they may be rewritten in place between issues, as under graph
        capture); ``triton`` does all its work at issue. The callable keeps what it needs alive.
        """
        reason = self.unavailable(plan)
        if reason is not None:
            raise BackendUnavailableError(f"io-backend {self.name!r}: {reason}")
        return self._prepare(plan)

    def _prepare(self, plan: TransferPlan) -> Callable[[], None]:
        return functools.partial(self._run, plan)

    def _run(self, plan: TransferPlan) -> None:
        raise NotImplementedError


def nothing() -> None:
    pass


def cuda_reason(plan: TransferPlan) -> str | None:
    if not plan.route.on_cuda:
        return "needs the device pool on a CUDA GPU (got CPU tensors)"
    return None


def pinned_reason(plan: TransferPlan) -> str | None:
    if not plan.route.gpu_addressable:  # decided once, when the pools were bound
        return "host: reads and writes host memory directly, so the host pool must be pinned (pin_memory=True)"
    return None
