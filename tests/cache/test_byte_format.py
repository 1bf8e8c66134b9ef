"""The bytes a cache leaves in its host pool and in storage, read back by their definitions.

A round trip through the cache (backup, evict, load back) cannot tell K from V or one head from another
when both directions make the same mistake; stores shared across deployments and versions depend on
the formats themselves. So these tests read the host pool by the layout table of
:mod:`hicache_kernels.layouts` and the stored objects by :mod:`hicache.storage.objects`' definition,
with this file's own indexing, and compare every item with :func:`cachedata.kv_value`.
"""

from __future__ import annotations

import pytest
import torch

from hicache import DeviceKVPool, HiRadixCache, HostKVPool
from hicache.storage import FileBackend, page_keys
from hicache_kernels import layouts

from cachedata import HEAD_DIM, HEAD_NUM, NUM_LAYERS, fingerprint, kv_index, kv_value, make_cache, prefill, slot_key

PAGE = 4
TOKENS = list(range(300, 332))  # 8 pages; ids above 16, where the old fingerprint repeated itself
CASES = [(lay, False) for lay in layouts.LAYOUTS] + [(lay, True) for lay in layouts.MLA_LAYOUTS]
IDS = [f"{lay}-{'mla' if mla else 'mha'}" for lay, mla in CASES]


def host_item(buf: torch.Tensor, layout: str, mla: bool, kv: int, layer: int, slot: int) -> torch.Tensor:
    """Item ``[H, D]`` of ``slot`` in ``layer`` (K: kv 0, V: kv 1) of a host buffer, by the layout table."""
    page, off = divmod(slot, PAGE)
    b = buf if mla else buf[kv]
    if layout == "layer_first":  # [2, L, N, H, D]
        return b[layer, slot]
    if layout == "page_first":  # [2, N, L, H, D]
        return b[slot, layer]
    if layout == "page_first_direct":  # [2, P, L, page, H, D]
        return b[page, layer, off]
    assert layout == "page_head" and not mla  # [2, P, H, page, L, D]
    return b[page, :, off, layer]


def host_copies(cache: HiRadixCache) -> list[tuple[int, int, int]]:
    """``(token, position, host slot)`` of every token with a host copy, from the tree."""
    out = []
    stack = [(c, 0) for c in cache.root.children.values()]
    while stack:
        node, start = stack.pop()
        if node.host_value is not None:
            out += [(t, start + i, s) for i, (t, s) in enumerate(zip(node.key, node.host_value.tolist(), strict=True))]
        stack.extend((c, start + len(node.key)) for c in node.children.values())
    return out


@pytest.mark.parametrize(("layout", "mla"), CASES, ids=IDS)
def test_host_pool_bytes_follow_the_layout(layout, mla):
    cache = make_cache(layout=layout, mla=mla, page_size=PAGE, device_slots=64, host_ratio=2.0)
    prefill(cache, TOKENS)
    cache.flush()
    copies = host_copies(cache)
    assert sorted(p for _, p, _ in copies) == list(range(len(TOKENS)))  # write-through: every token backed up
    heads = 1 if mla else HEAD_NUM
    buf = cache.host_pool.buffer
    for tok, pos, slot in copies:
        for layer in range(NUM_LAYERS):
            for kv in (0,) if mla else (0, 1):
                got = host_item(buf, layout, mla, kv, layer, slot)
                assert torch.equal(got, kv_value(tok, pos, layer, kv)[:heads]), (layout, tok, pos, layer, "kv"[kv])
    cache.close()


def stored_cache(path, layout: str, mla: bool, head_group: int = 1) -> HiRadixCache:
    dev = DeviceKVPool(num_slots=64, num_layers=NUM_LAYERS, head_num=1 if mla else HEAD_NUM, head_dim=HEAD_DIM,
                       dtype=torch.float32, device="cpu", page_size=PAGE, mla=mla)  # fmt: skip
    host = HostKVPool(dev, layout=layout, ratio=2.0)
    return HiRadixCache(dev, host, io_backend="direct", threaded=False, storage="file",
                        storage_config={"path": str(path)}, model_id="byte-format",
                        storage_head_group=head_group)  # fmt: skip


