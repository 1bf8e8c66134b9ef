"""The bench's main: the sweep on a GPU, the functional check without one, or --host-overhead."""

from __future__ import annotations

import os
import sys

import torch

from .. import benchutil
from . import cpu_check, host_overhead, interference, memory, planning, results, sweep
from .args import ignored_without_gpu, parse_args
from .config import ESTIMATE_GBPS, ESTIMATE_US_PER_FRAGMENT


def main(argv: list[str] | None = None) -> int:
    """Run the bench (see :mod:`hicache_kernels.bench`); returns the exit status."""
    args = parse_args(argv)
    # The JSON's command, commit and machine, as the run starts.
    prov = benchutil.provenance("hicache_kernels.bench", argv) if args.json else {}
    if args.host_overhead:
        return host_overhead.run(args, benchutil.run_meta("bench", vars(args)), prov)
    specs = planning.plan_sweep(args)
    meta = benchutil.run_meta("bench", vars(args))
    est = memory.estimate_s(specs, args.repeats, args.warmup, args.refcheck)
    print(f"bench: {len(specs)} transfer points; on an H200 about {est:.0f} s of GPU time (an estimate: bytes at "
          f"{ESTIMATE_GBPS:g} GB/s plus {ESTIMATE_US_PER_FRAGMENT:g} us per copy-engine fragment; setup, "
          "interference and overlap not counted)")  # fmt: skip
    if not torch.cuda.is_available():
        return _functional_check(args, meta, prov)
    torch.cuda.init()
    link_gbps, link = results.link_bandwidth()
    meta["link_theoretical_gbps"], meta["link"] = link_gbps, link
    why_not = str(link.get("error") or "NVML reported no known PCIe generation and width")
    if link_gbps is None:
        print(f"bench: link check not made: the link's theoretical bandwidth is unknown ({why_not})")
    # One side stream for every point, its warm-up and its ceiling: the timer's (batch refuses the
    # legacy default stream).
    timer = benchutil.CudaEventTimer(torch.cuda.Stream())
    progress = benchutil.Progress(len(specs), "bench")
    try:
        points = sweep.run_sweep(specs, device=torch.device("cuda"), timer=timer, repeats=args.repeats,
                                 warmup=args.warmup, seed=args.seed, tokens=max(s.num_tokens for s in specs),
                                 progress=progress, refcheck=args.refcheck, link_gbps=link_gbps)  # fmt: skip
    except sweep.LinkCheckError as exc:
        progress.close()
        meta["link_check"] = results.link_check_meta(link_gbps, why_not, str(exc))
        benchutil.write_outputs(args.json, None, meta, exc.points, **prov)
        print(f"bench: refused: {exc}", file=sys.stderr)
        return 3
    progress.close()
    meta["link_check"] = results.link_check_meta(link_gbps, why_not)
    models = planning.models_from_args(args)
    if args.interference:
        backends = [b for b in benchutil.comma_list(args.backends) if b != "triton"]
        points += interference.interference(args, models[0], backends, args.repeats)
    if args.overlap:
        backend = "kernel" if "kernel" in args.backends else "direct"
        points.append(interference.overlap(args, models[0], backend, args.repeats))
    print(benchutil.format_table([p for p in points if p["kind"] == "transfer"], results.TABLE))
    _print_notes(points)
    if args.tune_auto is not None:
        from pathlib import Path

        from ..backends import AutoBackend

        tuned = sweep.tune_auto(points, args.sm_budget)
        saved = AutoBackend(thresholds=tuned, path=Path(args.tune_auto) if args.tune_auto else None).save()
        meta["auto_thresholds"] = tuned
        for line in results.format_tuned(tuned):
            print(line)
        print(f"auto's table saved to {saved}")
    for line in benchutil.write_outputs(args.json, args.csv, meta, points, **prov):
        print(line)
    if args.plot:
        results.plot(args.plot, points, args.sm_budget)
    wrong = [p for p in points if p.get("refcheck") is False]
    for p in wrong:
        print(f"REFCHECK FAILED: {p['backend']} {p['op']} {p['layout']} page {p['page_size']} sm {p['sm_budget']}")
    return 1 if wrong else 0


def _functional_check(args, meta: dict, prov: dict) -> int:
    """Without a GPU: the functional cross-check of the CPU-capable backends (no figures)."""
    meta["link_theoretical_gbps"] = None
    meta["link_check"] = results.link_check_meta(None, "no GPU")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the functional check runs Triton on CPU tensors
    print("hicache-kernels bench: bandwidth needs a CUDA GPU, and none is visible here "
          f"({meta.get('driver') or 'no driver'}; torch {torch.__version__}).")  # fmt: skip
    ignored = ignored_without_gpu(args)
    if ignored:
        print(f"bench: ignored without a GPU: {', '.join(ignored)} (they need measured points)")
    print("Running the functional cross-check of the CPU-capable backends instead (correctness only, no GB/s):")
    checks = cpu_check.functional_check(args.seed)
    rows: dict[str, dict] = {}
    for c in checks:
        r = rows.setdefault(c["backend"], {"backend": c["backend"], "cases": 0, "passed": 0})
        r["cases"] += 1
        r["passed"] += int(c["ok"])
    print(benchutil.format_table(list(rows.values()), [("backend", "backend"), ("cases", "cases"),
                                                       ("passed", "passed")]))  # fmt: skip
    for c in checks:
        if not c["ok"]:
            print(f"  FAILED {c}")
    benchutil.write_outputs(args.json, None, meta, [], mode=cpu_check.MODE, functional_check=checks, **prov)
    return 0 if all(c["ok"] for c in checks) else 1


def _print_notes(points: list[dict]) -> None:
    """Batch fallbacks, and the interference and overlap results, one line each."""
    for p in points:
        if p.get("batch_fallback"):
            print(f"BATCH FELL BACK TO DIRECT ({p['backend']} {p['op']} {p['layout']} page {p['page_size']}): "
                  f"{p['batch_fallback']}; targets 3 and 4 fail on this point")  # fmt: skip
    for p in points:
        if p["kind"] == "interference":
            sms = "" if p.get("sm_budget") is None else f" at {p['sm_budget']} SMs"
            print(f"GEMM slowdown beside {p['backend']}{sms}: {100 * p['slowdown']:.1f}% "
                  f"({p['gemm_alone_ms']:.3f} -> {p['gemm_beside_ms']:.3f} ms)")  # fmt: skip
        elif p["kind"] == "overlap":
            print(f"layer-wise overlap ({p['backend']}): compute {p['compute_ms']:.2f} ms, load-then-compute "
                  f"{p['load_then_compute_ms']:.2f} ms, overlapped {p['overlapped_ms']:.2f} ms "
                  f"(x{p['overlap_ratio']:.3f} of compute; load-all {p['load_all_ms']:.2f} ms)")  # fmt: skip
