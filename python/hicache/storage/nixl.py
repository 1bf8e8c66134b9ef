"""The ``nixl`` storage backend: the file backend's page objects, moved by NVIDIA NIXL (the transfer library
of SGLang's ``nixl`` storage backend and of Dynamo) through one of its file plugins.

Install: ``pip install hicache-kernels[nixl]`` (``nixl-cu13``; ``nixl-cu12`` or ``nixl`` work too); NIXL is
imported when a backend is built (``ImportError`` naming the package when it is missing). Objects: the
:mod:`~hicache.storage.file` backend's (``path/<key[:2]>/<key>.kv``, its header block with the key,
namespace digest, length and payload checksum, then the page's bytes), so either backend reads what the
other wrote. :class:`NixlBackend` is a :class:`~hicache.storage.file.FileBackend` that moves a batch's pages
differently; the index, ``capacity_bytes``, namespaces, the removal of corrupt objects, ``exists`` /
``batch_exists`` (a ``stat`` of the file: no I/O on the object; NIXL's ``queryMem``, which the POSIX plugin
answers with the same ``stat``, costs about 2.5 times as much per key from Python) and the byte-level
``get`` / ``set`` (plain file I/O: they copy through ``bytes`` anyway) are the file backend's.

Moving a batch: :meth:`~NixlBackend.attach` registers the host pool's ``buffer`` and every tensor of its
``extra_buffers`` (staging areas a view of the pool may point into) with the NIXL agent once, as DRAM. A
:meth:`~NixlBackend.batch_get_into` opens each object and checks its size and header with plain calls,
then issues ONE NIXL ``READ`` for the batch: FILE descriptors ``(offset, nbytes, fd)`` over the objects'
payloads against DRAM descriptors over the pages' host ranges ``(address, nbytes)``, so the bytes land in
the host pages (zero copy); then each page's checksum is computed over what landed (a mismatch is a miss,
the page holds garbage as the interface allows, and the object is removed). A
:meth:`~NixlBackend.batch_set_from` checksums each page, writes each object's header into a temporary file
with ``os.pwrite``, issues ONE NIXL ``WRITE`` of all the pages' ranges into those files and renames each
into place (a reader sees a whole object or none). The files are registered with the agent for the batch
only, then deregistered and closed. A failed transfer is retried page by page (to tell the bad object from
the good); what still fails is a miss, counted in ``stats()["transfer_errors"]``, never an exception.

Plugins: ``POSIX`` (default; no GPU: DRAM to and from files through Linux AIO), ``GDS`` / ``GDS_MT``
(GPUDirect Storage via cuFile, on a GPU machine with ``libcufile``), or another that moves DRAM to FILE.
Files are opened without ``O_DIRECT`` (no ``direct_io`` here), so GDS runs in its compatibility mode.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .base import page_views
from .checksum import checksum
from .file import HEADER_BYTES, FileBackend
from .keys import Namespace

__all__ = ["NixlBackend", "install_hint", "load_nixl", "nixl_status"]

log = logging.getLogger("hicache.storage.nixl")

NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")  # NIXL's Python API: the wheels' packages, the meta package
FILE_PLUGINS = ("POSIX", "GDS", "GDS_MT")  # the plugins meant for this backend (others that move DRAM to FILE work too)
_names = itertools.count()


def install_hint() -> str:
    """How to install NIXL (for error messages and skip reasons)."""
    return "pip install hicache-kernels[nixl] (the nixl-cu13 wheel; nixl-cu12 for a CUDA 12 machine)"


def load_nixl() -> tuple[Any, str]:
    """NIXL's agent API module (``<package>._api``) and the package's name, trying :data:`NIXL_MODULES`
    in order. ``ImportError`` naming :func:`install_hint` (and why each failed) when none imports.

    NIXL's Python logger prints every agent and plugin it starts on stdout at INFO; unless
    ``NIXL_LOG_LEVEL`` is set, it is set to ``WARN`` before the first import."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    why = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(f"{name}._api"), name
        except ImportError as e:
            why.append(f"{name}: {e}")
        except OSError as e:  # a wheel whose shared libraries do not load here
            why.append(f"{name}: {type(e).__name__}: {e}")
    raise ImportError(f"the nixl storage backend needs NIXL: {install_hint()} ({'; '.join(why)})")


