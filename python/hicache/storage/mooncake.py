"""The ``mooncake`` storage backend: page objects in a Mooncake Store (the distributed KV store of SGLang
deployments), through its Python client ``mooncake.store.MooncakeDistributedStore``.

One Mooncake object per stored object (a page; through the storage tier, a page's head group:
:mod:`hicache.storage.objects`), under its key, holding its bytes in the order of its memory ranges (the
same bytes as every other backend's object, ``page_bytes`` long). :meth:`~MooncakeBackend.attach`
registers the host pool's buffer (and the tier's staging areas) with the client, and the batch
methods move pages straight between that buffer and the store: ``batch_put_from`` / ``batch_get_into``
when every page of the batch is one range (``page_first`` and friends with MLA), and
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` otherwise (MHA: one range per K/V;
``layer_first``: one per K/V and layer), which gather a page's ranges into one object and scatter it back,
still with no staging copy. A set first asks ``batch_is_exist`` and writes only the absent keys (the keys
are content addresses: a present key already holds these bytes). :meth:`~MooncakeBackend.get` and
:meth:`~MooncakeBackend.set` copy through the client's local buffer (``local_buffer_size`` bounds them).

Failures are misses. Per key, a negative code (not found, no space, transfer failure), or a read of any
other length than the page's, is ``False``. A client call that raises, returns RPC-error codes (the
master is gone) or runs past the method's ``timeout_s`` (every method returns within it, all its client
calls included) marks the master *down*: a warning is logged once per outage, and until
the client's ``health_check`` passes again (asked at most every ``retry_interval_s``) every call is an
immediate miss (``False`` / ``0`` / ``None``) without touching the store. When the master comes back the
same client remounts its segment by itself and the backend works again; objects the old master knew
are gone (its metadata lived in memory). ``timeout_s`` is enforced by running client calls on shared
daemon threads: a call that outlives it is left to finish in the background (the client's own RPC
timeout ends it, about 30 s against a frozen master), and while ``max_abandoned`` such calls are
outstanding the backend makes no new ones (these bounded calls and the master's state:
:mod:`hicache.storage.mooncake_calls`). A batch call left running may still move pages between the
store and its host slots (the client does if it stalls mid-transfer): a late *get* would write them, a
late *set* read them. So until it returns, :meth:`~MooncakeBackend.slots_busy` reports the host slots
of its batch as busy, and its caller (the storage tier's cache) keeps them out of the host pool's free
list: neither can land in, or store, another page's KV. A late set's objects are then also removed
again (its caller was told ``False``; this guards callers that ignore ``slots_busy``; as a put of a
present key also reports success, it may drop an object another client stored meanwhile: a later
miss, never wrong bytes; an object a reader holds a lease on stays).

Set-up, for one machine with TCP (no RDMA)::

    mooncake_master --rpc_port=50051 --rpc_address=127.0.0.1   # the master (from the pip package)
    MooncakeBackend("127.0.0.1:50051")                          # metadata by P2P handshake

or, with the master's embedded HTTP metadata server (``--enable_http_metadata_server=true
--http_metadata_server_port=8080``), ``metadata_server="http://127.0.0.1:8080/metadata"``.

All clients of one master must use the same kind of metadata server (a P2P-handshake client cannot
reach the segment of an HTTP-metadata one, and the other way round). Every client also contributes
``global_segment_size`` bytes of its own memory to the store: objects live in the segments of the
clients that are up, and go when their client closes.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .base import StorageBackend
from .mooncake_calls import FAILED, OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND, RPC_ERRORS, MasterCalls

__all__ = ["MooncakeBackend", "install_hint"]

log = logging.getLogger("hicache.storage.mooncake")


def install_hint() -> str:
    """How to install the Mooncake Store client (for error messages and skip reasons)."""
    return (
        "pip install mooncake-transfer-engine (CUDA builds) or mooncake-transfer-engine-non-cuda (CPU, TCP); "
        "its extension loads libibverbs.so.1 (Debian/Ubuntu: apt-get install libibverbs1)"
    )


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master_server_address: expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _local_ip_towards(host: str, port: int) -> str:
    """The local address the kernel would use to reach ``host`` (a UDP connect sends nothing)."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except (OSError, ValueError):
        return "127.0.0.1"


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def _positive_seconds(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"{name}: expected a positive number of seconds{' or None' if allow_none else ''}, got {value!r}"
        )
    return float(value)


