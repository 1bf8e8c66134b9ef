"""hicache_kernels.compat.sgl_kernel: sgl-kernel's kvcacheio API on this package's kernels.

On CPU the functions run on the Triton backend under the interpreter; on a GPU (marked tests) on the
CUDA kernels. Expected results come from the package reference on the equivalent layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache_kernels import BackendUnavailableError, layouts
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
    sk.transfer_kv_direct(src, dst, si, di, np.int64(2))  # 6 indices: whole pages of 2
    assert all(same_bytes(a, b) for a, b in zip(dst, exp, strict=True))


def test_transfer_kv_direct_needs_whole_pages():
    """sgl-kernel refuses an index count that is not a multiple of page_size; so must we, unwritten."""
    src, dst = device_layers(seed=12), device_layers(fill="poison", seed=1)
    before = [t.clone() for t in dst]
    with pytest.raises(ValueError, match="src_indices: expected whole pages, a multiple of page_size 4 indices, got 6"):
        sk.transfer_kv_direct(src, dst, torch.arange(4, 10), torch.arange(6), 4)
    assert all(same_bytes(a, b) for a, b in zip(dst, before, strict=True))


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
        (lambda k, v, dk, dv, i: sk.transfer_kv_per_layer(k, dk, v, dv, i.int(), i, ITEM), TypeError, "src_indices"),
        (lambda k, v, dk, dv, i: sk.transfer_kv_per_layer(k, dk, v, dv, i, i[:2], ITEM), ValueError, "dst_indices"),
        (lambda k, v, dk, dv, i: sk.transfer_kv_per_layer(k, dk, v, dv, i, i, 0), ValueError, "item_size"),
        (
            lambda k, v, dk, dv, i: sk.transfer_kv_all_layer(i.float(), i, i, i, i, i, ITEM, L),
            TypeError,
            "src_k_layers",
        ),
        (lambda k, v, dk, dv, i: sk.transfer_kv_direct([k], [dk, dv], i, i, 1), ValueError, "dst_layers"),
        (  # used to raise ZeroDivisionError
            lambda k, v, dk, dv, i: sk.transfer_kv_all_layer_mla(table([k]), table([dk]), i, i, ITEM, 0),
            ValueError,
            "num_layers: expected a positive int, got 0",
        ),
        (lambda k, v, dk, dv, i: sk.use_backend("nvlink"), ValueError, "backend"),
    ],
)
def test_bad_arguments(call, exc, fragment):
    (k, dk), (v, dv) = device_layers(seed=1)[:2], device_layers(seed=2)[:2]
    before = [t.clone() for t in (dk, dv)]
    with pytest.raises(exc, match=fragment) as info:
        call(k, v, dk, dv, torch.arange(3))
    # sgl-kernel's TORCH_CHECK raises RuntimeError: code written against it catches ours too
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, (sk.ArgumentError, sk.ArgumentTypeError))
    assert same_bytes(dk, before[0]) and same_bytes(dv, before[1])


def test_index_length_mismatch_reads_like_sgl_kernels_check():
    (k, dk), (v, dv) = device_layers(seed=1)[:2], device_layers(seed=2)[:2]
    with pytest.raises(RuntimeError, match="same length"):
        sk.transfer_kv_per_layer(k, dk, v, dv, torch.arange(3), torch.arange(2), ITEM)


def page_idx(seed, pages=2):
    """Whole pages: runs of PAGE consecutive device slots (not page-aligned: sgl-kernel does not ask
    that of the layer-first side) paired with whole host pages."""
    g = gen(seed)
    hp = torch.randperm(N_HOST // PAGE, generator=g)[:pages]
    dp = torch.randperm(N_DEV // PAGE - 1, generator=g)[:pages] * PAGE + 1
    off = torch.arange(PAGE)
    return (dp[:, None] + off).reshape(-1), (hp[:, None] * PAGE + off).reshape(-1)


def kv_lists(k, v, host, layers):
    """sgl-kernel's direct-function lists: device layers K then V, host buffers [host_k, host_v]."""
    dev = [k[i] for i in layers] + ([] if v is None else [v[i] for i in layers])
    return dev, [host] if v is None else [host[0], host[1]]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_all_layer_direct_lf_pf(mla):
    k, v = device_layers(mla=mla, seed=3), None if mla else device_layers(seed=4)
    host = host_pool("page_first_direct", mla=mla, fill="poison")
    d_idx, h_idx = page_idx(seed=5)
    exp = expect("d2h", k, v, host, d_idx, h_idx, "page_first_direct", range(L))
    src, dst = kv_lists(k, v, host, range(L))
    sk.transfer_kv_all_layer_direct_lf_pf(src, dst, d_idx, h_idx, PAGE)
    check(k, v, host, exp)


