"""HiRadixCache: a radix tree over token ids whose nodes hold KV on the device, the host, or both.

Model
-----
Keys are page-aligned token sequences (``page_size`` >= 1). A node's ``value`` holds its device
slots (None once evicted from the device) and ``host_value`` its host slots (None until backed up).
Invariants, checked by :meth:`HiRadixCache.verify`:

- every non-root node has a device copy, a host copy, or both;
- along any root-to-leaf path the device-resident nodes form a prefix: device eviction takes device
  *leaves* only, load-back and insert revive host-only nodes from the top;
- a node with a copy in flight (backup or load-back) is locked (``lock_ref > 0``), so it is never
  evicted from either tier while its slots are WRITING/LOADING; a node whose host copy a storage
  backup is reading is host-pinned (never evicted from the host until that backup ends; its device
  copy may go);
- every device and host slot is either free in its pool or owned by exactly one node;
- a host slot is WRITING / LOADING exactly while the controller has that backup / load-back (queued,
  running or acknowledged but not processed), and each such copy holds one lock on its node.

Write policies (the controller's ``write_policy``): ``write_through`` backs up each new node on
insert; ``write_through_selective`` backs up a node when its hit count reaches
``write_through_threshold`` (default 2); ``write_back`` backs up only when the node is evicted.

Outcomes when memory runs out (all documented, none raises): a backup that finds the host pool full
evicts host-only leaves first and is skipped if still no room (the node stays device-only; counted in
``metrics.writes_refused_host_full``); a load-back that cannot get device slots, even after evicting,
is skipped and returns None (the caller recomputes; counted in ``metrics.load_backs_skipped``), as is
one shorter than ``load_back_threshold`` tokens or larger than the caller's budget; device eviction
of a node with no host copy (and, under ``write_back``, no host room) deletes it.

Errors: a bad argument raises (``TypeError`` / ``ValueError`` naming it) before anything changes.
A failed copy is rolled back when its ack is processed (:mod:`hicache.cache.copy_acks`), and that call
(``check_writes``, ``check_loads``, ``flush``, ``close``, or ``evict`` under ``write_back``) then
raises :class:`~hicache.controller.copy_errors.CopyError`. After :meth:`close`, every call that would change the
tree raises ``RuntimeError``; :meth:`verify`, the size queries and ``dec_lock_ref`` still work.

Timestamps are a logical clock, so tensor-parallel ranks that see the same requests order evictions
identically.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..controller.controller import HiCacheController
from ..controller.metrics import CacheMetrics
from ..pools import DeviceKVPool, HostKVPool
from ..storage import StorageBackend
from ..storage.tier import PrefetchPolicy, StorageTier
from ..tree.core import CompiledNode, choose_core
from ..tree.nodes import MatchResult, TreeNode
from ..tree.policies import EvictionPolicy, get_policy
from .cache_tree import CacheTree
from .copy_acks import CopyAcks
from .eviction import Eviction
from .invariants import check_invariants, check_kept
from .load_backs import LoadBacks
from .lookups import Lookups
from .namespaces import RequestNamespaces
from .storage_ops import HeldHostSlots, StorageOps, create_tier
from .windows import WindowCut

__all__ = ["CompiledNode", "HiRadixCache", "MatchResult", "TreeNode"]


class HiRadixCache:
    """A two-tier radix cache (see module docstring).

    Parameters
    ----------
    device_pool, host_pool : the pools; ``host_pool.page_size`` must equal ``device_pool.page_size``.
    controller : the :class:`~hicache.controller.HiCacheController` to use; built from the keyword
        arguments below when None (and then closed by :meth:`close`).
    io_backend, write_policy, tp_group, threaded, device_model : passed to the controller it builds
        (``threaded``, default None: copies issued from the caller's thread on a GPU, on worker threads
        for CPU pools; ``False`` also makes the storage tier read and write inline, else on its threads;
        ``device_model``: a :class:`~hicache.streams.deferred.DeferredDevice` for CPU pools, see
        :class:`~hicache.controller.HiCacheController`).
    eviction_policy : ``lru`` (default), ``lfu``, ``slru``, ``fifo``, ``priority`` or an object with
        ``key(node)``; used for both tiers.
    load_back_threshold : host hits shorter than this many tokens are not loaded back (default 10).
    write_through_threshold : hits that trigger a backup under ``write_through_selective`` (default 2).
    tree_core : ``"auto"`` (default; None reads the ``HICACHE_TREE_CORE`` environment variable, default
        ``"auto"``), ``"compiled"`` or ``"python"``: which core holds the tree (:mod:`hicache.tree.core`).
        ``auto`` takes the compiled core when the host core ``hicache._core`` is built; ``compiled`` raises
        ``RuntimeError`` naming why it cannot. ``tree_core`` / ``tree_core_reason`` tell the choice.
    storage : the storage tier below the host pool (:mod:`hicache.cache.storage_ops`): a
        :class:`~hicache.storage.StorageBackend`, or a backend name / ``module:Class`` built with
        ``storage_config`` (a dict or a JSON/TOML path). None (default): no storage tier.
    model_id : required with ``storage``: names the weights in the page keys' namespace.
    storage_salt : optional; caches with different salts never share stored pages.
    storage_head_group : K/V heads per stored object of an MHA page (default 1; a divisor of this rank's
        heads, else ``ValueError``): caches of one model with any TP size and host layout share stored
        pages when they use the same group size (:mod:`hicache.storage.objects`). Ignored for MLA.
    prefetch_policy : ``best_effort`` (default), ``wait_complete``, ``timeout``, or a
        :class:`~hicache.storage.tier.PrefetchPolicy` (thresholds, timeouts, host-slot cap).
    sidecars : per-token pools beside the KV, ``(DeviceKVPool, HostKVPool)`` pairs sharing the KV pools'
        slot numbering (a sparse-attention indexer's FP8 keys and scales, in any item shape): every
        backup and load-back moves them with the KV in one acknowledged copy, so a page is never on a
        tier without its sidecar (:func:`hicache.controller.controller.check_sidecars`). With a storage
        tier (MLA pages only, else ``ValueError``) each stored page object carries the sidecars' rows after
        the KV, and the namespace describes them: pages stored with sidecars are read only with them.
    """

    # The components (each owns its state; this class composes them and checks the calls):
    #   tree       CacheTree   nodes, locks, host pins, kept sizes, eviction candidates, lost nodes
    #   lookups    Lookups     match_prefix and insert on the request path
    #   eviction   Eviction    picks and drops victims of both tiers
    #   copies     CopyAcks    backups and load-backs in flight, their acks and roll-backs
    #   load_backs LoadBacks   load-back decisions and their TP agreement
    #   storage_ops StorageOps storage backups and prefetches (a no-op without a storage tier)

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        controller: HiCacheController | None = None,
        *,
        io_backend: Any = "auto",
        write_policy: str = "write_through",
        tp_group: Any = None,
        threaded: bool | None = None,
        eviction_policy: str | EvictionPolicy = "lru",
        load_back_threshold: int = 10,
        write_through_threshold: int = 2,
        tree_core: str | None = None,
        storage: str | StorageBackend | None = None,
        storage_config: Any = None,
        model_id: str | None = None,
        storage_salt: str | None = None,
        storage_head_group: int = 1,
        prefetch_policy: str | PrefetchPolicy = "best_effort",
        device_model: Any = None,
        sidecars: Any = (),
        window: Any = None,
    ) -> None:
        if host_pool.page_size != device_pool.page_size:
            raise ValueError(
                f"host_pool: page_size {host_pool.page_size} differs from the device pool's {device_pool.page_size}"
            )
        if load_back_threshold < 0:
            raise ValueError(f"load_back_threshold: expected >= 0, got {load_back_threshold}")
        if write_through_threshold < 1:
            raise ValueError(f"write_through_threshold: expected >= 1, got {write_through_threshold}")
        self.tree_core, self.tree_core_reason = choose_core(tree_core)
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._owns_controller = controller is None
        self.controller = controller or HiCacheController(
            device_pool, host_pool, io_backend=io_backend, write_policy=write_policy, tp_group=tp_group,
            threaded=threaded, device_model=device_model, sidecars=sidecars, window=window,
        )  # fmt: skip
        if controller is not None and (sidecars or window is not None):
            raise ValueError("sidecars, window: give them to the controller (HiCacheController(..., sidecars=...))")
        self.write_policy = self.controller.write_policy
        self.policy = get_policy(eviction_policy)
        self.page_size = device_pool.page_size
        self._closed = False
        try:
            tier = create_tier(
                storage, storage_config, model_id, storage_salt, prefetch_policy, host_pool, self.controller,
                threaded=threaded is not False and self.controller.side_threads, head_group=storage_head_group,
            )  # fmt: skip
        except BaseException:
            if self._owns_controller:
                self.controller.close(drain=False)
            raise
        held = HeldHostSlots(host_pool, tier)
        metrics = self.controller.metrics
        self.tree = CacheTree(device_pool, self.tree_core, self.policy, metrics, release_host=held.free)
        self.root = self.tree.root
        self.lookups = Lookups(self.tree, self.write_policy, write_through_threshold, metrics)
        self.eviction = Eviction(self.tree)
        self.namespaces = RequestNamespaces()
        self.storage_ops = StorageOps(
            self.tree, host_pool, self.controller, tier, held, self.evict_host, self.namespaces
        )
        self.copies = CopyAcks(
            self.tree, self.controller, host_pool, self.evict_host,
            host_copy_landed=None if tier is None else self.storage_ops.host_copy_landed,
        )  # fmt: skip
        self.load_backs = LoadBacks(
            self.tree, device_pool, self.controller, self.copies, self.evict, load_back_threshold
        )
        w = self.controller.window
        self.window_cut = None if w is None else WindowCut(self.tree, w)

    @property
    def load_back_threshold(self) -> int:
        """Host hits shorter than this many tokens are not loaded back (settable)."""
        return self.load_backs.threshold

    @load_back_threshold.setter
    def load_back_threshold(self, tokens: int) -> None:
        self.load_backs.threshold = tokens

    @property
    def write_through_threshold(self) -> int:
        """Hits that make a node worth a backup under ``write_through_selective`` (settable)."""
        return self.lookups.write_through_threshold

    @write_through_threshold.setter
    def write_through_threshold(self, hits: int) -> None:
        self.lookups.write_through_threshold = hits

    @property
    def metrics(self) -> CacheMetrics:
        return self.controller.metrics

    @property
    def storage(self) -> StorageTier | None:
        """The storage tier (None without ``storage=``)."""
        return self.storage_ops.tier

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called, or the controller was closed."""
        return self._closed or self.controller.closed

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"{method}: the HiRadixCache is closed")
        if self.controller.closed:
            raise RuntimeError(f"{method}: the HiRadixCache's controller is closed")

    # ------------------------------------------------------------------ lookups and inserts
    def match_prefix(self, tokens: Any, extra_key: Any = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` (a list or 1-D tensor of ints), page-aligned, among the
        prefixes inserted with the same ``extra_key`` (None, or a str / bytes / int naming a request
        namespace: a LoRA adapter, a tenant's cache salt; :mod:`hicache.cache.namespaces`)."""
        self._check_open("match_prefix")
        held = self.namespaces.tokens(tokens, extra_key)
        if self.window_cut is not None:  # a sliding-window model resumes only where its windows are whole
            usable, matched = self.window_cut.usable(held)
            if usable < matched:
                result, backups = self.lookups.match(held[:usable])
                self.metrics.miss_tokens += len(held) - usable
                self.metrics.window_cut_tokens += matched - usable
                if backups:
                    self.copies.backup_many(backups)
                return result
        result, backups = self.lookups.match(held)
        if backups:
            self.copies.backup_many(backups)  # every node this hit made worth a backup, in one copy op
        return result

    def insert(self, tokens: Any, device_indices: torch.Tensor, priority: int = 0, extra_key: Any = None) -> int:
        """Insert ``tokens`` whose KV sits in ``device_indices`` (one slot per token, page-aligned).

        Parameters
        ----------
        tokens : a page-aligned list or 1-D tensor of token ids.
        extra_key : None, or the request's namespace (as in :meth:`match_prefix`): only requests with
            the same ``extra_key`` ever match what this inserts, on any tier.
        device_indices : 1-D integer tensor, allocated device slots, whole pages in order, no slot twice.
            Where the tree already holds the tokens on the device, each slot must be either the tree's
            own slot for that token (as ``match_prefix`` returned it) or one of the caller's that the
            tree does not own; everywhere else they must be the caller's: the tree takes them.

        Returns
        -------
        ``dup``: how many leading tokens were already cached on the device. The tree takes no slot of
        ``device_indices[:dup]``: there, the tree's own slots stay the tree's (never free them) and the
        caller's stay the caller's (free them, or the pool leaks). A caller that passed the
        ``match_prefix`` result (``hit`` slots) followed by its own slots frees exactly
        ``device_indices[hit:dup]`` (empty unless another insert cached more of the key meanwhile), never
        ``device_indices[:dup]``. The rest of ``device_indices`` now belongs to the tree. Host-only nodes
        along the way are revived with the caller's slots (their host copy stays valid).

        Raises ``TypeError`` / ``ValueError`` naming ``device_indices`` (or ``RuntimeError`` after
        :meth:`close`) before changing anything, also when a slot of ``device_indices[:dup]`` is owned by
        the tree but is not the tree's slot for that token (freeing it as a duplicate would corrupt
        the cache).
        """
        self._check_open("insert")
        dup, backups = self.lookups.insert(self.namespaces.tokens(tokens, extra_key), device_indices, priority)
        if backups:
            self.copies.backup_many(backups)
        return dup

    # ------------------------------------------------------------------ locks
    def adopt_window_rows(self, tokens: Any, device_indices: torch.Tensor, extra_key: Any = None) -> int:
        """After an :meth:`insert` of ``tokens`` from ``device_indices`` that found pages cached already
        (the caller frees its copies of them next): the window rows of the caller's copies move to the
        cached pages that have none (a window pool; a no-op without one), so the inserted sequence's
        window stays whole. Returns the pages whose rows moved."""
        self._check_open("adopt_window_rows")
        if self.window_cut is None:
            return 0
        cached = self.window_cut.device_slots(self.namespaces.tokens(tokens, extra_key))
        n = min(len(cached), len(device_indices))
        return self.controller.window.adopt(device_indices[:n], cached[:n])

    def window_rows_to_load(self, node: TreeNode) -> int:
        """Tokens of window rows :meth:`load_back` of ``node`` would take from the window pool (0 without
        one): room a caller makes before asking."""
        return 0 if self.window_cut is None else self.window_cut.rows_to_load(node)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (e.g. while a request uses the prefix)."""
        self.tree.inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release a lock taken with :meth:`inc_lock_ref`; raises if a count would go negative."""
        self.tree.dec_lock_ref(node)

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots if possible, least valuable device leaves first.

        Backed-up nodes keep their host copy and stay in the tree; others are written to the host
        first under ``write_back``, else deleted. Returns the device slots freed. Under ``write_back``,
        :class:`CopyError` when a backup failed (nothing is evicted then).
        """
        self._check_open("evict")
        chosen = self.eviction.pick_device(num_tokens)
        if self.write_policy == "write_back":
            pending = [x for x in chosen if x.host_value is None]
            if pending:
                try:
                    self.copies.backup_many(pending)  # one copy op for all of them
                    # Write-back: the host copy must exist before the device copy goes (the storage backups
                    # these host copies start are not waited for). Only backups are waited for: queued
                    # load-backs are not started here (under agree="step" they are not agreed yet).
                    self.controller.flush_writes()
                    self.check_acks()
                except BaseException:  # nothing is evicted: the picked nodes are candidates again
                    self.eviction.unpick(chosen)
                    raise
                chosen = [x for x in chosen if x.value is not None]  # acks may have released lost subtrees
        return self.eviction.drop(chosen)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots if possible by deleting host-only leaves."""
        self._check_open("evict_host")
        return self.eviction.evict_host(num_tokens)

    # ------------------------------------------------------------------ load-backs
    def load_back(self, node: TreeNode, mem_quota: int | None = None, *, agree: str = "now") -> torch.Tensor | None:
        """Bring the host-only part of the prefix ending at ``node`` back to device slots
        (:mod:`hicache.cache.load_backs`).

        Returns the new device slots (in prefix order; the copy starts with :meth:`start_loading` and
        the nodes stay locked until its ack is processed), or None when skipped: nothing to load,
        fewer than ``load_back_threshold`` tokens, more than ``mem_quota`` tokens, or more than the
        free plus evictable device slots (then nothing is evicted).

        ``agree``: ``"now"`` agrees the decision across TP ranks before returning (one collective);
        ``"step"`` leaves it to the step's :meth:`agree_load_backs`, which may revoke the slots returned
        here, and records an error inside the load-back (then None here) for it to raise.

        Raises (and changes nothing) ``TypeError`` / ``ValueError`` naming ``node``, ``mem_quota`` or
        ``agree``: ``node`` must be a node of this tree still in it (a host eviction after the match may
        have deleted it: match again); ``RuntimeError`` after :meth:`close`.
        """
        self._check_open("load_back")
        return self.load_backs.load_back(node, mem_quota, agree)

    def agree_load_backs(self) -> list[int]:
        """Settle the step's ``agree="step"`` load-backs across TP ranks in ONE collective (none without a
        group or without such load-backs): one that did not go on every rank is revoked where it went
        (its device slots freed, its nodes host-only again, its lock released; no copy had started).
        Returns the ids of the revoked load-backs' ``node`` arguments, in call order; raises the first
        error recorded inside this rank's load-backs, after settling them."""
        self._check_open("agree_load_backs")
        return self.load_backs.agree()

    def start_loading(self) -> int:
        """Start the queued load-backs as one layer-by-layer batch (see the controller). Load-backs
        decided with ``agree="step"`` must be settled by :meth:`agree_load_backs` first
        (``RuntimeError`` otherwise: a copy that starts cannot be revoked)."""
        self._check_open("start_loading")
        if self.load_backs.step:
            raise RuntimeError(
                f"start_loading: {len(self.load_backs.step)} load-back(s) decided with agree='step' are not "
                "settled; call agree_load_backs() first"
            )
        return self.controller.start_loading()

    # ------------------------------------------------------------------ acks
    def check_writes(self) -> int:
        """Process finished backups (agreed across TP ranks): host slots become SYNCED, nodes unlock.
        Returns how many were processed; raises :class:`CopyError` after rolling back failed ones."""
        failures: list = []
        n = self.copies.take_writes(failures)
        self.storage_ops.take_backups()  # storage backups that finished: nodes unpin (no collective without storage)
        self.copies.raise_failures(failures)
        return n

    def check_loads(self) -> int:
        """Process finished load-backs: host slots back to SYNCED, nodes unlock, latency recorded.
        Returns how many were processed; raises :class:`CopyError` after rolling back failed ones."""
        failures: list = []
        n = self.copies.take_loads(failures)
        self.copies.raise_failures(failures)
        return n

    def check_acks(self) -> int:
        """Process the finished backups and load-backs of this step and the storage tier's finished
        backups together, agreed across TP ranks in ONE collective (:meth:`check_writes` and
        :meth:`check_loads` take one or two each). Returns how many copies were processed; raises
        :class:`CopyError` after rolling back failed ones. What a scheduler calls once per step."""
        failures: list = []
        tier = self.storage_ops.tier
        counts = None if tier is None else {"storage": tier.landed_backups()}
        done = self.controller.finished(counts=counts)
        n = self.copies.take_writes(failures, done["write"]) + self.copies.take_loads(failures, done["load"])
        self.storage_ops.take_backups(done["counts"].get("storage"))
        self.copies.raise_failures(failures)
        return n

    def check_storage(self) -> int:
        """Process finished storage backups (agreed across TP ranks): their nodes unpin. Returns how many.
        A scheduler calls it each step beside ``check_writes``; failed backups are counted in
        ``metrics.storage_backups_failed``, not raised."""
        self._check_open("check_storage")
        return self.storage_ops.take_backups()

    # ------------------------------------------------------------------ storage prefetches
    def prefetch_from_storage(self, request_id: Any, last_host_node: Any, tokens: Any, extra_key: Any = None) -> bool:
        """Ask for the stored pages of ``tokens`` beyond ``last_host_node``; call it when the request
        arrives, then :meth:`check_prefetch_progress` until it admits the request.

        Parameters
        ----------
        request_id : any hashable; names the prefetch in :meth:`check_prefetch_progress`.
        last_host_node : ``match_prefix(tokens).last_host_node``: the pages continue its prefix (it stays
            locked until the prefetch ends).
        tokens : the request's token ids (a list or 1-D integer tensor), the matched prefix included.
        extra_key : the request's namespace, as given to :meth:`match_prefix` (the storage keys of a
            namespace's pages differ from every other's).

        Returns True when a prefetch was requested: the query thread keys the pages and asks the
        backend how many leading ones it holds, with no collective and no waiting here. False when
        fewer than the policy's ``threshold_tokens`` lie beyond the match (the same on every rank).
        Raises ``RuntimeError`` without a storage tier or after :meth:`close`, ``ValueError`` for a
        ``request_id`` already prefetching or a node no longer in the tree; nothing changes then.
        """
        self._check_open("prefetch_from_storage")
        return self.storage_ops.request(request_id, last_host_node, self.namespaces.tokens(tokens, extra_key))

    def check_prefetch_progress(self, request_id: Any) -> bool:
        """Whether the request may be admitted: :meth:`check_prefetches` of this one request.
        ``ValueError`` for an unknown ``request_id``."""
        return bool(self.check_prefetches([request_id]))

    def check_prefetches(self, request_ids: Iterable[Any]) -> list[Any]:
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
        return self.storage_ops.check(request_ids)

    # ------------------------------------------------------------------ state
    def flush(self) -> None:
        """Wait for every copy in flight and process the acks (:class:`CopyError` for failed ones)."""
        self._check_open("flush")
        if self.load_backs.step:  # settled first: a queued load-back may not start unagreed
            self.agree_load_backs()
        self.controller.flush()
        self.check_acks()
        tier = self.storage_ops.tier
        if tier is not None:  # the backups the acks above queued, too
            tier.wait_backups()
            self.storage_ops.take_backups()

    def evictable_size(self) -> int:
        """Device tokens in unlocked nodes (kept as nodes change: no walk)."""
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        """Device tokens in locked nodes (kept as nodes change: no walk)."""
        return self.tree.protected

    def verify(self, external_device: torch.Tensor | None = None) -> None:
        """Check every invariant of the module docstring; raises AssertionError naming the first broken.

        ``external_device``: device slots allocated outside the tree (e.g. held by running requests).
        The tree's copies in flight are compared with the controller's: a controller that also serves
        other callers fails this check.
        """
        check_invariants(
            self.tree, self.device_pool, self.host_pool, self.controller, self.copies, self.storage_ops,
            external_device,
        )  # fmt: skip
        check_kept(self.tree)
        if self.controller.window is not None:
            self.controller.window.check()

    def close(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Stop the cache: afterwards no call changes the tree (they raise ``RuntimeError``).

        Parameters
        ----------
        drain : wait for every queued copy (queued load-backs are started) and process its ack.
            ``False`` drops the copies not yet running: their nodes are rolled back (a dropped backup
            leaves its node device-only, a dropped load-back puts its nodes back to host-only) and a
            dropped load batch fails its layer-counter waiters. Dropping needs closing the controller,
            so it is refused (``ValueError``) for a controller passed in and still open.
        timeout : seconds to wait for each worker thread of a controller built here.

        The controller's threads are released whatever happened (failed copies included); then the
        acks are processed, so no node stays locked by a copy and ``verify()`` holds. Raises
        :class:`CopyError` at the end if a copy failed. Idempotent.
        """
        if not drain and not self._owns_controller and not self.controller.closed:
            raise ValueError(
                "drain: dropping queued copies closes the controller, and this cache did not build it; "
                "close the controller (controller.close(drain=False)) first, or drain"
            )
        self._closed = True
        if self._owns_controller:
            self.controller.close(drain=drain, timeout=timeout)  # runs or drops what is queued, joins
        elif drain and not self.controller.closed:
            self.controller.flush()  # the controller stays open: it is not the cache's to close
        try:
            self.check_acks()
        finally:
            self.storage_ops.close()

    def __enter__(self) -> HiRadixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
