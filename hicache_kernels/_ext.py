"""One cached loader for the compiled extension ``hicache_kernels._C`` and the record of its build."""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from . import _archs

_META = Path(__file__).with_name("_build_meta.json")


class BackendUnavailableError(RuntimeError):
    """An io-backend cannot run here; the message says why (e.g. the extension was not built)."""


def _read_meta() -> dict[str, Any]:
    try:
        return json.loads(_META.read_text())
    except FileNotFoundError:
        return {"cuda_built": False, "skip_reason": "package was not built by setup.py (no _build_meta.json)"}


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ModuleType | None, str]:
    meta = _read_meta()
    try:
        mod = importlib.import_module("hicache_kernels._C")
    except ImportError as exc:
        if not meta.get("cuda_built", False):
            return None, f"the CUDA extension was not built: {meta.get('skip_reason', 'unknown reason')}"
        return None, f"the CUDA extension was built but does not import: {exc}"
    return mod, "ok"


def extension_status() -> tuple[bool, str]:
    """``(True, "ok")`` when the CUDA extension imports, else ``(False, reason)``."""
    mod, reason = _load()
    return mod is not None, reason


def load_extension() -> ModuleType:
    """Return ``hicache_kernels._C`` or raise :class:`BackendUnavailableError` naming the reason."""
    mod, reason = _load()
    if mod is None:
        raise BackendUnavailableError(reason)
    return mod


def build_info() -> dict[str, Any]:
    """What this installation was built with.

    Returns a dict with ``cuda_built`` (bool); when built, ``archs`` (list of str such as
    ``["90", "100+PTX"]``, read from the compiled extension itself), ``cuda_version`` (int, e.g.
    13000) and ``archs_source`` (which setting chose them); otherwise ``skip_reason``.
    """
    meta = _read_meta()
    info: dict[str, Any] = {"cuda_built": bool(meta.get("cuda_built", False))}
    mod, reason = _load()
    if mod is not None:
        ext = mod.build_info()
        info.update(
            cuda_built=True,
            archs=[str(a) for a in _archs.parse_arch_list(ext["archs"], supported=None)],
            cuda_version=int(ext["cuda_version"]),
            cudart=ext["cudart"],
            archs_source=meta.get("archs_source", "unknown"),
        )
    else:
        info["extension_error"] = reason
        if "skip_reason" in meta:
            info["skip_reason"] = meta["skip_reason"]
    return info
