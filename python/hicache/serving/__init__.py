"""A small model served over the cache, for the serving benchmark and the end-to-end tests.

- :mod:`.engine`: :class:`~hicache.serving.engine.Engine`, continuous batching over a
  :class:`~hicache.cache.radix_cache.HiRadixCache` (prefix hits per tier, layer-wise load-backs
  overlapped with the forward), and the request/result types.
- :mod:`.model`: :class:`~hicache.serving.model.TinyLM`, a decoder whose KV lives in the device pool
  (head-parallel TP ranks included).
- :mod:`.workloads`: the multi-turn and long-context QA request streams.
"""
