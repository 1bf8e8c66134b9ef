"""The errors a copy is acknowledged with, and the one the cache raises after rolling failed copies
back. Below the controller and the cache, which both use them."""

from __future__ import annotations


class CopyDropped(RuntimeError):
    """The error a copy is acknowledged with when ``close(drain=False)`` dropped it before it ran."""


class CopyFailedOnPeer(RuntimeError):
    """The error a copy that completed here is acknowledged with when the same copy failed on another
    TP rank: every rank rolls it back, so the ranks' trees stay the same."""


class CopyError(RuntimeError):
    """Copies failed. Raised by the tree's ack processing (``check_writes``, ``check_loads``, ``flush``,
    ``close``) *after* it rolled the nodes of every failed copy back, so the cache is consistent.

    Attributes
    ----------
    failures : ``(kind, node_id, error)`` per failed copy, ``kind`` ``"write"`` or ``"load"``; the
        first error is also the exception's ``__cause__``.
    """

    def __init__(self, failures: list[tuple[str, int, BaseException]]) -> None:
        self.failures = list(failures)
        kind, node_id, error = self.failures[0]
        more = f" (and {len(self.failures) - 1} more failed copies)" if len(self.failures) > 1 else ""
        super().__init__(f"{kind} of node {node_id} failed: {error!r}{more}; its nodes were rolled back")
