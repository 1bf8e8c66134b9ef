"""``python -m hicache_kernels.pcie``: the host link itself, by copy engines and by SM-driven zero copy.

For each transfer size (4 KiB to 1 GiB by default) and each direction (host to device, device to host,
and both at once on two streams) it times one contiguous copy of that many bytes:

- ``copy_engine``: ``cudaMemcpyAsync`` through torch (``dst.copy_(src, non_blocking=True)``), with the
  host buffer pinned and pageable;
- ``kernel``: this package's transfer kernel reading or writing the pinned host buffer directly
  through its device alias (zero copy), with ``num_blocks`` = the SM budget (``--sm-counts``).

It also times small copies (8 B and 4 KiB by default) as latency, reads the PCIe link's generation and
width from NVML (and the theoretical per-direction bandwidth they imply), and samples NVML's PCIe
throughput counters in a background thread while every point runs. Every figure is the median (and
10th/90th percentiles) of ``--repeats`` timed calls with CUDA events after ``--warmup`` calls
(:func:`hicache_kernels.benchutil.measure`); each point's copy is checked byte for byte once after
timing (``--no-verify`` skips that).

Without a CUDA GPU it says so, with the reasons (torch, driver, NVML, extension), writes the JSON
(``"mode": "no-gpu"``, no points) when asked, and exits 0.

===================  ============================================================================
:mod:`.planning`     sizes, the sweep resolved from the arguments, its points in run order
:mod:`.measure`      one point's workload, timing and record; the sweep loop
:mod:`.nvml`         NVML's PCIe throughput counters sampled while points run
:mod:`.gpu`          whether the kernel can run; the buffers and copies of every point (LinkBench)
:mod:`.report`       tables, peak lines, the plot
:mod:`.cli`          the arguments and ``main``
===================  ============================================================================

The link facts (NVML handle, generation and width, theoretical bandwidth) live in
:mod:`hicache_kernels.benchutil.link`, shared with the bench's link check.
"""

from __future__ import annotations

from ..benchutil import PlotUnavailableError, format_bytes, link_facts, nvml_for_device, theoretical_of
from .cli import main, parse_args
from .gpu import LinkBench, kernel_unavailable
from .measure import Workload, failed_point, measure_point, run_sweep
from .nvml import NVML_KB, NVML_WINDOW_S, NvmlPcieSampler
from .planning import (
    DIRECTIONS,
    FULL_SIZES,
    FULL_SM_COUNTS,
    KERNEL_CHUNK_MAX,
    KERNEL_CHUNK_MIN,
    LATENCY_SIZES,
    MEMORIES,
    METHODS,
    QUICK_SIZES,
    QUICK_SM_COUNTS,
    GiB,
    KiB,
    MiB,
    PointSpec,
    Sweep,
    kernel_chunk_bytes,
    parse_size,
    parse_sizes,
    plan_points,
    resolve_sweep,
)
from .report import BANDWIDTH_COLUMNS, LATENCY_COLUMNS, format_points, peak_summary, write_plot

__all__ = [
    "BANDWIDTH_COLUMNS",
    "DIRECTIONS",
    "FULL_SIZES",
    "FULL_SM_COUNTS",
    "KERNEL_CHUNK_MAX",
    "KERNEL_CHUNK_MIN",
    "LATENCY_COLUMNS",
    "LATENCY_SIZES",
    "MEMORIES",
    "METHODS",
    "NVML_KB",
    "NVML_WINDOW_S",
    "QUICK_SIZES",
    "QUICK_SM_COUNTS",
    "GiB",
    "KiB",
    "LinkBench",
    "MiB",
    "NvmlPcieSampler",
    "PlotUnavailableError",
    "PointSpec",
    "Sweep",
    "Workload",
    "failed_point",
    "format_bytes",
    "format_points",
    "kernel_chunk_bytes",
    "kernel_unavailable",
    "link_facts",
    "main",
    "measure_point",
    "nvml_for_device",
    "parse_args",
    "parse_size",
    "parse_sizes",
    "peak_summary",
    "plan_points",
    "resolve_sweep",
    "run_sweep",
    "theoretical_of",
    "write_plot",
]
