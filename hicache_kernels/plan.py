"""A transfer described in bytes: what every io-backend receives.

- :class:`Side`: one pool's byte geometry (where every chunk of every token slot lives).
- :class:`Route`: what a copy moves from one side to the other, for one direction and layer range,
  but not which slots. It does not change between calls, so a binding builds it once
  (:class:`~hicache_kernels.binding.KVBinding`) and backends keep what they derive from it (device
  tables, host aliases, kernel descriptors) in :attr:`Route.launch_state`.
- :class:`TransferPlan`: a route plus one call's index tensors and stream, and the tensors whose
  memory the route addresses (kept alive by the plan). Built per call; cheap.

A transfer copies, for each index pair ``i``, each layer ``l`` in ``[layer_begin, layer_begin +
layer_count)``, each ``kv`` in ``range(num_kv)`` and each chunk ``c`` in ``range(num_chunks)``,
``chunk_bytes`` bytes from ``src`` to ``dst`` at the byte addresses :meth:`Side.addresses` gives.
A side is either *affine* (one base address plus strides: every host layout) or a *table* (a base
address per (kv, layer), ``table[kv * num_layers + l]``, plus the same strides: layer-first device
pools). With ``page = page_size``::

    affine: base            + kv * s_kv + l * s_layer + (n // page) * s_page + (n % page) * s_in_page + c * s_chunk
    table:  table[kv*L + l]                            + (n // page) * s_page + (n % page) * s_in_page + c * s_chunk

The CUDA kernel (``csrc/transfer.cuh``) and the Triton kernel implement the same formula on the
device; on the host, :meth:`Side.addresses` is its only implementation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class Side:
    """One side of a transfer. Addresses and strides in bytes; ``page_size``/``num_slots`` in slots.

    ``is_host``: the addresses are host (CPU) memory; a CUDA launch reaches them through their device
    alias (pinned memory). ``launch_state`` holds what backends derive from the side once (its device
    table, host alias), see :mod:`hicache_kernels.launch`.
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
    is_host: bool = False
    launch_state: dict = field(default_factory=dict, repr=False)

    def desc(self) -> tuple[int, ...]:
        """The 9 integers the CUDA launcher takes (``csrc/transfer.h`` SideDesc); a launch replaces
        ``base`` by the address the GPU uses (the device table, or the host alias)."""
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

    @functools.cached_property
    def alignment(self) -> int:
        """gcd of every address (table entry or base) and every stride: each byte address the formula
        gives is a multiple of it (0 when all are 0). One half of the rule :meth:`Route.alignment` applies."""
        return math.gcd(*(self.table if self.is_table else (self.base,)), self.s_kv, self.s_layer, self.s_page,
                        self.s_in_page, self.s_chunk)  # fmt: skip

    @functools.cached_property
    def table_array(self) -> np.ndarray:
        return np.asarray(self.table, dtype=np.int64)

    def addresses(self, kv: np.ndarray, layer: np.ndarray, slot: np.ndarray, chunk: np.ndarray) -> np.ndarray:
        """Byte addresses of chunks (the module formula), element-wise over int64 arrays."""
        page, off = np.divmod(slot, self.page_size)
        rest = page * self.s_page + off * self.s_in_page + chunk * self.s_chunk
        if self.is_table:
            return self.table_array[kv * self.num_layers + layer] + rest
        return self.base + kv * self.s_kv + layer * self.s_layer + rest


#: ``num_slots`` of a table side built from raw addresses (sgl-kernel's pointer tables, copy_ranges'
#: pointer lists): no pool size is known, so no index is bounded by one.
NO_BOUND = 1 << 62


@dataclass(frozen=True, eq=False)
class Route:
    """What a copy moves, without the slots. ``direction`` is ``"d2h"`` (device pool to host pool, a
    backup) or ``"h2d"`` (a load). ``device`` is where a launch runs (the device pool's device);
    ``gpu_addressable`` says whether a CUDA launch can reach every side's memory (device memory or
    pinned host memory). ``page_size`` is the host layout's page in tokens: the run length callers
    allocate, from which ``auto`` estimates a copy-engine fragment (``chunk_bytes * page_size``)."""

    direction: str
    src: Side
    dst: Side
    layer_begin: int
    layer_count: int
    num_kv: int
    num_chunks: int
    chunk_bytes: int
    item_bytes: int
    page_size: int
    device: torch.device
    gpu_addressable: bool
    launch_state: dict = field(default_factory=dict, repr=False)
    on_cuda: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_cuda", self.device.type == "cuda")

    @property
    def host_side(self) -> Side:
        return self.dst if self.direction == "d2h" else self.src

    def alignment(self, *addresses: int) -> int:
        """The alignment rule, in one place: the gcd of both sides' :attr:`Side.alignment`,
        ``chunk_bytes`` and ``addresses`` (the addresses a launch uses in place of the sides' own,
        e.g. host aliases). Every byte address and size the copy touches is a multiple of it; the
        kernels pick their copy width from it (16-byte vectors when it is a multiple of 16)."""
        return math.gcd(self.src.alignment, self.dst.alignment, self.chunk_bytes, *addresses)


def cpu_pointer_tables_reason(route: Route, backend_name: str, what: str) -> str | None:
    """Why ``backend_name`` cannot run ``route`` on the CPU, or None: a table side of raw addresses
    (``num_slots == NO_BOUND``; ``what`` names the arguments they came from) on a CPU route runs only on
    the triton backend; the others copy CPU memory through views of the transfer's tensors, and such a
    table names none."""
    if NO_BOUND not in (route.src.num_slots, route.dst.num_slots) or backend_name == "triton" or route.on_cuda:
        return None
    return (f"io-backend {backend_name!r}: pointer tables ({what}) on the CPU run only on the triton backend "
            "(use_backend('triton')); the others copy CPU memory through views of the transfer's tensors, "
            "and a pointer table names none")  # fmt: skip


@dataclass(eq=False)
class TransferPlan:
    """One call: a :class:`Route`, the index tensors (1-D integer, equal length; validated by the
    ops unless the caller turned ``check_indices`` off, and skipped by every backend when out of
    range), the stream (None: the device's current stream), and the tensors whose memory the
    route's sources and destinations address (``src_tensors``, ``dst_tensors``), which the plan keeps
    alive for as long as a backend's prepared copy holds it."""

    route: Route
    src_indices: torch.Tensor
    dst_indices: torch.Tensor
    stream: Any = None
    src_tensors: tuple[torch.Tensor, ...] = ()
    dst_tensors: tuple[torch.Tensor, ...] = ()

    # The route's fields, read through.
    @property
    def direction(self) -> str:
        return self.route.direction

    @property
    def src(self) -> Side:
        return self.route.src

    @property
    def dst(self) -> Side:
        return self.route.dst

    @property
    def layer_begin(self) -> int:
        return self.route.layer_begin

    @property
    def layer_count(self) -> int:
        return self.route.layer_count

    @property
    def num_kv(self) -> int:
        return self.route.num_kv

    @property
    def num_chunks(self) -> int:
        return self.route.num_chunks

    @property
    def chunk_bytes(self) -> int:
        return self.route.chunk_bytes

    @property
    def item_bytes(self) -> int:
        return self.route.item_bytes

    @property
    def device(self) -> torch.device:
        return self.route.device

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.src_tensors + self.dst_tensors

    @property
    def num_items(self) -> int:
        return int(self.src_indices.numel())

    @property
    def bytes_moved(self) -> int:
        return self.num_items * self.layer_count * self.num_kv * self.item_bytes
