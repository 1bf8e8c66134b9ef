"""hicache_kernels.compat.sgl_kernel: sgl-kernel's kvcacheio API on this package's kernels.

On CPU the functions run on the Triton backend under the interpreter; on a GPU (marked tests) on the
CUDA kernels. Expected results come from the package reference on the equivalent layouts.
"""

from __future__ import annotations

import pytest
import torch

from hicache_kernels import layouts
from hicache_kernels.compat import sgl_kernel as sk
from hicache_kernels.reference import reference_transfer

from kvdata import POISON, poison_, random_bytes_, same_bytes

L, N_DEV, N_HOST, H, D, PAGE = 3, 40, 16, 2, 6, 4
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # device pools; host pools are pinned CPU tensors on a GPU machine
DT = torch.float16
ITEM = H * D * DT.itemsize  # 24 bytes: not a multiple of 8, which sgl-kernel itself would refuse


@pytest.fixture(autouse=True)
def triton_on_cpu():
    if not CUDA:
        sk.use_backend("triton")
    yield
    sk.use_backend("kernel")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def layer_poison(seed, layer):
    """The poison byte of ``layer`` in the pool made with ``seed``: distinct for every (seed, layer) with
    seed < 16, so an expectation taken from another layer or another pool (K for V) cannot match."""
    return (POISON + 16 * seed + layer) % 256


def device_layers(mla=False, fill="random", seed=0):
    """``L`` per-layer ``[N_DEV, h, D]`` tensors: random bytes, or each layer its own poison byte.
    Give K and V (and any two pools of one test) different seeds."""
    h = 1 if mla else H
    out = [torch.empty(N_DEV, h, D, dtype=DT) for _ in range(L)]
    for i, t in enumerate(out):
        random_bytes_(t, gen(seed * 10 + i)) if fill == "random" else t.view(torch.uint8).fill_(layer_poison(seed, i))
    return [t.to(DEV) for t in out]


def host_pool(layout, mla=False, fill="random"):
    h = 1 if mla else H
    shape = layouts.host_shape(layout, mla=mla, num_layers=L, num_slots=N_HOST, page_size=PAGE, head_num=h, head_dim=D)
    t = torch.empty(shape, dtype=DT, pin_memory=CUDA)
    return random_bytes_(t, gen(7)) if fill == "random" else poison_(t)


def table(layers):
    return torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64, device=DEV)


def idx(seed=1, n=6):
    g = gen(seed)
    return torch.randperm(N_DEV, generator=g)[:n], torch.randperm(N_HOST, generator=g)[:n]


def expect(direction, k, v, host, d_idx, h_idx, layout, layers):
    k2, v2, host2 = [t.clone() for t in k], None if v is None else [t.clone() for t in v], host.clone()
    reference_transfer(direction=direction, device_k=k2, device_v=v2, host=host2, device_indices=d_idx,
                       host_indices=h_idx, layout=layout, page_size=PAGE, layers=layers)  # fmt: skip
    return k2, v2, host2


def check(k, v, host, exp):
    assert all(same_bytes(a, b) for a, b in zip(k, exp[0], strict=True))
    if v is not None:
        assert all(same_bytes(a, b) for a, b in zip(v, exp[1], strict=True))
    assert same_bytes(host, exp[2])


@pytest.mark.gpu_smoke  # runs on CUDA pools when a GPU is visible
def test_per_layer_lf_lf():
    src_k, src_v = device_layers(seed=1), device_layers(seed=2)
    dst_k, dst_v = device_layers(fill="poison", seed=3), device_layers(fill="poison", seed=4)
    si, di = idx()[0], torch.randperm(N_DEV, generator=gen(5))[:6]
    exp_k, exp_v = [t.clone() for t in dst_k], [t.clone() for t in dst_v]
    exp_k[1][di] = src_k[1][si]
    exp_v[1][di] = src_v[1][si]
    sk.transfer_kv_per_layer(src_k[1], dst_k[1], src_v[1], dst_v[1], si, di, ITEM)
    # Every layer of both pools: layer 1 written, layers 0 and 2 untouched.
    assert all(same_bytes(a, b) for a, b in zip(dst_k + dst_v, exp_k + exp_v, strict=True))


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_per_layer_host_to_device(layout):
    k, v = device_layers(fill="poison", seed=1), device_layers(fill="poison", seed=2)
    host = host_pool(layout)
    d_idx, h_idx = idx()
    exp = expect("h2d", k, v, host, d_idx, h_idx, layout, [2])
    if layout == "page_first":
        sk.transfer_kv_per_layer_pf_lf(host[0], k[2], host[1], v[2], h_idx, d_idx, 2, ITEM, L * ITEM)
    else:
        sk.transfer_kv_per_layer_ph_lf(host[0], k[2], host[1], v[2], h_idx, d_idx, 2, ITEM, L * ITEM, PAGE, H)
    check(k, v, host, exp)


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_all_layer_device_to_host(layout):
    k, v = device_layers(seed=3), device_layers(seed=4)
    host = host_pool(layout, fill="poison")
    d_idx, h_idx = idx(seed=2)
    exp = expect("d2h", k, v, host, d_idx, h_idx, layout, range(L))
    if layout == "page_first":
        sk.transfer_kv_all_layer_lf_pf(table(k), host[0], table(v), host[1], d_idx, h_idx, ITEM, L * ITEM, L)
    else:
        sk.transfer_kv_all_layer_lf_ph(table(k), host[0], table(v), host[1], d_idx, h_idx, ITEM, L * ITEM, L, PAGE, H)
    check(k, v, host, exp)


