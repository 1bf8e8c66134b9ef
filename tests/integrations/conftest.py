"""Set-up of the integration tests: the real clients' own code, imported from where
``HICACHE_SGLANG_PATH`` points (``bash scripts/fetch_sglang.sh DIR --integration``), appended to the
import path (an installed SGLang is used as well).

Without the clients' modules the tests skip, saying what is missing; with ``HICACHE_REQUIRE_CLIENTS=1``
(CI's integration step) they fail instead, so a green integration run means they ran.
"""

from __future__ import annotations

import os
import sys

import pytest

REQUIRE = os.environ.get("HICACHE_REQUIRE_CLIENTS") == "1"
for _path in filter(None, os.environ.get("HICACHE_SGLANG_PATH", "").split(os.pathsep)):
    _path = os.path.abspath(_path)
    if _path not in sys.path:
        sys.path.append(_path)


def _missing(why: str) -> None:
    if REQUIRE:
        pytest.fail(why, pytrace=False)
    pytest.skip(why, allow_module_level=True)


def need(modules: list[str], first: tuple[str, ...] = ("torchvision",)) -> None:
    """Import ``modules`` or skip the calling test module (fail under HICACHE_REQUIRE_CLIENTS=1).

    ``first`` are looked up (not imported) before anything is imported: SGLang's host pools import
    torchvision, so without it the module skips before importing any of SGLang (whose import-time
    set-up would otherwise stay in this process for the tests that follow)."""
    import importlib
    import importlib.util

    for name in first:
        if importlib.util.find_spec(name) is None:
            _missing(f"{name} is not installed here (SGLang's host pools import it); "
                     "see scripts/fetch_sglang.sh --integration")  # fmt: skip
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure means the client is not usable here
            _missing(f"{name} does not import here ({type(exc).__name__}: {exc}); "
                     "see scripts/fetch_sglang.sh --integration")  # fmt: skip
