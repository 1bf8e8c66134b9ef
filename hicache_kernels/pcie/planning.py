"""What a pcie run measures: transfer sizes, the sweep resolved from the arguments, its points in run order."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..benchutil import comma_list, flagged, format_bytes

METHODS = ("copy_engine", "kernel")
MEMORIES = ("pinned", "pageable")
DIRECTIONS = ("h2d", "d2h", "bidir")
KiB, MiB, GiB = 2**10, 2**20, 2**30

FULL_SIZES = tuple(4 * KiB * 4**k for k in range(11) if 4 * KiB * 4**k <= GiB)  # 4 KiB, 16 KiB, ..., 1 GiB
QUICK_SIZES = (64 * KiB, MiB, 16 * MiB, 256 * MiB)
FULL_SM_COUNTS = (1, 2, 4, 8, 16, 32)
QUICK_SM_COUNTS = (1, 4, 16)
LATENCY_SIZES = (8, 4 * KiB)
# Kernel chunk (one warp's unit of work) when --chunk-bytes is auto: enough chunks to give every warp of
# the grid one, but none smaller than MIN nor larger than MAX.
KERNEL_CHUNK_MIN, KERNEL_CHUNK_MAX = 512, 64 * KiB

_SUFFIXES = {"": 1, "B": 1}
_SUFFIXES.update({f"{p}{s}": scale for p, scale in (("K", KiB), ("M", MiB), ("G", GiB)) for s in ("", "B", "IB")})


def parse_size(text: str) -> int:
    """A byte count such as ``4096``, ``64K``, ``64KiB``, ``256M`` or ``1G`` (binary units).

    Raises
    ------
    ValueError
        When ``text`` is not a positive size.
    """
    s = text.strip().upper().replace(" ", "")
    digits = len(s) - len(s.lstrip("0123456789"))
    number, unit = s[:digits], s[digits:]
    if not number or unit not in _SUFFIXES or int(number) * _SUFFIXES[unit] <= 0:
        raise ValueError(f"expected a positive size such as 4096, 64K, 256M or 1G, got {text!r}")
    return int(number) * _SUFFIXES[unit]


def parse_sizes(text: str) -> list[int]:
    """A comma list of sizes (see :func:`parse_size`), sorted, duplicates removed."""
    sizes = sorted(set(comma_list(text, parse_size)))
    if not sizes:
        raise ValueError(f"expected a comma list of sizes, got {text!r}")
    return sizes


@dataclass(frozen=True)
class Sweep:
    """What one run measures, resolved from the arguments (``--quick`` defaults filled in)."""

    sizes: tuple[int, ...]
    sm_counts: tuple[int, ...]
    methods: tuple[str, ...]
    memories: tuple[str, ...]
    directions: tuple[str, ...]
    latency_sizes: tuple[int, ...]
    repeats: int
    warmup: int
    latency_repeats: int
    warps_per_block: int
    chunk_bytes: int | None  # None: auto (kernel_chunk_bytes)
    verify: bool

    @property
    def max_bytes(self) -> int:
        return max((*self.sizes, *self.latency_sizes), default=0)


@dataclass(frozen=True)
class PointSpec:
    """One point: ``nbytes`` moved in each ``direction`` (``bidir``: that many each way, at once)."""

    kind: str  # bandwidth / latency
    method: str  # copy_engine / kernel
    memory: str  # pinned / pageable (kernel: pinned)
    direction: str  # h2d / d2h / bidir
    nbytes: int
    sm_budget: int | None  # kernel: num_blocks per direction; copy engine: None

    def label(self) -> str:
        sm = f" sm={self.sm_budget}" if self.sm_budget is not None else ""
        return f"{self.kind} {self.method} {self.memory} {self.direction} {format_bytes(self.nbytes)}{sm}"


def _csv_choice(text: str, choices: Iterable[str], flag: str) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(comma_list(text)))
    bad = [x for x in items if x not in choices]
    if bad or not items:
        raise ValueError(f"{flag}: expected a comma list of {', '.join(choices)}, got {text!r}")
    return items


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted(set(comma_list(text, int))))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: expected a comma list of positive integers, got {text!r}")
    return values


def resolve_sweep(args: argparse.Namespace) -> Sweep:
    """The :class:`Sweep` the parsed arguments ask for.

    Explicit ``--sizes``, ``--sm-counts``, ``--repeats``, ``--warmup`` and ``--latency-repeats`` win over
    ``--quick``'s reduced defaults; ``--max-size`` drops larger sizes.

    Raises
    ------
    ValueError
        Naming the flag, when a value is malformed or nothing is left to measure.
    """
    max_size = flagged(parse_size, args.max_size, "--max-size")
    if args.sizes:
        sizes = flagged(parse_sizes, args.sizes, "--sizes")
    else:
        sizes = list(QUICK_SIZES if args.quick else FULL_SIZES)
    sizes = [s for s in sizes if s <= max_size]
    if not sizes:
        raise ValueError(f"--sizes/--max-size: no size left at or below --max-size {args.max_size}")
    sm_counts = _positive_ints(args.sm_counts, "--sm-counts") if args.sm_counts else None
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    latency_repeats = args.latency_repeats if args.latency_repeats is not None else (50 if args.quick else 200)
    if repeats < 1 or warmup < 0 or latency_repeats < 1:
        raise ValueError("--repeats/--latency-repeats must be >= 1 and --warmup >= 0")
    if not 1 <= args.warps_per_block <= 32:
        raise ValueError(f"--warps-per-block: expected 1..32, got {args.warps_per_block}")
    chunk = None if args.chunk_bytes in (None, "auto") else flagged(parse_size, args.chunk_bytes, "--chunk-bytes")
    return Sweep(
        sizes=tuple(sizes),
        sm_counts=sm_counts or (QUICK_SM_COUNTS if args.quick else FULL_SM_COUNTS),
        methods=_csv_choice(args.methods, METHODS, "--methods"),
        memories=_csv_choice(args.memory, MEMORIES, "--memory"),
        directions=_csv_choice(args.directions, DIRECTIONS, "--directions"),
        latency_sizes=() if args.no_latency else tuple(flagged(parse_sizes, args.latency_sizes, "--latency-sizes")),
        repeats=repeats,
        warmup=warmup,
        latency_repeats=latency_repeats,
        warps_per_block=args.warps_per_block,
        chunk_bytes=chunk,
        verify=not args.no_verify,
    )


def _configs(sweep: Sweep, kernel_ok: bool, sm_counts: Iterable[int]) -> list[tuple[str, str, int | None]]:
    """(method, memory, sm_budget) triples in run order."""
    out: list[tuple[str, str, int | None]] = []
    if "copy_engine" in sweep.methods:
        out += [("copy_engine", m, None) for m in sweep.memories]
    if "kernel" in sweep.methods and kernel_ok and "pinned" in sweep.memories:
        out += [("kernel", "pinned", sm) for sm in sm_counts]
    return out


def plan_points(sweep: Sweep, kernel_ok: bool = True) -> list[PointSpec]:
    """Every point of the run, in run order: bandwidth (per direction, method/memory/SM budget, size),
    then latency (per size and single direction: copy engine per memory, kernel with 1 block).

    Parameters
    ----------
    sweep
        The resolved arguments.
    kernel_ok
        False when the kernel method cannot run here (its points are left out).
    """
    points = [
        PointSpec("bandwidth", method, memory, d, size, sm)
        for d in sweep.directions
        for method, memory, sm in _configs(sweep, kernel_ok, sweep.sm_counts)
        for size in sweep.sizes
    ]
    points += [
        PointSpec("latency", method, memory, d, size, sm)
        for size in sweep.latency_sizes
        for d in sweep.directions
        if d != "bidir"
        for method, memory, sm in _configs(sweep, kernel_ok, (1,))
    ]
    return points


def kernel_chunk_bytes(nbytes: int, sm_budget: int, warps_per_block: int, override: int | None = None) -> int:
    """Bytes per slot when the kernel treats a buffer of ``nbytes`` as ``nbytes / chunk`` slots.

    Auto (``override`` None): the power of two that gives every warp of the grid one chunk, clamped to
    [512 B, 64 KiB] (one warp moves one chunk at a time, so fewer chunks than warps idles the rest),
    then to ``nbytes``. The result always divides ``nbytes`` (gcd with it).
    """
    if override is not None:
        chunk = override
    else:
        target = max(1, nbytes // max(1, sm_budget * warps_per_block))
        chunk = min(max(1 << (target.bit_length() - 1), KERNEL_CHUNK_MIN), KERNEL_CHUNK_MAX)
    return math.gcd(min(chunk, nbytes), nbytes)
