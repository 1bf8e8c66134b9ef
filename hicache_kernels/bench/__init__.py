"""``python -m hicache_kernels.bench``: compare io-backends on model-shaped KV pools.

For each point of the sweep (model preset x page size x host layout x direction x backend, and the
kernel's SM budget) it times the transfer of a fresh random set of pages per repeat with CUDA events
after warm-up, and reports the median and quantiles, bytes moved, GB/s, and the ratio to the
copy-engine ceiling measured in the same run (one contiguous pinned ``cudaMemcpyAsync`` of the same
number of bytes in the same direction), plus kernel / direct and kernel / batch. ``--interference``
times a GEMM alone and beside a running transfer; ``--overlap`` runs a simulated layer-by-layer
forward pass that waits on the controller's LayerDoneCounter. ``--targets-core`` measures only the
points that decide targets 1-3 (:mod:`hicache_kernels.targets`). ``--host-overhead`` instead times
the host side of single calls (every op, the custom op, the compat functions, a 61-layer layer-wise
load) on a no-op io-backend (:mod:`.host_overhead`).

Timing. Every point, its warm-up and its ceiling run on one side stream, the timer's
(:func:`hicache_kernels.benchutil.measure`); the point's callables never name a stream. What does
not change with the copy is built before the start event: the random indices (on the GPU for the
zero-copy backends) and the validated :class:`~hicache_kernels.plan.TransferPlan`. What stays timed
is the io-backend's ``run(plan)``, as a caller holding a plan pays it: for ``direct``/``batch`` that
includes their host-side fragment planning, which they do per call from the plan's indices.

Link check. On a GPU the PCIe link's theoretical one-direction bandwidth is read from NVML; a
ceiling or point measured above it (plus :data:`LINK_TOLERANCE`) can only be a timing error, so the
run stops, marks the JSON (``meta.link_check``) and exits 3. Without NVML the check is not made and
the JSON says so (``link_theoretical_gbps: null``).

Without a GPU it says so and runs the functional cross-check of the CPU-capable backends against
the reference instead (no bandwidth is claimed).

Arguments are checked before anything runs (:func:`check_args`), the memory the run would hold
included (:func:`run_memory`); a bad one exits with status 2 and one line naming it.

=====================  ==========================================================================
:mod:`.config`         dtypes, ops, backends, model presets, :class:`PointSpec`, constants
:mod:`.args`           the arguments and their validation
:mod:`.planning`       the sweep's points (and the --targets-core subset)
:mod:`.memory`         the memory a run would hold, and its estimated GPU time
:mod:`.sweep`          pools, each point's callables and ceiling, the timed sweep, ratios, --tune-auto
:mod:`.interference`   GEMM slowdown beside a transfer; layer-wise overlapped load (GPU only)
:mod:`.cpu_check`      the no-GPU functional check
:mod:`.host_overhead`  --host-overhead: host microseconds per call on a no-op backend
:mod:`.results`        the JSON schema and its validation, the table, the plot, the link check
:mod:`.cli`            ``main``
=====================  ==========================================================================
"""

from __future__ import annotations

from .args import check_args, gpu_sm_count, ignored_without_gpu, parse_args
from .cli import main
from .config import (
    BACKENDS,
    COPY_ENGINE_BACKENDS,
    CORE_ESTIMATE_S,
    DIRECTIONS,
    DTYPES,
    ESTIMATE_GBPS,
    ESTIMATE_US_PER_FRAGMENT,
    LINK_TOLERANCE,
    PRESETS,
    ModelConfig,
    PointSpec,
)
from .cpu_check import functional_check
from .host_overhead import NoopBackend, measure_host_overhead
from .memory import check_memory, copy_engine_fragments, estimate_s, host_memory, run_memory
from .planning import core_targets_plan, decides_core_targets, models_from_args, plan_sweep
from .results import TABLE, link_bandwidth, link_check_meta, plot, validate_bench_json
from .sweep import LinkCheckError, Workload, add_ratios, ceiling_fn, link_violation, run_sweep, transfer_fn, tune_auto

__all__ = [
    "BACKENDS",
    "COPY_ENGINE_BACKENDS",
    "CORE_ESTIMATE_S",
    "DIRECTIONS",
    "DTYPES",
    "ESTIMATE_GBPS",
    "ESTIMATE_US_PER_FRAGMENT",
    "LINK_TOLERANCE",
    "PRESETS",
    "TABLE",
    "LinkCheckError",
    "ModelConfig",
    "NoopBackend",
    "PointSpec",
    "Workload",
    "add_ratios",
    "ceiling_fn",
    "check_args",
    "check_memory",
    "copy_engine_fragments",
    "core_targets_plan",
    "decides_core_targets",
    "estimate_s",
    "functional_check",
    "gpu_sm_count",
    "host_memory",
    "ignored_without_gpu",
    "link_bandwidth",
    "link_check_meta",
    "link_violation",
    "main",
    "measure_host_overhead",
    "models_from_args",
    "parse_args",
    "plan_sweep",
    "plot",
    "run_memory",
    "run_sweep",
    "transfer_fn",
    "tune_auto",
    "validate_bench_json",
]
