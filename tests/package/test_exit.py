"""A process that ends while the package's threads are busy exits with its own status.

Each test runs a small script in a fresh interpreter, with copies, storage backups or prefetches in
flight, and ends it a different way: the script just finishes, raises, calls ``sys.exit``, gets SIGINT
while the engine serves, or has a TP peer leave. The checks:
- the exit status is the script's own;
- stderr holds nothing of ours. A daemon thread that returns from native code while the interpreter
  finalizes aborts the process ("terminate called without an active exception", SIGABRT);
- what reached storage reads back whole or as a miss.

Each test runs eagerly and under the deferred device model. The copies are large enough that, before
the exit hook (:mod:`hicache.streams.lifetime`), a worker was inside one at exit nearly every time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ABORT = "terminate called"

PRELUDE = """
import sys, torch
sys.path.insert(0, {tests!r})
from hicache import DeviceKVPool, HiRadixCache, HostKVPool

def cache(write_policy="write_through", storage=None, slots=4096, layers=8, heads=8, head_dim=128):
    dev = DeviceKVPool(num_slots=slots, num_layers=layers, head_num=heads, head_dim=head_dim,
                       dtype=torch.float32, device="cpu", page_size=4)
    if storage is None:
        extra = {{}}
    elif isinstance(storage, str):  # a directory: the file backend
        extra = dict(storage="file", storage_config={{"path": storage}}, model_id="exit")
    else:  # a backend
        extra = dict(storage=storage, model_id="exit")
    return HiRadixCache(dev, HostKVPool(dev, layout="page_first", ratio=2.0), io_backend="direct",
                        write_policy=write_policy, load_back_threshold=0, **extra)

def fill(c, n=8, length=256):
    for i in range(n):
        s = c.device_pool.alloc(length)
        c.insert([i * 1000 + j for j in range(length)], s)
"""


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(PRELUDE.format(tests=str(ROOT / "tests"))) + textwrap.dedent(body))
    return path


def environ(deferred: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_DEFERRED_SEED"}
    if deferred:
        env["HICACHE_DEFERRED_SEED"] = "1"
    return env


def run(tmp_path: Path, body: str, deferred: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script(tmp_path, body))], capture_output=True, text=True,
                          env=environ(deferred), timeout=300)  # fmt: skip


MODES = pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])


@MODES
def test_the_reported_script_exits_0(tmp_path, deferred):
    """The report's script: one insert (a backup in flight), then the end of the script, no close()."""
    p = run(tmp_path, """
        c = cache(slots=64, layers=2, heads=1, head_dim=8)
        s = c.device_pool.alloc(8); c.insert(list(range(8)), s)
    """, deferred)  # fmt: skip
    assert (p.returncode, p.stderr) == (0, "")


@MODES
def test_exit_with_backups_in_flight(tmp_path, deferred):
    p = run(tmp_path, "fill(cache())\n", deferred)
    assert (p.returncode, p.stderr) == (0, "")


@MODES
def test_exit_after_write_back_evictions(tmp_path, deferred):
    p = run(tmp_path, """
        c = cache(write_policy="write_back")
        fill(c)
        c.evict(1024)  # write-back: backed up (and waited for), then dropped from the device
        fill(c, n=4)
        c.match_prefix(list(range(256)))  # a host hit: its load-back is queued below
        m = c.match_prefix(list(range(256)))
        c.load_back(m.last_host_node)
        c.start_loading()  # a load-back in flight too
    """, deferred)  # fmt: skip
    assert (p.returncode, p.stderr) == (0, "")


@MODES
def test_an_uncaught_exception_keeps_its_traceback_and_status(tmp_path, deferred):
    p = run(tmp_path, """
        fill(cache())
        raise ValueError("the user's own error")
    """, deferred)  # fmt: skip
    assert p.returncode == 1 and ABORT not in p.stderr
    assert p.stderr.rstrip().endswith("ValueError: the user's own error")


@MODES
def test_sys_exit_status_is_kept(tmp_path, deferred):
    p = run(tmp_path, "fill(cache())\nsys.exit(7)\n", deferred)
    assert (p.returncode, p.stderr) == (7, "")


WRITER = """
from cachedata import write_kv
c = cache(storage={store!r}, slots=2048, layers=3, heads=2, head_dim=4)
for i in range(6):
    toks = [i * 1000 + j for j in range(256)]
    s = c.device_pool.alloc(256)
    write_kv(c, toks, s)
    c.insert(toks, s)
c.controller.flush()
c.check_acks()  # the host copies landed: their storage backups are queued now
"""

READER = """
from cachedata import check_kv
c = cache(storage={store!r}, slots=2048, layers=3, heads=2, head_dim=4)
found = []
for i in range(6):
    toks = [i * 1000 + j for j in range(256)]
    m = c.match_prefix(toks)
    if c.prefetch_from_storage(i + 1, m.last_host_node, toks):
        for _ in range(100):
            p = c.storage_ops.prefetches[i + 1]
            assert (p.queried if p.state == "query" else p.finished).wait(60)
            if c.check_prefetch_progress(i + 1):
                break
    m = c.match_prefix(toks)
    if m.host_hit_length:
        assert c.load_back(m.last_host_node) is not None
        c.start_loading()
        c.flush()
        m = c.match_prefix(toks)
    check_kv(c, toks[: len(m.device_indices)], m.device_indices)  # the pages that came back are whole
    found.append(len(m.device_indices))
print(*found)
m = c.match_prefix(list(range(256)))
c.prefetch_from_storage(99, m.last_host_node, list(range(256)))  # in flight at exit
"""


