"""The geometry of :class:`~hicache.serving.model.TinyLM` (:class:`ModelConfig`) and the pools it needs
beside its KV pool: the indexer's sidecar (:func:`index_pool`, its keys FP8 with a scale:
:func:`quantize_index_keys`), the recurrent branch's checkpoints (:func:`state_pool`) and the
sliding-window layers' window pool (:meth:`ModelConfig.window_pool`). Importable from
:mod:`hicache.serving.model` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..pools import DeviceKVPool
from ..pools.window_pool import WindowKVPool

__all__ = [
    "ModelConfig",
    "dequantize_index_keys",
    "index_pool",
    "index_row",
    "quantize_index_keys",
    "state_pool",
    "state_row",
]


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of :class:`TinyLM` (its weights come from ``seed``)."""

    num_layers: int = 4
    hidden: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    vocab: int = 512
    dtype: torch.dtype = torch.float32
    seed: int = 0
    # True: every token's computation independent of how the work is split (bit-identical logits on CPU
    # float32 whether a prefix came from the cache or was recomputed; slow). False: matmuls and fused
    # attention (for benchmarks at real sizes, on a GPU).
    exact: bool = True
    mla: bool = False  # cache a kv_lora-element latent per token (an MLA pool) instead of K and V heads
    kv_lora: int = 32
    # A sparse-attention indexer (DeepSeek V3.2 style): each token's index key (indexer_dim elements)
    # goes into a sidecar pool beside the KV, and each query attends only to the index_topk earlier
    # tokens whose keys score highest against its index query. 0: dense attention, no sidecar.
    indexer_dim: int = 0
    index_topk: int = 8
    # The index keys as DeepSeek V3.2 stores them: FP8 (e4m3) with one float32 scale per token, packed
    # into uint8 rows of indexer_dim + 4 bytes (index_pool). False: keys in ``dtype``, unquantized.
    indexer_fp8: bool = True
    # A recurrent branch (linear attention / Mamba-style, as in hybrid models): layer recurrent_layer
    # also runs a per-channel linear recurrence over recurrent_dim channels beside its attention (the
    # two added, as Hymba's parallel heads are). Its state is one fixed-size vector per sequence, not
    # per token: the cache keeps it as a checkpoint at every page boundary (state_pool). 0: none.
    recurrent_dim: int = 0
    recurrent_layer: int = 0
    # The recurrent layer has no attention (a Mamba layer of a Jamba / Nemotron-H style hybrid): its
    # output is the recurrent branch's alone, and it has no K/V in any pool.
    recurrent_only: bool = False
    # Sliding-window attention (Gemma / Mistral / gpt-oss style hybrids): every layer but each
    # full_every-th (layers full_every - 1, 2 * full_every - 1, ...) attends only to the last
    # sliding_window tokens (itself included) and reads only their K/V from the pool. 0: every layer full.
    sliding_window: int = 0
    full_every: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "ffn", "vocab", "kv_lora",
                     "index_topk"):  # fmt: skip
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.indexer_dim, int) or self.indexer_dim < 0:
            raise ValueError(f"indexer_dim: expected an int >= 0, got {self.indexer_dim!r}")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError(f"sliding_window: expected an int >= 0, got {self.sliding_window!r}")
        if not isinstance(self.full_every, int) or self.full_every < 1:
            raise ValueError(f"full_every: expected a positive int, got {self.full_every!r}")
        if self.recurrent_only and (not self.recurrent_dim or self.mla):
            raise ValueError("recurrent_only: needs recurrent_dim, with MHA/GQA attention layers (not mla)")
        if self.sliding_window and (self.mla or self.indexer_dim):
            raise ValueError("sliding_window: served with MHA/GQA layers only (not with mla or an indexer)")
        if not isinstance(self.recurrent_dim, int) or self.recurrent_dim < 0:
            raise ValueError(f"recurrent_dim: expected an int >= 0, got {self.recurrent_dim!r}")
        if not isinstance(self.recurrent_layer, int) or not 0 <= self.recurrent_layer < self.num_layers:
            raise ValueError(
                f"recurrent_layer: expected a layer in [0, {self.num_layers}), got {self.recurrent_layer!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: expected a divisor of num_heads ({self.num_heads}), got {self.num_kv_heads}"
            )

    def window(self, layer: int) -> int:
        """The attention window of ``layer`` in tokens (0: full attention)."""
        return 0 if (layer + 1) % self.full_every == 0 else self.sliding_window

    def attends(self, layer: int) -> bool:
        """Whether ``layer`` has attention (and K/V in a pool): all but a ``recurrent_only`` layer."""
        return not (self.recurrent_only and self.recurrent_dim and layer == self.recurrent_layer)

    def layer_slots(self, windowed: bool) -> tuple[list[int], list[int]]:
        """``(kv, window)``: each layer's index in the KV pool and in the window pool, -1 where a layer is
        not in that pool. ``windowed``: the windowed layers have a :class:`~hicache.pools.WindowKVPool`
        (the KV pool holds the full layers); else every attention layer is in the KV pool."""
        kv, win, nk, nw = [], [], 0, 0
        for li in range(self.num_layers):
            if not self.attends(li):
                kv.append(-1)
                win.append(-1)
            elif windowed and self.window(li):
                kv.append(-1)
                win.append(nw)
                nw += 1
            else:
                kv.append(nk)
                win.append(-1)
                nk += 1
        return kv, win

    def pool(self, num_slots: int, page_size: int, device: str | torch.device = "cpu", *, windowed: bool = False,
             kv_heads: int | None = None) -> DeviceKVPool:  # fmt: skip
        """A device KV pool shaped for this model (an MLA pool of ``kv_lora`` when ``mla``). ``windowed``:
        the full layers only (the windowed ones go to a :meth:`window_pool`)."""
        if windowed and not self.sliding_window:
            raise ValueError("windowed: this model has no sliding-window layers")
        layers = sum(1 for x in self.layer_slots(windowed)[0] if x >= 0)
        if not layers:
            raise ValueError("full_every, recurrent_only: this model has no attention layer for the KV pool")
        if self.mla:
            return DeviceKVPool(num_slots=num_slots, num_layers=layers, head_num=1, head_dim=self.kv_lora,
                                dtype=self.dtype, device=device, page_size=page_size, mla=True)  # fmt: skip
        return DeviceKVPool(num_slots=num_slots, num_layers=layers, head_num=kv_heads or self.num_kv_heads,
                            head_dim=self.head_dim, dtype=self.dtype, device=device, page_size=page_size)  # fmt: skip

    def kv_layer_needed(self, layer: int, windowed: bool) -> int:
        """The KV-pool layer whose load-back must have landed before ``layer`` runs. With a window pool
        (``windowed``), a windowed layer reads only window rows, which land before the KV's layer 0."""
        kv = self.layer_slots(windowed)[0][layer]
        return kv if kv >= 0 else 0  # a recurrent layer's checkpoints land with the KV's layer 0 too

    def window_pool(self, kv_pool: DeviceKVPool, num_slots: int) -> WindowKVPool:
        """The windowed layers' pool beside ``kv_pool`` (a :meth:`pool` with ``windowed=True``):
        ``num_slots`` window slots, rows kept only where a window needs them."""
        n = sum(1 for x in self.layer_slots(True)[1] if x >= 0)
        if not n:
            raise ValueError("sliding_window: this model has no windowed attention layer (see full_every)")
        return WindowKVPool(kv_pool, num_slots=num_slots, num_layers=n, window=self.sliding_window)


