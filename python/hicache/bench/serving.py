"""Serving benchmark: the same request stream through recompute, a device-only radix cache, the
hierarchical cache (device + host) and the hierarchical cache with a storage tier, on :mod:`hicache.serving.engine`.

Workloads (:mod:`hicache.serving.workloads`): ``multiturn`` (clients with a shared system prompt, several
rounds each; a round's prompt is the whole history plus a new question), ``multitenant`` (the same, the
clients spread over ``--tenants`` tenants whose requests each carry the tenant's cache salt: a tenant
hits only its own pages; hit rates are reported per tenant) and ``longqa`` (several long documents,
questions interleaved across them; a question's prompt is its document plus the question).
Turns are scheduled as a Poisson process at ``--rate`` per second (0: all at once); a client sends its
next turn at its scheduled time or, if later, as soon as it has the answer to the previous one (closed
loop). The clients keep at most ``--max-parallel`` requests in flight. The engine serves them with
continuous batching (:meth:`hicache.serving.engine.Engine.serve`: up to ``--max-running`` requests in the running
batch, each step one forward over the new prefills and a decode token of every running request), in real
time: a request's time to first token (TTFT) counts from when it was sent, so waiting for admission on
the server (a full device pool, a full batch) counts too.

Modes: ``recompute`` (no cache), ``device`` (radix cache on the device pool only: nothing is ever
backed up, eviction deletes), ``hierarchical`` (write-through to the host pool, host hits loaded back
layer by layer), ``storage`` (hierarchical, plus a file-backed storage tier below a host pool of
``--storage-host-ratio`` device pools, smaller than the working set: host evictions stay in the store
and come back by prefetch). The device pool holds ``--device-fraction`` (default a quarter) of the
working set, for ``longqa`` of the documents' KV (so they are 4x the pool: a document is evicted before
its next question comes); the host pool holds the whole working set.

Reports per mode: TTFT p50/p90/p99 (and p50 per round; ``longqa``: per question on its document), the
time waited for admission (p50), throughput (generated tokens per second from the first arrival to the
last answer), prompt tokens per tier (device hit, host hit, from storage, computed), tokens loaded back
and their GB/s, time the forward waited for layer loads. ``--json``, ``--plot PATH.png``.

Run ``python -m hicache.bench.serving --quick`` (under two minutes on 2 CPU cores); ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hicache_kernels.benchutil import provenance

from ..cache.radix_cache import HiRadixCache
from ..pools import HostKVPool
from ..serving.engine import Engine, GenerationResult, ModelConfig, Request, TinyLM
from ..serving.model import index_pool, state_pool
from ..serving.workloads import Clients, Turn, longest_per_client, longqa, multitenant, multiturn
from ..storage import FileBackend
from ..storage.tier import PrefetchPolicy

MODES = ("recompute", "device", "hierarchical", "storage")


def pctl(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


class _Progress(Clients):
    """:class:`Clients` that draws a progress bar per mode on stderr as requests finish."""

    WIDTH = 30

    def __init__(self, turns: list[Turn], prompt_of, max_parallel: int, mode: str) -> None:
        super().__init__(turns, prompt_of, max_parallel)
        self.mode, self.total, self.done = mode, len(turns), 0
        self.t0 = time.perf_counter()

    def finished(self, result: GenerationResult) -> None:
        super().finished(result)
        self.done += 1
        fill = self.WIDTH * self.done // self.total
        bar = "#" * fill + "." * (self.WIDTH - fill)
        print(f"\r{self.mode:>12} [{bar}] {self.done}/{self.total} requests, {time.perf_counter() - self.t0:.1f} s",
              end="", file=sys.stderr, flush=True)  # fmt: skip


def run_mode(mode: str, args: argparse.Namespace, model: TinyLM, turns: list[Turn], prompt_of, slots: int,
             store: Path) -> dict[str, Any]:  # fmt: skip
    cfg = model.cfg
    # --window-pool: the cache modes keep the windowed layers in a window pool of that fraction of the
    # KV pool's slots (rows only where a window needs them); recompute keeps every layer in its pool.
    windowed = bool(args.window_pool) and mode != "recompute"
    pool = model.pool(slots, args.page_size, args.device, windowed=windowed)
    device_bytes = pool.total_bytes
    cache = None
    if mode != "recompute":
        # The storage mode's host pool is smaller than the working set: host evictions happen, and what
        # they drop comes back from the store.
        host_ratio = args.storage_host_ratio if mode == "storage" else args.host_ratio
        host = HostKVPool(pool, layout=args.layout, ratio=host_ratio, safety_margin_gb=0.5)
        kw: dict[str, Any] = dict(io_backend=args.io_backend, load_back_threshold=args.page_size)
        # The indexer's keys and the recurrent checkpoints: sidecar pools moved with the KV on every tier.
        kinds = ((index_pool, cfg.indexer_dim), (state_pool, cfg.recurrent_dim))
        sides = [make(cfg, pool.size, args.page_size, args.device) for make, used in kinds if used]
        side_layout = "page_first" if args.layout == "page_head" else args.layout  # one row a token: no heads
        kw["sidecars"] = [(s, HostKVPool(s, layout=side_layout, ratio=host_ratio, safety_margin_gb=0.5)) for s in sides]
        if windowed:
            ps = args.page_size
            kw["window"] = cfg.window_pool(pool, max(ps, int(slots * args.window_pool) // ps * ps))
            device_bytes += kw["window"].pool.total_bytes
        if mode == "device":  # never backed up: eviction deletes (selective backup that never triggers)
            kw.update(write_policy="write_through_selective", write_through_threshold=2**62)
        else:
            kw.update(write_policy="write_through")
        if mode == "storage":
            kw.update(storage=FileBackend(store), model_id="bench-serving",
                      prefetch_policy=PrefetchPolicy("wait_complete", threshold_tokens=args.page_size))  # fmt: skip
        cache = HiRadixCache(pool, host, **kw)
    engine = Engine(model, pool, cache)
    if args.progress:
        source = _Progress(turns, prompt_of, args.max_parallel, mode)
    else:
        source = Clients(turns, prompt_of, args.max_parallel)
    t_start = time.perf_counter()
    try:
        results = engine.serve(source, max_running=args.max_running or args.max_parallel,
                               max_prefill_tokens=args.max_prefill_tokens)  # fmt: skip
        if cache is not None:
            cache.flush()
            cache.verify()
    finally:
        if cache is not None:
            cache.close()
    if args.progress:
        print(file=sys.stderr)
    wall = time.perf_counter() - t_start
    tenant_of = {(t.client, t.round): t.tenant for t in turns}
    rows = [{"client": r.rid[0], "round": r.rid[1], "tenant": tenant_of[r.rid], "arrival_s": r.arrival_s,
             "prompt": r.device_hit + r.host_hit
             + r.computed, "ttft_s": r.ttft_s, "queued_s": r.queued_s, "total_s": r.total_s,
             "device_hit": r.device_hit, "host_hit": r.host_hit, "computed": r.computed,
             "load_wait_s": r.load_wait_s, "batch": r.extra["batch"], "answer": r.tokens} for r in results]  # fmt: skip
    ttft = [r["ttft_s"] for r in rows]
    prompt_tokens = sum(r["prompt"] for r in rows)
    span = max(r.arrival_s + r.total_s for r in results)
    m = cache.metrics if cache is not None else None
    storage_tokens = m.storage_hit_tokens if m is not None else 0
    by_round = {}
    for k in sorted({r["round"] for r in rows}):
        by_round[k] = statistics.median(r["ttft_s"] for r in rows if r["round"] == k)
    by_tenant = {}
    for t in sorted({r["tenant"] for r in rows if r["tenant"] is not None}):
        mine = [r for r in rows if r["tenant"] == t]
        p = sum(r["prompt"] for r in mine)
        by_tenant[t] = {"requests": len(mine), "prompt_tokens": p,
                        "device_hit_rate": sum(r["device_hit"] for r in mine) / p,
                        "host_hit_rate": sum(r["host_hit"] for r in mine) / p,
                        "ttft_p50_s": pctl([r["ttft_s"] for r in mine], 50)}  # fmt: skip
    return {
        "mode": mode,
        "requests": len(rows),
        "device_kv_bytes": device_bytes,  # the KV pool's, and the window pool's with --window-pool
        "window_cut_tokens": m.window_cut_tokens if m is not None else 0,
        "by_tenant": by_tenant,  # multitenant: each tenant's hit rates (its own pages only)
        "ttft_p50_s": pctl(ttft, 50),
        "ttft_p90_s": pctl(ttft, 90),
        "ttft_p99_s": pctl(ttft, 99),
        "ttft_p50_by_round_s": by_round,
        "queued_p50_s": pctl([r["queued_s"] for r in rows], 50),
        "throughput_tokens_per_s": sum(len(r.tokens) for r in results) / max(span, 1e-9),
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "device_hit_tokens": sum(r["device_hit"] for r in rows),
        "host_hit_tokens": sum(r["host_hit"] for r in rows),
        # Brought into the host pool from the store by prefetch: mostly counted again as host hits, but a
        # page the host pool evicts again before its request is admitted is counted here only.
        "storage_hit_tokens": storage_tokens,
        "computed_tokens": sum(r["computed"] for r in rows),
        "device_hit_rate": sum(r["device_hit"] for r in rows) / prompt_tokens,
        "host_hit_rate": sum(r["host_hit"] for r in rows) / prompt_tokens,
        "storage_hit_rate": storage_tokens / prompt_tokens,
        "tokens_loaded": m.tokens_loaded if m is not None else 0,
        "load_gbps": m.load_gbps if m is not None else 0.0,
        "load_wait_s": sum(r["load_wait_s"] for r in rows),
        "rows": rows,
    }


TARGET_RATIO = 0.5  # hierarchical TTFT p50 at most half of device-only's ...
TARGET_MAX_FRACTION = 0.25  # ... when the device pool holds at most a quarter of the working set


def serving_target(results: list[dict], device_fraction: float, on_gpu: bool) -> dict[str, Any]:
    """The serving target, on a GPU: hierarchical TTFT p50 / device-only TTFT p50 <= 0.5 with the
    working set at least 4x the device pool. ``status`` is ``n/a`` when the run did not measure it (not
    on a GPU, a mode missing, or a larger device pool); the ratio is reported all the same."""
    by = {r["mode"]: r for r in results}
    row: dict[str, Any] = {"target": "hierarchical TTFT p50 / device-only TTFT p50, working set >= 4x device pool",
                           "measured": None, "threshold": TARGET_RATIO, "status": "n/a"}  # fmt: skip
    if "hierarchical" in by and "device" in by and by["device"]["ttft_p50_s"] > 0:
        row["measured"] = by["hierarchical"]["ttft_p50_s"] / by["device"]["ttft_p50_s"]
        if on_gpu and device_fraction <= TARGET_MAX_FRACTION:
            row["status"] = "pass" if row["measured"] <= TARGET_RATIO else "MISS"
    if not on_gpu:
        row["note"] = "the target applies on a GPU; on a CPU only the ordering is expected (cpu_ordering)"
    return row


def cpu_ordering(results: list[dict]) -> dict[str, bool | None]:
    """What a CPU run must show: the hierarchical cache hits more of the prompts than the device-only
    one, and its TTFT p50 is below recompute's (None: a mode missing)."""
    by = {r["mode"]: r for r in results}
    hier, dev, rec = by.get("hierarchical"), by.get("device"), by.get("recompute")
    return {
        "hit_rate_above_device_only": None if hier is None or dev is None else
        hier["device_hit_rate"] + hier["host_hit_rate"] > dev["device_hit_rate"],
        "ttft_p50_below_recompute": None if hier is None or rec is None else hier["ttft_p50_s"] < rec["ttft_p50_s"],
    }  # fmt: skip