@MODES
def test_storage_backups_and_prefetches_in_flight_then_exit(tmp_path, deferred):
    """A writer exits with storage backups queued and running: it says how many pages were not written,
    nothing else; a second process finds each page stored whole (its KV checked) or missing, and exits
    with a prefetch in flight."""
    store = str(tmp_path / "store")
    w = run(tmp_path, WRITER.format(store=store), deferred)
    assert w.returncode == 0 and ABORT not in w.stderr
    lines = w.stderr.splitlines()
    assert len(lines) <= 1 and all(line.startswith("hicache: at exit, ") for line in lines), w.stderr
    r = run(tmp_path, READER.format(store=store), deferred)
    assert (r.returncode, r.stderr) == (0, "")
    found = [int(x) for x in r.stdout.split()]
    assert len(found) == 6 and all(n % 4 == 0 for n in found)  # whole pages, or none
    if not lines:  # nothing was reported lost: everything is there
        assert found == [256] * 6


@MODES
def test_sigint_while_the_engine_serves(tmp_path, deferred):
    """Ctrl-C while the engine serves: the process ends as an interrupted Python does (the
    KeyboardInterrupt traceback, killed by SIGINT), not by SIGABRT."""
    path = script(tmp_path, """
        import itertools
        from hicache.serving.engine import Engine, Request
        from hicache.serving.model import ModelConfig, TinyLM
        cfg = ModelConfig(num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, head_dim=32, ffn=512, vocab=97)
        pool = cfg.pool(1024, 4)
        c = HiRadixCache(pool, HostKVPool(pool, layout="page_first", ratio=4.0), io_backend="direct",
                         load_back_threshold=1)
        engine = Engine(TinyLM(cfg), pool, c)
        for round in itertools.count():
            engine.serve([Request([(r * 7 + k) % 97 for k in range(200)], 4, 0.0, r) for r in range(16)],
                         max_running=4)
            if round == 0:
                print("serving", flush=True)
    """)  # fmt: skip
    p = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=environ(deferred))  # fmt: skip
    try:
        assert p.stdout.readline() == "serving\n"  # one round served: the next has copies in flight
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert ABORT not in err and "KeyboardInterrupt" in err
    assert p.returncode in (-signal.SIGINT, 128 + signal.SIGINT), (p.returncode, err[-2000:])


RANK = """
import datetime
import torch.distributed as dist
from hicache.serving.engine import Engine, Request
from hicache.serving.model import ModelConfig, TinyLM
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
cfg = ModelConfig(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn=128, vocab=97)
model = TinyLM(cfg, tp_group=dist.group.WORLD)
pool = model.pool(512, 4)  # this rank's heads
c = HiRadixCache(pool, HostKVPool(pool, layout="page_first", ratio=4.0), io_backend="direct",
                 load_back_threshold=1, tp_group=dist.group.WORLD)
engine = Engine(model, pool, c)
for round in range(1000):
    engine.serve([Request([(r * 7 + k) % 97 for k in range(100)], 4, 0.0, r) for r in range(8)], max_running=4)
    if rank == 1 and round == 1:
        # Leaves the cache and its copies as they are. The group is destroyed first: with a live gloo
        # group torch itself aborts at exit now and then (torch 2.11, a script of all_reduce and
        # sys.exit without this package: 3 aborts in 12 runs; none in 16 with the group destroyed).
        dist.destroy_process_group()
        sys.exit(0)
"""


@MODES
def test_a_tp_rank_leaving_early(tmp_path, deferred):
    """Two head-parallel ranks serve together; rank 1 leaves after two rounds (its group destroyed, its
    cache and copies as they are). It exits 0 without a word; rank 0's next collective fails (gloo: the
    peer closed the connection) and it exits 1 with that traceback, not with SIGABRT."""
    path = script(tmp_path, RANK)
    init = str(tmp_path / "init")
    procs = [subprocess.Popen([sys.executable, str(path), str(rank), init], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=environ(deferred)) for rank in (0, 1)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    (_, err0), (_, err1) = outs
    assert (procs[1].returncode, err1) == (0, "")
    assert procs[0].returncode == 1 and ABORT not in err0 and "RuntimeError" in err0, err0[-2000:]


BACKEND_WRITER = """
{make}
c = cache(storage=backend, slots=2048, layers=3, heads=2, head_dim=64)
fill(c, n=6)
c.controller.flush()
c.check_acks()  # storage backups queued and running on the backend's threads
"""


def ends_cleanly(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0 and ABORT not in p.stderr, p.stderr[-2000:]
    ours = [line for line in p.stderr.splitlines() if line.startswith("hicache")]
    assert all(line.startswith("hicache: at exit, ") for line in ours), p.stderr  # the loss report at most


@MODES
def test_exit_with_mooncake_backups_in_flight(tmp_path, deferred, master):
    """Against a real mooncake_master (skips, saying why, without the client): the client's calls run on
    the backend's own threads, which the exit hook waits for."""
    make = f"from mooncakedata import make_backend\nbackend = make_backend({master.address!r})"
    ends_cleanly(run(tmp_path, BACKEND_WRITER.format(make=make), deferred))


@MODES
def test_exit_with_nixl_backups_in_flight(tmp_path, deferred):
    from hicache.storage.nixl import install_hint, load_nixl

    try:
        load_nixl()
    except ImportError:
        pytest.skip(f"NIXL is not installed ({install_hint()})")
    config = {"path": str(tmp_path / "store")}
    make = f"from hicache.storage import create_backend\nbackend = create_backend('nixl', {config!r})"
    ends_cleanly(run(tmp_path, BACKEND_WRITER.format(make=make), deferred))
