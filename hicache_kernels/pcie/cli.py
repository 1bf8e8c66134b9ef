"""``python -m hicache_kernels.pcie``'s arguments and main: the sweep on a GPU, or why it cannot run."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from .. import _env, benchutil
from ..benchutil import OneLineParser, cuda_device_uuid, format_bytes, link_facts, nvml_for_device, theoretical_of
from . import gpu
from .measure import run_sweep
from .nvml import NvmlPcieSampler
from .planning import DIRECTIONS, LATENCY_SIZES, MEMORIES, METHODS, plan_points, resolve_sweep
from .report import format_points, peak_summary, write_plot

DESCRIPTION = "``python -m hicache_kernels.pcie``: the host link itself, by copy engines and by SM-driven zero copy."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments (argparse's own errors in one line, exit status 2); :func:`resolve_sweep` checks the values."""
    p = OneLineParser(prog="python -m hicache_kernels.pcie", description=DESCRIPTION)
    p.add_argument("--sizes", help="comma list of transfer sizes (4096, 64K, 256M, 1G); default 4K..1G by 4x")
    p.add_argument("--max-size", default="1G", help="drop sizes above this (default 1G)")
    p.add_argument("--sm-counts", help="kernel SM budgets (num_blocks) to sweep; default 1,2,4,8,16,32")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of copy_engine, kernel")
    p.add_argument("--memory", default=",".join(MEMORIES), help="host memory for copy engines: pinned, pageable")
    p.add_argument("--directions", default=",".join(DIRECTIONS), help="comma list of h2d, d2h, bidir")
    p.add_argument("--repeats", type=int, help="timed calls per bandwidth point (default 20; --quick 5)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 3; --quick 1)")
    p.add_argument(
        "--latency-sizes",
        default=",".join(map(str, LATENCY_SIZES)),
        help="small copies timed as latency (default 8,4096)",
    )
    p.add_argument("--latency-repeats", type=int, help="timed calls per latency point (default 200; --quick 50)")
    p.add_argument("--no-latency", action="store_true", help="skip the latency points")
    p.add_argument("--warps-per-block", type=int, default=32, help="kernel warps per block (default 32)")
    p.add_argument("--chunk-bytes", default="auto", help="kernel bytes per slot, or auto (one chunk per warp)")
    p.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte check of each point's copy")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--quick", action="store_true", help="sizes 64K,1M,16M,256M, SM counts 1,4,16, fewer repeats")
    p.add_argument("--json", metavar="PATH", help="write the run's tags and every point as JSON")
    p.add_argument("--csv", metavar="PATH", help="write every point as CSV")
    p.add_argument("--plot", metavar="PATH.png", help="plot GB/s vs size (needs matplotlib)")
    return p.parse_args(argv)


