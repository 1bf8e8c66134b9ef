"""Test data for transfers: random pools, poisoned destinations, index sets, byte-exact comparison."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache_kernels import layouts
from hicache_kernels.reference import reference_transfer

POISON = 0xA5


def random_bytes_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill ``t`` with random bits (any dtype; NaN patterns included, so compare bytes, not values)."""
    b = t.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    return t


def poison_(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(POISON)
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu())


@dataclass
class Pools:
    device_k: list[torch.Tensor] | torch.Tensor
    device_v: list[torch.Tensor] | torch.Tensor | None
    host: torch.Tensor
    layout: str
    page_size: int

    def layers(self, pool) -> list[torch.Tensor]:
        return list(pool.unbind(0)) if isinstance(pool, torch.Tensor) else pool

    def tensors(self) -> list[torch.Tensor]:
        out = self.layers(self.device_k) + ([] if self.device_v is None else self.layers(self.device_v))
        return [*out, self.host]

    def clone(self) -> Pools:
        def c(p):
            if p is None:
                return None
            return p.clone() if isinstance(p, torch.Tensor) else [t.clone() for t in p]

        return Pools(c(self.device_k), c(self.device_v), self.host.clone(), self.layout, self.page_size)

    def equal(self, other: Pools) -> bool:
        return all(same_bytes(a, b) for a, b in zip(self.tensors(), other.tensors(), strict=True))


def make_pools(
    *,
    layout: str,
    mla: bool,
    dtype: torch.dtype,
    page_size: int,
    num_layers: int = 3,
    head_num: int = 2,
    head_dim: int = 8,
    device_slots: int = 96,
    host_pages: int = 4,
    stacked: bool = True,
    direction: str = "d2h",
    seed: int = 0,
    device: str = "cpu",
    pin: bool = False,
) -> Pools:
    """Source pool random, destination pool poisoned."""
    gen = torch.Generator().manual_seed(seed)
    H = 1 if mla else head_num
    n_host = host_pages * page_size if page_size > 1 else 48
    shape = layouts.host_shape(
        layout, mla=mla, num_layers=num_layers, num_slots=n_host, page_size=page_size, head_num=H, head_dim=head_dim
    )
    host = torch.empty(shape, dtype=dtype, pin_memory=pin)

    def dev_pool():
        t = torch.empty(num_layers, device_slots, H, head_dim, dtype=dtype)
        if direction == "d2h":
            random_bytes_(t, gen)
        else:
            poison_(t)
        t = t.to(device)
        return t if stacked else [x.clone() for x in t.unbind(0)]

    k = dev_pool()
    v = None if mla else dev_pool()
    if direction == "d2h":
        poison_(host)
    else:
        random_bytes_(host, gen)
    return Pools(k, v, host, layout, page_size)


def make_indices(kind: str, n_dev: int, n_host: int, page_size: int, count: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Duplicate-free index pairs: ``random`` token permutations, whole ``pages`` (runs), or runs
    ``crossing`` a host page boundary: consecutive on both sides, each starting at another offset inside
    a host page (1 .. page - 1) and one page long, so that each crosses exactly one boundary there (with
    page size 1, runs of 4 at arbitrary offsets)."""
    gen = torch.Generator().manual_seed(seed + 1)
    count = min(count, n_dev, n_host)
    if kind == "crossing":
        p = max(page_size, 4)
        runs = min(n_dev // p, n_host // (2 * p), max(2, count // p))
        if runs < 1:
            raise ValueError(f"crossing runs of {p} slots need {p} device, {2 * p} host slots; got {n_dev}, {n_host}")
        db = torch.randperm(n_dev // p, generator=gen)[:runs]  # device: no pages, any p-aligned run
        hb = torch.randperm(n_host // (2 * p), generator=gen)[:runs]  # host: two pages per run, disjoint
        off = torch.tensor([1 + (i * 5 + seed) % (p - 1) for i in range(runs)])
        run = torch.arange(p)
        return (db[:, None] * p + run).reshape(-1), (hb[:, None] * 2 * p + off[:, None] + run).reshape(-1)
    if kind == "random":
        d = torch.randperm(n_dev, generator=gen)[:count]
        h = torch.randperm(n_host, generator=gen)[:count]
        return d, h
    p = max(page_size, 4)  # with page 1, still make runs of 4
    pages = min(n_dev // p, n_host // p, max(1, count // p))
    dp = torch.randperm(n_dev // p, generator=gen)[:pages]
    hp = torch.randperm(n_host // p, generator=gen)[:pages]
    off = torch.arange(p)
    return (dp[:, None] * p + off).reshape(-1), (hp[:, None] * p + off).reshape(-1)


def expected_after(pools: Pools, direction: str, d_idx, h_idx, layer_id: int | None) -> Pools:
    exp = pools.clone()
    num_layers = len(exp.layers(exp.device_k))
    reference_transfer(
        direction=direction,
        device_k=exp.layers(exp.device_k),
        device_v=None if exp.device_v is None else exp.layers(exp.device_v),
        host=exp.host,
        device_indices=d_idx,
        host_indices=h_idx,
        layout=exp.layout,
        page_size=exp.page_size,
        layers=range(num_layers) if layer_id is None else [layer_id],
    )
    return exp