@pytest.mark.parametrize(
    ("mla", "layers"),
    [(False, [2]), (False, [1, 2]), (True, [0]), (True, [0, 1])],
    ids=["mha-one", "mha-two", "mla-one", "mla-two"],
)
def test_per_layer_direct_pf_lf(mla, layers):
    """Host layers layer_id .. layer_id + n - 1 into the n given device layers per K/V; the others stay
    poisoned (every layer and K/V has its own poison byte)."""
    k, v = device_layers(mla=mla, fill="poison", seed=1), None if mla else device_layers(fill="poison", seed=2)
    host = host_pool("page_first_direct", mla=mla)
    d_idx, h_idx = page_idx(seed=6, pages=3)
    exp = expect("h2d", k, v, host, d_idx, h_idx, "page_first_direct", layers)
    dst, src = kv_lists(k, v, host, layers)
    layer_id = np.int64(layers[0]) if mla else layers[0]  # numpy integers work like ints
    sk.transfer_kv_per_layer_direct_pf_lf(src, dst, h_idx, d_idx, layer_id, PAGE)
    check(k, v, host, exp)


def test_direct_round_trip_through_page_first_direct():
    k, v = device_layers(seed=7), device_layers(seed=8)
    host = host_pool("page_first_direct", fill="poison")
    d_idx, h_idx = page_idx(seed=9)
    src, dst = kv_lists(k, v, host, range(L))
    sk.transfer_kv_all_layer_direct_lf_pf(src, dst, d_idx, h_idx, PAGE)
    back_k, back_v = device_layers(fill="poison", seed=5), device_layers(fill="poison", seed=6)
    for layer in range(L):
        sk.transfer_kv_per_layer_direct_pf_lf(dst, [back_k[layer], back_v[layer]], h_idx, d_idx, layer, PAGE)
    for a, b in zip(back_k + back_v, k + v, strict=True):
        assert same_bytes(a[d_idx], b[d_idx])


def _lf_pf(k, v, host, d_idx, h_idx, page=PAGE):
    src, dst = kv_lists(k, v, host, range(len(k)))
    sk.transfer_kv_all_layer_direct_lf_pf(src, dst, d_idx, h_idx, page)


def _pf_lf(k, v, host, d_idx, h_idx, layer_id=0, dst=None):
    src = [host[0], host[1]]
    sk.transfer_kv_per_layer_direct_pf_lf(src, dst or [k[0], v[0]], h_idx, d_idx, layer_id, PAGE)


