"""Locating the CUDA tools the CPU-side build checks use."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
NVCC = CUDA_HOME / "bin" / "nvcc"


def cuobjdump() -> str:
    """cuobjdump from PATH, the CUDA toolkit, or the copy Triton's wheel ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    if (CUDA_HOME / "bin" / "cuobjdump").exists():
        return str(CUDA_HOME / "bin" / "cuobjdump")
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    assert path.exists(), "no cuobjdump: install the CUDA toolkit or triton"
    return str(path)
