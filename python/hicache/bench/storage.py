"""Storage-tier benchmark: batch get/set of host pages through a backend, against the same bytes
read and written sequentially in one file in the same run; and prefetch latency against hit length.

For each model preset and page size, ``--pages`` host pages of random bytes are written with one
``batch_set_from`` and read back with one ``batch_get_into`` (timed; median of ``--repeats``), then
the same bytes go through one file with ``os.pwritev`` / ``os.preadv`` (the sequential baseline).
Both reads come from the page cache (a benchmark without root cannot drop it), so the ratio compares
the backend's per-page work (open, header, checksum, index) with a plain copy, which is what decides
whether the tier beats recomputation. Then a cache backed by the store prefetches hits of growing
length (``wait_complete``), timing ``prefetch_from_storage`` until ``check_prefetch_progress`` admits
(the median of ``--repeats`` prefetches, each into a fresh cache).

Target (the storage issue's): file backend batch get of 128 pages >= 70% of the same-run sequential
read of the same bytes.

``--direct-io``: the file backend reads and writes with ``O_DIRECT`` (``FileBackend(direct_io=True)``),
and the sequential baseline opens its file with ``O_DIRECT`` too (into the same host pages when they
are whole 4096-byte blocks, else one aligned buffer of the same size), so both sides are cold: they go
to the disk, not the page cache (what the disk's own cache, or a hypervisor's, holds is out of reach).
Each row also reports the page cache's share of the run: ``store_cached_bytes`` / ``seq_cached_bytes``
(the bytes of the store's objects / the sequential file resident in the page cache once the reads are
done, by ``mincore``; what the run itself left there) and ``page_cache_growth_bytes`` (the change of
``Cached:`` in ``/proc/meminfo`` over the row; system-wide, so other processes' I/O shows in it).
Rows whose pages went buffered (``direct_fallbacks`` > 0: a geometry whose pages are not whole blocks,
e.g. DeepSeek-V3 with 16-token pages) are left out of the verdict. Targets: batch get of 128 pages >=
80% of the sequential ``O_DIRECT`` read, and the store's resident bytes <= 1% of the bytes moved
(page cache growth ~ 0). ``--dir`` chooses where the store goes: it must take ``O_DIRECT`` (not tmpfs
before Linux 6.6).

Run ``python -m hicache.bench.storage [--json PATH]``; ``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hicache_kernels.benchutil import meminfo_bytes, provenance
from hicache_kernels.layouts import LAYOUTS

from ..cache.radix_cache import HiRadixCache
from ..pools import DeviceKVPool, HostKVPool
from ..storage import FileBackend, StorageBackend, create_backend, page_views
from ..storage.fileio import DIRECT_ALIGN, direct_aligned, preadv_all, pwritev_all  # the file backend's own
from ..storage.objects import StoredObjects
from ..storage.tier import PrefetchPolicy

# name -> (layers, kv heads, head dim, mla): bf16 pools as the kernel benchmark's presets.
PRESETS = {
    "llama3-8b": (32, 8, 128, False),
    "qwen3-32b": (64, 8, 128, False),
    "deepseek-v3": (61, 1, 576, True),
}
TARGET_GET_OVER_SEQ = 0.70
TARGET_DIRECT_GET_OVER_SEQ = 0.80  # --direct-io: both sides cold
TARGET_DIRECT_CACHED_SHARE = 0.01  # --direct-io: the store's bytes left in the page cache / bytes moved


def make_pools(preset: str, page_size: int, pages: int, layout: str = "page_first") -> HostKVPool:
    layers, heads, dim, mla = PRESETS[preset]
    dev = DeviceKVPool(num_slots=page_size, num_layers=layers, head_num=heads, head_dim=dim, dtype=torch.bfloat16,
                       device="cpu", page_size=page_size, mla=mla)  # fmt: skip
    host = HostKVPool(dev, layout=layout, ratio=pages + 1, safety_margin_gb=1.0)
    raw = host.buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    return host


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_objects(preset: str, page_size: int, repeats: int) -> list[dict[str, Any]]:
    """What the storage tier's objects cost per host layout (MHA; TP=1, one head per object): zero copy,
    or the staging copy of a batch (a staging area's pages) before a backup's write (gather) and after a
    prefetch's read (scatter), in GB/s of page bytes."""
    if PRESETS[preset][3]:
        return []  # MLA: pages are stored as they are
    out = []
    for layout in LAYOUTS:
        probe = StoredObjects(make_pools(preset, page_size, 1, layout), max_pages=128)
        n = probe.stage_pages or 1
        host = make_pools(preset, page_size, n, layout)
        objects = StoredObjects(host, max_pages=128)
        row: dict[str, Any] = {"preset": preset, "page_size": page_size, "layout": layout,
                               "zero_copy": objects.zero_copy, "object_bytes": objects.page_bytes,
                               "objects_per_page": objects.objects_per_page, "pages": n}  # fmt: skip
        if not objects.zero_copy:
            slots = torch.arange(n * page_size)
            nbytes = n * host.page_bytes
            row["gather_gbps"] = nbytes / _median(lambda o=objects, s=slots: o.gather("backup", s), repeats) / 1e9
            row["scatter_gbps"] = nbytes / _median(lambda o=objects, s=slots: o.scatter("prefetch", s), repeats) / 1e9
        out.append(row)
        del host, objects, probe
    return out


def cached_bytes() -> int | None:
    """``Cached:`` of /proc/meminfo in bytes (the page cache, system-wide), or None where there is none."""
    return meminfo_bytes("Cached")


def resident_bytes(paths: list[Path]) -> int | None:
    """Bytes of the files ``paths`` resident in the page cache (``mincore`` over a mapping of each, which
    itself reads nothing); None where ``mincore`` cannot be called. Files that vanish count 0."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_, mincore, munmap = libc.mmap, libc.mincore, libc.munmap
    except (OSError, AttributeError):
        return None
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            if not size:
                continue
            addr = mmap_(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
                if mincore(addr, size, vec) != 0:
                    return None
                total += min(size, sum(b & 1 for b in vec) * mmap.PAGESIZE)
            finally:
                munmap(addr, size)
        finally:
            os.close(fd)
    return total


def _sequential(path: Path, ranges: list[tuple[int, int]], repeats: int,
                direct: bool = False) -> tuple[float, float, int | None]:  # fmt: skip
    """Median seconds to write the memory ``ranges`` into one file and to read them back (preadv into the
    same memory), and the file's bytes left in the page cache. ``direct``: with ``O_DIRECT`` (through one
    aligned buffer of the same size, rounded up to whole blocks, when ``ranges`` are not whole blocks)."""
    flags = os.O_DIRECT if direct else 0
    bounce = None
    if direct and not direct_aligned(ranges):
        nbytes = sum(n for _, n in ranges)
        bounce = mmap.mmap(-1, -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN)  # page-aligned
        views = [memoryview(bounce)]
    else:
        views = page_views(ranges)

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
        try:
            pwritev_all(fd, views, 0)
        finally:
            os.close(fd)

    def read() -> None:
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            if preadv_all(fd, views, 0) != sum(len(v) for v in views):
                raise OSError(f"{path}: short read")
        finally:
            os.close(fd)

    try:
        write_s = _median(write, repeats)
        read_s = _median(read, repeats)
        cached = resident_bytes([path])
    finally:
        if bounce is not None:
            views[0].release()
            bounce.close()
    path.unlink()
    return write_s, read_s, cached


def bench_batch(backend: StorageBackend, host: HostKVPool, pages: int, repeats: int, workdir: Path) -> dict[str, Any]:
    direct = isinstance(backend, FileBackend) and backend.direct_io
    cached_before = cached_bytes()
    ps = host.page_size
    slots = torch.arange(pages * ps, dtype=torch.int64)
    keys = [secrets.token_hex(32) for _ in range(pages)]
    backend.attach(host)
    nbytes = pages * host.page_bytes

    def set_all() -> None:
        # A fresh write each time (a backend skips keys it already holds): the file backend's objects
        # of the previous repeat are removed, other backends get new keys.
        if isinstance(backend, FileBackend):
            for k in keys:
                backend_remove(backend, k)
        else:
            keys[:] = [secrets.token_hex(32) for _ in range(pages)]
        ok = backend.batch_set_from(keys, slots)
        assert all(ok), "batch_set_from refused pages"

    def get_all() -> None:
        ok = backend.batch_get_into(keys, slots)
        assert all(ok), "batch_get_into missed pages"

    set_s = _median(set_all, repeats)
    get_s = _median(get_all, repeats)
    store_cached = resident_bytes([backend._file(k) for k in keys]) if isinstance(backend, FileBackend) else None
    ranges = [r for page in host.page_ranges(slots) for r in page]
    seq_write_s, seq_read_s, seq_cached = _sequential(workdir / "sequential.bin", ranges, repeats, direct)
    cached_after = cached_bytes()
    st = backend.stats()
    return {
        "pages": pages,
        "page_bytes": host.page_bytes,
        "bytes": nbytes,
        "get_s": get_s,
        "set_s": set_s,
        "get_gbps": nbytes / get_s / 1e9,
        "set_gbps": nbytes / set_s / 1e9,
        "get_pages_per_s": pages / get_s,
        "set_pages_per_s": pages / set_s,
        "seq_read_gbps": nbytes / seq_read_s / 1e9,
        "seq_write_gbps": nbytes / seq_write_s / 1e9,
        "get_over_seq_read": seq_read_s / get_s,
        "set_over_seq_write": seq_write_s / set_s,
        "direct_io": bool(direct),
        "direct_pages": int(st.get("direct_pages", 0)),
        "direct_fallbacks": int(st.get("direct_fallbacks", 0)),
        "store_cached_bytes": store_cached,
        "seq_cached_bytes": seq_cached,
        "page_cache_growth_bytes": None if None in (cached_before, cached_after) else cached_after - cached_before,
    }


def backend_remove(backend: StorageBackend, key: str) -> None:
    if isinstance(backend, FileBackend):
        path = backend._file(key)
        if path.exists():
            path.unlink()
        backend._miss(key)


def bench_prefetch(make_backend, preset: str, page_size: int, hits: list[int], layout: str = "page_first",
                   head_group: int = 1, repeats: int = 1) -> list[dict[str, Any]]:  # fmt: skip
    """Prefetch latency (start to admission, ``wait_complete``) for hits of ``hits`` pages, host pools in
    ``layout``, MHA pages stored as objects of ``head_group`` heads: the median of ``repeats`` prefetches,
    each into a fresh cache (``latencies_s`` keeps them all)."""
    layers, heads, dim, mla = PRESETS[preset]
    out = []
    most = max(hits)
    tokens = [secrets.randbelow(32000) for _ in range(most * page_size)]

    def cache() -> HiRadixCache:
        dev = DeviceKVPool(num_slots=most * page_size, num_layers=layers, head_num=heads, head_dim=dim,
                           dtype=torch.bfloat16, device="cpu", page_size=page_size, mla=mla)  # fmt: skip
        host = HostKVPool(dev, layout=layout, ratio=2.0, safety_margin_gb=1.0)
        return HiRadixCache(dev, host, io_backend="direct", threaded=True, storage=make_backend(),
                            model_id=f"bench-{preset}", load_back_threshold=1, storage_head_group=head_group,
                            prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=page_size))  # fmt: skip

    # The writer stays open while the readers run (a Mooncake object lives as long as the client
    # that put it).
    with cache() as writer:
        slots = writer.device_pool.alloc(len(tokens))
        writer.insert(tokens, slots)
        writer.flush()
        for n in hits:
            toks = tokens[: n * page_size]
            times = []
            for _ in range(repeats):
                with cache() as reader:
                    t0 = time.perf_counter()
                    m = reader.match_prefix(toks)
                    assert reader.prefetch_from_storage("r", m.last_host_node, toks)
                    while not reader.check_prefetch_progress("r"):
                        time.sleep(0.0001)
                    times.append(time.perf_counter() - t0)
                    assert reader.metrics.storage_hit_tokens == len(toks)
                    objects_per_page, page_bytes = reader.storage.objects.objects_per_page, reader.host_pool.page_bytes
            dt = statistics.median(times)
            out.append({"hit_pages": n, "hit_tokens": len(toks), "latency_s": dt, "latencies_s": times,
                        "layout": layout, "head_group": 1 if mla else head_group,
                        "objects_per_page": objects_per_page, "gbps": n * page_bytes / dt / 1e9})  # fmt: skip
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows, prefetch, objects = [], [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        workdir = Path(tmp)

        def make_backend() -> StorageBackend:
            if args.backend == "file":
                return FileBackend(workdir / "store", num_threads=args.threads, direct_io=args.direct_io)
            return create_backend(args.backend, json.loads(args.config) if args.config else None)

        for preset in args.presets:
            for ps in args.page_sizes:
                host = make_pools(preset, ps, args.pages)
                backend = make_backend()
                try:
                    row = {"preset": preset, "page_size": ps, **bench_batch(backend, host, args.pages, args.repeats,
                                                                             workdir)}  # fmt: skip
                finally:
                    backend.close()
                rows.append(row)
                print(f"{preset:>12} page {ps:>3}: {args.pages} pages x {row['page_bytes'] / 2**20:.1f} MiB  "
                      f"get {row['get_gbps']:6.2f} GB/s ({row['get_pages_per_s']:7.0f} pages/s)  "
                      f"set {row['set_gbps']:6.2f} GB/s  | sequential read {row['seq_read_gbps']:6.2f} "
                      f"write {row['seq_write_gbps']:6.2f} GB/s  -> get/seq {row['get_over_seq_read']:.2f}, "
                      f"set/seq {row['set_over_seq_write']:.2f}")  # fmt: skip
                if args.direct_io:
                    print(f"{'':>12} O_DIRECT: {row['direct_pages']} pages direct, {row['direct_fallbacks']} buffered "
                          f"(unaligned); page cache: store {_mib(row['store_cached_bytes'])}, sequential file "
                          f"{_mib(row['seq_cached_bytes'])}, Cached: {_mib(row['page_cache_growth_bytes'])} "
                          f"over the row")  # fmt: skip
                del host
                if not args.direct_io:
                    for o in bench_objects(preset, ps, args.repeats):
                        objects.append(o)
                        cost = "zero copy" if o["zero_copy"] else (
                            f"staged: gather {o['gather_gbps']:6.2f} GB/s, scatter {o['scatter_gbps']:6.2f} GB/s "
                            f"({o['pages']} pages a batch)")  # fmt: skip
                        kib = o["object_bytes"] / 2**10
                        print(f"{'':>12} objects ({o['objects_per_page']} a page, {kib:.0f} KiB), {o['layout']:>17}: "
                              f"{cost}")  # fmt: skip
        if args.prefetch_hits:
            prefetch = bench_prefetch(make_backend, args.presets[0], args.page_sizes[0], args.prefetch_hits,
                                      args.prefetch_layout, args.head_group, args.repeats)  # fmt: skip
            for p in prefetch:
                print(f"prefetch {p['hit_pages']:>4} pages ({p['hit_tokens']} tokens): {1e3 * p['latency_s']:8.2f} ms "
                      f"(median of {len(p['latencies_s'])}) "
                      f"({p['gbps']:.2f} GB/s; {p['layout']}, {p['objects_per_page']} objects a page)")  # fmt: skip
    # With --direct-io, rows whose pages went buffered compare a warm read with a cold one: not counted.
    counted = [r for r in rows if r["pages"] >= 128 and not (args.direct_io and r["direct_fallbacks"])]
    target_ratio = TARGET_DIRECT_GET_OVER_SEQ if args.direct_io else TARGET_GET_OVER_SEQ
    worst = min((r["get_over_seq_read"] for r in counted), default=None)
    verdict = None if worst is None else ("pass" if worst >= target_ratio else "MISS")
    if worst is not None:
        cold = " (both O_DIRECT, cold)" if args.direct_io else ""
        print(f"target: batch get of >= 128 pages / sequential read{cold} >= {target_ratio}: worst {worst:.2f} "
              f"-> {verdict}")  # fmt: skip
    target: dict[str, Any] = {"get_over_seq_read_min": target_ratio, "worst": worst, "status": verdict}
    if args.direct_io:
        shares = [r["store_cached_bytes"] / r["bytes"] for r in counted if r["store_cached_bytes"] is not None]
        share = max(shares, default=None)
        cache_verdict = None if share is None else ("pass" if share <= TARGET_DIRECT_CACHED_SHARE else "MISS")
        target.update(store_cached_share_max=TARGET_DIRECT_CACHED_SHARE, store_cached_share_worst=share,
                      page_cache_status=cache_verdict)  # fmt: skip
        if share is not None:
            print(f"target: the store's bytes in the page cache / bytes moved <= {TARGET_DIRECT_CACHED_SHARE}: "
                  f"worst {share:.4f} -> {cache_verdict}")  # fmt: skip
    return {
        "bench": "hicache.bench.storage",
        "backend": args.backend,
        "threads": args.threads,
        "repeats": args.repeats,
        "direct_io": bool(args.direct_io),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": rows,
        "prefetch": prefetch,
        "objects": objects,
        "target": target,
    }


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache.bench.storage", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="file", help="file, or a name / module:Class for create_backend")
    p.add_argument("--config", help="JSON config for a backend other than file")
    p.add_argument("--presets", nargs="+", default=["llama3-8b", "deepseek-v3"], choices=sorted(PRESETS))
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--pages", type=int, default=128, help="pages per batch (the target reads 128)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=4, help="the file backend's I/O threads")
    p.add_argument("--prefetch-hits", type=int, nargs="*", default=[1, 8, 32, 128],
                   help="hit lengths in pages for the prefetch latency (none: skip)")  # fmt: skip
    p.add_argument("--prefetch-layout", default="page_first", choices=LAYOUTS,
                   help="the host layout of the prefetch latency's caches (default page_first)")  # fmt: skip
    p.add_argument("--head-group", type=int, default=1,
                   help="the prefetch caches' storage_head_group: K/V heads per stored object (default 1)")  # fmt: skip
    p.add_argument("--dir", help="where the temporary store goes (default: the system's temp dir)")
    p.add_argument("--direct-io", action="store_true",
                   help="backend and sequential baseline use O_DIRECT (cold; --dir must take it)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = p.parse_args(argv)
    for name, value in (("--pages", a.pages), ("--repeats", a.repeats), ("--threads", a.threads),
                        ("--head-group", a.head_group)):  # fmt: skip
        if value < 1:
            p.error(f"{name}: expected >= 1, got {value}")
    if a.direct_io and a.backend != "file":
        p.error(f"--direct-io: only the file backend has it, got --backend {a.backend}")
    prov = provenance("hicache.bench.storage", argv) if a.json else {}  # the code and machine as the run starts
    out = {**prov, **run(a)}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 1 if "MISS" in (out["target"]["status"], out["target"].get("page_cache_status")) else 0


if __name__ == "__main__":
    sys.exit(main())
