"""The no-GPU functional check: every CPU-capable backend against the reference on a small pool."""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import layouts
from ..targets import FUNCTIONAL_CHECK_MODE
from .config import DIRECTIONS

MODE = FUNCTIONAL_CHECK_MODE  # the JSON's "mode": no figures


def _check_case(backend: str, layout: str, mla: bool, direction: str, scope: str, gen: torch.Generator) -> dict:
    from .. import ops
    from ..reference import reference_transfer

    L, H, D, page, n_dev, n_host = 3, 1 if mla else 2, 8, 4, 32, 16
    shape = layouts.host_shape(layout, mla=mla, num_layers=L, num_slots=n_host, page_size=page, head_num=H, head_dim=D)
    k = torch.randn(L, n_dev, H, D, generator=gen).half()
    v = None if mla else torch.randn(L, n_dev, H, D, generator=gen).half()
    host = torch.randn(shape, generator=gen).half()
    d_idx = torch.randperm(n_dev, generator=gen)[:8]
    h_idx = torch.randperm(n_host, generator=gen)[:8]
    layer = 1 if scope == "layer" else None
    expected = [k.clone(), None if v is None else v.clone(), host.clone()]
    reference_transfer(
        direction=direction, device_k=list(expected[0]), device_v=None if v is None else list(expected[1]),
        host=expected[2], device_indices=d_idx, host_indices=h_idx, layout=layout, page_size=page,
        layers=range(L) if layer is None else [layer],
    )  # fmt: skip
    error = None
    try:
        ops.transfer(direction, k, v, host, d_idx, h_idx, layout=layout, page_size=page, layer_id=layer,
                     backend=backend)  # fmt: skip
        ok = all(got is None or torch.equal(got, want) for got, want in zip((k, v, host), expected, strict=True))
    except Exception as exc:  # reported, not hidden
        ok, error = False, f"{type(exc).__name__}: {exc}"
    return {"backend": backend, "layout": layout, "mla": mla, "direction": direction, "scope": scope, "ok": ok,
            "error": error}  # fmt: skip


def functional_check(seed: int = 0) -> list[dict[str, Any]]:
    """Every CPU-capable backend against the reference on a small pool: correctness only."""
    gen = torch.Generator().manual_seed(seed)
    backends = ["direct", "batch", "auto"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    return [
        _check_case(backend, layout, mla, direction, scope, gen)
        for mla in (False, True)
        for layout in (layouts.MLA_LAYOUTS if mla else layouts.LAYOUTS)
        for direction, scope in DIRECTIONS.values()
        for backend in backends
    ]
