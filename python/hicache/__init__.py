"""hicache: a minimal hierarchical KV cache (device pool, pinned host pool, radix tree, controller)
built on the transfer ops of :mod:`hicache_kernels`."""

from .cache.radix_cache import HiRadixCache, MatchResult, TreeNode
from .controller.controller import HiCacheController, LayerDoneCounter
from .controller.copy_errors import CopyDropped, CopyError, CopyFailedOnPeer
from .controller.metrics import CacheMetrics
from .pools import DeviceKVPool, HostKVPool, SlotState, WindowKVPool
from .tree.policies import FIFO, LFU, LRU, SLRU, Priority, get_policy

__all__ = [
    "FIFO", "LFU", "LRU", "SLRU", "CacheMetrics", "CopyDropped", "CopyError", "CopyFailedOnPeer",
    "DeviceKVPool", "HiCacheController",
    "HiRadixCache", "HostKVPool", "LayerDoneCounter", "MatchResult", "Priority", "SlotState", "TreeNode",
    "WindowKVPool", "get_policy",
]  # fmt: skip