STORED = [(lay, mla, g) for lay, mla in CASES for g in ((1,) if mla else (1, 2))]


@pytest.mark.parametrize(("layout", "mla", "head_group"), STORED,
                         ids=[f"{lay}-{'mla' if mla else f'mha-group{g}'}" for lay, mla, g in STORED])  # fmt: skip
def test_stored_objects_follow_their_definition(tmp_path, layout, mla, head_group):
    """MHA: one object per (page, group of ``head_group`` heads), ``[K|V, head, token, layer, D]``
    whatever the host layout. MLA: one object per page, the page's bytes in the host layout's order."""
    cache = stored_cache(tmp_path, layout, mla, head_group)
    prefill(cache, TOKENS)
    tier = cache.storage_ops.tier
    pages = page_keys(TOKENS, PAGE, namespace=tier.namespace)
    keys = tier.objects.keys(pages)
    cache.close()  # drains the storage backups
    backend = FileBackend(tmp_path)
    groups = 1 if mla else HEAD_NUM // head_group
    assert len(keys) == len(pages) * groups == len(TOKENS) // PAGE * groups
    for i, key in enumerate(keys):
        page, group = divmod(i, groups)
        data = backend.get(key)
        assert data is not None, f"page {page} group {group} was not stored"
        got = torch.frombuffer(bytearray(data), dtype=torch.float32)
        want = []
        positions = range(page * PAGE, (page + 1) * PAGE)
        if mla and layout == "page_first":  # [token, layer, D]
            want = [kv_value(TOKENS[p], p, layer, 0)[0] for p in positions for layer in range(NUM_LAYERS)]
        elif mla:  # layer_first and page_first_direct: [layer, token, D]
            want = [kv_value(TOKENS[p], p, layer, 0)[0] for layer in range(NUM_LAYERS) for p in positions]
        else:  # [K|V, head of the group, token, layer, D]
            heads = range(group * head_group, (group + 1) * head_group)
            want = [kv_value(TOKENS[p], p, layer, kv)[h] for kv in (0, 1) for h in heads for p in positions
                    for layer in range(NUM_LAYERS)]  # fmt: skip
        assert torch.equal(got, torch.cat(want)), (layout, page, group)


def test_kv_fingerprint_is_exact_and_distinct():
    """Every value of the cache tests' KV (cachedata.kv_value) is exact in float32 and differs from every
    other: across tokens (the cache tests use ids up to ~1000) and positions, layers, K and V, heads and
    the elements of a head. A fingerprint that repeats (float32 rounding a large base, once) lets
    swapped heads, K for V or reversed elements pass check_kv."""
    tokens = torch.tensor([0, 1, 2, 15, 16, 17, 299, 300, 301, 999, 1000, 1015, 4095])
    positions = torch.arange(0, 1100, 7)
    key = slot_key(tokens[:, None], positions[None, :]).reshape(-1)
    low = torch.stack([kv_index(layer, kv) for layer in range(NUM_LAYERS) for kv in (0, 1)]).reshape(-1)
    values = fingerprint(key[:, None], low[None, :])
    assert values.dtype == torch.float32 and torch.isfinite(values).all()
    assert values.unique().numel() == values.numel() == key.numel() * 2 * NUM_LAYERS * HEAD_NUM * HEAD_DIM
    assert torch.equal(values.to(torch.float64), fingerprint(key[:, None], low[None, :]).to(torch.float64))
    for tok, pos in ((300, 7), (1000, 903)):  # the scalar form is the same function
        for layer in range(NUM_LAYERS):
            for kv in (0, 1):
                row = tokens.tolist().index(tok) * positions.numel() + positions.tolist().index(pos)
                col = (layer * 2 + kv) * HEAD_NUM * HEAD_DIM
                want = values[row, col : col + HEAD_NUM * HEAD_DIM].reshape(HEAD_NUM, HEAD_DIM)
                assert torch.equal(kv_value(tok, pos, layer, kv), want)
