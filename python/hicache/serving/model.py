"""The model :mod:`hicache.serving.engine` serves: a small decoder-only transformer in plain torch.

:class:`TinyLM` has seeded random weights (no downloads): ``num_layers`` layers of grouped-query
attention (``num_heads`` query heads sharing ``num_kv_heads`` K/V heads of ``head_dim``) and a GELU
MLP, pre-RMS-norm, fixed sinusoidal positions. With ``mla=True`` a layer caches one latent vector of
``kv_lora`` elements per token instead (an MLA pool), from which every head's K and V are projected
up when attention reads it. Its attention keeps no K/V of its own: each layer writes the new tokens'
K and V into the :class:`~hicache.pools.DeviceKVPool` at the request's slots and reads every earlier
token's K and V back from there (paged: the pool is the only KV storage).

With ``ModelConfig(exact=True)`` every computation is laid out so that a token's logits do not depend
on how the work was split (projections are per-row reductions of fixed length, each query attends
over exactly its own prefix): on CPU float32 the logits of a request served from the cache equal
those of a full recompute bit for bit, which is what proves that the loaded KV is the right KV in the
right place. ``exact=False`` uses matmuls and fused attention (for benchmarks at real sizes).

Tensor parallel: ``TinyLM(cfg, tp_group=group)`` is one rank of a head-parallel model (Megatron-style
attention): rank ``r`` of ``T`` holds query heads ``[r * H/T, (r+1) * H/T)`` and their K/V heads (its pool
has ``num_kv_heads / T`` heads: :meth:`TinyLM.pool`), computes attention for them only and all-gathers
the heads' outputs (gloo) before the output projection; everything else is replicated. With ``exact``
every head's computation is the same as on one rank, so every rank's logits equal a TP=1 recompute's bit
for bit. An MLA model keeps the whole latent on every rank and splits only the query heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..pools import DeviceKVPool
from ..pools.window_pool import WindowKVPool
from .config import (
    ModelConfig,
    dequantize_index_keys,
    index_pool,
    index_row,
    quantize_index_keys,
    state_pool,
    state_row,
)

__all__ = [
    "ModelConfig",
    "TinyLM",
    "dequantize_index_keys",
    "index_pool",
    "index_row",
    "quantize_index_keys",
    "state_pool",
    "state_row",
]

# SDPA groups query heads over fewer K/V heads itself (no repeated K/V copies) from torch 2.5 on.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def _put(pools: tuple[torch.Tensor, ...], slots: torch.Tensor, values: tuple[torch.Tensor, ...]) -> None:
    """Write ``values[i]`` into ``pools[i]`` at ``slots`` (one layer's K and V, or its latents)."""
    for pool, value in zip(pools, values, strict=True):
        pool[slots] = value


def _rowmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` as one fixed-length reduction per output element: a row's result does not depend on
    how many rows are computed with it (a GEMM may pick another kernel, and another summation order,
    for another batch size)."""
    return (x.unsqueeze(-1) * w).sum(dim=-2)


def _rmsnorm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)


class TinyLM:
    """The model (module docstring). ``forward`` runs new tokens of one sequence."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu", tp_group: Any = None) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = 0, 1
        if tp_group is not None:
            self.tp_rank, self.tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
            heads = cfg.num_heads if cfg.mla else cfg.num_kv_heads
            if heads % self.tp_size:
                raise ValueError(
                    f"tp_group: {self.tp_size} ranks do not divide the model's {heads} "
                    f"{'query' if cfg.mla else 'K/V'} heads"
                )
        self.q_heads = cfg.num_heads // self.tp_size  # this rank's query heads
        self.kv_heads = 1 if cfg.mla else cfg.num_kv_heads // self.tp_size  # this rank's pool heads
        g = torch.Generator().manual_seed(cfg.seed)
        h, q, kv, f = cfg.hidden, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.ffn

        def w(*shape: int) -> torch.Tensor:
            t = torch.randn(*shape, generator=g) / math.sqrt(shape[-2] if len(shape) > 1 else 1)
            return t.to(device=self.device, dtype=cfg.dtype)

        self.embed = w(cfg.vocab, h) * math.sqrt(h)
        if cfg.mla:  # down to the latent, and up from it to every head's K and V
            r = cfg.kv_lora
            self.layers = [
                {
                    "wq": w(h, q),
                    "wdkv": w(h, r),
                    "wuk": w(r, q),
                    "wuv": w(r, q),
                    "wo": w(q, h),
                    "w1": w(h, f),
                    "w2": w(f, h),
                }  # fmt: skip
                for _ in range(cfg.num_layers)
            ]
        else:
            self.layers = [
                {"wq": w(h, q), "wk": w(h, kv), "wv": w(h, kv), "wo": w(q, h), "w1": w(h, f), "w2": w(f, h)}
                for _ in range(cfg.num_layers)
            ]
        if cfg.indexer_dim:
            for layer in self.layers:
                layer["wiq"], layer["wik"] = w(h, cfg.indexer_dim), w(h, cfg.indexer_dim)
        if cfg.recurrent_dim:  # the recurrent branch: input and output projections, a decay per channel
            rec = self.layers[cfg.recurrent_layer]
            rec["wu"], rec["wy"] = w(h, cfg.recurrent_dim), w(cfg.recurrent_dim, h)
            rec["decay"] = torch.sigmoid(torch.randn(cfg.recurrent_dim, generator=g) + 2.0).to(self.device)
        self.head = w(h, cfg.vocab)
        inv = torch.exp(-math.log(10000.0) * torch.arange(0, h, 2, dtype=torch.float64) / h)
        self._inv_freq = inv

    def pool(
        self, num_slots: int, page_size: int, device: str | torch.device = "cpu", *, windowed: bool = False
    ) -> DeviceKVPool:
        """A device KV pool for this rank: :meth:`ModelConfig.pool` with this rank's K/V heads."""
        return self.cfg.pool(num_slots, page_size, device, windowed=windowed, kv_heads=self.kv_heads)

    def positions(self, start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n, dtype=torch.float64)[:, None] * self._inv_freq[None]
        return torch.cat([pos.sin(), pos.cos()], dim=-1).to(device=self.device, dtype=self.cfg.dtype)

    def forward(
        self,
        pool: DeviceKVPool,
        tokens: list[int],
        start: int,
        slots: torch.Tensor,
        wait_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` of ``tokens`` at positions ``start, start + 1, ...``.

        ``slots`` are the device slots of positions ``0 .. start + len(tokens) - 1`` (the prefix's KV is
        already there, or arriving: ``wait_layer(k)`` is called before layer ``k`` reads it).
        """
        return self.forward_batch(pool, [(tokens, start, slots)], wait_layer)[0]

    def forward_batch(
        self,
        pool: DeviceKVPool,
        seqs: list[tuple[list[int], int, torch.Tensor]],
        wait_layer: Callable[[int], None] | None = None,
        last_only: bool = False,
        write_kv: Callable[..., None] | None = None,
        index: DeviceKVPool | None = None,
        state: DeviceKVPool | None = None,
        states: list[torch.Tensor | None] | None = None,
        window: WindowKVPool | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`forward` for several sequences at once, ``(tokens, start, slots)`` each: the rows of all
        of them go through each projection together; attention stays within each sequence (a prefill
        and the decode steps of other requests can share one call). ``last_only``: the logits of each
        sequence's last token only (``[1, vocab]`` each; the output projection skips the other rows).

        The new tokens' K/V (latents) go into the pool by ``write_kv(layer, slots, write, pool)`` (default:
        the write runs at once): an engine under a device model that completes work later queues it on the
        current stream. Attention reads the prefix from the pool and the new tokens' K/V from the
        projection itself, the same values, so it never reads back a write still in flight.

        ``index``: the indexer's sidecar pool (:func:`index_pool`), for a model with ``indexer_dim``: the
        new tokens' index keys are written there (the same way) and the prefix's read from it; a query
        attends to the ``index_topk`` earlier tokens its index query scores highest (itself always).

        ``state``, ``states``: for a model with a recurrent branch, its checkpoint pool (:func:`state_pool`)
        and each sequence's recurrent state before its new tokens (``[recurrent_dim]`` float32; None: the
        checkpoint at ``start``, which must then be a page boundary, read from the pool after
        ``wait_layer`` of the recurrent layer, or zeros at 0). Each page boundary the new tokens reach
        writes its checkpoint into the pool (the way K/V are written); ``states`` (given or not) ends
        holding each sequence's state after its last new token, for the next step's decode.

        ``window``: the windowed layers' :class:`~hicache.pools.WindowKVPool`, for a model with
        ``sliding_window`` whose ``pool`` holds the full layers only (``pool(..., windowed=True)``):
        a windowed layer writes and reads its K/V there, at the window slots of the KV slots: it reads
        the ``sliding_window - 1`` positions before each sequence's new tokens and writes only its last
        ``sliding_window - 1 + page_size - 1`` new tokens (all a later query or a resume at the page
        boundary before its end reads from the pool); those pages must have rows. ``wait_layer`` is
        called with the model's layer index (:meth:`ModelConfig.kv_layer_needed` says which KV-pool
        layer's load it needs)."""
        cfg = self.cfg
        d = cfg.head_dim
        group = cfg.num_heads // cfg.num_kv_heads
        hq, hkv = self.q_heads, self.kv_heads
        q0, kv0 = self.tp_rank * hq, self.tp_rank * hkv  # this rank's first query and K/V head
        lens = [len(t) for t, _, _ in seqs]
        n = sum(lens)
        seqs = [(t, start, sl.to(self.device)) for t, start, sl in seqs]
        ids = torch.tensor([tok for t, _, _ in seqs for tok in t], dtype=torch.int64, device=self.device)
        x = self.embed[ids] + torch.cat([self.positions(start, len(t)) for t, start, _ in seqs])
        scale = 1.0 / math.sqrt(d)
        mm = _rowmm if cfg.exact else torch.matmul
        put = write_kv if write_kv is not None else (lambda layer, slots, write, pool=None: write())
        if cfg.indexer_dim and index is None:
            raise ValueError("index: this model has an indexer; give its sidecar pool (index_pool)")
        if cfg.recurrent_dim and state is None:
            raise ValueError("state: this model has a recurrent branch; give its checkpoint pool (state_pool)")
        full_ix, win_ix = cfg.layer_slots(window is not None)
        if pool.num_layers != sum(1 for x in full_ix if x >= 0):
            if window is None and cfg.sliding_window:
                raise ValueError("window: this pool holds the full layers only; give the window pool")
            raise ValueError(f"pool: expected {sum(1 for x in full_ix if x >= 0)} layers (TinyLM.pool), got "
                             f"{pool.num_layers}")  # fmt: skip
        if states is None:
            states = [None] * len(seqs)
        elif len(states) != len(seqs):
            raise ValueError(f"states: expected one per sequence ({len(seqs)}), got {len(states)}")
        for li, layer in enumerate(self.layers):
            a = _rmsnorm(x)
            if not cfg.attends(li):  # a recurrent layer: its branch alone, no K/V
                if wait_layer is not None:
                    wait_layer(li)  # the checkpoints new sequences resume from have landed
                x = x + self._recur(a, seqs, lens, layer, state, states, put, mm)
                x = x + mm(torch.nn.functional.gelu(mm(_rmsnorm(x), layer["w1"])), layer["w2"])
                continue
            q_all = mm(a, layer["wq"]).view(n, cfg.num_heads, d)[:, q0 : q0 + hq]
            if cfg.indexer_dim:
                iq_all, ik_all = mm(a, layer["wiq"]), mm(a, layer["wik"])
            if cfg.mla:
                new = mm(a, layer["wdkv"])
            else:
                new = tuple(mm(a, layer[w]).view(n, cfg.num_kv_heads, d)[:, kv0 : kv0 + hkv] for w in ("wk", "wv"))
            if wait_layer is not None:
                wait_layer(li)  # the prefixes' K/V (latents) of this layer have landed in the pool
            outs = []
            row = 0
            wlen = cfg.window(li)
            for (_, start, slots), m in zip(seqs, lens, strict=True):
                q = q_all[row : row + m]
                first = 0  # the position of keys[0]
                into = slots[start : start + m]
                if cfg.mla:
                    pkv = pool.kv[li]
                    latent = new[row : row + m].view(m, 1, cfg.kv_lora).to(pkv.dtype)
                    put(li, into, partial(_put, (pkv,), into, (latent,)))
                    c = torch.cat([pkv[slots[:start]], latent]).view(start + m, cfg.kv_lora)
                    keys = mm(c, layer["wuk"]).view(start + m, cfg.num_heads, d)[:, q0 : q0 + hq]  # [S, Hq, d]
                    vals = mm(c, layer["wuv"]).view(start + m, cfg.num_heads, d)[:, q0 : q0 + hq]
                else:
                    # A windowed layer reads only the K/V its first query's window reaches.
                    first = max(0, start - wlen + 1) if wlen else 0
                    keep = 0  # the first new token whose K/V goes into the pool
                    if wlen and window is not None:  # the window pool, at the window slots of these KV slots
                        # Only what a later query or a later resume reads from the pool: the last window - 1
                        # new tokens, and page_size - 1 more (a cache keeps whole pages: a sequence cached
                        # up to the page boundary before its end resumes there); this forward's queries
                        # take the new tokens' K/V from the projection.
                        keep = max(0, m - (wlen - 1) - (window.page_size - 1))
                        into_at, read_at, wl = window.slots(into[keep:]), window.slots(slots[first:start]), win_ix[li]
                        pk, pv, target = window.pool.k[wl], window.pool.v[wl], (wl, window.pool)
                    else:
                        into_at, read_at, target = into, slots[first:start], (full_ix[li], None)
                        pk, pv = pool.k[full_ix[li]], pool.v[full_ix[li]]
                    k_new, v_new = new[0][row : row + m].to(pk.dtype), new[1][row : row + m].to(pv.dtype)
                    put(target[0], into_at, partial(_put, (pk, pv), into_at, (k_new[keep:], v_new[keep:])), target[1])
                    keys = torch.cat([pk[read_at], k_new])  # [S, Hkv, d]: positions first, ...
                    vals = torch.cat([pv[read_at], v_new])
                    if cfg.exact or not _SDPA_GQA:  # every query head its K/V head's copy: [S, Hq, d]
                        keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
                allowed = None
                if cfg.indexer_dim:
                    pik = index.kv[li]
                    if cfg.indexer_fp8:  # stored as FP8 with a scale; scored as the store holds them
                        ik = quantize_index_keys(ik_all[row : row + m]).view(m, 1, -1)
                    else:
                        ik = ik_all[row : row + m].view(m, 1, cfg.indexer_dim).to(pik.dtype)
                    put(li, into, partial(_put, (pik,), into, (ik,)), index)
                    ikeys = torch.cat([pik[slots[:start]], ik]).view(start + m, -1)
                    if cfg.indexer_fp8:
                        ikeys = dequantize_index_keys(ikeys)
                    allowed = self._select(iq_all[row : row + m], ikeys, start)
                outs.append(self._attend(q, keys, vals, start, scale, allowed, first, wlen))
                row += m
            out = torch.cat(outs)
            if self.tp_group is not None:  # every rank's heads, in head order, before the output projection
                parts = [torch.empty_like(out) for _ in range(self.tp_size)]
                dist.all_gather(parts, out.contiguous(), group=self.tp_group)
                out = torch.cat(parts, dim=1)
            x = x + mm(out.reshape(n, -1), layer["wo"])
            if cfg.recurrent_dim and li == cfg.recurrent_layer:  # beside the attention, from the same input
                x = x + self._recur(a, seqs, lens, layer, state, states, put, mm)
            x = x + mm(torch.nn.functional.gelu(mm(_rmsnorm(x), layer["w1"])), layer["w2"])
        if last_only:
            ends = torch.tensor(lens, device=self.device).cumsum(0) - 1
            return list(mm(_rmsnorm(x[ends]), self.head).split(1))
        logits = mm(_rmsnorm(x), self.head)
        return list(logits.split(lens))

    def _recur(
        self, a: torch.Tensor, seqs: list, lens: list[int], layer: dict, pool: DeviceKVPool,
        states: list[torch.Tensor | None], put: Callable[..., None], mm: Callable[..., torch.Tensor],
    ) -> torch.Tensor:  # fmt: skip
        """The recurrent branch's output ``[n, hidden]``: per channel ``h_t = decay * h_{t-1} + (1 - decay) *
        u_t`` (``u = a @ wu``, in float32, one token after another: the state after a prefix is the same
        however the prefix was split into calls), then ``h @ wy``; checkpoints written at page ends."""
        cfg, ps = self.cfg, pool.page_size
        u_all = mm(a, layer["wu"]).float()
        lam = layer["decay"]
        gain = 1.0 - lam
        rows = pool.kv[0]
        ys = []
        row = 0
        for k, ((_, start, slots), m) in enumerate(zip(seqs, lens, strict=True)):
            h = states[k]
            if h is None:
                if start % ps:
                    raise ValueError(
                        f"states: sequence {k} starts at {start}, not a page boundary, with no state given"
                    )
                h = rows[slots[start - ps : start]].reshape(-1) if start else torch.zeros_like(lam)
            for i in range(m):
                h = lam * h + gain * u_all[row + i]
                ys.append(h)
                end = start + i + 1
                if end % ps == 0:  # a page boundary: its checkpoint, spread over the page's rows
                    page = slots[end - ps : end]
                    put(0, page, partial(_put, (rows,), page, (h.view(ps, 1, -1),)), pool)
            states[k] = h
            row += m
        return mm(torch.stack(ys).to(cfg.dtype), layer["wy"])

    def _select(self, iq: torch.Tensor, ikeys: torch.Tensor, start: int) -> torch.Tensor:
        """The indexer's choice: ``[m, S]`` booleans, True where query ``i`` (position ``start + i``) may
        attend: its own token and the ``index_topk`` earlier ones whose index keys score highest (each
        query's scores one fixed-length reduction per key, so a prefix from the cache scores the same)."""
        m, s_all = len(iq), len(ikeys)
        allowed = torch.zeros(m, s_all, dtype=torch.bool, device=self.device)
        for i in range(m):
            s = start + i  # earlier tokens
            allowed[i, s] = True
            if s:
                scores = (iq[i][None] * ikeys[:s].to(iq.dtype)).sum(-1)
                allowed[i, scores.topk(min(self.cfg.index_topk, s)).indices] = True
        return allowed

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int, scale: float,
        allowed: torch.Tensor | None = None, first: int = 0, window: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """Causal attention of queries at positions ``start ..`` over ``keys``/``vals`` ``[S, H, d]`` of
        positions ``first ..`` (``H`` the query heads, or on the fast path the K/V heads, which SDPA groups
        itself); with ``allowed`` (``[m, S]``, the indexer's choice) only over the keys it allows; with a
        ``window``, a query at position ``p`` only over positions ``p - window + 1 .. p``."""
        cfg = self.cfg
        m = len(q)
        if cfg.exact:
            out = torch.empty(m, q.shape[1], cfg.head_dim, dtype=cfg.dtype, device=self.device)
            # Every reduction runs over the innermost, contiguous axis: its result per head does not depend
            # on how many heads the tensor holds (a reduction over an outer axis vectorizes across the
            # heads, and its rounding then changes with their number: TP ranks hold fewer).
            vals_t = vals.permute(1, 2, 0).contiguous()  # [H, d, S]
            for i in range(m):  # each query over exactly its own prefix: shapes independent of the batch
                s = start + i + 1 - first
                lo = max(0, s - window) if window else 0  # a windowed query's first key
                scores = (q[i][None] * keys[lo:s]).sum(-1).t().contiguous()  # [Hq, s - lo]
                if allowed is not None:
                    scores = scores.masked_fill(~allowed[i, lo:s][None], float("-inf"))
                p = torch.softmax(scores * scale, dim=-1)
                out[i] = (p[:, None, :] * vals_t[:, :, lo:s]).sum(-1)
            return out
        kw: dict = {"enable_gqa": True} if keys.shape[1] != q.shape[1] else {}
        if m > 1 or allowed is not None or window:  # a dense decode step's one query sees every key: no mask
            pos = torch.arange(first, start + m, device=self.device)[None]
            qpos = torch.arange(start, start + m, device=self.device)[:, None]
            kw["attn_mask"] = pos <= qpos
            if window:
                kw["attn_mask"] &= pos > qpos - window
            if allowed is not None:
                kw["attn_mask"] = kw["attn_mask"] & allowed
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), **kw
        ).transpose(0, 1)