def index_pool(cfg: ModelConfig, num_slots: int, page_size: int, device: str | torch.device = "cpu") -> DeviceKVPool:
    """The indexer's sidecar pool for ``cfg``, sharing the KV pool's slot numbering: give it to the cache
    as ``sidecars=[(pool, HostKVPool(pool, ...))]``. A row a token and layer: with ``indexer_fp8`` (the
    default) ``indexer_dim + 4`` bytes (uint8: the key in FP8 e4m3, then its float32 scale, as DeepSeek
    V3.2's indexer cache packs them), else ``indexer_dim`` elements of ``cfg.dtype``."""
    if not cfg.indexer_dim:
        raise ValueError("indexer_dim: this model has no indexer (0)")
    width, dtype = index_row(cfg)
    return DeviceKVPool(num_slots=num_slots, num_layers=cfg.num_layers, head_num=1, head_dim=width,
                        dtype=dtype, device=device, page_size=page_size, mla=True)  # fmt: skip


def state_pool(cfg: ModelConfig, num_slots: int, page_size: int, device: str | torch.device = "cpu") -> DeviceKVPool:
    """The recurrent branch's checkpoint pool for ``cfg``: the state after each page's last token, spread
    over the page's rows (one layer; a row a token of ``recurrent_dim / page_size`` float32 elements),
    sharing the KV pool's slot numbering, so a page's checkpoint moves, is stored and is evicted with its
    KV: give it to the cache as ``sidecars=[(pool, HostKVPool(pool, ...))]``. Every page boundary is a
    checkpoint, so every page-aligned prefix hit can resume the recurrence; the price is one state
    (``recurrent_dim * 4`` bytes) per page."""
    width, dtype = state_row(cfg, page_size)
    return DeviceKVPool(num_slots=num_slots, num_layers=1, head_num=1, head_dim=width,
                        dtype=dtype, device=device, page_size=page_size, mla=True)  # fmt: skip


def state_row(cfg: ModelConfig, page_size: int) -> tuple[int, torch.dtype]:
    """``(elements, dtype)`` of one row of ``cfg``'s checkpoint pool (:func:`state_pool`) at ``page_size``."""
    if not cfg.recurrent_dim:
        raise ValueError("recurrent_dim: this model has no recurrent branch (0)")
    if cfg.recurrent_dim % page_size:
        raise ValueError(f"page_size: {page_size} does not divide recurrent_dim {cfg.recurrent_dim} (a page's rows "
                         "hold one state)")  # fmt: skip
    return cfg.recurrent_dim // page_size, torch.float32


def index_row(cfg: ModelConfig) -> tuple[int, torch.dtype]:
    """``(elements, dtype)`` of one row of ``cfg``'s index pool (:func:`index_pool`)."""
    return (cfg.indexer_dim + _SCALE_BYTES, torch.uint8) if cfg.indexer_fp8 else (cfg.indexer_dim, cfg.dtype)


_SCALE_BYTES = 4  # one float32 scale per FP8 index key
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_index_keys(keys: torch.Tensor) -> torch.Tensor:
    """Index keys ``[m, D]`` as packed FP8 rows ``[m, D + 4]`` (uint8): each row scaled by its own
    ``amax / 448`` into float8 e4m3, then the float32 scale's 4 bytes. Deterministic per row: a key
    recomputed later packs to the same bytes."""
    scale = (keys.float().abs().amax(dim=-1, keepdim=True) / _FP8_MAX).clamp_min(1e-12)
    q = (keys.float() / scale).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_index_keys(rows: torch.Tensor) -> torch.Tensor:
    """Packed FP8 rows ``[m, D + 4]`` (uint8, :func:`quantize_index_keys`) as float32 keys ``[m, D]``."""
    rows = rows.contiguous()
    d = rows.shape[-1] - _SCALE_BYTES
    q = rows[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., d:].contiguous().view(torch.float32)
    return q * scale
