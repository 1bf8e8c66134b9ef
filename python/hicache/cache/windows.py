"""Matches cut where the sliding-window layers' rows stop being whole (a cache with a
:class:`~hicache.pools.window_pool.WindowKVPool`).

A cached prefix of a sliding-window model can be resumed at position ``p`` only if the ``window - 1``
tokens before ``p`` have their window rows, on the device or in their host copy. :class:`WindowCut`
reads the path a match would take without changing the tree (:func:`hicache.tree.nodes.match_path`,
on either core), finds the longest usable prefix from each page's rows, and lets the match run only
that far: nodes past it stay in the tree (their full layers' KV is good, a longer prefix with a whole
window may still use them) but this request does not use them. The walk costs O(the match's nodes);
without a window pool the cache never calls it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..pools.window_pool import WindowKVPool
from ..tree.nodes import match_path, page_key

__all__ = ["WindowCut"]


class WindowCut:
    """Where a match of ``tokens`` must stop for its windows to be whole (module docstring)."""

    def __init__(self, tree: Any, window: WindowKVPool) -> None:
        self.tree = tree
        self.window = window
        self.page_size = window.page_size

    def usable(self, tokens: Any) -> tuple[int, int]:
        """``(usable, matched)``: the tokens of ``tokens``' cached prefix whose windows are whole, and the
        tokens it matches in the tree (device and host, up to a lost node), page-aligned."""
        ps, window = self.page_size, self.window
        key = page_key(tokens, ps)
        path, matched, cut = match_path(self.tree.root, key, ps)
        present: list[np.ndarray] = []
        total = 0
        lost = self.tree.lost
        for i, node in enumerate(path):
            if lost and node.id in lost:
                break
            n = cut if (cut and i == len(path) - 1) else len(node.key)
            if node.value is not None:
                present.append(window.has_rows(node.value[:n]))
            elif node.host_value is not None:
                present.append(window.host_has_rows(node.host_value[:n]))
            else:
                break
            total += n
        rows = np.concatenate(present) if present else np.zeros(0, dtype=bool)
        return window.usable(rows), total

    def device_slots(self, tokens: Any) -> torch.Tensor:
        """The device slots of ``tokens``' cached prefix, as far as it is on the device (no lock, no
        touch, no count: a read of the tree)."""
        path, _, cut = match_path(self.tree.root, page_key(tokens, self.page_size), self.page_size)
        out = []
        for i, node in enumerate(path):
            if node.value is None:
                break
            out.append(node.value[: cut if (cut and i == len(path) - 1) else len(node.key)])
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def rows_to_load(self, node: Any) -> int:
        """Tokens of window rows a load-back of ``node`` would bring (its host-only path's pages whose
        host copy carries rows): what it takes from the window pool."""
        pages = 0
        while node is not self.tree.root and node.value is None and node.host_value is not None:
            pages += int(self.window.host_has_rows(node.host_value).sum())
            node = node.parent
        return pages * self.page_size
