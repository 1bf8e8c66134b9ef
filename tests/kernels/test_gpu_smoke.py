"""The GPU smoke set's transfer cases: every host layout (MHA and MLA) x every io-backend as a round
trip, and every vector width the kernels pick, against the pure-torch reference.

``pytest -m gpu_smoke`` runs these plus the smoke cases marked in other files (graph capture,
torch.compile, the controller on the kernel backend, the sgl-kernel compat functions): about 60
cases, stage 1 of ``benchmarks/gpu_check.sh``. Skipped cleanly without CUDA (conftest).
"""

from __future__ import annotations

import pytest
import torch

from hicache_kernels.backends import BatchBackend, KernelBackend, get_backend

from test_ops_gpu import BACKENDS, LAYOUT_IDS, LAYOUT_KINDS, gpu_case

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_smoke]


def _backend(name: str):
    # A private batch instance, so its last_fallback belongs to this test alone.
    return BatchBackend() if name == "batch" else get_backend(name)


def round_trip(name: str, layout: str, mla: bool, dtype: torch.dtype, page_size: int, **shape) -> None:
    """A backup of all layers, then a load of layer 1, each checked byte for byte (fresh poisoned
    destinations each time), on a side stream (``batch`` refuses the legacy one)."""
    backend = _backend(name)
    stream = torch.cuda.Stream()
    gpu_case(backend, layout, mla, dtype, page_size, "d2h", None, stream=stream, **shape)
    gpu_case(backend, layout, mla, dtype, page_size, "h2d", 1, stream=stream, stacked=False, **shape)
    if name == "batch":
        assert backend.last_fallback is None, f"batch fell back to direct: {backend.last_fallback}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("layout", "mla"), LAYOUT_KINDS, ids=LAYOUT_IDS)
def test_every_layout_and_backend(backend, layout, mla):
    round_trip(backend, layout, mla, torch.bfloat16, 16)


# (head_num, head_dim, dtype) -> item bytes 32, 8, 4, 2, 15: 16-, 8-, 4-, 2- and 1-byte vectors.
VECTOR_WIDTHS = {
    16: (2, 8, torch.bfloat16),
    8: (1, 4, torch.float16),
    4: (1, 1, torch.float32),
    2: (1, 1, torch.float16),
    1: (3, 5, torch.uint8),
}


@pytest.mark.parametrize("backend", ["kernel", "triton"])
@pytest.mark.parametrize("width", list(VECTOR_WIDTHS), ids=lambda w: f"vec{w}")
def test_every_vector_width(backend, width):
    head_num, head_dim, dtype = VECTOR_WIDTHS[width]
    round_trip(backend, "page_first", False, dtype, 4, head_num=head_num, head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float32], ids=str)
def test_other_dtypes_on_the_kernel(dtype):
    round_trip("kernel", "page_first_direct", False, dtype, 16)


@pytest.mark.parametrize(("layout", "mla"), [("page_first_direct", False), ("layer_first", True), ("page_head", False)])
def test_bulk_kernel_design(layout, mla):
    """The sm_90+ bulk-copy kernel against the reference (and that it, not the register kernel, ran)."""
    backend = KernelBackend(design="bulk")
    stream = torch.cuda.Stream()
    gpu_case(backend, layout, mla, torch.bfloat16, 16, "d2h", None, stream=stream)
    assert backend.last_design == ("bulk" if torch.cuda.get_device_capability() >= (9, 0) else "register")
    gpu_case(backend, layout, mla, torch.bfloat16, 16, "h2d", 1, stream=stream, stacked=False)


@pytest.mark.parametrize(("layout", "mla"), [("page_first_direct", False), ("layer_first", True)])
def test_staged_backend(layout, mla):
    """Copy engines through the GPU staging buffer, against the reference, several blocks per copy."""
    round_trip_with(get_backend("staged", staging_pages=1), layout, mla)


def round_trip_with(backend, layout: str, mla: bool) -> None:
    stream = torch.cuda.Stream()
    gpu_case(backend, layout, mla, torch.bfloat16, 16, "d2h", None, stream=stream)
    gpu_case(backend, layout, mla, torch.bfloat16, 16, "h2d", 1, stream=stream, stacked=False)
