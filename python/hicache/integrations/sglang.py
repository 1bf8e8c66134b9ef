"""SGLang's HiCache storage (L3) backed by this package's storage backends.

:class:`HiCacheKernelsStorage` is a subclass of SGLang's ``HiCacheStorage``
(``sglang/srt/mem_cache/hicache_storage.py``, SGLang 0.5.23) that SGLang's own
``StorageBackendFactory`` loads by configuration::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache",
        "module_path": "hicache.integrations.sglang", "class_name": "HiCacheKernelsStorage",
        "interface_v1": 1, "hicache_backend": "file",
        "hicache_backend_config": {"path": "/mnt/kv", "capacity_bytes": 100000000000}}'

``hicache_backend`` is ``"file"``, ``"mooncake"``, ``"nixl"`` or ``"package.module:Class"`` (any
:class:`~hicache.storage.base.StorageBackend`), built by :func:`hicache.storage.create_backend` with
``hicache_backend_config`` as its keyword arguments. ``interface_v1: 1`` makes SGLang call the zero-copy
methods (:meth:`~HiCacheKernelsStorage.batch_get_v1` / :meth:`~HiCacheKernelsStorage.batch_set_v1`):
the backend reads and writes the host pool's pages in place, located through the host pool's
``get_page_buffer_meta``. Without it SGLang calls the copying methods (``batch_get`` / ``batch_set``
with flat page tensors).

Keys. SGLang's page keys are a hash chain over token ids (seeded by ``extra_key`` / ``cache_salt``,
which this adapter keeps as they are) and say nothing about the model, dtype, layout, layers or TP
shard. Every key is therefore re-keyed as ``SHA-256(namespace digest || SGLang key)``: the digest
covers the model name, the KV dtype, the host layout, the page size, this stage's layers, the head
geometry, the page object's byte layout and an optional tenant salt (``hicache_namespace`` in the
extra config), so two deployments that differ in any of these never read each other's bytes
(sglang#33268 is what happens when the dtype is left out). An MHA rank's heads are part of its
digest: a rank never reads another rank's shard.

Sharing pages across TP sizes. With the ``page_head`` layout and SGLang's ``tp_lcm_size`` (SGLang then
sets ``should_split_heads``), a page is stored as head groups of ``heads * tp_size / tp_lcm_size``
K/V heads, each its own object under ``SHA-256(digest || key || group index)`` where the group index
counts over the model's heads; the digest then leaves the rank out. A rank of any TP size that divides
``tp_lcm_size`` reads the groups of its own heads: pages written at TP=2 are read at TP=4.

MLA. Every rank holds the same latent: only SGLang's storage writer rank
(``HiCacheStorageConfig.is_storage_writer``) stores; on the other ranks a set stores nothing and
reports success (the writer stores the same bytes), and every rank reads. Under decode context
parallelism (DCP) each DCP rank holds its own share of every page: SGLang makes one writer per DCP
rank, the DCP rank and size are in the digest, and pages are counted in the host pool's logical slots
(``logical_page_size``).

Faults. A store fault (a missing, torn or corrupt object, a full store, a backend exception) is a
miss: ``False`` / ``None`` / a shorter prefix, never an exception into SGLang's storage threads. Only
construction and :meth:`~HiCacheKernelsStorage.register_mem_pool_host` raise, for a configuration
this adapter cannot serve, naming the setting.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolTransfer,
        PoolTransferResult,
    )
except ModuleNotFoundError as exc:
    from hicache.integrations._clients import raise_client_missing

    raise_client_missing(exc, "sglang", "SGLang (tested with sglang==0.5.23): it runs inside SGLang's server",
                         "hicache.integrations.sglang")  # fmt: skip

from hicache.integrations._clients import fields_digest
from hicache.storage import StorageBackend, create_backend

__all__ = ["HiCacheKernelsStorage", "SGLangPageObjects"]

logger = logging.getLogger(__name__)

#: The byte format of the stored objects; part of every digest, so a change never reads old objects.
OBJECT_FORMAT = "hicache-sglang-v1"
#: Layouts of SGLang's MHA / MLA host pools this adapter stores.
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class SGLangPageObjects:
    """An SGLang host pool seen as this package's storage backends see a host pool: objects of
    ``page_bytes`` bytes, each a list of ``(address, nbytes)`` ranges inside ``buffer``.

    An object id is the first host slot of its page (``host_indices[::page_size]``; with SGLang's
    decode context parallelism, DCP, the host pool's slots are logical and a page is
    ``logical_page_size = page_size * dcp_size`` of them, of which this rank holds its share), times
    ``groups`` plus the head group's index on this rank when pages are split into head groups. The
    ranges come from the host pool's own ``get_page_buffer_meta`` (or
    ``get_split_heads_page_buffer_meta``), so they follow SGLang's layout code. Stateless apart from the
    pool: safe from SGLang's prefetch and backup threads at once.
    """

    def __init__(self, host_pool: Any, groups: int = 1) -> None:
        self.host = host_pool
        self.groups = groups
        # the slots of one page in the host pool's index space (logical under DCP)
        self.page_size = int(getattr(host_pool, "logical_page_size", host_pool.page_size))
        self.buffer = host_pool.kv_buffer
        probe = torch.arange(self.page_size, dtype=torch.int64)
        ranges = self._meta(probe)
        self.ranges_per_object = len(ranges) // groups
        self.page_bytes = sum(n for _, n in ranges[: self.ranges_per_object])

    def _meta(self, slots: torch.Tensor) -> list[tuple[int, int]]:
        if self.groups == 1:
            ptrs, sizes = self.host.get_page_buffer_meta(slots)
        else:
            ptrs, sizes = self.host.get_split_heads_page_buffer_meta(slots, self.groups)
        return list(zip(ptrs, sizes, strict=True))

    def object_ids(self, host_indices: torch.Tensor) -> torch.Tensor:
        """Ids of the objects of ``host_indices`` (whole pages), page by page and group by group."""
        firsts = host_indices.reshape(-1)[:: self.page_size].to(torch.int64)
        if self.groups == 1:
            return firsts
        return (firsts[:, None] * self.groups + torch.arange(self.groups)).reshape(-1)

    def page_ranges(self, ids: torch.Tensor) -> list[list[tuple[int, int]]]:
        ids = ids.to(torch.int64)
        firsts = ids // self.groups
        pages = firsts.unique(sorted=False) if self.groups > 1 else firsts
        slots = (pages[:, None] + torch.arange(self.page_size)).reshape(-1)
        ranges = self._meta(slots)
        per_page = self.ranges_per_object * self.groups
        by_page = {int(p): ranges[i * per_page : (i + 1) * per_page] for i, p in enumerate(pages.tolist())}
        k = self.ranges_per_object
        out = []
        for first, g in zip(firsts.tolist(), (ids % self.groups).tolist(), strict=True):
            out.append(by_page[first][g * k : (g + 1) * k])
        return out


_KV = "kv"  # SGLang's PoolName.KV
#: Attributes of SGLang's host pools that fix a page's byte layout beyond its size (a Mamba pool's state
#: shapes and dtypes, an attention pool's heads): two pools differing in any never read each other's.
_GEOMETRY = ("layer_num", "num_mamba_layers", "temporal_state_shape", "conv_state_shapes", "temporal_dtype",
             "conv_dtype", "dtype", "head_num", "head_dim", "kv_cache_dim")  # fmt: skip


def _pool_geometry(host: Any) -> dict[str, str]:
    return {a: str(getattr(host, a)) for a in _GEOMETRY if getattr(host, a, None) is not None}


class _SidecarPool:
    """A v2 pool beside the KV pool: SGLang's host pool, its namespace digest and page geometry."""

    __slots__ = ("digest", "dtype", "host", "page_bytes", "page_size")

    def __init__(self, host: Any, digest: bytes, page_size: int, page_bytes: int, dtype: torch.dtype) -> None:
        self.host, self.digest, self.page_size, self.page_bytes, self.dtype = host, digest, page_size, page_bytes, dtype

    def keys(self, keys: Sequence[str]) -> list[str]:
        return [hashlib.sha256(self.digest + k.encode()).hexdigest() for k in keys]


class HiCacheKernelsStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a :class:`~hicache.storage.base.StorageBackend` (module docstring).

    Parameters
    ----------
    storage_config : HiCacheStorageConfig
        SGLang's; ``extra_config`` holds ``hicache_backend`` (default ``"file"``),
        ``hicache_backend_config`` (a dict, default ``{}``) and optionally ``hicache_namespace``
        (a tenant salt).
    kwargs : dict, optional
        What SGLang's factory passes beside the config (unused).
    backend : StorageBackend, optional
        A ready backend to use instead of building one from the extra config (tests, embedding).
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None, *, backend: StorageBackend | None = None
    ) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise TypeError(
                f"storage_config: expected SGLang's HiCacheStorageConfig, got {type(storage_config).__name__}"
            )
        extra = dict(storage_config.extra_config or {})
        salt = extra.get("hicache_namespace")
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"hicache_namespace: expected a string, got {type(salt).__name__}")
        if backend is None:
            spec = extra.get("hicache_backend", "file")
            config = extra.get("hicache_backend_config") or {}
            if not isinstance(spec, str):
                raise TypeError(f"hicache_backend: expected a backend name or 'module:Class', got {spec!r}")
            if not isinstance(config, dict):
                raise TypeError(f"hicache_backend_config: expected an object, got {type(config).__name__}")
            backend = create_backend(spec, config)
        elif not isinstance(backend, StorageBackend):
            raise TypeError(f"backend: expected a hicache StorageBackend, got {type(backend).__name__}")
        self.config = storage_config
        self.backend = backend
        # SGLang calls the zero-copy methods iff interface_v1; the two write a page's bytes in the order
        # of the host pool's buffer meta and of its flat data page, which differ for MHA layer_first,
        # so the interface is part of the namespace (a deployment never reads the other order).
        self.interface = "v1" if extra.get("interface_v1") else "flat"
        self.salt = salt
        self.writer = bool(storage_config.is_storage_writer)
        self.objects: SGLangPageObjects | None = None
        self._prefix = b""
        self._group_base = 0
        self._split = False  # pages stored as head groups (page_head with tp_lcm_size)
        self._closed = False
        self._lock = threading.Lock()
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bw": [], "backup_bw": []}
        self._counts = {"faults": 0, "skipped_sets": 0}
        self._pools: dict[str, _SidecarPool] = {}  # v2: the pools beside the KV pool, by SGLang's pool name

    # -- binding to SGLang's host pool -------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind to SGLang's host pool: compute the namespace digest and attach the backend to the
        pool's page objects (a backend that registers memory registers ``kv_buffer``)."""
        super().register_mem_pool_host(mem_pool_host)
        host = mem_pool_host
        cfg = self.config
        mla = bool(cfg.is_mla_model)
        layout = str(host.layout)
        allowed = MLA_LAYOUTS if mla else MHA_LAYOUTS
        if layout not in allowed:
            raise ValueError(f"layout: {'MLA' if mla else 'MHA'} host pools in layouts {', '.join(allowed)} are "
                             f"supported, got {layout!r}")  # fmt: skip
        fields: dict[str, Any] = {
            "format": OBJECT_FORMAT,
            "model": cfg.model_name,
            "dtype": str(host.dtype),
            "layout": layout,
            "page_size": int(host.page_size),
            "layers": [int(getattr(host, "start_layer", 0) or 0), int(host.layer_num)],
            "mla": mla,
            "salt": self.salt,
            "interface": self.interface,
        }
        groups = 1
        if mla:
            fields["kv_cache_dim"] = int(host.kv_cache_dim)
        else:
            heads = int(host.head_num)
            fields["head_dim"] = int(host.head_dim)
            fields["v_head_dim"] = int(getattr(host, "v_head_dim", host.head_dim) or host.head_dim)
            if cfg.should_split_heads:
                total = heads * cfg.tp_size
                lcm = int(cfg.tp_lcm_size or 0)
                if layout != "page_head" or lcm < 1 or total % lcm or heads % (total // lcm):
                    raise ValueError(f"tp_lcm_size: head groups need the page_head layout and {total} heads divisible "
                                     f"into {lcm} groups that divide this rank's {heads}")  # fmt: skip
                group = total // lcm
                groups = heads // group
                fields.update(heads_total=total, head_group=group)
                self._group_base = cfg.tp_rank * heads // group
                self._split = True
            else:
                fields["heads"] = [cfg.tp_rank * heads, heads]  # this rank's shard: never another rank's
        dcp_size = int(getattr(cfg, "dcp_size", 1) or 1)
        if dcp_size > 1:  # each DCP rank holds its own share of every page: never another rank's
            fields["dcp"] = [int(cfg.dcp_rank), dcp_size]
        self.objects = SGLangPageObjects(host, groups)
        fields["object"] = [self.objects.ranges_per_object, self.objects.page_bytes]
        self._prefix = fields_digest(fields)
        self.backend.attach(self.objects)

    def _keys(self, keys: Sequence[str]) -> list[str]:
        """This namespace's object keys of SGLang's page keys (one per head group when split)."""
        out = []
        groups = self.objects.groups
        for key in keys:
            h = hashlib.sha256(self._prefix + key.encode())
            if not self._split:
                out.append(h.hexdigest())
                continue
            for g in range(groups):
                hg = h.copy()
                hg.update((self._group_base + g).to_bytes(4, "little"))
                out.append(hg.hexdigest())
        return out

    def _fault(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self._counts["faults"] += 1
            first = self._counts["faults"] == 1
        (logger.warning if first else logger.debug)("hicache storage %s failed (a miss): %r", what, exc)

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if not self.config.enable_storage_metrics or pages == 0:
            return
        gb = pages * self.objects.page_bytes * self.objects.groups / 1e9
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bw"].append(gb / max(seconds, 1e-9))

    def _per_page(self, results: list[bool]) -> list[bool]:
        groups = self.objects.groups
        return [all(results[i : i + groups]) for i in range(0, len(results), groups)]

    def _ready(self, method: str) -> bool:
        if self._closed:
            self._fault(method, RuntimeError("closed"))
            return False
        if self.objects is None:
            self._fault(method, RuntimeError("no host pool registered (register_mem_pool_host)"))
            return False
        return True

    # -- zero copy (interface_v1) -------------------------------------------------------------------
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read each key's page into its page of ``host_indices`` (``page_size`` slots per key);
        per key, whether it was read (a False page holds garbage)."""
        if not keys:
            return []
        if not self._ready("batch_get_v1"):
            return [False] * len(keys)
        start = time.perf_counter()
        try:
            ids = self.objects.object_ids(host_indices)
            res = self._per_page(list(self.backend.batch_get_into(self._keys(keys), ids)))
        except Exception as exc:  # a store fault is a miss
            self._fault("batch_get_v1", exc)
            return [False] * len(keys)
        self._record("prefetch", sum(res), time.perf_counter() - start)
        return res

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store each page of ``host_indices`` under its key; per key, whether it was stored."""
        if not keys:
            return []
        if not self._ready("batch_set_v1"):
            return [False] * len(keys)
        if not self.writer:
            with self._lock:
                self._counts["skipped_sets"] += len(keys)
            return [True] * len(keys)
        start = time.perf_counter()
        try:
            ids = self.objects.object_ids(host_indices)
            res = self._per_page(list(self.backend.batch_set_from(self._keys(keys), ids)))
        except Exception as exc:
            self._fault("batch_set_v1", exc)
            return [False] * len(keys)
        self._record("backup", sum(res), time.perf_counter() - start)
        return res

    # -- existence ----------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading keys are stored (every head group of a split page)."""
        if not keys or not self._ready("batch_exists"):
            return 0
        try:
            n = int(self.backend.batch_exists(self._keys(keys)))
        except Exception as exc:
            self._fault("batch_exists", exc)
            return 0
        return n // self.objects.groups

    # -- SGLang's v2 pool interface (hybrid models: Mamba, SWA, DSA indexer pools beside the KV) -----
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register one pool of SGLang's host pool group: the KV pool binds as
        :meth:`register_mem_pool_host` does; any other pool (its pages moved as SGLang's flat data pages)
        gets a namespace of its own: this deployment's, plus the pool's name, page dtype, page size,
        page bytes, layout, geometry (state shapes and dtypes, heads) and this rank."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == _KV:
            if self.objects is None:
                self.register_mem_pool_host(host_pool)
            return
        page = host_pool.get_dummy_flat_data_page()
        cfg = self.config
        fields = {
            "format": OBJECT_FORMAT,
            "model": cfg.model_name,
            "salt": self.salt,
            "pool": name,
            "dtype": str(page.dtype),
            "page_size": int(getattr(host_pool, "page_size", 1) or 1),
            "page_bytes": int(page.numel() * page.element_size()),
            "layout": str(getattr(host_pool, "layout", "")),
            "rank": [int(cfg.tp_rank), int(cfg.tp_size), int(getattr(cfg, "dcp_rank", 0) or 0)],
            "geometry": _pool_geometry(host_pool),
        }
        self._pools[name] = _SidecarPool(host_pool, fields_digest(fields), fields["page_size"], fields["page_bytes"],
                                         page.dtype)  # fmt: skip

    def _pool(self, name: Any) -> _SidecarPool:
        pool = self._pools.get(str(name))
        if pool is None:
            raise ValueError(f"transfers: no host pool registered as {str(name)!r} (register_mem_host_pool_v2)")
        return pool

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """The longest prefix of ``keys`` whose KV pages and every other pool's pages are stored, by each
        pool's hit policy (``all_pages``: each page of the prefix; ``trailing_pages``: the last
        ``len(transfer.keys)`` pages of it, as Mamba / SWA states): a prefix a sidecar is missing from is
        not restorable (a miss, never a load without it). ``restorable_prefix_pages`` lists every
        restorable length, as SGLang intersects them across ranks."""
        kv = self.batch_exists(keys)
        hits: dict[str, int] = {_KV: kv} if kv else {}
        restorable = set(range(1, kv + 1))
        try:
            for t in pool_transfers or []:
                if not restorable:
                    break
                pool, name = self._pool(t.name), str(t.name)
                present = [bool(self.backend.exists(k)) for k in pool.keys(keys[:kv])]
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    first_gap = present.index(False) if False in present else kv
                    ok = set(range(1, first_gap + 1))
                elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing = max(1, len(t.keys) if t.keys else 1)
                    ok = {n for n in range(1, kv + 1) if all(present[max(0, n - trailing) : n])}
                else:
                    raise ValueError(f"pool_transfers: hit policy {t.hit_policy!s} of {name!r} is not served")
                if ok:
                    hits[name] = max(ok)
                restorable &= ok
        except Exception as exc:  # a fault is a miss
            self._fault("batch_exists_v2", exc)
            return PoolTransferResult(0, {}, [])
        order = sorted(restorable)
        return PoolTransferResult(order[-1] if order else 0, hits, order)

    def _sidecar_io(self, t: PoolTransfer, write: bool) -> list[bool]:
        keys = list(t.keys or [])
        pool = self._pool(t.name)
        idx = t.host_indices
        if idx is None or idx.numel() != len(keys) * pool.page_size:
            raise ValueError(f"transfers[{str(t.name)!r}].host_indices: expected {len(keys) * pool.page_size} "
                             f"slots for {len(keys)} keys, got {0 if idx is None else idx.numel()}")  # fmt: skip
        firsts = idx.reshape(-1)[:: pool.page_size].tolist()
        out = []
        for okey, first in zip(pool.keys(keys), firsts, strict=True):
            if write:
                out.append(self._store(okey, self._flat(pool.host.get_data_page(first, flat=True)).numpy()))
                continue
            data = self._load([okey], pool.page_bytes)
            if data is None:
                out.append(False)
                continue
            page = torch.frombuffer(data, dtype=torch.uint8).view(pool.dtype)
            pool.host.set_from_flat_data_page(first, page)
            self.backend._count(hits=1, bytes_read=pool.page_bytes)
            out.append(True)
        return out

    def _kv_io(self, t: PoolTransfer, write: bool) -> list[bool]:
        """A v2 KV transfer through this deployment's KV interface (zero copy, or flat pages)."""
        keys, idx = list(t.keys or []), t.host_indices
        if self.interface == "v1":
            return self.batch_set_v1(keys, idx) if write else self.batch_get_v1(keys, idx)
        host, firsts = self.objects.host, idx.reshape(-1)[:: self.objects.page_size].tolist()
        if write:
            return [self.batch_set([k], [host.get_data_page(f, flat=True)]) for k, f in zip(keys, firsts, strict=True)]
        pages = self.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
        for f, page in zip(firsts, pages, strict=True):
            if page is not None:
                host.set_from_flat_data_page(f, page)
        return [p is not None for p in pages]

    def _batch_v2(self, transfers: list[PoolTransfer], write: bool) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        what = "batch_set_v2" if write else "batch_get_v2"
        for t in transfers:
            name = str(t.name)
            n = len(t.keys or [])
            if not self._ready(what):
                results[name] = [False] * n
                continue
            if write and not self.writer:  # MLA: the writer rank stores every pool's (replicated) pages
                with self._lock:
                    self._counts["skipped_sets"] += n
                results[name] = [True] * n
                continue
            try:
                results[name] = self._kv_io(t, write) if name == _KV else self._sidecar_io(t, write)
            except Exception as exc:  # a fault is a miss (a failed set)
                self._fault(what, exc)
                results[name] = [False] * n
        return results

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        """Read each transfer's pages (``keys`` into ``host_indices``) into its pool; per pool, whether
        each page was read."""
        return self._batch_v2(transfers, write=False)

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        """Store each transfer's pages from its pool; per pool, whether each page was stored."""
        return self._batch_v2(transfers, write=True)

    # -- the copying interface (flat page tensors) ---------------------------------------------------
    def _store(self, okey: str, part: np.ndarray) -> bool:
        """Store one object's bytes under ``okey``, counted; whether it was stored."""
        stored = bool(self.backend.set(okey, memoryview(part)))
        self.backend._count(sets=int(stored), set_failures=int(not stored), bytes_written=part.size * stored)
        return stored

    def _load(self, okeys: Sequence[str], nbytes: int) -> bytearray | None:
        """The objects under ``okeys`` end to end (one copy), or None (a miss, counted) when one is missing
        or they do not hold ``nbytes`` in all (a torn or foreign object)."""
        parts = [self.backend.get(k) for k in okeys]
        if any(p is None for p in parts) or sum(len(memoryview(p).cast("B")) for p in parts) != nbytes:
            self.backend._count(misses=1)
            return None
        return bytearray().join(parts)

    def _flat(self, value: Any) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            raise TypeError(f"value: expected a CPU tensor, got {type(value).__name__}")
        return value.contiguous().reshape(-1).view(torch.uint8)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page stored under ``key``, copied into ``target_location`` (a flat page tensor, as the
        host pool's ``get_dummy_flat_data_page`` makes) and returned; None on a miss."""
        out = self.batch_get([key], None if target_location is None else [target_location])
        return out[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        if not keys:
            return []
        if not self._ready("batch_get"):
            return [None] * len(keys)
        if target_locations is not None and len(target_locations) != len(keys):
            self._fault("batch_get", ValueError(f"{len(keys)} keys for {len(target_locations)} targets"))
            return [None] * len(keys)
        start = time.perf_counter()
        out: list[torch.Tensor | None] = []
        try:
            okeys = self._keys(keys)
            groups = self.objects.groups
            for i in range(len(keys)):
                joined = self._load(okeys[i * groups : (i + 1) * groups], self.objects.page_bytes * groups)
                if joined is None:
                    out.append(None)
                    continue
                src = torch.frombuffer(joined, dtype=torch.uint8)
                if groups > 1:
                    src = self._join_groups(src)
                if target_locations is None:
                    out.append(src)
                    continue
                target = target_locations[i]
                flat = self._flat(target)
                if flat.numel() != src.numel() or not target.is_contiguous():
                    raise ValueError(f"target_locations[{i}]: expected a contiguous {src.numel()}-byte page")
                flat.copy_(src)
                self.backend._count(hits=1, bytes_read=src.numel())
                out.append(target)
        except Exception as exc:
            self._fault("batch_get", exc)
            return out + [None] * (len(keys) - len(out))
        self._record("prefetch", sum(o is not None for o in out), time.perf_counter() - start)
        return out

    def _split_page(self, flat: Any) -> list[Any]:
        """A page_head flat page (K of every head, then V) as its head groups' objects (K then V of
        the group's heads): the byte order of the zero-copy objects."""
        half = flat.size // 2
        step = half // self.objects.groups
        return [np.concatenate((flat[g * step : (g + 1) * step], flat[half + g * step : half + (g + 1) * step]))
                for g in range(self.objects.groups)]  # fmt: skip

    def _join_groups(self, joined: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_split_page` over the groups' objects laid end to end."""
        groups = self.objects.groups
        step = joined.numel() // (2 * groups)
        parts = joined.view(groups, 2, step)
        return torch.cat((parts[:, 0].reshape(-1), parts[:, 1].reshape(-1)))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store flat page tensors (the host pool's ``get_data_page``); True when every one was stored."""
        if not keys:
            return True
        if not self._ready("batch_set") or values is None or len(values) != len(keys):
            if values is not None and len(values) != len(keys):
                self._fault("batch_set", ValueError(f"{len(keys)} keys for {len(values)} values"))
            return False
        if not self.writer:
            with self._lock:
                self._counts["skipped_sets"] += len(keys)
            return True
        start = time.perf_counter()
        try:
            okeys = self._keys(keys)
            groups = self.objects.groups
            ok = True
            for i, value in enumerate(values):
                flat = self._flat(value).numpy()
                if flat.size != self.objects.page_bytes * groups:
                    raise ValueError(f"values[{i}]: expected {self.objects.page_bytes * groups} bytes, got {flat.size}")
                parts = [flat] if groups == 1 else self._split_page(flat)
                for g, part in enumerate(parts):
                    ok = self._store(okeys[i * groups + g], part) and ok
        except Exception as exc:
            self._fault("batch_set", exc)
            return False
        self._record("backup", len(keys) if ok else 0, time.perf_counter() - start)
        return ok

    # -- lifecycle and metrics ----------------------------------------------------------------------
    def clear(self) -> None:
        """Drop every stored object, where the backend can (``clear``); otherwise nothing."""
        clear = getattr(self.backend, "clear", None)
        if callable(clear):
            try:
                clear()
            except Exception as exc:
                self._fault("clear", exc)

    def close(self) -> None:
        """Close the backend (idempotent); later calls are misses."""
        if self._closed:
            return
        self._closed = True
        try:
            self.backend.close()
        except Exception as exc:
            self._fault("close", exc)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` for the calls since the last call (pages per call and GB/s per
        call, prefetch and backup); None when storage metrics are off."""
        if not self.config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._lock:
            m.prefetch_pgs.extend(self._metrics["prefetch_pgs"])
            m.backup_pgs.extend(self._metrics["backup_pgs"])
            m.prefetch_bandwidth.extend(self._metrics["prefetch_bw"])
            m.backup_bandwidth.extend(self._metrics["backup_bw"])
            for v in self._metrics.values():
                v.clear()
        return m

    def stats(self) -> dict[str, Any]:
        """This adapter's counters (faults turned into misses, sets skipped on non-writer MLA ranks) and
        the backend's."""
        with self._lock:
            return {**self.backend.stats(), **self._counts}
