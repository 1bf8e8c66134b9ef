"""A pytest plugin that runs sgl-kernel's and SGLang's own transfer tests against this package.

    HICACHE_SGL_KERNEL=1 python -m pytest -p hicache_kernels.compat.pytest_plugin \\
        path/to/sgl-kernel/tests/test_kvcacheio.py path/to/test_hicache_direct_loadback.py

The upstream tests import the transfers from ``sgl_kernel.kvcacheio`` and two helpers from SGLang
(``sglang.srt.utils.is_hip``; ``sglang.test.ci.ci_register.register_cuda_ci``, which only files a test
with SGLang's CI). At start-up the plugin:

- turns the SGLang kernel switch on (:func:`hicache_kernels.compat.sglang_switch.install`), so a
  transfer imported from an installed ``sgl_kernel.kvcacheio`` is this package's;
- where sgl-kernel is not installed, registers a module ``sgl_kernel.kvcacheio`` holding this package's
  compat functions (:data:`~hicache_kernels.compat.sglang_switch.KVCACHEIO`) under their sgl-kernel names,
  and nothing else;
- where SGLang is not installed, registers those two helpers only: ``is_hip()`` answers whether torch is a
  ROCm build, ``register_cuda_ci`` does nothing;
- removes sgl-kernel's module-wide skip of ``test_kvcacheio.py`` on CUDA 13 (its reason names a segfault
  in sgl-kernel's own kernel, which does not run here); every other skip stays.

The report header says which of these happened, so a run cannot pass for the other thing. Load it only
for these tests (``-p``): it is not registered as an automatic plugin.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

#: What a skip mark's reason must contain to be removed: sgl-kernel's CUDA 13 skip of test_kvcacheio.py.
CUDA13_SKIP = "segfaults on CUDA 13"

_provided: list[str] = []
_removed: list[str] = []


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a parent that is not a package, or a broken __spec__
        return True


def _module(name: str, attrs: dict[str, Any], package: bool = False) -> ModuleType:
    module = ModuleType(name, f"Provided by {__name__} for the upstream tests (not the real {name}).")
    if package:
        module.__path__ = []  # a package with no files: only the provided submodules import
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _provide_sgl_kernel() -> None:
    from . import sgl_kernel as compat
    from .sglang_switch import KVCACHEIO

    _module("sgl_kernel", {}, package=True)
    _module("sgl_kernel.kvcacheio", {name: getattr(compat, name) for name in KVCACHEIO})
    _provided.append("sgl_kernel.kvcacheio (sgl-kernel is not installed): hicache_kernels.compat.sgl_kernel")


def _provide_sglang_helpers() -> None:
    import torch

    def is_hip() -> bool:
        return torch.version.hip is not None

    def register_cuda_ci(*args: Any, **kwargs: Any) -> None:
        """SGLang's CI registration; nothing to register here."""

    for name in ("sglang", "sglang.srt", "sglang.test", "sglang.test.ci"):
        _module(name, {}, package=True)
    _module("sglang.srt.utils", {"is_hip": is_hip})
    _module("sglang.test.ci.ci_register", {"register_cuda_ci": register_cuda_ci})
    _provided.append("sglang.srt.utils.is_hip, sglang.test.ci.ci_register (SGLang is not installed)")


def pytest_configure(config: Any) -> None:
    from . import sglang_switch

    sglang_switch.install()
    if _missing("sgl_kernel"):
        _provide_sgl_kernel()
    else:  # the switch patches it as it loads
        importlib.import_module("sgl_kernel.kvcacheio")
    if _missing("sglang"):
        _provide_sglang_helpers()


def _drop_cuda13_skip(node: Any) -> None:
    kept = []
    for mark in node.own_markers:
        if mark.name == "skipif" and CUDA13_SKIP in str(mark.kwargs.get("reason", "")):
            _removed.append(f"{node.nodeid}: {mark.kwargs['reason']}")
            continue
        kept.append(mark)
    node.own_markers[:] = kept


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    seen: set[int] = set()
    for item in items:
        for node in item.listchain():
            if id(node) not in seen:
                seen.add(id(node))
                _drop_cuda13_skip(node)


def _status_lines() -> list[str]:
    from . import sglang_switch

    kvcacheio = sys.modules.get("sgl_kernel.kvcacheio")
    ours = kvcacheio is not None and all(
        getattr(kvcacheio, n, None) is getattr(sys.modules["hicache_kernels.compat.sgl_kernel"], n)
        for n in sglang_switch.KVCACHEIO
    )
    lines = [
        f"hicache_kernels.compat.pytest_plugin: SGLang kernel switch on={sglang_switch.status()['on']}; "
        f"sgl_kernel.kvcacheio's transfers are hicache_kernels': {ours}"
    ]
    lines += [f"  provided: {p}" for p in _provided] or ["  provided: nothing (the real modules import)"]
    return lines


def pytest_report_header(config: Any) -> list[str]:
    return _status_lines()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _status_lines():  # again at the end: -q drops the header
        terminalreporter.write_line(line)
    if _removed:
        terminalreporter.write_line(f"{__name__} removed {len(_removed)} CUDA 13 skip mark(s):")
        for line in sorted(set(_removed)):
            terminalreporter.write_line(f"  {line}")
