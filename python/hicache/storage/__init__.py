"""The storage tier (L3) of the hierarchical cache: page keys, the backend interface and backends.

- :mod:`.keys`: :func:`page_keys` (a SHA-256 chain over token ids rooted in a :class:`Namespace`).
- :mod:`.base`: :class:`StorageBackend` (``exists`` / ``get`` / ``set`` plus batch defaults that read and
  write host-pool pages in place).
- :mod:`.file`: :class:`FileBackend` (a directory, one checked object per page, LRU capacity).
- :mod:`.nixl`: ``NixlBackend`` (the file backend's objects, each batch moved by one NIXL transfer; NIXL
  is imported when one is built).
- :mod:`.registry`: :func:`create_backend` (``"file"`` or ``"module:Class"`` with a JSON/TOML config).
- :mod:`.tier`: :class:`PrefetchPolicy` (how long a prefetch from storage may take: ``HiRadixCache(...,
  prefetch_policy=PrefetchPolicy(...))``) and the tier's threads.
"""

from .base import StorageBackend, page_views
from .file import FileBackend
from .keys import Namespace, page_keys
from .registry import create_backend, load_config
from .tier import PrefetchPolicy

__all__ = [
    "FileBackend",
    "Namespace",
    "PrefetchPolicy",
    "StorageBackend",
    "create_backend",
    "load_config",
    "page_keys",
    "page_views",
]
