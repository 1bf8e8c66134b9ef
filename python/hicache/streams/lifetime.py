"""The package's worker threads at interpreter exit: stopped before the interpreter finalizes.

The controller's copy workers, the storage tier's I/O threads and the Mooncake client's call threads are
daemon threads. A daemon thread that returns from a native call (a copy, file or network I/O) while the
interpreter finalizes is ended by it on the spot, and inside C++ that ends the whole process (SIGABRT,
"terminate called without an active exception"), hiding the script's own exit status and traceback.

So every component that starts threads registers a *stop* here (:func:`stop_at_exit`), holding its queues
and threads but not the component (it may still be collected). At exit, once the main thread has
finished, each live stop runs, newest first: queued work is dropped unrun, the work a thread is inside
finishes, and the threads are joined, within :data:`EXIT_TIMEOUT_S` each. The hook runs where
:mod:`concurrent.futures` stops its own pools (the interpreter's threading shutdown, before non-daemon
threads are joined and before :mod:`atexit`), and before them: a storage thread inside a backup still
finds the file backend's thread pool open. A component's ``close()`` unregisters its stop (its threads
are gone then). The hook prints one line to stderr when something the user would expect to persist
was lost (storage backups never written); otherwise it says nothing.
"""

from __future__ import annotations

import atexit
import itertools
import sys
import threading
from collections.abc import Callable

__all__ = ["EXIT_TIMEOUT_S", "Stop", "forget", "stop_at_exit"]

EXIT_TIMEOUT_S = 30.0  # the longest the hook waits for one component's threads (a copy or an I/O call)

# A stop: called with the seconds it may take; returns what was lost (one phrase), or None.
Stop = Callable[[float], "str | None"]

_lock = threading.Lock()
_stops: dict[int, Stop] = {}
_ids = itertools.count(1)


def stop_at_exit(stop: Stop) -> int:
    """Run ``stop(timeout_s)`` at interpreter exit unless :func:`forget` is called first; returns the
    handle for :func:`forget`. ``stop`` must not reference its component (only queues and threads)."""
    global _hooked
    with _lock:
        handle = next(_ids)
        _stops[handle] = stop
        if not _hooked:
            _hooked = True
            _hook()
        return handle


def forget(handle: int | None) -> None:
    """The component stopped its threads itself (``close()``): nothing to do at exit. Idempotent."""
    if handle is not None:
        with _lock:
            _stops.pop(handle, None)


def _stop_all() -> None:
    with _lock:
        stops = [_stops.pop(h) for h in sorted(_stops, reverse=True)]  # newest first: a cache before its tier
    lost = []
    for stop in stops:
        try:
            what = stop(EXIT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - one component's failure must not keep the others running
            what = f"a worker did not stop ({type(exc).__name__}: {exc})"
        if what:
            lost.append(what)
    if lost:
        print(f"hicache: at exit, {'; '.join(lost)} (close() the cache before exiting to finish them)",
              file=sys.stderr)  # fmt: skip


_hooked = False


def _hook() -> None:
    """Register :func:`_stop_all` once, at the first stop: after :mod:`concurrent.futures` registered its
    own (it is imported with the storage backends), so that ours runs first (the threading shutdown
    calls its hooks newest first). Falls back to :mod:`atexit` where that hook does not exist."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError
        register(_stop_all)
    except RuntimeError:  # no threading hook here, or the interpreter is already shutting down
        atexit.register(_stop_all)
