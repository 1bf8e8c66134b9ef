"""Shared benchmark plumbing for the bench and pcie CLIs: timing, statistics, run metadata, outputs.

Every figure the CLIs print comes from :func:`measure`: warm-up calls, then ``repeats`` timed calls,
each timed by a :class:`Timer` (CUDA events on the GPU, the host's clock for host overhead, a fake in
the unit tests), reported as the median and quantiles. Nothing is extrapolated.

========================  =======================================================================
:mod:`.timing`            timers (:class:`CudaEventTimer`, :class:`HostTimer`), :func:`measure`, :class:`Stats`
:mod:`.output`            run metadata, provenance, JSON/CSV writers, text tables, byte sizes, progress
:mod:`.args`              :class:`OneLineParser` and comma-list parsing with errors naming the flag
:mod:`.plotting`          matplotlib without pyplot, and whether it is there
:mod:`.link`              the PCIe link from NVML (handle, facts, theoretical bandwidth)
========================  =======================================================================
"""

from __future__ import annotations

from .args import OneLineParser, comma_list, counts, flagged, names, no_repeats
from .link import cuda_device_uuid, device_link, link_facts, nvml_for_device, theoretical_of
from .output import (
    Progress,
    format_bytes,
    format_table,
    git_commit,
    machine_facts,
    meminfo_bytes,
    provenance,
    run_meta,
    source_commit,
    write_csv,
    write_json,
    write_outputs,
)
from .plotting import PlotUnavailableError, new_figure, plot_unavailable, save_figure
from .timing import CudaEventTimer, HostTimer, Stats, Timer, gbps, issuing, measure, summarize

__all__ = [
    "CudaEventTimer",
    "HostTimer",
    "OneLineParser",
    "PlotUnavailableError",
    "Progress",
    "Stats",
    "Timer",
    "comma_list",
    "counts",
    "cuda_device_uuid",
    "device_link",
    "flagged",
    "format_bytes",
    "format_table",
    "gbps",
    "git_commit",
    "issuing",
    "link_facts",
    "machine_facts",
    "meminfo_bytes",
    "measure",
    "names",
    "new_figure",
    "no_repeats",
    "nvml_for_device",
    "plot_unavailable",
    "provenance",
    "run_meta",
    "save_figure",
    "source_commit",
    "summarize",
    "theoretical_of",
    "write_csv",
    "write_json",
    "write_outputs",
]
