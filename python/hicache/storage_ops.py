"""The storage tier seen from the tree: backups of host copies to storage, prefetches from it.

Mixin of :class:`~hicache.radix_cache.HiRadixCache` (``storage=``). What it adds:

- **Page keys on nodes**: a node's pages are keyed by the hash chain (:func:`hicache.storage.page_keys`)
  continued from its parent's last page and rooted in the cache's :class:`~hicache.storage.Namespace`;
  computed on first use, split with the node, dropped with it.
- **Backups**: when a node's host copy lands (whatever the write policy: it decides when that
  happens), its pages are queued for the backend; the node is *host-pinned* until the agreed ack
  (``_host_pins``): host eviction skips it, so its host slots stay as they are while the backend reads
  them, but its device copy may still be evicted (a slow store does not hold device memory). Pages
  already stored are skipped; a failed backup is counted, never raised.
- **Prefetches**: :meth:`prefetch_from_storage` after ``match_prefix`` hands the tokens beyond the
  host hit to the query thread, which keys their pages and asks the backend how many leading ones it
  holds; :meth:`check_prefetch_progress`, called by the scheduler until it admits the request, agrees
  that number across TP ranks (MIN), allocates host slots for that many only, starts the I/O thread's
  read, ends the prefetch by the policy, and inserts the pages that landed on every rank as a
  host-only node under the matched node, to be loaded to the device as any host hit.
- **Busy host slots**: host slots the backend may still read or write after giving up on a call
  (:meth:`~hicache.storage.StorageBackend.slots_busy`: a timed-out Mooncake batch whose transfer goes
  on) are never returned to the host pool while busy: a stopped prefetch's slots and a deleted node's
  host copy wait in ``_held_host`` (unowned, RESERVED or SYNCED) and are freed once the backend is done
  with them (checked when a prefetch is requested, when backups are processed, and at close, which
  waits up to ``IO_GRACE_S``; slots still busy after close stay allocated).
- **TP**: every collective is issued on every rank the same number of times (the branches before them
  depend only on the tokens and the agreed values), including when a rank's backend fails or hangs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from .storage import Namespace, StorageBackend, create_backend, page_keys
from .storage.tier import Prefetch, PrefetchPolicy, StorageTier
from .streams import KVRegion
from .tree import TreeNode, copy_chain

if TYPE_CHECKING:
    from .radix_cache import HiRadixCache

# How long check_prefetch_progress waits for the I/O thread to let go of a stopped prefetch's slots.
IO_GRACE_S = 2.0


class StorageOps:
    """Mixin of :class:`~hicache.radix_cache.HiRadixCache`: the storage tier (module docstring)."""

    def _init_storage(
        self: HiRadixCache,
        storage: str | StorageBackend | None,
        storage_config: Any,
        model_id: str | None,
        storage_salt: str | None,
        prefetch_policy: str | PrefetchPolicy,
    ) -> None:
        self._storage: StorageTier | None = None
        self._node_keys: dict[int, list[str]] = {}
        self._inflight_storage: dict[int, list[TreeNode]] = {}  # node id -> the nodes of its backups
        self._prefetch_ops: dict[Any, Prefetch] = {}
        self._zombies: list[Prefetch] = []  # stopped, but the I/O thread still holds some of their slots
        self._host_pins: dict[int, int] = {}  # node id -> storage backups reading its host copy
        self._held_host: list[torch.Tensor] = []  # host slots let go of while the backend was busy with them
        if storage is None:
            return
        if model_id is None or not isinstance(model_id, str) or not model_id:
            raise ValueError("model_id: the storage tier needs the model's id (its bytes depend on the weights)")
        policy = prefetch_policy if isinstance(prefetch_policy, PrefetchPolicy) else PrefetchPolicy(prefetch_policy)
        backend = create_backend(storage, storage_config) if isinstance(storage, str) else storage
        group = self.controller.tp_group
        tp = {}
        if group is not None:
            import torch.distributed as dist  # noqa: PLC0415

            tp = {"tp_rank": dist.get_rank(group), "tp_size": dist.get_world_size(group)}
        namespace = Namespace.for_pool(self.host_pool, model_id, salt=storage_salt, **tp)
        self._storage = StorageTier(
            backend,
            self.host_pool,
            namespace,
            self.controller.agree_min,
            policy,
            threaded=self._storage_threads and self.controller.side_threads,
        )

    @property
    def storage(self: HiRadixCache) -> StorageTier | None:
        """The storage tier (None without ``storage=``)."""
        return self._storage

    # ------------------------------------------------------------------ keys
    def _keys_of(self: HiRadixCache, node: Any) -> list[str]:
        """The storage keys of ``node``'s pages (``ValueError`` for token ids outside ``[0, 2**32)``)."""
        chain = []
        x = node
        while x is not self.root and x.id not in self._node_keys:
            chain.append(x)
            x = x.parent
        prev = self._storage.root_digest if x is self.root else self._node_keys[x.id][-1]
        for y in reversed(chain):
            keys = page_keys(list(y.key), self.page_size, prev_digest=prev)
            self._node_keys[y.id] = keys
            prev = keys[-1]
        return self._node_keys[node.id]

    def _split_keys(self: HiRadixCache, lower_id: int, upper_id: int, at: int) -> None:
        keys = self._node_keys.get(lower_id)
        if keys is not None:
            k = at // self.page_size
            self._node_keys[upper_id], self._node_keys[lower_id] = keys[:k], keys[k:]

    # ------------------------------------------------------------------ backups
    def _after_host_copy(self: HiRadixCache, node: Any, host: torch.Tensor) -> None:
        """A backup's host copy landed (SYNCED): queue its pages for storage, the node host-pinned (the
        halves a later split takes off it are its ancestors: never host-only leaves while it stays)."""
        if self._storage is None or self._storage.closed:
            return
        chain = copy_chain(self.root, node, host)  # the node and the halves split off it, bottom-up
        try:
            keys = [k for x in reversed(chain) for k in self._keys_of(x)]
        except ValueError:  # token ids a key cannot hold: this prefix is not stored
            return
        if len(keys) * self.page_size != len(host):
            return
        # The storage threads read the host pages from now on: they must have landed (the deferred model
        # checks it; on a GPU the write's ack came from its completed event).
        device = self.controller.device
        if device.tracks_regions:
            device.check_read([KVRegion(self.host_pool, host)], f"the storage backup of node {node.id}")
        self._host_pins[node.id] = self._host_pins.get(node.id, 0) + 1
        self._inflight_storage.setdefault(node.id, []).append(node)
        self._storage.submit_backup(node.id, keys, host)

    def _take_storage(self: HiRadixCache, agreed: int | None = None) -> int:
        """Process the storage backups finished on every rank (``agreed`` of them when the step's one
        agreement counted them, else agreed here): unlock their nodes, count; free the host slots the
        backend has let go of."""
        if self._storage is None:
            return 0
        self._reap_zombies()
        done = self._storage.finished_backups(agreed)
        m = self.metrics
        page_bytes = self.host_pool.page_bytes
        for node_id, written, skipped, _pages, seconds, error in done:
            nodes = self._inflight_storage[node_id]
            node = nodes.pop(0)
            if not nodes:
                del self._inflight_storage[node_id]
            m.storage_pages_written += written
            m.storage_pages_skipped += skipped
            m.storage_bytes_written += written * page_bytes
            m.storage_write_time_s += seconds
            m.storage_backups_failed += int(error is not None)
            self._unpin_host(node)
        return len(done)

    def _host_pinned(self: HiRadixCache, node: Any) -> bool:
        """A storage backup still reads ``node``'s host copy: host eviction must leave it."""
        return node.id in self._host_pins

    def _unpin_host(self: HiRadixCache, node: Any) -> None:
        left = self._host_pins[node.id] - 1
        if left:
            self._host_pins[node.id] = left
        else:
            del self._host_pins[node.id]
            self._maybe_host_candidate(node)  # host eviction may take it again

    def check_storage(self: HiRadixCache) -> int:
        """Process finished storage backups (agreed across TP ranks): their nodes unlock. Returns how many.
        A scheduler calls it each step beside ``check_writes``; failed backups are counted in
        ``metrics.storage_backups_failed``, not raised."""
        self._check_open("check_storage")
        return self._take_storage()

    # ------------------------------------------------------------------ prefetches
    def prefetch_from_storage(self: HiRadixCache, request_id: Any, last_host_node: Any, tokens: Any) -> bool:
        """Ask for the stored pages of ``tokens`` beyond ``last_host_node``; call it when the request
        arrives, then :meth:`check_prefetch_progress` until it admits the request.

        Parameters
        ----------
        request_id : any hashable; names the prefetch in :meth:`check_prefetch_progress`.
        last_host_node : ``match_prefix(tokens).last_host_node``: the pages continue its prefix (it stays
            locked until the prefetch ends).
        tokens : the request's token ids (a list or 1-D integer tensor), the matched prefix included.

        Returns True when a prefetch was requested: the query thread keys the pages and asks the
        backend how many leading ones it holds, with no collective and no waiting here. False when
        fewer than the policy's ``threshold_tokens`` lie beyond the match (the same on every rank).
        Raises ``RuntimeError`` without a storage tier or after :meth:`close`, ``ValueError`` for a
        ``request_id`` already prefetching or a node no longer in the tree; nothing changes then.
        """
        self._check_open("prefetch_from_storage")
        tier = self._storage
        if tier is None:
            raise RuntimeError("prefetch_from_storage: this HiRadixCache has no storage tier (storage=...)")
        if request_id in self._prefetch_ops:
            raise ValueError(f"request_id: {request_id!r} already has a prefetch in flight")
        if last_host_node is not self.root and not self._attached(last_host_node):
            raise ValueError(f"last_host_node: {last_host_node} is not in the tree; match the tokens again")
        self._reap_zombies()
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
            prev = tier.root_digest if last_host_node is self.root else self._keys_of(last_host_node)[-1]
        except ValueError:
            return False  # the matched prefix holds token ids no key can hold (the same on every rank)
        self.inc_lock_ref(last_host_node)
        now = time.perf_counter()
        p = Prefetch(request_id, last_host_node, rest, prev, now, policy.deadline(now, len(rest)))
        self._prefetch_ops[request_id] = p
        tier.start_query(p)
        return True

    def check_prefetch_progress(self: HiRadixCache, request_id: Any) -> bool:
        """Whether the request may be admitted: :meth:`check_prefetches` of this one request.
        ``ValueError`` for an unknown ``request_id``."""
        return bool(self.check_prefetches([request_id]))

    def check_prefetches(self: HiRadixCache, request_ids: Iterable[Any]) -> list[Any]:
        """The requests among ``request_ids`` that may be admitted now, in the given order (every rank
        passes the same ids in the same order). Agreed across TP ranks in one collective for all of
        them when no prefetch changes state, and at most four when some do (the same on every rank),
        whatever their number: what a scheduler calls once per step.

        A prefetch whose query is done on every rank has its hit agreed (MIN), host slots allocated
        for it (making room in the host pool if needed) and its read started; a prefetch then ends by
        the policy: ``best_effort`` at once (a query not done yet ends it with nothing),
        ``wait_complete`` when every page is read or failed, ``timeout`` also at its deadline. When it
        ends, the pages that landed on every rank are in the tree as a host-only node under the matched
        node (match again, then ``load_back``). ``ValueError`` for an unknown or repeated id, before
        anything changes."""
        self._check_open("check_prefetches")
        ids = list(request_ids)
        ops: list[Prefetch] = []
        for rid in ids:
            p = self._prefetch_ops.get(rid)
            if p is None:
                raise ValueError(f"request_id: no prefetch in flight for {rid!r}")
            ops.append(p)
        if len({id(p) for p in ops}) != len(ops):
            raise ValueError("request_ids: an id appears more than once")
        if not ops:
            return []
        policy = self._storage.policy
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

    def _read_done(self: HiRadixCache, p: Prefetch, now: float) -> bool:
        """Whether this rank may end read ``p`` by the policy."""
        name = self._storage.policy.name
        if name == "best_effort":
            return True
        if name == "wait_complete":
            return p.complete
        return p.complete or now >= p.deadline

    def _alloc_prefetch(self: HiRadixCache, p: Prefetch, hit: int) -> torch.Tensor | None:
        """Host slots for the agreed ``hit`` pages of ``p`` (capped by the policy's ``max_host_tokens``,
        making room in the host pool if needed), or None when there is nothing worth reading or no room."""
        ps = self.page_size
        policy = self._storage.policy
        if policy.max_host_tokens is not None:
            held = sum(len(q.host_slots) for q in self._prefetch_ops.values())
            hit = min(hit, max(0, policy.max_host_tokens - held) // ps)
        if not policy.worth(hit * ps, ps):
            return None
        slots = self.host_pool.alloc(hit * ps)
        if slots is None:
            self.evict_host(hit * ps - self.host_pool.available_size())
            slots = self.host_pool.alloc(hit * ps)
        return slots

    def _start_read(self: HiRadixCache, p: Prefetch, slots: torch.Tensor) -> None:
        """Start reading ``p``'s agreed hit into ``slots`` (allocated on every rank)."""
        hit = len(slots) // self.page_size
        p.tokens, p.keys, p.host_slots, p.state = p.tokens[: hit * self.page_size], p.keys[:hit], slots, "read"
        self.metrics.prefetches += 1
        self._storage.start_prefetch(p)

    def _stop_read(self: HiRadixCache, p: Prefetch) -> None:
        """Stop ``p``'s read: the batch in flight completes (a hung backend is left behind); then
        ``p.landed`` pages are complete and no longer touched by the I/O thread."""
        p.cancel.set()
        p.finished.wait(IO_GRACE_S)

    def _finish_prefetch(
        self: HiRadixCache, p: Prefetch, insert: bool = True, agreed_landed: int | None = None
    ) -> None:
        """End ``p``: with ``insert``, the pages that landed on every rank become a host-only node
        (``agreed_landed``: their number when the caller agreed it after :meth:`_stop_read`; else
        stopped and agreed here)."""
        if p.state == "query":  # no read was started: no slots, nothing landed
            del self._prefetch_ops[p.request_id]
            self.dec_lock_ref(p.node)
            return
        if agreed_landed is None:
            self._stop_read(p)
            agreed = self.controller.agree_min(p.landed) if insert else 0
        else:
            agreed = int(agreed_landed) if insert else 0
        del self._prefetch_ops[p.request_id]
        ps = self.page_size
        m = self.metrics
        n = agreed * ps
        used = False
        if n:
            page = p.tokens[:ps]
            if self._tree is not None:
                taken = self._tree.core.child_for(p.node.id, page) >= 0
            else:
                taken = tuple(page) in p.node.children
            if taken:  # another insert cached (part of) these tokens meanwhile: theirs stay
                m.prefetches_discarded += 1
            else:
                slots = p.host_slots[:n]
                self.host_pool.mark_filled(slots)
                node = self._add_host_node(p.node, p.tokens[:n], slots)
                self._node_keys[node.id] = p.keys[:agreed]
                used = True
                m.storage_hit_tokens += n
                m.storage_pages_read += agreed
                m.storage_bytes_read += agreed * self.host_pool.page_bytes
        if agreed < len(p.keys):
            cut = m.prefetches_cut
            cut[self._storage.policy.name] = cut.get(self._storage.policy.name, 0) + 1
        m.prefetch_latency_s.append(time.perf_counter() - p.start)
        rest = p.host_slots[n:] if used else p.host_slots
        if p.finished.is_set():
            m.storage_read_time_s += p.read_s
            self._free_host(rest)  # held instead while a read the backend gave up on may still land in them
        else:
            p.host_slots = rest  # freed when the I/O thread returns (_reap_zombies)
            self._zombies.append(p)
        self.dec_lock_ref(p.node)

    def _add_host_node(self: HiRadixCache, parent: Any, tokens: list[int], host: torch.Tensor) -> Any:
        """A new host-only child of ``parent`` holding ``tokens`` in host slots ``host`` (SYNCED)."""
        if self._tree is not None:
            node = self._tree.node(self._tree.core.add_child(parent.id, tokens))
        else:
            node = TreeNode(next(self._ids), parent, tuple(tokens), self._tick())
            parent.children[node.key[: self.page_size]] = node
        node.host_value = host
        self._maybe_host_candidate(node)
        return node

    def _free_host(self: HiRadixCache, slots: torch.Tensor) -> None:
        """Return host slots the cache no longer uses to the host pool, or, while the storage backend may
        still read or write them (a call it gave up on), hold them in ``_held_host`` until it is done."""
        if not len(slots):
            return
        if self._storage is not None and self._storage.slots_busy(slots):
            self._held_host.append(slots)
        else:
            self.host_pool.free(slots)

    def _reap_zombies(self: HiRadixCache) -> None:
        """Free the slots of stopped prefetches whose I/O thread has let go of them, and the held host
        slots the backend is done with."""
        if self._zombies:
            for p in [z for z in self._zombies if z.finished.is_set()]:
                self._zombies.remove(p)
                self._free_host(p.host_slots)
        if self._held_host:
            held, self._held_host = self._held_host, []
            for slots in held:
                if self._storage.slots_busy(slots):
                    self._held_host.append(slots)
                else:
                    self.host_pool.free(slots)

    def _close_storage(self: HiRadixCache) -> None:
        """At close: stop every prefetch (nothing inserted), finish the queued backups, stop the threads."""
        if self._storage is None:
            return
        for p in list(self._prefetch_ops.values()):
            self._finish_prefetch(p, insert=False)
        self._storage.wait_backups()
        self._take_storage()
        for p in self._zombies:
            p.finished.wait(IO_GRACE_S)
        self._reap_zombies()
        end = time.perf_counter() + IO_GRACE_S  # one grace for every busy transfer together
        for slots in self._held_host:
            self._storage.slots_busy(slots, max(0.0, end - time.perf_counter()))
        self._reap_zombies()  # what is still busy stays allocated: the backend may yet touch it
        self._storage.close()
