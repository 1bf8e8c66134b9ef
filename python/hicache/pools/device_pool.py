"""The layer-first device KV pool of the hierarchical cache (:class:`DeviceKVPool`), with its
page-aligned slot allocator and the owners of slots beyond a request (:class:`SlotOwner`).

It holds every layer's K and V (MHA) or latent vector (MLA) for ``size`` token slots on the GPU, in the
layer-first form attention kernels read and :mod:`hicache_kernels.ops` takes (``device_k`` /
``device_v``). The allocator hands out whole pages (``page_size`` consecutive slots: page ``p`` is slots
``[p * page_size, (p + 1) * page_size)``) and takes back only whole allocated pages; a free checks every
given slot first and changes nothing when any is wrong (``ValueError`` naming the slots and their
states). The pool also knows which allocated slots a radix tree holds (rather than a request):
:meth:`DeviceKVPool.free` refuses those, naming the tree node (:meth:`DeviceKVPool.add_owner`).
Thread-safe. Also importable from :mod:`hicache.pools`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from hicache_kernels.ops import SUPPORTED_DTYPES

from .paged_slots import _FREE, SlotState, Transition, _fmt_slots, _PagedSlots, _positive_int

__all__ = ["DeviceKVPool", "SlotOwner"]

_GIB = 1 << 30

# The device pool's slot state change (hicache.pools.paged_slots.Transition), made once.
_DEVICE_FREE = Transition(
    "free",
    (SlotState.RESERVED,),
    SlotState.FREE,
    {SlotState.FREE: "double free"},
    whole_pages=True,
)


class SlotOwner(Protocol):
    """Something that holds device slots beyond a request (a radix tree): :meth:`DeviceKVPool.free`
    refuses the slots it holds."""

    owned: np.ndarray  # bool, one per slot of the pool: True where this owner holds the slot

    def describe(self, slots: np.ndarray) -> str:
        """Who holds ``slots`` (all held by this owner), for an error message: e.g. the tree's nodes."""
        ...


