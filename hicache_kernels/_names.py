"""Names several modules share, each in one place. Torch-free, so ``python -m hicache_kernels.info``
reads them without importing torch."""

IO_BACKENDS: tuple[str, ...] = ("direct", "batch", "kernel", "triton", "auto", "staged")
"""The io-backends, by name (:func:`hicache_kernels.backends.get_backend`)."""