DIRECT_BAD = [
    # (id, call, exception, message pattern); calls get (k, v, host, d_idx, h_idx) and write host or k/v
    (
        "lf-pf-partial-page",
        lambda k, v, h, d, i: _lf_pf(k, v, h, d[:6], i[:6]),
        ValueError,
        "src_indices: .* page_size 4",
    ),
    ("lf-pf-page-size", lambda k, v, h, d, i: _lf_pf(k, v, h, d, i, page=2), ValueError, "page_size: 2 differs"),
    ("lf-pf-page-size-bool", lambda k, v, h, d, i: _lf_pf(k, v, h, d, i, page=True), TypeError, "page_size"),
    (
        "lf-pf-three-host-buffers",
        lambda k, v, h, d, i: sk.transfer_kv_all_layer_direct_lf_pf(k + v, [h[0], h[1], h[0]], d, i, PAGE),
        ValueError,
        "dst_ptrs: expected 1 or 2",
    ),
    (
        "lf-pf-odd-layer-count",
        lambda k, v, h, d, i: sk.transfer_kv_all_layer_direct_lf_pf(k + v[:2], [h[0], h[1]], d, i, PAGE),
        ValueError,
        "src_ptrs: expected K layers then V layers",
    ),
    (
        "lf-pf-more-layers-than-host",
        lambda k, v, h, d, i: sk.transfer_kv_all_layer_direct_lf_pf(k + k[:1] + v + v[:1], [h[0], h[1]], d, i, PAGE),
        ValueError,
        "src_ptrs: 4 layers per K/V, more than the 3 layers",
    ),
    (
        "lf-pf-item-shape",
        lambda k, v, h, d, i: _lf_pf([t[:, :1].contiguous() for t in k], [t[:, :1].contiguous() for t in v], h, d, i),
        ValueError,
        r"src_ptrs\[0\]: expected \[N, 2, 6\]",
    ),
    (
        "lf-pf-dtype",
        lambda k, v, h, d, i: _lf_pf([t.view(torch.bfloat16) for t in k], [t.view(torch.bfloat16) for t in v], h, d, i),
        TypeError,
        "src_ptrs: dtype torch.bfloat16",
    ),
    (
        "lf-pf-meta",
        lambda k, v, h, d, i: _lf_pf([t.to("meta") for t in k], [t.to("meta") for t in v], h, d, i),
        ValueError,
        r"src_ptrs\[0\]: .*meta tensors hold no memory",
    ),
    ("pf-lf-layer-range", lambda k, v, h, d, i: _pf_lf(k, v, h, d, i, layer_id=L), ValueError, r"layer_id: .*\[0, 3\)"),
    ("pf-lf-layer-neg", lambda k, v, h, d, i: _pf_lf(k, v, h, d, i, layer_id=-1), ValueError, "layer_id"),
    (
        "pf-lf-two-layers-from-last",
        lambda k, v, h, d, i: _pf_lf(k, v, h, d, i, layer_id=L - 1, dst=[k[0], k[1], v[0], v[1]]),
        ValueError,
        r"layer_id: expected an int in \[0, 2\) for 2 layer",
    ),
    ("pf-lf-layer-float", lambda k, v, h, d, i: _pf_lf(k, v, h, d, i, layer_id=1.0), TypeError, "layer_id"),
    ("pf-lf-layer-none", lambda k, v, h, d, i: _pf_lf(k, v, h, d, i, layer_id=None), TypeError, "layer_id"),
    ("pf-lf-partial-page", lambda k, v, h, d, i: _pf_lf(k, v, h, d[:5], i[:5]), ValueError, "src_indices"),
    ("pf-lf-k-without-v", lambda k, v, h, d, i: _pf_lf(k, v, h, d, i, dst=[k[0]]), ValueError, "dst_ptrs: expected K"),
]


@pytest.mark.parametrize(("call", "exc", "pattern"), [b[1:] for b in DIRECT_BAD], ids=[b[0] for b in DIRECT_BAD])
def test_direct_functions_refuse_bad_arguments(call, exc, pattern):
    k, v = device_layers(seed=1), device_layers(seed=2)
    host = host_pool("page_first_direct")
    d_idx, h_idx = page_idx(seed=3)
    before = [t.clone() for t in (*k, *v, host)]
    with pytest.raises(exc, match=pattern) as info:
        call(k, v, host, d_idx, h_idx)
    assert isinstance(info.value, RuntimeError), "sgl-kernel's TORCH_CHECK raises RuntimeError"
    assert all(same_bytes(a, b) for a, b in zip((*k, *v, host), before, strict=True)), "a rejected call wrote"