def _status_lines() -> tuple[list[str], dict[str, Any]]:
    """Why there is no usable GPU: torch, driver, NVML and extension reasons, as text and as data."""
    from .._ext import extension_status

    _, torch_reason = _env._torch_cuda()
    _, nvml_reason = _env._nvml()
    cv = _env.cuda_versions()
    ext_ok, ext_reason = extension_status()
    reasons = {
        "torch": torch_reason,
        "nvml": nvml_reason,
        "driver": cv.get("driver_error") or f"driver {cv.get('driver')} (CUDA {cv.get('driver_cuda')})",
        "extension": "imports" if ext_ok else ext_reason,
    }
    lines = [f"  {k}: {v}" for k, v in reasons.items()]
    return lines, reasons


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (or report why it cannot run) and write the outputs; returns the exit status."""
    args = parse_args(argv)
    prov = benchutil.provenance("hicache_kernels.pcie", argv) if args.json else {}  # command, commit, machine
    try:
        sweep = resolve_sweep(args)
    except ValueError as exc:
        print(f"pcie: {exc}", file=sys.stderr)
        return 2

    if not torch.cuda.is_available():
        lines, reasons = _status_lines()
        print("pcie: host-link bandwidth and latency need a CUDA GPU; none is usable here, nothing measured.")
        print("\n".join(lines))
        meta = benchutil.run_meta("pcie", vars(args))
        for line in benchutil.write_outputs(args.json, args.csv, meta, [], mode="no-gpu", reasons=reasons, **prov):
            print(line)
        if args.plot:
            print(f"pcie: --plot {args.plot}: nothing to plot without a GPU")
        return 0

    if not 0 <= args.device < torch.cuda.device_count():
        print(f"pcie: --device {args.device}: {torch.cuda.device_count()} CUDA device(s) visible", file=sys.stderr)
        return 2
    if args.plot and benchutil.plot_unavailable() is not None:
        print(f"pcie: --plot: {benchutil.plot_unavailable()}", file=sys.stderr)
        return 2
    torch.cuda.set_device(args.device)
    device = torch.device("cuda", args.device)
    props = torch.cuda.get_device_properties(device)
    uuid = cuda_device_uuid(args.device)

    notes: list[str] = []
    kernel_reason = gpu.kernel_unavailable(args.device) if "kernel" in sweep.methods else None
    if kernel_reason:
        notes.append(f"kernel method skipped: {kernel_reason}")
    nvml, handle, nvml_reason = nvml_for_device(args.device, uuid)
    link = link_facts(nvml, handle, nvml_reason)
    theoretical = theoretical_of(link)
    if nvml is None:
        notes.append(f"NVML: {nvml_reason} (no link facts, no throughput counters)")
    specs = plan_points(sweep, kernel_ok=kernel_reason is None)
    specs = plan_points(sweep, kernel_ok=kernel_reason is None)
    print(f"pcie: {props.name} (device {args.device}, {props.multi_processor_count} SMs), {len(specs)} points")
    if link.get("error"):
        print(f"  PCIe link: unknown ({link['error']})")
    else:
        print(
            f"  PCIe link: Gen{link['current_generation']} x{link['current_width']} now, max "
            f"Gen{link['max_generation']} x{link['max_width']}: {theoretical} GB/s per direction (theoretical)"
        )
    for note in notes:
        print(f"  {note}")
    if not specs:
        print("pcie: nothing left to measure with these --methods/--memory on this machine", file=sys.stderr)
        return 1

    meta = benchutil.run_meta("pcie", vars(args))
    try:
        bench = gpu.LinkBench(device, sweep, kernel=any(s.method == "kernel" for s in specs))
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        print(
            f"pcie: could not set up buffers of {format_bytes(sweep.max_bytes)} (device, pinned and pageable host): "
            f"{type(exc).__name__}: {exc}; try a smaller --max-size",
            file=sys.stderr,
        )
        return 1
    sampler = NvmlPcieSampler(nvml, handle) if nvml is not None else None
    progress = benchutil.Progress(len(specs), "pcie")
    main_stream = torch.cuda.Stream(device)
    try:
        if sampler is not None:
            sampler.start()
        with torch.cuda.stream(main_stream):
            points = run_sweep(
                specs,
                bench.workload,
                timer=benchutil.CudaEventTimer(main_stream),
                sweep=sweep,
                sampler=sampler,
                theoretical_gbps=theoretical,
                progress=progress,
            )
    finally:
        if sampler is not None:
            sampler.stop()
        progress.close()
    link_after = link_facts(nvml, handle, nvml_reason)

    print(format_points(points))
    print("\n".join(peak_summary(points)))
    if sampler is not None and sampler.errors:
        print(f"  NVML throughput counters: {sampler.errors}")
    failed = [p for p in points if p.get("error")]
    if failed:
        print(f"pcie: {len(failed)} point(s) failed; see the error column")
    extra = {
        "mode": "gpu",
        "device": {"index": args.device, "name": props.name, "sm_count": props.multi_processor_count, "uuid": uuid},
        "link": link,
        "link_after": link_after,
        "theoretical_gbps": theoretical,
        "nvml": {"available": nvml is not None, "reason": nvml_reason}
        | (sampler.summary() if sampler is not None else {}),
        "notes": notes,
        **prov,
    }
    for line in benchutil.write_outputs(args.json, args.csv, meta, points, **extra):
        print(line)
    if args.plot:
        try:
            print(f"wrote {write_plot(points, args.plot, theoretical)}")
        except ValueError as exc:
            print(f"pcie: --plot: {exc}")
    return 1 if failed else 0
