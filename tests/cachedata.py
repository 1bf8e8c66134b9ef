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


# The KV fingerprint of a token: exact in float32 and distinct for every token, position, layer, K/V,
# head and element. A value is sign * m * 2**e with m a 24-bit whole number (float32's whole precision):
# m's low LOW_BITS bits number the slot's items (layer, K/V, head, element), and the slot's key
# (token, position) fills the other 17 bits of m, 6 bits of e and the sign: one-to-one for tokens and
# positions below 4096, a hash above (collisions then possible).
LOW_BITS = 6  # 2 (K/V) x NUM_LAYERS x HEAD_NUM x HEAD_DIM items must fit
KEY_RANGE = 4096  # tokens and positions below this get keys of their own
assert 2 * NUM_LAYERS * HEAD_NUM * HEAD_DIM <= 1 << LOW_BITS


def slot_key(token, position):
    """A 24-bit key of (token, position), for ints or int64 tensors alike: ``token * 4096 + position``
    when both are below 4096, else a hash (every intermediate below 2**63 for inputs below 2**30)."""
    exact = token * KEY_RANGE + position
    hashed = (token * 92821 + position * 48271 + (token * 31 + position) % 65521 * 69621) % (1 << 24)
    inside = (token >= 0) & (token < KEY_RANGE) & (position >= 0) & (position < KEY_RANGE)
    if isinstance(inside, torch.Tensor):
        return torch.where(inside, exact, hashed)
    return exact if inside else hashed


def fingerprint(key, low) -> torch.Tensor:
    """float32 ``sign * m * 2**e`` of 24-bit keys and low item numbers (broadcast; int64 tensors)."""
    key, low = torch.as_tensor(key, dtype=torch.int64), torch.as_tensor(low, dtype=torch.int64)
    m = (1 << 23) + ((key & 0x1FFFF) << LOW_BITS) + low
    e = (key >> 17) & 63
    sign = 1 - 2 * ((key >> 23) & 1)
    return (sign * m).to(torch.float64).mul(torch.pow(2.0, e.to(torch.float64))).to(torch.float32)


def kv_index(layer, kv) -> torch.Tensor:
    """The low bits of a slot's items in ``layer``, K (0) or V (1): ``[HEAD_NUM, HEAD_DIM]``, int64."""
    if not 0 <= layer < NUM_LAYERS or kv not in (0, 1):
        raise ValueError(f"layer {layer}, kv {kv}: the fingerprint covers {NUM_LAYERS} layers and K/V")
    first = (layer * 2 + kv) * HEAD_NUM * HEAD_DIM
    return torch.arange(first, first + HEAD_NUM * HEAD_DIM, dtype=torch.int64).reshape(HEAD_NUM, HEAD_DIM)


def kv_value(token: int, position: int, layer: int, kv: int) -> torch.Tensor:
    """The KV a token at a position would have in a layer (``[HEAD_NUM, HEAD_DIM]`` float32): every
    element of every head differs from every other of the slot, K from V and each layer from the others,
    and from every element of another token or position (see the fingerprint above)."""
    return fingerprint(slot_key(token, position), kv_index(layer, kv))


def _layers(pool) -> list[torch.Tensor]:
    if pool is None:
        return []
    return pool if isinstance(pool, list) else list(pool.unbind(0))


def queued_device(cache: HiRadixCache):
    """The cache's device model when it completes work later than it is issued (the deferred model
    under HICACHE_DEFERRED_SEED), else None."""
    device = cache.controller.device
    return device if device.tracks_regions else None


def launch_on_current(cache: HiRadixCache, slots: torch.Tensor, write, what: str) -> None:
    """Run ``write()`` as a forward would: at once, or under a deferred device model queued on the
    current stream (writing ``slots`` of the device pool), so that a backup issued next must wait for
    it (the controller's ready event) or read KV that is not there yet."""
    device = queued_device(cache)
    if device is None or not len(slots):
        write()
    else:
        from hicache.streams import KVRegion

        device.launch(device.current_stream(), lambda _: write(), writes=[KVRegion(cache.device_pool, slots)],
                      what=what)  # fmt: skip


def host_reads(cache: HiRadixCache) -> None:
    """The host is about to read device KV: what the current stream queued lands first (a sync)."""
    device = queued_device(cache)
    if device is not None:
        device.current_stream().synchronize()


def write_kv(cache: HiRadixCache, tokens: list[int], slots: torch.Tensor, start: int = 0) -> None:
    """Fill device slots with :func:`kv_value` of (token, position, layer) — as a forward pass would
    (queued on the current stream under a deferred device model: :func:`launch_on_current`)."""
    pool = cache.device_pool
    layers_k, layers_v = _layers(pool.device_k), _layers(pool.device_v)
    h = layers_k[0].shape[1]
    values = [(slot, pos, tok) for pos, (tok, slot) in enumerate(zip(tokens, slots.tolist(), strict=True), start=start)]

    def write() -> None:
        for slot, pos, tok in values:
            for layer in range(pool.num_layers):
                layers_k[layer][slot] = kv_value(tok, pos, layer, 0)[:h]
                if layers_v:
                    layers_v[layer][slot] = kv_value(tok, pos, layer, 1)[:h]

    launch_on_current(cache, slots, write, "the test's forward writing KV")


def check_kv(cache: HiRadixCache, tokens: list[int], slots: torch.Tensor) -> None:
    host_reads(cache)
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
