"""The completion side of :class:`~hicache.controller.HiCacheController`: issued copies are
acknowledged (:class:`CopyAck`) with an event recorded after their work, taken only once that event
completed, and agreed over the TP ranks before the tree sees them (the tree's processing of what comes
out, roll-backs included, is :mod:`hicache.cache.copy_acks`).

Tensor parallelism: every rank runs the same tree logic; what differs between ranks is timing (how many
copies have landed). Whenever a decision depends on timing, ranks agree by an all-reduce (MIN) over the
given process group (gloo: the values are CPU tensors): always issued, whatever the local value,
because a collective skipped on one rank hangs the others.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch

from .copy_errors import CopyFailedOnPeer
from .layer_counter import LayerDoneCounter
from .metrics import CacheMetrics

__all__ = ["CopyAck", "CopyCompletions", "check_tp_group"]


@dataclass
class CopyAck:
    """A copy issued (or dropped): its nodes, its error (None: completed), and the event recorded after
    everything it issued on its stream; it is taken by the tree only once ``done`` says so."""

    kind: str
    node_ids: list[int]
    error: BaseException | None
    done: Any = None  # None: nothing was issued (dropped unrun)
    start: Any = None  # event before its first launch (for the copy time)
    tokens: int = 0
    generation: int = 0


def check_tp_group(tp_group: Any) -> None:
    """The agreement collectives reduce CPU tensors: the group must have a gloo backend."""
    if tp_group is None:
        return
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("tp_group: torch.distributed is not initialized; pass None without tensor parallelism")
    backend = str(dist.get_backend(tp_group)).lower()
    if "gloo" not in backend:
        raise ValueError(
            f"tp_group: the cache's agreement collectives reduce CPU tensors and need a gloo group, got a "
            f"{backend!r} group; pass a CPU (gloo) group over the same ranks (SGLang passes its tp_cpu_group), "
            "e.g. torch.distributed.new_group(ranks, backend='gloo')"
        )


class CopyCompletions:
    """The acks of a controller's copies and the TP agreements over them; owned by
    :class:`~hicache.controller.HiCacheController`, which issues the copies, appends their acks to
    :attr:`write_acks` / :attr:`load_acks` (from the issuing thread) and counts each submitted copy in
    :attr:`outstanding`.

    Parameters
    ----------
    tp_group : a gloo process group, or None.
    layer_counter : the controller's layer counter (a landed load batch releases its events).
    device : the controller's :class:`~hicache.streams.StreamDevice` (copy times).
    bytes_per_slot : the device pool's bytes per slot (bytes moved per token).
    metrics : where copied tokens, bytes and times are counted.
    """

    # At most this many acks of a kind are agreed per check (one fixed-size collective); more wait for
    # the next check.
    ACK_WINDOW = 64

    def __init__(
        self, tp_group: Any, layer_counter: LayerDoneCounter, device: Any, bytes_per_slot: int, metrics: CacheMetrics
    ) -> None:
        self.tp_group = tp_group
        self.layer_counter = layer_counter
        self.device = device
        self.bytes_per_slot = bytes_per_slot
        self.metrics = metrics
        # Issued copies in issue order, per kind; taken by finished() once their done events complete.
        # (deques: appended by the issuing thread, a worker or the caller's; emptied by the caller's)
        self.write_acks: deque[CopyAck] = deque()
        self.load_acks: deque[CopyAck] = deque()
        self._seen: dict[str, list[CopyAck]] = {"write": [], "load": []}  # pulled off a queue, not yet taken
        # Copies submitted whose ack the tree has not taken yet, per kind: node id -> count.
        self.outstanding: dict[str, Counter[int]] = {"write": Counter(), "load": Counter()}

    # ------------------------------------------------------------------ agreement across TP ranks
    def agree_min(self, value: int) -> int:
        """The minimum of ``value`` over the TP group (``value`` itself without one). Always issues
        the collective when a group is set, whatever ``value`` is."""
        return self._min_over_group([value])[0]

    def agree_all(self, values: list[int]) -> list[int]:
        """The minimum over the TP group of each of ``values`` (every rank passes as many), in ONE
        collective; ``values`` themselves without a group."""
        return self._min_over_group(values) if values else []

    def _min_over_group(self, values: list[int]) -> list[int]:
        """Every agreement's one collective: the element-wise MIN of ``values`` over the TP group (the
        values themselves without one)."""
        if self.tp_group is None:
            return [int(v) for v in values]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
        return t.tolist()

    # ------------------------------------------------------------------ completions
    def _landed(self, kind: str, q: deque) -> list[CopyAck]:
        """The acks of ``kind`` issued and not yet taken, in issue order (:meth:`_count_landed` says how
        many lead whose done events completed: a copy's ack is taken only after its work landed)."""
        seen = self._seen[kind]
        while q:  # popleft is atomic: an ack appended meanwhile is taken now or at the next check
            seen.append(q.popleft())
        return seen

    def _count_landed(self, seen: list[CopyAck]) -> int:
        n = 0
        for ack in seen:
            if ack.done is not None:
                try:
                    if not ack.done.query():
                        break
                except Exception as exc:  # an asynchronous copy error, reported by the stream
                    ack.error = ack.error or exc
            n += 1
        return n

    def _agree_landed(
        self, kinds: tuple[str, ...], counts: dict[str, int]
    ) -> tuple[dict[str, tuple[int, list[int]]], dict[str, int]]:
        """Per kind, how many leading acks landed on every rank and, for each, whether it failed on any
        rank; and the minimum over ranks of each of ``counts``: ONE collective for all of it (a MIN over
        ``[count, ok flags...]`` per kind, then the counts; a flag is 1 where the copy completed, so the
        MIN says whether every rank's did)."""
        seens = {kind: self._landed(kind, q) for kind, q in self._ack_queues(kinds)}
        local = {kind: self._count_landed(seen) for kind, seen in seens.items()}
        if self.tp_group is None:
            acks = {k: (n, [int(a.error is not None) for a in seens[k][:n]]) for k, n in local.items()}
            return acks, {name: int(c) for name, c in counts.items()}
        w = self.ACK_WINDOW
        values: list[int] = []
        for kind in kinds:
            n = min(local[kind], w)
            ok = [int(ack.error is None) for ack in seens[kind][:n]]
            values += [n, *ok, *[1] * (w - n)]  # 1 (neutral for MIN) beyond the acks this rank has
        values += [int(c) for c in counts.values()]
        v = self._min_over_group(values)
        out = {}
        for j, kind in enumerate(kinds):
            base = j * (w + 1)
            n = v[base]
            out[kind] = (n, [1 - x for x in v[base + 1 : base + 1 + n]])
        return out, dict(zip(counts, v[len(kinds) * (w + 1) :], strict=True))

    def _ack_queues(self, kinds: tuple[str, ...]) -> list[tuple[str, deque]]:
        for kind in kinds:
            if kind not in ("write", "load"):
                raise ValueError(f"kinds: expected 'write' and/or 'load', got {kind!r}")
        return [(k, self.write_acks if k == "write" else self.load_acks) for k in kinds]

    def finished(
        self, kinds: tuple[str, ...] = ("write", "load"), counts: dict[str, int] | None = None
    ) -> dict[str, Any]:
        """The copies of ``kinds`` that landed on every rank, per kind in submission order, agreed in ONE
        collective (with a TP group, at most :attr:`ACK_WINDOW` per kind and call): ``(node_id, None)`` for a completed
        copy, ``(node_id, error)`` for one that raised or was dropped (:class:`CopyDropped`), or that
        completed here but failed on another rank (:class:`CopyFailedOnPeer`: every rank rolls it back,
        so the trees stay alike). Backups' host slots are still WRITING: the caller marks them synced,
        or aborts them. Works after close too: the owner must still take the acks of drained and dropped
        copies.

        ``counts``: other per-step numbers to agree in the same collective (e.g. the storage tier's
        landed backups); their minimum over the ranks comes back under ``"counts"``."""
        extra = {} if counts is None else counts
        for name in extra:
            if name in ("write", "load", "counts"):
                raise ValueError(f"counts: {name!r} is a kind of copy, not a count name")
        agreed, agreed_counts = self._agree_landed(kinds, extra)
        result: dict[str, Any] = {"counts": agreed_counts}
        for kind in kinds:
            n, flags = agreed[kind]
            seen = self._seen[kind]
            acks = seen[:n]
            del seen[:n]
            out: list[tuple[int, BaseException | None]] = []
            outstanding = self.outstanding[kind]
            for ack, flag in zip(acks, flags, strict=True):
                error = ack.error
                if error is None and flag:
                    error = CopyFailedOnPeer(f"a {kind} failed on another TP rank; rolled back here too")
                self._account(ack)
                for node_id in ack.node_ids:
                    out.append((node_id, error))
                    outstanding[node_id] -= 1
                    if outstanding[node_id] <= 0:
                        del outstanding[node_id]
            result[kind] = out
        return result

    def _account(self, ack: CopyAck) -> None:
        """A landed copy: release its load batch, count its bytes and time."""
        if ack.kind == "load" and ack.error is None and ack.generation in self.layer_counter.in_flight:
            self.layer_counter.finish(ack.generation)  # landed: release its events
        if ack.error is not None or ack.done is None:
            return
        elapsed = self.device.elapsed_s(ack.start, ack.done)
        nbytes = ack.tokens * self.bytes_per_slot
        m = self.metrics
        if ack.kind == "write":
            m.tokens_written += ack.tokens
            m.bytes_written += nbytes
            m.write_time_s += elapsed
        else:
            m.tokens_loaded += ack.tokens
            m.bytes_loaded += nbytes
            m.load_time_s += elapsed

    def release_landed_loads(self) -> None:
        """Give the layer counter back the slots of load batches that have landed, before their acks
        are taken (a scheduler may start batches faster than it processes acks)."""
        seen = self._landed("load", self.load_acks)
        for ack in seen[: self._count_landed(seen)]:
            if ack.error is None and ack.generation in self.layer_counter.in_flight:
                self.layer_counter.finish(ack.generation)

    def wait_landed(self, kinds: tuple[str, ...] = ("write", "load")) -> None:
        """Block until every issued copy of ``kinds`` has landed (a copy's error stays on its ack)."""
        for kind, q in (("write", self.write_acks), ("load", self.load_acks)):
            if kind not in kinds:
                continue
            for ack in self._landed(kind, q):
                if ack.done is not None:
                    try:
                        ack.done.synchronize()
                    except Exception as exc:
                        ack.error = ack.error or exc
        self.release_landed_loads()
