"""The serving benchmark's workloads (:mod:`hicache.bench.serving`) and the clients that send them.

A workload is a list of :class:`Turn` and a ``prompt_of(turn, answers)`` that builds a turn's prompt when
it is sent (a multi-turn prompt holds the answers to the client's earlier turns). Both are drawn from
one :class:`random.Random`, so a seed gives the same stream every time.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import random
from typing import Any

from .engine import GenerationResult, Request


@dataclasses.dataclass
class Turn:
    """One request of the workload: ``client``'s ``round``-th turn, scheduled at ``at`` seconds."""

    at: float
    round: int
    client: int
    prompt: list[int] | None  # None: built when sent (multi-turn prompts include earlier answers)
    new_tokens: int
    tenant: int | None = None  # multitenant: the client's tenant, whose cache salt its requests carry

    @property
    def extra_key(self) -> str | None:
        """The request's cache namespace: its tenant's salt (None: the shared namespace)."""
        return None if self.tenant is None else f"tenant-{self.tenant}"


def multiturn(args: argparse.Namespace, r: random.Random) -> tuple[list[Turn], Any]:
    """Turns and a ``prompt_of(turn, answers)`` that builds a round's prompt from the history."""
    system = [r.randrange(args.vocab) for _ in range(args.system_len)]
    questions = {(c, k): [r.randrange(args.vocab) for _ in range(args.turn_len)]
                 for c in range(args.clients) for k in range(args.rounds)}  # fmt: skip
    turns, t = [], 0.0
    for k in range(args.rounds):
        order = list(range(args.clients))
        r.shuffle(order)
        for c in order:
            t += r.expovariate(args.rate) if args.rate > 0 else 0.0
            turns.append(Turn(t, k, c, None, args.output_len))

    def prompt_of(turn: Turn, answers: dict) -> list[int]:
        out = list(system)
        for k in range(turn.round + 1):
            out += questions[(turn.client, k)]
            if k < turn.round:
                out += answers[(turn.client, k)]
        return out

    return turns, prompt_of


def multitenant(args: argparse.Namespace, r: random.Random) -> tuple[list[Turn], Any]:
    """:func:`multiturn` with the clients spread over ``args.tenants`` tenants (client ``c`` is tenant
    ``c % tenants``'s), every request carrying its tenant's cache salt (``Turn.extra_key``). The tenants
    send the same system prompt, yet each caches its own copy: no tenant's prefix matches another's."""
    turns, prompt_of = multiturn(args, r)
    for t in turns:
        t.tenant = t.client % args.tenants
    return turns, prompt_of


def longqa(args: argparse.Namespace, r: random.Random) -> tuple[list[Turn], Any]:
    """``args.questions`` questions over ``args.docs`` documents of ``args.doc_len`` tokens, interleaved:
    the documents are asked about in passes, each pass in a fresh shuffled order, never one document
    twice in a row. A turn's ``client`` is the question's place in the stream, its ``round`` how many
    questions on its document came before it; its prompt is the document, then the question."""
    docs = [[r.randrange(args.vocab) for _ in range(args.doc_len)] for _ in range(args.docs)]
    order: list[int] = []
    while len(order) < args.questions:
        one_pass = list(range(args.docs))
        r.shuffle(one_pass)
        if order and one_pass[0] == order[-1] and args.docs > 1:
            one_pass[0], one_pass[-1] = one_pass[-1], one_pass[0]
        order += one_pass
    asked = [0] * args.docs
    turns, t = [], 0.0
    for i, d in enumerate(order[: args.questions]):
        t += r.expovariate(args.rate) if args.rate > 0 else 0.0
        question = [r.randrange(args.vocab) for _ in range(args.turn_len)]
        turns.append(Turn(t, asked[d], i, docs[d] + question, args.output_len))
        asked[d] += 1
    return turns, lambda turn, answers: turn.prompt


class Clients:
    """The workload as a :class:`~hicache.serving.engine.RequestSource`, sent the way a multi-turn benchmark
    client sends it: each client sends its turns in order, a turn at its scheduled time or, if later,
    as soon as the client has the answer to its previous turn (closed loop: a conversation's next
    prompt contains that answer), and never more than ``max_parallel`` requests are in flight (a turn
    waits on the client side for one to finish). A request's arrival is when it is sent."""

    def __init__(self, turns: list[Turn], prompt_of, max_parallel: int) -> None:
        self.prompt_of = prompt_of
        self.answers: dict[tuple[int, int], list[int]] = {}
        self._later: dict[int, list[Turn]] = {}  # per client, its turns not yet ready, in order
        for t in sorted(turns, key=lambda t: (t.client, t.round)):
            self._later.setdefault(t.client, []).append(t)
        self._ready: list[tuple[float, Turn]] = [(q[0].at, q.pop(0)) for q in self._later.values()]
        self._free = [0.0] * max_parallel  # when each free in-flight place became free (a heap)
        self._left = len(turns)

    def poll(self, now: float) -> list[Request]:
        out = []
        self._ready.sort(key=lambda x: (x[0], x[1].client))
        while self._free and self._ready and self._ready[0][0] <= now:
            ready, turn = self._ready.pop(0)
            at = max(ready, heapq.heappop(self._free))
            prompt = self.prompt_of(turn, self.answers)
            out.append(Request(prompt, turn.new_tokens, at, (turn.client, turn.round), extra_key=turn.extra_key))
        self._left -= len(out)
        return out

    def next_arrival(self) -> float | None:
        if not self._free:
            return None  # the next one is sent when a request in flight finishes
        return min((at for at, _ in self._ready), default=None)

    def exhausted(self) -> bool:
        return self._left == 0

    def finished(self, result: GenerationResult) -> None:
        done = result.arrival_s + result.total_s
        heapq.heappush(self._free, done)
        self.answers[result.rid] = result.tokens
        later = self._later.get(result.rid[0])
        if later:
            turn = later.pop(0)
            self._ready.append((max(turn.at, done), turn))


def longest_per_client(turns: list[Turn], prompt_of, output_len: int) -> dict[int, int]:
    """Each client's longest request in tokens (prompt and answer), answers standing in as zeros."""
    answers = {(q.client, q.round): [0] * output_len for q in turns}
    longest: dict[int, int] = {}
    for q in turns:
        longest[q.client] = max(longest.get(q.client, 0), len(prompt_of(q, answers)) + output_len)
    return longest
