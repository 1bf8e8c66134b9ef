"""hicache quickstart: one prompt through both tiers of the cache, end to end.

A miss; the "forward pass" writes the prompt's KV and the prefix is inserted (and backed up to the
host); the device tier is evicted, so the prefix lives on the host only; a new request finds a host
hit, loads it back layer by layer and reads each layer as soon as it has landed. The loaded KV must be
bit-identical to what was written: the program exits 1 (and says where) if it is not.

Runs on a GPU (pools on CUDA, pinned host pool, the ``kernel`` io-backend: zero-copy CUDA kernels)
and without one (CPU pools, ``direct`` copies). Pools are small: a few MiB.

    python examples/hicache_quickstart.py                 # picks cuda when there is one
    python examples/hicache_quickstart.py --device cpu
    python examples/hicache_quickstart.py --io-backend triton   # GPU, or CPU with TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import sys

import torch

from hicache import DeviceKVPool, HiRadixCache, HostKVPool

NUM_LAYERS, HEAD_NUM, HEAD_DIM, PAGE_SIZE = 4, 8, 64, 16


def forward_pass_kv(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for the KV a model computes for a prompt: K and V, each ``[layers, tokens, heads, dim]``."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, num_tokens, HEAD_NUM, HEAD_DIM)
    return torch.randn(shape, generator=g).to(torch.bfloat16), torch.randn(shape, generator=g).to(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--io-backend", default=None, help="default: kernel on a GPU, direct on CPU")
    args = parser.parse_args(argv)
    on_gpu = torch.device(args.device).type == "cuda"
    io_backend = args.io_backend or ("kernel" if on_gpu else "direct")

    dev = DeviceKVPool(
        num_slots=1024, num_layers=NUM_LAYERS, head_num=HEAD_NUM, head_dim=HEAD_DIM, dtype=torch.bfloat16,
        device=args.device, page_size=PAGE_SIZE,
    )  # fmt: skip
    host = HostKVPool(dev, layout="page_first_direct", ratio=4.0)  # pinned when the device pool is on CUDA
    print(f"{dev}\n{host}\nio-backend: {io_backend}")

    prompt = list(range(1000, 1256))  # 256 tokens = 16 pages
    k, v = forward_pass_kv(len(prompt), seed=0)
    with HiRadixCache(dev, host, io_backend=io_backend, write_policy="write_through", eviction_policy="lru") as cache:
        # 1. A new prompt: nothing cached.
        m = cache.match_prefix(prompt)
        print(f"first request: device hit {len(m.device_indices)}, host hit {m.host_hit_length} of {len(prompt)}")

        # 2. Prefill: slots for the prompt, the forward pass writes its KV there, the prefix is inserted.
        #    write_through backs it up to the host at once (a copy on the controller's write thread).
        slots = dev.alloc(len(prompt))
        idx = slots.to(dev.device)
        dev.k[:, idx] = k.to(dev.device)
        dev.v[:, idx] = v.to(dev.device)
        duplicated = cache.insert(prompt, slots)  # 0: the tree owns every slot now
        cache.flush()  # a scheduler polls cache.check_writes() every step instead

        # 3. Memory pressure: the device tier is evicted; the backed-up prefix stays, on the host only.
        freed = cache.evict(dev.size)
        print(f"inserted ({duplicated} duplicated), backed up, evicted {freed} device slots")

        # 4. The same prompt again: a host hit. Load it back, start the copy, read it layer by layer.
        m = cache.match_prefix(prompt)
        print(f"second request: device hit {len(m.device_indices)}, host hit {m.host_hit_length}")
        device_slots = cache.load_back(m.last_host_node)  # None: too short, over budget or no room
        if device_slots is None:
            print("load_back was skipped", file=sys.stderr)
            return 1
        generation = cache.start_loading()
        idx = device_slots.to(dev.device)
        mismatches = []
        for layer in range(NUM_LAYERS):
            # A forward pass waits for the layer it is about to read (on a GPU: its stream waits).
            cache.controller.layer_counter.wait_until(layer, generation=generation)
            for name, pool, want in (("K", dev.k, k), ("V", dev.v, v)):
                got = pool[layer, idx].cpu()
                if not torch.equal(got, want[layer]):
                    bad = int((got != want[layer]).flatten(1).any(dim=1).sum())
                    mismatches.append(f"layer {layer} {name}: {bad} of {len(prompt)} tokens differ")
        cache.flush()  # processes the load-back's ack: the prefix is unlocked and device-resident again
        m = cache.match_prefix(prompt)
        print(f"after load-back: device hit {len(m.device_indices)}, host hit {m.host_hit_length}")
        cache.verify()
        metrics = cache.metrics.as_dict()

    for key, value in metrics.items():
        print(f"  {key}: {value:.3g}" if isinstance(value, float) else f"  {key}: {value}")
    if mismatches:
        print("MISMATCH: the KV loaded back differs from what was written:\n  " + "\n  ".join(mismatches))
        return 1
    print("OK: the KV loaded back is what was written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
