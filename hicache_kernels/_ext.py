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
    """Return ``hicache_kernels._C`` or raise :class:`BackendUnavailableError` naming the reason.

    The module imports without a driver, and its argument checks work there; whether its CUDA calls
    can run is :func:`cuda_runtime_status`.
    """
    mod, reason = _load()
    if mod is None:
        raise BackendUnavailableError(reason)
    return mod


def optional_attr(name: str) -> Any:
    """``hicache_kernels._C.<name>``, or None when the extension does not import (a pure-Python build)
    or predates ``name``: for the host-side helpers the package also has in Python, which callers use
    instead (same results, slower)."""
    mod, _ = _load()
    return None if mod is None else getattr(mod, name, None)


@functools.lru_cache(maxsize=1)
def driver_version() -> int:
    """The newest CUDA version the installed driver supports (e.g. 13000 for 13.0); 0 without a driver.

    The one place the package asks (tests replace it to play an old driver). Raises
    :class:`BackendUnavailableError` when the extension does not import.
    """
    return int(load_extension().driver_version())


@functools.lru_cache(maxsize=1)
def _runtime_cuda_version() -> int:
    return int(load_extension().build_info()["cuda_version"])


def required_driver_version() -> int:
    """The oldest driver CUDA version the extension's static runtime runs on: its major version's
    ``.0`` (CUDA minor-version compatibility), e.g. 13000 for a CUDA 13.x build."""
    return _archs.min_driver_version(_runtime_cuda_version())


def cuda_runtime_status() -> tuple[bool, str]:
    """``(True, "ok")`` when the extension imports and the driver can run its static CUDA runtime, else
    ``(False, reason)``: the extension's import error, no driver, or a driver too old (named with the
    version it supports and the one needed)."""
    mod, reason = _load()
    if mod is None:
        return False, reason
    try:
        have, need = driver_version(), required_driver_version()
    except RuntimeError as exc:  # cudaDriverGetVersion itself failed
        return False, f"cannot ask the CUDA driver for its version: {exc}"
    text = _archs.cuda_version_text
    built = text(_runtime_cuda_version())
    if have == 0:
        return False, (
            f"no CUDA driver is installed (cudaDriverGetVersion returned 0); the extension's static CUDA {built} "
            f"runtime needs an NVIDIA driver supporting CUDA {text(need)} or newer"
        )
    if have < need:
        return False, (
            f"the NVIDIA driver supports CUDA {text(have)}, older than the CUDA {text(need)} the "
            f"extension's static CUDA {built} runtime needs: update the driver"
        )
    return True, "ok"


def load_cuda_extension() -> ModuleType:
    """:func:`load_extension` for CUDA work: also raises :class:`BackendUnavailableError` when the
    driver cannot run the extension (:func:`cuda_runtime_status`), instead of failing at launch."""
    ok, reason = cuda_runtime_status()
    if not ok:
        raise BackendUnavailableError(reason)
    return load_extension()


def build_info() -> dict[str, Any]:
    """What this installation was built with.

    Returns a dict with ``cuda_built`` (bool), ``version`` (the version the build was given, with its
    local label, e.g. ``"0.1.0+cu130.sm90"``; None when setup.py left no record) and ``record`` (the
    build record setup.py wrote, ``_build_meta.json``). When the extension imports: ``archs`` (list of
    str such as ``["90", "100+PTX"]``), ``cuda_version`` (int, e.g. 13000) and ``cudart``, read from the
    compiled extension itself, ``min_driver_cuda_version`` (the oldest driver CUDA version its runtime
    runs on, e.g. 13000) and ``archs_source`` (which setting chose the archs); otherwise
    ``extension_error`` and, for a pure-Python build, ``skip_reason``.
    """
    meta = _read_meta()
    info: dict[str, Any] = {"cuda_built": bool(meta.get("cuda_built", False)), "version": meta.get("version")}
    mod, reason = _load()
    if mod is not None:
        ext = mod.build_info()
        info.update(
            cuda_built=True,
            archs=[str(a) for a in _archs.parse_arch_list(ext["archs"], supported=None)],
            cuda_version=int(ext["cuda_version"]),
            cudart=ext["cudart"],
            min_driver_cuda_version=_archs.min_driver_version(int(ext["cuda_version"])),
            archs_source=meta.get("archs_source", "unknown"),
        )
    else:
        info["extension_error"] = reason
        if "skip_reason" in meta:
            info["skip_reason"] = meta["skip_reason"]
    info["record"] = meta
    return info
