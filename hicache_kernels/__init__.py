"""hicache-kernels: move KV-cache pages between layer-first GPU pools and page-first pinned host pools.

Importing the package is cheap: torch, Triton and the CUDA extension load only when first needed
(``KVBinding`` and ``copy_ranges``, the pointer-list copy of :mod:`hicache_kernels.ranges`, import torch
when first asked for).
"""

from __future__ import annotations

from typing import Any

from ._ext import BackendUnavailableError, build_info, extension_status

__version__ = "0.1.0"

__all__ = ["BackendUnavailableError", "KVBinding", "__version__", "build_info", "copy_ranges", "extension_status"]


def __getattr__(name: str) -> Any:
    if name == "KVBinding":
        from .binding import KVBinding

        return KVBinding
    if name == "copy_ranges":
        from .ranges import copy_ranges

        return copy_ranges
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
