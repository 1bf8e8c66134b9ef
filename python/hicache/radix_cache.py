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
A failed copy is rolled back when its ack is processed (:mod:`hicache.copy_acks`), and that call
(``check_writes``, ``check_loads``, ``flush``, ``close``, or ``evict`` under ``write_back``) then
raises :class:`~hicache.copy_errors.CopyError`. After :meth:`close`, every call that would change the
tree raises ``RuntimeError``; :meth:`verify`, the size queries and ``dec_lock_ref`` still work.

Timestamps are a logical clock, so tensor-parallel ranks that see the same requests order evictions
identically.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from .candidates import Candidates, CompiledCandidates, compiled_policy
from .controller import HiCacheController
from .copy_acks import CopyAcks
from .eviction import Eviction
from .invariants import check_invariants, check_kept
from .load_backs import LoadBacks, _StepLoad
from .metrics import CacheMetrics
from .policies import EvictionPolicy, get_policy
from .pools import DeviceKVPool, HostKVPool
from .slot_check import TreeDeviceSlots
from .storage import StorageBackend
from .storage.tier import PrefetchPolicy
from .storage_ops import StorageOps
from .tree import MatchResult, TreeNode, is_attached, match_path, page_key, subtree
from .tree_core import TOUCH, CompiledNode, CompiledTree, choose_core, token_source

__all__ = ["CompiledNode", "HiRadixCache", "MatchResult", "TreeNode"]


class _LostNodes(dict):
    """``HiRadixCache._lost`` (id -> node): the compiled core keeps a copy of membership as a flag, which
    ``match_prefix`` reads."""

    __slots__ = ("core",)

    def __init__(self, core: Any) -> None:
        super().__init__()
        self.core = core

    def __setitem__(self, node_id: int, node: Any) -> None:
        super().__setitem__(node_id, node)
        if self.core is not None:
            self.core.set_flag(node_id, 1, True)

    def __delitem__(self, node_id: int) -> None:
        super().__delitem__(node_id)
        if self.core is not None and self.core.alive(node_id):
            self.core.set_flag(node_id, 1, False)


