"""The cache controller: copies between the pools issued on streams, and their completions.

- :mod:`.controller`: :class:`HiCacheController` (backups and load-backs through an io-backend of
  :mod:`hicache_kernels`, worker threads, the acks the cache takes).
- :mod:`.copy_completions`: which copies have landed, in issue order, and what failed.
- :mod:`.copy_errors`: :class:`~hicache.controller.copy_errors.CopyError` and the other outcomes of a copy.
- :mod:`.layer_counter`: :class:`LayerDoneCounter`, per-layer completion for a forward that overlaps a
  layer-wise load; :mod:`.layer_loads`: the per-layer plans of one load batch.
- :mod:`.metrics`: :class:`~hicache.controller.metrics.CacheMetrics`, the counters the controller and
  the cache fill.
"""

from .controller import HiCacheController
from .layer_counter import LayerDoneCounter

__all__ = ["HiCacheController", "LayerDoneCounter"]
