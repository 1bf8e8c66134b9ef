"""The radix tree under the cache: its nodes, its two cores, eviction policies and candidates.

- :mod:`.nodes`: :class:`~hicache.tree.nodes.TreeNode` (the Python core's nodes) and read-only walks.
- :mod:`.core`: the compiled core (``hicache._core.RadixTree``) and its node handles; which core a
  cache takes (``HICACHE_TREE_CORE``).
- :mod:`.policies`: eviction policies (``lru``, ``lfu``, ``slru``, ``fifo``, ``priority``, or your own).
- :mod:`.candidates`: each tier's eviction candidates, kept as nodes change (Python or compiled heap).
"""