class MooncakeBackend(StorageBackend):
    """Page objects in a Mooncake Store.

    Parameters
    ----------
    master_server_address : ``"host:port"`` of ``mooncake_master`` (its ``--rpc_port``).
    metadata_server : where transfer engines find each other: ``"P2PHANDSHAKE"`` (default; no service),
        the master's embedded HTTP metadata server (``"http://host:port/metadata"``), or an etcd address.
    local_hostname : the address other clients reach this one at; None: the local address that routes
        to the master (``127.0.0.1`` for a master on loopback).
    protocol : the transfer protocol, ``"tcp"`` (default) or ``"rdma"``.
    device_name : RDMA devices (``"mlx5_0,mlx5_1"``); ``""`` lets Mooncake choose. Unused with TCP.
    global_segment_size : bytes of this process's memory it contributes to the store (default 1 GiB).
    local_buffer_size : bytes of the client's staging buffer, which :meth:`get` / :meth:`set` copy
        through (default 64 MiB); the batch methods do not use it.
    timeout_s : the longest one method call may take, its calls into the client included (the existence
        check and the put of a set, a health probe while the master is down), before its pages count as
        misses and the master as down (default 5 s); None: no bound of ours (the client's own RPC
        timeout, ~30 s against a frozen master).
    setup_timeout_s : the longest connecting may take in the constructor (default 30 s).
    retry_interval_s : while the master is down, how often to ask the client whether it is back (1 s).
    replica_num : replicas per object (default 1).
    max_abandoned : calls past ``timeout_s`` still running in the background beyond which no new call is
        made (default 4). A batch call among them keeps its host slots busy (:meth:`slots_busy`).

    Raises ``RuntimeError`` when the client is not installed or the master cannot be reached at
    construction; store faults later are misses.
    """

    def __init__(
        self,
        master_server_address: str = "127.0.0.1:50051",
        *,
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str | None = None,
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int = 1 << 30,
        local_buffer_size: int = 64 << 20,
        timeout_s: float | None = 5.0,
        setup_timeout_s: float = 30.0,
        retry_interval_s: float = 1.0,
        replica_num: int = 1,
        max_abandoned: int = 4,
    ) -> None:
        super().__init__()
        if not isinstance(master_server_address, str):
            raise ValueError(f"master_server_address: expected 'host:port', got {master_server_address!r}")
        host, port = _split_address(master_server_address)
        for name, value in [("metadata_server", metadata_server), ("protocol", protocol)]:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
        if not isinstance(device_name, str):
            raise ValueError(f"device_name: expected a string, got {device_name!r}")
        if local_hostname is not None and (not isinstance(local_hostname, str) or not local_hostname):
            raise ValueError(f"local_hostname: expected None or a non-empty string, got {local_hostname!r}")
        self.master_server_address = master_server_address
        self.metadata_server = metadata_server
        self.local_hostname = local_hostname or _local_ip_towards(host, port)
        self.protocol = protocol
        self.device_name = device_name
        self.global_segment_size = _positive_int("global_segment_size", global_segment_size)
        self.local_buffer_size = _positive_int("local_buffer_size", local_buffer_size)
        self.timeout_s = _positive_seconds("timeout_s", timeout_s, allow_none=True)
        self.setup_timeout_s = _positive_seconds("setup_timeout_s", setup_timeout_s)
        self.retry_interval_s = _positive_seconds("retry_interval_s", retry_interval_s)
        self.max_abandoned = _positive_int("max_abandoned", max_abandoned)
        _positive_int("replica_num", replica_num)

        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise RuntimeError(
                f"the mooncake storage backend needs the Mooncake Store client: {install_hint()} ({e})"
            ) from e

        # Every client call goes through it: bounded in time, and none while the master is down.
        self._calls = MasterCalls(
            master_server_address,
            timeout_s=self.timeout_s,
            retry_interval_s=self.retry_interval_s,
            max_abandoned=self.max_abandoned,
            count=self._count,
        )
        self._registered: tuple[tuple[int, int], ...] = ()  # (address, bytes) of the attached buffers
        self._counts.update(skipped=0, not_found=0, errors=0, timeouts=0, outages=0, late_gets=0, late_sets=0)

        # Fail fast (and clearly) when nothing listens: setup() itself retries for about 90 s.
        try:
            socket.create_connection((host, port), timeout=min(self.setup_timeout_s, 5.0)).close()
        except OSError as e:
            raise RuntimeError(
                f"master_server_address: no mooncake_master answers at {master_server_address} ({e})"
            ) from e
        self._config = ReplicateConfig()
        self._config.replica_num = replica_num
        store = MooncakeDistributedStore()
        args = (self.local_hostname, metadata_server, self.global_segment_size, self.local_buffer_size, protocol,
                device_name, master_server_address)  # fmt: skip
        status, rc = self._calls.run(store.setup, args, self.setup_timeout_s, on_late=lambda _: store.close())
        if status != "ok" or rc != 0:
            why = {"ok": f"setup returned {rc}", "raised": f"setup raised {rc!r}"}.get(
                status, f"setup took longer than setup_timeout_s={self.setup_timeout_s:g}"
            )
            raise RuntimeError(
                f"mooncake: could not connect to master {master_server_address} (metadata {metadata_server!r}, "
                f"local_hostname {self.local_hostname!r}, protocol {protocol!r}): {why}"
            )
        self._store = self._calls.store = store
        self._multi = hasattr(store, "batch_put_from_multi_buffers") and hasattr(store, "batch_get_into_multi_buffers")

    # -- attachment ----------------------------------------------------------------------------------
    def attach(self, host_pool: Any) -> MooncakeBackend:
        """Bind to ``host_pool`` (a host pool, or the storage tier's stored objects) and register its
        ``buffer`` and any ``extra_buffers`` (staging areas) with the client for zero-copy transfers (the
        previous ones, if any, are unregistered). ``RuntimeError`` when the client refuses."""
        super().attach(host_pool)
        regions = []
        for buf in (host_pool.buffer, *getattr(host_pool, "extra_buffers", ())):
            if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
                self.host_pool = None
                raise TypeError("attach: host_pool.buffer (and extra_buffers) must be contiguous CPU tensors")
            regions.append((buf.data_ptr(), buf.numel() * buf.element_size()))
        if tuple(regions) == self._registered:
            return self
        self._unregister()
        for region in regions:
            status, rc = self._calls.run(self._store.register_buffer, region, self.setup_timeout_s)
            if status != "ok" or rc != 0:
                self._unregister()
                self.host_pool = None
                raise RuntimeError(
                    f"attach: mooncake could not register the host pool buffer ({region[1]} bytes at "
                    f"{region[0]:#x}): {'register_buffer returned ' + str(rc) if status == 'ok' else status}"
                )
            self._registered += (region,)
        return self

    def _unregister(self) -> None:
        for address, _ in self._registered:
            self._calls.run(self._store.unregister_buffer, (address,), self.timeout_s)
        self._registered = ()

    def _batch_pages(self, method: str, keys: Sequence[str], host_slots: torch.Tensor) -> list[list[tuple[int, int]]]:
        if self._calls.closed:
            raise RuntimeError(f"{method}: MooncakeBackend is closed")
        return self._pages(method, keys, host_slots)

    # -- the three user-level methods ----------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str) -> bytes | None:
        value = self._calls.call("get", self._calls.deadline(), self._store.get, key)
        if value is FAILED or not value:  # the client returns b"" for a missing object
            return None
        return value if isinstance(value, bytes) else bytes(value)

    def set(self, key: str, value: bytes | memoryview) -> bool:
        deadline = self._calls.deadline()
        present = self._exist_codes([key], deadline)
        if present is None or present[0] in RPC_ERRORS:
            return False
        if present[0] == 1:
            self._count(skipped=1)
            return True
        rc = self._calls.call("put", deadline, self._store.put, key, memoryview(value).cast("B"), self._config)
        if rc is FAILED:
            return False
        if int(rc) in RPC_ERRORS:
            self._calls.mark_down(f"put failed with RPC error {rc}")
        else:
            self._calls.reached()
        return int(rc) in (0, OBJECT_ALREADY_EXISTS)

    # -- batches -------------------------------------------------------------------------------------
    def _exist_codes(self, keys: list[str], deadline: float | None) -> list[int] | None:
        """``batch_is_exist``'s per-key codes (1 present, 0 absent, negative an error), or None."""
        calls = self._calls
        return calls.codes("batch_is_exist", calls.call("batch_is_exist", deadline, self._store.batch_is_exist, keys),
                           len(keys))  # fmt: skip

    def batch_exists(self, keys: Sequence[str]) -> int:
        keys = list(keys)
        if not keys:
            return 0
        codes = self._exist_codes(keys, self._calls.deadline())
        n = 0
        for c in codes or ():
            if c != 1:
                break
            n += 1
        return n

    def _client_call(self, name: str, pages: list[list[tuple[int, int]]]) -> tuple[Callable[..., Any], str, tuple]:
        """The client method for ``pages`` (each key's ``(address, bytes)`` ranges) and its buffer
        arguments: ``name`` with one buffer per key when every page is one range, else
        ``name_multi_buffers`` with a list of ranges per key."""
        if all(len(r) == 1 for r in pages):
            return getattr(self._store, name), name, ([r[0][0] for r in pages], [r[0][1] for r in pages])
        multi = f"{name}_multi_buffers"
        args = ([[a for a, _ in r] for r in pages], [[n for _, n in r] for r in pages])
        return getattr(self._store, multi), multi, args

    def batch_get_into(self, keys: Sequence[str], host_slots: torch.Tensor) -> list[bool]:
        pages = self._batch_pages("batch_get_into", keys, host_slots)
        if not pages:
            return []
        if not self._multi and any(len(r) > 1 for r in pages):
            return super().batch_get_into(keys, host_slots)  # an old client: copy through get()
        keys, nbytes = list(keys), self.host_pool.page_bytes
        fn, what, args = self._client_call("batch_get_into", pages)

        def late(_: Any) -> None:  # its host slots were busy until now (slots_busy): nothing else was there
            self._count(late_gets=1)
            log.warning("mooncake: a %s finished after its timeout; its host slots are free to reuse now", what)

        got = self._calls.call(what, self._calls.deadline(), fn, keys, *args, on_late=late, busy=host_slots)
        codes = self._calls.codes(what, got, len(keys))
        out = [c == nbytes for c in codes] if codes is not None else [False] * len(keys)
        hits = sum(out)
        if codes is not None:
            self._count(
                not_found=sum(c == OBJECT_NOT_FOUND for c in codes),
                errors=sum(c != nbytes and c != OBJECT_NOT_FOUND for c in codes),
            )
        self._count(hits=hits, misses=len(out) - hits, bytes_read=hits * nbytes)
        return out

    def batch_set_from(self, keys: Sequence[str], host_slots: torch.Tensor) -> list[bool]:
        pages = self._batch_pages("batch_set_from", keys, host_slots)
        if not pages:
            return []
        if not self._multi and any(len(r) > 1 for r in pages):
            return super().batch_set_from(keys, host_slots)  # an old client: copy through set()
        keys, nbytes = list(keys), self.host_pool.page_bytes
        out = [False] * len(keys)
        deadline = self._calls.deadline()
        present = self._exist_codes(keys, deadline)
        if present is not None and not any(c in RPC_ERRORS for c in present):
            first: dict[str, int] = {}  # each absent key once (a batch may repeat a key)
            for i, (key, c) in enumerate(zip(keys, present, strict=True)):
                if c == 1:
                    out[i] = True
                else:
                    first.setdefault(key, i)
            self._count(skipped=sum(out))
            if first:
                todo = list(first.values())
                put_keys = [keys[i] for i in todo]
                fn, what, args = self._client_call("batch_put_from", [pages[i] for i in todo])

                def late(codes: Any) -> None:  # the caller was told False: take back what was stored
                    self._count(late_sets=1)
                    for key, c in zip(put_keys, codes, strict=False):
                        if int(c) == 0:
                            self._remove(key)

                # Busy until it returns: a late put must read the pages it was given, not what a reuse of
                # their slots put there (a wrong object under a content key, for every reader of the store).
                put = self._calls.call(what, deadline, fn, put_keys, *args, self._config, on_late=late,
                                       busy=host_slots)  # fmt: skip
                codes = self._calls.codes(what, put, len(todo))
                if codes is not None:
                    stored = {keys[i]: c in (0, OBJECT_ALREADY_EXISTS) for i, c in zip(todo, codes, strict=True)}
                    self._count(errors=sum(not ok for ok in stored.values()))
                    out = [ok or stored.get(key, False) for key, ok in zip(keys, out, strict=True)]
        done = sum(out)
        self._count(sets=done, set_failures=len(out) - done, bytes_written=done * nbytes)
        return out

    def _remove(self, key: str) -> None:
        # Not force=True: a reader holding the object's lease keeps it (a put of a present key also returns 0).
        self._store.remove(key)

    # -- the rest ------------------------------------------------------------------------------------
    def slots_busy(self, host_slots: torch.Tensor, timeout: float | None = 0.0) -> bool:
        """Whether a batch call given up on at its ``timeout_s`` and still running holds any of
        ``host_slots`` (its whole batch), after waiting up to ``timeout`` seconds for those calls to end.
        Closing the backend does not end them: their slots stay busy until they return."""
        return self._calls.slots_busy(host_slots, timeout)

    def stats(self) -> dict[str, int | float | str]:
        """The base counters plus ``skipped`` (keys already stored on a set), ``not_found``, ``errors``
        (other per-key failures), ``timeouts``, ``outages`` (master outages, each logged once),
        ``late_gets`` / ``late_sets`` (calls that finished after their timeout), ``master_up``,
        ``abandoned`` (calls past their timeout still running; a batch call's slots are busy meanwhile)
        and ``master``."""
        out = super().stats()
        master_up, abandoned = self._calls.health()
        out.update(master_up=int(master_up), abandoned=abandoned, master=self.master_server_address)
        return out

    def close(self) -> None:
        """Unregister the host pool's buffer and close the client (its segment leaves the store, with the
        objects in it). Bounded by ``setup_timeout_s``; a client that takes longer is left to finish."""
        if not self._calls.close():
            return
        store = getattr(self, "_store", None)
        if store is None:
            return

        def shut() -> None:
            for address, _ in self._registered:
                store.unregister_buffer(address)
            self._registered = ()
            store.close()

        status, err = self._calls.run(shut, (), self.setup_timeout_s)
        if status != "ok":
            log.warning("mooncake: closing the client %s", "timed out" if status == "timeout" else f"raised {err!r}")
