"""hicache: a minimal hierarchical KV cache (device pool, pinned host pool, radix tree, controller)
built on the transfer ops of :mod:`hicache_kernels`."""

__all__: list[str] = []
