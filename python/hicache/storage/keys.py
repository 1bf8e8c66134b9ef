"""Page keys of the storage tier: a SHA-256 hash chain over token ids, rooted in a namespace digest.

A page's key is ``SHA-256(previous page's digest || this page's token ids as little-endian uint32)``.
The first page of a sequence chains from the :class:`Namespace` digest (or from ``prev_digest``, the
digest of the page before when continuing a sequence), so a key names the page's whole prefix *and*
everything its bytes depend on: model, dtype, geometry, the stored objects' format and an optional salt.
Two deployments that differ in any of these never compute the same key, so they never read each other's
bytes even when they share a store. The TP size is never in it: an MHA page is stored as head groups
(:mod:`hicache.storage.objects`) that every TP size reads alike, and an MLA page is the same on every rank.

Examples
--------
>>> ns = Namespace(model_id="m", dtype="float16", num_layers=2, head_num=2, head_dim=8, page_size=2,
...                layout="page_first")
>>> keys = page_keys([1, 2, 3, 4, 5], 2, namespace=ns)  # the trailing partial page has no key
>>> len(keys), len(keys[0])
(2, 64)
>>> page_keys([3, 4], 2, prev_digest=keys[0]) == keys[1:]
True
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Namespace", "page_keys"]

DIGEST_BYTES = 32


@dataclass(frozen=True)
class Namespace:
    """Everything the bytes of a stored page depend on; :attr:`digest` names it.

    Parameters
    ----------
    model_id : the model (name and revision, or a weights hash): different weights, different KV.
    dtype : element type of the KV (e.g. ``"bfloat16"``).
    num_layers, head_num, head_dim, page_size : pool geometry (``head_num`` per TP shard).
    layout : host layout; it decides the byte order of an MLA page object (MHA objects are head-major
        whatever the layout, so it is left out of their digest).
    mla : MLA pool: pages are the same on every TP rank and only rank 0 writes (:attr:`writer`).
    tp_rank, tp_size : the shard of an MHA pool sharded over heads (``head_num`` each, the model's
        ``head_num * tp_size`` in all). Never in the digest.
    head_group : K/V heads per stored MHA object (:mod:`hicache.storage.objects`); deployments share
        pages only with the same group size. Ignored for MLA.
    salt : optional; deployments with different salts never share pages (e.g. tenants).
    sidecars : one description per sidecar pool stored with each page (its dtype, row elements and host
        layout, :func:`sidecar_description`); a page stored with sidecars is never read without them, or
        with others. Left out of the digest when empty (the digests of pools without sidecars stay).
    """

    model_id: str
    dtype: str
    num_layers: int
    head_num: int
    head_dim: int
    page_size: int
    layout: str
    mla: bool = False
    tp_rank: int = 0
    tp_size: int = 1
    salt: str | None = None
    head_group: int = 1
    sidecars: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size={self.tp_size}, got {self.tp_rank}")
        if isinstance(self.head_group, bool) or not isinstance(self.head_group, int) or self.head_group < 1:
            raise ValueError(f"head_group: expected a positive int, got {self.head_group!r}")
        if not self.mla and self.head_num % self.head_group:
            raise ValueError(
                f"head_group: {self.head_group} heads per stored object do not divide this rank's {self.head_num} "
                f"K/V heads (the model's {self.head_num * self.tp_size} over TP={self.tp_size}); choose a divisor "
                f"of {self.head_num}"
            )

    @classmethod
    def for_pool(cls, host_pool: object, model_id: str, **kwargs: object) -> Namespace:
        """The namespace of a :class:`hicache.pools.HostKVPool`; ``kwargs`` give ``tp_rank``, ``tp_size``,
        ``salt``, ``head_group``."""
        p = host_pool
        return cls(
            model_id=model_id,
            dtype=str(p.dtype).removeprefix("torch."),  # type: ignore[attr-defined]
            num_layers=p.num_layers,  # type: ignore[attr-defined]
            head_num=p.head_num,  # type: ignore[attr-defined]
            head_dim=p.head_dim,  # type: ignore[attr-defined]
            page_size=p.page_size,  # type: ignore[attr-defined]
            layout=p.layout,  # type: ignore[attr-defined]
            mla=p.mla,  # type: ignore[attr-defined]
            **kwargs,  # type: ignore[arg-type]
        )

    @property
    def writer(self) -> bool:
        """Whether this rank writes pages: every rank of a sharded MHA pool, only rank 0 for MLA."""
        return not self.mla or self.tp_rank == 0

    @property
    def kv_heads(self) -> int:
        """The model's K/V heads (over all TP ranks); 1 for MLA."""
        return self.head_num * (1 if self.mla else self.tp_size)

    @property
    def digest(self) -> bytes:
        """SHA-256 of the canonical JSON of what the stored bytes depend on; 32 bytes. Never the TP shard:
        MLA pages are the same on every rank, MHA objects are head groups of the model's ``kv_heads``
        (in place of the per-rank ``head_num``), head-major whatever the host ``layout``."""
        fields = asdict(self)
        for name in ("tp_rank", "tp_size"):
            fields.pop(name)
        if not self.sidecars:
            fields.pop("sidecars")
        else:
            fields["sidecars"] = list(self.sidecars)
        if self.mla:
            fields.pop("head_group")
        else:
            fields.pop("layout")
            fields["head_num"] = self.kv_heads
            fields["objects"] = "head-groups"
        blob = json.dumps({"hicache-namespace": 2, **fields}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).digest()


