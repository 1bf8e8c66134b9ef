"""Where adapters for serving frameworks go (SGLang's storage backend and vLLM's offloading
connector): code that implements another project's interface on top of this package. Nothing lives
here yet; an adapter may import any layer below the benchmarks and the serving engine.
"""
