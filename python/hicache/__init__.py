"""hicache: a minimal hierarchical KV cache (device pool, pinned host pool, radix tree, controller)
built on the transfer ops of :mod:`hicache_kernels`."""

from .controller import HiCacheController, LayerDoneCounter
from .copy_errors import CopyDropped, CopyError, CopyFailedOnPeer
from .metrics import CacheMetrics
from .policies import FIFO, LFU, LRU, SLRU, Priority, get_policy
from .pools import DeviceKVPool, HostKVPool, SlotState
from .radix_cache import HiRadixCache, MatchResult, TreeNode

__all__ = [
    "FIFO", "LFU", "LRU", "SLRU", "CacheMetrics", "CopyDropped", "CopyError", "CopyFailedOnPeer",
    "DeviceKVPool", "HiCacheController",
    "HiRadixCache", "HostKVPool", "LayerDoneCounter", "MatchResult", "Priority", "SlotState", "TreeNode", "get_policy",
]  # fmt: skip
