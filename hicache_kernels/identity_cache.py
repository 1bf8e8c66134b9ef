"""Caches of values derived from live arguments, found again by the arguments' identity: the ops'
pool bindings (:func:`hicache_kernels.binding.bound_pools`) and compat's routes
(:mod:`hicache_kernels.compat`).

An entry is found again after O(1) checks per argument (:class:`_Same`): a tensor's ``data_ptr``,
shape, strides and dtype; a list's elements' identities and its first element's metadata; and, for an
argument whose *contents* the value was derived from (an sgl-kernel pointer table), those contents.
The cache holds no argument: an entry goes when any tensor among its arguments dies.
"""

from __future__ import annotations

import array
import ctypes
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ._ext import optional_attr

# None in a pure-Python build: the tuple-of-ids comparison below does the same.
_same_items = optional_attr("same_items")


def _contents_reader(t: torch.Tensor, count: int) -> Callable[[torch.Tensor], bytes]:
    """A function giving the first ``count`` items of a CPU tensor shaped and strided like ``t`` as
    bytes, read straight from its memory (~0.2 us for a contiguous 61-entry table)."""
    if t.is_contiguous():
        raw = ctypes.c_char * (count * t.element_size())
        return lambda x: raw.from_address(x.data_ptr()).raw
    return lambda x: x.reshape(-1)[:count].contiguous().view(torch.uint8).numpy().tobytes()


class _Same:
    """Whether an argument (a tensor, a list of tensors, or None) is still the one a cache entry was
    made for: the tensor's metadata, or for a list, every element's identity and the first's metadata.
    Identity itself comes from the cache key (ids of objects the entry outlives only while they live).

    ``contents`` (a tensor argument whose first ``contents`` items the entry was derived from, e.g. a
    pointer table's layer addresses): a CPU tensor's items are compared on every lookup, so a rewrite
    that bumps no in-place version (a numpy or DLPack alias, ``.data``, a C extension) is seen. A CUDA
    tensor's are not (reading them would synchronise the host with the stream on every call): its
    in-place version stands for them, so a rewrite outside torch's in-place ops must bump it
    (``torch.autograd.graph.increment_version``).
    """

    __slots__ = ("contents", "dtype", "ids", "packed", "ptr", "read", "shape", "stride", "version")

    def __init__(self, arg: Any, contents: int = 0) -> None:
        self.ids = None if arg is None or isinstance(arg, torch.Tensor) else tuple(map(id, arg))
        # The ids packed for the extension's one-pass check (_C.same_items): a 61-layer list costs
        # ~0.3 us instead of ~2 us for an int object per item.
        self.packed = None if self.ids is None or _same_items is None else array.array("Q", self.ids).tobytes()
        first = None if arg is None else (arg if self.ids is None else arg[0])
        self.ptr = None if first is None else first.data_ptr()
        self.shape = None if first is None else first.shape
        self.stride = None if first is None else first.stride()
        self.dtype = None if first is None else first.dtype
        self.version = self.read = self.contents = None
        if contents and first is not None:
            if first.device.type == "cpu":
                self.read = _contents_reader(first, contents)
                self.contents = self.read(first)
            else:
                self.version = first._version

    def __call__(self, arg: Any) -> bool:
        if arg is None:
            return self.ptr is None
        if self.ids is not None:
            # The key holds id(arg[0]) and len(arg); every element must be the one seen (ids are unique
            # among live objects, and the entry goes when any of them dies): one C-level pass.
            if self.packed is not None:
                if not _same_items(arg, self.packed):
                    return False
            elif type(arg) not in (list, tuple) or tuple(map(id, arg)) != self.ids:
                return False
            arg = arg[0]
        return (
            arg.data_ptr() == self.ptr
            and arg.stride() == self.stride
            and arg.shape == self.shape
            and arg.dtype is self.dtype
            and (self.version is None or arg._version == self.version)
            and (self.read is None or self.read(arg) == self.contents)  # same layout: read like the first
        )


def arg_key(arg: Any) -> Any:
    """The part of a cache key that names an argument: a tensor's id; for a list or tuple of tensors,
    its first element's id and its length (not the list's own id: the custom ops, and many callers,
    build a new list on every call); None for None."""
    if isinstance(arg, torch.Tensor):
        return id(arg)
    if type(arg) in (list, tuple):
        return ("items", id(arg[0]), len(arg)) if arg else ("empty",)
    return None if arg is None else ("other", id(arg))


class _Entry:
    __slots__ = ("checks", "finalizers", "value")

    def __init__(self, value: Any, checks: tuple[_Same, ...]) -> None:
        self.value = value
        self.checks = checks
        self.finalizers: list[weakref.finalize] = []


class IdentityCache:
    """Values derived from live arguments, found again by the arguments' identity after O(1) checks
    (:class:`_Same`) and dropped when any tensor among the arguments dies. Holds no argument: a value
    must not reference the tensors it was derived from."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: entries are forgotten from finalizers, run anywhere
        self._entries: dict[tuple, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple, args: tuple) -> Any:
        """The value stored for ``key`` if ``args`` are still what it was made from, else None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        for same, arg in zip(entry.checks, args, strict=True):
            if not same(arg):
                return None
        return entry.value

    def put(self, key: tuple, args: tuple, value: Any, contents: tuple[int, ...] = ()) -> None:
        """Store ``value`` for ``key`` (made from ``args``; ``contents[i]`` > 0: the value depends on the
        first ``contents[i]`` items of the tensor ``args[i]``, so a lookup finding other items there
        misses, see :class:`_Same`)."""
        counts = contents or (0,) * len(args)
        entry = _Entry(value, tuple(_Same(a, n) for a, n in zip(args, counts, strict=True)))
        owners = [t for a in args if a is not None for t in ((a,) if isinstance(a, torch.Tensor) else a)]
        with self._lock:
            old = self._entries.get(key)
            if old is not None:
                self._forget(key, old)
            self._entries[key] = entry
            for obj in owners:
                f = weakref.finalize(obj, self._forget, key, entry)
                f.atexit = False
                entry.finalizers.append(f)

    def _forget(self, key: tuple, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]
            for f in entry.finalizers:
                f.detach()
            entry.finalizers.clear()  # no cycle through the finalizers: the entry (and its device tables) go now