@pytest.mark.parametrize("backend", ["direct", "batch", "auto", "kernel"])
def test_pointer_tables_on_cpu_need_triton(backend):
    """The *_layers functions on CPU tensors: only triton can follow a raw pointer table there; the
    others raise a clear BackendUnavailableError (they used to fail with an unrelated IndexError)."""
    k = [t.cpu() for t in device_layers(seed=3)]
    v = [t.cpu() for t in device_layers(seed=4)]
    host = host_pool("page_first", fill="poison").cpu()
    before = host.clone()
    d_idx, h_idx = idx(seed=2)

    def cpu_table(layers):
        return torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)

    sk.use_backend(backend)
    with pytest.raises(BackendUnavailableError, match=rf"io-backend '{backend}': pointer tables .* only on the triton"):
        sk.transfer_kv_all_layer_lf_pf(cpu_table(k), host[0], cpu_table(v), host[1], d_idx, h_idx, ITEM, L * ITEM, L)
    assert same_bytes(host, before)


def test_meta_tensors_are_refused():
    """A meta tensor used to crash the process on the triton backend (it has no memory to address)."""
    k, v = device_layers(seed=1)[0], device_layers(seed=2)[0]
    meta = torch.empty_like(k, device="meta")
    with pytest.raises(ValueError, match=r"dst_k: .* on meta \(meta tensors hold no memory\)"):
        sk.transfer_kv_per_layer(k, meta, v, meta, torch.arange(3), torch.arange(3), ITEM)
    with pytest.raises(ValueError, match=r"src: .* meta"):
        sk.transfer_kv_per_layer_mla(meta, k, torch.arange(3), torch.arange(3), ITEM)


def test_use_backend_names_its_argument():
    with pytest.raises(TypeError, match="name: expected a backend name"):
        sk.use_backend(["triton"])


# -- a destination sharing memory with a source: refused before anything is written ------------------------
def inside(buf, like):
    """A tensor shaped like ``like`` over the first bytes of ``buf``: it shares ``buf``'s memory."""
    return buf.reshape(-1)[: like.numel()].view(like.shape)


MLA_ITEM = D * DT.itemsize