def nixl_status() -> dict[str, Any]:
    """Whether the nixl backend can run here: ``available``; when it can, ``module``, ``version``,
    ``plugins`` (what an agent lists) and ``file_plugins`` (POSIX, GDS, GDS_MT: whether NIXL loads each and
    the memory it handles, or why not; none is started), else ``reason`` (for ``python -m hicache.info``)."""
    try:
        api, name = load_nixl()
    except ImportError as e:
        return {"available": False, "reason": str(e)}
    try:
        ver = metadata.version(name.replace("_", "-"))
    except metadata.PackageNotFoundError:
        ver = None
    try:
        agent = api.nixl_agent(f"hicache-info-{os.getpid()}", api.nixl_agent_config(enable_prog_thread=False,
                                                                                     backends=[]))  # fmt: skip
        plugins = list(agent.get_plugin_list())
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"available": False, "module": name, "version": ver, "reason": f"no NIXL agent: {e}"}
    usable = {}
    for plugin in FILE_PLUGINS:
        mems, why = _plugin_mem_types(agent, plugin) if plugin in plugins else (None, "not in this NIXL")
        if mems is None:
            usable[plugin] = f"does not load here ({why})"
        else:
            files = {"DRAM_SEG", "FILE_SEG"} <= set(mems)
            usable[plugin] = ("loads" if files else "does not move DRAM to FILE") + f" ({', '.join(mems)})"
    return {"available": True, "module": name, "version": ver, "plugins": plugins, "file_plugins": usable}


def _plugin_mem_types(agent: Any, plugin: str) -> tuple[list[str] | None, str]:
    """The memory types ``plugin`` handles, from its parameters, without starting it (a started UCX can
    crash the process at exit); ``(None, why)`` when NIXL cannot load it here (GDS without cuFile)."""
    try:
        return list(agent.agent.getPluginParams(plugin)[1]), ""  # the binding: no warning logged on failure
    except AttributeError:
        mems = list(agent.get_plugin_mem_types(plugin))
        return (mems, "") if mems else (None, "NIXL could not load it")
    except Exception as e:  # noqa: BLE001 - the reason, for the caller's message
        return None, f"{type(e).__name__}: {e}"


