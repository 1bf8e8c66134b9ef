"""The extension's argument checks, one test per check: each bad argument is refused before any CUDA
call with a ValueError that names the function, the argument and the value (csrc/common.cuh
HICACHE_CHECK_ARG). They need the built extension but no GPU or driver; on a GPU machine they never
reach CUDA either, so the made-up addresses below are never dereferenced."""

from __future__ import annotations

import re

import numpy as np
import pytest

import hicache_kernels

pytestmark = pytest.mark.skipif(
    not hicache_kernels.build_info()["cuda_built"], reason="the CUDA extension was not built (HICACHE_SKIP_CUDA)"
)


@pytest.fixture(scope="module")
def C():
    from hicache_kernels._ext import load_extension

    return load_extension()


def refused(message: str):
    """A ValueError with exactly this message."""
    return pytest.raises(ValueError, match=f"^{re.escape(message)}$")


# ------------------------------------------------------------------------------------------ transfer


def side(base=1 << 20, num_layers=4, page_size=1, num_slots=64, **strides) -> tuple[int, ...]:
    item = 256
    s = dict(s_kv=num_layers * num_slots * item, s_layer=num_slots * item, s_page=item, s_in_page=0, s_chunk=0)
    s.update(strides)
    return (base, num_layers, s["s_kv"], s["s_layer"], s["s_page"], s["s_in_page"], s["s_chunk"], page_size, num_slots)


def transfer_args(**over: object) -> dict[str, object]:
    args: dict[str, object] = dict(
        src_desc=side(), src_table=False, dst_desc=side(base=1 << 24), dst_table=False,
        src_idx_ptr=1 << 12, dst_idx_ptr=1 << 13, n=8, layer_begin=0, layer_count=4, num_kv=2, num_chunks=1,
        chunk_bytes=256, align_bytes=0, num_blocks=4, warps_per_block=32, oob_count_ptr=0, stream=0, dst_host=True,
    )  # fmt: skip
    args.update(over)
    return args


TRANSFER_CHECKS = {
    "n": ({"n": -1}, "n must be >= 0, got -1"),
    "layer_begin": ({"layer_begin": -1}, "layer_begin must be >= 0, got -1"),
    "layer_count": ({"layer_count": 0}, "layer_count must be >= 1, got 0"),
    "num_kv": ({"num_kv": 0}, "num_kv must be >= 1, got 0"),
    "num_chunks": ({"num_chunks": 0}, "num_chunks must be >= 1, got 0"),
    "chunk_bytes": ({"chunk_bytes": 0}, "chunk_bytes must be >= 1, got 0"),
    "align_bytes": ({"align_bytes": -8}, "align_bytes must be >= 0, got -8"),
    "num_blocks": ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
    "warps_per_block-low": ({"warps_per_block": 0}, "warps_per_block must be in [1, 32], got 0"),
    "warps_per_block-high": ({"warps_per_block": 40}, "warps_per_block must be in [1, 32], got 40"),
    "src_desc.base": ({"src_desc": side(base=0)}, "src_desc.base must not be 0"),
    "dst_desc.base": ({"dst_desc": side(base=0)}, "dst_desc.base must not be 0"),
    "table-alignment": (
        {"src_desc": side(base=(1 << 20) + 4), "src_table": True},
        f"src_desc.base must be 8-byte aligned for a table side (an int64 array), got {(1 << 20) + 4}",
    ),
    "num_layers": ({"dst_desc": side(num_layers=0)}, "dst_desc.num_layers must be >= 1, got 0"),
    "page_size": ({"dst_desc": side(page_size=0)}, "dst_desc.page_size must be >= 1, got 0"),
    "num_slots": ({"dst_desc": side(num_slots=-1)}, "dst_desc.num_slots must be >= 0, got -1"),
    "s_kv": ({"src_desc": side(s_kv=-1)}, "src_desc.s_kv must be >= 0, got -1"),
    "s_layer": ({"src_desc": side(s_layer=-2)}, "src_desc.s_layer must be >= 0, got -2"),
    "s_page": ({"src_desc": side(s_page=-3)}, "src_desc.s_page must be >= 0, got -3"),
    "s_in_page": ({"dst_desc": side(s_in_page=-4)}, "dst_desc.s_in_page must be >= 0, got -4"),
    "s_chunk": ({"dst_desc": side(s_chunk=-5)}, "dst_desc.s_chunk must be >= 0, got -5"),
    "src-layers": (
        {"layer_begin": 3, "layer_count": 2},
        "layer_begin + layer_count must be <= src_desc.num_layers (4), got 3 + 2",
    ),
    "dst-layers": (
        {"src_desc": side(num_layers=8), "layer_begin": 3, "layer_count": 2},
        "layer_begin + layer_count must be <= dst_desc.num_layers (4), got 3 + 2",
    ),
    "units-per-index": (
        {"num_chunks": 1 << 29},
        "num_kv * layer_count * num_chunks must be <= 2147483647, got 4294967296",
    ),
    "total-units": (
        {"n": 1 << 62},
        f"n * num_kv * layer_count * num_chunks (8 per index) overflows int64 with n = {1 << 62}",
    ),
    "chunk-vectors": (
        {"chunk_bytes": 1 << 40},
        f"chunk_bytes must be at most 2147483583 vectors of 16 bytes, got {1 << 40}",
    ),
    "src_idx": ({"src_idx_ptr": 0}, "src_idx must not be null when n > 0 (n = 8)"),
    "dst_idx": ({"dst_idx_ptr": 0}, "dst_idx must not be null when n > 0 (n = 8)"),
}