# (id, call, message pattern). A call gets `b` (K and V device layers, MLA layers, host buffers of each
# layout, indices) and passes some memory on both sides: the same tensor or pointer table, a view of a
# source, or a pointer table naming a layer that lives inside a destination buffer.
ALIASED = [
    (
        "per_layer-same-tensor",
        lambda b: sk.transfer_kv_per_layer(b.k[0], b.k[0], b.v[0], b.v[1], b.dev, b.dev2, ITEM),
        r"dst_k: its memory .* overlaps src_k's",
    ),
    (
        "per_layer-dst_v-is-src_k",
        lambda b: sk.transfer_kv_per_layer(b.k[0], b.k[1], b.v[0], b.k[0], b.dev, b.dev2, ITEM),
        r"dst_v: its memory .* overlaps src_k's",
    ),
    (
        "per_layer_pf_lf-dst-view-of-src",
        lambda b: sk.transfer_kv_per_layer_pf_lf(
            b.pf[0], inside(b.pf[0], b.k[0]), b.pf[1], b.v[0], b.host, b.dev, 1, ITEM, L * ITEM
        ),
        r"dst_k: its memory .* overlaps src_k's",
    ),
    (
        "per_layer_ph_lf-dst-view-of-src",
        lambda b: sk.transfer_kv_per_layer_ph_lf(
            b.ph[0], b.k[0], b.ph[1], inside(b.ph[1], b.v[0]), b.host, b.dev, 1, ITEM, L * ITEM, PAGE, H
        ),
        r"dst_v: its memory .* overlaps src_v's",
    ),
    (
        "all_layer-same-tables",
        lambda b: sk.transfer_kv_all_layer(b.kt, b.kt, b.vt, table(b.v2), b.dev, b.dev2, ITEM, L),
        r"dst_k_layers\[(\d)\]: its memory .* overlaps src_k_layers\[\1\]'s",
    ),
    (
        "all_layer_lf_pf-table-into-dst",
        lambda b: sk.transfer_kv_all_layer_lf_pf(
            b.kt, b.pf[0], table([inside(b.pf[1], b.v[0]), *b.v[1:]]), b.pf[1], b.dev, b.host, ITEM, L * ITEM, L
        ),
        r"dst_v: its memory .* overlaps src_v_layers\[0\]'s",
    ),
    (
        "all_layer_lf_ph-table-into-dst",
        lambda b: sk.transfer_kv_all_layer_lf_ph(
            table([*b.k[:2], inside(b.ph[0], b.k[2])]),
            b.ph[0],
            b.vt,
            b.ph[1],
            b.dev,
            b.host,
            ITEM,
            L * ITEM,
            L,
            PAGE,
            H,
        ),
        r"dst_k: its memory .* overlaps src_k_layers\[2\]'s",
    ),  # fmt: skip
    (
        "per_layer_mla-same-tensor",
        lambda b: sk.transfer_kv_per_layer_mla(b.kv[1], b.kv[1], b.dev, b.dev2, MLA_ITEM),
        r"dst: its memory .* overlaps src's",
    ),
    (
        "per_layer_mla_pf_lf-dst-view-of-src",
        lambda b: sk.transfer_kv_per_layer_mla_pf_lf(
            b.pf_mla, inside(b.pf_mla, b.kv[0]), b.host, b.dev, 0, MLA_ITEM, L * MLA_ITEM
        ),
        r"dst: its memory .* overlaps src's",
    ),
    (
        "all_layer_mla-same-table",
        lambda b: sk.transfer_kv_all_layer_mla(table(b.kv), table(b.kv), b.dev, b.dev2, MLA_ITEM, L),
        r"dst_layers\[(\d)\]: its memory .* overlaps src_layers\[\1\]'s",
    ),
    (
        "all_layer_mla_lf_pf-table-into-dst",
        lambda b: sk.transfer_kv_all_layer_mla_lf_pf(
            table([inside(b.pf_mla, b.kv[0]), *b.kv[1:]]), b.pf_mla, b.dev, b.host, MLA_ITEM, L * MLA_ITEM, L
        ),
        r"dst: its memory .* overlaps src_layers\[0\]'s",
    ),
    (
        "direct-same-list",
        lambda b: sk.transfer_kv_direct(b.k, b.k, b.dev_pages, b.dev_pages2, PAGE),
        r"dst_layers\[(\d)\]: its memory .* overlaps src_layers\[\1\]'s",
    ),
    (
        "all_layer_direct_lf_pf-src-view-of-dst",
        lambda b: sk.transfer_kv_all_layer_direct_lf_pf(
            [*b.k, *b.v[:2], inside(b.pfd[1], b.v[2])], [b.pfd[0], b.pfd[1]], b.dev_pages, b.host_pages, PAGE
        ),
        r"dst_ptrs\[1\]: its memory .* overlaps src_ptrs\[5\]'s",
    ),
    (
        "per_layer_direct_pf_lf-dst-view-of-src",
        lambda b: sk.transfer_kv_per_layer_direct_pf_lf(
            [b.pfd[0], b.pfd[1]], [inside(b.pfd[0], b.k[0]), b.v[0]], b.host_pages, b.dev_pages, 0, PAGE
        ),
        r"dst_ptrs\[0\]: its memory .* overlaps src_ptrs\[0\]'s",
    ),
]


