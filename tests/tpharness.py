"""Spawning tensor-parallel test ranks: each rank's process puts ``(rank, "ok", result)`` or
``(rank, "error", traceback)`` on the queue it is given; the parent waits with a hang detector."""

from __future__ import annotations

import datetime
import gc
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_report(rank: int, world: int, init_file: str, timeout_s: float, out: Any, work: Callable[[], Any]) -> None:
    """In a rank's process: join the gloo group (``timeout_s``: a collective another rank skipped fails
    instead of hanging), run ``work()``, meet the others, leave, and put ``(rank, "ok", result)`` on
    ``out``; ``(rank, "error", traceback)`` if anything raised."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
        result = work()
        # Caches kept alive by reference cycles (a raised CopyError's traceback holds its frames) hold
        # the process group: free them now, so the group's C++ side is torn down here and not while
        # the interpreter finalizes (gloo's threads then abort the process, exit code -6, at random).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, "ok", result))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    # The report is this process's whole output: flush it and leave without the interpreter's
    # finalization, where third-party C++ threads can still abort a process whose work succeeded.
    out.close()
    out.join_thread()
    os._exit(0)


def run_ranks(target: Callable[..., None], args: tuple, world: int, timeout_s: float, grace_s: float) -> dict:
    """Start ``target(rank, *args, out_queue)`` in ``world`` spawned processes; their results by rank.

    Fails the test when a rank reports an error (after giving the others ``grace_s`` to report: one
    may be waiting out a collective) or when they do not all finish within ``timeout_s`` (a hang)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world:
            try:
                rank, status, payload = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"TP ranks did not finish within {timeout_s} s (hang?); got ranks {sorted(results)}")
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                deadline = min(deadline, time.monotonic() + grace_s)
        if errors:
            pytest.fail("\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=max(1, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(5)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results
