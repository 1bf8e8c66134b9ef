"""What the adapters share: how a missing serving framework is reported."""

from __future__ import annotations

from typing import NoReturn


def raise_client_missing(exc: ModuleNotFoundError, client: str, needs: str, adapter: str) -> NoReturn:
    """Raise for a failed import of ``client`` (a top-level package name): ``exc`` itself when something
    else is missing (a bug, to be seen as it is), else a ``ModuleNotFoundError`` whose ``name`` is
    ``client`` (so a check of installed modules can tell the two apart) saying what ``adapter`` needs."""
    if exc.name is None or exc.name.split(".")[0] != client:
        raise exc
    raise ModuleNotFoundError(f"{adapter} needs {needs}", name=client) from exc
