"""``python -m hicache.info``: what this installation and machine can do, for the cache layer.

Everything ``python -m hicache_kernels.info`` prints (versions, archs, CUDA, GPUs and their PCIe links,
usable io-backends), whether the cache layer's compiled host core ``hicache._core`` imports (and from
where, or why not), and which radix-tree core :class:`~hicache.HiRadixCache` takes here by default
(``HICACHE_TREE_CORE`` honoured) and why, and whether the storage backends that need another package can
be built here (``nixl``: NIXL's module, version and plugins, or why not). ``--json`` prints one JSON object.
"""

from __future__ import annotations

import sys
from typing import Any

from hicache_kernels import info as kernel_info

from .native import core_file, core_status
from .tree.core import choose_core


def host_core_status() -> dict[str, Any]:
    """Whether ``hicache._core`` (:mod:`hicache.native`) imports: ``built``, ``reason`` and ``file``."""
    ok, reason = core_status()
    return {"built": ok, "reason": reason, "file": core_file()}


def tree_core_status() -> dict[str, Any]:
    """Which radix-tree core ``HiRadixCache`` takes by default here, and why (a bad
    ``HICACHE_TREE_CORE`` is reported, not raised)."""
    try:
        core, reason = choose_core(None)
    except Exception as exc:  # noqa: BLE001 - a bad HICACHE_TREE_CORE: say so
        return {"core": None, "reason": f"{type(exc).__name__}: {exc}"}
    return {"core": core, "reason": reason}


def storage_backend_status() -> dict[str, Any]:
    """Per storage backend that needs another package, whether it can be built here: ``available`` and
    its details, or the ``reason`` it cannot (:func:`hicache.storage.nixl.nixl_status`)."""
    from .storage.nixl import nixl_status

    return {"nixl": nixl_status()}


def add_cache_layer(report: dict[str, Any]) -> None:
    """The cache layer's entries of the report: ``host_core``, ``tree_core`` and ``storage_backends``."""
    report["host_core"] = host_core_status()
    report["tree_core"] = tree_core_status()
    report["storage_backends"] = storage_backend_status()


def main(argv: list[str] | None = None) -> int:
    return kernel_info.main(argv, extra=add_cache_layer, prog="python -m hicache.info")


if __name__ == "__main__":
    sys.exit(main())
