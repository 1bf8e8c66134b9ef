"""KV pool layouts and the byte geometry every backend shares.

Terms
-----
- ``L`` layers, ``N`` token slots (device and host pools size theirs separately), ``H`` heads,
  ``D`` head dim, ``P = N // page_size`` pages. MLA pools have one latent vector per token per layer:
  ``H = 1`` and ``D = kv_dim``, and no K/V axis.
- An *item* is one token's K (or V, or MLA latent) for one layer: ``H * D`` elements, ``item_bytes``
  bytes. Items move as ``num_chunks`` *chunks* of ``chunk_bytes`` each: one chunk (the whole item) in
  every layout except ``page_head``, where the heads of one item are not adjacent (``H`` chunks of
  ``D`` elements).

Device pool (layer-first, what attention kernels read)
------------------------------------------------------
Per layer ``l``: ``k[l]``, ``v[l]`` of shape ``[N, H, D]`` (MHA) or ``kv[l]`` of ``[N, 1, kv_dim]``
(MLA), each contiguous. Given either as one stacked ``[L, N, H, D]`` tensor or a list of ``L``
tensors (engines often allocate layers separately).

Host pool (pinned), one tensor per layout, contiguous
-----------------------------------------------------
==================== ================================ ===============================
layout               MHA shape                        MLA shape
==================== ================================ ===============================
``layer_first``      ``[2, L, N, H, D]``              ``[L, N, 1, kv_dim]``
``page_first``       ``[2, N, L, H, D]``              ``[N, L, 1, kv_dim]``
``page_first_direct`` ``[2, P, L, page, H, D]``       ``[P, L, page, 1, kv_dim]``
``page_head``        ``[2, P, H, page, L, D]``        not defined (MLA has no heads to split)
==================== ================================ ===============================

Every layout is *affine* in (kv, layer, page, offset-in-page, chunk): the byte offset of chunk ``c``
of token slot ``n`` in layer ``l`` of K (kv=0) or V (kv=1) is::

    kv * s_kv + l * s_layer + (n // page) * s_page + (n % page) * s_in_page + c * s_chunk

:func:`host_geometry` returns these strides: the host side of every plan
(:class:`hicache_kernels.plan.Side`, where the formula itself lives). :mod:`hicache_kernels.reference`
indexes the shapes above directly instead, so that a wrong stride cannot hide in both.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS: tuple[str, ...] = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS: tuple[str, ...] = ("layer_first", "page_first", "page_first_direct")


def check_layout(layout: str, mla: bool) -> None:
    """Raise ``ValueError`` naming ``layout`` when it is unknown or undefined for MLA."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    if mla and layout not in MLA_LAYOUTS:
        raise ValueError(
            f"layout: {layout!r} splits an item by head and MLA has one latent vector per token; "
            f"use one of {', '.join(MLA_LAYOUTS)} for MLA pools"
        )


def shape_formula(layout: str, mla: bool) -> str:
    """The layout's shape as a template, e.g. ``"[2, L={L}, N, H={H}, D={D}]"`` (N and P = N/page stay symbolic)."""
    check_layout(layout, mla)
    core = {
        "layer_first": "L={L}, N, H={H}, D={D}",
        "page_first": "N, L={L}, H={H}, D={D}",
        "page_first_direct": "P=N/{page}, L={L}, page={page}, H={H}, D={D}",
        "page_head": "P=N/{page}, H={H}, page={page}, L={L}, D={D}",
    }[layout]
    return f"[{core}]" if mla else f"[2, {core}]"


def host_shape(
    layout: str, *, mla: bool, num_layers: int, num_slots: int, page_size: int, head_num: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of a host pool (see the module table). ``num_slots`` must be a multiple of ``page_size``."""
    check_layout(layout, mla)
    if num_slots % page_size:
        raise ValueError(f"num_slots: {num_slots} is not a multiple of page_size {page_size}")
    L, N, H, D, p = num_layers, num_slots, head_num, head_dim, page_size
    P = N // p
    core = {
        "layer_first": (L, N, H, D),
        "page_first": (N, L, H, D),
        "page_first_direct": (P, L, p, H, D),
        "page_head": (P, H, p, L, D),
    }[layout]
    return core if mla else (2, *core)


@dataclass(frozen=True)
class HostGeometry:
    """Byte strides of a host layout (see module docstring). All values are in bytes except
    ``page_size`` (token slots), ``num_slots`` and ``num_chunks`` (counts)."""

    layout: str
    num_kv: int
    num_layers: int
    num_slots: int
    page_size: int  # the addressing page: the layout's page size, or 1 for layouts without a page axis
    item_bytes: int
    chunk_bytes: int
    num_chunks: int
    s_kv: int
    s_layer: int
    s_page: int
    s_in_page: int
    s_chunk: int

    @property
    def total_bytes(self) -> int:
        return self.num_kv * self.num_layers * self.num_slots * self.item_bytes


def host_geometry(
    layout: str,
    *,
    mla: bool,
    num_layers: int,
    num_slots: int,
    page_size: int,
    head_num: int,
    head_dim: int,
    elem_bytes: int,
) -> HostGeometry:
    """Strides in bytes of a contiguous host pool of :func:`host_shape`."""
    check_layout(layout, mla)
    if num_slots % page_size:
        raise ValueError(f"num_slots: {num_slots} is not a multiple of page_size {page_size}")
    L, N, H, p = num_layers, num_slots, head_num, page_size
    hb = head_dim * elem_bytes  # one head of one token of one layer
    item = H * hb
    num_kv = 1 if mla else 2
    chunk_bytes, num_chunks, s_chunk = item, 1, 0
    if layout == "layer_first":  # [kv, L, N, H, D]
        s_layer, s_page, s_in_page, page = N * item, item, 0, 1
    elif layout == "page_first":  # [kv, N, L, H, D]
        s_layer, s_page, s_in_page, page = item, L * item, 0, 1
    elif layout == "page_first_direct":  # [kv, P, L, page, H, D]
        s_layer, s_page, s_in_page, page = p * item, L * p * item, item, p
    else:  # page_head: [kv, P, H, page, L, D]
        s_layer, s_page, s_in_page, page = hb, H * p * L * hb, L * hb, p
        chunk_bytes, num_chunks, s_chunk = hb, H, p * L * hb
    return HostGeometry(
        layout=layout,
        num_kv=num_kv,
        num_layers=L,
        num_slots=N,
        page_size=page,
        item_bytes=item,
        chunk_bytes=chunk_bytes,
        num_chunks=num_chunks,
        s_kv=L * N * item,
        s_layer=s_layer,
        s_page=s_page,
        s_in_page=s_in_page,
        s_chunk=s_chunk,
    )
