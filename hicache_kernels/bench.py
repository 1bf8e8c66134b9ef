"""``python -m hicache_kernels.bench``: compare io-backends on model-shaped KV pools.

For each point of the sweep (model preset x page size x host layout x direction x backend, and the
kernel's SM budget) it times the transfer of a fresh random set of pages per repeat with CUDA events
after warm-up, and reports the median and quantiles, bytes moved, GB/s, and the ratio to the
copy-engine ceiling measured in the same run (one contiguous pinned ``cudaMemcpyAsync`` of the same
number of bytes in the same direction), plus kernel / direct and kernel / batch. ``--interference``
times a GEMM alone and beside a running transfer; ``--overlap`` runs a simulated layer-by-layer
forward pass that waits on the controller's LayerDoneCounter. ``--targets-core`` measures only the
points that decide targets 1-3 (:mod:`hicache_kernels.targets`).

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
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from . import benchutil, layouts, targets

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}  # fmt: skip
DIRECTIONS = {"backup_all": ("d2h", "all"), "load_layer": ("h2d", "layer"), "load_all": ("h2d", "all")}
BACKENDS = ("kernel", "direct", "batch", "triton", "auto")
COPY_ENGINE_BACKENDS = ("direct", "batch")
# A measured GB/s may exceed the link's theoretical figure by this much before the run is refused.
# NVML's figure subtracts only line encoding, so real copies stay well below it (Gen5 x16: 63 GB/s
# theoretical, about 55 measured); the margin absorbs CUDA-event resolution on short copies.
LINK_TOLERANCE = 0.02
# The time estimate printed before a run (and quoted in --targets-core's help): bytes at a typical
# PCIe Gen5 x16 rate, plus the host cost of issuing each copy-engine fragment. Rough by design.
ESTIMATE_GBPS = 50.0
ESTIMATE_US_PER_FRAGMENT = 2.0
# The --targets-core sweep (see parse_args); the help quotes the estimate for the default preset.
CORE_PAGE_SIZES = "1,4,16,64,128"
CORE_LAYOUTS = "page_first_direct,layer_first"
CORE_ESTIMATE_S = 16  # estimate_s() of the default --targets-core plan; tests/test_bench.py keeps it current
# The GEMMs of --interference (n x n) and --overlap (the first of these at least 1.25x a layer's load).
INTERFERENCE_GEMM_N = 8192
OVERLAP_GEMM_NS = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


@dataclass(frozen=True)
class ModelConfig:
    """The KV shape of a model: per layer, per token, ``head_num x head_dim`` elements for K and V
    (MLA: one latent vector of ``head_dim`` = kv_dim elements)."""

    name: str
    num_layers: int
    head_num: int
    head_dim: int
    dtype: str = "bfloat16"
    mla: bool = False

    @property
    def item_bytes(self) -> int:
        return self.head_num * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def num_kv(self) -> int:
        return 1 if self.mla else 2

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot of a pool: every layer, K and V."""
        return self.num_kv * self.num_layers * self.item_bytes


PRESETS = {
    "llama3-8b": ModelConfig("llama3-8b", 32, 8, 128),  # MHA with GQA: 8 KV heads of 128
    "qwen3-32b": ModelConfig("qwen3-32b", 64, 8, 128),  # GQA: 64 layers, 8 KV heads
    "deepseek-v3": ModelConfig("deepseek-v3", 61, 1, 576, mla=True),  # MLA: 512 latent + 64 rope dims
}


@dataclass(frozen=True)
class PointSpec:
    model: ModelConfig
    backend: str
    direction: str  # backup_all / load_layer / load_all
    layout: str
    page_size: int
    num_pages: int
    sm_budget: int | None  # kernel/auto: blocks (at most that many SMs); copy engines: None

    @property
    def num_tokens(self) -> int:
        return self.page_size * self.num_pages

    @property
    def nbytes(self) -> int:
        """Bytes moved by one call (every layer, or one for ``load_layer``; K and V)."""
        layers = 1 if DIRECTIONS[self.direction][1] == "layer" else self.model.num_layers
        return self.num_tokens * layers * self.model.num_kv * self.model.item_bytes

    def as_point(self) -> dict[str, Any]:
        """The fields targets.py selects points by, before the point is measured."""
        return {"backend": self.backend, "item_bytes": self.model.item_bytes, "page_size": self.page_size,
                "sm_budget": self.sm_budget}  # fmt: skip


def _csv_list(text: str, cast: Callable[[str], Any] = str) -> list[Any]:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def _names(flag: str, text: str, known: Sequence[str]) -> list[str]:
    """A comma list of names from ``known``: ValueError naming ``flag`` for an empty list, an unknown
    name or a repeat."""
    names = _csv_list(text)
    if not names:
        raise ValueError(f"{flag}: empty; choose from {', '.join(known)}")
    for name in names:
        if name not in known:
            raise ValueError(f"{flag}: unknown {name!r}; choose from {', '.join(known)}")
    _no_repeats(flag, names)
    return names


def _counts(flag: str, text: str, *, allow_empty: bool = False) -> list[int]:
    """A comma list of integers >= 1: ValueError naming ``flag`` for anything else (or a repeat)."""
    values = []
    for x in _csv_list(text):
        try:
            value = int(x)
        except ValueError:
            raise ValueError(f"{flag}: {x!r} is not an integer") from None
        if value < 1:
            raise ValueError(f"{flag}: expected integers >= 1, got {value}")
        values.append(value)
    if not values and not allow_empty:
        raise ValueError(f"{flag}: empty; expected a comma list of integers >= 1")
    _no_repeats(flag, values)
    return values


