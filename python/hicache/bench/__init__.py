"""The cache layer's benchmarks, each a command line (``python -m hicache.bench.<name>``).

- :mod:`.serving`: a model served over the cache (recompute, device-only, hierarchical, + storage):
  TTFT per mode, hit rates per tier; the serving target.
- :mod:`.tree`: the radix tree's request path (compiled and Python cores, SGLang's trees beside them);
  ``--scale``: the engine's calls per request as the device pool grows (:mod:`.scale`).
- :mod:`.storage`: the storage tier's backends (file, O_DIRECT, Mooncake, NIXL): save, load, prefetch.
- :mod:`.host_setup`: seconds and GB/s to make a host pool's memory ready, by thread count, against a
  single-threaded memset of the same size.
- :mod:`.sglang`: SGLang's own radix caches run in a child process, for :mod:`.tree`'s comparison.

The top floor of the package: a benchmark may import any layer below; nothing imports a benchmark.
"""