def aliasing_buffers():
    from types import SimpleNamespace

    k, v = device_layers(seed=1), device_layers(seed=2)
    b = SimpleNamespace(k=k, v=v, v2=device_layers(seed=3), kv=device_layers(mla=True, seed=4), kt=table(k),
                        vt=table(v), pf=host_pool("page_first"), ph=host_pool("page_head"),
                        pfd=host_pool("page_first_direct"), pf_mla=host_pool("page_first", mla=True))  # fmt: skip
    b.dev, b.host = idx(seed=5)
    b.dev2 = torch.randperm(N_DEV, generator=gen(6))[:6]
    b.dev_pages, b.host_pages = page_idx(seed=7)
    b.dev_pages2 = page_idx(seed=8)[0]
    return b


@pytest.mark.parametrize(("call", "pattern"), [a[1:] for a in ALIASED], ids=[a[0] for a in ALIASED])
def test_source_and_destination_sharing_memory_are_refused(call, pattern):
    """Every function: a destination overlapping a source (the kernels read sources through the
    non-coherent cache, so such a copy is undefined) raises ValueError naming both, and writes nothing."""
    b = aliasing_buffers()
    every = [*b.k, *b.v, *b.v2, *b.kv, b.pf, b.ph, b.pfd, b.pf_mla]
    before = [t.clone() for t in every]
    with pytest.raises(ValueError, match=pattern):
        call(b)
    assert all(same_bytes(a, c) for a, c in zip(every, before, strict=True)), "a refused call wrote"


def test_disjoint_views_of_one_buffer_are_fine():
    """Source and destination may be views of one storage when their bytes do not overlap: K and V
    layers, sources and destinations, as the quarters of one buffer, by pointer tables and by tensors."""
    buf = torch.empty(4, L, N_DEV, H, D, dtype=DT)
    random_bytes_(buf[:2], gen(20))
    poison_(buf[2:])
    buf = buf.to(DEV)  # one storage on the pools' device
    src_k, src_v, dst_k, dst_v = (list(buf[i].unbind(0)) for i in range(4))
    si, di = idx(seed=21)[0], torch.randperm(N_DEV, generator=gen(22))[:6]

    def expected(layers):
        exp = [t.clone() for t in dst_k + dst_v]
        for layer in layers:
            exp[layer][di] = src_k[layer][si]
            exp[L + layer][di] = src_v[layer][si]
        return exp

    exp = expected(range(L))
    sk.transfer_kv_all_layer(table(src_k), table(dst_k), table(src_v), table(dst_v), si, di, ITEM, L)
    assert all(same_bytes(a, e) for a, e in zip(dst_k + dst_v, exp, strict=True))
    poison_(buf[2:])
    exp = expected([1])
    sk.transfer_kv_per_layer(src_k[1], dst_k[1], src_v[1], dst_v[1], si, di, ITEM)
    assert all(same_bytes(a, e) for a, e in zip(dst_k + dst_v, exp, strict=True))


@pytest.mark.gpu_smoke  # runs on CUDA pools when a GPU is visible
@pytest.mark.parametrize("kind", ["step", "column"])
def test_strided_indices_are_read_as_their_values(kind):
    """sgl-kernel callers slice index tensors: a strided view must move the slots its values name."""
    src_k, src_v = device_layers(seed=1), device_layers(seed=2)
    dst_k, dst_v = device_layers(fill="poison", seed=3), device_layers(fill="poison", seed=4)
    si, di = torch.tensor([4, 0, 7, 31, 12]), torch.tensor([9, 2, 30, 5, 21])
    wide = torch.full((5, 3) if kind == "column" else (10,), -1, dtype=torch.int64)
    view = (lambda w: w[:, 1]) if kind == "column" else (lambda w: w[::2])

    def strided_of(values):  # a strided view of a tensor on the pools' device (CUDA ones on a GPU)
        w = wide.clone().to(DEV)
        view(w).copy_(values.to(DEV))
        return view(w)

    exp_k, exp_v = [t.clone() for t in dst_k], [t.clone() for t in dst_v]
    exp_k[1][di.to(DEV)] = src_k[1][si.to(DEV)]
    exp_v[1][di.to(DEV)] = src_v[1][si.to(DEV)]
    s_view, d_view = strided_of(si), strided_of(di)
    assert not s_view.is_contiguous()
    sk.transfer_kv_per_layer(src_k[1], dst_k[1], src_v[1], dst_v[1], s_view, d_view, ITEM)
    assert all(same_bytes(a, b) for a, b in zip(dst_k + dst_v, exp_k + exp_v, strict=True))