@dataclass
class _Obj:
    """One page object of a batch: its slot in the batch, file descriptor and host ranges."""

    index: int
    key: str
    fd: int
    ranges: list[tuple[int, int]]
    path: Path
    tmp: Path | None = None  # a write's temporary file
    crc: int = 0  # a read's expected payload checksum
    ino: int = 0

    def close(self, discard: bool = False) -> None:
        """Close the file (once); ``discard``: also remove a write's temporary file."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        if discard and self.tmp is not None:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass


class NixlBackend(FileBackend):
    """Page objects as files under ``path``, the pages of a batch moved by one NIXL transfer.

    Parameters
    ----------
    path : the directory (created when missing); objects are ``path/<key[:2]>/<key>.kv`` (the file
        backend's format).
    plugin : the NIXL plugin that moves the bytes: ``"POSIX"`` (default), ``"GDS"`` or ``"GDS_MT"`` where
        the agent can start them (``ValueError`` naming it and listing what NIXL has, otherwise).
    plugin_params : the plugin's initialization parameters (strings), e.g. ``{"use_uring": "true"}`` for
        POSIX or ``{"thread_count": "8"}`` for GDS_MT; None: its defaults.
    capacity_bytes, namespace, fsync : as for :class:`~hicache.storage.file.FileBackend`.

    Raises ``ImportError`` (naming ``pip install hicache-kernels[nixl]``) when NIXL is not installed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        plugin: str = "POSIX",
        plugin_params: Mapping[str, Any] | None = None,
        capacity_bytes: int | None = None,
        namespace: Namespace | bytes | None = None,
        fsync: bool = False,
    ) -> None:
        if not isinstance(plugin, str) or not plugin:
            raise ValueError(f"plugin: expected a NIXL plugin name such as 'POSIX', got {plugin!r}")
        if plugin_params is not None and not isinstance(plugin_params, Mapping):
            raise ValueError(f"plugin_params: expected a mapping of strings, got {type(plugin_params).__name__}")
        params = {str(k): str(v) for k, v in (plugin_params or {}).items()}
        api, module = load_nixl()
        name = f"hicache-nixl-{os.getpid()}-{next(_names)}"
        # STRICT: the agent serializes its own calls, so the tier's backup, prefetch and query threads can
        # share it; no progress thread (the POSIX plugin progresses when asked for a transfer's state).
        conf = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                     sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)  # fmt: skip
        agent = api.nixl_agent(name, conf)
        listed = list(agent.get_plugin_list())
        if plugin not in listed:
            raise ValueError(f"plugin: {plugin!r} is not a plugin of this NIXL ({module}); it has "
                             f"{', '.join(listed)} (for files: POSIX, or GDS / GDS_MT on a GPU machine)")  # fmt: skip
        mems, why = _plugin_mem_types(agent, plugin)
        if mems is not None and not {"DRAM_SEG", "FILE_SEG"} <= set(mems):  # e.g. UCX
            raise ValueError(f"plugin: {plugin!r} does not move host memory (DRAM) to files (FILE): it handles "
                             f"{', '.join(mems) or 'nothing'}; use POSIX, GDS or GDS_MT")  # fmt: skip
        try:
            if mems is None:
                raise RuntimeError(why)
            agent.create_backend(plugin, params)
        except Exception as e:  # noqa: BLE001 - the plugin cannot start here: say which and why
            raise ValueError(f"plugin: NIXL could not start {plugin!r} here ({e}); its plugins: {', '.join(listed)} "
                             f"(POSIX needs no GPU; GDS and GDS_MT need cuFile and a GPU)") from e  # fmt: skip
        # num_threads=1: the file backend's pool serves no batch here (its threads start only when used).
        super().__init__(path, capacity_bytes=capacity_bytes, namespace=namespace, num_threads=1, fsync=fsync)
        self.plugin, self.nixl_module, self._name, self._agent = plugin, module, name, agent
        self._regions, self._dram = [], None  # the (address, bytes) registered as DRAM, their registration
        # Transfers whose handle NIXL would not release (still running): (handle, host slots, objects, FILE
        # registration), retried by slots_busy and close; their host slots are busy until then.
        self._stuck: list[tuple[Any, torch.Tensor, list[_Obj], Any]] = []
        self._stuck_lock = threading.Lock()
        self._counts.update(transfers=0, transfer_errors=0, skipped=0)

    # -- attachment ----------------------------------------------------------------------------------
    def attach(self, host_pool: Any) -> NixlBackend:
        """Bind to ``host_pool`` (a :class:`~hicache.pools.HostKVPool` or a view with ``page_ranges``,
        ``page_bytes``, ``buffer`` and optionally ``extra_buffers``) and register ``buffer`` and each tensor
        of ``extra_buffers`` with the NIXL agent (what an earlier attach registered is deregistered first).
        ``TypeError`` for a pool without them; ``RuntimeError`` when NIXL refuses the memory."""
        if self._closed:
            raise RuntimeError("attach: NixlBackend is closed")
        if not hasattr(host_pool, "page_ranges") or not hasattr(host_pool, "buffer"):
            raise TypeError(f"attach: expected a HostKVPool (or a view with page_ranges, page_bytes and buffer), "
                            f"got {type(host_pool).__name__}")  # fmt: skip
        tensors = [("buffer", host_pool.buffer)]
        tensors += [(f"extra_buffers[{i}]", t) for i, t in enumerate(getattr(host_pool, "extra_buffers", ()) or ())]
        regions: list[tuple[int, int]] = []
        for name, t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
                raise TypeError(f"attach: host_pool.{name} must be a contiguous CPU tensor, got {type(t).__name__}")
            region = (t.data_ptr(), t.numel() * t.element_size())
            if region[1] and region not in regions:
                regions.append(region)
        if regions != self._regions or self._dram is None:
            self._deregister()
            try:
                self._dram = self._agent.register_memory([(a, n, 0, "") for a, n in regions], "DRAM",
                                                         [self.plugin]) if regions else None  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a clear error at attach, not a miss later
                self.host_pool = None
                raise RuntimeError(f"attach: NIXL ({self.plugin}) could not register the host memory "
                                   f"({sum(n for _, n in regions)} bytes): {e}") from e  # fmt: skip
            self._regions = regions
        super().attach(host_pool)
        return self

    def _deregister(self) -> None:
        try:
            if self._dram is not None:
                self._agent.deregister_memory(self._dram, [self.plugin])
        except Exception as e:  # noqa: BLE001 - nothing to do about it but say so
            log.warning("nixl: deregistering the host memory failed: %s", e)
        self._dram, self._regions = None, []

    def _batch_pages(self, method: str, keys: Sequence[str], host_slots: torch.Tensor) -> list[list[tuple[int, int]]]:
        if self._closed:
            raise RuntimeError(f"{method}: NixlBackend is closed")
        return self._pages(method, keys, host_slots)

    # -- one transfer --------------------------------------------------------------------------------
    def _transfer(self, op: str, objs: list[_Obj], host_slots: torch.Tensor) -> bool | None:
        """One NIXL ``op`` ("READ": files -> host, "WRITE": host -> files) over every range of ``objs``
        (each object's payload from byte ``HEADER_BYTES`` of its file), waited on. True when it completed,
        False when it failed, None when NIXL would not release it (it may still run: the caller leaves the
        objects' files open and the slots busy)."""
        agent, dram, files = self._agent, [], []
        for o in objs:
            pos = HEADER_BYTES
            for addr, n in o.ranges:
                dram.append((addr, n, 0))
                files.append((pos, n, o.fd))
                pos += n
        freg = handle = None
        state = "ERR"
        try:
            freg = agent.register_memory([(0, 0, o.fd, "") for o in objs], "FILE", [self.plugin])
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(dram, "DRAM"), agent.get_xfer_descs(files, "FILE"),
                                           self._name, b"", [self.plugin])  # fmt: skip
            state = agent.transfer(handle)
            polls = 0
            while state == "PROC":
                polls += 1
                if polls > 32:  # a short spin, then sleeps of up to 1 ms
                    time.sleep(min(1e-3, 1e-5 * (polls - 32)))
                state = agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001 - a store fault is a miss
            log.debug("nixl: %s of %d objects failed: %s", op, len(objs), e)
            state = "ERR"
        if handle is not None:
            try:
                handle.release()
            except Exception as e:  # noqa: BLE001 - still running: keep it, its files and its slots
                log.warning("nixl: a failed %s could not be released (%s); its host slots stay busy", op, e)
                with self._stuck_lock:
                    self._stuck.append((handle, host_slots, objs, freg))
                self._count(transfers=1, transfer_errors=1)
                return None
        try:
            if freg is not None:
                agent.deregister_memory(freg, [self.plugin])
        except Exception as e:  # noqa: BLE001
            log.warning("nixl: deregistering a batch's files failed: %s", e)
        ok = state == "DONE"
        self._count(transfers=1, transfer_errors=int(not ok))
        return ok

    def _move(self, op: str, objs: list[_Obj], host_slots: torch.Tensor) -> list[bool | None]:
        """Per object, whether ``op`` moved it: one transfer for all; when it fails, one per object (to tell
        which one is bad); None for an object of a transfer NIXL would not release."""
        if not objs:
            return []
        ok = self._transfer(op, objs, host_slots)
        if ok is False and len(objs) > 1:
            return [self._transfer(op, [o], host_slots) for o in objs]
        return [ok] * len(objs)

    # -- batches -------------------------------------------------------------------------------------
    def _open_object(self, i: int, key: str, ranges: list[tuple[int, int]], nbytes: int) -> _Obj | None:
        """The object of ``key`` opened for a read, its size and header checked; None when it is a miss."""
        path = self._file(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._miss(key)
            return None
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            verdict, crc = "corrupt", 0  # truncated or extended, unless the header says otherwise
            if st.st_size == HEADER_BYTES + nbytes:
                verdict, crc = self._check_header(key, os.pread(fd, HEADER_BYTES, 0), nbytes)
        except OSError:
            os.close(fd)
            return None
        if verdict == "ok":
            return _Obj(i, key, fd, ranges, path, crc=crc, ino=st.st_ino)
        os.close(fd)
        if verdict == "foreign":
            self._count(foreign=1)
        else:
            self._drop(key, path, st.st_ino)
        return None

    def batch_get_into(self, keys: Sequence[str], host_slots: torch.Tensor) -> list[bool]:
        """Read each key's object into its page of ``host_slots`` with one NIXL READ (module docstring);
        per page, whether it was read and its checksum matched."""
        pages = self._batch_pages("batch_get_into", keys, host_slots)
        nbytes = self.host_pool.page_bytes
        out = [False] * len(pages)
        objs: list[_Obj] = []
        moved: list[bool | None] = []
        try:
            for i, (key, ranges) in enumerate(zip(keys, pages, strict=True)):
                o = self._open_object(i, key, ranges, nbytes)
                if o is not None:
                    objs.append(o)
            moved = self._move("READ", objs, host_slots)
            for o, m in zip(objs, moved, strict=True):
                if not m:
                    continue
                if checksum(*page_views(o.ranges)) == o.crc:  # over the bytes that landed
                    out[o.index] = True
                    self._touch(o.key, HEADER_BYTES + nbytes, o.path)
                else:
                    self._drop(o.key, o.path, o.ino)
        finally:
            for o, m in zip(objs, moved or [True] * len(objs), strict=True):
                if m is not None:  # None: a transfer NIXL would not release still holds it
                    o.close()
        hits = sum(out)
        self._count(hits=hits, misses=len(out) - hits, bytes_read=hits * nbytes)
        return out

    def _create_object(self, i: int, key: str, ranges: list[tuple[int, int]], nbytes: int) -> _Obj | None:
        """A temporary file for ``key``'s object (reserved) with its header written (the payload's checksum
        from the host ranges); None when it cannot be created (the reservation dropped)."""
        path = self._file(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.{i}.tmp")
        o = _Obj(i, key, -1, ranges, path, tmp=tmp)
        try:
            path.parent.mkdir(exist_ok=True)
            o.fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            if os.pwrite(o.fd, self._header(key, nbytes, checksum(*page_views(ranges))), 0) != HEADER_BYTES:
                raise OSError("short header write")
        except OSError:
            o.close(discard=True)
            with self._lock:  # reserved by the caller
                self._writing.discard(key)
                self._forget(key)
            return None
        return o

    def _finish_write(self, o: _Obj, moved: bool | None, nbytes: int) -> bool:
        """Rename a written object into place (a transfer that reported done but left the file short is
        a failure); otherwise remove its temporary file, unless NIXL may still be writing it (None)."""
        ok = False
        try:
            if moved and os.fstat(o.fd).st_size == HEADER_BYTES + nbytes:
                if self.fsync:
                    os.fsync(o.fd)
                o.close()
                os.replace(o.tmp, o.path)
                ok = True
        except OSError:
            pass
        if moved is not None:
            o.close(discard=not ok)
        with self._lock:
            self._writing.discard(o.key)
            if not ok:
                self._forget(o.key)
        return ok

    def batch_set_from(self, keys: Sequence[str], host_slots: torch.Tensor) -> list[bool]:
        """Store the page of ``host_slots`` matching each key with one NIXL WRITE (module docstring); keys
        already stored are left as they are (content addresses); per page, whether it is stored."""
        pages = self._batch_pages("batch_set_from", keys, host_slots)
        nbytes = self.host_pool.page_bytes
        out = [False] * len(pages)
        first: dict[str, int] = {}  # a batch may repeat a key: written once
        objs: list[_Obj] = []
        moved: list[bool | None] = []
        try:
            for i, (key, ranges) in enumerate(zip(keys, pages, strict=True)):
                if first.setdefault(key, i) != i:
                    continue
                path = self._file(key)
                if path.exists():
                    self._touch(key, HEADER_BYTES + nbytes, path)
                    self._count(skipped=1)
                    out[i] = True
                elif self._reserve(key, HEADER_BYTES + nbytes):
                    o = self._create_object(i, key, ranges, nbytes)
                    if o is not None:
                        objs.append(o)
            moved = self._move("WRITE", objs, host_slots)
        finally:
            moved = moved or [False] * len(objs)
            for o, m in zip(objs, moved, strict=True):
                out[o.index] = self._finish_write(o, m, nbytes)
        out = [out[first[k]] for k in keys]
        done = sum(out)
        self._count(sets=done, set_failures=len(out) - done, bytes_written=done * nbytes)
        return out

    def _settle(self) -> None:
        """Release the transfers NIXL would not release before, where it does now (closing their files)."""
        with self._stuck_lock:
            still = []
            for handle, slots, objs, freg in self._stuck:
                try:
                    handle.release()
                except Exception:  # noqa: BLE001 - still running
                    still.append((handle, slots, objs, freg))
                    continue
                for o in objs:
                    o.close(discard=True)
                if freg is not None:
                    try:
                        self._agent.deregister_memory(freg, [self.plugin])
                    except Exception:  # noqa: BLE001
                        pass
            self._stuck = still

    def slots_busy(self, host_slots: torch.Tensor, timeout: float | None = 0.0) -> bool:
        """Whether a transfer NIXL would not release (a failed one it could not cancel) may still move any
        of ``host_slots``, after waiting up to ``timeout`` seconds (None: until none does)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        want = set(host_slots.tolist())
        while True:
            self._settle()
            with self._stuck_lock:
                busy = any(want & set(s.tolist()) for _, s, _, _ in self._stuck)
            if not busy or (deadline is not None and time.monotonic() >= deadline):
                return busy
            time.sleep(0.001)

    def stats(self) -> dict[str, int | float | str]:
        """The file backend's counters plus ``transfers`` / ``transfer_errors`` (NIXL transfers issued /
        failed; a failed batch is retried page by page), ``skipped`` (keys already stored on a set),
        ``stuck`` (transfers NIXL would not release yet), ``plugin`` and ``nixl`` (its package)."""
        out = super().stats()
        with self._stuck_lock:
            out.update(stuck=len(self._stuck), plugin=self.plugin, nixl=self.nixl_module)
        return out

    def close(self) -> None:
        """Deregister the host memory and drop the agent (kept alive while a transfer it would not release
        may still run). Objects stay on disk; exists / get / set still work, batch calls raise."""
        if self._closed:
            return
        self._settle()
        if not self._stuck:
            self._deregister()
            self._agent = None
        super().close()
