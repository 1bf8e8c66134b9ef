"""Ordering: one stream/event abstraction for every copy the cache issues, and the devices behind it.

- :mod:`.devices`: :class:`StreamDevice` (the protocol), :class:`CudaDevice` (``torch.cuda`` streams
  and events), :class:`EagerDevice` (CPU pools: a copy has landed when its call returns) and
  :class:`KVRegion` (the pool memory a copy reads or writes).
- :mod:`.deferred`: :class:`~hicache.streams.deferred.DeferredDevice`, CPU pools whose copies complete
  later than they are issued, as on a GPU, with every ordering hazard reported. The controller takes
  it for CPU pools when ``HICACHE_DEFERRED_SEED`` is set; tests and users may build one directly.
"""

from .devices import CudaDevice, EagerDevice, KVRegion, StreamDevice

__all__ = ["CudaDevice", "EagerDevice", "KVRegion", "StreamDevice"]
