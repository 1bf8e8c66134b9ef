"""Adapters for serving frameworks: code that implements another project's interface on top of this
package, loaded by that project's own configuration.

- :mod:`hicache.integrations.sglang`: ``HiCacheKernelsStorage``, SGLang's HiCache storage (L3) backend
  (``--hicache-storage-backend dynamic``).
- :mod:`hicache.integrations.vllm`: ``HiCacheSecondaryTier``, a secondary tier of vLLM's
  ``TieringOffloadingSpec`` (``secondary_tiers``).

Each imports its framework and says so, naming it, when that is missing. An adapter may import any
layer below the benchmarks and the serving engine.
"""
