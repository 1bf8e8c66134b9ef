"""Test set-up: Triton runs under its CPU interpreter when no GPU is visible (natively when one is);
`gpu` tests skip cleanly without CUDA."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Decide before anything imports Triton: the interpreter reads TRITON_INTERPRET at import time.
CUDA = torch.cuda.is_available()
os.environ.setdefault("TRITON_INTERPRET", "0" if CUDA else "1")
sys.path.insert(0, str(Path(__file__).parent))  # tests/kvdata.py


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and driver (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_ordering_hazards():
    """Fails a test during which a deferred-completion device (:mod:`hicache.streams.deferred`; every cache on
    CPU pools runs under one when HICACHE_DEFERRED_SEED is set) caught a stream-ordering hazard, even
    when the code under test caught the error. A test that provokes hazards on purpose clears
    ``hazard_log()`` itself."""
    from hicache.streams.deferred import hazard_log

    log = hazard_log()
    start = len(log)
    yield
    new = log[start:]
    del log[start:]
    if new:
        pytest.fail(f"{len(new)} stream-ordering hazard(s) under the deferred device model; first: {new[0]}")


@pytest.fixture(params=["compiled", "python"])
def each_tree_core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once per radix-tree core (HiRadixCache's default comes from HICACHE_TREE_CORE);
    the compiled run skips, saying why, when the host core hicache._core is not built."""
    if request.param == "compiled":
        from hicache.tree.core import compiled_core_status

        ok, why = compiled_core_status()
        if not ok:
            pytest.skip(f"compiled tree core unavailable: {why}")
    monkeypatch.setenv("HICACHE_TREE_CORE", request.param)
    return request.param


@pytest.fixture
def fake_mooncake(monkeypatch: pytest.MonkeyPatch):
    """A fake Mooncake Store client in place of ``mooncake.store`` (:class:`storagedata.FakeMooncake`)."""
    from storagedata import FakeMooncake

    fake = FakeMooncake().install(monkeypatch)
    yield fake
    fake.close()


# The Mooncake Store's master, for tests/storage/ and the TP-shared store of tests/serving/ (one a module).
@pytest.fixture(scope="module")
def master_binary() -> str:
    from mooncakedata import client_missing, master_binary_path

    why = client_missing()
    if why:
        pytest.skip(why)
    binary = master_binary_path()
    if binary is None or not os.access(binary, os.X_OK):
        pytest.skip("no mooncake_master executable (set HICACHE_MOONCAKE_MASTER, or install the mooncake package)")
    return binary


@pytest.fixture(scope="module")
def master(master_binary, tmp_path_factory):
    from mooncakedata import Master

    m = Master(master_binary, tmp_path_factory.mktemp("mooncake") / "master.log").start()
    yield m
    m.stop()
