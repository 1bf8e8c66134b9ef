"""The bench's arguments: parsed, every one validated before anything runs, with one-line errors."""

from __future__ import annotations

import argparse

import torch

from .. import layouts, targets
from ..benchutil import OneLineParser, counts, names, plot_unavailable
from .config import (
    BACKENDS,
    CORE_ESTIMATE_S,
    CORE_LAYOUTS,
    CORE_PAGE_SIZES,
    DESCRIPTION,
    DIRECTIONS,
    DTYPES,
    ESTIMATE_GBPS,
    ESTIMATE_US_PER_FRAGMENT,
    HOST_CALLS,
    PRESETS,
    PointSpec,
)
from .memory import check_memory
from .planning import plan_sweep

# The designs --tune-auto ranks (auto's, hicache_kernels.backends.AUTO_DESIGNS, which imports the extension's loader).
TUNED_DESIGNS = ("kernel", "kernel-bulk", "staged", "batch", "direct")

# The options of the transfer sweep, which --host-overhead (fixed pools, single calls) does not read.
SWEEP_ONLY = ("preset", "layers", "kv_heads", "head_dim", "dtype", "mla", "page_sizes", "tokens", "num_pages",
              "layouts", "directions", "backends", "sm_budget", "sm_sweep", "repeats", "warmup", "interference",
              "overlap", "plot", "refcheck", "tune_auto", "seed")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, every one validated (:func:`check_args`); a bad one exits with status 2 and a
    one-line message naming it."""
    p = OneLineParser(prog="python -m hicache_kernels.bench", description=DESCRIPTION)
    p.add_argument("--preset", default="llama3-8b", help=f"comma list of {', '.join(PRESETS)}, 'all', or 'custom'")
    p.add_argument("--layers", type=int, help="custom model: layers")
    p.add_argument("--kv-heads", type=int, help="custom model: KV heads (1 for MLA)")
    p.add_argument("--head-dim", type=int, help="custom model: head dim (kv_dim for MLA)")
    p.add_argument("--dtype", choices=list(DTYPES), help="custom model: dtype (default bfloat16)")
    p.add_argument("--mla", action="store_true", help="custom model: MLA (one latent vector per token)")
    p.add_argument("--page-sizes", default="1,4,16,64,128", help="comma list of tokens per page")
    p.add_argument("--tokens", type=int, default=4096, help="tokens moved per point (pages = tokens / page size)")
    p.add_argument("--num-pages", help="comma list of page counts to sweep instead of --tokens (e.g. 8,64,512)")
    p.add_argument("--layouts", default=",".join(layouts.LAYOUTS), help="comma list of host layouts")
    p.add_argument("--directions", default=",".join(DIRECTIONS), help=f"comma list of {', '.join(DIRECTIONS)}")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma list of io-backends")
    p.add_argument("--sm-budget", type=int, default=4, help="kernel blocks (SMs) for the main sweep")
    p.add_argument("--sm-sweep", default="1,2,4,8,16", help="kernel SM budgets swept at one page size")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--interference", action="store_true", help="GEMM slowdown beside a transfer, per backend")
    p.add_argument("--overlap", action="store_true", help="layer-wise load overlapped with a simulated forward")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a reduced sweep (under 2 minutes on an H200)")
    mode.add_argument(
        "--targets-core",
        action="store_true",
        help=f"only the points that decide targets 1-3 (python -m hicache_kernels.targets): the kernel with "
        f"{targets.T1_MAX_SMS} SMs at page sizes {CORE_PAGE_SIZES}, direct at page size {targets.T2_PAGE_SIZE}, "
        f"batch where item x page <= {targets.T3_MAX_FRAGMENT_BYTES} B; layouts {CORE_LAYOUTS}, every op, "
        f"at most 2048 tokens, 5 repeats and 2 warm-ups; no interference or overlap. With the default preset, "
        f"an estimated ~{CORE_ESTIMATE_S} s of GPU time on an H200 (bytes at {ESTIMATE_GBPS:g} GB/s plus "
        f"{ESTIMATE_US_PER_FRAGMENT:g} us per copy-engine fragment; setup and --refcheck not counted: an "
        "estimate, not a measurement)",
    )
    mode.add_argument(
        "--host-overhead",
        action="store_true",
        help="instead of the sweep: host microseconds per call of every op (eager and through the custom op), "
        "every sgl-kernel compat function and a 61-layer layer-wise load, on a no-op io-backend so only the "
        "Python side is timed; pools: MHA 3 layers, MLA 3 and 61 layers (deepseek-v3's kv_dim); the "
        "host-overhead targets of python -m hicache_kernels.targets read its --json",
    )
    p.add_argument("--calls", type=int, help=f"--host-overhead: timed calls per row (default {HOST_CALLS})")
    p.add_argument("--json", metavar="PATH", help="write every point and the run's tags as JSON")
    p.add_argument("--csv", metavar="PATH", help="write every point as CSV")
    p.add_argument("--plot", metavar="PATH.png", help="plot GB/s vs page size per backend (needs matplotlib)")
    p.add_argument("--refcheck", action="store_true", help="after timing, check each point's result bytes")
    p.add_argument(
        "--tune-auto",
        metavar="PATH",
        nargs="?",
        const="",
        help="rank auto's designs per direction and fragment size from this run (kernels at --sm-budget) and "
        "save the table (default path: AutoBackend's)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.host_overhead:
        try:
            check_host_overhead_args(args, {dest: p.get_default(dest) for dest in SWEEP_ONLY})
        except ValueError as exc:
            p.error(str(exc))
        return args
    if args.quick:
        args.page_sizes, args.tokens = "1,16,64", min(args.tokens, 2048)
        args.layouts = "page_first_direct,layer_first"
        args.sm_sweep, args.repeats, args.warmup = "1,2,4,8,16", min(args.repeats, 5), min(args.warmup, 2)
        args.interference = args.overlap = True
    if args.targets_core:
        args.page_sizes, args.tokens, args.layouts = CORE_PAGE_SIZES, min(args.tokens, 2048), CORE_LAYOUTS
        args.directions, args.backends = ",".join(DIRECTIONS), "kernel,direct,batch"
        args.sm_budget, args.sm_sweep = targets.T1_MAX_SMS, ""
        args.repeats, args.warmup = min(args.repeats, 5), min(args.warmup, 2)
        args.interference = args.overlap = False
    try:
        check_args(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def check_host_overhead_args(args: argparse.Namespace, defaults: dict[str, object]) -> None:
    """``--host-overhead``'s arguments: ``--calls`` >= 1 (filled in when not given), and none of the sweep's
    options (ValueError naming the first one given)."""
    for dest, default in defaults.items():
        if getattr(args, dest) != default:
            raise ValueError(f"--{dest.replace('_', '-')}: an option of the transfer sweep; --host-overhead times "
                             "fixed pools and does not read it")  # fmt: skip
    if args.calls is None:
        args.calls = HOST_CALLS
    if args.calls < 1:
        raise ValueError(f"--calls: expected an integer >= 1, got {args.calls}")


def check_args(args: argparse.Namespace) -> list[PointSpec]:
    """Every argument, before anything runs: numbers in range, lists of known names, SM budgets within
    the GPU's SMs, and the memory the run would hold (:func:`check_memory`). Returns the sweep's points;
    ValueError naming the first bad argument."""
    for flag, value, least in (("--tokens", args.tokens, 1), ("--repeats", args.repeats, 1),
                               ("--warmup", args.warmup, 0), ("--sm-budget", args.sm_budget, 1)):  # fmt: skip
        if value < least:
            raise ValueError(f"{flag}: expected an integer >= {least}, got {value}")
    if args.calls is not None:
        raise ValueError("--calls: counts --host-overhead's calls; it needs --host-overhead")
    if args.preset != "custom":
        custom = [flag for flag, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads),
                  ("--head-dim", args.head_dim), ("--dtype", args.dtype), ("--mla", args.mla or None))
                  if value is not None]  # fmt: skip
        if custom:
            raise ValueError(f"{custom[0]}: describes a custom model; it needs --preset custom (got {args.preset})")
    sms = gpu_sm_count()
    for flag, budgets in (("--sm-budget", [args.sm_budget]), ("--sm-sweep", counts("--sm-sweep", args.sm_sweep,
                                                                                   allow_empty=True))):  # fmt: skip
        over = [b for b in budgets if sms is not None and b > sms]
        if over:
            raise ValueError(f"{flag}: {over[0]} SMs, but this GPU has {sms}")
    specs = plan_sweep(args)
    backends = names("--backends", args.backends, BACKENDS)
    ranked = [b for b in backends if b in TUNED_DESIGNS]
    if args.tune_auto is not None and len(ranked) < 2:
        raise ValueError(f"--tune-auto: ranks auto's designs against each other: --backends needs two or more of "
                         f"{', '.join(TUNED_DESIGNS)}, got {','.join(backends)}")  # fmt: skip
    if args.plot and sms is not None and plot_unavailable() is not None:
        raise ValueError(f"--plot: {plot_unavailable()}")
    check_memory(args, specs)
    return specs


def gpu_sm_count() -> int | None:
    """The current GPU's SMs, or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def ignored_without_gpu(args: argparse.Namespace) -> list[str]:
    """The options given that need measured points, which the no-GPU functional check does not make
    (``--interference`` and ``--overlap`` only when asked for, not as part of ``--quick``)."""
    given = {
        "--csv": args.csv is not None,
        "--plot": args.plot is not None,
        "--tune-auto": args.tune_auto is not None,
        "--interference": args.interference and not args.quick,
        "--overlap": args.overlap and not args.quick,
    }
    return [flag for flag, on in given.items() if on]
