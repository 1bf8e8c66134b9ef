"""The Mooncake client's calls, each bounded in time, and the master's up/down state, for
:class:`~hicache.storage.mooncake.MooncakeBackend` (:class:`MasterCalls`).

A call that raises, returns RPC-error codes (the master is gone) or runs past its time marks the master
*down*: a warning is logged once per outage, and until the client's ``health_check`` passes again
(asked at most every ``retry_interval_s``) no call is made. Calls run on shared daemon threads
(:class:`_Workers`): one that outlives its time is left to finish in the background, and while
``max_abandoned`` such calls are outstanding no new one is made; the host slots a late batch call may
still read or write stay busy (:meth:`MasterCalls.slots_busy`) until it returns.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..streams import lifetime

__all__ = ["FAILED", "OBJECT_ALREADY_EXISTS", "OBJECT_NOT_FOUND", "RPC_ERRORS", "MasterCalls"]

log = logging.getLogger("hicache.storage.mooncake")  # the backend's logger: one name for its messages

# Mooncake ErrorCode values (mooncake-store types.h) the backend tells apart; the Python client returns ints.
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_ERRORS = range(-999, -899)  # RPC_FAIL, RPC_TIMEOUT, ...: the master did not answer

FAILED = object()  # a call that raised, timed out, or was not made (master down, backend closed)


class _Workers:
    """Daemon threads that run the client's calls for :meth:`MasterCalls.run`, shared by every
    backend of the process: started when none is idle, never joined (a stuck call must not hold up the
    interpreter's exit), reused (a call on a warm thread costs ~10x less than on a new one)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._idle = 0  # threads waiting for a job, less the jobs queued for them
        self._busy = 0  # jobs submitted and not finished
        self._exiting = False
        lifetime.stop_at_exit(self._stop_at_exit)

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._exiting:  # the interpreter is exiting: no new client call
                raise RuntimeError("the interpreter is exiting")
            self._busy += 1
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            try:
                threading.Thread(target=self._loop, name="hicache-mooncake", daemon=True).start()
            except RuntimeError:  # Python >= 3.12 during interpreter exit: no new thread, so no call
                with self._lock:
                    self._busy -= 1
                    self._lock.notify_all()
                raise
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            finally:
                with self._lock:
                    self._idle += 1
                    self._busy -= 1
                    self._lock.notify_all()

    def _stop_at_exit(self, timeout: float) -> str | None:
        """At interpreter exit (:mod:`hicache.streams.lifetime`): no new call; the calls running finish
        (each is bounded by its backend's ``timeout_s``, and a master that is down is not called)."""
        with self._lock:
            self._exiting = True
            if not self._lock.wait_for(lambda: self._busy == 0, timeout):
                return f"{self._busy} Mooncake client call(s) were still running after {timeout:g} s"
        return None


_WORKERS = _Workers()


class MasterCalls:
    """Bounded calls into one master's client, and whether that master is up.

    Parameters
    ----------
    master : the master's ``"host:port"``, for messages.
    timeout_s : the longest one public call of the backend may take, all its client calls included
        (None: no bound of ours).
    retry_interval_s : while the master is down, how often to ask the client whether it is back.
    max_abandoned : calls past their time still running beyond which no new call is made.
    count : the backend's counters (``count(timeouts=1)``, ``count(outages=1)``).

    Attributes
    ----------
    store : the client (``MooncakeDistributedStore``) once set up, whose ``health_check`` probes a
        master that is down; None before.
    """

    def __init__(
        self,
        master: str,
        *,
        timeout_s: float | None,
        retry_interval_s: float,
        max_abandoned: int,
        count: Callable[..., None],
    ) -> None:
        self.master = master
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.max_abandoned = max_abandoned
        self.store: Any = None
        self._count = count
        self._lock = threading.Lock()
        self._down = False  # the master is considered gone: no calls but a probe per retry_interval_s
        self._warned = False  # an outage was logged and no call has reached the master since
        self._retry_at = 0.0
        # Calls past their timeout still running: each one's done event -> the host slots it may still
        # read or write (None for a call that touches no host slot).
        self._late: dict[threading.Event, torch.Tensor | None] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (no call is made any more)."""
        return self._closed

    def close(self) -> bool:
        """Make no call any more; False when it was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def health(self) -> tuple[bool, int]:
        """Whether the master is considered up, and how many calls past their time still run."""
        with self._lock:
            return not self._down, len(self._late)

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        timeout: float | None,
        on_late: Callable[[Any], None] | None = None,
        busy: torch.Tensor | None = None,
    ) -> tuple[str, Any]:
        """Call ``fn(*args)`` for at most ``timeout`` seconds: ``("ok", result)``, ``("raised", exc)`` or
        ``("timeout", None)``; a call past its timeout finishes on its thread, then ``on_late(result)``.
        ``busy``: the host slots the call reads or writes, reported by :meth:`slots_busy` from the moment
        it is given up on until it returns (recorded under the lock that decides it is late, so a call
        that ends meanwhile is either on time or recorded, never lost)."""
        if timeout is None:
            try:
                return "ok", fn(*args)
            except Exception as e:  # noqa: BLE001 - a client fault is a miss
                return "raised", e
        box: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                box["result"] = fn(*args)
            except Exception as e:  # noqa: BLE001
                box["error"] = e
            with self._lock:
                done.set()
                late = box.get("late", False)
                if late:
                    del self._late[done]  # its host slots are no longer busy
            if late and on_late is not None and "result" in box:
                try:
                    on_late(box["result"])
                except Exception:  # noqa: BLE001
                    log.debug("mooncake: cleanup after a late call failed", exc_info=True)

        try:
            _WORKERS.submit(target)
        except RuntimeError as e:  # the interpreter is exiting: no new call
            return "raised", e
        if not done.wait(timeout):
            with self._lock:
                if not done.is_set():
                    box["late"] = True
                    self._late[done] = None if busy is None else busy.detach().to("cpu", torch.int64).clone()
                    return "timeout", None
        if "error" in box:
            return "raised", box["error"]
        return "ok", box["result"]

    def mark_down(self, why: str) -> None:
        """Stop calling the store for ``retry_interval_s``; warn once per outage (an outage ends with a
        call that reaches the master, not with a passing health probe, which can lag a lost master)."""
        with self._lock:
            self._retry_at = time.monotonic() + self.retry_interval_s
            self._down = True
            if self._warned:
                return
            self._warned = True
        self._count(outages=1)
        log.warning(
            "mooncake: master %s unavailable (%s); storage reads and writes are misses until it answers again",
            self.master,
            why,
        )

    def deadline(self) -> float | None:
        """When a public call must be done by: it may make a probe and up to two client calls, all within
        one ``timeout_s``."""
        return None if self.timeout_s is None else time.monotonic() + self.timeout_s

    @staticmethod
    def left(deadline: float | None) -> float | None:
        """Seconds left until ``deadline`` (None: no bound)."""
        return None if deadline is None else deadline - time.monotonic()

    def available(self, deadline: float | None) -> bool:
        """Whether to call the store now: the master is up, or down but the client says it is back."""
        with self._lock:
            if self._closed or len(self._late) >= self.max_abandoned:
                return False
            if not self._down:
                return True
            now = time.monotonic()
            if now < self._retry_at:
                return False
            self._retry_at = now + self.retry_interval_s  # one probe per interval, whoever asks
        probe = getattr(self.store, "health_check", None)
        if probe is not None:
            left = self.left(deadline)
            status, rc = self.run(probe, (), left) if left is None or left > 0 else ("timeout", None)
            if status != "ok" or rc != 0:
                return False
        with self._lock:
            self._down = False  # on probation: the outage ends with a call that reaches the master
        return True

    def reached(self) -> None:
        """A call reached the master: the outage, if any, is over."""
        with self._lock:
            was, self._warned = self._warned, False
        if was:
            log.info("mooncake: master %s answers again", self.master)

    def call(
        self,
        what: str,
        deadline: float | None,
        fn: Callable[..., Any],
        *args: Any,
        on_late: Callable[[Any], None] | None = None,
        busy: torch.Tensor | None = None,
    ) -> Any:
        """A store call that returns by ``deadline``: its result, or :data:`FAILED` (when it raised or ran
        out of time the master is marked down; when no time was left it is not made). ``busy``: as for
        :meth:`run`."""
        if not self.available(deadline):
            return FAILED
        left = self.left(deadline)
        if left is not None and left <= 0:
            self._count(timeouts=1)
            return FAILED
        status, out = self.run(fn, args, left, on_late, busy)
        if status == "ok":
            return out
        if status == "timeout":
            self._count(timeouts=1)
            self.mark_down(f"{what} took longer than timeout_s={self.timeout_s:g}")
        else:
            self.mark_down(f"{what} raised {out!r}")
        return FAILED

    def codes(self, what: str, codes: Any, n: int) -> list[int] | None:
        """Per-key result codes of a batch call, or None when the call failed as a whole (then marked down)."""
        if codes is FAILED:
            return None
        try:
            codes = [int(c) for c in codes]
        except (TypeError, ValueError):
            codes = []
        if len(codes) != n:
            self.mark_down(f"{what} returned {n} keys' results as {codes!r}")
            return None
        rpc = [c for c in codes if c in RPC_ERRORS]
        if rpc:
            self.mark_down(f"{what} failed with RPC error {rpc[0]}")
        else:
            self.reached()
        return codes

    def slots_busy(self, host_slots: torch.Tensor, timeout: float | None = 0.0) -> bool:
        """Whether a batch call given up on at its time and still running holds any of ``host_slots``
        (its whole batch), after waiting up to ``timeout`` seconds for those calls to end."""
        slots = host_slots.detach().to("cpu", torch.int64)
        with self._lock:
            calls = [
                done
                for done, held in self._late.items()
                if held is not None and len(slots) and bool(torch.isin(held, slots).any())
            ]
        end = None if timeout is None else time.monotonic() + timeout
        for done in calls:
            if not done.wait(None if end is None else max(0.0, end - time.monotonic())):
                return True
        return False