def plot(path: str, results: list[dict], xlabel: str = "round") -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        rounds = sorted(r["ttft_p50_by_round_s"], key=int)
        a.plot([int(k) for k in rounds], [1e3 * r["ttft_p50_by_round_s"][k] for k in rounds], marker="o",
               label=r["mode"])  # fmt: skip
    a.set_xticks(sorted({int(k) for r in results for k in r["ttft_p50_by_round_s"]}))
    a.set_xlabel(xlabel)
    a.set_ylabel("TTFT p50 (ms)")
    a.legend()
    names = [r["mode"] for r in results]
    dev = [r["device_hit_rate"] for r in results]
    sto = [min(r["storage_hit_rate"], r["host_hit_rate"]) for r in results]
    host = [r["host_hit_rate"] - s for r, s in zip(results, sto, strict=True)]
    b.bar(names, dev, label="device")
    b.bar(names, host, bottom=dev, label="host")
    b.bar(names, sto, bottom=[x + y for x, y in zip(dev, host, strict=True)], label="storage")
    b.set_ylabel("prompt tokens hit")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, ``--quick`` applied and every value checked (``SystemExit`` naming a bad one)."""
    p = argparse.ArgumentParser(prog="python -m hicache.bench.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["multiturn", "multitenant", "longqa"], default="multiturn")
    p.add_argument("--tenants", type=int, default=4, help="multitenant: tenants the clients are spread over")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--system-len", type=int, default=64)
    p.add_argument("--turn-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--docs", type=int, default=10, help="longqa: the documents")
    p.add_argument("--doc-len", type=int, default=1024, help="longqa: each document's tokens")
    p.add_argument("--questions", type=int, default=40, help="longqa: questions in all, interleaved over the documents")
    p.add_argument("--rate", type=float, default=0.0, help="requests per second, Poisson (0: all at once)")
    p.add_argument("--max-parallel", type=int, default=4,
                   help="the most requests in flight (a client's turn waits for one to finish)")  # fmt: skip
    p.add_argument("--max-running", type=int, default=None,
                   help="the server's running batch: the most requests prefilled and decoded together "
                        "(default: --max-parallel)")  # fmt: skip
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="the most prompt tokens prefilled in one step (default: no limit)")  # fmt: skip
    p.add_argument("--device-fraction", type=float, default=0.25,
                   help="device pool / working set (longqa: / the documents' KV)")  # fmt: skip
    p.add_argument("--host-ratio", type=float, default=None,
                   help="host pool / device pool (default: room for the working set, at least 4)")  # fmt: skip
    p.add_argument("--storage-host-ratio", type=float, default=2.0, help="host pool / device pool, storage mode")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--layout", default="page_first")
    p.add_argument("--io-backend", default="direct")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--ffn", type=int, default=None, help="the MLP's width (default 2 x --hidden)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--mla", action="store_true", help="an MLA model (a latent per token; --kv-lora elements)")
    p.add_argument("--kv-lora", type=int, default=32)
    p.add_argument("--indexer-dim", type=int, default=0,
                   help="a sparse-attention indexer (DeepSeek V3.2 style): index keys of this many "
                        "elements in a sidecar pool, each query attending to its --index-topk best "
                        "earlier tokens (0: none)")  # fmt: skip
    p.add_argument("--index-topk", type=int, default=16)
    p.add_argument("--indexer-keys", choices=("fp8", "model"), default="fp8",
                   help="the index keys' storage: FP8 with a float32 scale per token, packed in uint8 rows "
                        "(DeepSeek V3.2's; default), or the model's dtype")  # fmt: skip
    p.add_argument(
        "--recurrent-dim",
        type=int,
        default=0,
        help="a recurrent branch (Mamba / linear-attention style) of this many state channels beside "
        "--recurrent-layer's attention, its state checkpointed at every page boundary (0: none)",
    )
    p.add_argument("--recurrent-layer", type=int, default=0)
    p.add_argument("--recurrent-only", action="store_true",
                   help="the recurrent layer has no attention (a Mamba layer of a Jamba-style hybrid)")  # fmt: skip
    p.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="sliding-window attention of this many tokens in every layer but each --full-every-th "
        "(0: every layer full)",
    )
    p.add_argument("--full-every", type=int, default=2)
    p.add_argument("--window-pool", type=float, default=0.0,
                   help="with --sliding-window: keep the windowed layers in a window pool of this fraction of "
                        "the KV pool's slots, rows only where a window needs them (0: in the KV pool)")  # fmt: skip
    p.add_argument("--fast", action="store_true", help="matmuls and fused attention (not bit-exact; for GPUs)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the pools, the model and the copies on the GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for the model (default 1: the cache's copy threads then do not "
                        "fight the model for a small machine's cores)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a small run (under two minutes on 2 CPU cores)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar per mode on stderr (default: when stderr is a terminal)")  # fmt: skip
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    a = p.parse_args(argv)
    if a.quick:
        a.clients, a.rounds, a.system_len, a.turn_len, a.output_len = 8, 4, 32, 12, 4
        a.docs, a.doc_len, a.questions = min(a.docs, 10), min(a.doc_len, 128), min(a.questions, 20)
        a.layers, a.hidden, a.heads, a.kv_heads, a.head_dim = 2, 32, 4, 2, 8
    if a.progress is None:
        a.progress = sys.stderr.isatty()
    for name in ("clients", "rounds", "output_len", "page_size", "docs", "doc_len", "questions", "max_parallel",
                 "tenants"):  # fmt: skip
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1")
    if not 0 < a.device_fraction <= 1:
        p.error("--device-fraction: expected in (0, 1]")
    if a.threads < 1:
        p.error("--threads: expected >= 1")
    if a.ffn is not None and a.ffn < 1:
        p.error("--ffn: expected >= 1")
    if a.max_running is not None and a.max_running < 1:
        p.error("--max-running: expected >= 1")
    if a.max_prefill_tokens is not None and a.max_prefill_tokens < 1:
        p.error("--max-prefill-tokens: expected >= 1")
    if a.host_ratio is not None and a.host_ratio <= 0:
        p.error("--host-ratio: expected > 0")
    if a.indexer_dim < 0 or a.index_topk < 1 or a.kv_lora < 1:
        p.error("--indexer-dim: expected >= 0; --index-topk, --kv-lora: expected >= 1")
    if (a.indexer_dim or a.recurrent_dim) and not a.mla and "storage" in a.modes and a.layout != "page_head":
        p.error("--indexer-dim, --recurrent-dim: the storage mode stores sidecar rows with MLA pages, or MHA pages "
                "in --layout page_head (each head group's object carries them): add one, or drop the storage "
                "mode")  # fmt: skip
    if a.recurrent_dim < 0 or a.sliding_window < 0 or a.full_every < 1:
        p.error("--recurrent-dim, --sliding-window: expected >= 0; --full-every: expected >= 1")
    if a.recurrent_dim and a.recurrent_dim % a.page_size:
        p.error(f"--recurrent-dim: expected a multiple of --page-size {a.page_size} (a page's rows hold one state)")
    if a.recurrent_only and (not a.recurrent_dim or a.mla):
        p.error("--recurrent-only: needs --recurrent-dim, without --mla")
    if a.recurrent_dim and not 0 <= a.recurrent_layer < a.layers:
        p.error(f"--recurrent-layer: expected a layer in [0, {a.layers})")
    if a.window_pool and (not a.sliding_window or a.window_pool < 0):
        p.error("--window-pool: expected a fraction > 0, with --sliding-window")
    if a.window_pool and "storage" in a.modes and a.layout != "page_head":
        p.error("--window-pool: the storage mode stores window rows in each head group's object: add --layout "
                "page_head, or drop the storage mode")  # fmt: skip
    if a.sliding_window and (a.mla or a.indexer_dim):
        p.error("--sliding-window: served with MHA/GQA layers only (not with --mla or --indexer-dim)")
    return a


@dataclasses.dataclass
class PoolSizes:
    """What the pools are sized from and to, in tokens (KV slots)."""

    working_set: int  # KV the whole stream would keep
    documents_kv: int | None  # longqa: the documents' KV, each once (None: multiturn)
    device_slots: int
    host_ratio: float  # host pool / device pool, outside the storage mode

    @property
    def sized_from(self) -> int:
        return self.working_set if self.documents_kv is None else self.documents_kv


def pool_sizes(a: argparse.Namespace, turns: list[Turn], prompt_of) -> PoolSizes:
    """The working set: multi-turn, each client's longest request (the shared system prompt counted per
    client); long-context QA, each document once, then each question and its answer. The device pool is
    ``--device-fraction`` of it, for long-context QA of the documents alone (what the host tier is there
    to keep), in whole pages, but at least room for two of the largest requests (fewer run at once when
    the pool is full: they wait). The host pool: ``--host-ratio``, by default room for the working set
    and at least 4 device pools."""
    per_client = longest_per_client(turns, prompt_of, a.output_len)
    docs_kv = a.docs * a.doc_len if a.workload == "longqa" else None
    if docs_kv is not None:
        ws = docs_kv + a.questions * (a.turn_len + a.output_len)
    else:
        ws = sum(per_client.values())
    ps = a.page_size
    floor = -(-2 * max(per_client.values()) // ps) * ps
    slots = max(int((docs_kv or ws) * a.device_fraction) // ps * ps, floor)
    host_ratio = a.host_ratio if a.host_ratio is not None else max(4.0, float(-(-ws // slots)))
    return PoolSizes(ws, docs_kv, slots, host_ratio)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    prov = provenance("hicache.bench.serving", argv) if a.json else {}  # the code and machine as the run starts
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        print(f"hicache.bench.serving: --device {a.device}: no CUDA device is visible here "
              f"(torch {torch.__version__}); nothing measured", file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(a.threads)
    r = random.Random(a.seed)
    turns, prompt_of = {"multiturn": multiturn, "multitenant": multitenant, "longqa": longqa}[a.workload](a, r)
    cfg = ModelConfig(num_layers=a.layers, hidden=a.hidden, num_heads=a.heads, num_kv_heads=a.kv_heads,
                      head_dim=a.head_dim, ffn=a.ffn or 2 * a.hidden, vocab=a.vocab, exact=not a.fast, seed=a.seed,
                      dtype=getattr(torch, a.dtype), mla=a.mla, kv_lora=a.kv_lora, indexer_dim=a.indexer_dim,
                      index_topk=a.index_topk, indexer_fp8=a.indexer_keys == "fp8", recurrent_dim=a.recurrent_dim,
                      recurrent_layer=a.recurrent_layer, recurrent_only=a.recurrent_only,
                      sliding_window=a.sliding_window, full_every=a.full_every)  # fmt: skip
    model = TinyLM(cfg, a.device)
    longest = max(longest_per_client(turns, prompt_of, a.output_len).values())
    sizes = pool_sizes(a, turns, prompt_of)
    a.host_ratio = sizes.host_ratio
    ws, docs_kv, slots, ps = sizes.working_set, sizes.documents_kv, sizes.device_slots, a.page_size
    results = []
    # Warm-up, untimed: the first forwards pay one-time costs (GPU kernels loaded, GEMM plans chosen)
    # that would otherwise land on the first mode's first requests.
    warm = Engine(model, cfg.pool(2 * longest, ps, a.device))
    warm.serve([Request(list(range(1, min(longest - 1, 4 * ps) + 1)), 2), Request([1, 2], 2)], max_running=2)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes:
            results.append(run_mode(mode, a, model, turns, prompt_of, slots, Path(tmp) / "store"))
    print(f"{a.workload}: {len(turns)} requests, working set ~{ws} tokens, device pool {slots} slots "
          f"({slots / ws:.2f} of it), host pool {a.host_ratio:g}x, page {ps}, {cfg.num_layers} layers")  # fmt: skip
    if docs_kv is not None:
        print(f"longqa: {a.docs} documents of {a.doc_len} tokens, {a.questions} questions interleaved; the "
              f"documents' KV is {docs_kv / slots:.2f}x the device pool")  # fmt: skip
    for x in results:
        print(f"{x['mode']:>12}: TTFT p50 {1e3 * x['ttft_p50_s']:8.2f} ms  p90 {1e3 * x['ttft_p90_s']:8.2f}  "
              f"p99 {1e3 * x['ttft_p99_s']:8.2f}  | {x['throughput_tokens_per_s']:7.1f} tok/s  | hit: device "
              f"{x['device_hit_rate']:.2f} host {x['host_hit_rate']:.2f} (storage {x['storage_hit_rate']:.2f})  "
              f"loaded {x['tokens_loaded']} tokens, waited {1e3 * x['load_wait_s']:.1f} ms")  # fmt: skip
        for t, y in x["by_tenant"].items():
            print(f"{'':>14}tenant {t}: {y['requests']} requests, hit: device {y['device_hit_rate']:.2f} host "
                  f"{y['host_hit_rate']:.2f}, TTFT p50 {1e3 * y['ttft_p50_s']:.2f} ms")  # fmt: skip
    # The pool's real share of what it was sized from (its floor of two requests can make it larger).
    target = serving_target(results, slots / sizes.sized_from, torch.device(a.device).type == "cuda")
    order = cpu_ordering(results)
    # Every mode's answers against recompute's (equal on CPU float32, where the model is exact).
    ref = next((x for x in results if x["mode"] == "recompute"), None)
    if ref is not None:
        want = {(r["client"], r["round"]): r["answer"] for r in ref["rows"]}
        for x in results:
            x["answers_equal_recompute"] = all(want[(r["client"], r["round"])] == r["answer"] for r in x["rows"])
    if target["measured"] is not None:
        print(f"target: {target['target']}: {target['measured']:.3f} (<= {TARGET_RATIO}): {target['status']}"
              + (f" ({target['note']})" if "note" in target else ""))  # fmt: skip
    print("ordering: " + ", ".join(f"{k} {v}" for k, v in order.items() if v is not None))
    out = {
        **prov,
        "bench": "hicache.bench.serving",
        "target": target,
        "cpu_ordering": order,
        "workload": a.workload,
        "args": {k: v for k, v in vars(a).items() if k not in ("json", "plot")},
        "working_set_tokens": ws,
        "device_slots": slots,
        "documents_kv_tokens": docs_kv,  # longqa only (None otherwise)
        "documents_kv_over_device_pool": None if docs_kv is None else docs_kv / slots,
        "model": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in dataclasses.asdict(cfg).items()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
    }
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.json}")
    if a.plot:
        plot(a.plot, results, "question on its document" if a.workload == "longqa" else "round")
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
