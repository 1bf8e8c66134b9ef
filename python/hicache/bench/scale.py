"""The cache at serving scale: host time per request of the engine's call sequence, device pool full.

What :class:`~hicache.serving.engine.Engine` does per request on the scheduler's thread is timed, one request
per step: the step's acks (``check_acks``: backups and load-backs in one agreement), ``match_prefix``
and ``inc_lock_ref``; room for the request past its device hit (``evict``); the host hit locked,
``load_back`` and ``start_loading``; then ``alloc``, ``insert``, the frees and ``dec_lock_ref``. These
four phases are the split reported (``acks_match``, ``room``, ``load_back``, ``insert``).

Copies cost nothing: CPU pools of one layer, one head and ``head_dim`` elements, the controller inline
(``threaded=False``: a copy is issued on the calling thread, where issue 21 puts it) on the io-backend
:class:`~hicache_kernels.bench.NoopBackend` (each copy still builds its plan and checks its indices, the
no-op issues nothing). Every run checks that copies reached the no-op.

Workload: page 16; each prompt is 2 pages plus one token and generates one token, so a request holds 3
pages while it runs and caches its 2 full pages. The first page is one of a set of shared pages (about
``fanout`` sequences under each), the second is the sequence's own. Before timing, the tree is filled
(untimed) with such sequences until the host pool (``host_ratio`` x the device pool) is full, evicting in
large batches, so the device pool is full when timing starts: every request that misses on the device
evicts. Timed requests re-send an earlier sequence with probability ``revisit`` (a device hit, a host
hit that is loaded back, or a miss when the host evicted it) and otherwise send a new one (under a shared
page, a new shared page with probability ``1/fanout``). The write policy is the cache's default,
``write_through``, so in steady state a new node's backup also evicts from the host.

Every size is filled first; then their timed requests run in interleaved rounds (5: a fifth of each
size's requests in turn, five times), so that a slow phase of a shared machine falls on every size
alike rather than on whichever size was running then.

Run ``python -m hicache.bench.tree --scale [--scale-sizes N ...] [--requests N] [--json PATH]``.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from hicache_kernels.bench import NoopBackend
from hicache_kernels.benchutil import run_meta

from ..cache.radix_cache import HiRadixCache
from ..pools import DeviceKVPool, HostKVPool

PAGE_SIZE = 16
PROMPT_PAGES = 2  # full pages a request caches; its prompt has one token more
VOCAB = 32000
DEFAULT_SIZES = (2048, 131072, 1048576)
QUICK_SIZES = (512, 1024, 2048)
MIN_SLOTS = 256  # below this a handful of requests fill the pool and there is no tree to speak of
PHASES = ("acks_match", "room", "load_back", "insert")
# Issue 21's targets, per size and from the smallest to the largest size.
TARGET_MEDIAN_US, TARGET_P99_US, TARGET_GROWTH = 100.0, 400.0, 1.3


@dataclass(frozen=True)
class ScaleConfig:
    """Knobs of one scale run (the same for every size)."""

    requests: int = 200  # timed requests per size
    warmup: int = 20  # untimed requests per size after the fill
    host_ratio: float = 4.0
    revisit: float = 0.5
    fanout: int = 16
    head_dim: int = 8
    seed: int = 0
    tree_core: str = "auto"
    verify: bool = False  # cache.verify() after the fill and after the timed requests (walks the tree)
    rounds: int = 5  # the sizes' timed requests interleave in this many rounds


def check_sizes(sizes: list[int]) -> list[int]:
    """The device-pool sizes in slots, ascending; ``ValueError`` naming the bad one."""
    if not sizes:
        raise ValueError("--scale-sizes: expected at least one size")
    for n in sizes:
        if isinstance(n, bool) or not isinstance(n, int) or n < MIN_SLOTS or n % PAGE_SIZE:
            raise ValueError(
                f"--scale-sizes: expected device slots >= {MIN_SLOTS} and a multiple of the page size {PAGE_SIZE}, "
                f"got {n!r}"
            )
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"--scale-sizes: a size given twice in {sizes}")
    return sorted(sizes)


class _Sequences:
    """The workload's 2-page sequences: sequence ``i`` is shared page ``group[i]`` then its own page.
    Token lists are built fresh on each use (new int objects, as a tokenizer returns them)."""

    def __init__(self, rng: np.random.Generator, capacity: int, groups: int) -> None:
        self.rng = rng
        self.firsts = rng.integers(0, VOCAB, size=(groups, PAGE_SIZE), dtype=np.int64)
        self.groups = 0  # shared pages in use
        self.tails = rng.integers(0, VOCAB, size=(capacity, PAGE_SIZE), dtype=np.int64)
        self.group_of = np.zeros(capacity, dtype=np.int64)
        self.count = 0

    def new(self, new_group: bool) -> int:
        if new_group or self.groups == 0:
            if self.groups == len(self.firsts):
                raise RuntimeError("workload: out of shared pages (capacity too small)")
            group = self.groups
            self.groups += 1
        else:
            group = int(self.rng.integers(self.groups))
        i = self.count
        self.group_of[i] = group
        self.count += 1
        return i

    def prompt(self, i: int) -> list[int]:
        """The sequence's 2 pages and one more token (the prompt's last, always computed)."""
        return [*self.firsts[self.group_of[i]].tolist(), *self.tails[i].tolist(), int(self.tails[i, 0])]


def _build(device_slots: int, cfg: ScaleConfig) -> tuple[HiRadixCache, DeviceKVPool, HostKVPool, NoopBackend]:
    dev = DeviceKVPool(num_slots=device_slots, num_layers=1, head_num=1, head_dim=cfg.head_dim,
                       dtype=torch.float16, device="cpu", page_size=PAGE_SIZE)  # fmt: skip
    host = HostKVPool(dev, layout="page_first", ratio=cfg.host_ratio, safety_margin_gb=0.0)
    noop = NoopBackend()
    cache = HiRadixCache(dev, host, io_backend=noop, threaded=False, tree_core=cfg.tree_core)
    device = type(cache.controller.device).__name__
    if device != "EagerDevice":
        cache.close()
        raise RuntimeError(
            f"scale bench: the controller runs a {device} (HICACHE_DEFERRED_SEED set?); it measures eager CPU copies"
        )
    return cache, dev, host, noop


def _fill(cache: HiRadixCache, dev: DeviceKVPool, host: HostKVPool, seqs: _Sequences, cfg: ScaleConfig) -> None:
    """Insert sequences until the host pool is full, leaving the device pool full; evicts in batches of up
    to a quarter of the device pool (one walk each) instead of per request."""
    reserve = 4 * PAGE_SIZE
    key_len = PROMPT_PAGES * PAGE_SIZE
    while host.available_size() >= reserve and seqs.count < len(seqs.tails):
        prompt = seqs.prompt(seqs.new(new_group=seqs.rng.random() < 1 / cfg.fanout))
        m = cache.match_prefix(prompt[:key_len])
        hit = len(m.device_indices)
        free = dev.available_size()
        if free < key_len - hit:
            cache.check_writes()  # landed backups unlock their nodes, which may then be evicted
            batch = min(dev.size // 4, host.available_size() - reserve)
            cache.evict(max(key_len - hit - free, batch))
        new = dev.alloc(key_len - hit)
        if new is None:
            raise RuntimeError(f"fill: {key_len - hit} device slots not free after evicting")
        slots = torch.cat([m.device_indices, new])
        dup = cache.insert(prompt[:key_len], slots)
        if dup > hit:
            dev.free(slots[hit:dup])
        if seqs.count % 1024 == 0:
            cache.check_writes()
    cache.check_writes()


def _serve(cache: HiRadixCache, dev: DeviceKVPool, prompt: list[int]) -> tuple[int, int, int, int, bool, int, int]:
    """One request through the engine's calls (``Engine._admit``, ``_step``'s ``start_loading``,
    ``_release``, the step's acks first): the four phases in ns, whether it evicted, its device and host hit."""
    ps = PAGE_SIZE
    fed = len(prompt)  # the prompt and one new token, the last never fed back
    need = -(-fed // ps) * ps
    key_len = fed - fed % ps
    t0 = time.perf_counter_ns()
    cache.check_acks()
    m = cache.match_prefix(prompt[:-1])
    cache.inc_lock_ref(m.last_device_node)
    locked = [m.last_device_node]
    prefix = m.device_indices
    device_hit = len(prefix)
    t1 = time.perf_counter_ns()
    free = dev.available_size()
    evicted = free < need - device_hit
    if evicted:
        cache.evict(need - device_hit - free)
        if dev.available_size() < need - device_hit:
            raise RuntimeError(f"room: {need - device_hit} device slots not free after evicting")
    t2 = time.perf_counter_ns()
    host_hit = 0
    if m.host_hit_length:
        cache.inc_lock_ref(m.last_host_node)
        locked.append(m.last_host_node)
        loaded = cache.load_back(m.last_host_node)
        if loaded is not None:
            prefix = torch.cat([prefix, loaded])
            host_hit = len(loaded)
            cache.start_loading()
    t3 = time.perf_counter_ns()
    rest = dev.alloc(need - len(prefix))
    if rest is None:
        raise RuntimeError(f"alloc: {need - len(prefix)} device slots made free, then not allocatable")
    slots = torch.cat([prefix, rest])
    dup = cache.insert(prompt[:key_len], slots[:key_len])  # the new token is past the last full page
    if dup > len(prefix):
        dev.free(slots[len(prefix) : dup])
    dev.free(slots[key_len:])
    for node in locked:
        cache.dec_lock_ref(node)
    t4 = time.perf_counter_ns()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3, evicted, device_hit, host_hit


def census(cache: HiRadixCache) -> dict[str, int]:
    """Nodes and tokens in the tree by tier (a walk over the public node API; never timed)."""
    nodes = device_nodes = host_only = device_tokens = host_tokens = 0
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        nodes += 1
        n = node.num_tokens
        if node.evicted:
            host_only += 1
        else:
            device_nodes += 1
            device_tokens += n
        if node.backuped:
            host_tokens += n
        stack.extend(node.children.values())
    return {"nodes": nodes, "device_nodes": device_nodes, "host_only_nodes": host_only,
            "device_tokens": device_tokens, "host_tokens": host_tokens}  # fmt: skip


def p99(values: list[float]) -> float:
    """The nearest-rank 99th percentile."""
    s = sorted(values)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


class _SizeRun:
    """One size's cache, filled, and what its timed requests measured so far."""

    def __init__(self, device_slots: int, cfg: ScaleConfig) -> None:
        self.device_slots, self.cfg = device_slots, cfg
        rng = np.random.default_rng([cfg.seed, device_slots])
        self.cache, self.dev, self.host, self.noop = _build(device_slots, cfg)
        try:
            capacity = self.host.size // PAGE_SIZE + cfg.warmup + cfg.requests + 1
            self.seqs = _Sequences(rng, capacity, groups=capacity)
            t = time.perf_counter()
            _fill(self.cache, self.dev, self.host, self.seqs, cfg)
            self.fill_s = time.perf_counter() - t
            self.filled = self.seqs.count
            if cfg.verify:
                self.cache.verify()
            self.before = census(self.cache)
        except BaseException:
            self.cache.close()
            raise
        self.phases: list[tuple[int, int, int, int]] = []
        self.served = self.evicting = self.device_hits = self.host_hits = 0

    def serve(self, n: int) -> None:
        """The next ``n`` requests (the first ``cfg.warmup`` of the run untimed)."""
        cfg, seqs = self.cfg, self.seqs
        for _ in range(n):
            if seqs.rng.random() < cfg.revisit:
                i = int(seqs.rng.integers(seqs.count))
            else:
                i = seqs.new(new_group=seqs.rng.random() < 1 / cfg.fanout)
            *times, evicted, dh, hh = _serve(self.cache, self.dev, seqs.prompt(i))
            if self.served >= cfg.warmup:
                self.phases.append(tuple(times))  # type: ignore[arg-type]
                self.evicting += evicted
                self.device_hits += dh > 0
                self.host_hits += hh > 0
            self.served += 1

    def finish(self) -> dict[str, Any]:
        """Close the cache; the size's result row."""
        cache = self.cache
        try:
            cache.check_acks()
            if self.cfg.verify:
                cache.verify()
            after = census(cache)
            if self.noop.issued == 0:
                raise RuntimeError("scale bench: no copy reached the no-op backend (the controller did not use it)")
            m = cache.metrics
            metrics = {"load_backs": m.load_backs, "load_backs_skipped": m.load_backs_skipped,
                       "device_evicted_tokens": m.device_evicted_tokens, "host_evicted_tokens": m.host_evicted_tokens,
                       "writes_refused_host_full": m.writes_refused_host_full}  # fmt: skip
            tree_core = cache.tree_core
        finally:
            cache.close()
        phases = self.phases
        totals = [sum(p) / 1e3 for p in phases]
        split = {
            name: {
                "mean_us": statistics.fmean(p[j] for p in phases) / 1e3,
                "median_us": statistics.median(p[j] for p in phases) / 1e3,
            }  # fmt: skip
            for j, name in enumerate(PHASES)
        }
        n = len(phases)
        return {
            "device_slots": self.device_slots,
            "host_slots": self.host.size,
            "tree_core": tree_core,
            **after,
            "nodes_after_fill": self.before["nodes"],
            "fill_sequences": self.filled,
            "fill_s": self.fill_s,
            "requests": n,
            "median_us": statistics.median(totals),
            "p99_us": p99(totals),
            "mean_us": statistics.fmean(totals),
            "max_us": max(totals),
            "split": split,
            "evicting_fraction": self.evicting / n,
            "device_hit_fraction": self.device_hits / n,
            "host_hit_fraction": self.host_hits / n,
            "copies_issued": self.noop.issued,
            "metrics": metrics,
        }


def run_size(device_slots: int, cfg: ScaleConfig) -> dict[str, Any]:
    """Fill a cache of ``device_slots`` device slots, then time ``cfg.requests`` requests; one result row."""
    return run_sizes([device_slots], cfg)[0]


def run_sizes(sizes: list[int], cfg: ScaleConfig) -> list[dict[str, Any]]:
    """Every size filled first, then their timed requests in ``cfg.rounds`` interleaved rounds (each
    round serves a share of every size's requests in turn): a slow phase of a shared machine lands on
    every size alike instead of on the one that happened to run then. One result row per size."""
    runs: list[_SizeRun] = []
    try:
        for n in sizes:
            runs.append(_SizeRun(n, cfg))
        total = cfg.warmup + cfg.requests
        rounds = max(1, min(cfg.rounds, cfg.requests))
        done = 0
        for r in range(rounds):
            share = total * (r + 1) // rounds - done
            for run in runs:
                run.serve(share)
            done += share
        return [run.finish() for run in runs]
    finally:
        for run in runs:
            if not run.cache.closed:
                run.cache.close()


def growth_ratio(rows: list[dict[str, Any]]) -> float | None:
    """median per request at the largest size / at the smallest (None with one size)."""
    if len(rows) < 2:
        return None
    by_size = sorted(rows, key=lambda r: r["device_slots"])
    return by_size[-1]["median_us"] / by_size[0]["median_us"]


def run_scale(sizes: list[int], cfg: ScaleConfig, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every size of ``sizes`` (checked by :func:`check_sizes`), the growth ratio and the targets."""
    rows = run_sizes(check_sizes(list(sizes)), cfg)
    growth = growth_ratio(rows)
    meta = run_meta("hicache.bench.tree --scale", args or {})
    meta.update(machine=platform.machine(), processor=platform.processor(), cpus=_cpus())
    return {
        "bench": "hicache.bench.tree --scale",
        "meta": meta,
        "config": {
            **asdict(cfg),
            "page_size": PAGE_SIZE,
            "prompt_tokens": PROMPT_PAGES * PAGE_SIZE + 1,
            "max_new_tokens": 1,
            "layers": 1,
            "heads": 1,
            "dtype": "float16",
            "write_policy": "write_through",
            "eviction_policy": "lru",
            "io_backend": "noop (hicache_kernels.bench.NoopBackend)",
            "threaded": False,
            "percentile": "nearest rank",
        },
        "results": rows,
        "growth_ratio": growth,
        "targets": {
            "median_us_max": TARGET_MEDIAN_US,
            "p99_us_max": TARGET_P99_US,
            "growth_max": TARGET_GROWTH,
            "median_met": all(r["median_us"] <= TARGET_MEDIAN_US for r in rows),
            "p99_met": all(r["p99_us"] <= TARGET_P99_US for r in rows),
            "growth_met": None if growth is None else growth <= TARGET_GROWTH,
        },
    }


def _cpus() -> int | None:
    import os  # noqa: PLC0415

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def format_scale(out: dict[str, Any]) -> str:
    """The printed table: one line per size, then the growth ratio."""
    c = out["config"]
    lines = [
        f"scale: page {c['page_size']}, {c['prompt_tokens']}-token prompts, device pool full, host {c['host_ratio']}x, "
        f"{c['requests']} timed requests per size after {c['warmup']}; copies: {c['io_backend']}",
        f"{'device slots':>12} {'nodes':>8} {'median us':>10} {'p99 us':>9} | mean us: "
        + " ".join(f"{p:>10}" for p in PHASES)
        + f" | {'evict':>5} {'dev hit':>7} {'host hit':>8}",
    ]
    for r in out["results"]:
        parts = " ".join(f"{r['split'][p]['mean_us']:10.1f}" for p in PHASES)
        lines.append(
            f"{r['device_slots']:>12} {r['nodes']:>8} {r['median_us']:10.1f} {r['p99_us']:9.1f} | {'':9}{parts}"
            f" | {r['evicting_fraction']:5.2f} {r['device_hit_fraction']:7.2f} {r['host_hit_fraction']:8.2f}"
        )
    g = out["growth_ratio"]
    lines.append("growth (median, largest / smallest): " + ("n/a (one size)" if g is None else f"{g:.2f}x"))
    return "\n".join(lines)
