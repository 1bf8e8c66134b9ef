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
  evicted from either tier while its slots are WRITING/LOADING;
- every device and host slot is either free in its pool or owned by exactly one node.

Write policies (the controller's ``write_policy``): ``write_through`` backs up each new node on
insert; ``write_through_selective`` backs up a node when its hit count reaches
``write_through_threshold`` (default 2); ``write_back`` backs up only when the node is evicted.

Outcomes when memory runs out (all documented, none raises): a backup that finds the host pool full
evicts host-only leaves first and is skipped if still no room (the node stays device-only; counted in
``metrics.writes_refused_host_full``); a load-back that cannot get device slots, even after evicting,
is skipped and returns None (the caller recomputes; counted in ``metrics.load_backs_skipped``), as is
one shorter than ``load_back_threshold`` tokens or larger than the caller's budget; device eviction
of a node with no host copy (and, under ``write_back``, no host room) deletes it.

Timestamps are a logical clock, so tensor-parallel ranks that see the same requests order evictions
identically.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch

from .controller import CacheMetrics, HiCacheController
from .policies import EvictionPolicy, get_policy
from .pools import DeviceKVPool, HostKVPool, SlotState

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the radix tree: ``key`` tokens and the slots that hold their KV."""

    __slots__ = (
        "id",
        "parent",
        "key",
        "children",
        "value",
        "host_value",
        "lock_ref",
        "hit_count",
        "last_access_time",
        "creation_time",
        "priority",
    )

    def __init__(self, node_id: int, parent: TreeNode | None, key: tuple[int, ...], clock: int) -> None:
        self.id = node_id
        self.parent = parent
        self.key = key
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.lock_ref = 0
        self.hit_count = 0
        self.last_access_time = clock
        self.creation_time = clock
        self.priority = 0

    @property
    def evicted(self) -> bool:
        """No device copy."""
        return self.value is None

    @property
    def backuped(self) -> bool:
        """Has a host copy (complete unless the node is locked by its backup)."""
        return self.host_value is not None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key)}, device={self.value is not None}, "
            f"host={self.host_value is not None}, lock_ref={self.lock_ref})"
        )


@dataclass
class MatchResult:
    """What :meth:`HiRadixCache.match_prefix` found.

    ``device_indices``: int64 device slots of the device-resident prefix (``len`` = device hit);
    ``last_device_node``: the deepest matched node with a device copy (the root when none);
    ``last_host_node``: the deepest matched node (device or host copy): pass it to ``load_back``;
    ``host_hit_length``: tokens matched beyond the device prefix that only the host holds.
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


class HiRadixCache:
    """A two-tier radix cache (see module docstring).

    Parameters
    ----------
    device_pool, host_pool : the pools; ``host_pool.page_size`` must equal ``device_pool.page_size``.
    controller : the :class:`~hicache.controller.HiCacheController` to use; built from the keyword
        arguments below when None (and then closed by :meth:`close`).
    io_backend, write_policy, tp_group, threaded : passed to the controller it builds.
    eviction_policy : ``lru`` (default), ``lfu``, ``slru``, ``fifo``, ``priority`` or an object with
        ``key(node)``; used for both tiers.
    load_back_threshold : host hits shorter than this many tokens are not loaded back (default 10).
    write_through_threshold : hits that trigger a backup under ``write_through_selective`` (default 2).
    """

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        controller: HiCacheController | None = None,
        *,
        io_backend: str = "auto",
        write_policy: str = "write_through",
        tp_group: Any = None,
        threaded: bool = True,
        eviction_policy: str | EvictionPolicy = "lru",
        load_back_threshold: int = 10,
        write_through_threshold: int = 2,
    ) -> None:
        if host_pool.page_size != device_pool.page_size:
            raise ValueError(
                f"host_pool: page_size {host_pool.page_size} differs from the device pool's {device_pool.page_size}"
            )
        if load_back_threshold < 0:
            raise ValueError(f"load_back_threshold: expected >= 0, got {load_back_threshold}")
        if write_through_threshold < 1:
            raise ValueError(f"write_through_threshold: expected >= 1, got {write_through_threshold}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._owns_controller = controller is None
        self.controller = controller or HiCacheController(
            device_pool, host_pool, io_backend=io_backend, write_policy=write_policy, tp_group=tp_group,
            threaded=threaded,
        )  # fmt: skip
        self.write_policy = self.controller.write_policy
        self.policy = get_policy(eviction_policy)
        self.page_size = device_pool.page_size
        self.load_back_threshold = load_back_threshold
        self.write_through_threshold = write_through_threshold
        self._ids = itertools.count(1)
        self._clock = 0
        self.root = TreeNode(0, None, (), 0)
        self.root.lock_ref = 1  # never evicted
        self._inflight_writes: dict[int, tuple[TreeNode, torch.Tensor]] = {}
        self._inflight_loads: dict[int, tuple[TreeNode, torch.Tensor, float]] = {}

    @property
    def metrics(self) -> CacheMetrics:
        return self.controller.metrics

    # ------------------------------------------------------------------ helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _page_key(self, tokens: Any) -> tuple[int, ...]:
        key = tuple(int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens))
        return key[: len(key) - len(key) % self.page_size]

    def _common(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        """Length of the common page-aligned prefix of ``a`` and ``b``."""
        n = 0
        limit = min(len(a), len(b))
        p = self.page_size
        while n < limit and a[n : n + p] == b[n : n + p]:
            n += p
        return n

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
        child.parent.children[child.key[: self.page_size]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    def _walk(self, key: tuple[int, ...]):
        """Yield matched nodes top-down, splitting the last one at a partial match."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + self.page_size])
            if child is None:
                return
            n = self._common(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            yield child
            node, pos = child, pos + n

    def _touch(self, node: TreeNode) -> None:
        node.last_access_time = self._tick()
        node.hit_count += 1
        if (
            self.write_policy == "write_through_selective"
            and node.hit_count >= self.write_through_threshold
            and node.value is not None
            and node.host_value is None
        ):
            self._backup(node)

    # ------------------------------------------------------------------ lookups and inserts
    def match_prefix(self, tokens: Any) -> MatchResult:
        """Longest cached prefix of ``tokens`` (a list or 1-D tensor of ints), page-aligned."""
        key = self._page_key(tokens)
        device: list[torch.Tensor] = []
        last_device = last_host = self.root
        host_len = 0
        for node in self._walk(key):
            self._touch(node)
            if node.value is not None:
                device.append(node.value)
                last_device = node
            else:
                host_len += len(node.key)
            last_host = node
        indices = torch.cat(device) if device else _EMPTY
        m = self.metrics
        m.device_hit_tokens += len(indices)
        m.host_hit_tokens += host_len
        m.miss_tokens += len(tokens) - len(indices) - host_len
        return MatchResult(indices, last_device, last_host, host_len)

    def insert(self, tokens: Any, device_indices: torch.Tensor, priority: int = 0) -> int:
        """Insert ``tokens`` whose KV sits in ``device_indices`` (int64, one slot per token, page-aligned).

        Returns how many leading tokens were already cached on the device: those slots of
        ``device_indices`` stay the caller's (free them); the rest now belong to the tree. Host-only
        nodes along the way are revived with the caller's slots (their host copy stays valid).
        """
        key = self._page_key(tokens)
        if len(key) != len(tokens) or len(device_indices) != len(key):
            raise ValueError(
                f"device_indices: expected one slot per token of a page-aligned key (page_size {self.page_size}); "
                f"got {len(tokens)} tokens and {len(device_indices)} slots"
            )
        device_indices = device_indices.to(torch.int64)
        node, pos, duplicated = self.root, 0, 0
        for node in self._walk(key):
            n = len(node.key)
            if node.value is None:
                node.value = device_indices[pos : pos + n].clone()
            else:
                duplicated += n
            node.priority = max(node.priority, priority)
            self._touch(node)
            pos += n
        if pos < len(key):
            new = TreeNode(next(self._ids), node, key[pos:], self._tick())
            new.value = device_indices[pos:].clone()
            new.priority = priority
            node.children[new.key[: self.page_size]] = new
            new.hit_count = 1
            if self.write_policy == "write_through":
                self._backup(new)
        return duplicated

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (e.g. while a request uses the prefix)."""
        while node is not self.root:
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
            node = node.parent

    # ------------------------------------------------------------------ backups and acks
    def _backup(self, node: TreeNode) -> bool:
        host = self.controller.write(node.value, node.id, count_refusal=False)
        if host is None:
            self.evict_host(len(node.value))
            host = self.controller.write(node.value, node.id)
        if host is None:
            return False
        node.host_value = host
        self.inc_lock_ref(node)
        self._inflight_writes[node.id] = (node, host)
        return True

    def check_writes(self) -> int:
        """Process finished backups (agreed across TP ranks): host slots become SYNCED, nodes unlock."""
        done = self.controller.finished_writes()
        for node_id in done:
            node, host = self._inflight_writes.pop(node_id)
            self.host_pool.mark_synced(host)
            self.dec_lock_ref(node)
        return len(done)

    def check_loads(self) -> int:
        """Process finished load-backs: host slots back to SYNCED, nodes unlock, latency recorded."""
        done = self.controller.finished_loads()
        for node_id in done:
            node, host, t0 = self._inflight_loads.pop(node_id)
            self.host_pool.mark_synced(host)
            self.dec_lock_ref(node)
            self.metrics.load_back_latency_s.append(time.perf_counter() - t0)
        return len(done)

    def flush(self) -> None:
        """Wait for every copy in flight and process the acks."""
        self.controller.flush()
        self.check_writes()
        self.check_loads()

    # ------------------------------------------------------------------ eviction
    def _nodes(self, start: TreeNode | None = None):
        """Every node below ``start`` (default: the root), ``start`` itself excluded."""
        stack = list((start or self.root).children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _is_device_leaf(self, node: TreeNode) -> bool:
        return node.value is not None and all(c.value is None for c in node.children.values())

    def _delete(self, node: TreeNode) -> None:
        """Remove ``node`` and its subtree, freeing every slot they own (none may be in flight)."""
        for x in [node, *self._nodes(node)]:
            if x.value is not None:
                self.device_pool.free(x.value)
            if x.host_value is not None:
                self.host_pool.free(x.host_value)
                self.metrics.host_evicted_tokens += len(x.key)
            x.value = x.host_value = None
        del node.parent.children[node.key[: self.page_size]]

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots if possible, least valuable device leaves first.

        Backed-up nodes keep their host copy and stay in the tree; others are written to the host
        first under ``write_back``, else deleted. Returns the device slots freed.
        """
        heap = [(self.policy.key(n), n.id, n) for n in self._nodes() if self._is_device_leaf(n) and n.lock_ref == 0]
        heapq.heapify(heap)
        chosen: list[TreeNode] = []
        chosen_ids: set[int] = set()
        planned = 0
        while planned < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            chosen.append(x)
            chosen_ids.add(x.id)
            planned += len(x.value)
            parent = x.parent
            if parent is not self.root and parent.lock_ref == 0 and parent.value is not None:
                if all(c.value is None or c.id in chosen_ids for c in parent.children.values()):
                    heapq.heappush(heap, (self.policy.key(parent), parent.id, parent))
        if self.write_policy == "write_back":
            pending = [x for x in chosen if x.host_value is None]
            if pending:
                for x in pending:
                    self._backup(x)
                self.flush()  # write-back: the host copy must exist before the device copy goes
        freed = 0
        # Children before parents: a parent is only evictable once its device children are gone.
        for x in chosen:
            n = len(x.value)
            if x.host_value is not None:
                self.device_pool.free(x.value)
                x.value = None
            else:
                self._delete(x)
            freed += n
        self.metrics.device_evicted_tokens += freed
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots if possible by deleting host-only leaves."""
        heap = [
            (self.policy.key(n), n.id, n)
            for n in self._nodes()
            if n.value is None and not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            parent = x.parent
            freed += len(x.host_value)
            self._delete(x)
            if parent is not self.root and parent.value is None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self.policy.key(parent), parent.id, parent))
        return freed

    # ------------------------------------------------------------------ load-back
    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> torch.Tensor | None:
        """Bring the host-only part of the prefix ending at ``node`` back to device slots.

        Returns the new device slots (in prefix order; the copy starts with :meth:`start_loading` and
        the nodes stay locked until its ack is processed), or None when skipped: nothing to load,
        fewer than ``load_back_threshold`` tokens, more than ``mem_quota`` tokens, or more than the
        free plus evictable device slots (then nothing is evicted). The skip decision is agreed
        across TP ranks.
        """
        path: list[TreeNode] = []
        x = node
        while x is not self.root and x.value is None:
            path.append(x)
            x = x.parent
        path.reverse()
        total = sum(len(n.key) for n in path)
        if total == 0:
            return None
        if total < self.load_back_threshold or (mem_quota is not None and total > mem_quota):
            self.metrics.load_backs_skipped += 1
            return None
        t0 = time.perf_counter()
        # Lock the whole path first: eviction below must neither take the device ancestor nor (through a
        # write-back's host eviction) the host-only nodes we are about to load.
        self.inc_lock_ref(node)
        device = None
        available = self.device_pool.available_size()
        # Evict only when that can make enough room: a load-back that cannot fit changes nothing.
        if total <= available + (self.evictable_size() if total > available else 0):
            device = self.device_pool.alloc(total)
            if device is None:
                self.evict(total - available)
                device = self.device_pool.alloc(total)
        if not self.controller.agree_min(device is not None):
            if device is not None:
                self.device_pool.free(device)
            self.dec_lock_ref(node)
            self.metrics.load_backs_skipped += 1
            return None
        host = torch.cat([n.host_value for n in path])
        offset = 0
        for n in path:
            n.value = device[offset : offset + len(n.key)]
            offset += len(n.key)
        self.controller.load(host, device, node.id)  # the lock taken above is released by its ack
        self._inflight_loads[node.id] = (node, host, t0)
        self.metrics.load_backs += 1
        return device

    def start_loading(self) -> int:
        """Start the queued load-backs as one layer-by-layer batch (see the controller)."""
        return self.controller.start_loading()

    # ------------------------------------------------------------------ state
    def evictable_size(self) -> int:
        """Device tokens in unlocked nodes."""
        return sum(len(n.value) for n in self._nodes() if n.value is not None and n.lock_ref == 0)

    def protected_size(self) -> int:
        """Device tokens in locked nodes."""
        return sum(len(n.value) for n in self._nodes() if n.value is not None and n.lock_ref > 0)

    def verify(self, external_device: torch.Tensor | None = None) -> None:
        """Check every invariant of the module docstring; raises AssertionError naming the first broken.

        ``external_device``: device slots allocated outside the tree (e.g. held by running requests).
        """
        dev_owner = torch.zeros(self.device_pool.size, dtype=torch.int64)
        host_owner = torch.zeros(self.host_pool.size, dtype=torch.int64)
        if external_device is not None:
            dev_owner.index_add_(0, external_device, torch.ones_like(external_device))
        for n in self._nodes():
            if n.value is None and n.host_value is None:
                raise AssertionError(f"{n} holds its KV nowhere")
            if len(n.key) == 0 or len(n.key) % self.page_size:
                raise AssertionError(f"{n} has a key of {len(n.key)} tokens (page_size {self.page_size})")
            if n.parent.children.get(n.key[: self.page_size]) is not n:
                raise AssertionError(f"{n} is not its parent's child under its first page")
            if n.lock_ref < 0 or (n.parent is not self.root and n.parent.lock_ref < n.lock_ref):
                raise AssertionError(f"{n} has lock_ref {n.lock_ref} (parent {n.parent.lock_ref})")
            if n.value is None and any(c.value is not None for c in n.children.values()):
                raise AssertionError(f"{n} is evicted but a child is on the device")
            for v, owner in ((n.value, dev_owner), (n.host_value, host_owner)):
                if v is not None:
                    if len(v) != len(n.key):
                        raise AssertionError(f"{n} has {len(v)} slots for {len(n.key)} tokens")
                    owner.index_add_(0, v, torch.ones_like(v))
        if (dev_owner > 1).any() or (host_owner > 1).any():
            raise AssertionError("a slot is owned by more than one node")
        dev_free = ~self.device_pool.is_allocated()
        host_free = self.host_pool.state() == SlotState.FREE
        if not torch.equal(dev_owner == 1, ~dev_free):
            bad = torch.nonzero((dev_owner == 1) == dev_free).flatten()[:5].tolist()
            raise AssertionError(f"device slots {bad} are neither free nor owned by exactly one node")
        if not torch.equal(host_owner == 1, ~host_free):
            bad = torch.nonzero((host_owner == 1) == host_free).flatten()[:5].tolist()
            raise AssertionError(f"host slots {bad} are neither free nor owned by exactly one node")

    def close(self) -> None:
        """Drain copies in flight, process their acks and stop the controller (if built here)."""
        if self._owns_controller and not self.controller._closed:
            self.flush()
            self.controller.close()

    def __enter__(self) -> HiRadixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