@pytest.mark.gpu_smoke  # runs on CUDA pools when a GPU is visible
def test_all_layer_tables_both_sides():
    src_k, src_v = device_layers(seed=5), device_layers(seed=6)
    dst_k, dst_v = device_layers(fill="poison", seed=1), device_layers(fill="poison", seed=2)
    si, di = idx(seed=3)[0], torch.randperm(N_DEV, generator=gen(9))[:6]
    exp_k, exp_v = [t.clone() for t in dst_k], [t.clone() for t in dst_v]
    for e, s in zip(exp_k + exp_v, src_k + src_v, strict=True):
        e[di] = s[si]
    sk.transfer_kv_all_layer(table(src_k), table(dst_k), table(src_v), table(dst_v), si, di, ITEM, L)
    assert all(same_bytes(a, b) for a, b in zip(dst_k + dst_v, exp_k + exp_v, strict=True))


@pytest.mark.gpu_smoke  # runs on CUDA pools when a GPU is visible
def test_mla_variants():
    item = D * DT.itemsize
    kv = device_layers(mla=True, seed=8)
    host = host_pool("page_first", mla=True, fill="poison")
    d_idx, h_idx = idx(seed=4)
    exp = expect("d2h", kv, None, host, d_idx, h_idx, "page_first", range(L))
    sk.transfer_kv_all_layer_mla_lf_pf(table(kv), host, d_idx, h_idx, item, L * item, L)
    check(kv, None, host, exp)

    back = device_layers(mla=True, fill="poison", seed=1)
    exp = expect("h2d", back, None, host, d_idx, h_idx, "page_first", [1])
    sk.transfer_kv_per_layer_mla_pf_lf(host, back[1], h_idx, d_idx, 1, item, L * item)
    check(back, None, host, exp)

    dst = device_layers(mla=True, fill="poison", seed=2)
    si, di = d_idx, torch.randperm(N_DEV, generator=gen(11))[:6]
    exp_layers = [t.clone() for t in dst]
    for e, s in zip(exp_layers, kv, strict=True):
        e[di] = s[si]
    sk.transfer_kv_all_layer_mla(table(kv), table(dst), si, di, item, L)
    assert all(same_bytes(a, b) for a, b in zip(dst, exp_layers, strict=True))
    one = device_layers(mla=True, fill="poison", seed=3)
    exp_one = [t.clone() for t in one]
    exp_one[0][di] = kv[0][si]
    sk.transfer_kv_per_layer_mla(kv[0], one[0], si, di, item)
    assert all(same_bytes(a, b) for a, b in zip(one, exp_one, strict=True))


@pytest.mark.gpu_smoke  # runs on CUDA pools when a GPU is visible
def test_transfer_kv_direct_merges_runs():
    src, dst = device_layers(seed=12), device_layers(fill="poison", seed=1)
    si = torch.tensor([4, 5, 6, 7, 20, 21])
    di = torch.tensor([8, 9, 10, 11, 0, 1])
    exp = [t.clone() for t in dst]
    for e, s in zip(exp, src, strict=True):
        e[di] = s[si]
    sk.transfer_kv_direct(src, dst, si, di, 4)
    assert all(same_bytes(a, b) for a, b in zip(dst, exp, strict=True))


def test_out_of_range_index_is_skipped_with_tensors():
    """With tensors (not pointer tables) the kernels know the pool sizes and skip a bad index."""
    src_k, src_v = device_layers(seed=13), device_layers(seed=14)
    dst_k, dst_v = device_layers(fill="poison", seed=1), device_layers(fill="poison", seed=2)
    si, di = torch.tensor([0, 1, N_DEV]), torch.tensor([3, N_DEV + 5, 4])
    exp_k, exp_v = [t.clone() for t in dst_k], [t.clone() for t in dst_v]
    exp_k[0][3] = src_k[0][0]
    exp_v[0][3] = src_v[0][0]
    sk.transfer_kv_per_layer(src_k[0], dst_k[0], src_v[0], dst_v[0], si, di, ITEM)
    assert all(same_bytes(a, b) for a, b in zip(dst_k + dst_v, exp_k + exp_v, strict=True))


@pytest.mark.parametrize(
    ("call", "exc", "fragment"),
    [
        (lambda k, v, i: sk.transfer_kv_per_layer(k, k, v, v, i.int(), i, ITEM), TypeError, "src_indices"),
        (lambda k, v, i: sk.transfer_kv_per_layer(k, k, v, v, i, i[:2], ITEM), ValueError, "dst_indices"),
        (lambda k, v, i: sk.transfer_kv_per_layer(k, k, v, v, i, i, 0), ValueError, "item_size"),
        (lambda k, v, i: sk.transfer_kv_all_layer(i.float(), i, i, i, i, i, ITEM, L), TypeError, "src_k_layers"),
        (lambda k, v, i: sk.transfer_kv_direct([k], [k, v], i, i, 1), ValueError, "dst_layers"),
        (lambda k, v, i: sk.use_backend("nvlink"), ValueError, "backend"),
    ],
)
def test_bad_arguments(call, exc, fragment):
    k, v = device_layers()[0], device_layers()[0]
    with pytest.raises(exc, match=fragment):
        call(k, v, torch.arange(3))
