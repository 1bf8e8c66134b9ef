"""The randomized driver of the cache tests: a tiny HiRadixCache + HiCacheController on CPU pools
(:func:`build`), the operations a :class:`Driver` applies at random (requests, locks, evictions,
load-backs, acks, flushes, storage, misuse) and the checks it makes after every step (the tree's own
invariants, exact lock counts, the host slot state machine, slot accounting, the KV bytes of
device-resident nodes). Used by the cache stress tests and by the tree-core, candidate, controller and
TP tests, which drive the same operations."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from hicache import DeviceKVPool, HiRadixCache, HostKVPool, SlotState
from hicache.cache.radix_cache import TreeNode
from hicache.pools.window_pool import WindowKVPool
from hicache.storage import FileBackend, StorageBackend
from hicache.storage.tier import PrefetchPolicy
from hicache.streams import KVRegion

from cachedata import check_kv, fingerprint, host_reads, kv_index, launch_on_current, queued_device, slot_key

L, H, D = 2, 1, 4
VOCAB = 3  # few token ids: sequences share prefixes often
POLICIES = ("write_through", "write_through_selective", "write_back")


def build(
    *,
    device_slots: int = 48,
    host_ratio: float = 2.5,
    page_size: int = 1,
    write_policy: str = "write_through",
    eviction_policy: str = "lru",
    threaded: bool = False,
    load_back_threshold: int = 1,
    layout: str = "page_first",
    tp_group=None,
    storage=None,
    prefetch_threshold: int = 1,
    sidecar: bool = False,
    window: bool = False,
) -> HiRadixCache:
    dev = DeviceKVPool(
        num_slots=device_slots, num_layers=L, head_num=H, head_dim=D, dtype=torch.float32, device="cpu",
        page_size=page_size,
    )  # fmt: skip
    host = HostKVPool(dev, layout=layout, ratio=host_ratio)
    extra: dict = {}
    if sidecar:  # a pool group: an indexer-style sidecar (SIDE elements a token and layer) and a one-layer
        # state-style one (STATE elements a token: a recurrent layer's checkpoints), both sharing the KV's slots
        side = DeviceKVPool(num_slots=device_slots, num_layers=L, head_num=1, head_dim=SIDE, dtype=torch.float32,
                            device="cpu", page_size=page_size, mla=True)  # fmt: skip
        state = DeviceKVPool(num_slots=device_slots, num_layers=1, head_num=1, head_dim=STATE, dtype=torch.float32,
                             device="cpu", page_size=page_size, mla=True)  # fmt: skip
        extra["sidecars"] = [(p, HostKVPool(p, layout="page_first", ratio=host_ratio)) for p in (side, state)]
    if window:  # a sliding-window layer's rows (one layer, half the KV slots) beside the KV
        rows = max(page_size, device_slots // 2 // page_size * page_size)
        extra["window"] = WindowKVPool(dev, num_slots=rows, num_layers=1, window=2 * page_size + 1)
    if storage is not None:  # a StorageBackend, or a directory for a FileBackend
        backend = storage if isinstance(storage, StorageBackend) else FileBackend(storage)
        policy = PrefetchPolicy("wait_complete", threshold_tokens=prefetch_threshold, batch_pages=2)
        extra.update(storage=backend, model_id="stress", prefetch_policy=policy)
    return HiRadixCache(
        dev, host, io_backend="direct", write_policy=write_policy, eviction_policy=eviction_policy,
        threaded=threaded, load_back_threshold=load_back_threshold, tp_group=tp_group, **extra,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# KV data: vectorized twins of cachedata.kv_value / write_kv / check_kv
# ---------------------------------------------------------------------------------------------------

# cachedata.kv_index for every (K/V, layer), the first H heads: [2, L, H, D]
_LOW = torch.stack([torch.stack([kv_index(layer, kv)[:H] for layer in range(L)]) for kv in (0, 1)])


def expected_kv(tokens: list[int] | tuple[int, ...], positions: torch.Tensor) -> torch.Tensor:
    """``[2 (k/v), L, n, H, D]``: cachedata.kv_value(token, position, layer, kv) for every token."""
    key = slot_key(torch.tensor(tokens, dtype=torch.int64), positions.to(torch.int64))
    return fingerprint(key[None, None, :, None, None], _LOW[:, :, None])


SIDE = 3  # a sidecar row: 3 float32 a token and layer (another size than the KV's H x D)
STATE = 2  # the one-layer sidecar's row: 2 float32 a token


def expected_side(e: torch.Tensor) -> list[torch.Tensor]:
    """The sidecar rows of tokens whose KV is ``e`` (:func:`expected_kv`), one tensor per sidecar pool:
    ``[L, n, 1, SIDE]`` derived from the K (negated, its first SIDE elements), and ``[1, n, 1, STATE]``
    from the V's first layer (its last STATE elements, halved): distinct per token and position like the KV."""
    return [-e[0].flatten(2)[..., :SIDE].unsqueeze(2), e[1][:1].flatten(2)[..., -STATE:].unsqueeze(2) / 2]


