"""vLLM's KV offloading tiers backed by this package's storage backends.

:class:`HiCacheSecondaryTier` is a ``SecondaryTierManager`` (``vllm/v1/kv_offload/tiering/base.py``,
vLLM 0.34.0): a storage tier below vLLM's CPU primary tier, loaded by ``TieringOffloadingSpec`` from
the connector's extra config with no change to vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 17179869184,
            "secondary_tiers": [{"type": "HiCacheSecondaryTier",
                                 "module_path": "hicache.integrations.vllm",
                                 "hicache_backend": "file",
                                 "hicache_backend_config": {"path": "/mnt/kv",
                                                            "capacity_bytes": 100000000000}}]}}'

``hicache_backend`` is ``"file"``, ``"mooncake"``, ``"nixl"`` or ``"package.module:Class"`` (any
:class:`~hicache.storage.base.StorageBackend`), built by :func:`hicache.storage.create_backend` with
``hicache_backend_config`` as its keyword arguments. Optional: ``hicache_namespace`` (a tenant salt),
``io_threads`` (worker threads, default 2), ``locality`` (vLLM's ``"LOCAL"`` / ``"REMOTE"``),
``enable_kv_events`` and ``backpressure`` (vLLM's own tier options).

What runs where. The tier lives in vLLM's scheduler process. vLLM's workers copy GPU blocks into the
CPU primary tier (a shared mmap of ``num_chunks`` rows); this tier moves whole rows between that
region and the store: a cascade (``submit_store``) writes rows the primary tier holds, a promotion
(``submit_load``) reads objects into rows the primary tier allocated. A row is one object, read and
written in place by the backend (:class:`VLLMChunkObjects` is the region seen as a host pool: object id
= chunk id); the copies run on the tier's threads, never on the scheduler thread. Lookups are vLLM's
own non-blocking ``AsyncLookupManager`` (a lookup answers RETRY until the existence probe, run on its
thread, comes back).

Keys. vLLM's ``OffloadKey`` is a block hash and a KV-cache group index; it says nothing about the
model, dtype, layout or parallelism. Every key is re-keyed as ``SHA-256(namespace digest || key)``:
the digest covers the model name, the KV dtype, the tokens per hash and blocks per chunk, the KV-cache
groups (tokens per block and layer names), the KV-cache layout and whether it is vLLM's canonical one,
the row's byte length, the parallel sizes and rank (left out when vLLM says the bytes are
parallelism-agnostic, so such rows are shared across TP sizes) and the tenant salt.

Faults. A store fault (a missing, torn or corrupt object, a full store, a backend exception) fails the
job (``JobResult.success`` False; a promotion names the keys that did load), never an exception into
vLLM's scheduler. A job's result is posted only when the backend is done with the job's rows
(:meth:`~hicache.storage.base.StorageBackend.slots_busy` is waited out), so vLLM may reuse them at once.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

try:
    from vllm.v1.kv_offload.base import (
        ConfigInfo,
        Locality,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
    )
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
except ModuleNotFoundError as exc:
    from hicache.integrations._clients import raise_client_missing

    raise_client_missing(exc, "vllm", "vLLM (tested with vllm==0.34.0): it runs inside vLLM's scheduler",
                         "hicache.integrations.vllm")  # fmt: skip

from hicache.integrations._clients import fields_digest
from hicache.storage import StorageBackend, create_backend
from hicache_kernels.backends import get_backend
from hicache_kernels.ranges import copy_ranges

__all__ = ["HiCacheSecondaryTier", "HiCacheTieringSpec", "VLLMChunkObjects", "swap_blocks_fn"]

logger = logging.getLogger(__name__)

#: The byte format of the stored objects; part of every digest, so a change never reads old objects.
OBJECT_FORMAT = "hicache-vllm-v1"


class VLLMChunkObjects:
    """vLLM's CPU primary tier seen as this package's storage backends see a host pool: object ``c`` is
    row ``c`` of the region, ``page_bytes`` (the row stride) long, one memory range inside ``buffer``.

    Parameters
    ----------
    primary_kv_view : memoryview
        vLLM's ``primary_kv_view``: C-contiguous, shape ``(num_chunks, row_bytes)``, one byte per
        element. No copy is made; the region must outlive this object (vLLM's primary tier owns it).
    """

    def __init__(self, primary_kv_view: memoryview) -> None:
        if not isinstance(primary_kv_view, memoryview):
            raise TypeError(f"primary_kv_view: expected a memoryview, got {type(primary_kv_view).__name__}")
        view = primary_kv_view
        if view.ndim != 2 or view.itemsize != 1 or not view.c_contiguous:
            raise ValueError(f"primary_kv_view: expected a C-contiguous (num_chunks, row_bytes) byte view, got "
                             f"shape {view.shape} itemsize {view.itemsize}")  # fmt: skip
        self.num_chunks, self.page_bytes = int(view.shape[0]), int(view.shape[1])
        # Zero copy: numpy takes the buffer, torch takes numpy's.
        self.buffer = torch.from_numpy(np.asarray(view).view(np.uint8).reshape(-1))
        self.page_size = 1
        self.size = self.num_chunks

    def page_ranges(self, ids: torch.Tensor | np.ndarray | Sequence[int]) -> list[list[tuple[int, int]]]:
        """One ``(address, nbytes)`` range per chunk id: the row."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_chunks):
            raise ValueError(f"chunk_ids: expected ids in [0, {self.num_chunks}), got {ids.min()}..{ids.max()}")
        if self.buffer.numel() == 0 and self.num_chunks:
            raise RuntimeError("page_ranges: the primary region was released (the tier is shut down)")
        base, n = self.buffer.data_ptr(), self.page_bytes
        return [[(base + c * n, n)] for c in ids.tolist()]

    def release(self) -> None:
        """Drop the reference to the region, so vLLM can unmap it at shutdown (idempotent)."""
        self.buffer = torch.empty(0, dtype=torch.uint8)


def namespace_fields(offloading_spec: Any, row_bytes: int, salt: str | None) -> dict[str, Any]:
    """What the namespace digest covers, from vLLM's ``OffloadingConfig`` (``offloading_spec.config``)."""
    config = offloading_spec.config
    parallel = config.parallel
    fields: dict[str, Any] = {
        "format": OBJECT_FORMAT,
        "model": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": int(config.cache.tokens_per_hash),
        "blocks_per_chunk": int(config.cache.blocks_per_chunk),
        "groups": [[int(g.tokens_per_block), list(g.layer_names)] for g in config.groups],
        "kv_cache_layout": config.kv_cache_layout,
        "canonical_layout": bool(config.canonical_layout),
        "replicated_layout": bool(config.replicated_layout),
        "row_bytes": int(row_bytes),
        "salt": salt,
    }
    if not parallel.is_parallelism_agnostic:
        fields["parallel"] = [parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size,
                              parallel.world_size, parallel.rank]  # fmt: skip
    return fields


@dataclass(frozen=True)
class HiCacheTierInfo(ConfigInfo):
    """The tier's facts on vLLM's ``vllm:kv_offload_config_info`` metric."""

    hicache_backend: str


class _Lookups(AsyncLookupManager):
    """vLLM's non-blocking lookups; the existence probes run on its thread."""

    def __init__(self, tier: HiCacheSecondaryTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._probe(keys)


class HiCacheSecondaryTier(SecondaryTierManager):
    """vLLM ``SecondaryTierManager`` over a :class:`~hicache.storage.base.StorageBackend` (module docstring).

    Parameters
    ----------
    offloading_spec : OffloadingSpec
        vLLM's (``TieringOffloadingSpec``); its ``config`` feeds the namespace.
    primary_kv_view : memoryview
        The CPU primary tier's rows, ``(num_chunks, row_bytes)`` bytes.
    tier_type : str
        Set by vLLM's ``SecondaryTierFactory`` (the config's ``type``).
    hicache_backend : str
        ``"file"`` (default), ``"mooncake"``, ``"nixl"`` or ``"package.module:Class"``.
    hicache_backend_config : dict, optional
        The backend's keyword arguments (for ``file``: ``path``, ``capacity_bytes``, ...).
    hicache_namespace : str, optional
        A tenant salt: deployments with different salts never read each other's objects.
    io_threads : int
        Threads that run the tier's copies (default 2).
    locality : str, optional
        vLLM's ``Locality`` name (``"LOCAL"`` / ``"REMOTE"``) for the tier's KV events.
    enable_kv_events : bool
        Emit vLLM ``OffloadingEvent`` s for stored objects (when vLLM's KV events are on).
    backpressure_detector : BackpressureDetector, optional
        Built by vLLM's factory from the tier's ``backpressure`` config.
    backend : StorageBackend, optional
        A ready backend instead of one built from ``hicache_backend`` (embedding, tests).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        hicache_backend: str = "file",
        hicache_backend_config: dict[str, Any] | None = None,
        hicache_namespace: str | None = None,
        io_threads: int = 2,
        locality: str | None = None,
        enable_kv_events: bool = False,
        backpressure_detector: Any = None,
        backend: StorageBackend | None = None,
    ) -> None:
        objects = VLLMChunkObjects(primary_kv_view)  # validates the view before vLLM's base reads it
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if hicache_namespace is not None and not isinstance(hicache_namespace, str):
            raise TypeError(f"hicache_namespace: expected a string, got {type(hicache_namespace).__name__}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads: expected an integer >= 1, got {io_threads!r}")
        self.locality = Locality(locality) if locality is not None else None
        # The namespace first: a spec it cannot read fails before a backend (threads, connections) exists.
        self._prefix = fields_digest(namespace_fields(offloading_spec, objects.page_bytes, hicache_namespace))
        if backend is None:
            if not isinstance(hicache_backend, str):
                raise TypeError(f"hicache_backend: expected a backend name or 'module:Class', got {hicache_backend!r}")
            config = hicache_backend_config or {}
            if not isinstance(config, dict):
                raise TypeError(f"hicache_backend_config: expected an object, got {type(config).__name__}")
            backend = create_backend(hicache_backend, config)
            self._backend_name = hicache_backend
        elif not isinstance(backend, StorageBackend):
            raise TypeError(f"backend: expected a hicache StorageBackend, got {type(backend).__name__}")
        else:
            self._backend_name = type(backend).__name__
        self.backend = backend
        self.objects = objects
        try:
            backend.attach(objects)
        except Exception:
            backend.close()
            raise
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self.events = []
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix=f"hicache-vllm-{tier_type}")
        self._lock = threading.Lock()  # guards the three below (the tier's threads post results)
        self._inflight: dict[int, Future] = {}
        self._finished: list[JobResult] = []
        self._counts = {"stored": 0, "skipped_present": 0, "loaded": 0, "failed_stores": 0, "failed_loads": 0,
                        "faults": 0}  # fmt: skip
        self._store_keys: dict[int, Sequence[OffloadKey]] = {}  # job -> keys (scheduler thread only)
        self._load_keys: dict[int, Sequence[OffloadKey]] = {}
        self._store_ctx: dict[int, ReqContext] = {}
        self._closed = False
        self._lookups = _Lookups(self, tier_type)
        self._config_info = HiCacheTierInfo(hicache_backend=self._backend_name)

    # -- keys ---------------------------------------------------------------------------------------
    def object_key(self, key: OffloadKey) -> str:
        """The store's key of one vLLM key in this tier's namespace (64 hex characters)."""
        return hashlib.sha256(self._prefix + bytes(key)).hexdigest()

    def _probe(self, keys: Sequence[OffloadKey]) -> list[bool]:
        out = []
        for key in keys:
            try:
                out.append(bool(self.backend.exists(self.object_key(key))))
            except Exception as exc:  # a probe fault is a miss
                self._fault("lookup", exc)
                out.append(False)
        return out

    def _fault(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self._counts["faults"] += 1
            first = self._counts["faults"] == 1
        (logger.warning if first else logger.debug)("hicache tier %s failed: %r", what, exc)

    # -- the scheduler's calls ----------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._closed:  # the probe thread is gone: a RETRY would never resolve
            return LookupResult.MISS
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's primary rows under its keys, on the tier's threads (rows whose objects are
        already stored are left alone)."""
        job = job_metadata
        self._store_keys[job.job_id] = list(job.keys)
        self._store_ctx[job.job_id] = job.req_context
        self._submit(job, self._run_store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's objects into its primary rows, on the tier's threads."""
        job = job_metadata
        self._load_keys[job.job_id] = list(job.keys)
        self._submit(job, self._run_load)

    def _submit(self, job: TransferJob, run: Any) -> None:
        keys = list(job.keys)
        ids = np.asarray(job.chunk_ids, dtype=np.int64).reshape(-1)
        if self._closed or len(keys) != ids.size:
            why = "closed" if self._closed else f"{len(keys)} keys for {ids.size} chunk_ids"
            self._fault(f"job {job.job_id}", ValueError(why))
            with self._lock:
                self._finished.append(JobResult(job_id=job.job_id, success=False))
            return
        with self._lock:
            self._inflight[job.job_id] = self._pool.submit(run, job.job_id, keys, ids)

    def _post(self, result: JobResult) -> None:
        with self._lock:
            self._finished.append(result)
            self._inflight.pop(result.job_id, None)

    def _settle(self, ids: np.ndarray) -> None:
        """Wait until the backend has no transfer left on these rows (one it gave up on still may)."""
        try:
            self.backend.slots_busy(torch.from_numpy(ids), timeout=None)
        except Exception as exc:
            self._fault("slots_busy", exc)

    def _run_store(self, job_id: int, keys: list[OffloadKey], ids: np.ndarray) -> None:
        start = time.perf_counter()
        okeys = [self.object_key(k) for k in keys]
        ok, written = False, 0
        try:
            # A request's chunks are stored in order: the leading ones already stored are skipped.
            present = int(self.backend.batch_exists(okeys)) if okeys else 0
            todo = list(range(present, len(okeys)))
            results = list(self.backend.batch_set_from([okeys[i] for i in todo], torch.from_numpy(ids[todo])))
            ok = all(results)
            written = sum(results) * self.objects.page_bytes
            with self._lock:
                self._counts["stored"] += sum(results)
                self._counts["skipped_present"] += present
                self._counts["failed_stores"] += int(not ok)
        except Exception as exc:  # a store fault fails the job
            self._fault(f"store job {job_id}", exc)
            with self._lock:
                self._counts["failed_stores"] += 1
        self._settle(ids)
        self._post(JobResult(job_id=job_id, success=ok, transfer_time=time.perf_counter() - start,
                             transfer_bytes=written))  # fmt: skip

    def _run_load(self, job_id: int, keys: list[OffloadKey], ids: np.ndarray) -> None:
        start = time.perf_counter()
        results = [False] * len(keys)
        try:
            results = [bool(r) for r in self.backend.batch_get_into([self.object_key(k) for k in keys],
                                                                     torch.from_numpy(ids))]  # fmt: skip
        except Exception as exc:
            self._fault(f"load job {job_id}", exc)
        self._settle(ids)
        ok = all(results)
        with self._lock:
            self._counts["loaded"] += sum(results)
            self._counts["failed_loads"] += int(not ok)
        self._post(JobResult(
            job_id=job_id, success=ok,
            successful_keys=None if ok else [k for k, r in zip(keys, results, strict=True) if r],
            transfer_time=time.perf_counter() - start, transfer_bytes=sum(results) * self.objects.page_bytes,
        ))  # fmt: skip

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs that finished since the last call; a stored key turns this tier's cached lookups into
        hits, a key that failed to load into misses (so vLLM recomputes it rather than retrying)."""
        with self._lock:
            results, self._finished = self._finished, []
        for result in results:
            keys = self._store_keys.pop(result.job_id, None)
            ctx = self._store_ctx.pop(result.job_id, None)
            if keys is not None and result.success:
                self._lookups.mark_present(keys)
                if self.events is not None and keys:
                    self.events.append(OffloadingEvent(keys=list(keys), medium=self.medium, removed=False,
                                                       locality=self.locality, req_context=ctx))  # fmt: skip
            load_keys = self._load_keys.pop(result.job_id, None)
            if load_keys is not None and not result.success:
                loaded = set(result.successful_keys or ())
                self._lookups.mark_miss([k for k in load_keys if k not in loaded])
        return results

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight or self._finished)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            return events
        return ()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (none is aborted; results stay queued for
        :meth:`get_finished_jobs`)."""
        while True:
            with self._lock:
                pending = list(self._inflight.values())
            if not pending:
                return
            wait_futures(pending)

    def shutdown(self) -> None:
        """Finish the jobs in flight, stop the threads and close the backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._lookups.shutdown()
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        try:
            self.backend.close()
        except Exception as exc:
            self._fault("close", exc)
        self.objects.release()

    # -- metrics ------------------------------------------------------------------------------------
    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return HiCacheTierInfo.config_info_keys()

    def config_info(self) -> Any:
        return self._config_info.as_config_info()

    def stats(self) -> dict[str, Any]:
        """This tier's counters (rows stored, skipped as present, loaded; failed jobs; faults) and the
        backend's."""
        with self._lock:
            return {**self.backend.stats(), **self._counts}


# -- the GPU <-> CPU copies of vLLM's worker ---------------------------------------------------------------
def swap_blocks_fn(gpu_to_cpu: bool, backend: str = "auto") -> Any:
    """A drop-in for vLLM's ``swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any)``
    (the copy vLLM's CPU offloading worker queues on its transfer stream, the current stream when it
    calls) that runs :func:`hicache_kernels.copy_ranges` on ``backend`` instead. ``is_src_access_order_any``
    is accepted and unused: the kernels read their sources in stream order."""
    io = get_backend(backend)
    direction = "d2h" if gpu_to_cpu else "h2d"

    def swap_blocks_batch(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor,
                          is_src_access_order_any: bool = False) -> None:  # fmt: skip
        copy_ranges(src_ptrs, dst_ptrs, sizes, direction=direction, backend=io)

    swap_blocks_batch.hicache_backend = io.name  # type: ignore[attr-defined]
    return swap_blocks_batch


class HiCacheTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` whose GPU worker copies blocks between the GPU and the CPU
    primary tier with :func:`hicache_kernels.copy_ranges` (``hicache_io_backend`` in the extra config:
    ``"auto"`` by default, ``"kernel"``, ``"batch"`` or ``"triton"``) instead of vLLM's
    ``swap_blocks_batch``. Everything else is vLLM's: loaded with ``"spec_name": "HiCacheTieringSpec",
    "spec_module_path": "hicache.integrations.vllm"``, secondary tiers as for ``TieringOffloadingSpec``."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.io_backend = self.extra_config.get("hicache_io_backend", "auto")
        get_backend(self.io_backend)  # an unknown name fails here, naming the setting's value

    def create_worker(self, kv_caches: Any) -> Any:
        worker = super().create_worker(kv_caches)
        for name in ("_store_handler", "_load_handler", "_expedited_load_handler"):
            handler = getattr(worker, name, None)
            if handler is None or not hasattr(handler, "_swap_blocks_batch"):
                raise RuntimeError(f"HiCacheTieringSpec: vLLM's CPUOffloadingWorker has no {name} with a "
                                   "_swap_blocks_batch (tested with vllm==0.34.0)")  # fmt: skip
            handler._swap_blocks_batch = swap_blocks_fn(handler.gpu_to_cpu, self.io_backend)
        return worker
