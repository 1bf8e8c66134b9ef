"""Request namespaces: a request's ``extra_key`` (a LoRA adapter's id, a tenant's cache salt), as
SGLang's ``RadixKey`` carries it. Prefixes never match across namespaces, at any tier.

How: the tree holds a namespace's tokens as ``token + (id << 32)``, where ``id`` (>= 1) is the
namespace's number in this cache (given in order of first use, so ranks that see the same requests
agree). Token ids lie in ``[0, 2**32)`` (the storage keys' rule), so two namespaces' tokens are never
equal: they share no node on the device or on the host, and every match, insert, eviction and
load-back works unchanged. Requests without an ``extra_key`` keep their tokens as they are (namespace
0, today's keys). Once any namespace exists, a request without one is checked to hold no token id of
``2**32`` or more (it could otherwise equal a namespaced token).

Storage: the page keys of a namespace's chain start from ``SHA-256(root digest || tag)`` instead of the
root digest (the tag is the ``extra_key``'s type and value, not its number here, so every process and
every run of the same deployment keys a tenant's pages alike) and hash the tokens' low 32 bits.

The registry only grows (a handful of bytes per namespace ever seen); this class owns it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..tree.core import token_source

__all__ = ["LOW_BITS", "SHIFT", "RequestNamespaces"]

SHIFT = 32
LOW_BITS = (1 << SHIFT) - 1
_MAX_ID = (1 << (63 - SHIFT)) - 1  # ids in bits 32..62: tokens stay positive int64


def _tag(extra_key: Any) -> bytes:
    """The extra_key's identity: its type and value (``"a"`` and ``b"a"`` and ``1`` and ``"1"`` differ)."""
    if isinstance(extra_key, str):
        return b"str:" + extra_key.encode()
    if isinstance(extra_key, bytes):
        return b"bytes:" + extra_key
    if isinstance(extra_key, int) and not isinstance(extra_key, bool):
        return b"int:" + str(extra_key).encode()
    raise TypeError(f"extra_key: expected None, a str, bytes or an int, got {type(extra_key).__name__}")


def _ids(tokens: Any, when: str) -> np.ndarray:
    """``tokens`` as a 1-D integer array, every id in ``[0, 2**32)`` (``ValueError`` naming ``tokens`` and
    ``when`` the rule applies otherwise)."""
    arr = np.asarray(token_source(tokens))
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"tokens: expected a 1-D sequence of integer token ids, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.max()) > LOW_BITS or int(arr.min()) < 0):
        raise ValueError(f"tokens: token ids must lie in [0, 2**32) {when}")
    return arr


class RequestNamespaces:
    """``extra_key`` -> the tokens the tree holds, and the storage chain's root (module docstring)."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}
        self._tags: list[bytes | None] = [None]  # by id; 0 = no extra_key

    def __len__(self) -> int:
        """Namespaces seen, besides the default one."""
        return len(self._tags) - 1

    def id_of(self, extra_key: Any) -> int:
        """The namespace number of ``extra_key`` (0 for None), registered on first use."""
        if extra_key is None:
            return 0
        tag = _tag(extra_key)
        ns = self._ids.get(tag)
        if ns is None:
            ns = len(self._tags)
            if ns > _MAX_ID:
                raise ValueError(f"extra_key: more than {_MAX_ID} namespaces")
            self._ids[tag] = ns
            self._tags.append(tag)
        return ns

    def tokens(self, tokens: Any, extra_key: Any) -> Any:
        """The tokens the tree holds for ``tokens`` in ``extra_key``'s namespace: ``tokens`` themselves
        for None (checked only once a namespace exists), else a new int64 array. ``ValueError`` naming
        ``tokens`` for an id outside ``[0, 2**32)``; ``TypeError`` naming ``extra_key`` for its type."""
        if extra_key is None:
            if len(self._tags) > 1:
                _ids(tokens, "when request namespaces are in use")
            return tokens
        ns = self.id_of(extra_key)
        return _ids(tokens, "with an extra_key").astype(np.int64) + (ns << SHIFT)

    def of_token(self, token: int) -> int:
        """The namespace number a held token belongs to (``ValueError`` for an unknown one: a token id
        of 2**32 or more given without an extra_key while no namespace existed)."""
        ns = int(token) >> SHIFT
        if not 0 <= ns < len(self._tags):
            raise ValueError(f"tokens: token id {int(token)} belongs to no request namespace")
        return ns

    def root_digest(self, base_hex: str, ns: int) -> str:
        """The storage chain's root for namespace ``ns``: the tier's ``base_hex`` for 0."""
        if ns == 0:
            return base_hex
        tag = self._tags[ns]
        return hashlib.sha256(bytes.fromhex(base_hex) + b"hicache-extra-key|" + tag).hexdigest()

    @staticmethod
    def key_tokens(tokens: Any, ns: int) -> list[int]:
        """The token ids a storage key hashes: the held tokens' low 32 bits."""
        ids = list(tokens)
        return ids if ns == 0 else [int(t) & LOW_BITS for t in ids]
