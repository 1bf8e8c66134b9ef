"""SGLang 0.5.23's own device and host KV pools on the CPU, built the way its server builds them, for the
integration tests and their child processes. Import it only once SGLang imports (``conftest.need``)."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

PAGE = 4
LAYERS = 3
DTYPE = torch.bfloat16


def mha_pools(layout: str, heads: int = 2, head_dim: int = 8, dtype: torch.dtype = DTYPE):
    """(device pool, host pool) of an MHA model: ``heads`` K/V heads of ``head_dim``, LAYERS layers."""
    kv = MHATokenToKVPool(256, PAGE, dtype, heads, head_dim, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1)
    host = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout, pin_memory=False,
                                device_capacity_tokens=kv.size, start_layer=kv.start_layer, end_layer=kv.end_layer,
                                write_back_staging=kv.hicache_write_back_staging)  # fmt: skip
    return kv, host


def mla_pools(layout: str, dtype: torch.dtype = DTYPE, dcp_size: int = 1, dcp_rank: int = 0):
    """(device pool, host pool) of an MLA model: a 16 + 8 latent, LAYERS layers. With decode context
    parallelism (``dcp_size`` > 1) the host pool gets the widened page, as SGLang's server passes it:
    its slots are logical, ``PAGE * dcp_size`` a page, and the rank holds PAGE of each."""
    kv = MLATokenToKVPool(256, PAGE, dtype, 16, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1)
    host = MLATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE * dcp_size, layout,
                                pin_memory=False, device_capacity_tokens=kv.size, start_layer=kv.start_layer,
                                end_layer=kv.end_layer, target_layer_num=LAYERS, dcp_size=dcp_size,
                                dcp_rank=dcp_rank)  # fmt: skip
    return kv, host


def mamba_pools(layout: str, slots: int = 32, conv_shape: tuple[int, int] = (3, 5)):
    """(device states [temporal, conv], host pool) of a model with LAYERS Mamba layers: a float32
    temporal (SSM) state of 2 x 4 and a bf16 conv state of ``conv_shape`` per request slot, as SGLang's
    MambaPoolHost takes them (``MambaStateBufferInfo``: layer and slot axes first)."""
    temporal = torch.empty(LAYERS, slots, 2, 4, dtype=torch.float32)
    conv = torch.empty(LAYERS, slots, *conv_shape, dtype=torch.bfloat16)
    info = MambaStateBufferInfo(temporal=temporal, conv=(conv,))
    host = MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, layout=layout)
    return [temporal, conv], host


def random_bytes(t: torch.Tensor, seed: int) -> None:
    """Fill ``t`` with seeded random bytes (never zeros; as bf16 they include NaNs: compare bytes)."""
    gen = torch.Generator().manual_seed(seed)
    raw = t.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