def _no_repeats(flag: str, values: list[Any]) -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise ValueError(f"{flag}: {v} is given twice")
        seen.add(v)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (``prog: error: ...``) with exit status 2, without
    the usage block that, for this many options, would bury the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, every one validated (:func:`check_args`); a bad one exits with status 2 and a
    one-line message naming it."""
    p = OneLineParser(prog="python -m hicache_kernels.bench", description=__doc__.splitlines()[0])
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
    p.add_argument("--json", metavar="PATH", help="write every point and the run's tags as JSON")
    p.add_argument("--csv", metavar="PATH", help="write every point as CSV")
    p.add_argument("--plot", metavar="PATH.png", help="plot GB/s vs page size per backend (needs matplotlib)")
    p.add_argument("--refcheck", action="store_true", help="after timing, check each point's result bytes")
    p.add_argument(
        "--tune-auto",
        metavar="PATH",
        nargs="?",
        const="",
        help="derive auto's threshold from this run and save it (default path: AutoBackend's)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
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


def check_args(args: argparse.Namespace) -> list[PointSpec]:
    """Every argument, before anything runs: numbers in range, lists of known names, SM budgets within
    the GPU's SMs, and the memory the run would hold (:func:`check_memory`). Returns the sweep's points;
    ValueError naming the first bad argument."""
    for flag, value, least in (("--tokens", args.tokens, 1), ("--repeats", args.repeats, 1),
                               ("--warmup", args.warmup, 0), ("--sm-budget", args.sm_budget, 1)):  # fmt: skip
        if value < least:
            raise ValueError(f"{flag}: expected an integer >= {least}, got {value}")
    if args.preset != "custom":
        custom = [flag for flag, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads),
                  ("--head-dim", args.head_dim), ("--dtype", args.dtype), ("--mla", args.mla or None))
                  if value is not None]  # fmt: skip
        if custom:
            raise ValueError(f"{custom[0]}: describes a custom model; it needs --preset custom (got {args.preset})")
    sms = gpu_sm_count()
    for flag, budgets in (("--sm-budget", [args.sm_budget]), ("--sm-sweep", _counts("--sm-sweep", args.sm_sweep,
                                                                                    allow_empty=True))):  # fmt: skip
        over = [b for b in budgets if sms is not None and b > sms]
        if over:
            raise ValueError(f"{flag}: {over[0]} SMs, but this GPU has {sms}")
    specs = plan_sweep(args)
    backends = _names("--backends", args.backends, BACKENDS)
    if args.tune_auto is not None and ("kernel" not in backends or not set(COPY_ENGINE_BACKENDS) & set(backends)):
        raise ValueError(f"--tune-auto: compares the kernel with a copy engine: --backends needs kernel and direct "
                         f"or batch, got {','.join(backends)}")  # fmt: skip
    if args.plot and sms is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot: needs matplotlib, which is not installed (pip install matplotlib)")
    check_memory(args, specs)
    return specs


def gpu_sm_count() -> int | None:
    """The current GPU's SMs, or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def models_from_args(args: argparse.Namespace) -> list[ModelConfig]:
    """The models of ``--preset`` (ValueError naming the argument when one is unknown or incomplete)."""
    if args.preset == "custom":
        missing = [f for f in ("layers", "kv_heads", "head_dim") if getattr(args, f) is None]
        if missing:
            raise ValueError(f"--preset custom needs --{' --'.join(m.replace('_', '-') for m in missing)}")
        for flag, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim)):
            if value < 1:
                raise ValueError(f"{flag}: expected an integer >= 1, got {value}")
        if args.mla and args.kv_heads != 1:
            raise ValueError(f"--kv-heads: an MLA model (--mla) has one latent head; expected 1, got {args.kv_heads}")
        return [ModelConfig("custom", args.layers, args.kv_heads, args.head_dim, args.dtype or "bfloat16", args.mla)]
    names = list(PRESETS) if args.preset == "all" else _names("--preset", args.preset, [*PRESETS, "all", "custom"])
    if len(names) > 1 and {"all", "custom"} & set(names):
        raise ValueError(f"--preset: 'all' and 'custom' stand alone, got {args.preset}")
    return [PRESETS[n] for n in names]