def _sides(cache: HiRadixCache) -> list:
    return [d for d, _ in cache.controller.sidecars]


def expected_window(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A window row's K and V for tokens whose KV is ``e``: ``[n, H, D]`` each, from the V's first layer
    (K) and the K's second (V, negated): distinct per token and position like the KV."""
    return e[1][0], -e[0][-1]


def write_kv(cache: HiRadixCache, tokens: list[int], slots: torch.Tensor, start: int) -> None:
    """What a forward pass would write for ``tokens`` at positions ``start...`` into ``slots`` (queued on
    the current stream under a deferred device model: cachedata.launch_on_current), sidecar rows too,
    and with a window pool the window rows of the pages a later resume can read (as the engine gives
    them: its last window - 1 + page_size - 1 tokens' pages; none where the window pool is full)."""
    if len(slots):
        e = expected_kv(tokens, torch.arange(start, start + len(tokens)))
        sides = _sides(cache)
        window = cache.controller.window
        at = None
        if window is not None:
            ps = cache.page_size
            tail = max(0, len(slots) - (window.window - 1) - (ps - 1)) // ps * ps
            if window.alloc_for(slots[tail:]):
                keep = torch.from_numpy(np.repeat(window.has_rows(slots), ps))
                at, wk, wv = window.slots(slots[keep]), *(x[keep] for x in expected_window(e))

        def write() -> None:
            cache.device_pool.k[:, slots] = e[0]
            cache.device_pool.v[:, slots] = e[1]
            for side, rows in zip(sides, expected_side(e) if sides else (), strict=True):
                side.kv[:, slots] = rows
            if at is not None:
                window.pool.k[0][at], window.pool.v[0][at] = wk, wv

        device = queued_device(cache)
        if device is None or at is None:
            launch_on_current(cache, slots, write, "the driver's forward writing KV")
        else:
            device.launch(device.current_stream(), lambda _: write(), what="the driver's forward writing KV",
                          writes=[KVRegion(cache.device_pool, slots), KVRegion(window.pool, at)])  # fmt: skip


def device_kv_ok(cache: HiRadixCache, tokens: list[int], slots: torch.Tensor, positions: torch.Tensor) -> bool:
    host_reads(cache)
    e = expected_kv(tokens, positions)
    sides = _sides(cache)
    for side, rows in zip(sides, expected_side(e) if sides else (), strict=True):
        if not torch.equal(side.kv[:, slots], rows):
            return False
    window = cache.controller.window
    if window is not None:  # the window rows of the pages that have them
        keep = torch.from_numpy(np.repeat(window.has_rows(slots), cache.page_size))
        at, (wk, wv) = window.slots(slots[keep]), expected_window(e)
        if not (torch.equal(window.pool.k[0][at], wk[keep]) and torch.equal(window.pool.v[0][at], wv[keep])):
            return False
    return torch.equal(cache.device_pool.k[:, slots], e[0]) and torch.equal(cache.device_pool.v[:, slots], e[1])


def tree_nodes(cache: HiRadixCache) -> list[tuple[TreeNode, int]]:
    """Every non-root node with the position of its first token, parents before children."""
    out: list[tuple[TreeNode, int]] = []
    stack = [(c, 0) for c in cache.root.children.values()]
    while stack:
        node, start = stack.pop()
        out.append((node, start))
        stack.extend((c, start + len(node.key)) for c in node.children.values())
    return out


def attached(cache: HiRadixCache, node: TreeNode) -> bool:
    """``node`` is still in the tree (not deleted)."""
    while node is not cache.root:
        parent = node.parent
        if parent is None or parent.children.get(node.key[: cache.page_size]) is not node:
            return False
        node = parent
    return True


def check_device_kv(cache: HiRadixCache) -> int:
    """KV bytes of every device-resident node whose device copy is complete (no load-back into it in
    flight: such nodes' host slots are LOADING until the ack is processed) and not lost (a load-back
    dropped or failed while others held the node: it keeps its slots until the last unlock but never
    matches). Returns slots checked."""
    states = cache.host_pool.state().numpy()
    toks: list[int] = []
    slots, positions = [], []
    for node, start in tree_nodes(cache):
        if node.value is None or node.id in cache.tree.lost:
            continue
        if node.host_value is not None and (states[node.host_value.numpy()] == SlotState.LOADING).any():
            continue
        toks.extend(node.key)
        slots.append(node.value)
        positions.append(torch.arange(start, start + len(node.key)))
    if not slots:
        return 0
    s, p = torch.cat(slots), torch.cat(positions)
    if not device_kv_ok(cache, toks, s, p):
        e = expected_kv(toks, p)
        bad = ~((cache.device_pool.k[:, s] == e[0]).flatten(2).all(-1).all(0))
        if not bad.any():
            raise AssertionError("sidecar or window rows differ from what was written (the KV is right)")
        raise AssertionError(f"device KV differs from what was written at slots {s[bad][:8].tolist()}")
    return len(s)


# ---------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------

OPS = (
    "prefill",  # match, allocate (evicting if short), write KV, insert: a whole request at once
    "request",  # match + lock + allocate + write KV; the slots stay the driver's until "finish"
    "finish",  # insert a pending request, free its duplicated slots, unlock its prefix
    "match",  # match_prefix (+ check the KV of the matched device prefix)
    "lock",  # inc_lock_ref on the last device or last host node of a match
    "unlock",  # dec_lock_ref of a lock still held
    "evict",
    "evict_host",
    "load_back",  # match + load_back(last_host_node, quota) (+ start_loading half the time)
    "start_loading",
    "check_writes",
    "check_loads",
    "flush",
)
WEIGHTS = (14, 6, 6, 10, 5, 5, 6, 4, 10, 4, 10, 8, 2)
MISUSE_OPS = (
    "bad_insert",  # insert with bad slots (float, out of range, unallocated, repeated, the tree's, ...)
    "host_evict_race",  # match a host-only prefix, host-evict (maybe it), then load_back the matched node
    "close",  # close (drain or drop) with copies in flight, misuse the closed cache, start a new one
)
MISUSE_WEIGHTS = (2, 2, 0.1)  # modest: normal operation stays the bulk of every run
ALL_OPS = OPS + MISUSE_OPS
ALL_WEIGHTS = WEIGHTS + MISUSE_WEIGHTS
STORAGE_OPS = (
    "prefetch",  # match, then prefetch the stored pages beyond the host hit
    "check_prefetch",  # a prefetch's I/O done: check_prefetch_progress inserts what landed
    "check_storage",  # process finished storage backups
)
STORAGE_WEIGHTS = (6, 6, 4)


@dataclass
class Request:
    tokens: list[int]
    hit: int  # device-prefix tokens matched when allocated
    prefix: torch.Tensor  # their device slots (locked through `node`)
    node: TreeNode  # last_device_node of the match, locked
    slots: torch.Tensor  # the driver's slots for tokens[hit:]


@dataclass
class Driver:
    cache: HiRadixCache
    seed: int = 0
    check_kv_every: int = 1
    max_pages: int = 6
    held: list[TreeNode] = field(default_factory=list)
    pending: list[Request] = field(default_factory=list)
    steps: int = 0
    counts: Counter = field(default_factory=Counter)
    factory: Callable[[], HiRadixCache] | None = None  # builds the next cache after "close" (else no close)
    retired: Counter = field(default_factory=Counter)  # metrics of the caches closed by "close"
    prefetching: list = field(default_factory=list)  # request ids with a prefetch in flight
    next_rid: int = 0

    def __post_init__(self) -> None:
        r = random.Random(self.seed)
        ps = self.cache.page_size
        self.bases = [[r.randrange(VOCAB) for _ in range(self.max_pages * ps)] for _ in range(5)]
        self.dev, self.host = self.cache.device_pool, self.cache.host_pool
        assert self.max_pages * ps * 2 <= self.dev.size  # two requests always fit an empty pool

    # -------------------------------------------------------------- helpers
    def tokens(self, r: random.Random) -> list[int]:
        ps = self.cache.page_size
        base = self.bases[r.randrange(len(self.bases))]
        cut = ps * r.randint(1, self.max_pages)
        toks = base[:cut]
        if r.random() < 0.3:  # diverge after a shared prefix
            keep = ps * r.randint(0, self.max_pages - 1)
            toks = toks[:keep] + [r.randrange(VOCAB) for _ in range(ps * r.randint(1, self.max_pages - keep // ps))]
        return toks

    def host_tokens(self, r: random.Random) -> list[int] | None:
        """Tokens ending inside a random host-only node (so a match splits it, half the time), or None."""
        nodes = [(n, start) for n, start in tree_nodes(self.cache) if n.value is None]
        if not nodes:
            return None
        node, start = nodes[r.randrange(len(nodes))]
        toks: list[int] = []
        x = node
        while x is not self.cache.root:
            toks[:0] = x.key
            x = x.parent
        ps = self.cache.page_size
        return toks[: start + ps * r.randint(1, len(node.key) // ps)]

    def alloc(self, need: int) -> torch.Tensor | None:
        slots = self.dev.alloc(need)
        if slots is None:
            self.cache.evict(need - self.dev.available_size())
            slots = self.dev.alloc(need)
        return slots

    def external(self) -> torch.Tensor | None:
        return torch.cat([q.slots for q in self.pending]) if self.pending else None

    # -------------------------------------------------------------- one step
    def step(self, op: str, r: random.Random) -> None:
        if self.cache.storage is not None:
            # Storage backups run on their own thread: let the queued ones finish first, so which acks
            # a step sees does not depend on thread timing (runs are reproducible, seed for seed).
            self.cache.storage.wait_backups()
        getattr(self, "op_" + op)(r)
        self.steps += 1
        self.counts[op] += 1
        self.check()

    def op_prefill(self, r: random.Random) -> None:
        c = self.cache
        toks = self.tokens(r)
        m = c.match_prefix(toks)
        hit = len(m.device_indices)
        c.inc_lock_ref(m.last_device_node)
        slots = self.alloc(len(toks) - hit)
        c.dec_lock_ref(m.last_device_node)
        if slots is None:
            self.counts["device_full"] += 1
            return
        write_kv(c, toks[hit:], slots, hit)
        full = torch.cat([m.device_indices, slots])
        dup = c.insert(toks, full, priority=r.randrange(3))
        assert dup >= hit, (dup, hit)
        if dup > hit:
            c.adopt_window_rows(toks[:dup], full[:dup])
            self.dev.free(full[hit:dup])

    def op_request(self, r: random.Random) -> None:
        c = self.cache
        toks = self.tokens(r)
        m = c.match_prefix(toks)
        hit = len(m.device_indices)
        c.inc_lock_ref(m.last_device_node)
        slots = self.alloc(len(toks) - hit)
        if slots is None:
            c.dec_lock_ref(m.last_device_node)
            self.counts["device_full"] += 1
            return
        write_kv(c, toks[hit:], slots, hit)
        self.pending.append(Request(toks, hit, m.device_indices, m.last_device_node, slots))

    def finish(self, q: Request, priority: int = 0) -> None:
        c = self.cache
        full = torch.cat([q.prefix, q.slots])
        dup = c.insert(q.tokens, full, priority=priority)
        assert dup >= q.hit, (dup, q.hit)
        if dup > q.hit:
            c.adopt_window_rows(q.tokens[:dup], full[:dup])
            self.dev.free(full[q.hit : dup])
        c.dec_lock_ref(q.node)

    def op_finish(self, r: random.Random) -> None:
        if self.pending:
            self.finish(self.pending.pop(r.randrange(len(self.pending))), r.randrange(3))

    def op_match(self, r: random.Random) -> None:
        toks = self.tokens(r)
        m = self.cache.match_prefix(toks)
        n = len(m.device_indices)
        assert n % self.cache.page_size == 0 and n + m.host_hit_length <= len(toks)
        window = self.cache.controller.window
        if window is not None and n and not m.host_hit_length:  # a usable match's window is whole
            ps = self.cache.page_size
            need = min(n, -(-(window.window - 1) // ps) * ps)
            assert window.has_rows(m.device_indices[n - need :]).all(), "a match resumes where its window is gone"
        if n and self.steps % self.check_kv_every == 0 and not self.loading(m.last_device_node):
            check_kv(self.cache, toks[:n], m.device_indices)

    def loading(self, node: TreeNode) -> bool:
        """A load-back into ``node`` or an ancestor is in flight (its device bytes may not be there yet)."""
        states = self.host.state().numpy()
        while node is not self.cache.root:
            if node.host_value is not None and (states[node.host_value.numpy()] == SlotState.LOADING).any():
                return True
            node = node.parent
        return False

    def op_lock(self, r: random.Random) -> None:
        m = self.cache.match_prefix(self.tokens(r))
        node = m.last_host_node if r.random() < 0.5 else m.last_device_node
        if node is not self.cache.root:
            self.cache.inc_lock_ref(node)
            self.held.append(node)

    def op_unlock(self, r: random.Random) -> None:
        if self.held:
            self.cache.dec_lock_ref(self.held.pop(r.randrange(len(self.held))))

    def op_evict(self, r: random.Random) -> None:
        before = self.dev.available_size()
        want = r.randint(1, self.dev.size // 2)
        freed = self.cache.evict(want)
        assert freed >= 0
        # What evict reports is what it gave back to the pool (write_back's backups do not allocate device slots).
        assert self.dev.available_size() - before == freed, (before, freed, self.dev.available_size())

    def op_evict_host(self, r: random.Random) -> None:
        before = self.host.available_size()
        freed = self.cache.evict_host(r.randint(1, self.host.size // 2))
        assert self.host.available_size() - before == freed

    def op_load_back(self, r: random.Random) -> None:
        c = self.cache
        toks = self.host_tokens(r) if r.random() < 0.5 else None
        m = c.match_prefix(toks or self.tokens(r))
        if not m.host_hit_length:
            return
        quota = None if r.random() < 0.8 else r.randint(0, self.dev.size)
        skipped = c.metrics.load_backs_skipped
        got = c.load_back(m.last_host_node, mem_quota=quota)
        if got is None:
            assert c.metrics.load_backs_skipped == skipped + 1
            self.counts["load_back_skipped"] += 1
            return
        self.counts["load_back_done"] += 1
        assert len(got) == m.host_hit_length
        assert m.last_host_node.value is not None and m.last_host_node.lock_ref > 0
        if r.random() < 0.5:
            c.start_loading()

    def op_start_loading(self, r: random.Random) -> None:
        self.cache.start_loading()

    def op_prefetch(self, r: random.Random) -> None:
        c = self.cache
        if c.storage is None:
            return
        toks = self.tokens(r)
        m = c.match_prefix(toks)
        self.next_rid += 1
        if c.prefetch_from_storage(self.next_rid, m.last_host_node, toks):
            self.prefetching.append(self.next_rid)
            self.counts["prefetch_started"] += 1

    def finish_prefetch(self, rid: int) -> None:
        """Wait for the prefetch's query, then its read (so what lands does not depend on thread
        timing), polling as a scheduler would until it admits the request."""
        c = self.cache
        for _ in range(100):
            p = c.storage_ops.prefetches[rid]
            assert (p.queried if p.state == "query" else p.finished).wait(60), "prefetch thread stuck"
            if c.check_prefetch_progress(rid):
                break
        else:
            raise AssertionError(f"prefetch {rid} never admitted")
        self.prefetching.remove(rid)
        self.counts["prefetch_done"] += 1

    def op_check_prefetch(self, r: random.Random) -> None:
        if self.prefetching:
            self.finish_prefetch(self.prefetching[r.randrange(len(self.prefetching))])

    def op_check_storage(self, r: random.Random) -> None:
        if self.cache.storage is not None:
            self.cache.check_storage()

    def op_check_writes(self, r: random.Random) -> None:
        self.cache.check_writes()

    def op_check_loads(self, r: random.Random) -> None:
        self.cache.check_loads()

    def op_flush(self, r: random.Random) -> None:
        self.cache.flush()
        assert not self.cache.copies.writes and not self.cache.copies.loads

    # -------------------------------------------------------------- misuse: every error changes nothing
    def refused(self, call: Callable[[], object], errors: type | tuple[type, ...], match: str) -> None:
        """``call`` raises one of ``errors`` matching ``match`` and leaves tree and pools as they were."""
        before = state_of(self.cache)
        with pytest.raises(errors, match=match):
            call()
        assert state_of(self.cache) == before, "a refused call changed the cache"

    def op_bad_insert(self, r: random.Random) -> None:
        c, ps = self.cache, self.cache.page_size
        toks = self.tokens(r)
        m = c.match_prefix(toks)
        hit = len(m.device_indices)
        if c.window_cut is not None and c.window_cut.usable(toks)[1] > hit:
            # A cut match: the tree holds pages past it, which an insert takes as duplicates, unchecked.
            self.counts["bad_insert_after_a_cut"] += 1
            return
        c.inc_lock_ref(m.last_device_node)
        mine = self.alloc(len(toks) - hit)
        c.dec_lock_ref(m.last_device_node)
        if mine is None:
            self.counts["device_full"] += 1
            return
        full = torch.cat([m.device_indices, mine])
        bad: list[tuple[object, type, str]] = [
            (full.to(torch.float32), TypeError, "integer tensor"),
            (full.tolist(), TypeError, "torch.Tensor"),
            (full[:-ps], ValueError, "one slot per token"),
        ]
        if len(mine):
            page = torch.arange(ps)
            last = slice(len(full) - ps, len(full))  # the caller's last page: the tree would take it
            free_pages = np.flatnonzero(~self.dev.is_allocated().numpy().reshape(-1, ps).any(axis=1))
            owned = [n.value[:ps] for n, _ in tree_nodes(c) if n.value is not None]
            swaps = [(page + self.dev.size, "out of range"), (full[:ps].clone(), "repeated")]
            if free_pages.size:
                swaps.append((page + int(free_pages[r.randrange(free_pages.size)]) * ps, "not allocated"))
            if owned:
                swaps.append((owned[r.randrange(len(owned))], "owned by the tree|repeated"))
            if ps > 1:
                swaps.append((full[last].flip(0), "whole device page"))
            for page_slots, match in swaps:
                if len(full) == ps and match == "repeated":
                    continue  # one page: nothing to repeat
                slots = full.clone()
                slots[last] = page_slots
                bad.append((slots, ValueError, match))
        slots, error, match = bad[r.randrange(len(bad))]
        self.refused(lambda: c.insert(toks, slots), error, f"device_indices: .*({match})")
        self.counts["bad_insert_refused"] += 1
        self.dev.free(mine)

    def op_host_evict_race(self, r: random.Random) -> None:
        c = self.cache
        toks = self.host_tokens(r)
        if toks is None:
            return
        m = c.match_prefix(toks)
        if not m.host_hit_length:
            return
        c.evict_host(r.randint(1, self.host.size))
        if attached(c, m.last_host_node):
            if c.load_back(m.last_host_node) is not None:
                self.counts["load_back_done"] += 1
            return
        self.refused(lambda: c.load_back(m.last_host_node), ValueError, "node: .* no longer in the tree")
        self.counts["load_back_raced"] += 1

    def op_close(self, r: random.Random) -> None:
        if self.factory is None:
            return
        c = self.cache
        drain = r.random() < 0.5
        c.close(drain=drain)
        self.prefetching.clear()  # close stopped them (nothing inserted, slots freed)
        self.counts["close_drain" if drain else "close_drop"] += 1
        self.check()  # nothing in flight: locks are the driver's, host slots SYNCED or FREE
        assert not c.copies.writes and not c.copies.loads
        # Calls on the closed cache: refused, nothing changed.
        toks = self.tokens(r)
        slots = self.dev.alloc(len(toks))
        if slots is not None:
            self.refused(lambda: c.insert(toks, slots), RuntimeError, "closed")
            self.dev.free(slots)
        hosts = [n for n, _ in tree_nodes(c) if n.value is None]
        if hosts:
            node = hosts[r.randrange(len(hosts))]
            self.refused(lambda: c.load_back(node), RuntimeError, "closed")
        self.refused(lambda: c.match_prefix(toks), RuntimeError, "closed")
        # Release what the driver holds (unlocking still works), then carry on with a new cache.
        while self.held:
            c.dec_lock_ref(self.held.pop())
        while self.pending:
            q = self.pending.pop()
            self.dev.free(q.slots)
            c.dec_lock_ref(q.node)
        c.verify()
        self.retired.update({k: v for k, v in c.metrics.as_dict().items() if isinstance(v, int)})
        self.cache = self.factory()
        self.dev, self.host = self.cache.device_pool, self.cache.host_pool

    def metric(self, name: str) -> int:
        """A counter of :class:`CacheMetrics` summed over every cache this driver used."""
        return self.retired[name] + getattr(self.cache.metrics, name)

    # -------------------------------------------------------------- invariants after every step
    def check(self) -> None:
        c = self.cache
        ext = self.external()
        c.verify(external_device=ext)
        nodes = tree_nodes(c)
        # Exact lock counts: each lock point (held lock, pending request, copy in flight) counts once
        # on its node and every ancestor.
        points: Counter = Counter()
        for node in self.held:
            points[node] += 1
        for q in self.pending:
            points[q.node] += 1
        inflight_host: list[tuple[torch.Tensor, int]] = []
        for node, host in c.copies.writes.values():
            points[node] += 1
            inflight_host.append((host, SlotState.WRITING))
        for node, host, _ in c.copies.loads.values():
            points[node] += 1
            inflight_host.append((host, SlotState.LOADING))
        pins: Counter = Counter()
        for backed_up in c.storage_ops.backups.values():  # storage backups host-pin their node (no lock)
            for node in backed_up:
                pins[node.id] += 1
                assert attached(c, node) and node.host_value is not None, f"{node}: pinned without a host copy"
        assert pins == Counter(c.tree.host_pins), (pins, c.tree.host_pins)
        prefetch_held = np.zeros(0, dtype=np.int64)
        for p in c.storage_ops.prefetches.values():  # prefetches lock the node they continue
            points[p.node] += 1
        held = [p.host_slots.numpy() for p in [*c.storage_ops.prefetches.values(), *c.storage_ops.zombies]]
        if held:
            prefetch_held = np.concatenate(held)
        expect: Counter = Counter()
        for node, k in points.items():
            if node is c.root:
                continue
            assert attached(c, node), f"{node} is locked but no longer in the tree"
            while node is not c.root:
                expect[node] += k
                node = node.parent
        dev_owned = host_owned = 0
        host_expect = np.zeros(self.host.size, dtype=np.uint8)
        for node, _ in nodes:
            assert node.lock_ref == expect[node], (node, expect[node])
            if node.value is not None:
                dev_owned += len(node.value)
            if node.host_value is not None:
                host_owned += len(node.host_value)
                host_expect[node.host_value.numpy()] = SlotState.SYNCED
        # Host slot states: WRITING / LOADING exactly for the copies in flight, SYNCED for the rest,
        # RESERVED for prefetches in flight.
        assert not host_expect[prefetch_held].any(), "prefetch slots owned by a node"
        host_expect[prefetch_held] = SlotState.RESERVED
        for host, state in inflight_host:
            assert (host_expect[host.numpy()] == SlotState.SYNCED).all(), "in-flight host slots not owned"
            host_expect[host.numpy()] = state
        states = self.host.state().numpy()
        if not np.array_equal(states, host_expect):
            bad = np.nonzero(states != host_expect)[0][:6]
            raise AssertionError(f"host slots {bad.tolist()}: states {states[bad]} expected {host_expect[bad]}")
        n_ext = 0 if ext is None else len(ext)
        assert self.dev.available_size() + dev_owned + n_ext == self.dev.size
        assert self.host.available_size() + host_owned + len(prefetch_held) == self.host.size
        assert c.evictable_size() + c.protected_size() == dev_owned
        if self.check_kv_every and self.steps % self.check_kv_every == 0:
            check_device_kv(c)

    # -------------------------------------------------------------- runs and the final drain
    def run(self, ops: list[tuple[str, int]]) -> None:
        for op, seed in ops:
            self.step(op, random.Random(seed))

    def run_random(self, n: int, seed: int) -> None:
        r = random.Random(seed)
        ops, weights = ALL_OPS, ALL_WEIGHTS
        if self.cache.storage is not None:
            ops, weights = ops + STORAGE_OPS, weights + STORAGE_WEIGHTS
        for op in r.choices(ops, weights, k=n):
            self.step(op, r)

    def release_all(self) -> None:
        """Finish every request, release every lock, flush: afterwards nothing is locked."""
        while self.pending:
            self.finish(self.pending.pop())
        while self.held:
            self.cache.dec_lock_ref(self.held.pop())
        while self.prefetching:
            self.finish_prefetch(self.prefetching[-1])
        self.cache.flush()
        self.check()
        assert all(n.lock_ref == 0 for n, _ in tree_nodes(self.cache))
        assert not self.cache.copies.writes and not self.cache.copies.loads

    def drain(self, sample: int = 6) -> None:
        """Release everything; check the device KV; push the device tier out and load a sample of
        host-only prefixes back (their KV must be what was written); then evict both tiers completely
        and check both pools are entirely free."""
        c = self.cache
        self.release_all()
        check_device_kv(c)
        c.evict(self.dev.size)
        c.flush()
        self.check()
        assert self.dev.available_size() == self.dev.size, "unlocked device nodes survived evict(all)"
        leaves = [(n, s) for n, s in tree_nodes(c) if not n.children]
        random.Random(self.seed).shuffle(leaves)
        loaded = 0
        for leaf, start in leaves[:sample]:
            if not attached(c, leaf):
                continue
            toks = []
            x = leaf
            while x is not c.root:
                toks[:0] = x.key
                x = x.parent
            assert len(toks) == start + len(leaf.key)
            m = c.match_prefix(toks)
            if m.host_hit_length < max(1, c.load_back_threshold):
                continue
            got = c.load_back(m.last_host_node)
            if got is None:  # no room: make some and retry
                c.evict(self.dev.size)
                m = c.match_prefix(toks)
                got = c.load_back(m.last_host_node)
            assert got is not None
            c.start_loading()
            c.flush()
            self.check()
            m = c.match_prefix(toks)
            # With a window pool, as far as its windows are whole (the match before the load was cut there).
            whole = len(toks) if c.window_cut is None else c.window_cut.usable(toks)[0]
            assert len(m.device_indices) == whole and m.host_hit_length == 0
            check_kv(c, toks[:whole], m.device_indices)  # cachedata's per-slot check
            loaded += 1
        self.counts["drain_loaded"] += loaded
        c.evict(self.dev.size)
        c.evict_host(self.host.size)
        c.flush()
        self.check()
        assert not c.root.children, "nodes survived eviction of both tiers"
        assert self.dev.available_size() == self.dev.size, "device slots leaked"
        assert self.host.available_size() == self.host.size, "host slots leaked"
        assert (self.host.state() == SlotState.FREE).all()


# ---------------------------------------------------------------------------------------------------
# Property test (hypothesis), deterministic controller
# ---------------------------------------------------------------------------------------------------


class SlowCopies:
    """Wraps a controller's ``_issue`` to sleep a random 0-2 ms first, so copies overlap the driver."""

    def __init__(self, controller, seed: int, max_s: float = 0.002) -> None:
        self.inner = controller._issue
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.max_s = max_s
        controller._issue = self

    def __call__(self, op, stream) -> None:
        with self.lock:
            delay = self.rng.uniform(0, self.max_s)
        time.sleep(delay)
        self.inner(op, stream)


def insert_seq(cache: HiRadixCache, tokens: list[int]) -> torch.Tensor:
    """Insert ``tokens`` (none cached) with fresh, written device slots; returns the slots."""
    slots = cache.device_pool.alloc(len(tokens))
    assert slots is not None
    write_kv(cache, tokens, slots, 0)
    assert cache.insert(tokens, slots) == 0
    return slots


def lock_host_only(cache: HiRadixCache, tokens: list[int]) -> TreeNode:
    m = cache.match_prefix(tokens)
    assert m.host_hit_length == len(tokens)
    cache.inc_lock_ref(m.last_host_node)
    return m.last_host_node


def fill_host(cache: HiRadixCache) -> list[TreeNode]:
    """Host pool full of locked host-only nodes (16 tokens each); device pool empty."""
    locked = []
    for i in range(cache.host_pool.size // 16):
        toks = [VOCAB + i] * 16  # distinct first tokens: one node each
        insert_seq(cache, toks)
        cache.match_prefix(toks)  # write_through_selective: second hit backs it up
        cache.flush()
        cache.evict(cache.device_pool.size)
        locked.append(lock_host_only(cache, toks))
    assert cache.host_pool.available_size() == 0 and cache.device_pool.available_size() == cache.device_pool.size
    return locked


def state_of(cache: HiRadixCache) -> dict:
    """Tree (every node by its full token path: slots, locks, counters) and both pools' slot states."""
    nodes = []
    for node, _ in tree_nodes(cache):
        path, x = [], node
        while x is not cache.root:
            path[:0] = x.key
            x = x.parent
        value = None if node.value is None else node.value.tolist()
        host = None if node.host_value is None else node.host_value.tolist()
        nodes.append((tuple(path), value, host, node.lock_ref, node.hit_count, node.last_access_time, node.priority))
    return dict(
        nodes=sorted(nodes),
        device_allocated=cache.device_pool.is_allocated().tolist(),
        host_state=cache.host_pool.state().tolist(),
    )


def host_only(cache: HiRadixCache, tokens: list[int]) -> None:
    """Insert ``tokens``, back them up, and evict the whole device tier."""
    insert_seq(cache, tokens)
    cache.match_prefix(tokens)  # write_through_selective: second hit backs it up
    cache.flush()
    cache.evict(cache.device_pool.size)
    cache.flush()
    assert cache.match_prefix(tokens).host_hit_length == len(tokens)
