"""What the adapters share: how a missing serving framework is reported, and the namespace digest."""

from __future__ import annotations

import hashlib
import json
from typing import Any, NoReturn


def raise_client_missing(exc: ModuleNotFoundError, client: str, needs: str, adapter: str) -> NoReturn:
    """Raise for a failed import of ``client`` (a top-level package name): ``exc`` itself when something
    else is missing (a bug, to be seen as it is), else a ``ModuleNotFoundError`` whose ``name`` is
    ``client`` (so a check of installed modules can tell the two apart) saying what ``adapter`` needs."""
    if exc.name is None or exc.name.split(".")[0] != client:
        raise exc
    raise ModuleNotFoundError(f"{adapter} needs {needs}", name=client) from exc


def fields_digest(fields: dict[str, Any]) -> bytes:
    """SHA-256 of ``fields`` as sorted JSON: an adapter's namespace digest, the prefix of its object keys
    (part of the stored byte format: a change here makes every stored object a miss)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()
