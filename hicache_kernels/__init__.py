"""hicache-kernels: move KV-cache pages between layer-first GPU pools and page-first pinned host pools.

Importing the package is cheap: torch, Triton and the CUDA extension load only when first needed.
"""

from __future__ import annotations

from ._ext import BackendUnavailableError, build_info, extension_status

__version__ = "0.1.0"

__all__ = ["BackendUnavailableError", "__version__", "build_info", "extension_status"]
