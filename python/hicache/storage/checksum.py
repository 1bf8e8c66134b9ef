"""The payload checksum of the file backend's page objects.

Definition: read the payload as little-endian 64-bit words ``w_0, w_1, ...`` (the last one padded
with zero bytes); the checksum is ``finish(sum_i mix(w_i XOR (i * K1)) mod 2**64, length)`` with
``mix(x) = y XOR (y >> 31)`` for ``y = x * K2 mod 2**64``, and ``finish`` folding in the byte length.
The word index makes swapped or shifted words count; each word goes through a multiply, so a flipped
bit changes the sum unpredictably. It detects torn, truncated and corrupted pages (it is not a defence
against someone forging pages: the store is trusted).

Why not CRC-32: ``zlib.crc32`` runs at about 7 GB/s on one core here, which made a batch read of
pages from the page cache half as fast as a plain read of the same bytes. The words are independent,
so the compiled version (``hicache._core.checksum_words``) runs at memory speed, and a page
checked chunk by chunk, right after each chunk is read, costs no second pass over memory. Without
the host core (a package that was not built: :func:`hicache.native.core_status` says why), a numpy
version computes the same value (slower).
"""

from __future__ import annotations

import numpy as np

from ..native import core_attr

__all__ = ["PageChecksum", "checksum", "finish"]

K1 = 0x9E3779B97F4A7C15
K2 = 0xBF58476D1CE4E5B9
K3 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def _numpy_words(data: memoryview, first: int, total: int) -> int:
    w = np.frombuffer(data, dtype="<u8")
    with np.errstate(over="ignore"):
        idx = np.arange(first, first + w.size, dtype=np.uint64)
        x = (w ^ (idx * np.uint64(K1))) * np.uint64(K2)
        x ^= x >> np.uint64(31)
        return (total + int(x.sum(dtype=np.uint64))) & _MASK


_compiled = core_attr("checksum_words")
# pread_checksum(fd, offset, buffers, first_word, sum, chunk) -> (bytes read, sum): a page read and
# checksummed chunk by chunk in one call without the GIL (buffers of whole words); None without it.
pread_checksum = core_attr("pread_checksum")


def _words(data: memoryview, first: int, total: int) -> int:
    if _compiled is not None:
        return _compiled(data, first, total)
    return _numpy_words(data, first, total)


class PageChecksum:
    """The checksum of a byte stream fed in pieces (``update``), e.g. a page's memory ranges, each
    right after it is read. ``value()`` is the checksum of everything fed so far."""

    __slots__ = ("_carry", "_length", "_sum", "_words")

    def __init__(self) -> None:
        self._sum = 0
        self._words = 0
        self._length = 0
        self._carry = b""  # the bytes of a word split between pieces

    def update(self, data: memoryview | bytes | bytearray) -> PageChecksum:
        view = memoryview(data).cast("B")
        self._length += len(view)
        if self._carry:
            take = 8 - len(self._carry)
            self._carry += bytes(view[:take])
            view = view[take:]
            if len(self._carry) < 8:
                return self
            self._feed(memoryview(self._carry))
            self._carry = b""
        whole = len(view) - len(view) % 8
        if whole:
            self._feed(view[:whole])
        if whole < len(view):
            self._carry = bytes(view[whole:])
        return self

    def _feed(self, words: memoryview) -> None:
        self._sum = _words(words, self._words, self._sum)
        self._words += len(words) // 8

    def value(self) -> int:
        total, words = self._sum, self._words
        if self._carry:
            total = _words(memoryview(self._carry.ljust(8, b"\0")), words, total)
        return finish(total, self._length)


def finish(total: int, length: int) -> int:
    """The checksum from the sum over the words and the byte length (what ``value`` returns)."""
    x = (total ^ (length * K3)) & _MASK
    x ^= x >> 33
    x = (x * K2) & _MASK
    return x ^ (x >> 29)


def checksum(*pieces: memoryview | bytes | bytearray) -> int:
    """The checksum of the concatenation of ``pieces``."""
    c = PageChecksum()
    for p in pieces:
        c.update(p)
    return c.value()
