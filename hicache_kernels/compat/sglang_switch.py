"""The switch that makes SGLang's host pools move KV with this package's kernels.

With ``HICACHE_SGL_KERNEL=1`` in the environment of every SGLang process, the ``hicache_kernels_sgl.pth``
file this package's wheel installs calls :func:`install` at interpreter start-up (SGLang spawns its
scheduler processes, so setting it in one process is not enough; the variable is inherited). It is off
by default: without the variable the ``.pth`` line imports nothing.

:func:`install` puts an import hook first on ``sys.meta_path``. When SGLang imports one of its host-pool
modules (:data:`TARGETS`: ``memory_pool_host``, ``pool_host.mha``, ``pool_host.mla``,
``pool_host.mamba``, ``pool_host.unified``, ``pool_host.common``, ``pool_host.dsa``,
``pool_host.minimax_m3_nvfp4``, ``hisparse_memory_pool``, ``embedding_cache_controller``: every SGLang
0.5.23 module that imports from ``sgl_kernel.kvcacheio``; SGLang's Mamba transfer module
``sglang.kernels.ops.mamba.transfer_mamba``; and sgl-kernel's ``sgl_kernel.kvcacheio`` where it is
installed), the hook runs the module as usual and then:

- binds every ``sgl_kernel.kvcacheio`` function the module calls (:data:`KVCACHEIO`) and the two Mamba
  state transfers (:data:`MAMBA`) to :mod:`hicache_kernels.compat.sgl_kernel`'s function of the same
  name, whether or not the module imported the original (on a CPU, or without sgl-kernel, SGLang imports
  none: the pools then have ours);
- makes ``pool_host.common`` build SGLang's pointer tables with the compat
  ``get_device_accessible_ptr`` (:data:`RESOLVER`);
- turns SGLang's JIT HiCache kernels off (:data:`JIT_PREDICATES` answer False), which the pools would
  otherwise take first for the ``kernel`` io-backend.

A module imported before :func:`install` ran is patched at once (pools built before keep their JIT
choice). :func:`status` says whether the switch is on and which modules it patched; ``python -m
hicache_kernels.info`` and ``python -m hicache.info`` print it. This module imports nothing heavy until a
target module loads.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from types import ModuleType
from typing import Any

__all__ = [
    "ENV",
    "JIT_PREDICATES",
    "KVCACHEIO",
    "MAMBA",
    "PTH_LINE",
    "RESOLVER",
    "PTH_NAME",
    "TARGETS",
    "install",
    "install_from_env",
    "status",
    "uninstall",
]

ENV = "HICACHE_SGL_KERNEL"
#: The file the wheel installs at the top of site-packages, and its one line: imports nothing unless the
#: variable is set (setup.py reads both from this file).
PTH_NAME = "hicache_kernels_sgl.pth"
PTH_LINE = (
    'import os; os.environ.get("HICACHE_SGL_KERNEL", "0") != "0" and '
    '__import__("hicache_kernels.compat.sglang_switch", fromlist=["install_from_env"]).install_from_env()\n'
)
#: SGLang 0.5.23's modules that import from ``sgl_kernel.kvcacheio``, and ``sgl_kernel.kvcacheio``
#: itself (where sgl-kernel is installed), so that whatever imports a transfer from it after the switch
#: is on (SGLang's other modules, sgl-kernel's own tests) gets this package's.
TARGETS = (
    "sgl_kernel.kvcacheio",
    "sglang.kernels.ops.mamba.transfer_mamba",
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4",
    "sglang.srt.mem_cache.hisparse_memory_pool",
    "sglang.srt.mem_cache.embedding_cache_controller",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.pool_host.unified",
)
#: The transfer functions those modules import from ``sgl_kernel.kvcacheio`` (SGLang 0.5.23).
KVCACHEIO = (
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
    "get_device_accessible_ptr",
    "transfer_embedding_ranges_direct",
)
#: The Mamba state transfers SGLang 0.5.23's ``pool_host.mamba`` imports from its own JIT module
#: ``sglang.kernels.ops.mamba.transfer_mamba`` (not from sgl-kernel).
MAMBA = ("transfer_kv_mamba_lf_pf", "transfer_kv_mamba_pf_lf")
#: ``pool_host.common``'s resolver of ``get_device_accessible_ptr`` (imported lazily inside it, so the
#: resolver itself is replaced: SGLang's pointer tables then come from the compat function).
RESOLVER = "_resolve_device_accessible_ptr_fn"
#: SGLang's predicates that choose its JIT HiCache kernels.
JIT_PREDICATES = ("can_use_hicache_jit_kernel", "can_use_write_back_jit_kernel")

_lock = threading.Lock()
_patched: list[str] = []


def _no_jit(*args: Any, **kwargs: Any) -> bool:
    """HICACHE_SGL_KERNEL=1: SGLang's JIT HiCache kernels are off; hicache_kernels' compat functions run."""
    return False


def _compat_resolver() -> Any:
    """HICACHE_SGL_KERNEL=1: SGLang's pointer tables take their addresses from the compat function."""
    from .sgl_kernel import get_device_accessible_ptr

    return get_device_accessible_ptr


def _patch(module: ModuleType) -> None:
    from . import sgl_kernel as compat

    for name in (*KVCACHEIO, *MAMBA):
        setattr(module, name, getattr(compat, name))
    if hasattr(module, RESOLVER):
        setattr(module, RESOLVER, _compat_resolver)
    for name in JIT_PREDICATES:
        if hasattr(module, name):
            setattr(module, name, _no_jit)
    module.__hicache_sgl_kernel__ = True
    with _lock:
        if module.__name__ not in _patched:
            _patched.append(module.__name__)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the target modules through the other finders and wraps their loaders."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _finder() -> _Finder | None:
    return next((f for f in sys.meta_path if isinstance(f, _Finder)), None)


def install() -> bool:
    """Turn the switch on in this process (idempotent); True when this call turned it on."""
    with _lock:
        if _finder() is not None:
            return False
        sys.meta_path.insert(0, _Finder())
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None and not getattr(module, "__hicache_sgl_kernel__", False):
            _patch(module)
    return True


def install_from_env() -> bool:
    """:func:`install` when ``HICACHE_SGL_KERNEL=1`` (what the ``.pth`` file calls); else nothing."""
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        print(f"hicache_kernels: {ENV}={value!r} is not 0 or 1; the SGLang kernel switch stays off", file=sys.stderr)
        return False
    return value == "1" and install()


def uninstall() -> None:
    """Remove the import hook (modules already patched stay patched); for tests."""
    with _lock:
        finder = _finder()
        if finder is not None:
            sys.meta_path.remove(finder)


def status() -> dict[str, Any]:
    """``{"env": HICACHE_SGL_KERNEL's value or None, "on": whether the hook is installed, "patched": the
    SGLang modules patched so far}``."""
    with _lock:
        return {"env": os.environ.get(ENV), "on": _finder() is not None, "patched": list(_patched)}
