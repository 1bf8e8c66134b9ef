"""GPU-only measurements beside the sweep: GEMM slowdown next to a transfer, layer-wise overlapped load."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import benchutil
from .config import (
    INTERFERENCE_GEMM_N,
    OVERLAP_GEMM_NS,
    UNBUDGETED_BACKENDS,
    ModelConfig,
    PointSpec,
)
from .sweep import Workload, transfer_fn


def _transfer_loop(run: Callable[[], None], stream: Any, stop: threading.Event) -> None:
    """Keep one transfer in flight on ``stream`` until ``stop`` is set (the current stream is per
    thread, so this thread makes ``stream`` its own)."""
    with torch.cuda.stream(stream):
        while not stop.is_set():
            run()
            stream.synchronize()


def interference_budgets(args: argparse.Namespace) -> list[int]:
    """SM budgets the kernel designs' interference is measured at: ``--sm-budget`` and every count of
    ``--sm-sweep``, ascending."""
    sweep = [int(x) for x in str(args.sm_sweep or "").split(",") if x.strip()]
    return sorted({int(args.sm_budget), *sweep})


def interference(args: argparse.Namespace, model: ModelConfig, backends: list[str], repeats: int) -> list[dict]:
    """GEMM time alone and beside a continuously running backup on another stream, per backend, and
    for the SM-budgeted designs (``kernel``, ``kernel-bulk``) per budget of :func:`interference_budgets`."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(args.seed)
    work = Workload(model, args.tokens, device, pin=True)
    a = torch.randn(INTERFERENCE_GEMM_N, INTERFERENCE_GEMM_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(INTERFERENCE_GEMM_N, INTERFERENCE_GEMM_N, device=device, dtype=torch.bfloat16)
    compute = torch.cuda.Stream()
    timer = benchutil.CudaEventTimer(compute)

    def gemm() -> None:
        torch.mm(a, b)  # on the compute stream: the timer makes it current

    alone = benchutil.measure(gemm, timer=timer, repeats=repeats, warmup=3)
    points = []
    runs = [(name, None if name in UNBUDGETED_BACKENDS else sms) for name in backends
            for sms in ([None] if name in UNBUDGETED_BACKENDS else interference_budgets(args))]  # fmt: skip
    for name, sms in runs:
        spec = PointSpec(model, name, "backup_all", "page_first_direct", 16, max(1, args.tokens // 16), sms)
        side = torch.cuda.Stream()
        pw = transfer_fn(spec, work, gen)
        with torch.cuda.stream(side):
            pw.prepare()
        stop = threading.Event()

        t = threading.Thread(target=_transfer_loop, args=(pw.run, side, stop), daemon=True)
        t.start()
        time.sleep(0.05)
        beside = benchutil.measure(gemm, timer=timer, repeats=repeats, warmup=1)
        stop.set()
        t.join(30)
        points.append({
            "kind": "interference", "model": model.name, "backend": name, "gemm_alone_ms": alone.median_ms,
            "gemm_beside_ms": beside.median_ms, "slowdown": beside.median_ms / alone.median_ms - 1.0,
            "sm_budget": spec.sm_budget, "transfer_bytes": pw.nbytes,
            "batch_fallback": "; ".join(sorted(pw.fallbacks)) or None,
        })  # fmt: skip
    return points


def overlap(args: argparse.Namespace, model: ModelConfig, backend: str, repeats: int) -> dict[str, Any]:
    """Simulated forward: one matmul per layer sized to take about 1.25x a layer's load; compares
    compute alone, load-all-then-compute, and layer-wise load waited on per layer.

    The layer-wise load does what the cache controller does, on this package's primitives only: the
    batch is prepared once (:meth:`~hicache_kernels.binding.KVBinding.batch_plan`), each layer's load
    goes to a side stream followed by that layer's event, and the forward's matmul of a layer waits
    for the layer's event (on the GPU, without blocking the host) while later layers still load."""
    from ..backends import get_backend
    from ..binding import KVBinding

    page = 16
    tokens = max(page, args.tokens - args.tokens % page)
    # The first `tokens` slots of each side, as freshly allocated pools hand them out.
    work = Workload(model, tokens, torch.device("cuda"), pin=True, headroom=2, page_sizes=(page,))
    pools = KVBinding(work.dev_k, work.dev_v, work.host("page_first_direct", page), layout="page_first_direct",
                      page_size=page)  # fmt: skip
    copy = get_backend(backend)
    d_idx, h_idx = torch.arange(tokens), torch.arange(tokens)
    timer = benchutil.CudaEventTimer()

    def load_layer0() -> None:
        pools.load(d_idx, h_idx, layer_id=0, backend=copy)

    layer_ms = benchutil.measure(load_layer0, timer=timer, repeats=repeats).median_ms
    for n in OVERLAP_GEMM_NS:  # the first GEMM at least 1.25x a layer's load
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        if benchutil.measure(lambda x=x: torch.mm(x, x), timer=timer, repeats=3).median_ms >= 1.25 * layer_ms:
            break

    def forward() -> None:
        for _ in range(model.num_layers):
            torch.mm(x, x)

    def wall(fn: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def load_then_compute() -> None:
        pools.load(d_idx, h_idx, backend=copy)
        forward()

    side = torch.cuda.Stream()
    layer_done = [torch.cuda.Event() for _ in range(model.num_layers)]  # made once, re-recorded per batch

    def overlapped() -> None:
        compute = torch.cuda.current_stream()
        side.wait_stream(compute)  # the loads overwrite slots the compute stream's earlier work used
        batch = pools.batch_plan("h2d", d_idx, h_idx, backend=copy, stream=side)  # indices checked, moved once
        for layer, done in enumerate(layer_done):
            copy.run(pools.layer_plan(batch, layer))
            done.record(side)
            compute.wait_event(done)  # this layer's matmul only; later layers keep loading meanwhile
            torch.mm(x, x)

    results = {}
    for name, fn in (("compute_ms", forward), ("load_then_compute_ms", load_then_compute),
                     ("overlapped_ms", overlapped)):  # fmt: skip
        fn()
        results[name] = benchutil.summarize([wall(fn) for _ in range(repeats)]).median_ms
    load_all = benchutil.measure(lambda: pools.load(d_idx, h_idx, backend=copy), timer=timer,
                                 repeats=repeats).median_ms  # fmt: skip
    return {
        "kind": "overlap", "model": model.name, "backend": backend, "tokens": tokens, "gemm_n": n,
        "layer_load_ms": layer_ms, "load_all_ms": load_all, **results,
        "overlap_ratio": results["overlapped_ms"] / results["compute_ms"],
        "transfer_le_compute": load_all <= results["compute_ms"],
    }  # fmt: skip