class HiRadixCache(CopyAcks, Eviction, LoadBacks, StorageOps):
    """A two-tier radix cache (see module docstring).

    Parameters
    ----------
    device_pool, host_pool : the pools; ``host_pool.page_size`` must equal ``device_pool.page_size``.
    controller : the :class:`~hicache.controller.HiCacheController` to use; built from the keyword
        arguments below when None (and then closed by :meth:`close`).
    io_backend, write_policy, tp_group, threaded, device_model : passed to the controller it builds
        (``threaded``, default None: copies issued from the caller's thread on a GPU, on worker threads
        for CPU pools; ``False`` also makes the storage tier read and write inline, else on its threads;
        ``device_model``: a :class:`~hicache.deferred.DeferredDevice` for CPU pools, see
        :class:`~hicache.controller.HiCacheController`).
    eviction_policy : ``lru`` (default), ``lfu``, ``slru``, ``fifo``, ``priority`` or an object with
        ``key(node)``; used for both tiers.
    load_back_threshold : host hits shorter than this many tokens are not loaded back (default 10).
    write_through_threshold : hits that trigger a backup under ``write_through_selective`` (default 2).
    tree_core : ``"auto"`` (default; None reads the ``HICACHE_TREE_CORE`` environment variable, default
        ``"auto"``), ``"compiled"`` or ``"python"``: which core holds the tree (:mod:`hicache.tree_core`).
        ``auto`` takes the compiled core when the extension is built; ``compiled`` raises
        ``RuntimeError`` naming why it cannot. ``tree_core`` / ``tree_core_reason`` tell the choice.
    storage : the storage tier below the host pool (:mod:`hicache.storage_ops`): a
        :class:`~hicache.storage.StorageBackend`, or a backend name / ``module:Class`` built with
        ``storage_config`` (a dict or a JSON/TOML path). None (default): no storage tier.
    model_id : required with ``storage``: names the weights in the page keys' namespace.
    storage_salt : optional; caches with different salts never share stored pages.
    prefetch_policy : ``best_effort`` (default), ``wait_complete``, ``timeout``, or a
        :class:`~hicache.storage.tier.PrefetchPolicy` (thresholds, timeouts, host-slot cap).
    """

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
        prefetch_policy: str | PrefetchPolicy = "best_effort",
        device_model: Any = None,
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
        self._storage_threads = threaded is not False
        self.controller = controller or HiCacheController(
            device_pool, host_pool, io_backend=io_backend, write_policy=write_policy, tp_group=tp_group,
            threaded=threaded, device_model=device_model,
        )  # fmt: skip
        self.write_policy = self.controller.write_policy
        self.policy = get_policy(eviction_policy)
        self.page_size = device_pool.page_size
        self.load_back_threshold = load_back_threshold
        self.write_through_threshold = write_through_threshold
        self._ids = itertools.count(1)
        self._clock = 0
        self._closed = False
        self._slots = TreeDeviceSlots(device_pool, self._nodes)
        self._tree: CompiledTree | None = None
        if self.tree_core == "compiled":
            self._tree = CompiledTree(self.page_size, device_pool._state_array(), self._slots.owned)
            self.root: TreeNode | CompiledNode = self._tree.node(0)
            self._touch_mode = TOUCH[self.write_policy]
        else:
            self.root = TreeNode(0, None, (), 0)
        self.root.lock_ref = 1  # never evicted
        # Kept as nodes change, so that nothing on the request path walks the tree: device tokens in
        # locked nodes (the tree's device tokens are self._slots.count), and each tier's eviction
        # candidates in policy order (None for a policy that cannot be kept ordered: sorted per eviction).
        self._protected = 0
        self._chosen: set[int] = set()  # the nodes an eviction in progress has picked
        ordered = getattr(self.policy, "monotonic", False) is True
        code = compiled_policy(self.policy) if self._tree is not None else None
        self._device_candidates: Candidates | CompiledCandidates | None = None
        self._host_candidates: Candidates | CompiledCandidates | None = None
        if code is not None:  # a built-in policy over the compiled core: the heaps live in the core
            self._device_candidates = CompiledCandidates(self._tree, code, self._is_device_candidate)
            self._host_candidates = CompiledCandidates(self._tree, code, self._is_host_candidate)
        elif ordered:
            self._device_candidates = Candidates(self.policy.key, self._is_device_candidate)
            self._host_candidates = Candidates(self.policy.key, self._is_host_candidate)
        self._inflight_writes: dict[int, tuple[TreeNode, torch.Tensor]] = {}
        self._inflight_loads: dict[int, tuple[TreeNode, torch.Tensor, float]] = {}
        self._step_loads: list[_StepLoad] = []  # agree="step" load-backs awaiting agree_load_backs()
        # Nodes whose load-back failed while others held them locked: device KV lost, dropped at the last unlock.
        self._lost: dict[int, Any] = _LostNodes(None if self._tree is None else self._tree.core)
        try:
            self._init_storage(storage, storage_config, model_id, storage_salt, prefetch_policy)
        except BaseException:
            if self._owns_controller:
                self.controller.close(drain=False)
            raise

    @property
    def metrics(self) -> CacheMetrics:
        return self.controller.metrics

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called, or the controller was closed."""
        return self._closed or self.controller.closed

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"{method}: the HiRadixCache is closed")
        if self.controller.closed:
            raise RuntimeError(f"{method}: the HiRadixCache's controller is closed")

    # ------------------------------------------------------------------ helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Split ``child`` after ``at`` tokens; returns the new upper node (which inherits locks and
        counters: a lock on any descendant covers it too)."""
        upper = TreeNode(next(self._ids), child.parent, child.key[:at], child.creation_time)
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.last_access_time = child.last_access_time
        upper.priority = child.priority
        if child.value is not None:
            upper.value, child.value = child.value[:at], child.value[at:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:at], child.host_value[at:]
        if child.id in self._lost:
            self._lost[upper.id] = upper
        child.parent.children[child.key[: self.page_size]] = upper
        if self._node_keys:
            self._split_keys(child.id, upper.id, at)
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    def _touch(self, node: TreeNode) -> bool:
        """A hit on ``node``; True when ``write_through_selective`` now wants it backed up (the caller
        backs up every such node of one call in one copy op, :meth:`_backup_many`)."""
        node.last_access_time = self._tick()
        node.hit_count += 1
        return (
            self.write_policy == "write_through_selective"
            and node.hit_count >= self.write_through_threshold
            and node.value is not None
            and node.host_value is None
        )

    # ------------------------------------------------------------------ lookups and inserts
    def match_prefix(self, tokens: Any) -> MatchResult:
        """Longest cached prefix of ``tokens`` (a list or 1-D tensor of ints), page-aligned."""
        self._check_open("match_prefix")
        if self._tree is not None:
            return self._match_compiled(tokens)
        key = page_key(tokens, self.page_size)
        device: list[torch.Tensor] = []
        last_device = last_host = self.root
        host_len = 0
        dev_len = 0
        path, _, cut = match_path(self.root, key, self.page_size)
        if cut:
            path[-1] = self._split(path[-1], cut)
        touch = self._touch if self.write_policy == "write_through_selective" else None
        backups: list[TreeNode] = []
        lost = self._lost
        for node in path:
            if lost and node.id in lost:
                break  # its device KV is lost (failed load-back) and it has no usable copy until released
            if touch is None:  # _touch, inlined: the clock ticks once per node
                self._clock += 1
                node.last_access_time = self._clock
                node.hit_count += 1
            elif touch(node):
                backups.append(node)
            if node.value is not None:
                device.append(node.value)
                dev_len += len(node.key)
                last_device = node
            else:
                host_len += len(node.key)
            last_host = node
        if backups:
            self._backup_many(backups)  # every node this hit made worth a backup, in one copy op
        indices = torch.cat(device) if device else torch.empty(0, dtype=torch.int64)  # a copy: the caller's
        m = self.metrics
        m.device_hit_tokens += dev_len
        m.host_hit_tokens += host_len
        m.miss_tokens += len(tokens) - dev_len - host_len
        return MatchResult(indices, last_device, last_host, host_len)

    def insert(self, tokens: Any, device_indices: torch.Tensor, priority: int = 0) -> int:
        """Insert ``tokens`` whose KV sits in ``device_indices`` (one slot per token, page-aligned).

        Parameters
        ----------
        tokens : a page-aligned list or 1-D tensor of token ids.
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
        if self._tree is not None:
            return self._insert_compiled(tokens, device_indices, priority)
        key = page_key(tokens, self.page_size)
        if len(key) != len(tokens):
            raise ValueError(
                f"tokens: expected a page-aligned key (a multiple of page_size {self.page_size}), got {len(tokens)}; "
                "device_indices: one slot per token"
            )
        s = self._slots.as_array(device_indices, len(key))
        path, end, cut = match_path(self.root, key, self.page_size)
        # Device-resident nodes come first on a path (invariant); the host-only ones after them get the
        # caller's slots, as does everything past the match.
        dup = 0
        cached: list[torch.Tensor] = []
        for node in path:
            if node.value is None:
                break
            if cut and node is path[-1]:
                cached.append(node.value[:cut])
                dup += cut
            else:
                cached.append(node.value)
                dup += len(node.key)
        # Usually the caller passes the tree's own slots back for the cached part: those need no check
        # (allocated, whole pages, and owned, so distinct from the unowned ones the tree takes), only
        # the rest does. Anything else, or a fault, goes through the full check, which names it.
        slots = self._slots
        try:
            fast = slots.is_cached(s[:dup], cached)
            if fast:
                slots.check(s[dup:])
                slots.check_unowned(s[dup:])
        except ValueError:
            fast = False
        if not fast:
            slots.check_insert(s, dup, cached)
        # Checked: from here on nothing raises. One copy of the slots the tree takes (the caller keeps
        # its tensor); the nodes hold views of it.
        taken = torch.from_numpy(s[dup:].copy())
        if cut:
            path[-1] = self._split(path[-1], cut)
        touch = self._touch if self.write_policy == "write_through_selective" else None
        backups: list[TreeNode] = []
        node, pos = self.root, 0
        for node in path:
            n = len(node.key)
            if node.value is None:
                node.value = taken[pos - dup : pos - dup + n]
                self._slots.take(node.value)
                self._gained_device(node)
            if priority > node.priority:
                node.priority = priority
            if touch is None:  # _touch, inlined
                self._clock += 1
                node.last_access_time = self._clock
                node.hit_count += 1
            elif touch(node):
                backups.append(node)
            pos += n
        if pos < len(key):
            new = TreeNode(next(self._ids), node, key[pos:], self._tick())
            new.value = taken[pos - dup :]
            self._slots.take(new.value)
            new.priority = priority
            node.children[new.key[: self.page_size]] = new
            new.hit_count = 1
            self._gained_device(new)
            if self.write_policy == "write_through":
                backups.append(new)
        if backups:
            self._backup_many(backups)  # the new node (write_through) or the hot ones (selective): one op
        return dup

    # ------------------------------------------------------------------ the compiled core's calls
    def _match_compiled(self, tokens: Any) -> MatchResult:
        t = self._tree
        src = tokens if type(tokens) is list else token_source(tokens)
        n = len(src)
        slots, dev_len, host_len, last_dev, last_host, splits, backups = t.core.match(
            src, n - n % self.page_size, self._touch_mode, self.write_through_threshold
        )
        if splits:
            self._after_splits(splits)
        if backups:
            self._backup_many([t.node(i) for i in backups])
        m = self.metrics
        m.device_hit_tokens += dev_len
        m.host_hit_tokens += host_len
        m.miss_tokens += n - dev_len - host_len
        return MatchResult(torch.from_numpy(slots), t.node(last_dev), t.node(last_host), host_len)

    def _insert_compiled(self, tokens: Any, device_indices: torch.Tensor, priority: int) -> int:
        t = self._tree
        src = tokens if type(tokens) is list else token_source(tokens)
        n = len(src)
        if n % self.page_size:
            raise ValueError(
                f"tokens: expected a page-aligned key (a multiple of page_size {self.page_size}), got {n}; "
                "device_indices: one slot per token"
            )
        s = self._slots.as_array(device_indices, n)
        if not s.flags.c_contiguous:
            s = np.ascontiguousarray(s)
        mode, threshold = self._touch_mode, self.write_through_threshold
        status, dup, cached, splits, backups, new, revived = t.core.insert(src, s, priority, mode, threshold, False)
        if status:  # not the usual slots: the full check names the fault, or accepts them
            self._slots.check_insert(s, dup, [torch.from_numpy(cached)])
            status, dup, _, splits, backups, new, revived = t.core.insert(src, s, priority, mode, threshold, True)
        self._slots.took(n - dup)
        if splits:
            self._after_splits(splits)
        for node_id in revived:
            self._gained_device(t.node(node_id))
        if new >= 0:
            self._gained_device(t.node(new))
        if backups:
            self._backup_many([t.node(i) for i in backups])
        return dup

    def _after_splits(self, splits: list[tuple[int, int, int]]) -> None:
        """The Python-side state of nodes the core split (a node without a handle has none): the upper
        node inherits the locks, the first ``at`` host slots and a lost mark, as ``_split`` does."""
        t = self._tree
        for lower_id, upper_id, at in splits:
            if self._node_keys:
                self._split_keys(lower_id, upper_id, at)
            lower = t._handles.get(lower_id)
            if lower is None:
                continue
            upper = t.node(upper_id)
            upper.lock_ref = lower.lock_ref
            host = lower._host
            if host is not None:
                upper._host, lower._host = host[:at], host[at:]
            if lower_id in self._lost:
                self._lost[upper_id] = upper

    def _child_nodes(self, node: Any) -> list:
        if self._tree is not None:
            return [self._tree.node(c) for c in self._tree.core.children(node.id)]
        return list(node.children.values())

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (e.g. while a request uses the prefix)."""
        while node is not self.root:
            if not node.lock_ref and not node.evicted:
                self._protected += node.num_tokens
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release a lock taken with :meth:`inc_lock_ref`; raises if a count would go negative."""
        x = node
        while x is not self.root:
            if x.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref: {x} is not locked")
            x = x.parent
        while node is not self.root:
            node.lock_ref -= 1
            if not node.lock_ref:
                self._unlocked(node)
            node = node.parent
        if self._lost:
            self._release_lost()

    # ------------------------------------------------------------------ what eviction keeps (no walks)
    def _is_device_candidate(self, node: Any) -> bool:
        """Unlocked, on the device, and no child on the device (children an eviction in progress has
        picked count as gone)."""
        if node.lock_ref or node.evicted:
            return False
        chosen = self._chosen
        if self._tree is not None:  # ids straight from the core: no handle per child
            core = self._tree.core
            return all(c in chosen or not core.has_value(c) for c in core.children(node.id))
        return all(c.evicted or c.id in chosen for c in node.children.values())

    def _is_host_candidate(self, node: Any) -> bool:
        """Host-only, unlocked, childless, and no storage backup reading its host copy."""
        return (
            not node.lock_ref
            and node.evicted
            and node.host_value is not None
            and not (self._tree.core.children(node.id) if self._tree is not None else node.children)
            and not self._host_pinned(node)
        )

    def _maybe_device_candidate(self, node: Any) -> None:
        """``node`` may have become a device eviction candidate (checked when popped)."""
        if self._device_candidates is not None:
            self._device_candidates.push(node)

    def _maybe_host_candidate(self, node: Any) -> None:
        """``node`` may have become a host eviction candidate (checked when popped)."""
        if self._host_candidates is not None:
            self._host_candidates.push(node)

    def _gained_device(self, node: Any) -> None:
        """``node`` got device slots: protected tokens if it is locked, else maybe a device leaf."""
        if node.lock_ref:
            self._protected += node.num_tokens
        else:
            self._maybe_device_candidate(node)

    def _unlocked(self, node: Any) -> None:
        """``node``'s last lock went: its tokens are evictable again, and it may be a candidate."""
        if not node.evicted:
            self._protected -= node.num_tokens
            self._maybe_device_candidate(node)
        elif node.host_value is not None:
            self._maybe_host_candidate(node)

    def _lost_child(self, parent: Any) -> None:
        """A child of ``parent`` lost its device copy or left the tree: ``parent`` may be a leaf now."""
        if parent is not self.root:
            self._maybe_device_candidate(parent)
            self._maybe_host_candidate(parent)

    def flush(self) -> None:
        """Wait for every copy in flight and process the acks (:class:`CopyError` for failed ones)."""
        self._check_open("flush")
        if self._step_loads:  # settled first: a queued load-back may not start unagreed
            self.agree_load_backs()
        self.controller.flush()
        self._take_acks()
        if self._storage is not None:  # the backups the acks above queued, too
            self._storage.wait_backups()
            self._take_storage()

    # ------------------------------------------------------------------ nodes
    def _nodes(self, start: TreeNode | None = None):
        """Every node below ``start`` (default: the root), ``start`` itself excluded."""
        if self._tree is not None:
            t = self._tree
            return [t.node(i) for i in t.core.subtree((start or self.root).id)]
        return subtree(start or self.root)

    # ------------------------------------------------------------------ load-back
    def _attached(self, node: Any) -> bool:
        """``node`` is a node of this tree, still in it."""
        if self._tree is not None:
            return isinstance(node, CompiledNode) and self._tree.attached(node)
        return isinstance(node, TreeNode) and is_attached(self.root, node, self.page_size)

    # ------------------------------------------------------------------ state
    def evictable_size(self) -> int:
        """Device tokens in unlocked nodes (kept as nodes change: no walk)."""
        return self._slots.count - self._protected

    def protected_size(self) -> int:
        """Device tokens in locked nodes (kept as nodes change: no walk)."""
        return self._protected

    def verify(self, external_device: torch.Tensor | None = None) -> None:
        """Check every invariant of the module docstring; raises AssertionError naming the first broken.

        ``external_device``: device slots allocated outside the tree (e.g. held by running requests).
        The tree's copies in flight are compared with the controller's: a controller that also serves
        other callers fails this check.
        """
        check_invariants(self, external_device)
        check_kept(self)

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
            self._take_acks()
        finally:
            self._close_storage()

    def __enter__(self) -> HiRadixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
