"""The io-backend family's base: :class:`IOBackend` and the helpers every backend shares, for the stream a
plan's copies go on, the device current for a launch, the preparation of a zero-copy CUDA launch
(:func:`prepare_gpu_launch`, :func:`device_indices`: the ``kernel`` and ``triton`` backends), and why a
backend cannot run a plan. Every module of :mod:`hicache_kernels.backends` builds on this one."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import launch, uploads
from .._ext import BackendUnavailableError
from ..plan import TransferPlan

__all__ = [
    "GpuLaunch",
    "IOBackend",
    "cuda_reason",
    "device_indices",
    "nothing",
    "on_device",
    "pinned_reason",
    "plan_stream",
    "prepare_gpu_launch",
    "stream_handle",
]


def plan_stream(plan: TransferPlan) -> Any:
    """The stream ``plan``'s copies go on.

    Parameters
    ----------
    plan : TransferPlan
        The plan; ``plan.stream``, when given, must be on the device pool's device.

    Returns
    -------
    torch.cuda.Stream
        ``plan.stream``, or the current stream of the device pool's device.

    Raises
    ------
    ValueError
        ``plan.stream`` is on another device.
    """
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


class GpuLaunch(NamedTuple):
    """What a zero-copy CUDA launch of a plan is issued with (:func:`prepare_gpu_launch`)."""

    route: launch.GpuRoute
    """The route's descriptors with the addresses the GPU uses, its alignment and device tables."""
    handle: int
    """The launch stream's handle."""
    stream: Any
    """The launch stream: ``plan.stream``, or None for the device's current stream (known by ``handle``)."""


def prepare_gpu_launch(plan: TransferPlan) -> GpuLaunch:
    """The launch arguments of ``plan``'s route, built by its first launch and by its first on a stream.

    The first launch of a route builds its :class:`~hicache_kernels.launch.GpuRoute` (device tables
    uploaded, host aliases asked) with the device pool's device current, where the capture check (of
    that device's current stream) and the allocations must happen; the first launch on a stream tells
    the caching allocator that the stream reads the tables (not under CUDA-graph capture). Later
    launches on that stream only look the route up.

    Parameters
    ----------
    plan : TransferPlan
        A plan whose device pool is on a CUDA GPU.

    Returns
    -------
    GpuLaunch
        The route's launch arguments and the launch stream.

    Raises
    ------
    ValueError
        ``plan.stream`` is on another device than the device pool.
    RuntimeError
        The route's device tables must be built while the device's current stream captures a CUDA graph.
    """
    handle, stream = stream_handle(plan)
    gpu = plan.route.launch_state.get("gpu")
    if gpu is None or handle not in gpu.recorded:
        with on_device(plan):
            capture = launch.capturing()
            gpu = launch.gpu_route(plan, capturing=capture)
            if not capture:
                gpu.use_tables_on(handle, stream)
    return GpuLaunch(gpu, handle, stream)


def device_indices(plan: TransferPlan, device: torch.device, stream: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's index tensors on ``device``.

    Host indices are copied on the launch stream itself (``stream``, None for the current one):
    ordered before the kernel, and allocated for that stream. They go through the device's pinned
    upload ring (:mod:`hicache_kernels.uploads`: one copy for both, queued without waiting for the
    stream, which a copy from pageable memory would do). Indices already on ``device`` are returned
    as they are.
    """
    s_idx, d_idx = plan.src_indices, plan.dst_indices
    if s_idx.device == device and d_idx.device == device:
        return s_idx, d_idx
    if s_idx.device.type == "cpu" and d_idx.device.type == "cpu":
        ring = uploads.upload_ring(
            device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        )
        s_idx, d_idx = ring.upload((s_idx, d_idx), stream, capturing=launch.capturing())
        return s_idx, d_idx
    with torch.cuda.stream(stream):
        return (s_idx if s_idx.device == device else s_idx.to(device, non_blocking=True),
                d_idx if d_idx.device == device else d_idx.to(device, non_blocking=True))  # fmt: skip


class IOBackend:
    """Base class: ``run(plan)`` executes a plan; ``unavailable(plan)`` says why it cannot, or None;
    ``prepare(plan)`` does the host-side work ahead and returns the copy to issue later. What does not
    change between calls (device tables, host aliases, kernel descriptors) is kept with the plan's
    route (``plan.route.launch_state``), so only the first call for a route builds it.

    A backend subclasses this in its own module of :mod:`hicache_kernels.backends`, overriding
    ``_prepare(plan)`` (or ``_run(plan)``) and, where it cannot run every plan, ``unavailable(plan)``.
    """

    name = "base"

    def unavailable(self, plan: TransferPlan) -> str | None:
        """Why this backend cannot run ``plan``, or None when it can."""
        return None

    def wants_host_indices(self, plan: TransferPlan) -> bool:
        """Whether this backend plans from indices on the host (CUDA index tensors are copied over, a
        sync): a caller issuing several copies with the same indices moves them once."""
        return False

    def run(self, plan: TransferPlan) -> None:
        """Execute ``plan``: ``prepare(plan)()``."""
        self.prepare(plan)()

    def warm(self, plan: TransferPlan) -> bool:
        """Compile or load now what running ``plan``'s route launches, so its first real copy does not
        (a JIT compile, a lazily loaded CUDA module): ``plan`` has index pairs outside both pools, which
        the backends that warm skip (nothing is read or written). True when something was launched;
        False for a backend with nothing to compile or load (this default), or that cannot run ``plan``."""
        return False

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

        Raises
        ------
        BackendUnavailableError
            The backend cannot run ``plan`` (:meth:`unavailable` says why).
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
    """The copy of an empty plan: issues nothing."""


def cuda_reason(plan: TransferPlan) -> str | None:
    """Why a backend that needs the device pool on a CUDA GPU cannot run ``plan``, or None."""
    if not plan.route.on_cuda:
        return "needs the device pool on a CUDA GPU (got CPU tensors)"
    return None


def pinned_reason(plan: TransferPlan) -> str | None:
    """Why a backend addressing host memory from the GPU cannot run ``plan`` (a pageable host pool), or None."""
    if not plan.route.gpu_addressable:  # decided once, when the pools were bound
        return "host: reads and writes host memory directly, so the host pool must be pinned (pin_memory=True)"
    return None
