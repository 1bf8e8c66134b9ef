"""One cached loader for the cache layer's compiled host core, ``hicache._core``.

The core (``csrc/host/``: plain C++ and pybind11, no CUDA, no torch) holds the radix tree
(``RadixTree``, :mod:`hicache.tree.core`), its eviction candidates (``CandidateHeap``,
:mod:`hicache.tree.candidates`), the pools' page stack (``PageStack``, :mod:`hicache.pools.paged_slots`) and the
file backend's page checksum (``checksum_words``, ``pread_checksum``, :mod:`hicache.storage.checksum`).
``setup.py`` builds it with the host C++ compiler in every build, ``HICACHE_SKIP_CUDA=1`` and machines
without a CUDA toolkit included; it is missing only where the package was not built (or the build
broke), and :func:`core_status` then says so.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

__all__ = ["CoreUnavailableError", "core_attr", "core_file", "core_status", "load_core"]

CORE = "hicache._core"


class CoreUnavailableError(RuntimeError):
    """``hicache._core`` does not import; the message says why."""


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ModuleType | None, str]:
    try:
        mod = importlib.import_module(CORE)
    except ImportError as exc:
        return None, f"{CORE} is not built: {exc}"
    return mod, "ok"


def core_status() -> tuple[bool, str]:
    """``(True, "ok")`` when ``hicache._core`` imports, else ``(False, reason)``, e.g.
    ``"hicache._core is not built: No module named 'hicache._core'"``."""
    mod, reason = _load()
    return mod is not None, reason


def load_core() -> ModuleType:
    """``hicache._core``, or :class:`CoreUnavailableError` naming why it does not import."""
    mod, reason = _load()
    if mod is None:
        raise CoreUnavailableError(reason)
    return mod


def core_attr(name: str) -> Any:
    """``hicache._core.<name>``, or None when the core does not import: for the helpers the cache layer
    also has in Python (the page stack, the checksum), whose callers then take the Python path (same
    results, slower); :func:`core_status` says why. A core that imports but lacks ``name`` is a build
    out of step with the sources: ``AttributeError``."""
    mod, _ = _load()
    return None if mod is None else getattr(mod, name)


def core_file() -> str | None:
    """Where ``hicache._core`` was loaded from, or None when it does not import."""
    mod, _ = _load()
    return None if mod is None else mod.__file__
