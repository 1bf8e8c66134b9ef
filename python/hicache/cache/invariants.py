"""The invariants of a :class:`~hicache.cache.radix_cache.HiRadixCache`, checked by its ``verify()``.

Kept apart from the tree's operations: the randomized stress tests call it after every step, so it
checks everything the tree promises, in one pass over the nodes plus numpy work over the pools.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from ..controller.controller import HiCacheController
from ..pools import DeviceKVPool, HostKVPool, SlotState
from ..tree.nodes import is_attached
from .cache_tree import CacheTree
from .copy_acks import CopyAcks
from .storage_ops import StorageOps


def _fail(message: str) -> None:
    raise AssertionError(message)


def check_invariants(
    tree: CacheTree,
    device_pool: DeviceKVPool,
    host_pool: HostKVPool,
    controller: HiCacheController,
    copies: CopyAcks,
    storage: StorageOps,
    external_device: torch.Tensor | None = None,
) -> None:
    """Raise ``AssertionError`` naming the first broken invariant of the cache made of these components.

    - every node holds its KV somewhere, has a whole-page key, is its parent's child, and is on the
      device only below device-resident ancestors;
    - locks: a node's count covers its children's (a lock counts on every ancestor), and what remains
      covers the copies in flight for that node; host pins: one per storage backup in flight, on a
      node in the tree with a host copy;
    - copies in flight: the tree's and the controller's are the same; each one's node is in the tree
      and owns (with the halves split off it) the copy's host slots;
    - host slots: FREE when no node owns them, WRITING / LOADING exactly for the copies in flight,
      SYNCED otherwise; RESERVED for the prefetches in flight (and stopped ones their I/O thread still
      holds); unowned and RESERVED or SYNCED while held for a busy storage backend (``storage.held``);
    - device slots: owned by exactly one node (or ``external_device``: held outside the tree) or free,
      and the tree's ownership record agrees.
    - lost nodes (failed load-back, still held): in the tree, on the device and the host, locked.
    """
    ps = tree.page_size
    root = tree.root
    dev_size, host_size = device_pool.size, host_pool.size
    dev_owner = torch.zeros(dev_size, dtype=torch.int64)
    host_owner = torch.zeros(host_size, dtype=torch.int64)
    host_node = np.full(host_size, -1, dtype=np.int64)  # id of the node owning each host slot

    # Copies in flight, as the tree records them and as the controller has them.
    records = {"write": copies.writes, "load": copies.loads}
    inflight_at: Counter = Counter()  # node id -> copies in flight for that node
    for kind, recs in records.items():
        theirs = controller.outstanding(kind)
        if Counter(recs.keys()) != theirs:
            _fail(
                f"{kind}s in flight: the tree has {sorted(recs)}, the controller {sorted(theirs.elements())} "
                "(host slots would stay WRITING/LOADING, or nodes locked, forever)"
            )
        for node, *_ in recs.values():
            inflight_at[node.id] += 1
    # Prefetches in flight hold a lock on the node their pages continue (the root takes no locks);
    # storage backups in flight host-pin their node instead (one pin each).
    for p in storage.prefetches.values():
        if p.node is not root:
            inflight_at[p.node.id] += 1
    backups = {i: len(nodes) for i, nodes in storage.backups.items()}
    pins = dict(tree.host_pins)
    if pins != backups:
        _fail(f"host pins {pins} are not one per storage backup in flight {backups}")
    for nodes in storage.backups.values():
        for x in nodes:
            if not tree.attached(x) or x.host_value is None:
                _fail(f"{x} is read by a storage backup but is not in the tree with a host copy")

    for n in tree.nodes():
        if n.value is None and n.host_value is None:
            _fail(f"{n} holds its KV nowhere")
        if len(n.key) == 0 or len(n.key) % ps:
            _fail(f"{n} has a key of {len(n.key)} tokens (page_size {ps})")
        if n.parent.children.get(n.key[:ps]) is not n:
            _fail(f"{n} is not its parent's child under its first page")
        below = sum(c.lock_ref for c in n.children.values())
        if n.lock_ref - below < inflight_at[n.id]:
            _fail(
                f"{n} has lock_ref {n.lock_ref}: its children hold {below} and {inflight_at[n.id]} copies are in "
                "flight for it"
            )
        if n.value is None and any(c.value is not None for c in n.children.values()):
            _fail(f"{n} is evicted but a child is on the device")
        for v, owner in ((n.value, dev_owner), (n.host_value, host_owner)):
            if v is not None:
                if len(v) != len(n.key):
                    _fail(f"{n} has {len(v)} slots for {len(n.key)} tokens")
                owner.index_add_(0, v, torch.ones_like(v))
        if n.host_value is not None:
            host_node[n.host_value.numpy()] = n.id
    if (dev_owner > 1).any() or (host_owner > 1).any():
        _fail("a slot is owned by more than one node")
    tree_owned = (dev_owner == 1).numpy()
    if not np.array_equal(tree_owned, tree.slots.owned):
        bad = np.flatnonzero(tree_owned != tree.slots.owned)[:5].tolist()
        _fail(f"device slots {bad}: the tree's ownership record disagrees with its nodes")

    # Host slot states: SYNCED when owned, WRITING / LOADING for the copies in flight, FREE otherwise.
    expected = np.where(host_owner.numpy() == 1, SlotState.SYNCED, SlotState.FREE).astype(np.uint8)
    for (kind, recs), state in zip(records.items(), (SlotState.WRITING, SlotState.LOADING), strict=True):
        for node_id, (node, host, *_) in recs.items():
            if not is_attached(root, node, ps):
                _fail(f"{kind} in flight for {node} (id {node_id}), which is no longer in the tree")
            chain = set()
            x = node
            while x is not root:
                chain.add(x.id)
                x = x.parent
            owners = set(host_node[host.numpy()].tolist())
            if not owners <= chain:
                _fail(f"{kind} in flight for {node}: its host slots are owned by nodes {sorted(owners - chain)}")
            expected[host.numpy()] = state
    # Prefetches in flight (and stopped ones whose I/O thread still holds slots): RESERVED, no owner.
    for p in [*storage.prefetches.values(), *storage.zombies]:
        held = p.host_slots.numpy()
        if (host_owner.numpy()[held] != 0).any():
            _fail(f"prefetch {p.request_id!r}: its host slots are owned by a node")
        expected[held] = SlotState.RESERVED
    states = host_pool.state().numpy()
    # Host slots let go of while the storage backend may still read or write them: unowned, not free yet.
    claimed = np.zeros(host_size, dtype=np.int64)
    for p in [*storage.prefetches.values(), *storage.zombies]:
        np.add.at(claimed, p.host_slots.numpy(), 1)
    for slots in storage.held.held:
        held = slots.numpy()
        np.add.at(claimed, held, 1)
        if (host_owner.numpy()[held] != 0).any():
            _fail("host slots held for a busy storage backend are owned by a node")
        if not np.isin(states[held], np.array([SlotState.RESERVED, SlotState.SYNCED], dtype=np.uint8)).all():
            _fail("host slots held for a busy storage backend are not RESERVED or SYNCED")
        expected[held] = states[held]
    if (claimed > 1).any():
        _fail(f"host slots {np.flatnonzero(claimed > 1)[:5].tolist()} are held twice (prefetches, held slots)")
    if not np.array_equal(states, expected):
        bad = np.flatnonzero(states != expected)[:5]
        names = [SlotState(int(s)).name for s in states[bad]]
        want = [SlotState(int(s)).name for s in expected[bad]]
        _fail(f"host slots {bad.tolist()} are {names}, expected {want} (from the nodes and the copies in flight)")

    if external_device is not None:
        dev_owner.index_add_(0, external_device, torch.ones_like(external_device))
    dev_free = ~device_pool.is_allocated()
    if not torch.equal(dev_owner == 1, ~dev_free):
        bad = torch.nonzero((dev_owner == 1) == dev_free).flatten()[:5].tolist()
        _fail(f"device slots {bad} are neither free nor owned by exactly one node")

    for x in tree.lost.values():
        if not is_attached(root, x, ps) or x.value is None or x.host_value is None or x.lock_ref <= 0:
            _fail(f"lost node {x} must be in the tree, on the device and the host, and locked")


def check_kept(tree: CacheTree) -> None:
    """What ``tree`` keeps as nodes change instead of walking the tree equals the walk: the protected
    and evictable device tokens, the tree's device tokens, and every eviction candidate of each tier is
    queued (:mod:`hicache.tree.candidates`)."""
    nodes = list(tree.nodes())
    on_device = [n for n in nodes if not n.evicted]
    protected = sum(n.num_tokens for n in on_device if n.lock_ref)
    owned = sum(n.num_tokens for n in on_device)
    if tree.slots.count != owned:
        _fail(f"device tokens kept: {tree.slots.count}, the nodes hold {owned}")
    if tree.protected != protected:
        _fail(f"protected_size kept: {tree.protected}, the walk finds {protected}")
    if tree.evictable_size() != owned - protected:
        _fail(f"evictable_size kept: {tree.evictable_size()}, the walk finds {owned - protected}")
    for tier, cands, is_candidate in (
        ("device", tree.device_candidates, tree.is_device_candidate),
        ("host", tree.host_candidates, tree.is_host_candidate),
    ):
        if cands is None:
            continue
        missing = [n.id for n in nodes if is_candidate(n) and n.id not in cands]
        if missing:
            _fail(f"{tier} eviction candidates {missing[:8]} are not queued: eviction would pass them over")
