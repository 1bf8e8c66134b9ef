"""The counters of a HiCache instance (:class:`CacheMetrics`): hits per tier, tokens and bytes moved,
transfer times, evictions, load-back and prefetch latencies, failed and dropped copies. The controller
counts its copies into it, the cache its hits, evictions and storage traffic."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CacheMetrics:
    """Counters of a HiCache instance. Times in seconds, sizes in tokens and bytes."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    miss_tokens: int = 0
    window_cut_tokens: int = 0  # matched tokens a sliding-window model could not resume from (windows gone)
    tokens_written: int = 0
    bytes_written: int = 0
    write_time_s: float = 0.0
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    load_time_s: float = 0.0
    device_evicted_tokens: int = 0
    host_evicted_tokens: int = 0
    writes_refused_host_full: int = 0
    load_backs: int = 0
    load_backs_skipped: int = 0
    writes_failed: int = 0  # backups that raised (their nodes stay device-only)
    loads_failed: int = 0  # load-backs that raised (their nodes go back to host-only)
    copies_dropped: int = 0  # copies dropped unrun by close(drain=False)
    load_back_latency_s: list[float] = field(default_factory=list)
    host_pinned_bytes: int = 0  # page-locked bytes of the host pool (its exact size, rounded to OS pages)
    # The storage tier (HiRadixCache(storage=...)); pages are host pages (page_size tokens).
    storage_pages_written: int = 0
    storage_pages_skipped: int = 0  # already stored (by this or another instance): not written again
    storage_bytes_written: int = 0
    storage_write_time_s: float = 0.0
    storage_backups_failed: int = 0  # backups whose backend call raised (their pages are simply not stored)
    storage_hit_tokens: int = 0  # tokens a prefetch brought into the host pool and the tree
    storage_pages_read: int = 0
    storage_bytes_read: int = 0
    storage_read_time_s: float = 0.0  # the prefetch I/O thread's time on prefetches that finished
    prefetches: int = 0  # started
    prefetches_cut: dict[str, int] = field(default_factory=dict)  # per policy: stopped before every page landed
    prefetches_discarded: int = 0  # landed, but the tree had meanwhile cached those tokens: slots freed
    prefetch_latency_s: list[float] = field(default_factory=list)

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_time_s / 1e9 if self.write_time_s else 0.0

    @property
    def load_gbps(self) -> float:
        return self.bytes_loaded / self.load_time_s / 1e9 if self.load_time_s else 0.0

    @property
    def storage_write_gbps(self) -> float:
        t = self.storage_write_time_s
        return self.storage_bytes_written / t / 1e9 if t else 0.0

    @property
    def storage_read_gbps(self) -> float:
        t = self.storage_read_time_s
        return self.storage_bytes_read / t / 1e9 if t else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        lat = d.pop("load_back_latency_s")
        plat = d.pop("prefetch_latency_s")
        d.update(
            write_gbps=self.write_gbps,
            load_gbps=self.load_gbps,
            load_back_latency_mean_s=sum(lat) / len(lat) if lat else 0.0,
            load_back_latency_max_s=max(lat, default=0.0),
            storage_write_gbps=self.storage_write_gbps,
            storage_read_gbps=self.storage_read_gbps,
            prefetch_latency_mean_s=sum(plat) / len(plat) if plat else 0.0,
            prefetch_latency_max_s=max(plat, default=0.0),
        )
        return d
