"""The storage tier seen from the tree: backups of host copies to storage, prefetches from it.

:class:`StorageOps`, a component of :class:`~hicache.cache.radix_cache.HiRadixCache` (``storage=``). What it adds:

- **Page keys on nodes**: a node's pages are keyed by the hash chain (:func:`hicache.storage.page_keys`)
  continued from its parent's last page and rooted in the cache's :class:`~hicache.storage.Namespace`;
  computed on first use, split with the node, dropped with it.
- **Backups**: when a node's host copy lands (whatever the write policy: it decides when that
  happens), its pages are queued for the backend; the node is *host-pinned* until the agreed ack
  (``CacheTree.pin_host``): host eviction skips it, so its host slots stay as they are while the
  backend reads them, but its device copy may still be evicted (a slow store does not hold device
  memory). Pages already stored are skipped; a failed backup is counted, never raised.
- **Prefetches**: :meth:`prefetch_from_storage` after ``match_prefix`` hands the tokens beyond the
  host hit to the query thread, which keys their pages and asks the backend how many leading ones it
  holds; :meth:`check_prefetch_progress`, called by the scheduler until it admits the request, agrees
  that number across TP ranks (MIN), allocates host slots for that many only, starts the I/O thread's
  read, ends the prefetch by the policy, and inserts the pages that landed on every rank as a
  host-only node under the matched node, to be loaded to the device as any host hit.
- **Busy host slots**: host slots the backend may still read or write after giving up on a call
  (:meth:`~hicache.storage.StorageBackend.slots_busy`: a timed-out Mooncake batch whose transfer goes
  on) are never returned to the host pool while busy: a stopped prefetch's slots and a deleted node's
  host copy wait in :class:`HeldHostSlots` (unowned, RESERVED or SYNCED) and are freed once the backend is done
  with them (checked when a prefetch is requested, when backups are processed, and at close, which
  waits up to ``IO_GRACE_S``; slots still busy after close stay allocated).
- **TP**: every collective is issued on every rank the same number of times (the branches before them
  depend only on the tokens and the agreed values), including when a rank's backend fails or hangs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..controller.controller import HiCacheController
from ..pools import HostKVPool
from ..storage import Namespace, StorageBackend, create_backend, page_keys
from ..storage.keys import sidecar_description, window_description
from ..storage.objects import StoredObjects
from ..storage.tier import Prefetch, PrefetchPolicy, StorageTier
from ..streams.devices import KVRegion
from ..tree.nodes import copy_chain
from .cache_tree import CacheTree
from .namespaces import RequestNamespaces

__all__ = ["HeldHostSlots", "IO_GRACE_S", "StorageOps", "create_tier"]

# How long check_prefetch_progress waits for the I/O thread to let go of a stopped prefetch's slots.
IO_GRACE_S = 2.0


def create_tier(
    storage: str | StorageBackend | None,
    storage_config: Any,
    model_id: str | None,
    storage_salt: str | None,
    prefetch_policy: str | PrefetchPolicy,
    host_pool: HostKVPool,
    controller: HiCacheController,
    threaded: bool,
    head_group: int = 1,
) -> StorageTier | None:
    """The storage tier ``HiRadixCache(storage=...)`` asks for (None without ``storage``); the arguments
    are the cache's (``ValueError`` naming ``model_id`` when it is missing, ``head_group`` when it does
    not divide the host pool's heads, ``sidecars`` when a page's objects cannot carry them: all before a
    backend is built). The controller's sidecar host pools are stored with their pages."""
    if storage is None:
        return None
    sidecars = [h for _, h in controller.sidecars]
    if model_id is None or not isinstance(model_id, str) or not model_id:
        raise ValueError("model_id: the storage tier needs the model's id (its bytes depend on the weights)")
    policy = prefetch_policy if isinstance(prefetch_policy, PrefetchPolicy) else PrefetchPolicy(prefetch_policy)
    group = controller.tp_group
    tp = {}
    if group is not None:
        import torch.distributed as dist  # noqa: PLC0415

        tp = {"tp_rank": dist.get_rank(group), "tp_size": dist.get_world_size(group)}
    window = controller.window
    described = tuple(sidecar_description(h) for h in sidecars) + ((window_description(window),) if window else ())
    namespace = Namespace.for_pool(host_pool, model_id, salt=storage_salt, head_group=head_group,
                                   sidecars=described, **tp)  # fmt: skip
    if sidecars or window is not None:  # where their rows go in a page's objects (ValueError where they cannot)
        StoredObjects(host_pool, head_group=head_group, sidecars=sidecars, window=window, **tp)
    backend = create_backend(storage, storage_config) if isinstance(storage, str) else storage
    return StorageTier(backend, host_pool, namespace, controller.agree_min, policy, threaded=threaded,
                       sidecars=sidecars, window=window)  # fmt: skip


