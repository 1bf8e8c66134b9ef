"""Test set-up: Triton runs under its CPU interpreter unless a GPU is present; `gpu` tests skip
cleanly without CUDA."""

from __future__ import annotations

import os

# Must happen before Triton is imported anywhere in the session.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("HICACHE_TEST_ON_GPU") == "1" else "1")

import pytest  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and driver (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
