"""The hierarchical radix cache, :class:`~hicache.cache.radix_cache.HiRadixCache`, and its components.

- :mod:`.radix_cache`: the cache's public face (match, insert, evict, load back, write policies).
- :mod:`.cache_tree`: the tree it holds (either tree core) with the per-tier candidates and slot owners.
- :mod:`.lookups`: prefix matches and what they hit on each tier.
- :mod:`.eviction`: device and host eviction through the candidates, never a walk of the tree.
- :mod:`.copy_acks`: backups started, the controller's acks processed, failed copies rolled back.
- :mod:`.load_backs`: host copies brought back to the device, layer by layer.
- :mod:`.storage_ops`: the storage tier seen from the tree (backups to storage, prefetches).
- :mod:`.slot_check`: the device slots the tree owns, and the check of the slots an insert brings.
- :mod:`.invariants`: the whole-tree consistency check (``HiRadixCache.verify``, tests only).
"""
