"""Host pools of random bytes and each page's bytes by reference indexing, for the storage backends'
tests (the file backend's and the mooncake backend's); a fake Mooncake Store client."""

from __future__ import annotations

import ctypes
import socket
import sys
import threading
import types

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


def object_bytes(host: HostKVPool, slots: torch.Tensor, head_group: int = 1, first_group: int = 0) -> list[bytes]:
    """The stored objects of each page of ``slots`` as the storage tier writes them (MLA: the page's
    bytes; MHA: one object per group of ``head_group`` heads, head-major ``[K|V, head, token, layer, D]``),
    page by page, by tensor indexing through the layout (independent of
    :class:`hicache.storage.objects.StoredObjects`); ``first_group`` only names the groups' order."""
    if host.mla:
        return page_bytes(host, slots)
    L, H, D = host.num_layers, host.head_num, host.head_dim
    out = []
    for p in range(0, len(slots), PAGE):
        s = slots[p : p + PAGE]
        page = int(s[0]) // PAGE
        if host.layout == "layer_first":  # [2, L, N, H, D] -> [2, H, token, L, D]
            kv = host.buffer[:, :, s].permute(0, 3, 2, 1, 4)
        elif host.layout == "page_first":  # [2, N, L, H, D]
            kv = host.buffer[:, s].permute(0, 3, 1, 2, 4)
        elif host.layout == "page_first_direct":  # [2, P, L, page, H, D]
            kv = host.buffer[:, page].permute(0, 3, 2, 1, 4)
        else:  # page_head: [2, P, H, page, L, D]
            kv = host.buffer[:, page]
        assert tuple(kv.shape) == (2, H, PAGE, L, D)
        for g in range(H // head_group):
            out.append(kv[:, g * head_group : (g + 1) * head_group].contiguous().view(torch.uint8).numpy().tobytes())
    return out


# -- a fake Mooncake Store client ------------------------------------------------------------------------
OBJECT_NOT_FOUND = -704


class Stall:
    """Makes the next batch get or put of a :class:`FakeMooncake` wait, before it touches the host memory,
    until ``release`` is set; ``done`` is set once that call has moved its bytes."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.done = threading.Event()


class FakeMooncake:
    """A stand-in for the Mooncake Store client (``mooncake.store``), installed in ``sys.modules`` by
    :meth:`install`: every client of it shares one store (``objects``), and the batch methods move the
    bytes between the registered host memory and that store with ``ctypes``, as the real client does
    (``puts`` keeps every object a put read, removed or not). A ``MooncakeBackend`` built on it needs a
    listening "master" socket, which :meth:`install` opens."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.puts: dict[str, bytes] = {}
        self.stalls: dict[str, Stall] = {}
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"

    def install(self, monkeypatch) -> FakeMooncake:
        fake = self

        class ReplicateConfig:
            replica_num = 1

        class Store:
            def setup(self, *args) -> int:
                return 0

            def register_buffer(self, addr: int, nbytes: int) -> int:
                return 0

            def unregister_buffer(self, addr: int) -> int:
                return 0

            def health_check(self) -> int:
                return 0

            def close(self) -> None:
                pass

            def batch_is_exist(self, keys):
                return [int(k in fake.objects) for k in keys]

            def remove(self, key: str) -> int:
                return 0 if fake.objects.pop(key, None) is not None else OBJECT_NOT_FOUND

            def batch_get_into_multi_buffers(self, keys, addrs, sizes):
                stall = fake._stall("get")
                out = []
                for key, a, n in zip(keys, addrs, sizes, strict=True):
                    data = fake.objects.get(key)
                    if data is None or len(data) != sum(n):
                        out.append(OBJECT_NOT_FOUND if data is None else -1)
                        continue
                    pos = 0
                    for addr, size in zip(a, n, strict=True):
                        ctypes.memmove(addr, data[pos : pos + size], size)
                        pos += size
                    out.append(pos)
                if stall is not None:
                    stall.done.set()
                return out

            def batch_put_from_multi_buffers(self, keys, addrs, sizes, config):
                stall = fake._stall("put")
                for key, a, n in zip(keys, addrs, sizes, strict=True):
                    fake.puts[key] = fake.objects[key] = b"".join(
                        ctypes.string_at(addr, size) for addr, size in zip(a, n, strict=True)
                    )
                if stall is not None:
                    stall.done.set()
                return [0] * len(keys)

            def batch_get_into(self, keys, addrs, sizes):
                return self.batch_get_into_multi_buffers(keys, [[a] for a in addrs], [[n] for n in sizes])

            def batch_put_from(self, keys, addrs, sizes, config):
                return self.batch_put_from_multi_buffers(keys, [[a] for a in addrs], [[n] for n in sizes], config)

        store = types.ModuleType("mooncake.store")
        store.MooncakeDistributedStore = Store
        store.ReplicateConfig = ReplicateConfig
        package = types.ModuleType("mooncake")
        package.__path__ = []
        package.store = store
        monkeypatch.setitem(sys.modules, "mooncake", package)
        monkeypatch.setitem(sys.modules, "mooncake.store", store)
        return self

    def stall(self, method: str) -> Stall:
        """Stall the next batch ``"get"`` or ``"put"``."""
        self.stalls[method] = s = Stall()
        return s

    def _stall(self, method: str) -> Stall | None:
        s = self.stalls.pop(method, None)
        if s is not None:
            assert s.release.wait(60), "the test never released a stalled call"
        return s

    def backend(self, **kw):
        from hicache.storage.mooncake import MooncakeBackend

        return MooncakeBackend(self.address, local_hostname="127.0.0.1", **kw)

    def close(self) -> None:
        self._sock.close()