# -- SGLang's Mamba state transfers (sglang.kernels.ops.mamba.transfer_mamba's signatures) ----------------
STATE = (3, 5)  # a state slot: 15 float32 (60 bytes: not a multiple of 8)


def mamba_pools(seed):
    """Device states ``[L, N_DEV, *STATE]`` (random) and a page-first host buffer ``[N_HOST, L, 1,
    *STATE]`` (poisoned), as SGLang's MambaPoolHost lays them out."""
    dev = torch.empty(L, N_DEV, *STATE, dtype=torch.float32)
    random_bytes_(dev, gen(seed))
    host = poison_(torch.empty(N_HOST, L, 1, *STATE, dtype=torch.float32, pin_memory=CUDA))
    return dev.to(DEV), host


@pytest.mark.gpu_smoke  # runs on CUDA pools when a GPU is visible
def test_mamba_state_backup_then_load_per_layer():
    dev, host = mamba_pools(seed=11)
    d_idx, h_idx = idx(seed=12, n=5)
    item = int(np.prod(STATE)) * 4
    want_host = host.clone()
    want_host[h_idx] = dev.cpu()[:, d_idx].movedim(0, 1).unsqueeze(2)
    sk.transfer_kv_mamba_lf_pf(table(list(dev.unbind(0))), host, d_idx.to(DEV), h_idx.to(DEV), item, L * item, L)
    assert same_bytes(host, want_host), "backup: the host slots differ from the device states"
    back = poison_(torch.empty_like(dev))
    d2 = torch.randperm(N_DEV, generator=gen(13))[:5]
    for layer in range(L):
        sk.transfer_kv_mamba_pf_lf(host, back[layer], h_idx.to(DEV), d2.to(DEV), layer, item, L * item)
    want = poison_(torch.empty_like(dev).cpu())
    want[:, d2] = dev.cpu()[:, d_idx]
    assert same_bytes(back.cpu(), want), "load: rows other than the loaded ones were written, or wrong bytes"


@pytest.mark.parametrize(
    ("call", "exc", "fragment"),
    [
        (lambda dev, host, i: sk.transfer_kv_mamba_pf_lf(host, dev[0], i, i, L, 60, L * 60), ValueError, "layer_id"),
        (lambda dev, host, i: sk.transfer_kv_mamba_pf_lf(host, dev[0], i, i, 0, 60, 60 * L, 2.5), TypeError, "warps"),
        (
            lambda dev, host, i: sk.transfer_kv_mamba_lf_pf(table([dev[0]]), host, i, i[:2], 60, 60 * L, 1),
            ValueError,
            "same length",
        ),  # fmt: skip
        (lambda dev, host, i: sk.transfer_kv_mamba_lf_pf(dev[0], host, i, i, 60, 60 * L, L), TypeError, "src_layers"),
    ],
)
def test_mamba_transfers_refuse_bad_arguments(call, exc, fragment):
    dev, host = mamba_pools(seed=14)
    before = (dev.clone(), host.clone())
    with pytest.raises(exc, match=fragment) as info:
        call(dev, host, torch.arange(3, device=DEV))
    assert isinstance(info.value, RuntimeError)
    assert same_bytes(dev, before[0]) and same_bytes(host, before[1])


