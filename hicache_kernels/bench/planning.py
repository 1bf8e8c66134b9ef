"""The sweep's points from the arguments: models, page counts, the full sweep and its --targets-core subset."""

from __future__ import annotations

import argparse

from .. import layouts, targets
from ..benchutil import counts, names
from .config import (
    BACKENDS,
    DIRECTIONS,
    KERNEL_BACKENDS,
    PRESETS,
    UNBUDGETED_BACKENDS,
    ModelConfig,
    PointSpec,
)


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
    chosen = list(PRESETS) if args.preset == "all" else names("--preset", args.preset, [*PRESETS, "all", "custom"])
    if len(chosen) > 1 and {"all", "custom"} & set(chosen):
        raise ValueError(f"--preset: 'all' and 'custom' stand alone, got {args.preset}")
    return [PRESETS[n] for n in chosen]


def page_counts(args: argparse.Namespace, page_size: int) -> list[int]:
    """Pages moved per point: ``--num-pages`` when given, else ``--tokens`` worth of pages."""
    if args.num_pages is not None:
        return counts("--num-pages", args.num_pages)
    return [max(1, args.tokens // page_size)]


def plan_sweep(args: argparse.Namespace) -> list[PointSpec]:
    """Every point the arguments ask for, in run order (ValueError naming a bad list argument)."""
    points = []
    backends = names("--backends", args.backends, BACKENDS)
    directions = names("--directions", args.directions, list(DIRECTIONS))
    page_sizes = counts("--page-sizes", args.page_sizes)
    host_layouts = names("--layouts", args.layouts, layouts.LAYOUTS)
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
                            sm = None if b in UNBUDGETED_BACKENDS else args.sm_budget
                            points.append(PointSpec(model, b, direction, layout, page, pages, sm))
        # SM-budget sweep of each kernel design at the middle page size, first layout.
        for kernel in (b for b in KERNEL_BACKENDS if b in backends):
            page = page_sizes[len(page_sizes) // 2]
            for sm in counts("--sm-sweep", args.sm_sweep, allow_empty=True):
                if sm == args.sm_budget:
                    continue
                for direction in directions:
                    points.append(PointSpec(model, kernel, direction, usable[0], page, max(1, args.tokens // page),
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
