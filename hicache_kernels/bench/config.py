"""The bench's vocabulary: dtypes, ops (directions), backends, model presets, one sweep point, constants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._names import IO_BACKENDS

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}  # fmt: skip
DIRECTIONS = {"backup_all": ("d2h", "all"), "load_layer": ("h2d", "layer"), "load_all": ("h2d", "all")}
KERNEL_BULK = "kernel-bulk"
"""The ``kernel`` io-backend with ``design="bulk"`` (sm_90+ bulk-copy staging), benched beside the register kernel."""
# The kernel designs first, then the io-backends as listed.
BACKENDS = ("kernel", KERNEL_BULK, *(name for name in IO_BACKENDS if name != "kernel"))
KERNEL_BACKENDS = ("kernel", KERNEL_BULK)
COPY_ENGINE_BACKENDS = ("direct", "batch")
# Backends with no SM budget to sweep, planned on the host (host indices): the copy engines, and staged
# (torch packing + copy engines).
UNBUDGETED_BACKENDS = (*COPY_ENGINE_BACKENDS, "staged")
# A measured GB/s may exceed the link's theoretical figure by this much before the run is refused.
# NVML's figure subtracts only line encoding, so real copies stay well below it (Gen5 x16: 63 GB/s
# theoretical, about 55 measured); the margin absorbs CUDA-event resolution on short copies.
LINK_TOLERANCE = 0.02
# The time estimate printed before a run (and quoted in --targets-core's help): bytes at a typical
# PCIe Gen5 x16 rate, plus the host cost of issuing each copy-engine fragment. Rough by design.
ESTIMATE_GBPS = 50.0
ESTIMATE_US_PER_FRAGMENT = 2.0
# The --targets-core sweep (see parse_args); the help quotes the estimate for the default preset.
CORE_PAGE_SIZES = "1,4,16,64,128"
CORE_LAYOUTS = "page_first_direct,layer_first"
# estimate_s() of the default --targets-core plan; tests/kernels_bench/test_bench.py keeps it current
CORE_ESTIMATE_S = 16
# The GEMMs of --interference (n x n) and --overlap (the first of these at least 1.25x a layer's load).
INTERFERENCE_GEMM_N = 8192
OVERLAP_GEMM_NS = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


@dataclass(frozen=True)
class ModelConfig:
    """The KV shape of a model: per layer, per token, ``head_num x head_dim`` elements for K and V
    (MLA: one latent vector of ``head_dim`` = kv_dim elements)."""

    name: str
    num_layers: int
    head_num: int
    head_dim: int
    dtype: str = "bfloat16"
    mla: bool = False

    @property
    def item_bytes(self) -> int:
        return self.head_num * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def num_kv(self) -> int:
        return 1 if self.mla else 2

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot of a pool: every layer, K and V."""
        return self.num_kv * self.num_layers * self.item_bytes


PRESETS = {
    "llama3-8b": ModelConfig("llama3-8b", 32, 8, 128),  # MHA with GQA: 8 KV heads of 128
    "qwen3-32b": ModelConfig("qwen3-32b", 64, 8, 128),  # GQA: 64 layers, 8 KV heads
    "deepseek-v3": ModelConfig("deepseek-v3", 61, 1, 576, mla=True),  # MLA: 512 latent + 64 rope dims
}


@dataclass(frozen=True)
class PointSpec:
    model: ModelConfig
    backend: str
    direction: str  # backup_all / load_layer / load_all
    layout: str
    page_size: int
    num_pages: int
    sm_budget: int | None  # kernel/auto: SMs' worth of CTAs (blocks_for_sm_budget); copy engines: None

    @property
    def num_tokens(self) -> int:
        return self.page_size * self.num_pages

    @property
    def nbytes(self) -> int:
        """Bytes moved by one call (every layer, or one for ``load_layer``; K and V)."""
        layers = 1 if DIRECTIONS[self.direction][1] == "layer" else self.model.num_layers
        return self.num_tokens * layers * self.model.num_kv * self.model.item_bytes

    def as_point(self) -> dict[str, Any]:
        """The fields targets.py selects points by, before the point is measured."""
        return {"backend": self.backend, "item_bytes": self.model.item_bytes, "page_size": self.page_size,
                "sm_budget": self.sm_budget}  # fmt: skip


DESCRIPTION = "``python -m hicache_kernels.bench``: compare io-backends on model-shaped KV pools."
# --host-overhead: timed calls per row by default, and the warm-up calls before them (a fraction of
# the timed calls, at least HOST_WARMUP_MIN).
HOST_CALLS = 1000
HOST_WARMUP_FRACTION = 10
HOST_WARMUP_MIN = 10
