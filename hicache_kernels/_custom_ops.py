"""The transfer ops registered with the dispatcher, for ``torch.compile``: ``hicache_kernels::backup``
(mutates ``host``) and ``hicache_kernels::load`` (mutates ``device_k`` and ``device_v``). The schemas
declare the writes, so functionalization and the compiler see them; the fake implementations have
nothing to compute (no outputs).

Registered with :class:`torch.library.Library` rather than ``torch.library.custom_op``: the latter's
Python wrappers cost ~30 us per call on every eager call of a compiled graph, the dispatcher alone a
few. Pools reach the ops as tensor lists (a stacked pool as a one-element list) and are bound through
the same cache as the eager ops (:func:`hicache_kernels.bound_pools.bound_pools`).
"""

from __future__ import annotations

from typing import Any

import torch

from ._validate import int_arg
from .backends import IOBackend, get_backend
from .bound_pools import bound_pools, check_direction, pool_tensors

_ARGS = (
    "Tensor device_indices, Tensor host_indices, str layout, SymInt page_size, SymInt layer_id, str backend, "
    "bool check_indices"
)
_lib = torch.library.Library("hicache_kernels", "DEF")  # kept alive here: the registrations live with it
_lib.define(f"backup(Tensor[] device_k, Tensor[] device_v, Tensor(a!) host, {_ARGS}) -> ()")
_lib.define(f"load(Tensor(a!)[] device_k, Tensor(b!)[] device_v, Tensor host, {_ARGS}) -> ()")


def _from_list(pools: list[torch.Tensor]) -> Any:
    return pools[0] if len(pools) == 1 and pools[0].dim() == 4 else pools


def _as_list(pool: Any) -> list[torch.Tensor]:
    return [pool] if isinstance(pool, torch.Tensor) else list(pool)


def _body(direction: str):
    def body(
        device_k: list[torch.Tensor],
        device_v: list[torch.Tensor],
        host: torch.Tensor,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        layout: str,
        page_size: int,
        layer_id: int,
        backend: str,
        check_indices: bool,
    ) -> None:
        k = _from_list(device_k)
        v = _from_list(device_v) if device_v else None
        pools = bound_pools(k, v, host, layout, page_size)
        plan = pools.plan(direction, device_indices, host_indices, None if layer_id == -1 else layer_id,
                          check_indices, None, pool_tensors(k, v), (host,))  # fmt: skip
        get_backend(backend).run(plan)

    return body


def _fake(device_k, device_v, host, device_indices, host_indices, layout, page_size, layer_id, backend, check_indices):
    return None


for _name, _direction in (("backup", "d2h"), ("load", "h2d")):
    _lib.impl(_name, _body(_direction), "CompositeExplicitAutograd")
    torch.library.register_fake(f"hicache_kernels::{_name}", _fake, lib=_lib)

backup_op = torch.ops.hicache_kernels.backup.default
load_op = torch.ops.hicache_kernels.load.default


def call(
    direction: str,
    device_k: Any,
    device_v: Any,
    host: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    layout: str,
    page_size: Any,
    layer_id: Any,
    backend: str | IOBackend,
    stream: Any,
    check_indices: bool,
) -> None:
    """What :func:`hicache_kernels.ops.transfer` does under ``torch.compile``: the arguments the op
    schema cannot carry are checked here, the rest inside the op."""
    check_direction(direction)
    if stream is not None:
        raise ValueError("stream: not supported under torch.compile; the current stream is used")
    if isinstance(backend, IOBackend):
        raise ValueError("backend: pass a backend name (not an instance) under torch.compile")
    page_size = int_arg(page_size, "page_size")
    if layer_id is not None:
        layer_id = int_arg(layer_id, "layer_id")
        if layer_id < 0:  # -1 is the op's "every layer"; the upper bound is checked inside the op
            raise ValueError(f"layer_id: expected a non-negative int, got {layer_id}")
    op = torch.ops.hicache_kernels.backup if direction == "d2h" else torch.ops.hicache_kernels.load
    op(
        _as_list(device_k), [] if device_v is None else _as_list(device_v), host, device_indices, host_indices,
        layout, page_size, -1 if layer_id is None else layer_id, backend, check_indices,
    )  # fmt: skip