@pytest.mark.parametrize(("bad", "message"), TRANSFER_CHECKS.values(), ids=TRANSFER_CHECKS.keys())
def test_transfer_names_the_bad_argument(C, bad: dict[str, object], message: str) -> None:
    with refused(f"launch_transfer: {message}"):
        C.transfer(**transfer_args(**bad))


def test_transfer_of_nothing_is_a_no_op(C) -> None:
    # Returns after the checks and before any CUDA call, so it succeeds even without a GPU.
    assert C.transfer(**transfer_args(n=0, src_idx_ptr=0, dst_idx_ptr=0)) is None


def test_transfer_desc_must_have_nine_fields(C) -> None:
    with pytest.raises(ValueError, match="dst_desc: expected 9 ints"):
        C.transfer(**transfer_args(dst_desc=side()[:8]))


def no_driver() -> bool:
    from hicache_kernels import _ext

    return _ext.driver_version() == 0


@pytest.mark.skipif("not no_driver()", reason="would launch on made-up addresses: only without a driver")
def test_valid_arguments_pass_the_checks(C) -> None:
    """The base arguments above pass every check: each refusal comes from the one change it makes.
    Without a driver the launch itself then fails, and with CUDA's own error, not a ValueError."""
    with pytest.raises(RuntimeError, match="launch_transfer failed: cudaError"):
        C.transfer(**transfer_args())


# ---------------------------------------------------------------------------------- memcpy_fragments


def fragment_arrays(**over: list[int]) -> dict[str, np.ndarray]:
    """Two valid fragments (2 rows of 64 bytes, pitches 128) with some fields replaced."""
    fields = dict(dst=[1 << 20, 1 << 21], dst_pitch=[128, 128], src=[1 << 22, 1 << 23], src_pitch=[128, 128],
                  width=[64, 64], height=[2, 2])  # fmt: skip
    fields.update(over)
    return {k: np.asarray(v, dtype=np.int64) for k, v in fields.items()}


def memcpy_fragments(C, arrays: dict[str, np.ndarray], count: int | None = None, **null: int) -> None:
    order = ("dst", "dst_pitch", "src", "src_pitch", "width", "height")
    ptrs = [null.get(k, arrays[k].ctypes.data) for k in order]
    C.memcpy_fragments(*ptrs, len(arrays["dst"]) if count is None else count, 0)


FRAGMENT_CHECKS = {
    "width": ({"width": [64, -1]}, "width[1] must be >= 0, got -1"),
    "height": ({"height": [2, -2]}, "height[1] must be >= 0, got -2"),
    "dst_pitch": ({"dst_pitch": [128, -3]}, "dst_pitch[1] must be >= 0, got -3"),
    "src_pitch": ({"src_pitch": [128, -4]}, "src_pitch[1] must be >= 0, got -4"),
    "dst_pitch-rows": (
        {"dst_pitch": [32, 128]},
        "dst_pitch[0] must be >= width[0] (64) for more than one row, got 32",
    ),
    "src_pitch-rows": (
        {"src_pitch": [128, 63]},
        "src_pitch[1] must be >= width[1] (64) for more than one row, got 63",
    ),
}