def page_counts(args: argparse.Namespace, page_size: int) -> list[int]:
    """Pages moved per point: ``--num-pages`` when given, else ``--tokens`` worth of pages."""
    if args.num_pages is not None:
        return _counts("--num-pages", args.num_pages)
    return [max(1, args.tokens // page_size)]


def plan_sweep(args: argparse.Namespace) -> list[PointSpec]:
    """Every point the arguments ask for, in run order (ValueError naming a bad list argument)."""
    points = []
    backends = _names("--backends", args.backends, BACKENDS)
    directions = _names("--directions", args.directions, list(DIRECTIONS))
    page_sizes = _counts("--page-sizes", args.page_sizes)
    host_layouts = _names("--layouts", args.layouts, layouts.LAYOUTS)
    models = models_from_args(args)
    for model in models:
        usable = [lo for lo in host_layouts if not model.mla or lo in layouts.MLA_LAYOUTS]
        if not usable:
            raise ValueError(f"--layouts: {model.name} is MLA and none of {','.join(host_layouts)} holds an MLA "
                             f"pool; add one of {', '.join(layouts.MLA_LAYOUTS)}")  # fmt: skip
        for layout in usable:
            for page in page_sizes:
                for pages in page_counts(args, page):
                    for direction in directions:
                        for b in backends:
                            sm = None if b in COPY_ENGINE_BACKENDS else args.sm_budget
                            points.append(PointSpec(model, b, direction, layout, page, pages, sm))
        # SM-budget sweep of the kernel at the middle page size, first layout.
        if "kernel" in backends:
            page = page_sizes[len(page_sizes) // 2]
            for sm in _counts("--sm-sweep", args.sm_sweep, allow_empty=True):
                if sm == args.sm_budget:
                    continue
                for direction in directions:
                    points.append(PointSpec(model, "kernel", direction, usable[0], page, max(1, args.tokens // page),
                                            sm))  # fmt: skip
    if args.targets_core:
        return core_targets_plan(points, models)
    return points


def decides_core_targets(spec: PointSpec) -> bool:
    """Whether targets 1-3 read this point (targets.py's own selection, applied before measuring)."""
    p = spec.as_point()
    return targets.in_target1(p) or targets.in_target2(p) or targets.in_target3(p)


def core_targets_plan(specs: list[PointSpec], models: list[ModelConfig]) -> list[PointSpec]:
    """The points of ``specs`` that decide targets 1-3; ValueError for a model that could not decide them."""
    for m in models:
        if m.item_bytes < targets.T1_MIN_ITEM_BYTES:
            raise ValueError(f"--targets-core: {m.name}'s items are {m.item_bytes} B, below target 1's "
                             f"{targets.T1_MIN_ITEM_BYTES} B: it cannot decide target 1")  # fmt: skip
        if m.item_bytes > targets.T3_MAX_FRAGMENT_BYTES:
            raise ValueError(f"--targets-core: {m.name}'s items are {m.item_bytes} B, so no fragment is within "
                             f"target 3's {targets.T3_MAX_FRAGMENT_BYTES} B: it cannot decide target 3")  # fmt: skip
    return [s for s in specs if decides_core_targets(s)]


# ---------------------------------------------------------------------------------------------- memory
def run_memory(args: argparse.Namespace, specs: list[PointSpec]) -> tuple[int, int]:
    """(pinned host bytes, device bytes) the run holds at its peak, from the same sizes the run uses:
    the sweep's pools (:meth:`Workload.num_slots`, one model at a time) and ceiling scratch, and the
    pools and GEMM operands of ``--interference`` / ``--overlap``. The CUDA context is not counted."""
    tokens = max(s.num_tokens for s in specs)
    slots = Workload.num_slots(tokens, {s.page_size for s in specs})
    host = device = 0
    for model in {s.model for s in specs}:
        pool = slots * model.slot_bytes
        scratch = max(s.nbytes for s in specs if s.model == model)
        host, device = max(host, pool), max(device, pool + scratch)
    first = models_from_args(args)[0]
    if args.interference:  # its own pools at --tokens, two operands and the product
        pool = Workload.num_slots(args.tokens) * first.slot_bytes
        host, device = max(host, pool), max(device, pool + 3 * INTERFERENCE_GEMM_N**2 * 2)
    if args.overlap:  # device pool of 2x the tokens, host of 2x that; the largest GEMM tried, twice, and a product
        t = max(16, args.tokens - args.tokens % 16)
        host = max(host, 4 * t * first.slot_bytes)
        device = max(device, 2 * t * first.slot_bytes + 3 * OVERLAP_GEMM_NS[-1] ** 2 * 2)
    return host, device


def host_memory(field: str) -> int | None:
    """``MemAvailable`` or ``MemTotal`` in bytes (/proc/meminfo, else os.sysconf), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == field:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    pages = {"MemAvailable": "SC_AVPHYS_PAGES", "MemTotal": "SC_PHYS_PAGES"}[field]
    try:
        return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _size(n: int) -> str:
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"


def check_memory(args: argparse.Namespace, specs: list[PointSpec]) -> None:
    """ValueError naming ``--num-pages`` or ``--tokens`` when the run would pin more host memory than
    is available (MemAvailable) or allocate more on the GPU than is free. Without a GPU nothing is
    allocated, but a run that could not fit this machine's RAM (MemTotal) is refused all the same, so
    a dry run catches it."""
    host, device = run_memory(args, specs)
    tokens = max(s.num_tokens for s in specs)
    what = (f"{'--num-pages' if args.num_pages is not None else '--tokens'}: up to {tokens:,} tokens a point, pools "
            f"of {Workload.num_slots(tokens, {s.page_size for s in specs}):,} slots")  # fmt: skip
    on_gpu = torch.cuda.is_available()
    have = host_memory("MemAvailable" if on_gpu else "MemTotal")
    if have is not None and host > have:
        where = "available here" if on_gpu else "of RAM on this machine"
        raise ValueError(f"{what}: the run needs {_size(host)} of pinned host memory, more than the {_size(have)} "
                         f"{where}")  # fmt: skip
    if on_gpu:
        free, _ = torch.cuda.mem_get_info()
        if device > free:
            raise ValueError(f"{what}: the run needs {_size(device)} of GPU memory, more than the {_size(free)} free")


def copy_engine_fragments(spec: PointSpec) -> int:
    """Copies a copy-engine backend issues for the point, roughly: one per random page (runs rarely
    join across pages), layer moved, K/V and chunk."""
    geom = layouts.host_geometry(
        spec.layout, mla=spec.model.mla, num_layers=spec.model.num_layers, num_slots=spec.page_size,
        page_size=spec.page_size, head_num=spec.model.head_num, head_dim=spec.model.head_dim,
        elem_bytes=DTYPES[spec.model.dtype].itemsize,
    )  # fmt: skip
    layers = 1 if DIRECTIONS[spec.direction][1] == "layer" else spec.model.num_layers
    return spec.num_pages * layers * spec.model.num_kv * geom.num_chunks


def estimate_s(specs: list[PointSpec], repeats: int, warmup: int, refcheck: bool = False) -> float:
    """Seconds of GPU time the sweep should take, roughly (see ESTIMATE_GBPS): every call of every
    point and of each distinct ceiling. Setup (pools, random fill for --refcheck) is not counted."""
    calls = warmup + repeats
    total, ceilings = 0.0, set()
    for s in specs:
        n = calls + int(refcheck)
        total += n * s.nbytes / (ESTIMATE_GBPS * 1e9)
        if s.backend in COPY_ENGINE_BACKENDS:
            total += n * copy_engine_fragments(s) * ESTIMATE_US_PER_FRAGMENT * 1e-6
        ceilings.add((DIRECTIONS[s.direction][0], s.nbytes))
    return total + sum(calls * n / (ESTIMATE_GBPS * 1e9) for _, n in ceilings)


class Workload:
    """Pools for one model, reused across points: a stacked device pool and one pinned host buffer
    viewed in each layout's shape (pinning once, not per point)."""

    def __init__(
        self,
        model: ModelConfig,
        tokens: int,
        device: torch.device,
        pin: bool,
        headroom: int = 4,
        fill: bool = False,
        page_sizes: Iterable[int] = (),
    ) -> None:
        self.model = model
        self.device = device
        dtype = DTYPES[model.dtype]
        self.slots = self.num_slots(tokens, page_sizes, headroom)
        self.dev_k = torch.empty(
            model.num_layers, self.slots, model.head_num, model.head_dim, dtype=dtype, device=device
        )
        self.dev_v = None if model.mla else torch.empty_like(self.dev_k)
        n = model.num_kv * model.num_layers * self.slots * model.head_num * model.head_dim
        # Contents do not matter for timing: left uninitialised unless results are checked (--refcheck),
        # where random bytes make a misplaced copy show.
        self.host_flat = torch.empty(n, dtype=dtype, pin_memory=pin)
        if fill:
            for t in (self.dev_k, self.dev_v, self.host_flat):
                if t is not None:
                    t.view(torch.uint8).random_(0, 256)

    @staticmethod
    def num_slots(tokens: int, page_sizes: Iterable[int] = (), headroom: int = 4) -> int:
        """Token slots of each pool: ``headroom`` x ``tokens`` plus 512 so random pages have room, rounded
        up to a multiple of 128 and of every page size (a layout's host shape holds whole pages)."""
        unit = math.lcm(128, *page_sizes)
        return -(-(headroom * tokens + 512) // unit) * unit

    def host(self, layout: str, page_size: int) -> torch.Tensor:
        shape = layouts.host_shape(
            layout, mla=self.model.mla, num_layers=self.model.num_layers, num_slots=self.slots, page_size=page_size,
            head_num=self.model.head_num, head_dim=self.model.head_dim,
        )  # fmt: skip
        return self.host_flat.view(shape)

    def indices(self, page_size: int, num_pages: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Random distinct pages on each side (a random token permutation when page_size is 1)."""
        pages = self.slots // page_size
        off = torch.arange(page_size)
        d = (torch.randperm(pages, generator=gen)[:num_pages, None] * page_size + off).reshape(-1)
        h = (torch.randperm(pages, generator=gen)[:num_pages, None] * page_size + off).reshape(-1)
        return d, h


def _backend_object(spec: PointSpec):
    from .backends import AutoBackend, KernelBackend, get_backend

    if spec.backend == "kernel":
        return KernelBackend(num_blocks=spec.sm_budget)
    if spec.backend == "auto":
        auto = AutoBackend()
        auto.kernel = KernelBackend(num_blocks=spec.sm_budget)
        return auto
    return get_backend(spec.backend)


@dataclass
class PointWork:
    """One point's callables. ``prepare`` (untimed) draws fresh indices and builds the plan; ``run``
    executes it on the current stream; ``check`` compares the last run's destination with its source.
    ``fallbacks`` and ``choices`` collect, over every run, why a batch run fell back to direct and
    which backend auto chose."""

    prepare: Callable[[], None]
    run: Callable[[], None]
    check: Callable[[], bool]
    nbytes: int
    fallbacks: set[str]
    choices: set[str]


def transfer_fn(spec: PointSpec, work: Workload, gen: torch.Generator) -> PointWork:
    """The callables of one point. Copy-engine backends get host indices (they plan on the host); the
    others get device indices, as a scheduler holding them on the GPU would pass. Nothing here names a
    stream: everything is issued on the stream current when it is called, which the harness makes the
    timer's (:func:`hicache_kernels.benchutil.measure`)."""
    from . import ops

    direction, scope = DIRECTIONS[spec.direction]
    host = work.host(spec.layout, spec.page_size)
    backend = _backend_object(spec)
    on_host = spec.backend in COPY_ENGINE_BACKENDS or work.device.type == "cpu"
    state: dict[str, Any] = {}
    fallbacks: set[str] = set()
    choices: set[str] = set()

    def prepare() -> None:
        d, h = work.indices(spec.page_size, spec.num_pages, gen)
        if not on_host:
            d, h = d.to(work.device), h.to(work.device)  # synchronous (pageable source): done before timing
        state["d"], state["h"] = d, h
        # What ops.transfer does before the backend runs (validation, geometry, address tables), done
        # untimed. stream=None: the plan runs on whichever stream is current when run() is called.
        plan = ops.build_plan(
            direction, work.dev_k, work.dev_v, host, d, h, layout=spec.layout, page_size=spec.page_size,
            layer_id=0 if scope == "layer" else None, check_indices=False, stream=None,
        )  # fmt: skip
        # The backend's own host-side work (fragment planning and pointer arrays for the copy engines,
        # descriptors and pinned aliases for the kernel) is done here too: run() only issues the copy.
        state["copy"] = backend.prepare(plan)

    def check() -> bool:
        """The last run's destination slots hold its source slots' bytes (plain indexing)."""
        from .reference import host_items

        d, h = state["d"].cpu(), state["h"].cpu()
        pools = [work.dev_k] if work.dev_v is None else [work.dev_k, work.dev_v]
        for kv, pool in enumerate(pools):
            for layer in [0] if scope == "layer" else range(spec.model.num_layers):
                dev = pool[layer][d.to(pool.device)].cpu().view(torch.uint8)
                hst = host_items(host, spec.layout, spec.page_size, layer, h, None if work.dev_v is None else kv)
                if not torch.equal(dev, hst):
                    return False
        return True

    def run() -> None:
        state["copy"]()
        # After the copies are issued (a few attribute reads): BatchBackend resets last_fallback on
        # every call, so each run's is collected here, or a fallback in any but the last run is lost.
        if spec.backend == "auto":
            choices.add(backend.last_choice)
            batch = backend.batch if backend.last_choice == "batch" else None
        else:
            batch = backend if spec.backend == "batch" else None
        if batch is not None and batch.last_fallback is not None:
            fallbacks.add(batch.last_fallback)

    return PointWork(prepare, run, check, spec.nbytes, fallbacks, choices)


def ceiling_fn(nbytes: int, direction: str, work: Workload, scratch: dict[str, torch.Tensor]) -> Callable[[], None]:
    """One contiguous pinned copy of ``nbytes`` in ``direction``, on the current stream (the timer's,
    like every point's): the copy-engine ceiling."""
    host = work.host_flat.view(torch.uint8)[:nbytes]
    if "dev" not in scratch or scratch["dev"].numel() < nbytes:
        scratch["dev"] = torch.empty(nbytes, dtype=torch.uint8, device=work.device)
    dev = scratch["dev"][:nbytes]
    if direction == "d2h":
        return lambda: host.copy_(dev, non_blocking=True)
    return lambda: dev.copy_(host, non_blocking=True)


class LinkCheckError(RuntimeError):
    """A ceiling or point measured faster than the PCIe link allows; ``points`` are those measured so far."""

    def __init__(self, message: str, points: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.points = points


def link_violation(what: str, gbps: float, link_gbps: float | None) -> str | None:
    """Why ``gbps`` cannot be a real measurement over a link of ``link_gbps`` (None: it can, or the
    link is unknown)."""
    if link_gbps is None or gbps <= link_gbps * (1 + LINK_TOLERANCE):
        return None
    return (f"{what}: {gbps:.2f} GB/s is above the PCIe link's theoretical {link_gbps:.2f} GB/s per direction "
            f"(+{LINK_TOLERANCE:.0%} tolerance): a timing error, not a fast link")  # fmt: skip


def run_sweep(
    specs: list[PointSpec],
    *,
    device: torch.device,
    timer: benchutil.Timer,
    repeats: int,
    warmup: int,
    seed: int = 0,
    tokens: int = 4096,
    progress: benchutil.Progress | None = None,
    pin: bool = True,
    refcheck: bool = False,
    link_gbps: float | None = None,
) -> list[dict[str, Any]]:
    """Measure every spec; returns the points (see module docstring for the fields). Every call runs
    on the timer's stream. With ``link_gbps`` (the link's theoretical one-direction GB/s), raises
    :class:`LinkCheckError` as soon as a ceiling or a point exceeds it (see :data:`LINK_TOLERANCE`)."""
    gen = torch.Generator().manual_seed(seed)
    work: dict[str, Workload] = {}
    ceilings: dict[tuple[str, int], benchutil.Stats] = {}
    scratch: dict[str, torch.Tensor] = {}
    points: list[dict[str, Any]] = []

    def refuse(what: str, gbps: float) -> None:
        problem = link_violation(what, gbps, link_gbps)
        if problem is not None:
            raise LinkCheckError(problem, points)

    page_sizes = {s.page_size for s in specs}
    for spec in specs:
        if spec.model.name not in work:
            # One model's pools at a time (run_memory counts on it): drop every reference to the last
            # model's before allocating, the last point's callables included.
            w = pw = None
            work.clear()
            scratch.clear()
            work[spec.model.name] = Workload(spec.model, tokens, device, pin, fill=refcheck, page_sizes=page_sizes)
        w = work[spec.model.name]
        direction, scope = DIRECTIONS[spec.direction]
        pw = transfer_fn(spec, w, gen)
        nbytes = pw.nbytes
        key = (direction, nbytes)
        if key not in ceilings:
            ceilings[key] = benchutil.measure(ceiling_fn(nbytes, direction, w, scratch), timer=timer,
                                              repeats=repeats, warmup=warmup)  # fmt: skip
            refuse(f"copy-engine ceiling, {direction}, {nbytes} B", benchutil.gbps(nbytes, ceilings[key].median_ms))
        ceiling = ceilings[key]
        stats = benchutil.measure(pw.run, timer=timer, repeats=repeats, warmup=warmup, prepare=pw.prepare)
        point = {
            "kind": "transfer",
            "model": spec.model.name,
            "backend": spec.backend,
            "direction": direction,
            "scope": scope,
            "op": spec.direction,
            "layout": spec.layout,
            "page_size": spec.page_size,
            "item_bytes": spec.model.item_bytes,
            "num_pages": spec.num_pages,
            "tokens": spec.num_tokens,
            "bytes": nbytes,
            **stats.as_dict(),
            "gbps": benchutil.gbps(nbytes, stats.median_ms),
            "ceiling_median_ms": ceiling.median_ms,
            "ceiling_gbps": benchutil.gbps(nbytes, ceiling.median_ms),
            "sm_budget": spec.sm_budget,
        }
        point["ratio_to_ceiling"] = point["gbps"] / point["ceiling_gbps"]
        if refcheck:  # one more run on fresh indices, on the timer's stream, then compare what landed
            with benchutil.issuing(timer):
                pw.prepare()
                pw.run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            point["refcheck"] = pw.check()
        if spec.backend == "auto":
            point["auto_choice"] = ",".join(sorted(pw.choices)) or None
        if spec.backend in ("batch", "auto"):  # every run's fallback, warm-up and refcheck included
            point["batch_fallback"] = "; ".join(sorted(pw.fallbacks)) or None
        points.append(point)
        refuse(f"{spec.backend} {spec.direction} {spec.layout} page {spec.page_size}", point["gbps"])
        if progress:
            progress.step(f"{spec.backend} {spec.direction} p{spec.page_size} {spec.layout}")
    add_ratios(points)
    return points


def add_ratios(points: list[dict[str, Any]]) -> None:
    """kernel / direct and kernel / batch speedups (median time ratios) on kernel points, each against
    the same transfer (model, op, layout, page size and number of pages)."""
    index = {}
    for p in points:
        if p.get("kind") == "transfer":
            index[(p["model"], p["backend"], p["op"], p["layout"], p["page_size"], p.get("num_pages"))] = p
    for p in points:
        if p.get("kind") != "transfer" or p["backend"] != "kernel":
            continue
        for other in ("direct", "batch"):
            q = index.get((p["model"], other, p["op"], p["layout"], p["page_size"], p.get("num_pages")))
            p[f"kernel_over_{other}"] = q["median_ms"] / p["median_ms"] if q and p["median_ms"] > 0 else None


def tune_auto(points: list[dict[str, Any]], sm_budget: int) -> dict[str, int]:
    """``auto``'s threshold from measured points: the smallest fragment size (item x page bytes) from
    which a copy-engine backend beats the kernel at every larger measured size, in every op and
    layout. If the kernel wins everywhere, one byte past the largest fragment measured."""
    by_frag: dict[int, list[bool]] = {}
    groups: dict[tuple, dict[str, float]] = {}
    for p in points:
        if p.get("kind") != "transfer" or (p["backend"] == "kernel" and p["sm_budget"] != sm_budget):
            continue
        key = (p["model"], p["op"], p["layout"], p["page_size"], p["item_bytes"], p.get("num_pages"))
        groups.setdefault(key, {})[p["backend"]] = p["median_ms"]
    for (_, _, _, page, item, _), times in groups.items():
        ce = [times[b] for b in COPY_ENGINE_BACKENDS if b in times]
        if "kernel" in times and ce:
            by_frag.setdefault(item * page, []).append(min(ce) < times["kernel"])
    if not by_frag:
        raise ValueError("points: no fragment size has both kernel and copy-engine measurements")
    sizes = sorted(by_frag)
    threshold = sizes[-1] + 1
    for size in reversed(sizes):  # walk down while copy engines win at this size and all above it
        if not all(by_frag[size]):
            break
        threshold = size
    return {"kernel_max_fragment_bytes": threshold}


# ---------------------------------------------------------------------------------------------- GPU-only parts
def _transfer_loop(run: Callable[[], None], stream: Any, stop: threading.Event) -> None:
    """Keep one transfer in flight on ``stream`` until ``stop`` is set (the current stream is per
    thread, so this thread makes ``stream`` its own)."""
    with torch.cuda.stream(stream):
        while not stop.is_set():
            run()
            stream.synchronize()


def interference(args: argparse.Namespace, model: ModelConfig, backends: list[str], repeats: int) -> list[dict]:
    """GEMM time alone and beside a continuously running backup on another stream, per backend."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(args.seed)
    work = Workload(model, args.tokens, device, pin=True)
    a = torch.randn(INTERFERENCE_GEMM_N, INTERFERENCE_GEMM_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(INTERFERENCE_GEMM_N, INTERFERENCE_GEMM_N, device=device, dtype=torch.bfloat16)
    compute = torch.cuda.Stream()
    timer = benchutil.CudaEventTimer(compute)

    def gemm() -> None:
        torch.mm(a, b)  # on the compute stream: the timer makes it current

    alone = benchutil.measure(gemm, timer=timer, repeats=repeats, warmup=3)
    points = []
    for name in backends:
        spec = PointSpec(model, name, "backup_all", "page_first_direct", 16, max(1, args.tokens // 16),
                         None if name in COPY_ENGINE_BACKENDS else args.sm_budget)  # fmt: skip
        side = torch.cuda.Stream()
        pw = transfer_fn(spec, work, gen)
        with torch.cuda.stream(side):
            pw.prepare()
        stop = threading.Event()

        t = threading.Thread(target=_transfer_loop, args=(pw.run, side, stop), daemon=True)
        t.start()
        time.sleep(0.05)
        beside = benchutil.measure(gemm, timer=timer, repeats=repeats, warmup=1)
        stop.set()
        t.join(30)
        points.append({
            "kind": "interference", "model": model.name, "backend": name, "gemm_alone_ms": alone.median_ms,
            "gemm_beside_ms": beside.median_ms, "slowdown": beside.median_ms / alone.median_ms - 1.0,
            "sm_budget": spec.sm_budget, "transfer_bytes": pw.nbytes,
            "batch_fallback": "; ".join(sorted(pw.fallbacks)) or None,
        })  # fmt: skip
    return points


def overlap(args: argparse.Namespace, model: ModelConfig, backend: str, repeats: int) -> dict[str, Any]:
    """Simulated forward: one matmul per layer sized to take about 1.25x a layer's load; compares
    compute alone, load-all-then-compute, and layer-wise load waited on per layer."""
    from hicache import DeviceKVPool, HiCacheController, HostKVPool

    from . import ops

    page = 16
    tokens = max(page, args.tokens - args.tokens % page)
    dev = DeviceKVPool(num_slots=2 * tokens, num_layers=model.num_layers, head_num=model.head_num,
                       head_dim=model.head_dim, dtype=DTYPES[model.dtype], device="cuda", page_size=page,
                       mla=model.mla)  # fmt: skip
    host = HostKVPool(dev, layout="page_first_direct", ratio=2.0, pin_memory=True)
    ctrl = HiCacheController(dev, host, io_backend=backend, threaded=True)
    d_idx, h_idx = dev.alloc(tokens), host.alloc(tokens)
    host.mark_writing(h_idx)
    host.mark_synced(h_idx)
    timer = benchutil.CudaEventTimer()

    def load_layer0() -> None:
        ops.load_layer(dev.device_k, dev.device_v, host.buffer, d_idx, h_idx, layer_id=0, layout=host.layout,
                       page_size=page, backend=backend)  # fmt: skip

    layer_ms = benchutil.measure(load_layer0, timer=timer, repeats=repeats).median_ms
    for n in OVERLAP_GEMM_NS:  # the first GEMM at least 1.25x a layer's load
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        if benchutil.measure(lambda x=x: torch.mm(x, x), timer=timer, repeats=3).median_ms >= 1.25 * layer_ms:
            break

    def forward() -> None:
        for _ in range(model.num_layers):
            torch.mm(x, x)

    def wall(fn: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def load_then_compute() -> None:
        ops.load_all_layers(dev.device_k, dev.device_v, host.buffer, d_idx, h_idx, layout=host.layout,
                            page_size=page, backend=backend)  # fmt: skip
        forward()

    def overlapped() -> None:
        ctrl.load(h_idx, d_idx, node_id=1)
        ctrl.start_loading()
        for layer in range(model.num_layers):
            ctrl.layer_counter.wait_until(layer)
            torch.mm(x, x)
        torch.cuda.synchronize()
        ctrl.flush()
        ctrl.finished_loads()
        host.mark_synced(h_idx)

    results = {}
    for name, fn in (("compute_ms", forward), ("load_then_compute_ms", load_then_compute),
                     ("overlapped_ms", overlapped)):  # fmt: skip
        fn()
        results[name] = benchutil.summarize([wall(fn) for _ in range(repeats)]).median_ms
    ctrl.close()
    load_all = benchutil.measure(
        lambda: ops.load_all_layers(dev.device_k, dev.device_v, host.buffer, d_idx, h_idx, layout=host.layout,
                                    page_size=page, backend=backend), timer=timer, repeats=repeats,
    ).median_ms  # fmt: skip
    return {
        "kind": "overlap", "model": model.name, "backend": backend, "tokens": tokens, "gemm_n": n,
        "layer_load_ms": layer_ms, "load_all_ms": load_all, **results,
        "overlap_ratio": results["overlapped_ms"] / results["compute_ms"],
        "transfer_le_compute": load_all <= results["compute_ms"],
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- CPU check
def _check_case(backend: str, layout: str, mla: bool, direction: str, scope: str, gen: torch.Generator) -> dict:
    from . import ops
    from .reference import reference_transfer

    L, H, D, page, n_dev, n_host = 3, 1 if mla else 2, 8, 4, 32, 16
    shape = layouts.host_shape(layout, mla=mla, num_layers=L, num_slots=n_host, page_size=page, head_num=H, head_dim=D)
    k = torch.randn(L, n_dev, H, D, generator=gen).half()
    v = None if mla else torch.randn(L, n_dev, H, D, generator=gen).half()
    host = torch.randn(shape, generator=gen).half()
    d_idx = torch.randperm(n_dev, generator=gen)[:8]
    h_idx = torch.randperm(n_host, generator=gen)[:8]
    layer = 1 if scope == "layer" else None
    expected = [k.clone(), None if v is None else v.clone(), host.clone()]
    reference_transfer(
        direction=direction, device_k=list(expected[0]), device_v=None if v is None else list(expected[1]),
        host=expected[2], device_indices=d_idx, host_indices=h_idx, layout=layout, page_size=page,
        layers=range(L) if layer is None else [layer],
    )  # fmt: skip
    error = None
    try:
        ops.transfer(direction, k, v, host, d_idx, h_idx, layout=layout, page_size=page, layer_id=layer,
                     backend=backend)  # fmt: skip
        ok = all(got is None or torch.equal(got, want) for got, want in zip((k, v, host), expected, strict=True))
    except Exception as exc:  # reported, not hidden
        ok, error = False, f"{type(exc).__name__}: {exc}"
    return {"backend": backend, "layout": layout, "mla": mla, "direction": direction, "scope": scope, "ok": ok,
            "error": error}  # fmt: skip


def functional_check(seed: int = 0) -> list[dict[str, Any]]:
    """Every CPU-capable backend against the reference on a small pool: correctness only."""
    gen = torch.Generator().manual_seed(seed)
    backends = ["direct", "batch", "auto"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    return [
        _check_case(backend, layout, mla, direction, scope, gen)
        for mla in (False, True)
        for layout in (layouts.MLA_LAYOUTS if mla else layouts.LAYOUTS)
        for direction, scope in DIRECTIONS.values()
        for backend in backends
    ]


# ---------------------------------------------------------------------------------------------- output
TRANSFER_FIELDS = {
    "model": str, "backend": str, "op": str, "direction": str, "scope": str, "layout": str, "page_size": int,
    "item_bytes": int, "num_pages": int, "bytes": int, "median_ms": float, "gbps": float, "ceiling_gbps": float,
    "ratio_to_ceiling": float,
}  # fmt: skip
# Fields of the other kinds that hicache_kernels.targets reads.
POINT_FIELDS = {
    "transfer": TRANSFER_FIELDS,
    "interference": {"backend": str, "slowdown": float},
    "overlap": {"overlap_ratio": float, "transfer_le_compute": bool},
}
OPTIONAL_FIELDS = {"kernel_over_direct": float, "kernel_over_batch": float, "batch_fallback": str}  # or null


def _is(value: Any, typ: type) -> bool:
    """``isinstance`` where a JSON true/false is not a number."""
    return isinstance(value, typ) and (typ is bool or not isinstance(value, bool))


def validate_bench_json(doc: Any) -> list[str]:
    """Problems with a bench JSON document (empty when it is well formed): what the bench writes and
    every field :mod:`hicache_kernels.targets` reads."""
    if not isinstance(doc, dict) or not {"meta", "points"} <= set(doc):
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        return [f"top level: expected an object with keys meta and points, got {got}"]
    if not isinstance(doc["meta"], dict) or not isinstance(doc["points"], list):
        return ["top level: expected meta to be an object and points a list"]
    errors = []
    for key in ("tool", "time_utc", "package_version", "git_commit", "torch", "gpu", "driver"):
        if key not in doc["meta"]:
            errors.append(f"meta: missing {key!r}")
    for i, p in enumerate(doc["points"]):
        kind = p.get("kind") if isinstance(p, dict) else None
        if kind not in POINT_FIELDS:
            errors.append(f"points[{i}]: expected an object of kind {', '.join(POINT_FIELDS)}, got {p!r:.80}")
            continue
        for key, typ in POINT_FIELDS[kind].items():
            if not _is(p.get(key), typ):
                errors.append(f"points[{i}].{key}: expected {typ.__name__}, got {p.get(key)!r}")
        for key, typ in OPTIONAL_FIELDS.items():
            if p.get(key) is not None and not _is(p[key], typ):
                errors.append(f"points[{i}].{key}: expected {typ.__name__} or null, got {p[key]!r}")
        if kind != "transfer":
            continue
        if p.get("direction") not in ("d2h", "h2d") or p.get("scope") not in ("layer", "all"):
            errors.append(f"points[{i}]: direction/scope {p.get('direction')}/{p.get('scope')}")
        if DIRECTIONS.get(p.get("op")) not in (None, (p.get("direction"), p.get("scope"))):
            errors.append(f"points[{i}].op: {p['op']} is not {p.get('direction')}/{p.get('scope')}")
        elif p.get("op") not in DIRECTIONS:
            errors.append(f"points[{i}].op: expected one of {', '.join(DIRECTIONS)}, got {p.get('op')!r}")
        sm = p.get("sm_budget", "missing")
        if sm is not None and (p.get("backend") in COPY_ENGINE_BACKENDS or not _is(sm, int)):
            errors.append(f"points[{i}].sm_budget: expected null for copy-engine backends, an int otherwise")
        timed = all(_is(p.get(k), t) for k, t in (("gbps", float), ("median_ms", float), ("bytes", int)))
        if timed and p["median_ms"] > 0:
            expect = p["bytes"] / (p["median_ms"] * 1e-3) / 1e9
            if abs(p["gbps"] - expect) > 1e-6 * max(1.0, expect):
                errors.append(f"points[{i}].gbps: {p['gbps']} inconsistent with bytes/median_ms ({expect})")
    return errors


def plot(path: str, points: list[dict[str, Any]], sm_budget: int | None = None) -> None:
    """GB/s vs page size per backend, one panel per (model, op, layout), the ceiling dashed. Kernel
    points are those of ``sm_budget`` (the main sweep's) when given."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib: pip install matplotlib ({exc})") from exc
    transfer = [p for p in points if p.get("kind") == "transfer"]
    panels = sorted({(p["model"], p["op"], p["layout"]) for p in transfer})
    if not panels:
        raise SystemExit("--plot: no transfer points to plot")
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 3.2 * len(panels)), squeeze=False)
    for ax, (model, op, layout) in zip(axes[:, 0], panels, strict=True):
        sel = [p for p in transfer if (p["model"], p["op"], p["layout"]) == (model, op, layout)]
        for backend in sorted({p["backend"] for p in sel}):
            pts = [p for p in sel if p["backend"] == backend]
            if backend == "kernel" and sm_budget is not None:
                pts = [p for p in pts if p["sm_budget"] == sm_budget]
            pts.sort(key=lambda p: p["page_size"])
            if pts:
                ax.plot([p["page_size"] for p in pts], [p["gbps"] for p in pts], marker="o", label=backend)
        ceil = sorted(sel, key=lambda p: p["page_size"])
        ax.plot([p["page_size"] for p in ceil], [p["ceiling_gbps"] for p in ceil], "k--", label="copy-engine ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page size (tokens)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{model}: {op}, {layout}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TABLE = [
    ("model", "model"), ("op", "op"), ("layout", "layout"), ("page_size", "page"), ("backend", "backend"),
    ("sm_budget", "SMs"), ("median_ms", "ms"), ("gbps", "GB/s"), ("ceiling_gbps", "ceil"),
    ("ratio_to_ceiling", "/ceil"), ("kernel_over_direct", "k/direct"), ("kernel_over_batch", "k/batch"),
]  # fmt: skip


def link_bandwidth() -> tuple[float | None, dict[str, Any]]:
    """The current GPU's PCIe link as :mod:`hicache_kernels.pcie` reads it from NVML: its theoretical
    one-direction GB/s (None when NVML cannot say) and the link facts (``error`` says why not)."""
    from .pcie import link_facts, nvml_for_device, theoretical_of

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "") or None  # NVML and torch may number GPUs differently
    nvml, handle, reason = nvml_for_device(index, uuid)
    link = link_facts(nvml, handle, reason)
    return theoretical_of(link), link


def link_check_meta(link_gbps: float | None, why_not: str, problem: str | None = None) -> dict[str, Any]:
    """``meta.link_check``: whether every ceiling and point was checked against the link, and how it went."""
    check = {"made": link_gbps is not None, "passed": None, "tolerance": LINK_TOLERANCE}
    if link_gbps is None:
        return {**check, "note": f"not made: the link's theoretical bandwidth is unknown ({why_not})"}
    if problem is not None:
        return {**check, "passed": False, "note": problem}
    limit = link_gbps * (1 + LINK_TOLERANCE)
    return {**check, "passed": True, "note": f"every ceiling and point <= {limit:.2f} GB/s"}


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = plan_sweep(args)
    meta = benchutil.run_meta("bench", vars(args))
    est = estimate_s(specs, args.repeats, args.warmup, args.refcheck)
    print(f"bench: {len(specs)} transfer points; on an H200 about {est:.0f} s of GPU time (an estimate: bytes at "
          f"{ESTIMATE_GBPS:g} GB/s plus {ESTIMATE_US_PER_FRAGMENT:g} us per copy-engine fragment; setup, "
          "interference and overlap not counted)")  # fmt: skip
    if not torch.cuda.is_available():
        meta["link_theoretical_gbps"] = None
        meta["link_check"] = link_check_meta(None, "no GPU")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the functional check runs Triton on CPU tensors
        print("hicache-kernels bench: bandwidth needs a CUDA GPU, and none is visible here "
              f"({meta.get('driver') or 'no driver'}; torch {torch.__version__}).")  # fmt: skip
        ignored = ignored_without_gpu(args)
        if ignored:
            print(f"bench: ignored without a GPU: {', '.join(ignored)} (they need measured points)")
        print("Running the functional cross-check of the CPU-capable backends instead (correctness only, no GB/s):")
        checks = functional_check(args.seed)
        rows = {}
        for c in checks:
            r = rows.setdefault(c["backend"], {"backend": c["backend"], "cases": 0, "passed": 0})
            r["cases"] += 1
            r["passed"] += int(c["ok"])
        print(benchutil.format_table(list(rows.values()), [("backend", "backend"), ("cases", "cases"),
                                                           ("passed", "passed")]))  # fmt: skip
        for c in checks:
            if not c["ok"]:
                print(f"  FAILED {c}")
        if args.json:
            benchutil.write_json(args.json, meta, [], mode="cpu-functional-check", functional_check=checks)
        return 0 if all(c["ok"] for c in checks) else 1
    torch.cuda.init()
    link_gbps, link = link_bandwidth()
    meta["link_theoretical_gbps"], meta["link"] = link_gbps, link
    why_not = str(link.get("error") or "NVML reported no known PCIe generation and width")
    if link_gbps is None:
        print(f"bench: link check not made: the link's theoretical bandwidth is unknown ({why_not})")
    # One side stream for every point, its warm-up and its ceiling: the timer's (batch refuses the
    # legacy default stream).
    timer = benchutil.CudaEventTimer(torch.cuda.Stream())
    progress = benchutil.Progress(len(specs), "bench")
    try:
        points = run_sweep(specs, device=torch.device("cuda"), timer=timer, repeats=args.repeats,
                           warmup=args.warmup, seed=args.seed, tokens=max(s.num_tokens for s in specs),
                           progress=progress, refcheck=args.refcheck, link_gbps=link_gbps)  # fmt: skip
    except LinkCheckError as exc:
        progress.close()
        meta["link_check"] = link_check_meta(link_gbps, why_not, str(exc))
        if args.json:
            benchutil.write_json(args.json, meta, exc.points)
        print(f"bench: refused: {exc}", file=sys.stderr)
        return 3
    progress.close()
    meta["link_check"] = link_check_meta(link_gbps, why_not)
    models = models_from_args(args)
    if args.interference:
        points += interference(args, models[0], [b for b in _csv_list(args.backends) if b != "triton"], args.repeats)
    if args.overlap:
        points.append(overlap(args, models[0], "kernel" if "kernel" in args.backends else "direct", args.repeats))
    print(benchutil.format_table([p for p in points if p["kind"] == "transfer"], TABLE))
    for p in points:
        if p.get("batch_fallback"):
            print(f"BATCH FELL BACK TO DIRECT ({p['backend']} {p['op']} {p['layout']} page {p['page_size']}): "
                  f"{p['batch_fallback']}; targets 3 and 4 fail on this point")  # fmt: skip
    for p in points:
        if p["kind"] == "interference":
            print(f"GEMM slowdown beside {p['backend']}: {100 * p['slowdown']:.1f}% "
                  f"({p['gemm_alone_ms']:.3f} -> {p['gemm_beside_ms']:.3f} ms)")  # fmt: skip
        elif p["kind"] == "overlap":
            print(f"layer-wise overlap ({p['backend']}): compute {p['compute_ms']:.2f} ms, load-then-compute "
                  f"{p['load_then_compute_ms']:.2f} ms, overlapped {p['overlapped_ms']:.2f} ms "
                  f"(x{p['overlap_ratio']:.3f} of compute; load-all {p['load_all_ms']:.2f} ms)")  # fmt: skip
    if args.tune_auto is not None:
        from pathlib import Path

        from .backends import AutoBackend

        tuned = tune_auto(points, args.sm_budget)
        saved = AutoBackend(thresholds=tuned, path=Path(args.tune_auto) if args.tune_auto else None).save()
        meta["auto_thresholds"] = tuned
        print(f"auto thresholds {tuned} saved to {saved}")
    if args.json:
        benchutil.write_json(args.json, meta, points)
    if args.csv:
        benchutil.write_csv(args.csv, meta, points)
    if args.plot:
        plot(args.plot, points, args.sm_budget)
    wrong = [p for p in points if p.get("refcheck") is False]
    for p in wrong:
        print(f"REFCHECK FAILED: {p['backend']} {p['op']} {p['layout']} page {p['page_size']} sm {p['sm_budget']}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["PRESETS", "ModelConfig", "PointSpec", "check_args", "main", "plan_sweep", "run_sweep",
           "validate_bench_json"]  # fmt: skip
