"""The cache layer's compiled host core, ``hicache._core`` (``csrc/host/``, :mod:`hicache.native`): the
dev install has it, the cache layer takes its tree, page stack, candidates and checksums from it (not from
the CUDA extension ``hicache_kernels._C``, which a build without CUDA lacks), and a missing core is
reported with the reason. The wheels built with and without CUDA: ``tests/package/test_build.py``."""

from __future__ import annotations

import numpy as np
import pytest

from hicache import native

CORE_API = {"RadixTree", "PageStack", "CandidateHeap", "checksum_words", "pread_checksum"}


def test_the_host_core_imports_and_serves_the_cache_layer() -> None:
    import hicache._core as core
    from hicache.pools.paged_slots import _compiled_page_stack
    from hicache.storage import checksum
    from hicache.tree.core import choose_core

    assert native.core_status() == (True, "ok")
    assert native.load_core() is core and native.core_file() == core.__file__
    assert CORE_API <= set(dir(core))
    assert choose_core("auto") == ("compiled", "hicache._core.RadixTree (tree_core=auto)")
    assert checksum._compiled is core.checksum_words and checksum.pread_checksum is core.pread_checksum
    stack = np.arange(4, dtype=np.int64)
    states, ever = np.zeros(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
    assert isinstance(_compiled_page_stack(stack, states, ever, 2), core.PageStack)


def test_the_cuda_extension_no_longer_holds_the_cache_layers_pieces() -> None:
    from hicache_kernels._ext import extension_status, load_extension

    ok, why = extension_status()
    if not ok:
        pytest.skip(f"the CUDA extension is not built: {why}")
    ext = load_extension()
    assert not CORE_API & set(dir(ext))
    assert {"same_items", "index_faults"} <= set(dir(ext))  # the kernel package's own host helpers stay


def test_a_missing_core_is_reported_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "CORE", "hicache._no_such_core")
    native._load.cache_clear()
    try:
        ok, reason = native.core_status()
        assert not ok and reason == "hicache._no_such_core is not built: No module named 'hicache._no_such_core'"
        with pytest.raises(native.CoreUnavailableError, match="hicache._no_such_core is not built"):
            native.load_core()
        assert native.core_attr("RadixTree") is None and native.core_file() is None
    finally:
        monkeypatch.undo()
        native._load.cache_clear()
    assert native.core_status() == (True, "ok")
