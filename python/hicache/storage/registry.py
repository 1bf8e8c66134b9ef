"""Choosing a storage backend by name (``file``, ``mooncake``, ``nixl``) or as ``module:Class`` with a config.

Examples
--------
>>> import tempfile
>>> backend = create_backend("file", {"path": tempfile.mkdtemp(), "capacity_bytes": 1 << 20})
>>> type(backend).__name__
'FileBackend'
>>> backend.close()
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import StorageBackend

__all__ = ["BUILTIN_BACKENDS", "create_backend", "load_config"]

BUILTIN_BACKENDS: dict[str, str] = {
    "file": "hicache.storage.file:FileBackend",
    "mooncake": "hicache.storage.mooncake:MooncakeBackend",
    "nixl": "hicache.storage.nixl:NixlBackend",
}
_PLANNED: dict[str, str] = {}


def load_config(config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """A backend config as a dict: a mapping, a path to a ``.json`` or ``.toml`` file, or a JSON object string."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    text = str(config)
    if text.lstrip().startswith("{"):
        out = json.loads(text)
    else:
        path = Path(text)
        if path.suffix == ".toml":
            try:
                import tomllib
            except ImportError as e:  # Python 3.10
                raise ImportError("config: reading TOML needs Python 3.11 (tomllib); give a JSON file") from e
            out = tomllib.loads(path.read_text())
        elif path.suffix == ".json":
            out = json.loads(path.read_text())
        else:
            raise ValueError(f"config: expected a mapping, a JSON object, or a .json / .toml file, got {text!r}")
    if not isinstance(out, dict):
        raise ValueError(f"config: expected an object at the top level, got {type(out).__name__}")
    return out


def create_backend(
    spec: str, config: Mapping[str, Any] | str | os.PathLike[str] | None = None, **overrides: Any
) -> StorageBackend:
    """Build a backend: ``spec`` is a built-in name or ``"package.module:Class"`` (a
    :class:`~hicache.storage.base.StorageBackend` subclass); the class is called with the config's items
    and ``overrides`` as keyword arguments."""
    if spec in _PLANNED:
        raise NotImplementedError(f"storage backend {spec!r}: {_PLANNED[spec]}")
    target = BUILTIN_BACKENDS.get(spec, spec)
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        names = ", ".join([*BUILTIN_BACKENDS, *_PLANNED])
        raise ValueError(f"storage backend: expected one of {names} or 'module:Class', got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in class_name.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, StorageBackend)):
        raise TypeError(f"storage backend {spec!r}: {obj!r} is not a StorageBackend subclass")
    return obj(**{**load_config(config), **overrides})
