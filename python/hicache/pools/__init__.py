"""KV pools of the hierarchical cache: the layer-first device pool (:mod:`hicache.pools.device_pool`) and
the pinned host pool (:mod:`hicache.pools.host_pool`), both importable from here, with the
sliding-window layers' pool (:class:`WindowKVPool`, :mod:`hicache.pools.window_pool`).

:class:`DeviceKVPool` holds every layer's K and V (MHA) or latent vector (MLA) for ``size`` token
slots on the GPU, in the layer-first form attention kernels read and :mod:`hicache_kernels.ops`
takes (``device_k`` / ``device_v``), plus a page-aligned slot allocator.

:class:`HostKVPool` holds a larger pinned copy in one of the host layouts of
:mod:`hicache_kernels.layouts` (``buffer``), its own page-aligned allocator, and a per-slot state
that the cache controller drives while a backup (device -> host) or load-back (host -> device) is in
flight::

    FREE --alloc--> RESERVED --mark_writing--> WRITING --mark_synced--> SYNCED
    WRITING --abort_write--> RESERVED  (the backup failed or was dropped: no valid data)
    SYNCED --mark_loading--> LOADING --mark_synced--> SYNCED  (also when a load failed: data stays valid)
    RESERVED / SYNCED --free--> FREE

Both allocators hand out whole pages (``page_size`` consecutive slots: page ``p`` is slots
``[p * page_size, (p + 1) * page_size)``) and take back only whole allocated pages. Every state change
checks every given slot first and changes nothing when any is wrong (``ValueError`` naming the method,
the slots and their states), so a controller bug surfaces at the call that made it, not as corrupted
KV data later. The device pool also knows which allocated slots a radix tree holds (rather than a
request): :meth:`DeviceKVPool.free` refuses those, naming the tree node (:meth:`DeviceKVPool.add_owner`).
All methods are thread-safe: the controller's transfer threads and the scheduler share the pools.

Units: slots are token slots (not pages, not bytes); ``*_bytes`` are bytes; ``*_gb`` arguments are
GiB (2**30 bytes).

Examples
--------
>>> import torch
>>> from hicache.pools import DeviceKVPool, HostKVPool
>>> from hicache_kernels import ops
>>> dev = DeviceKVPool(num_slots=64, num_layers=2, head_num=2, head_dim=8, dtype=torch.float16,
...                    device="cpu", page_size=4)
>>> host = HostKVPool(dev, layout="page_first_direct", ratio=2.0)
>>> d, h = dev.alloc(8), host.alloc(8)
>>> host.mark_writing(h)
>>> ops.backup_all_layers(dev.device_k, dev.device_v, host.buffer, d, h, layout=host.layout,
...                       page_size=host.page_size, backend="direct")
>>> host.mark_synced(h)
>>> host.state(h[:2]).tolist() == [SlotState.SYNCED] * 2
True
"""

from __future__ import annotations

from .device_pool import DeviceKVPool, SlotOwner
from .host_pool import HostKVPool
from .paged_slots import SlotState
from .window_pool import WindowKVPool

__all__ = ["DeviceKVPool", "HostKVPool", "SlotOwner", "SlotState", "WindowKVPool"]
