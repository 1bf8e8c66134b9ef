"""Host pool set-up benchmark: seconds and GB/s to make a host buffer of a given size ready, by thread
count, against the same run's single-threaded memset of a fresh mapping of the same size.

A host pool of hundreds of GB spends its start-up faulting in and zeroing pages (users report over ten
minutes for 0.5-1 TB of pinned memory). :func:`hicache.pools.host_memory.make_host` populates the pages
with several threads (``madvise(MADV_POPULATE_WRITE)``, outside the GIL), optionally on transparent
huge pages and bound to a NUMA node, then pins them (``cudaHostRegister``, when CUDA is there). Each
row is the median of ``--repeats`` fresh buffers: ``populate_s`` (every page resident and zero),
``register_s`` (0 without CUDA), ``total_s``, and ``vs_memset`` (the memset's seconds over
``populate_s``: above 1 is faster than one thread writing every byte). The memset runs before each
repeat's rows, on a fresh mapping too, so it pays the same page faults.

Target: with the default thread count, populating is at least as fast as the single-threaded memset
(``vs_memset >= 1``). On a machine whose cores are busy the threads gain little; the report says how
many CPUs the run had.

Run ``python -m hicache.bench.host_setup [--gib 4] [--threads 1 2 4 8] [--json PATH]``; ``--help`` lists
the knobs.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_kernels.benchutil import provenance

from ..pools import host_memory

_GIB = 1 << 30


def memset_s(nbytes: int) -> float:
    """Seconds for one thread to write zeros over a fresh anonymous mapping of ``nbytes`` (faults and all)."""
    mem = mmap.mmap(-1, host_memory.page_rounded(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(mem, dtype=np.uint8)
    t0 = time.perf_counter()
    a.fill(0)
    took = time.perf_counter() - t0
    del a
    mem.close()
    return took


def setup_once(nbytes: int, pin: bool, setup: host_memory.HostSetup) -> host_memory.SetupReport:
    """Make one buffer of ``nbytes`` as a host pool would, and free it; returns its report."""
    buf, report = host_memory.make_host((nbytes,), torch.uint8, pin=pin, setup=setup)
    del buf
    gc.collect()  # unmapped (and unregistered) before the next one is made
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = int(args.gib * _GIB)
    pin = torch.cuda.is_available() if args.pin is None else args.pin
    default_threads = host_memory._default_threads()
    counts = sorted(set(args.threads or [1, 2, 4, 8]) | {default_threads})
    memsets: list[float] = []
    reports: dict[int, list[host_memory.SetupReport]] = {n: [] for n in counts}
    for _ in range(args.repeats):
        memsets.append(memset_s(nbytes))
        for n in counts:
            setup = host_memory.HostSetup(threads=n, huge_pages=args.huge_pages, numa_node=args.numa_node)
            reports[n].append(setup_once(nbytes, pin, setup))
    memset = statistics.median(memsets)
    rows = []
    print(f"host set-up of {nbytes / _GIB:.2f} GiB ({'pinned' if pin else 'pageable'}); "
          f"single-threaded memset {memset:.3f} s ({nbytes / memset / 1e9:.2f} GB/s)")  # fmt: skip
    for n in counts:
        rs = reports[n]
        populate = statistics.median(r.populate_s for r in rs)
        register = statistics.median(r.register_s for r in rs)
        row = {
            "threads": n,
            "threads_used": rs[0].threads,
            "populate": rs[0].populate,
            "populate_s": populate,
            "populate_gbps": nbytes / populate / 1e9 if populate > 0 else 0.0,
            "register_s": register,
            "total_s": statistics.median(r.populate_s + r.register_s for r in rs),
            "vs_memset": memset / populate if populate > 0 else 0.0,
            "huge_pages": rs[0].huge_pages,
            "huge_pages_note": rs[0].huge_pages_note,
            "default": n == default_threads,
        }
        rows.append(row)
        print(f"  {n:3d} thread(s) ({row['populate']}): populate {populate:.3f} s ({row['populate_gbps']:.2f} GB/s, "
              f"{row['vs_memset']:.2f}x memset), register {register:.3f} s")  # fmt: skip
    best = next(r for r in rows if r["default"])
    status = "PASS" if best["vs_memset"] >= 1.0 else "MISS"
    print(f"target: default threads ({default_threads}) populate >= the single-threaded memset: "
          f"{best['vs_memset']:.2f}x -> {status}")  # fmt: skip
    return {
        "bench": "hicache.bench.host_setup",
        "bytes": nbytes,
        "pinned": pin,
        "repeats": args.repeats,
        "numa_node": args.numa_node,
        "memset_s": memset,
        "memset_gbps": nbytes / memset / 1e9 if memset > 0 else 0.0,
        "default_threads": default_threads,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": rows,
        "target": {
            "what": "default threads populate >= single-threaded memset",
            "ratio": best["vs_memset"],
            "status": status,
        },  # fmt: skip
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache.bench.host_setup", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="buffer size in GiB (default 4)")
    p.add_argument("--threads", type=int, nargs="+", help="thread counts (default 1 2 4 8, and the default count)")
    p.add_argument("--repeats", type=int, default=3, help="fresh buffers per thread count; the median is kept")
    p.add_argument("--huge-pages", action="store_true", help="advise transparent huge pages")
    p.add_argument("--numa-node", type=int, help="bind the pages to this NUMA node")
    pin = p.add_mutually_exclusive_group()
    pin.add_argument("--pin", dest="pin", action="store_true", default=None, help="pin (needs CUDA)")
    pin.add_argument("--no-pin", dest="pin", action="store_false", help="pageable only")
    p.add_argument("--safety-margin-gib", type=float, default=2.0, help="available RAM to leave untouched")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = p.parse_args(argv)
    if not a.gib > 0:
        p.error(f"--gib: expected a positive size, got {a.gib}")
    if a.repeats < 1:
        p.error(f"--repeats: expected >= 1, got {a.repeats}")
    if a.threads is not None and min(a.threads) < 1:
        p.error(f"--threads: expected counts >= 1, got {a.threads}")
    if a.pin and not torch.cuda.is_available():
        p.error("--pin: pinning needs CUDA (torch.cuda.is_available() is False)")
    if a.numa_node is not None:
        try:
            host_memory.HostSetup(numa_node=a.numa_node)
        except ValueError as exc:
            p.error(f"--numa-node: {exc}")
    available = host_memory.mem_available_bytes()
    if available is not None and a.gib * _GIB > available - a.safety_margin_gib * _GIB:
        p.error(f"--gib: {a.gib:.2f} GiB does not fit in available RAM {available / _GIB:.2f} GiB minus the "
                f"safety margin {a.safety_margin_gib:.2f} GiB")  # fmt: skip
    prov = provenance("hicache.bench.host_setup", argv) if a.json else {}  # the code and machine as the run starts
    out = {**prov, **run(a)}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 0  # a measurement: the target's status is in the report, the exit status says the run worked


if __name__ == "__main__":
    raise SystemExit(main())
