"""hicache_kernels.copy_ranges, the pointer-list copy (vLLM's swap_blocks_batch shape): byte-exact
against a numpy reference on random data with poisoned destinations, on the CPU through the triton
backend (its interpreter reaches raw addresses), the argument checks, and on a GPU every backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hicache_kernels
from hicache_kernels import copy_ranges
from hicache_kernels.backends.base import IOBackend

POISON = 0xA5


def arena(nbytes: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return t.to(device) if device != "cpu" else t


def ranges(sizes: list[int], src: torch.Tensor, dst: torch.Tensor, seed: int):
    """Non-overlapping ranges at shuffled, differently aligned offsets of src and dst."""
    rng = np.random.default_rng(seed)
    offs = []
    for arena_t in (src, dst):
        pos, out = 0, []
        for s in rng.permutation(len(sizes)):
            out.append((int(s), pos + int(rng.integers(0, 3)) * 8))
            pos = out[-1][1] + sizes[int(s)] + 16
        assert pos <= arena_t.numel()
        offs.append(dict(out))
    s_off = [offs[0][i] for i in range(len(sizes))]
    d_off = [offs[1][i] for i in range(len(sizes))]
    sp = torch.tensor([src.data_ptr() + o for o in s_off], dtype=torch.int64)
    dp = torch.tensor([dst.data_ptr() + o for o in d_off], dtype=torch.int64)
    return sp, dp, torch.tensor(sizes, dtype=torch.int64), s_off, d_off


def expected(src: torch.Tensor, dst: torch.Tensor, sizes, s_off, d_off) -> torch.Tensor:
    out = dst.cpu().clone()
    s = src.cpu()
    for n, a, b in zip(sizes, s_off, d_off, strict=True):
        out[b : b + n] = s[a : a + n]
    return out


SIZES = [64, 64, 4096, 24, 64, 4096, 0, 8]


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_triton_copies_every_range_byte_for_byte(direction):
    src, dst = arena(20000, 1), torch.full((20000,), POISON, dtype=torch.uint8)
    sp, dp, sz, s_off, d_off = ranges(SIZES, src, dst, seed=2)
    want = expected(src, dst, SIZES, s_off, d_off)
    copy_ranges(sp, dp, sz, direction=direction, device="cpu", backend="triton")
    assert torch.equal(dst, want)
    assert (dst == POISON).sum() > 0  # bytes outside the ranges were left alone (the poison shows)


def test_nothing_to_copy_is_a_no_op():
    empty = torch.zeros(0, dtype=torch.int64)
    copy_ranges(empty, empty, empty, direction="d2h", device="cpu", backend="triton")
    src, dst = arena(64, 3), torch.full((64,), POISON, dtype=torch.uint8)
    one = torch.tensor([src.data_ptr()]), torch.tensor([dst.data_ptr()]), torch.tensor([0])
    copy_ranges(*one, direction="d2h", device="cpu", backend="triton")
    assert (dst == POISON).all()


class Recorder(IOBackend):
    """Records the plans it is given (one per distinct size) instead of copying."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.plans = []

    def _prepare(self, plan):
        self.plans.append(plan)
        return lambda: None

    def prepare(self, plan):
        return self._prepare(plan)


def test_one_plan_per_distinct_size_with_the_ranges_as_table_entries():
    src, dst = arena(20000, 4), torch.zeros(20000, dtype=torch.uint8)
    sp, dp, sz, _, _ = ranges(SIZES, src, dst, seed=5)
    rec = Recorder()
    copy_ranges(sp, dp, sz, direction="h2d", device="cuda:0", backend=rec)  # planned only: the recorder copies nothing
    by_size = {p.route.chunk_bytes: p for p in rec.plans}
    assert sorted(by_size) == [8, 24, 64, 4096]
    for nbytes, plan in by_size.items():
        pick = [i for i, s in enumerate(SIZES) if s == nbytes]
        assert plan.route.layer_count == len(pick) and plan.src.table == tuple(sp[pick].tolist())
        assert plan.dst.table == tuple(dp[pick].tolist())
        assert plan.src.is_host and not plan.dst.is_host  # h2d: the sources are host memory


@pytest.mark.parametrize(
    ("kw", "exc", "name"),
    [
        ({"src_ptrs": [1]}, TypeError, "src_ptrs"),
        ({"src_ptrs": torch.tensor([1], dtype=torch.int32)}, TypeError, "src_ptrs"),
        ({"dst_ptrs": torch.tensor([1, 2])}, ValueError, "dst_ptrs"),
        ({"sizes": torch.tensor([[8]])}, TypeError, "sizes"),
        ({"sizes": torch.tensor([-1])}, ValueError, "sizes"),
        ({"src_ptrs": torch.tensor([0])}, ValueError, "src_ptrs"),
        ({"dst_ptrs": torch.tensor([-4])}, ValueError, "dst_ptrs"),
        ({"direction": "sideways"}, ValueError, "direction"),
        ({"backend": "nope"}, ValueError, "backend"),
        ({"backend": 3}, TypeError, "backend"),
    ],
)
def test_bad_arguments_name_themselves_and_copy_nothing(kw, exc, name):
    src, dst = arena(64, 6), torch.full((64,), POISON, dtype=torch.uint8)
    args = {"src_ptrs": torch.tensor([src.data_ptr()]), "dst_ptrs": torch.tensor([dst.data_ptr()]),
            "sizes": torch.tensor([8]), "direction": "d2h", "device": "cpu", "backend": "triton", **kw}  # fmt: skip
    with pytest.raises(exc, match=name):
        copy_ranges(**args)
    assert (dst == POISON).all()


@pytest.mark.parametrize("backend", ["auto", "direct", "batch", "kernel", "staged"])
def test_on_the_cpu_only_triton_reaches_raw_addresses_and_the_others_say_so(backend):
    """The compat layer's rule for pointer tables on the CPU (one check in hicache_kernels.plan)."""
    src, dst = arena(64, 10), torch.full((64,), POISON, dtype=torch.uint8)
    with pytest.raises(hicache_kernels.BackendUnavailableError, match=rf"'{backend}': pointer tables \(src_ptrs"):
        copy_ranges(torch.tensor([src.data_ptr()]), torch.tensor([dst.data_ptr()]), torch.tensor([16]),
                    direction="d2h", device="cpu", backend=backend)  # fmt: skip
    assert (dst == POISON).all()


def test_it_is_public():
    assert hicache_kernels.copy_ranges is copy_ranges and "copy_ranges" in hicache_kernels.__all__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["kernel", "batch", "triton", "auto"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_gpu_backends_copy_every_range_byte_for_byte(backend, direction):
    dev = arena(40000, 7, "cuda")
    host = arena(40000, 8).pin_memory()
    src, dst = (dev, host) if direction == "d2h" else (host, dev)
    dst.fill_(POISON)
    sizes = [16384, 512, 512, 24, 16384, 4096] * 2
    sp, dp, sz, s_off, d_off = ranges(sizes, src, dst, seed=9)
    want = expected(src, dst, sizes, s_off, d_off)
    copy_ranges(sp, dp, sz, direction=direction, backend=backend)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want)