@pytest.mark.parametrize(("bad", "message"), FRAGMENT_CHECKS.values(), ids=FRAGMENT_CHECKS.keys())
def test_memcpy_fragments_names_the_bad_fragment(C, bad: dict[str, list[int]], message: str) -> None:
    # Fragment 0 is valid in most cases: the refusal must come before it is copied (with a driver,
    # copying its made-up addresses would fail differently; without one, with a RuntimeError).
    with refused(f"memcpy_fragments: {message}"):
        memcpy_fragments(C, fragment_arrays(**bad))


def test_memcpy_fragments_count(C) -> None:
    with refused("memcpy_fragments: count must be >= 0, got -1"):
        memcpy_fragments(C, fragment_arrays(), count=-1)


def test_memcpy_fragments_null_arrays(C) -> None:
    with refused("memcpy_fragments: dst, dst_pitch, src, src_pitch, width and height must not be null when count > 0"):
        memcpy_fragments(C, fragment_arrays(), width=0)


def test_memcpy_fragments_of_nothing_is_a_no_op(C) -> None:
    assert C.memcpy_fragments(0, 0, 0, 0, 0, 0, 0, 0) is None


def test_one_row_fragments_need_no_pitch(C) -> None:
    """A single row has no pitch to check: only the copy itself (CUDA's error without a driver)."""
    if not no_driver():
        pytest.skip("would copy made-up addresses: only without a driver")
    with pytest.raises(RuntimeError, match="memcpy_fragments failed: cudaError"):
        memcpy_fragments(C, fragment_arrays(dst_pitch=[0, 0], src_pitch=[0, 0], height=[1, 1]))


# -------------------------------------------------------------------------------------- memcpy_batch


def memcpy_batch(C, pieces: list[int], direction: int = 0, stream: int = 2, count: int | None = None, **null: int):
    """memcpy_batch of pieces of these sizes (made-up addresses); ``null`` names arrays passed as 0."""
    addrs = np.asarray([1 << 20] * len(pieces), dtype=np.int64)
    size = np.asarray(pieces, dtype=np.int64)
    ptrs = [null.get(k, a.ctypes.data) for k, a in (("dst", addrs), ("src", addrs), ("sizes", size))]
    return C.memcpy_batch(*ptrs, len(pieces) if count is None else count, direction, stream)


@pytest.mark.parametrize(("handle", "shown"), [(0, "0"), (1, "0x1")], ids=["null", "cudaStreamLegacy"])
def test_memcpy_batch_refuses_the_legacy_stream(C, handle: int, shown: str) -> None:
    legacy = "the legacy default stream (cudaMemcpyBatchAsync refuses it)"
    with refused(f"memcpy_batch: stream must not be {legacy}, got handle {shown}"):
        memcpy_batch(C, [64], stream=handle)


def test_memcpy_batch_direction(C) -> None:
    with refused("memcpy_batch: direction must be 0 (device to host) or 1 (host to device), got 2"):
        memcpy_batch(C, [64], direction=2)


def test_memcpy_batch_count(C) -> None:
    with refused("memcpy_batch: count must be >= 0, got -1"):
        memcpy_batch(C, [64], count=-1)


def test_memcpy_batch_null_arrays(C) -> None:
    with refused("memcpy_batch: dst, src and sizes must not be null when count > 0"):
        memcpy_batch(C, [64], sizes=0)


def test_memcpy_batch_sizes(C) -> None:
    with refused("memcpy_batch: sizes[1] must be >= 0, got -5"):
        memcpy_batch(C, [64, -5])


def test_memcpy_batch_of_nothing_is_a_no_op(C) -> None:
    assert memcpy_batch(C, [], stream=2) == 0  # cudaStreamPerThread, nothing to copy


def test_error_name(C) -> None:
    assert [C.error_name(c) for c in (0, 1, 400, 801, 36)] == [
        "cudaSuccess", "cudaErrorInvalidValue", "cudaErrorInvalidResourceHandle", "cudaErrorNotSupported",
        "cudaErrorCallRequiresNewerDriver",
    ]  # fmt: skip


# ----------------------------------------------------------------------------- kernel_image_versions


def test_kernel_image_versions_device(C) -> None:
    with refused("kernel_image_versions: device must be >= 0, got -1"):
        C.kernel_image_versions(-1)


def test_bulk_image_versions_device(C) -> None:
    with refused("bulk_image_versions: device must be >= 0, got -1"):
        C.bulk_image_versions(-1)
