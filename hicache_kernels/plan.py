"""A validated transfer, described in bytes: what every io-backend receives.

A transfer copies, for each index pair ``i``, each layer ``l`` in ``[layer_begin, layer_begin +
layer_count)``, each ``kv`` in ``range(num_kv)`` and each chunk ``c`` in ``range(num_chunks)``,
``chunk_bytes`` bytes from ``src.address(kv, l, src_indices[i], c)`` to
``dst.address(kv, l, dst_indices[i], c)``.

A :class:`Side` is either *affine* (one base address plus strides: every host layout) or a *table*
(a base address per (kv, layer), looked up in ``table[kv * num_layers + l]``, plus the same strides:
layer-first device pools given as separate tensors per layer). With ``page = page_size``::

    affine: base            + kv * s_kv + l * s_layer + (n // page) * s_page + (n % page) * s_in_page + c * s_chunk
    table:  table[kv*L + l]                            + (n // page) * s_page + (n % page) * s_in_page + c * s_chunk
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .layouts import HostGeometry


@dataclass(frozen=True)
class Side:
    """One side of a transfer. Addresses and strides in bytes; ``page_size``/``num_slots`` in slots.

    ``tensors`` keeps the tensors whose memory the addresses point into (for lifetime, dtype and
    device); backends must not rely on their shapes, only on the byte description.
    """

    is_table: bool
    base: int  # affine: address of the pool's first byte; table: 0
    table: tuple[int, ...]  # table: addresses, index kv * num_layers + layer; affine: ()
    num_layers: int
    s_kv: int
    s_layer: int
    s_page: int
    s_in_page: int
    s_chunk: int
    page_size: int
    num_slots: int
    tensors: tuple[torch.Tensor, ...] = field(repr=False, compare=False, default=())

    def address(self, kv: int, layer: int, slot: int, chunk: int = 0) -> int:
        page, off = divmod(slot, self.page_size)
        rest = page * self.s_page + off * self.s_in_page + chunk * self.s_chunk
        if self.is_table:
            return self.table[kv * self.num_layers + layer] + rest
        return self.base + kv * self.s_kv + layer * self.s_layer + rest

    def desc(self) -> tuple[int, ...]:
        """The 9 integers the CUDA launcher takes: (base_or_table_address is filled by the backend)."""
        return (
            self.base,
            self.num_layers,
            self.s_kv,
            self.s_layer,
            self.s_page,
            self.s_in_page,
            self.s_chunk,
            self.page_size,
            self.num_slots,
        )

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def is_cuda(self) -> bool:
        return self.tensors[0].is_cuda


def affine_side(host: torch.Tensor, geom: HostGeometry) -> Side:
    """The host pool as an affine side."""
    return Side(
        is_table=False,
        base=host.data_ptr(),
        table=(),
        num_layers=geom.num_layers,
        s_kv=geom.s_kv,
        s_layer=geom.s_layer,
        s_page=geom.s_page,
        s_in_page=geom.s_in_page,
        s_chunk=geom.s_chunk,
        page_size=geom.page_size,
        num_slots=geom.num_slots,
        tensors=(host,),
    )


def table_side(layers: list[torch.Tensor], num_kv: int, slot_bytes: int, chunk_bytes: int, num_chunks: int) -> Side:
    """A layer-first device pool: ``layers`` lists K then V tensors (``num_kv * L`` of ``[N, H, D]``)."""
    num_layers = len(layers) // num_kv
    return Side(
        is_table=True,
        base=0,
        table=tuple(t.data_ptr() for t in layers),
        num_layers=num_layers,
        s_kv=0,
        s_layer=0,
        s_page=slot_bytes,
        s_in_page=0,
        s_chunk=chunk_bytes if num_chunks > 1 else 0,
        page_size=1,
        num_slots=layers[0].shape[0],
        tensors=tuple(layers),
    )


@dataclass(frozen=True)
class TransferPlan:
    """Everything a backend needs. ``direction`` is ``"d2h"`` (device pool to host pool, a backup) or
    ``"h2d"`` (a load); for those, ``src``/``dst`` are the device and host sides accordingly. Index
    tensors are 1-D int64 of equal length and already validated unless ``checked`` is False."""

    direction: str
    src: Side
    dst: Side
    src_indices: torch.Tensor
    dst_indices: torch.Tensor
    layer_begin: int
    layer_count: int
    num_kv: int
    num_chunks: int
    chunk_bytes: int
    item_bytes: int
    checked: bool = True
    stream: Any = None  # torch.cuda.Stream or None (the current stream)
    extras: dict = field(default_factory=dict, compare=False)

    @property
    def num_items(self) -> int:
        return int(self.src_indices.numel())

    @property
    def bytes_moved(self) -> int:
        return self.num_items * self.layer_count * self.num_kv * self.item_bytes
