"""Radix-tree benchmark: a seeded multi-turn chat workload through ``match_prefix`` + ``insert``.

What a scheduler does per request is timed: match the prompt, allocate device slots for the tokens
that missed, insert the page-aligned prompt with the matched slots plus the new ones, and free the
slots the insert reports as duplicated. No KV is copied: the pools are CPU pools of one layer, one
head of one element, large enough that nothing is evicted, the controller runs inline
(``threaded=False``) and the write policy is ``write_back`` (a backup only on eviction, which never
happens), so the figure is the tree plus the slot allocator. Both tree cores run by default (the
compiled one, which ``HiRadixCache`` picks when ``hicache._core`` is built, and the Python reference).

When ``sglang.srt.mem_cache.radix_cache`` imports (SGLang's pure-Python ``RadixCache``), the same
requests run through it in the same process and the ratio is reported. Its slots come from a counter
(no allocator, nothing freed), which flatters it slightly.

Workload (SGLang ``benchmark/hicache/bench_multiturn.py`` in spirit): ``conversations`` chats, each
starting from one of ``system_prompts`` shared system prompts; turn ``t`` sends the whole history
(system prompt, every earlier question and answer) plus a new question. Requests are issued in a
seeded interleaving that keeps each chat's turns in order.

Also timed: the slot bookkeeping one request's copies cost in the host pool (alloc, the backup's and
the load-back's state changes, free) for ``--slot-sizes`` slots.

``--compare sglang-latest`` adds SGLang 0.5.23's ``UnifiedRadixCache`` on its Rust core to the same
comparison, run in a child process on the same requests (:mod:`hicache.bench.sglang`: how to provide it,
and why a child); when it cannot run, the printout and the JSON say why.

``--scale`` runs the scale benchmark instead (:mod:`hicache.bench.scale`): the engine's per-request calls
with the device pool full, at several tree sizes (``--scale-sizes``, ``--requests``, ``--quick``).

Run ``python -m hicache.bench.tree [--json PATH]``; ``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import array
import gc
import hashlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hicache_kernels.benchutil import provenance, run_meta

from ..cache.radix_cache import HiRadixCache
from ..pools import DeviceKVPool, HostKVPool
from ..tree.core import TREE_CORES, choose_core
from . import scale as bench_scale
from . import sglang as bench_sglang

VOCAB = 32000


@dataclass
class Workload:
    seed: int = 0
    conversations: int = 96
    turns: int = 8
    system_prompts: int = 4
    system_len: int = 512
    question_len: int = 96
    answer_len: int = 160
    fresh_tokens: bool = True


def make_requests(w: Workload) -> list[list[int]]:
    """The prompts in issue order (lists of Python ints, as a scheduler holds them).

    ``fresh_tokens`` (default): each prompt's ints are new objects, as a tokenizer returns them for
    every request. Otherwise a turn reuses the previous turn's int objects, which flatters a tree that
    compares Python lists (identical objects compare equal without reading them)."""
    r = random.Random(w.seed)

    def tokens(n: int) -> list[int]:
        return [r.randrange(VOCAB) for _ in range(n)]

    systems = [tokens(w.system_len) for _ in range(w.system_prompts)]
    history = [list(systems[r.randrange(w.system_prompts)]) for _ in range(w.conversations)]
    # Every conversation's turns in order, the conversations interleaved at random.
    order = [c for c in range(w.conversations) for _ in range(w.turns)]
    r.shuffle(order)
    requests = []
    for c in order:
        # Lengths vary by up to +-25% so edges do not fall on page boundaries by construction.
        history[c] += tokens(r.randint(w.question_len * 3 // 4, w.question_len * 5 // 4))
        requests.append(_fresh(history[c]) if w.fresh_tokens else list(history[c]))
        history[c] += tokens(r.randint(w.answer_len * 3 // 4, w.answer_len * 5 // 4))
    return requests


def _fresh(tokens: list[int]) -> list[int]:
    """The same token ids as new int objects (ids below 257 are CPython's shared small ints anyway)."""
    return array.array("q", tokens).tolist()


def _hicache_runner(page_size: int, total_tokens: int, core: str = "auto") -> Callable[[Sequence[Any]], int]:
    def run(requests: Sequence[Any]) -> int:
        slots = (total_tokens // page_size + 1) * page_size
        dev = DeviceKVPool(num_slots=slots, num_layers=1, head_num=1, head_dim=1, dtype=torch.float16,
                           device="cpu", page_size=page_size)  # fmt: skip
        host = HostKVPool(dev, layout="page_first", ratio=2.0, safety_margin_gb=0.0)  # never used: nothing evicts
        cache = HiRadixCache(dev, host, io_backend="direct", write_policy="write_back", threaded=False, tree_core=core)
        run.core = cache.tree_core  # type: ignore[attr-defined]
        hits = 0
        t0 = time.perf_counter()
        for toks in requests:
            m = cache.match_prefix(toks)
            hit = len(m.device_indices)
            key_len = len(toks) - len(toks) % page_size
            new = dev.alloc(key_len - hit)
            full = torch.cat([m.device_indices, new])
            dup = cache.insert(toks[:key_len], full)
            if dup > hit:
                dev.free(full[hit:dup])
            hits += hit
        elapsed = time.perf_counter() - t0
        cache.close()
        run.elapsed = elapsed  # type: ignore[attr-defined]
        return hits

    return run


def _sglang_runner(page_size: int) -> Callable[[list[list[int]]], int] | None:
    try:
        from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None

    def run(requests: list[list[int]]) -> int:
        cache = RadixCache(None, None, page_size=page_size)
        next_slot = 0
        hits = 0
        t0 = time.perf_counter()
        for toks in requests:
            m = cache.match_prefix(toks)
            hit = len(m.device_indices)
            key_len = len(toks) - len(toks) % page_size
            new = torch.arange(next_slot, next_slot + key_len - hit, dtype=torch.int64)
            next_slot += key_len - hit
            cache.insert(toks[:key_len], torch.cat([m.device_indices, new]))
            hits += hit
        run.elapsed = time.perf_counter() - t0  # type: ignore[attr-defined]
        return hits

    return run


def _sglang_version() -> str | None:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("sglang")
    except Exception:  # noqa: BLE001
        try:
            import sglang  # noqa: PLC0415

            return getattr(sglang, "__version__", "unknown")
        except Exception:  # noqa: BLE001
            return None


def measure(run: Callable[[Any], int], requests: Sequence[Any], repeats: int) -> dict[str, Any]:
    times, hits = [], 0
    for _ in range(repeats):
        # The workload's 768 token lists are the bench's, not the cache's: frozen out of the garbage
        # collector's scans (as a server's would be spread over time), so it times the tree (whose own
        # objects stay collectable), the same for both sides.
        gc.collect()
        gc.freeze()
        try:
            hits = run(requests)
        finally:
            gc.unfreeze()
        times.append(run.elapsed)  # type: ignore[attr-defined]
    med = statistics.median(times)
    total = sum(len(t) for t in requests)
    return {
        "requests_per_s": len(requests) / med,
        "median_s": med,
        "times_s": times,
        "hit_rate": hits / total,
    }


def slot_cycle(sizes: list[int], page_size: int = 16, cycles: int = 100, repeats: int = 5) -> list[dict[str, Any]]:
    """Host time of the slot bookkeeping one request's copies cost: alloc, the backup's two state
    changes (WRITING, SYNCED), the load-back's two (LOADING, SYNCED) and free, of ``size`` host slots
    (whole pages, as the tree passes them); best of ``repeats`` runs of ``cycles`` cycles, per cycle."""
    rows = []
    for size in sizes:
        dev = DeviceKVPool(num_slots=-(-2 * size // page_size) * page_size, num_layers=1, head_num=1, head_dim=1,
                           dtype=torch.float16, device="cpu", page_size=page_size)  # fmt: skip
        host = HostKVPool(dev, layout="page_first", ratio=2.0)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(cycles):
                h = host.alloc(size)
                host.mark_writing(h)
                host.mark_synced(h)
                host.mark_loading(h)
                host.mark_synced(h)
                host.free(h)
            best = min(best, (time.perf_counter() - t0) / cycles)
        rows.append({"slots": size, "page_size": page_size, "us_per_cycle": best * 1e6})
    return rows


def cores_to_run(tree_core: str) -> list[str]:
    """The tree cores ``--tree-core`` asks for, the default one (what ``auto`` picks) first: ``both``
    adds the Python reference after the compiled core when that is available."""
    default, _ = choose_core("auto" if tree_core == "both" else tree_core)
    if tree_core == "both" and default == "compiled":
        return ["compiled", "python"]
    return [default]


def run_bench(
    w: Workload, page_sizes: list[int], repeats: int, compare: bool = True, tree_core: str = "both"
) -> dict[str, Any]:
    """Rows per page size: ``hicache`` is the first core of :func:`cores_to_run` (named by ``tree_core``),
    ``hicache_python`` the Python core beside it when both run; ``sglang`` and the speed-ups when
    SGLang's tree imports."""
    requests = make_requests(w)
    arrays = [array.array("q", t) for t in requests]
    total = sum(len(t) for t in requests)
    cores = cores_to_run(tree_core)
    rows = []
    for ps in page_sizes:
        row: dict[str, Any] = {"page_size": ps, "tree_core": cores[0]}
        for core in cores:
            name = "hicache" if core == cores[0] else f"hicache_{core}"
            row[name] = measure(_hicache_runner(ps, total, core), requests, repeats)
        # The same prompts as array('q') (what SGLang's Req holds, and what the SGLang 0.5.23 side of
        # --compare gets): read in place instead of int object by int object.
        row["hicache_array"] = measure(_hicache_runner(ps, total, cores[0]), arrays, repeats)
        sgl = _sglang_runner(ps) if compare else None
        if sgl is not None:
            row["sglang"] = measure(sgl, requests, repeats)
            row["speedup_vs_sglang"] = row["hicache"]["requests_per_s"] / row["sglang"]["requests_per_s"]
            if "hicache_python" in row:
                row["python_core_speedup_vs_sglang"] = (
                    row["hicache_python"]["requests_per_s"] / row["sglang"]["requests_per_s"]
                )
        rows.append(row)
    return {
        "bench": "hicache.bench.tree",
        "tree_cores": cores,
        "workload": {**asdict(w), "requests": len(requests), "tokens": total},
        "repeats": repeats,
        "sglang_version": _sglang_version() if compare else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": rows,
    }


def requests_digest(requests: list[list[int]]) -> str:
    """A digest of the requests' token ids, so two processes can tell they ran the same workload."""
    h = hashlib.sha256()
    for toks in requests:
        h.update(array.array("q", toks).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def sglang_latest_child(w: Workload, page_sizes: list[int], repeats: int) -> dict[str, Any]:
    """The child process's side of ``--compare sglang-latest``: SGLang's UnifiedRadixCache on its Rust core
    over the same requests, or why it cannot run."""
    try:
        sgl = bench_sglang.load_unified()
    except bench_sglang.Unavailable as exc:
        return {"available": False, "reason": str(exc)}
    requests = make_requests(w)
    total = sum(len(t) for t in requests)
    rows = {str(ps): measure(bench_sglang.unified_runner(sgl, ps, total), requests, repeats) for ps in page_sizes}
    return {
        "available": True,
        "version": sgl.version,
        "expected_version": bench_sglang.LATEST_VERSION,
        "path": sgl.path,
        "tree_core_backend": "rust",
        "tree_core_class": sgl.tree_core_class,
        "components": ["FULL"],
        "notes": sgl.notes,
        "requests_digest": requests_digest(requests),
        "results": rows,
    }


def add_sglang_latest(out: dict[str, Any], child: dict[str, Any], requests: list[list[int]]) -> None:
    """Merge the child's rows into ``out`` (``sglang_latest`` and the speed-up per page size); a child that
    ran other requests than ours is reported as unavailable."""
    if child.get("available") and child.get("requests_digest") != requests_digest(requests):
        child = {"available": False, "reason": "the SGLang child process ran different requests (digest mismatch)"}
    out["sglang_latest"] = {k: v for k, v in child.items() if k != "results"}
    if not child.get("available"):
        return
    for row in out["results"]:
        s = child["results"][str(row["page_size"])]
        row["sglang_latest"] = s
        row["speedup_vs_sglang_latest"] = row["hicache"]["requests_per_s"] / s["requests_per_s"]
        # Side by side on the same input: both trees given the prompts as array('q').
        row["speedup_vs_sglang_latest_same_input"] = row["hicache_array"]["requests_per_s"] / s["requests_per_s"]
        row["hit_rates_equal_latest"] = s["hit_rate"] == row["hicache"]["hit_rate"]


def _child_argv(a: argparse.Namespace) -> list[str]:
    argv = ["--sglang-latest-child", "--seed", str(a.seed), "--conversations", str(a.conversations),
            "--turns", str(a.turns), "--system-prompts", str(a.system_prompts), "--system-len", str(a.system_len),
            "--question-len", str(a.question_len), "--answer-len", str(a.answer_len), "--repeats", str(a.repeats),
            "--page-sizes", *map(str, a.page_sizes)]  # fmt: skip
    return argv + (["--shared-token-objects"] if a.shared_token_objects else [])


def _main_scale(p: argparse.ArgumentParser, a: argparse.Namespace, prov: dict[str, Any]) -> int:
    quick = a.quick
    sizes = a.scale_sizes or list(bench_scale.QUICK_SIZES if quick else bench_scale.DEFAULT_SIZES)
    try:
        sizes = bench_scale.check_sizes(sizes)
    except ValueError as exc:
        p.error(str(exc))
    requests = a.requests if a.requests is not None else (30 if quick else bench_scale.ScaleConfig.requests)
    core = "auto" if a.tree_core == "both" else a.tree_core  # one core per run here
    cfg = bench_scale.ScaleConfig(requests=requests, warmup=5 if quick else bench_scale.ScaleConfig.warmup,
                                  seed=a.seed, tree_core=core, verify=quick)  # fmt: skip
    args = {"scale_sizes": sizes, "requests": requests, "quick": quick, "seed": a.seed, "tree_core": core}
    out = {**prov, **bench_scale.run_scale(sizes, cfg, args)}
    print(bench_scale.format_scale(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache.bench.tree", description=__doc__.split("\n\n")[0])
    d = Workload()
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--system-prompts", type=int, default=d.system_prompts)
    p.add_argument("--system-len", type=int, default=d.system_len)
    p.add_argument("--question-len", type=int, default=d.question_len)
    p.add_argument("--answer-len", type=int, default=d.answer_len)
    p.add_argument(
        "--shared-token-objects", action="store_true",
        help="let each turn reuse the previous turn's int objects instead of fresh ones (a tokenizer's)",
    )  # fmt: skip
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-sglang", action="store_true", help="skip the side-by-side SGLang RadixCache run")
    p.add_argument(
        "--tree-core", choices=["both", *TREE_CORES], default="both",
        help="which radix-tree core to time (both: the compiled one and the Python reference, when compiled)",
    )  # fmt: skip
    p.add_argument("--slot-sizes", type=int, nargs="*", default=[256, 4096],
                   help="also time one request's slot bookkeeping for these many host slots (page 16)")  # fmt: skip
    p.add_argument(
        "--compare", choices=["sglang-latest"],
        help="also run SGLang 0.5.23's UnifiedRadixCache on its Rust core (in a child process; hicache.bench.sglang)",
    )  # fmt: skip
    p.add_argument(
        "--sglang-path", metavar="DIRS",
        help=f"where --compare imports SGLang from ({os.pathsep}-separated; default ${bench_sglang.PATH_ENV})",
    )  # fmt: skip
    p.add_argument("--sglang-latest-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--scale", action="store_true",
        help="run the scale benchmark instead: the engine's calls per request, device pool full (hicache.bench.scale)",
    )  # fmt: skip
    sizes, quick = " ".join(map(str, bench_scale.DEFAULT_SIZES)), " ".join(map(str, bench_scale.QUICK_SIZES))
    p.add_argument("--scale-sizes", type=int, nargs="+", metavar="SLOTS",
                   help=f"--scale: device pool sizes in slots (default {sizes})")  # fmt: skip
    p.add_argument("--requests", type=int, metavar="N",
                   help=f"--scale: timed requests per size (default {bench_scale.ScaleConfig.requests})")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help=f"--scale: sizes {quick}, 30 requests, verify() after fill and requests")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = p.parse_args(argv)
    prov = provenance("hicache.bench.tree", argv) if a.json else {}  # the code and machine as the run starts
    if a.scale:
        if a.compare:
            p.error("--compare: applies to the match + insert comparison, not to --scale")
        if a.requests is not None and a.requests < 1:
            p.error(f"--requests: expected >= 1, got {a.requests}")
        return _main_scale(p, a, prov)
    for flag, given in (("--scale-sizes", a.scale_sizes), ("--requests", a.requests), ("--quick", a.quick)):
        if given:
            p.error(f"{flag}: only with --scale")
    if any(n < 16 or n % 16 for n in a.slot_sizes):
        p.error("--slot-sizes: expected multiples of 16 (whole pages of 16 slots)")
    w = Workload(
        a.seed, a.conversations, a.turns, a.system_prompts, a.system_len, a.question_len, a.answer_len,
        fresh_tokens=not a.shared_token_objects,
    )  # fmt: skip
    if a.sglang_latest_child:
        print(json.dumps(sglang_latest_child(w, a.page_sizes, a.repeats)))
        return 0
    out = {**prov, **run_bench(w, a.page_sizes, a.repeats, compare=not a.no_sglang, tree_core=a.tree_core)}
    if a.compare == "sglang-latest":
        child = bench_sglang.run_child(_child_argv(a), bench_sglang.search_path(a.sglang_path))
        add_sglang_latest(out, child, make_requests(w))
    wl = out["workload"]
    print(f"workload: {wl['requests']} requests, {wl['tokens']} tokens, seed {w.seed}; median of {a.repeats}")
    if out["sglang_version"] is None and not a.no_sglang:
        print("sglang: not importable (no side-by-side run)")
    latest = out.get("sglang_latest")
    if latest is not None and not latest["available"]:
        print(f"sglang-latest ({bench_sglang.LATEST_VERSION}, rust core): unavailable: {latest['reason']}")
    elif latest is not None:
        expected = "" if latest["version"] == latest["expected_version"] else f" (not {latest['expected_version']}!)"
        print(f"sglang-latest: {latest['version']}{expected} from {latest['path']}, {latest['tree_core_class']}"
              + "".join(f"; {n}" for n in latest["notes"]))  # fmt: skip
    for row in out["results"]:
        h = row["hicache"]
        line = (
            f"page {row['page_size']:>3}: hicache ({row['tree_core']} core) {h['requests_per_s']:9.0f} req/s"
            f"  hit rate {h['hit_rate']:.3f}"
        )
        if "sglang" in row:
            s = row["sglang"]
            line += (
                f"  | sglang {out['sglang_version']} RadixCache {s['requests_per_s']:9.0f} req/s"
                f"  hit rate {s['hit_rate']:.3f}  -> {row['speedup_vs_sglang']:.2f}x"
            )
        print(line)
        ha = row["hicache_array"]
        print(f"          hicache, array('q') prompts {ha['requests_per_s']:9.0f} req/s  hit rate {ha['hit_rate']:.3f}")
        if "sglang_latest" in row:
            s, v = row["sglang_latest"], out["sglang_latest"]["version"]
            print(f"          sglang {v} UnifiedRadixCache (rust core, array('q')) {s['requests_per_s']:9.0f} req/s"
                  f"  hit rate {s['hit_rate']:.3f}  -> {row['speedup_vs_sglang_latest_same_input']:.2f}x on the same"
                  f" input ({row['speedup_vs_sglang_latest']:.2f}x with ours on lists)"
                  + ("" if row["hit_rates_equal_latest"] else "  (hit rates differ!)"))  # fmt: skip
        if "hicache_python" in row:
            line = f"          hicache (python core)   {row['hicache_python']['requests_per_s']:9.0f} req/s"
            if "python_core_speedup_vs_sglang" in row:
                line += f"  -> {row['python_core_speedup_vs_sglang']:.2f}x SGLang"
            print(line)
    out["slot_cycle"] = slot_cycle(a.slot_sizes, repeats=a.repeats)
    for row in out["slot_cycle"]:
        print(f"slots {row['slots']:>5} (page {row['page_size']}): alloc + 4 state changes + free "
              f"{row['us_per_cycle']:7.1f} us per request")  # fmt: skip
    if a.json:
        out["meta"] = run_meta("hicache.bench.tree", {k: v for k, v in vars(a).items() if k != "json"})
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