def test_get_device_accessible_ptr():
    t = torch.empty(8, dtype=torch.uint8, device=DEV)
    got = sk.get_device_accessible_ptr(t, 0)
    assert got == t.data_ptr()  # a CUDA tensor's own address; without a driver, the host address
    for bad, exc in ((t.tolist(), TypeError), (t.to("meta"), ValueError)):
        with pytest.raises(exc, match="tensor") as info:
            sk.get_device_accessible_ptr(bad, 0)
        assert isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError, match="device_index"):
        sk.get_device_accessible_ptr(t, -1)


# -- transfer_embedding_ranges_direct (SGLang's embedding cache and MiniMax NVFP4 host pool) -------------
@pytest.mark.gpu_smoke  # runs host -> CUDA and back when a GPU is visible
@pytest.mark.parametrize("starts", ["list", "numpy", "tensor"])
def test_embedding_ranges_copy_row_ranges(starts):
    host = torch.empty(20, 3, 7, dtype=torch.float16, pin_memory=CUDA)
    random_bytes_(host, gen(21))
    dev = poison_(torch.empty(16, 3, 7, dtype=torch.float16, device=DEV))
    src_s, dst_s, n = [0, 12, 5, 19], [9, 0, 4, 15], [3, 4, 0, 1]  # one empty range, one range per end row
    conv = {"list": list, "numpy": lambda v: np.array(v), "tensor": torch.tensor}[starts]
    sk.transfer_embedding_ranges_direct(host, dev, conv(src_s), conv(dst_s), conv(n))
    want = poison_(torch.empty(16, 3, 7, dtype=torch.float16))
    for a, b, k in zip(src_s, dst_s, n, strict=True):
        want[b : b + k] = host[a : a + k]
    if CUDA:
        torch.cuda.synchronize()
    assert same_bytes(dev.cpu(), want)
    back = poison_(torch.empty_like(host))  # and back, device rows to host rows
    sk.transfer_embedding_ranges_direct(dev, back, dst_s, src_s, n)
    if CUDA:
        torch.cuda.synchronize()
    want_back = poison_(torch.empty_like(host))
    for a, _b, k in zip(src_s, dst_s, n, strict=True):
        want_back[a : a + k] = host[a : a + k]
    assert same_bytes(back, want_back)


@pytest.mark.parametrize(
    ("args", "exc", "fragment"),
    [
        (lambda s, d: (s, d, [0], [0, 1], [1]), ValueError, "dst_starts: .*same length"),
        (lambda s, d: (s, d, [0], [0], [1, 1]), ValueError, "lengths: .*same length"),
        (lambda s, d: (s, d, [8], [0], [3]), ValueError, r"src_starts\[0\]: rows 8..11 run past the 10 rows"),
        (lambda s, d: (s, d, [0, 0], [0, 5], [2, 2]), ValueError, r"dst_starts\[1\]"),
        (lambda s, d: (s, d, [-1], [0], [1]), ValueError, "src_starts: expected non-negative"),
        (lambda s, d: (s, d, [0.5], [0], [1]), TypeError, "src_starts"),
        (lambda s, d: (s, d, [0], [0], torch.ones(1)), TypeError, "lengths"),
        (lambda s, d: (s, d.view(12, 3), [0], [0], [1]), ValueError, "dst: rows of 3 bytes differ from src's 6"),
        (lambda s, d: (s, d.t(), [0], [0], [1]), ValueError, "dst: expected a contiguous"),
        (lambda s, d: (s.tolist(), d, [0], [0], [1]), TypeError, "src: expected a torch.Tensor"),
    ],
)
def test_embedding_ranges_refuse_bad_arguments(args, exc, fragment):
    src = random_bytes_(torch.empty(10, 6, dtype=torch.uint8), gen(22))
    dst = poison_(torch.empty(6, 6, dtype=torch.uint8))
    before = dst.clone()
    with pytest.raises(exc, match=fragment) as info:
        sk.transfer_embedding_ranges_direct(*args(src, dst))
    assert isinstance(info.value, RuntimeError)
    assert same_bytes(dst, before), "a refused call wrote"
