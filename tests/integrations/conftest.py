"""Set-up of the integration tests: the real clients' own code, imported from where
``HICACHE_SGLANG_PATH`` (``bash scripts/fetch_sglang.sh DIR --integration``) and ``HICACHE_VLLM_PATH``
(``bash scripts/fetch_vllm.sh DIR``) point, appended to the import path (an installed SGLang or vLLM is
used as well).

Without the clients' modules the tests skip, saying what is missing; with ``HICACHE_REQUIRE_CLIENTS=1``
(CI's integration step) they fail instead, so a green integration run means they ran.
"""

from __future__ import annotations

import os
import sys

import pytest

REQUIRE = os.environ.get("HICACHE_REQUIRE_CLIENTS") == "1"
_PATHS = os.environ.get("HICACHE_SGLANG_PATH", "").split(os.pathsep) + os.environ.get("HICACHE_VLLM_PATH", "").split(
    os.pathsep
)
for _path in filter(None, _PATHS):
    _path = os.path.abspath(_path)
    if _path not in sys.path:
        sys.path.append(_path)


def _missing(why: str) -> None:
    if REQUIRE:
        pytest.fail(why, pytrace=False)
    pytest.skip(why, allow_module_level=True)


def need_here(why: str | None) -> None:
    """Skip the calling test when ``why`` says what it needs is missing (fail under
    HICACHE_REQUIRE_CLIENTS=1, where CI installs everything the integration tests use)."""
    if why is not None:
        _missing(why)


def need(
    modules: list[str], first: tuple[str, ...] = ("torchvision",), hint: str = "scripts/fetch_sglang.sh --integration"
) -> None:
    """Import ``modules`` or skip the calling test module (fail under HICACHE_REQUIRE_CLIENTS=1).

    ``first`` are looked up (not imported) before anything is imported: SGLang's host pools import
    torchvision, so without it the module skips before importing any of SGLang (whose import-time
    set-up would otherwise stay in this process for the tests that follow). ``hint`` says where the
    client comes from."""
    import importlib
    import importlib.util

    for name in first:
        if importlib.util.find_spec(name) is None:
            _missing(f"{name} is not installed here (the client imports it); see {hint}")
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure means the client is not usable here
            _missing(f"{name} does not import here ({type(exc).__name__}: {exc}); see {hint}")
