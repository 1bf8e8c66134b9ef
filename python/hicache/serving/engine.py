"""Serving requests with :class:`~hicache.serving.model.TinyLM` over the cache: what the hierarchy buys, end to end.

:class:`Engine` serves requests over a :class:`~hicache.cache.radix_cache.HiRadixCache` (or, without one,
recomputes everything) with continuous batching (:meth:`Engine.serve`): each step admits arrived
requests while the device pool, ``max_running`` and the step's prefill budget allow; for each,
``match_prefix`` finds the device and host hits, a host hit is loaded back layer by layer while the
step's forward runs (layer ``k`` waits only for layer ``k``'s load, through the controller's layer
counter) and, with a storage tier, the pages beyond the host hit are prefetched from the store first
(the request waits for the prefetch policy to admit it). One forward then runs the new requests'
prefills and a decode token (greedy) of every running request; a request that has all its tokens is
inserted into the tree and leaves the batch; the device pool evicts to the host under pressure with
the cache's write policy.

With ``ModelConfig(exact=True)`` (see :mod:`hicache.serving.model`) the logits of a request served from any
tier, in any batch, equal those of a full recompute bit for bit on CPU float32.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..cache.radix_cache import HiRadixCache
from ..pools import DeviceKVPool
from ..pools.window_pool import WindowKVPool
from ..streams.devices import KVRegion
from .model import ModelConfig, TinyLM, index_pool, index_row, state_pool, state_row

__all__ = ["Engine", "FixedArrivals", "GenerationResult", "ModelConfig", "Request", "RequestSource", "TinyLM"]


@dataclass
class Request:
    """One request: greedy decoding of ``max_new_tokens`` tokens after ``prompt``.

    ``arrival`` is in seconds on the serving loop's clock (0: when :meth:`Engine.serve` starts); ``rid``
    is the caller's name for it (any object), handed back in its :class:`GenerationResult`.
    ``extra_key``: the request's cache namespace (a LoRA adapter, a tenant's cache salt; None: the
    shared one): its prefix matches only what requests of the same namespace cached, on every tier.
    """

    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    rid: Any = None
    extra_key: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {self.max_new_tokens!r}")
        if not self.prompt:
            raise ValueError("prompt: expected at least one token in each prompt")
        if not math.isfinite(self.arrival) or self.arrival < 0:
            raise ValueError(f"arrival: expected seconds >= 0, got {self.arrival!r}")


class RequestSource(Protocol):
    """Where :meth:`Engine.serve` gets its requests from, as they arrive.

    ``poll(now)`` returns the requests that have arrived by ``now`` (seconds on the loop's clock), each
    once; ``next_arrival()`` when the next known one arrives (None: none is known yet, e.g. a
    conversation's next turn waits for this one's answer); ``exhausted()`` whether no more will come;
    ``finished(result)`` is told each request's result as soon as it is done (a closed-loop client
    sends its next turn then).
    """

    def poll(self, now: float) -> list[Request]: ...

    def next_arrival(self) -> float | None: ...

    def exhausted(self) -> bool: ...

    def finished(self, result: GenerationResult) -> None: ...


class FixedArrivals:
    """A :class:`RequestSource` of requests known up front (open loop: arrivals do not depend on answers)."""

    def __init__(self, requests: list[Request]) -> None:
        self._pending = sorted(requests, key=lambda r: r.arrival)
        self._next = 0

    def poll(self, now: float) -> list[Request]:
        start = self._next
        while self._next < len(self._pending) and self._pending[self._next].arrival <= now:
            self._next += 1
        return self._pending[start : self._next]

    def next_arrival(self) -> float | None:
        return self._pending[self._next].arrival if self._next < len(self._pending) else None

    def exhausted(self) -> bool:
        return self._next == len(self._pending)

    def finished(self, result: GenerationResult) -> None:
        pass


@dataclass
class GenerationResult:
    """One request served: the generated tokens, their logits, its times and where its prefix came from.

    Times are seconds from the request's arrival (:meth:`Engine.generate_batch`: from the call).
    """

    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), vocab]: row i produced tokens[i]
    ttft_s: float  # arrival to the first token (waiting for admission included)
    total_s: float  # arrival to the last token
    rid: Any = None
    arrival_s: float = 0.0  # the request's arrival on the serving loop's clock
    queued_s: float = 0.0  # arrival to admission (waiting for the pool, for --max-running, for a prefetch)
    device_hit: int = 0  # prompt tokens found on the device
    host_hit: int = 0  # prompt tokens loaded back from the host
    computed: int = 0  # prompt tokens prefilled
    load_wait_s: float = 0.0  # time the forward of its prefill step waited for layer loads
    extra: dict = field(default_factory=dict)


class _Running:
    """A request admitted to the running batch: its slots, locks and output so far."""

    __slots__ = ("admitted", "device_hit", "fed", "first", "host_hit", "load_wait", "loaded_from", "locked", "out",
                 "prefix", "req", "rows", "slots", "state", "step_size", "trimmed")  # fmt: skip

    def __init__(self, req: Request, fed: int) -> None:
        self.req = req
        self.fed = fed  # tokens whose KV is written: the prompt and every new token but the last
        self.prefix = 0  # prompt tokens whose KV was cached (device hit + host hit)
        self.device_hit = self.host_hit = 0
        self.loaded_from = -1  # the node id its load-back was asked for (agree_load_backs may revoke it)
        self.locked: list = []
        self.slots: torch.Tensor | None = None
        self.out: list[int] = []
        self.rows: list[torch.Tensor] = []
        self.admitted = self.first = 0.0
        self.load_wait = 0.0
        self.step_size = 0
        self.state: torch.Tensor | None = None  # the recurrent state after its last fed token (None: none yet)
        self.trimmed = 0  # its own pages before this position have given back their window rows


def _cached_sidecar(cache: HiRadixCache, shape: tuple, need: str, maker: str) -> DeviceKVPool:
    """The cache's sidecar pool of ``shape`` (``(layers, heads, row elements, dtype)``; ``None`` layers:
    any), or ``ValueError`` saying the model ``need`` s one (made by ``maker``)."""
    for d, _ in cache.controller.sidecars:
        if (shape[0] in (None, d.num_layers)) and (d.head_num, d.head_dim, d.dtype) == shape[1:]:
            return d
    raise ValueError(f"cache: {need} in the cache (HiRadixCache(..., sidecars=[({maker}(...), HostKVPool(...))]))")


class Engine:
    """Serves requests with :class:`TinyLM` over ``cache`` (None: recompute every prompt).

    :meth:`serve` is the serving loop (continuous batching): each step admits arrived requests while
    the device pool, ``max_running`` and the step's prefill budget allow (matching each, loading its
    host hit back, prefetching from storage first when there is a tier), then runs ONE forward over
    the new requests' prefills and one decode token of every running request; a request that has all
    its tokens is inserted into the tree and leaves the batch at once. :meth:`generate` and
    :meth:`generate_batch` serve requests given now, through the same loop.

    Parameters
    ----------
    model : the :class:`TinyLM`.
    pool : its :class:`~hicache.pools.DeviceKVPool` (the cache's, when there is one).
    cache : the :class:`~hicache.cache.radix_cache.HiRadixCache`, or None.
    """

    def __init__(self, model: TinyLM, pool: DeviceKVPool, cache: HiRadixCache | None = None) -> None:
        if cache is not None and cache.device_pool is not pool:
            raise ValueError("cache: its device pool is not the engine's pool")
        c = model.cfg
        want = (True, 1, c.kv_lora) if c.mla else (False, model.kv_heads, c.head_dim)
        # Sliding-window layers live in the pool with the full ones, or (a pool of the full layers only,
        # TinyLM.pool(..., windowed=True)) in a window pool of their own: the cache's, or the engine's.
        self.windowed = bool(c.sliding_window) and pool.num_layers != sum(x >= 0 for x in c.layer_slots(False)[0])
        layers = sum(x >= 0 for x in c.layer_slots(self.windowed)[0])
        if (pool.mla, pool.head_num, pool.head_dim, pool.num_layers) != (*want, layers):
            raise ValueError("pool: not shaped for this model (see TinyLM.pool)")
        self.model = model
        self.pool = pool
        self.cache = cache
        self._requests = 0  # storage prefetch ids
        # A model with an indexer writes and reads its index keys in a sidecar pool beside the KV: the
        # cache's (which moves it with the KV on every tier), or the engine's own without a cache.
        self.index: DeviceKVPool | None = None
        if c.indexer_dim:
            if cache is None:
                self.index = index_pool(c, pool.size, pool.page_size, pool.device)
            else:
                self.index = _cached_sidecar(
                    cache, (None, 1, *index_row(c)), "the model's indexer needs a sidecar pool", "index_pool"
                )
        # A model with a recurrent branch checkpoints its state at every page boundary in a one-layer
        # sidecar pool (the cache's, which keeps a page's checkpoint with its KV on every tier).
        self.state: DeviceKVPool | None = None
        if c.recurrent_dim:
            if cache is None:
                self.state = state_pool(c, pool.size, pool.page_size, pool.device)
            else:
                self.state = _cached_sidecar(
                    cache,
                    (1, 1, *state_row(c, pool.page_size)),
                    "the model's recurrent branch needs its checkpoint pool",
                    "state_pool",
                )
        # The KV-pool layer each model layer's load must have landed for (the layer map, once).
        self._needed = [c.kv_layer_needed(li, self.windowed) for li in range(c.num_layers)]
        self.window: WindowKVPool | None = None
        if self.windowed:
            self.window = c.window_pool(pool, pool.size) if cache is None else cache.controller.window
            if self.window is None:
                raise ValueError("cache: the pool holds the full layers only; the windowed layers need the "
                                 "cache's window pool (HiRadixCache(..., window=...)))")  # fmt: skip
        elif cache is not None and cache.controller.window is not None:
            raise ValueError("pool: the cache has a window pool but the pool holds every layer (windowed=False)")

    # ------------------------------------------------------------------ one request in and out
    def _room(self, n: int, rows: int = 0) -> bool:
        """Make ``n`` device slots free, and window rows for ``rows`` tokens (a window pool), if eviction
        can (unlocked tree nodes: evicting a page frees its window rows too); whether they are."""
        free = self.pool.available_size()
        if free < n and self.cache is not None:
            self.cache.evict(n - free)
            free = self.pool.available_size()
        if free < n:
            return False
        if not rows or self.window is None:
            return True
        ps = self.pool.page_size
        want = -(-rows // ps)
        while self.window.available_pages() < want and self.cache is not None:
            if not self.cache.evict((want - self.window.available_pages()) * ps):
                break
        return self.window.available_pages() >= want

    def _admit(self, req: Request, budget: int | None) -> _Running | None:
        """Match ``req``'s prefix, lock it, load its host part back and give it every slot it will write;
        None (nothing held) when the device pool cannot make room for it now, or when it would prefill
        more than ``budget`` tokens (None: no limit)."""
        ps = self.pool.page_size
        run = _Running(req, len(req.prompt) + req.max_new_tokens - 1)  # the last new token is never fed back
        need = -(-run.fed // ps) * ps
        cache = self.cache
        if cache is None:
            if (budget is not None and len(req.prompt) > budget) or not self._room(need, need):
                return None
            run.slots = self.pool.alloc(need)
            if self.window is not None:
                self.window.alloc_for(run.slots)  # as large as the pool: never short
            return run
        # At most the prompt minus one token: the last one is always computed (its logits give the first
        # new token).
        m = cache.match_prefix(req.prompt[:-1], extra_key=req.extra_key)
        if budget is not None and len(req.prompt) - len(m.device_indices) - m.host_hit_length > budget:
            return None
        cache.inc_lock_ref(m.last_device_node)
        run.locked.append(m.last_device_node)
        try:
            prefix = m.device_indices
            # Room for everything past the device hit (a host hit loads into it, the rest is computed
            # into it), made before anything is loaded: a request that cannot fit changes nothing but
            # evictions.
            # Window rows: for its own pages from the last window - 1 + page_size - 1 prompt tokens on (the
            # forward writes only those of the prompt: TinyLM.forward_batch), and every new token's.
            rows_from = need
            if self.window is not None:
                tail = self.model.cfg.sliding_window - 1 + ps - 1
                rows_from = max(len(prefix), max(0, len(req.prompt) - tail) // ps * ps)
            # (and rows for the host hit's pages that carry theirs: the load-back takes them first)
            if not self._room(need - len(prefix), need - rows_from + cache.window_rows_to_load(m.last_host_node)):
                self._unwind([run])
                return None
            run.device_hit = len(prefix)
            if m.host_hit_length:
                cache.inc_lock_ref(m.last_host_node)
                run.locked.append(m.last_host_node)
                # Queued, started by the step's start_loading; decided here, agreed for the whole step.
                loaded = cache.load_back(m.last_host_node, agree="step")
                if loaded is not None:
                    prefix = torch.cat([prefix, loaded])
                    run.host_hit = len(loaded)
                    run.loaded_from = m.last_host_node.id
            run.prefix = len(prefix)
            rest = self.pool.alloc(need - run.prefix)
            if rest is None:  # cannot happen single-threaded (room was made above); never silently
                raise RuntimeError(f"device pool: {need - run.prefix} slots made free, then not allocatable")
            own_rows = rest[max(0, rows_from - run.prefix) :]
            if self.window is not None and not self.window.alloc_for(own_rows):  # the window rows it writes
                self.pool.free(rest)
                raise RuntimeError(f"window pool: rows for {len(own_rows)} slots made free, then not allocatable")
        except BaseException:  # an eviction or a load-back raised: the locks taken here go back
            self._unwind([run])
            raise
        run.slots = torch.cat([prefix, rest])
        return run

    def _release(self, run: _Running) -> None:
        """A finished request: its sequence goes into the tree (whole pages), the rest of its slots and
        its locks are released."""
        slots, ps = run.slots, self.pool.page_size
        if self.cache is None:
            self.pool.free(slots)
            return
        key_len = run.fed - run.fed % ps
        if self.window is not None:  # cached, its pages keep window rows only for its last window
            keep_from = max(0, key_len - self.model.cfg.sliding_window + 1) // ps * ps
            start = max(run.prefix, run.trimmed)
            if keep_from > start:
                self.window.trim(slots[start:keep_from])
        dup = self.cache.insert((run.req.prompt + run.out)[:key_len], slots[:key_len], extra_key=run.req.extra_key)
        if dup > run.prefix:  # another request cached part of ours meanwhile: our copies go
            if self.window is not None:  # their window rows go to the cached pages that have none
                self.cache.adopt_window_rows((run.req.prompt + run.out)[:dup], slots[:dup], extra_key=run.req.extra_key)
            self.pool.free(slots[run.prefix : dup])
        if key_len < len(slots):
            self.pool.free(slots[key_len:])
        for node in run.locked:
            self.cache.dec_lock_ref(node)

    def _unwind(self, runs: list[_Running]) -> None:
        """Give back what admitted requests hold (a failed step): slots not in the tree, and locks."""
        for run in runs:
            if run.slots is not None:
                self.pool.free(run.slots[run.prefix :])
            for node in run.locked:
                self.cache.dec_lock_ref(node)
            run.locked, run.slots = [], None

    # ------------------------------------------------------------------ the serving loop
    def serve(
        self,
        source: RequestSource | list[Request],
        *,
        max_running: int = 8,
        max_prefill_tokens: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        idle: Callable[[float], None] = time.sleep,
    ) -> list[GenerationResult]:
        """Serve every request of ``source`` (a :class:`RequestSource`, or a list of :class:`Request`
        arriving at their ``arrival`` times) with continuous batching; results in finishing order.

        Parameters
        ----------
        max_running : the most requests in the running batch at once.
        max_prefill_tokens : the most prompt tokens prefilled in one step (None: no limit); a request
            larger than it is still admitted, alone, into a step with no other prefill.
        clock, idle : the loop's time (seconds) and how it waits for the next arrival (``idle(s)``).

        Requests wait, first come first served, while the device pool cannot hold their slots (a
        request whose storage prefetch is still running lets later ones pass). Raises
        :class:`MemoryError` (after giving back what it holds) when a request cannot fit even with
        nothing else running.
        """
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            raise ValueError(f"max_running: expected an int >= 1, got {max_running!r}")
        if max_prefill_tokens is not None and (
            isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1
        ):
            raise ValueError(f"max_prefill_tokens: expected None or an int >= 1, got {max_prefill_tokens!r}")
        if isinstance(source, list):
            source = FixedArrivals(source)
        cache = self.cache
        storage = cache is not None and cache.storage is not None
        t0 = clock()
        waiting: list[Request] = []
        prefetching: dict[int, Request] = {}  # prefetch id -> request, while its pages come from the store
        running: list[_Running] = []
        results: list[GenerationResult] = []
        try:
            while True:
                now = clock() - t0
                for req in source.poll(now):
                    if storage and self._start_prefetch(req, prefetching):
                        continue
                    waiting.append(req)
                for pid in cache.check_prefetches(list(prefetching)) if prefetching else ():  # one agreement
                    waiting.append(prefetching.pop(pid))
                    waiting.sort(key=lambda r: r.arrival)
                new = self._admit_some(waiting, running, max_running, max_prefill_tokens, now)
                if not new and not running:
                    if waiting:  # nothing runs and the head does not fit: let every copy land, try again
                        if cache is not None:
                            cache.flush()
                        new = self._admit_some(waiting, running, max_running, max_prefill_tokens, now)
                        if not new and prefetching:  # their locks may be what keeps the room: wait for them
                            idle(0.0002)
                            continue
                        if not new:
                            req = waiting[0]
                            raise MemoryError(
                                f"device pool: request {req.rid!r} needs {len(req.prompt) + req.max_new_tokens - 1}"
                                f" slots; {self.pool.available_size()} of {self.pool.size} free with nothing running"
                            )
                    elif prefetching:
                        idle(0.0002)
                        continue
                    elif source.exhausted():
                        break
                    else:
                        nxt = source.next_arrival()
                        if nxt is None:
                            raise RuntimeError("source: nothing running or waiting, not exhausted, and no next arrival")
                        idle(max(0.0, nxt - (clock() - t0)))
                        continue
                self._step(new, running, clock, t0)
                running += new
                if self.window is not None:
                    self._trim_windows(running)
                for run in [r for r in running if len(r.out) == r.req.max_new_tokens]:
                    running.remove(run)
                    self._release(run)
                    res = self._result(run, clock() - t0)
                    results.append(res)
                    source.finished(res)
                if cache is not None:
                    cache.check_acks()  # the step's landed copies: one agreement across TP ranks
        except BaseException:
            if cache is None or not cache.closed:
                self._unwind(running)
            raise
        return results

    def _start_prefetch(self, req: Request, prefetching: dict[int, Request]) -> bool:
        """Start fetching ``req``'s pages beyond its host hit from the store; whether it must wait."""
        cache = self.cache
        self._requests += 1
        m = cache.match_prefix(req.prompt[:-1], extra_key=req.extra_key)
        if cache.prefetch_from_storage(self._requests, m.last_host_node, req.prompt[:-1], extra_key=req.extra_key):
            prefetching[self._requests] = req
            return True
        return False

    def _admit_some(
        self, waiting: list[Request], running: list[_Running], max_running: int, budget: int | None, now: float
    ) -> list[_Running]:
        """Admit waiting requests in order while they fit (stops at the first that does not)."""
        new: list[_Running] = []
        prefill = 0
        try:
            while waiting and len(running) + len(new) < max_running:
                req = waiting[0]
                # The budget binds from the second request of a step on: a larger one still goes in alone.
                run = self._admit(req, None if budget is None or not new else budget - prefill)
                if run is None:
                    break
                waiting.pop(0)
                run.admitted = now
                prefill += len(req.prompt) - run.prefix
                new.append(run)
            if self.cache is not None:
                new = self._settle_load_backs(new, waiting)
        except BaseException:  # a later admission raised: the requests admitted before it give back theirs
            self._unwind(new)
            raise
        return new

    def _settle_load_backs(self, new: list[_Running], waiting: list[Request]) -> list[_Running]:
        """The step's load-backs agreed across TP ranks in one collective: a request whose load-back was
        revoked (it did not go on another rank) gives back what it holds and waits again, at the front."""
        revoked = set(self.cache.agree_load_backs())
        if not revoked:
            return new
        back = [r for r in new if r.loaded_from in revoked]
        self._unwind(back)
        waiting[:0] = [r.req for r in back]
        return [r for r in new if r.loaded_from not in revoked]

    def _step(self, new: list[_Running], running: list[_Running], clock: Callable[[], float], t0: float) -> None:
        """One forward: the new requests' prefills and one decode token of each running request."""
        cache = self.cache
        wait = None
        waited = [0.0]
        seqs = [(r.req.prompt[r.prefix :], r.prefix, r.slots) for r in new]
        seqs += [([r.out[-1]], len(r.req.prompt) + len(r.out) - 1, r.slots) for r in running]
        states = [r.state for r in new + running]
        device = None
        write_kv = None
        try:
            if cache is not None:
                device = cache.controller.device
                generation = cache.start_loading() if any(r.host_hit for r in new) else 0
                counter = cache.controller.layer_counter
                # The KV this step's forward reads (every sequence's slots before its new tokens), for a
                # device that checks reads against copies still in flight (the deferred model).
                cfg = self.model.cfg
                regions = self._read_regions(seqs) if device.tracks_regions else [[] for _ in range(cfg.num_layers)]
                needed = self._needed

                def wait_and_check(layer: int) -> None:  # the model's layer
                    if generation:
                        w0 = time.perf_counter()
                        counter.wait_until(needed[layer], generation=generation)
                        waited[0] += time.perf_counter() - w0
                    if regions[layer]:
                        device.check_read(regions[layer], f"the forward reading layer {layer}")

                if generation or any(regions):
                    wait = wait_and_check
                if device.tracks_regions:  # the forward's K/V writes are work on the current stream
                    current = device.current_stream()

                    def write_kv(layer: int, slots: torch.Tensor, write: Callable[[], None], pool=None) -> None:
                        region = KVRegion(pool if pool is not None else self.pool, slots, (layer,))
                        device.launch(current, lambda _: write(), writes=[region],
                                      what=f"the forward writing layer {layer}")  # fmt: skip

            logits = self.model.forward_batch(self.pool, seqs, wait, last_only=True, write_kv=write_kv,
                                              index=self.index, state=self.state, states=states,
                                              window=self.window)  # fmt: skip
        except BaseException:  # a load that could not start, a failed wait or forward: give back what new hold
            if device is not None:  # but first let the layers already issued finish writing into those slots
                device.current_stream().synchronize()
            self._unwind(new)
            raise
        rows = torch.cat(logits)
        tokens = rows.argmax(-1).tolist()  # waits for the forward (on a GPU): the step's end is now
        done = clock() - t0
        for r, row, tok, st in zip(new + running, rows, tokens, states, strict=True):
            r.rows.append(row)
            r.out.append(tok)
            r.state = st
        for r in new:
            r.first, r.load_wait, r.step_size = done, waited[0], len(new)

    def _trim_windows(self, running: list[_Running]) -> None:
        """Window rows no query of a running request will read again go back: those of the pages it
        computed itself (nobody else holds them) that its next token's window has moved past."""
        ps, w = self.pool.page_size, self.model.cfg.sliding_window
        for r in running:
            nxt = len(r.req.prompt) + len(r.out) - 1  # the position of the next token it feeds
            # Kept: its next token's window, and the window before the page boundary it would be cached
            # up to if it finished now (the boundary only moves on).
            keep_from = max(0, nxt - nxt % ps - w + 1) // ps * ps
            if keep_from > max(r.prefix, r.trimmed):
                self.window.trim(r.slots[max(r.prefix, r.trimmed) : keep_from])
                r.trimmed = keep_from

    def _read_regions(self, seqs: list) -> list[list[KVRegion]]:
        """Per model layer, what the step's forward reads of cached KV (the prefixes before each
        sequence's new tokens), for a device that checks reads against copies still in flight."""
        cfg = self.model.cfg
        read = [slots[:start] for _, start, slots in seqs if start]
        if not read:
            return [[] for _ in range(cfg.num_layers)]
        read_all = torch.cat(read)
        full_ix, win_ix = cfg.layer_slots(self.windowed)
        out = []
        for li in range(cfg.num_layers):
            if not cfg.attends(li):  # a recurrent layer reads only the checkpoints new requests resume from
                out.append([KVRegion(self.state, read_all, (0,))])
                continue
            if win_ix[li] >= 0:  # only the window before each sequence's new tokens
                w = cfg.sliding_window
                near = [slots[max(0, start - w + 1) : start] for _, start, slots in seqs if start]
                out.append([KVRegion(self.window.pool, self.window.slots(torch.cat(near)), (win_ix[li],))])
                continue
            layer = [KVRegion(self.pool, read_all, (full_ix[li],))]
            if self.index is not None:
                layer.append(KVRegion(self.index, read_all, (li,)))
            if self.state is not None and li == cfg.recurrent_layer:  # the checkpoints new requests resume from
                layer.append(KVRegion(self.state, read_all, (0,)))
            out.append(layer)
        return out

    def _result(self, run: _Running, now: float) -> GenerationResult:
        arrival = run.req.arrival
        return GenerationResult(
            tokens=run.out,
            logits=torch.stack(run.rows),
            ttft_s=run.first - arrival,
            total_s=now - arrival,
            rid=run.req.rid,
            arrival_s=arrival,
            queued_s=run.admitted - arrival,
            device_hit=run.device_hit,
            host_hit=run.host_hit,
            computed=len(run.req.prompt) - run.prefix,
            load_wait_s=run.load_wait,
            extra={"batch": run.step_size},
        )

    # ------------------------------------------------------------------ requests given now
    def generate(self, prompt: list[int], max_new_tokens: int) -> GenerationResult:
        """Serve one request: greedy decoding of ``max_new_tokens`` tokens after ``prompt``."""
        return self.generate_batch([prompt], max_new_tokens)[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[GenerationResult]:
        """Serve several requests together (all admitted at once when the pool holds them: one load-back
        batch, one prefill, a decode step each; each is matched before any is inserted, so they share
        nothing they compute). Results in the order of ``prompts``; times from the call."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens!r}")
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompt: expected at least one token in each prompt")
        reqs = [Request(list(p), max_new_tokens, 0.0, i) for i, p in enumerate(prompts)]
        out = self.serve(reqs, max_running=len(reqs))
        return sorted(out, key=lambda r: r.rid)