class HeldHostSlots:
    """Host slots the cache no longer uses, returned to ``host_pool`` unless the storage backend may
    still read or write them (a call it gave up on): those are held until it is done."""

    def __init__(self, host_pool: HostKVPool, tier: StorageTier | None) -> None:
        self.host_pool = host_pool
        self.tier = tier
        self.held: list[torch.Tensor] = []

    def free(self, slots: torch.Tensor) -> None:
        if not len(slots):
            return
        if self.tier is not None and self.tier.slots_busy(slots):
            self.held.append(slots)
        else:
            self.host_pool.free(slots)

    def reap(self) -> None:
        """Free the held slots the backend is done with."""
        if self.held:
            held, self.held = self.held, []
            for slots in held:
                if self.tier.slots_busy(slots):
                    self.held.append(slots)
                else:
                    self.host_pool.free(slots)

    def wait(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` seconds (for all together) for the backend to let go of held slots."""
        end = time.perf_counter() + grace_s
        for slots in self.held:
            self.tier.slots_busy(slots, max(0.0, end - time.perf_counter()))


class StorageOps:
    """The storage tier seen from the tree (module docstring): keys, backups, prefetches.

    Parameters
    ----------
    tree, host_pool, controller : the nodes, the host pool the tier reads and writes, the TP agreements.
    tier : the :class:`~hicache.storage.tier.StorageTier` (None: no storage; every call is a no-op
        except the prefetch calls, which raise).
    held : where host slots go that the cache lets go of (:class:`HeldHostSlots`).
    evict_host : ``evict_host(tokens)`` makes host room for a prefetch.
    """

    def __init__(
        self,
        tree: CacheTree,
        host_pool: HostKVPool,
        controller: HiCacheController,
        tier: StorageTier | None,
        held: HeldHostSlots,
        evict_host: Callable[[int], int],
        namespaces: RequestNamespaces | None = None,
    ) -> None:
        self.namespaces = namespaces if namespaces is not None else RequestNamespaces()
        self.tree = tree
        self.root = tree.root
        self.page_size = tree.page_size
        self.host_pool = host_pool
        self.controller = controller
        self.metrics = controller.metrics
        self.tier = tier
        self.held = held
        self.evict_host = evict_host
        self.backups: dict[int, list[Any]] = {}  # node id -> the nodes of its storage backups in flight
        self.prefetches: dict[Any, Prefetch] = {}  # request id -> prefetch in flight
        self.zombies: list[Prefetch] = []  # stopped, but the I/O thread still holds some of their slots

    # ------------------------------------------------------------------ keys
    def keys_of(self, node: Any) -> list[str]:
        """The storage keys of ``node``'s pages (``ValueError`` for token ids outside ``[0, 2**32)``)."""
        chain = []
        x = node
        while x is not self.root and x.id not in self.tree.node_keys:
            chain.append(x)
            x = x.parent
        if not chain:
            return self.tree.node_keys[node.id]
        ns = self.namespaces.of_token(chain[0].key[0])  # a chain's tokens share one namespace
        if x is self.root:
            prev = self.namespaces.root_digest(self.tier.root_digest, ns)
        else:
            prev = self.tree.node_keys[x.id][-1]
        for y in reversed(chain):
            keys = page_keys(self.namespaces.key_tokens(y.key, ns), self.page_size, prev_digest=prev)
            self.tree.node_keys[y.id] = keys
            prev = keys[-1]
        return self.tree.node_keys[node.id]

    # ------------------------------------------------------------------ backups
    def host_copy_landed(self, node: Any, host: torch.Tensor) -> None:
        """A backup's host copy landed (SYNCED): queue its pages for storage, the node host-pinned (the
        halves a later split takes off it are its ancestors: never host-only leaves while it stays)."""
        if self.tier is None or self.tier.closed:
            return
        chain = copy_chain(self.root, node, host)  # the node and the halves split off it, bottom-up
        try:
            keys = [k for x in reversed(chain) for k in self.keys_of(x)]
        except ValueError:  # token ids a key cannot hold: this prefix is not stored
            return
        if len(keys) * self.page_size != len(host):
            return
        # The storage threads read the host pages from now on: they must have landed (the deferred model
        # checks it; on a GPU the write's ack came from its completed event).
        device = self.controller.device
        if device.tracks_regions:
            device.check_read([KVRegion(self.host_pool, host)], f"the storage backup of node {node.id}")
        self.tree.pin_host(node)
        self.backups.setdefault(node.id, []).append(node)
        self.tier.submit_backup(node.id, keys, host)

    def take_backups(self, agreed: int | None = None) -> int:
        """Process the storage backups finished on every rank (``agreed`` of them when the step's one
        agreement counted them, else agreed here): unlock their nodes, count; free the host slots the
        backend has let go of."""
        if self.tier is None:
            return 0
        self.reap()
        done = self.tier.finished_backups(agreed)
        m = self.metrics
        page_bytes = self.host_pool.page_bytes
        for node_id, written, skipped, _pages, seconds, error in done:
            nodes = self.backups[node_id]
            node = nodes.pop(0)
            if not nodes:
                del self.backups[node_id]
            m.storage_pages_written += written
            m.storage_pages_skipped += skipped
            m.storage_bytes_written += written * page_bytes
            m.storage_write_time_s += seconds
            m.storage_backups_failed += int(error is not None)
            self.tree.unpin_host(node)
        return len(done)

    # ------------------------------------------------------------------ prefetches
    def request(self, request_id: Any, last_host_node: Any, tokens: Any) -> bool:
        """``HiRadixCache.prefetch_from_storage`` (its docstring): the query handed to the query thread."""
        tier = self.tier
        if tier is None:
            raise RuntimeError("prefetch_from_storage: this HiRadixCache has no storage tier (storage=...)")
        if request_id in self.prefetches:
            raise ValueError(f"request_id: {request_id!r} already has a prefetch in flight")
        if last_host_node is not self.root and not self.tree.attached(last_host_node):
            raise ValueError(f"last_host_node: {last_host_node} is not in the tree; match the tokens again")
        self.reap()
        ps = self.page_size
        depth = 0
        x = last_host_node
        while x is not self.root:
            depth += x.num_tokens
            x = x.parent
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        rest = ids[depth : len(ids) - len(ids) % ps]
        policy = tier.policy
        if not policy.worth(len(rest), ps):
            return False
        try:
            ns = self.namespaces.of_token(rest[0]) if rest else 0  # a request's tokens share one namespace
            if last_host_node is self.root:
                prev = self.namespaces.root_digest(tier.root_digest, ns)
            else:
                prev = self.keys_of(last_host_node)[-1]
        except ValueError:
            return False  # the matched prefix holds token ids no key can hold (the same on every rank)
        self.tree.inc_lock_ref(last_host_node)
        now = time.perf_counter()
        p = Prefetch(request_id, last_host_node, rest, prev, now, policy.deadline(now, len(rest)))
        if ns:
            p.key_tokens = self.namespaces.key_tokens(rest, ns)
        self.prefetches[request_id] = p
        tier.start_query(p)
        return True

    def check(self, request_ids: Iterable[Any]) -> list[Any]:
        """``HiRadixCache.check_prefetches`` (its docstring): the requests that may be admitted now."""
        ids = list(request_ids)
        ops: list[Prefetch] = []
        for rid in ids:
            p = self.prefetches.get(rid)
            if p is None:
                raise ValueError(f"request_id: no prefetch in flight for {rid!r}")
            ops.append(p)
        if len({id(p) for p in ops}) != len(ops):
            raise ValueError("request_ids: an id appears more than once")
        if not ops:
            return []
        policy = self.tier.policy
        ready: set[int] = set()  # indices into ops
        # Phase 1, every prefetch: [queried, in time, hit] for a query, [done] for a read.
        now = time.perf_counter()
        local: list[int] = []
        for p in ops:
            if p.state == "query":
                queried = p.queried.is_set()
                local += [int(queried), int(now < p.deadline), p.query_hit if queried else 0]
            else:
                local.append(int(self._read_done(p, now)))
        agreed = self.controller.agree_all(local)
        starting: list[tuple[int, int]] = []  # (index, agreed hit) of reads to start
        ending: list[int] = []  # reads every rank is done with
        k = 0
        for i, p in enumerate(ops):
            if p.state == "query":
                queried, in_time, hit = agreed[k : k + 3]
                k += 3
                if not queried:
                    if policy.name == "best_effort" or (policy.name == "timeout" and not in_time):
                        self._finish_prefetch(p, insert=False)
                        ready.add(i)
                    continue
                starting.append((i, hit))
            else:
                if agreed[k]:
                    ending.append(i)
                k += 1
        # Phase 2: [host slots allocated] for reads to start, [pages landed] for reads that end.
        allocs = []
        for i, hit in starting:
            allocs.append(self._alloc_prefetch(ops[i], hit))
        for i in ending:
            self._stop_read(ops[i])
        local = [int(slots is not None) for slots in allocs] + [ops[i].landed for i in ending]
        agreed = self.controller.agree_all(local) if local else []
        started: list[int] = []
        for (i, _), slots, ok in zip(starting, allocs, agreed[: len(starting)], strict=True):
            p = ops[i]
            if not ok or slots is None:
                if slots is not None:
                    self.host_pool.free(slots)
                self._finish_prefetch(p, insert=False)
                ready.add(i)
            else:
                self._start_read(p, slots)
                started.append(i)
        for i, landed in zip(ending, agreed[len(starting) :], strict=True):
            self._finish_prefetch(ops[i], agreed_landed=landed)
            ready.add(i)
        # Phase 3: the reads started just now, by the policy: best_effort ends them at once; the others
        # end when every rank is done ([done]).
        if started:
            now = time.perf_counter()
            if policy.name == "best_effort":
                ending = started
            else:
                agreed = self.controller.agree_all([int(self._read_done(ops[i], now)) for i in started])
                ending = [i for i, done in zip(started, agreed, strict=True) if done]
            # Phase 4: [pages landed] of those that end.
            if ending:
                for i in ending:
                    self._stop_read(ops[i])
                agreed = self.controller.agree_all([ops[i].landed for i in ending])
                for i, landed in zip(ending, agreed, strict=True):
                    self._finish_prefetch(ops[i], agreed_landed=landed)
                    ready.add(i)
        return [rid for i, rid in enumerate(ids) if i in ready]

    def _read_done(self, p: Prefetch, now: float) -> bool:
        """Whether this rank may end read ``p`` by the policy."""
        name = self.tier.policy.name
        if name == "best_effort":
            return True
        if name == "wait_complete":
            return p.complete
        return p.complete or now >= p.deadline

    def _alloc_prefetch(self, p: Prefetch, hit: int) -> torch.Tensor | None:
        """Host slots for the agreed ``hit`` pages of ``p`` (capped by the policy's ``max_host_tokens``,
        making room in the host pool if needed), or None when there is nothing worth reading or no room."""
        ps = self.page_size
        policy = self.tier.policy
        if policy.max_host_tokens is not None:
            held = sum(len(q.host_slots) for q in self.prefetches.values())
            hit = min(hit, max(0, policy.max_host_tokens - held) // ps)
        if not policy.worth(hit * ps, ps):
            return None
        slots = self.host_pool.alloc(hit * ps)
        if slots is None:
            self.evict_host(hit * ps - self.host_pool.available_size())
            slots = self.host_pool.alloc(hit * ps)
        return slots

    def _start_read(self, p: Prefetch, slots: torch.Tensor) -> None:
        """Start reading ``p``'s agreed hit into ``slots`` (allocated on every rank)."""
        hit = len(slots) // self.page_size
        p.tokens, p.keys, p.host_slots, p.state = p.tokens[: hit * self.page_size], p.keys[:hit], slots, "read"
        self.metrics.prefetches += 1
        self.tier.start_prefetch(p)

    def _stop_read(self, p: Prefetch) -> None:
        """Stop ``p``'s read: the batch in flight completes (a hung backend is left behind); then
        ``p.landed`` pages are complete and no longer touched by the I/O thread."""
        p.cancel.set()
        p.finished.wait(IO_GRACE_S)

    def _finish_prefetch(self, p: Prefetch, insert: bool = True, agreed_landed: int | None = None) -> None:
        """End ``p``: with ``insert``, the pages that landed on every rank become a host-only node
        (``agreed_landed``: their number when the caller agreed it after :meth:`_stop_read`; else
        stopped and agreed here)."""
        if p.state == "query":  # no read was started: no slots, nothing landed
            del self.prefetches[p.request_id]
            self.tree.dec_lock_ref(p.node)
            return
        if agreed_landed is None:
            self._stop_read(p)
            agreed = self.controller.agree_min(p.landed) if insert else 0
        else:
            agreed = int(agreed_landed) if insert else 0
        del self.prefetches[p.request_id]
        ps = self.page_size
        m = self.metrics
        n = agreed * ps
        used = False
        if n:
            page = p.tokens[:ps]
            if self.tree.compiled is not None:
                taken = self.tree.compiled.core.child_for(p.node.id, page) >= 0
            else:
                taken = tuple(page) in p.node.children
            if taken:  # another insert cached (part of) these tokens meanwhile: theirs stay
                m.prefetches_discarded += 1
            else:
                slots = p.host_slots[:n]
                self.host_pool.mark_filled(slots)
                node = self.tree.add_host_node(p.node, p.tokens[:n], slots)
                self.tree.node_keys[node.id] = p.keys[:agreed]
                used = True
                m.storage_hit_tokens += n
                m.storage_pages_read += agreed
                m.storage_bytes_read += agreed * self.host_pool.page_bytes
        if agreed < len(p.keys):
            cut = m.prefetches_cut
            cut[self.tier.policy.name] = cut.get(self.tier.policy.name, 0) + 1
        m.prefetch_latency_s.append(time.perf_counter() - p.start)
        rest = p.host_slots[n:] if used else p.host_slots
        if p.finished.is_set():
            m.storage_read_time_s += p.read_s
            self.held.free(rest)  # held instead while a read the backend gave up on may still land in them
        else:
            p.host_slots = rest  # freed when the I/O thread returns (reap)
            self.zombies.append(p)
        self.tree.dec_lock_ref(p.node)

    def reap(self) -> None:
        """Free the slots of stopped prefetches whose I/O thread has let go of them, and the held host
        slots the backend is done with."""
        if self.zombies:
            for p in [z for z in self.zombies if z.finished.is_set()]:
                self.zombies.remove(p)
                self.held.free(p.host_slots)
        self.held.reap()

    def close(self) -> None:
        """At close: stop every prefetch (nothing inserted), finish the queued backups, stop the threads."""
        if self.tier is None:
            return
        for p in list(self.prefetches.values()):
            self._finish_prefetch(p, insert=False)
        self.tier.wait_backups()
        self.take_backups()
        for p in self.zombies:
            p.finished.wait(IO_GRACE_S)
        self.reap()
        self.held.wait(IO_GRACE_S)  # one grace for every busy transfer together
        self.reap()  # what is still busy stays allocated: the backend may yet touch it
        self.tier.close()
