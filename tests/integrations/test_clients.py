"""How an adapter reports a missing serving framework (hicache.integrations._clients); needs no client."""

from __future__ import annotations

import pytest

from hicache.integrations._clients import raise_client_missing


def test_the_client_missing_is_named_and_the_cause_kept():
    cause = ModuleNotFoundError("No module named 'vllm.v1'", name="vllm.v1")
    with pytest.raises(ModuleNotFoundError, match="needs vLLM 9") as info:
        raise_client_missing(cause, "vllm", "vLLM 9", "hicache.integrations.vllm")
    assert info.value.name == "vllm" and info.value.__cause__ is cause
    assert str(info.value).startswith("hicache.integrations.vllm needs")


@pytest.mark.parametrize("name", ["numpy_missing", None, "vllmx"])
def test_anything_else_missing_is_raised_as_it_is(name):
    cause = ModuleNotFoundError("something else", name=name)
    with pytest.raises(ModuleNotFoundError) as info:
        raise_client_missing(cause, "vllm", "vLLM", "hicache.integrations.vllm")
    assert info.value is cause
