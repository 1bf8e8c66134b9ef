"""io-backends: six ways to execute a :class:`~hicache_kernels.plan.TransferPlan`, selected by name.

===========  =====================================================================================
``direct``   copy engines: runs of consecutive slots merged, one ``cudaMemcpyAsync`` (or
             ``cudaMemcpy2DAsync`` for strided rows) per run, layer, K/V and chunk. The baseline.
             On CPU tensors the same fragments are copied with torch.
``batch``    the same fragments split into 1-D pieces, all in one ``cudaMemcpyBatchAsync``
             (CUDA >= 12.8). Falls back to ``direct`` on the legacy default stream (which the call
             refuses) or when the driver does not support the call, and says so with a warning and
             in ``last_fallback``; any other error raises.
``kernel``   the CUDA kernels of ``csrc/``: SM threads read/write pinned host memory through its
             device-mapped address (zero copy), on a bounded grid (``num_blocks`` CTAs of
             ``warps_per_block`` warps; default 4 SMs' worth: 16 CTAs of 8 warps).
``triton``   the same gather/scatter in Triton (zero copy as well); on CPU tensors under
             ``TRITON_INTERPRET=1``.
``auto``     per call, the design a benchmark measured fastest for the direction and fragment size
             (:class:`AutoBackend`; its decision table persists in a JSON file).
``staged``   copy engines through a bounded, double-buffered GPU staging buffer packed in host
             address order (:class:`StagedBackend`).
===========  =====================================================================================

All run on ``plan.stream`` or the current CUDA stream of the device pool's device, with that device
current for the launch (the caller's current device is restored), and never synchronise the host,
except that copy-engine backends need the indices on the host: CUDA index tensors are copied over (a
sync). ``kernel`` and ``batch`` (and ``direct``'s ``cudaMemcpyAsync``) run the extension's static
CUDA runtime, which needs a driver for its CUDA major version: on an older one ``kernel`` and
``batch`` are unavailable (:class:`~hicache_kernels.BackendUnavailableError` says why) and ``direct``
copies with torch.

The family, one module each, over :mod:`~hicache_kernels.backends.base` (:class:`IOBackend` and the
helpers they share): :mod:`~hicache_kernels.backends.copy_engine` (``direct``, ``batch``),
:mod:`~hicache_kernels.backends.kernel`, :mod:`~hicache_kernels.backends.triton`,
:mod:`~hicache_kernels.backends.staged` and :mod:`~hicache_kernels.backends.auto`. This module
names them (:func:`get_backend`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._names import IO_BACKENDS
from .auto import AUTO_DESIGNS, AutoBackend, fragment_bucket
from .base import IOBackend
from .copy_engine import BatchBackend, DirectBackend
from .kernel import KernelBackend
from .staged import StagedBackend
from .triton import TritonBackend

__all__ = [
    "AUTO_DESIGNS",
    "IO_BACKENDS",
    "AutoBackend",
    "BatchBackend",
    "DirectBackend",
    "IOBackend",
    "KernelBackend",
    "StagedBackend",
    "TritonBackend",
    "fragment_bucket",
    "get_backend",
]

_FACTORIES: dict[str, Callable[..., IOBackend]] = {
    "direct": DirectBackend,
    "batch": BatchBackend,
    "kernel": KernelBackend,
    "triton": TritonBackend,
    "auto": AutoBackend,
    "staged": StagedBackend,
}
assert tuple(_FACTORIES) == IO_BACKENDS, "hicache_kernels._names.IO_BACKENDS lists the backends named here"
_DEFAULTS: dict[str, IOBackend] = {}


def get_backend(name: str | IOBackend, **options: Any) -> IOBackend:
    """An io-backend by name.

    Parameters
    ----------
    name : str or IOBackend
        ``direct``, ``batch``, ``kernel``, ``triton``, ``auto`` or ``staged``; an :class:`IOBackend`
        instance is returned as it is.
    **options
        Constructor arguments, e.g. ``get_backend("kernel", num_blocks=2)``: a new instance is built.
        Without options the shared instance is returned (its caches live across calls).

    Returns
    -------
    IOBackend
        The backend.

    Raises
    ------
    TypeError
        ``name`` is neither a str nor an IOBackend.
    ValueError
        An unknown name, or options given with an instance.
    """
    if isinstance(name, IOBackend):
        if options:
            raise ValueError("options: cannot be combined with a backend instance")
        return name
    if not isinstance(name, str):  # before the lookup: an unhashable name would raise an unrelated TypeError
        raise TypeError(f"backend: expected a backend name (str) or an IOBackend, got {type(name).__name__}")
    if name not in _FACTORIES:
        raise ValueError(f"backend: expected one of {', '.join(IO_BACKENDS)}, got {name!r}")
    if options:
        return _FACTORIES[name](**options)
    if name not in _DEFAULTS:
        _DEFAULTS[name] = _FACTORIES[name]()
    return _DEFAULTS[name]