def window_description(window: object) -> str:
    """What a window pool's stored rows depend on: ``"window<W>:"`` and its host pool's description."""
    return f"window{window.window}:" + sidecar_description(window.host)  # type: ignore[attr-defined]


def sidecar_description(host_pool: object) -> str:
    """What a sidecar host pool's stored bytes depend on: ``"<dtype>:<layers>x<heads>x<head_dim>@<layout>"``."""
    p = host_pool
    dtype = str(p.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
    return f"{dtype}:{p.num_layers}x{p.head_num}x{p.head_dim}@{p.layout}"  # type: ignore[attr-defined]


def _digest_bytes(value: bytes | str, name: str) -> bytes:
    raw = bytes.fromhex(value) if isinstance(value, str) else bytes(value)
    if len(raw) != DIGEST_BYTES:
        raise ValueError(f"{name}: expected a {DIGEST_BYTES}-byte digest (or its hex), got {len(raw)} bytes")
    return raw


def page_keys(
    tokens: Sequence[int] | np.ndarray,
    page_size: int,
    prev_digest: bytes | str | None = None,
    *,
    namespace: Namespace | None = None,
) -> list[str]:
    """Keys of the whole pages of ``tokens``, as 64-character hex strings.

    Parameters
    ----------
    tokens : token ids (each in ``[0, 2**32)``); a trailing partial page gets no key.
    page_size : tokens per page.
    prev_digest : digest (bytes or hex) of the page before ``tokens[0]``, to continue a chain (a tree node
        continues its parent's); None starts a sequence from the namespace.
    namespace : the root of a new chain (its :attr:`Namespace.digest`); None: 32 zero bytes. Ignored
        when ``prev_digest`` is given (the chain already carries it).

    Returns
    -------
    ``len(tokens) // page_size`` keys; key ``i`` depends on every token of pages ``0..i`` and the root.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(f"tokens: expected a 1-D sequence of ints, got {ids.dtype} of shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("tokens: token ids must lie in [0, 2**32)")
    if prev_digest is not None:
        prev = _digest_bytes(prev_digest, "prev_digest")
    else:
        prev = namespace.digest if namespace is not None else bytes(DIGEST_BYTES)
    n = ids.size // page_size
    data = ids[: n * page_size].astype("<u4").tobytes()
    step = 4 * page_size
    keys = []
    for i in range(n):
        prev = hashlib.sha256(prev + data[i * step : (i + 1) * step]).digest()
        keys.append(prev.hex())
    return keys