class DeviceKVPool:
    """The layer-first KV pool on the GPU and its page-aligned slot allocator.

    Parameters
    ----------
    num_slots : token slots ``N``; a positive multiple of ``page_size``.
    num_layers : layers ``L``.
    head_num : KV heads ``H`` per token and layer; must be 1 for MLA.
    head_dim : elements ``D`` per head; for MLA the latent width ``kv_dim``.
    dtype : element type, one of :data:`hicache_kernels.ops.SUPPORTED_DTYPES`.
    device : where the pool lives (default ``"cuda"``); CPU pools serve tests.
    page_size : slots per page: the allocation unit (default 1).
    mla : one latent vector per token and layer (``kv``) instead of K and V.
    stacked : one ``[L, N, H, D]`` tensor per K/V (default), or, with ``False``, a list of ``L``
        separately allocated ``[N, H, D]`` tensors, as engines that allocate per layer do.

    Attributes
    ----------
    k, v : MHA pools (stacked tensor or list of layers); ``None`` for MLA.
    kv : MLA latent pool ``[L, N, 1, kv_dim]`` (or a list of ``[N, 1, kv_dim]``); ``None`` for MHA.
    size, page_size, num_layers, head_num, head_dim, dtype, device, mla, stacked : as given
        (``device`` the tensors' actual device).
    item_bytes : bytes of one token's K (or V, or latent) in one layer: ``H * D * elem_bytes``.

    Notes
    -----
    Storage is uninitialised (``torch.empty``): a slot's contents are defined once written. No slot is
    reserved as padding; an engine that needs one allocates it first.

    Examples
    --------
    >>> import torch
    >>> pool = DeviceKVPool(num_slots=32, num_layers=2, head_num=4, head_dim=8, dtype=torch.bfloat16,
    ...                     device="cpu", page_size=8)
    >>> pool.alloc(16).tolist() == list(range(16))
    True
    >>> pool.available_size()
    16
    """

    def __init__(
        self,
        *,
        num_slots: int,
        num_layers: int,
        head_num: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cuda",
        page_size: int = 1,
        mla: bool = False,
        stacked: bool = True,
    ) -> None:
        page_size = _positive_int(page_size, "page_size")
        num_slots = _positive_int(num_slots, "num_slots")
        if num_slots % page_size:
            raise ValueError(f"num_slots: {num_slots} is not a multiple of page_size {page_size}")
        num_layers = _positive_int(num_layers, "num_layers")
        head_num = _positive_int(head_num, "head_num")
        head_dim = _positive_int(head_dim, "head_dim")
        if mla and head_num != 1:
            raise ValueError(f"head_num: an MLA pool has one latent vector per token (head_num=1), got {head_num}")
        if dtype not in SUPPORTED_DTYPES:
            supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise TypeError(f"dtype: {dtype} is not supported by the transfer ops; expected one of {supported}")

        self.size = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.head_num = head_num
        self.head_dim = head_dim
        self.dtype = dtype
        self.mla = bool(mla)
        self.stacked = bool(stacked)
        self.item_bytes = head_num * head_dim * dtype.itemsize

        def make() -> torch.Tensor | list[torch.Tensor]:
            if stacked:
                return torch.empty(num_layers, num_slots, head_num, head_dim, dtype=dtype, device=device)
            return [torch.empty(num_slots, head_num, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

        self.k: torch.Tensor | list[torch.Tensor] | None
        self.v: torch.Tensor | list[torch.Tensor] | None
        self.kv: torch.Tensor | list[torch.Tensor] | None
        if self.mla:
            self.k, self.v, self.kv = None, None, make()
        else:
            self.k, self.v, self.kv = make(), make(), None
        first = self.device_k if stacked else self.device_k[0]
        self.device = first.device  # "cuda" resolves to the current device index
        self._slots = _PagedSlots(num_slots, page_size)
        # Owners of slots (add_owner) by weak reference, each with its flags' first-slot-of-page view.
        self._owners: list[tuple[weakref.ref[SlotOwner], np.ndarray]] = []
        self._free_listeners: list[Callable[[torch.Tensor], None]] = []

    @property
    def device_k(self) -> torch.Tensor | list[torch.Tensor]:
        """The pool as :mod:`hicache_kernels.ops` takes ``device_k``: K (MHA) or the latent pool (MLA)."""
        return self.kv if self.mla else self.k  # type: ignore[return-value]

    @property
    def device_v(self) -> torch.Tensor | list[torch.Tensor] | None:
        """The pool as :mod:`hicache_kernels.ops` takes ``device_v``: V (MHA) or ``None`` (MLA)."""
        return None if self.mla else self.v

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one token slot takes across all layers (K and V, or the latent)."""
        return (1 if self.mla else 2) * self.num_layers * self.item_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.size * self.bytes_per_slot

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` slots as whole pages.

        Parameters
        ----------
        num_tokens : a non-negative multiple of ``page_size`` (``ValueError`` otherwise).

        Returns
        -------
        An int64 CPU tensor of ``num_tokens`` token slots, each page's slots consecutive and in order,
        or ``None`` (and nothing allocated) when fewer than ``num_tokens`` slots are free.
        """
        return self._slots.alloc(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        """Return whole allocated pages to the pool.

        Raises ``ValueError`` (and frees nothing) for a slot out of range, repeated, not yet allocated
        (double free or never allocated), a page given only in part, or held by an owner (a radix tree
        node: the message names it; see :meth:`add_owner`): a request frees only its own slots, the tree
        frees its own when it evicts them.
        """
        self._slots.transition(_DEVICE_FREE, slots, guard=self._refuse_owned if self._owners else None)
        for listener in self._free_listeners:
            listener(slots)

    def add_free_listener(self, listener: Callable[[torch.Tensor], None]) -> None:
        """Call ``listener(slots)`` after every successful :meth:`free` (with the freed slots): a pool
        keyed by this pool's pages (:class:`~hicache.pools.window_pool.WindowKVPool`) lets go of their
        rows with them."""
        self._free_listeners.append(listener)

    def add_owner(self, owner: SlotOwner) -> None:
        """Let ``owner`` (e.g. a radix tree's :class:`~hicache.cache.slot_check.TreeDeviceSlots`) hold slots:
        :meth:`free` refuses every slot where ``owner.owned`` (one bool per slot, kept current by the
        owner; it holds whole pages) is True, naming them with ``owner.describe``. The owner releases a
        slot by clearing its flag before it frees it. Held by weak reference: an owner that is gone holds
        nothing."""
        owned = getattr(owner, "owned", None)
        if not isinstance(owned, np.ndarray) or owned.dtype != np.bool_ or owned.shape != (self.size,):
            raise TypeError(f"owner: expected an object whose owned is a bool numpy array of {self.size} slots")
        live = [(ref, first) for ref, first in self._owners if ref() is not None]
        self._owners = [*live, (weakref.ref(owner), owned[:: self.page_size])]
        self._slots.set_owned([ref().owned for ref, _ in self._owners])  # type: ignore[union-attr]

    def _refuse_owned(self, s: np.ndarray, pages: np.ndarray | None) -> None:
        """``ValueError`` when an owner holds a slot of ``s`` (checked, allocated slots about to be freed;
        ``pages``: their pages when whole and in order, so a page's first slot speaks for it)."""
        for ref, first in self._owners:
            owner = ref()
            if owner is None:
                continue
            if pages is not None and not np.count_nonzero(first[pages]):
                continue
            held = owner.owned[s]
            if np.count_nonzero(held):
                bad = s[held]
                raise ValueError(
                    f"free: slot(s) {_fmt_slots(bad)} are held by {owner.describe(bad)}; free only slots a request "
                    "holds itself (the tree frees its slots when it evicts them); no slot was changed"
                )

    def is_allocated(self, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Bool tensor: whether each of ``slots`` (default: every slot) is allocated."""
        return self._slots.states("is_allocated", slots) != SlotState.FREE

    def _state_array(self) -> np.ndarray:
        """The live slot-state bytes (uint8, one per slot, 0 = free), for the compiled tree core's
        check of inserted slots (read only, under the GIL; the array is never replaced)."""
        return self._slots._states

    def allocated_of(self, slots: np.ndarray) -> np.ndarray:
        """Bool array: whether each of ``slots`` is allocated, for a caller that has already checked them
        (an int64 numpy array inside ``[0, size)``): the per-call lookup, without the checks and the
        sort of :meth:`is_allocated`."""
        return self._slots.states_of(slots) != _FREE

    def available_size(self) -> int:
        """Free token slots."""
        return self._slots.available_size()

    def __repr__(self) -> str:
        kind = "MLA" if self.mla else "MHA"
        return (
            f"DeviceKVPool({kind}, size={self.size}, page_size={self.page_size}, L={self.num_layers}, "
            f"H={self.head_num}, D={self.head_dim}, {self.dtype}, {self.device}, "
            f"{'stacked' if self.stacked else 'per-layer'}, {self.total_bytes / _GIB:.3f} GiB)"
        )
