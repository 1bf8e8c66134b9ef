"""What a sweep would cost before it runs: the memory it holds (refused when it cannot fit) and its GPU time."""

from __future__ import annotations

import argparse
import os

import torch

from .. import layouts
from ..benchutil import format_bytes
from .config import (
    COPY_ENGINE_BACKENDS,
    DIRECTIONS,
    DTYPES,
    ESTIMATE_GBPS,
    ESTIMATE_US_PER_FRAGMENT,
    INTERFERENCE_GEMM_N,
    OVERLAP_GEMM_NS,
    PointSpec,
)
from .planning import models_from_args
from .sweep import Workload


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
        raise ValueError(f"{what}: the run needs {format_bytes(host, 1)} of pinned host memory, more than the "
                         f"{format_bytes(have, 1)} {where}")  # fmt: skip
    if on_gpu:
        free, _ = torch.cuda.mem_get_info()
        if device > free:
            raise ValueError(f"{what}: the run needs {format_bytes(device, 1)} of GPU memory, more than the "
                             f"{format_bytes(free, 1)} free")  # fmt: skip


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
