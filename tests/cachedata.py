"""Helpers for cache tests: small CPU pools and KV data derived from (token, position, layer)."""

from __future__ import annotations

import torch

from hicache import DeviceKVPool, HiRadixCache, HostKVPool

NUM_LAYERS, HEAD_NUM, HEAD_DIM = 3, 2, 4


def make_cache(
    *,
    device_slots: int = 64,
    host_ratio: float = 2.0,
    page_size: int = 1,
    mla: bool = False,
    layout: str = "page_first",
    write_policy: str = "write_through",
    eviction_policy: str = "lru",
    load_back_threshold: int = 1,
    threaded: bool = False,
    io_backend: str = "direct",
    stacked: bool = True,
    tp_group=None,
) -> HiRadixCache:
    dev = DeviceKVPool(
        num_slots=device_slots, num_layers=NUM_LAYERS, head_num=1 if mla else HEAD_NUM, head_dim=HEAD_DIM,
        dtype=torch.float32, device="cpu", page_size=page_size, mla=mla, stacked=stacked,
    )  # fmt: skip
    host = HostKVPool(dev, layout=layout, ratio=host_ratio)
    return HiRadixCache(
        dev, host, io_backend=io_backend, write_policy=write_policy, eviction_policy=eviction_policy,
        load_back_threshold=load_back_threshold, threaded=threaded, tp_group=tp_group,
    )  # fmt: skip


def kv_value(token: int, position: int, layer: int, kv: int) -> torch.Tensor:
    """The KV a token at a position would have in a layer: distinct for every argument."""
    base = token * 1_000_000 + position * 1_000 + layer * 10 + kv
    return torch.arange(HEAD_NUM * HEAD_DIM, dtype=torch.float32).reshape(HEAD_NUM, HEAD_DIM) + base


def _layers(pool) -> list[torch.Tensor]:
    if pool is None:
        return []
    return pool if isinstance(pool, list) else list(pool.unbind(0))


def write_kv(cache: HiRadixCache, tokens: list[int], slots: torch.Tensor, start: int = 0) -> None:
    """Fill device slots with :func:`kv_value` of (token, position, layer) — as a forward pass would."""
    pool = cache.device_pool
    layers_k, layers_v = _layers(pool.device_k), _layers(pool.device_v)
    h = layers_k[0].shape[1]
    for pos, (tok, slot) in enumerate(zip(tokens, slots.tolist(), strict=True), start=start):
        for layer in range(pool.num_layers):
            layers_k[layer][slot] = kv_value(tok, pos, layer, 0)[:h]
            if layers_v:
                layers_v[layer][slot] = kv_value(tok, pos, layer, 1)[:h]


def check_kv(cache: HiRadixCache, tokens: list[int], slots: torch.Tensor) -> None:
    pool = cache.device_pool
    layers_k, layers_v = _layers(pool.device_k), _layers(pool.device_v)
    h = layers_k[0].shape[1]
    for pos, (tok, slot) in enumerate(zip(tokens, slots.tolist(), strict=True)):
        for layer in range(pool.num_layers):
            assert torch.equal(layers_k[layer][slot], kv_value(tok, pos, layer, 0)[:h]), (pos, layer, "k")
            if layers_v:
                assert torch.equal(layers_v[layer][slot], kv_value(tok, pos, layer, 1)[:h]), (pos, layer, "v")


def prefill(cache: HiRadixCache, tokens: list[int]) -> int:
    """What a scheduler does for a new request: match, compute the rest, insert. Returns the
    device hit length; raises if the device pool has no room even after eviction."""
    match = cache.match_prefix(tokens)
    hit = len(match.device_indices)
    need = len(tokens) - hit
    cache.inc_lock_ref(match.last_device_node)
    slots = cache.device_pool.alloc(need)
    if slots is None:
        cache.evict(need - cache.device_pool.available_size())
        slots = cache.device_pool.alloc(need)
    cache.dec_lock_ref(match.last_device_node)
    if slots is None:
        raise MemoryError("device pool full")
    write_kv(cache, tokens[hit:], slots, start=hit)
    full = torch.cat([match.device_indices, slots])
    dup = cache.insert(tokens, full)
    if dup > hit:  # another insert raced ahead: free our duplicated slots
        cache.device_pool.free(full[hit:dup])
    return hit


def evict_and_reload(cache: HiRadixCache, tokens: list[int], wait_layer: int | None = None) -> torch.Tensor:
    """Back up ``tokens`` (already inserted), evict the whole device tier, load the prefix back and
    check its KV bytes; returns the new device slots. ``wait_layer``: wait on the layer counter first."""
    cache.flush()
    cache.evict(cache.device_pool.size)
    m = cache.match_prefix(tokens)
    assert m.host_hit_length == len(tokens)
    assert cache.load_back(m.last_host_node) is not None
    cache.start_loading()
    if wait_layer is not None:
        cache.controller.layer_counter.wait_until(wait_layer)
    cache.flush()
    slots = cache.match_prefix(tokens).device_indices
    check_kv(cache, tokens, slots)
    return slots


def wrap_copies(monkeypatch, kind: str, around) -> None:
    """Route the controller's copies through ``around(issue, call)``, where ``issue()`` performs the
    real copy and ``call`` describes it: ``kind="backup"`` wraps each backup op
    (:meth:`KVBinding.backup`; ``call.layer_id`` is None), ``kind="load_layer"`` each layer of a
    layer-wise load (:class:`LayerLoads`; ``call.layer_id``, ``call.stream``, ``call.binding``,
    ``call.device_indices``)."""
    from types import SimpleNamespace

    from hicache.controller.layer_loads import LayerLoads
    from hicache_kernels.binding import KVBinding

    if kind == "backup":
        real_backup = KVBinding.backup

        def backup(self, device_indices, host_indices, **kwargs):
            call = SimpleNamespace(layer_id=None, stream=kwargs.get("stream"), binding=self,
                                   device_indices=device_indices)  # fmt: skip
            return around(lambda: real_backup(self, device_indices, host_indices, **kwargs), call)

        monkeypatch.setattr(KVBinding, "backup", backup)
    elif kind == "load_layer":
        real_call = LayerLoads.__call__

        def load_layer(self, layer_id):
            call = SimpleNamespace(layer_id=layer_id, stream=self.stream, binding=self.binding,
                                   device_indices=self.device_indices)  # fmt: skip
            return around(lambda: real_call(self, layer_id), call)

        monkeypatch.setattr(LayerLoads, "__call__", load_layer)
    else:
        raise ValueError(f"kind: expected 'backup' or 'load_layer', got {kind!r}")
