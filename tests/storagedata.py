"""Host pools of random bytes and each page's bytes by reference indexing, for the storage backends'
tests (the file backend's and the mooncake backend's)."""

from __future__ import annotations

import torch

from hicache.pools import DeviceKVPool, HostKVPool

from kvdata import random_bytes_

PAGE = 4


def host_pool(layout: str = "page_first", mla: bool = False, seed: int = 0, head_dim: int = 8,
              num_layers: int = 3) -> HostKVPool:  # fmt: skip
    """A bf16 host pool (``PAGE``-token pages) filled with random bytes."""
    dev = DeviceKVPool(
        num_slots=32, num_layers=num_layers, head_num=1 if mla else 2, head_dim=head_dim, dtype=torch.bfloat16,
        device="cpu", page_size=PAGE, mla=mla,
    )  # fmt: skip
    host = HostKVPool(dev, layout=layout, ratio=4.0)
    random_bytes_(host.buffer, torch.Generator().manual_seed(seed))
    return host


def page_bytes(host: HostKVPool, slots: torch.Tensor) -> list[bytes]:
    """Each page's bytes gathered by tensor indexing through the layout (independent of page_ranges)."""
    out = []
    for p in range(0, len(slots), PAGE):
        s = slots[p : p + PAGE]
        parts = []
        for kv in range(1 if host.mla else 2):
            t = host.buffer if host.mla else host.buffer[kv]
            if host.layout == "layer_first":
                parts += [t[layer, s].contiguous() for layer in range(host.num_layers)]
            elif host.layout == "page_first":
                parts.append(t[s].contiguous())
            else:  # page_first_direct and page_head: one page index
                parts.append(t[int(s[0]) // PAGE].contiguous())
        out.append(b"".join(x.view(torch.uint8).numpy().tobytes() for x in parts))
    return out
