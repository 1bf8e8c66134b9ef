"""io-backends: five ways to execute a :class:`~hicache_kernels.plan.TransferPlan`, selected by name.

===========  =====================================================================================
``direct``   copy engines: runs of consecutive slots merged, one ``cudaMemcpyAsync`` (or
             ``cudaMemcpy2DAsync`` for strided rows) per run, layer, K/V and chunk. The baseline.
             On CPU tensors the same fragments are copied with torch.
``batch``    the same fragments split into 1-D pieces, all in one ``cudaMemcpyBatchAsync``
             (CUDA >= 12.8). Falls back to ``direct`` on the legacy default stream (which the call
             refuses) or when the driver does not support the call, and says so with a warning and
             in ``last_fallback``; any other error raises.
``kernel``   the CUDA kernels of ``csrc/``: SM threads read/write pinned host memory through its
             device-mapped address (zero copy), on a bounded grid (``num_blocks`` blocks of
             ``warps_per_block`` warps; default 4 x 32, so at most 4 SMs).
``triton``   the same gather/scatter in Triton (zero copy as well); on CPU tensors under
             ``TRITON_INTERPRET=1``.
``auto``     per call, the design a benchmark measured fastest for the direction and fragment size
             (:class:`AutoBackend`; its decision table persists in a JSON file).
===========  =====================================================================================

All run on ``plan.stream`` or the current CUDA stream of the device pool's device, with that device
current for the launch (the caller's current device is restored), and never synchronise the host,
except that copy-engine backends need the indices on the host: CUDA index tensors are copied over (a
sync). ``kernel`` and ``batch`` (and ``direct``'s ``cudaMemcpyAsync``) run the extension's static
CUDA runtime, which needs a driver for its CUDA major version: on an older one ``kernel`` and
``batch`` are unavailable (:class:`~hicache_kernels.BackendUnavailableError` says why) and ``direct``
copies with torch.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import launch
from ._ext import cuda_runtime_status, load_extension
from ._names import IO_BACKENDS
from .direct import DirectBackend
from .fragments import TensorMemory, plan_fragments, split_rows
from .iobackend import IOBackend, cuda_reason, nothing, on_device, pinned_reason, plan_stream, stream_handle
from .plan import TransferPlan
from .staged import StagedBackend

# Stream handles cudaMemcpyBatchAsync refuses: the NULL (legacy default) stream and cudaStreamLegacy.
_LEGACY_STREAM_HANDLES = (0, 1)


# cudaMemcpyBatchAsync errors that mean "not here" (not built in, driver too old), after which
# per-fragment copies are the documented fallback. Any other error (cudaErrorInvalidValue,
# cudaErrorInvalidResourceHandle, ...) is a broken call and raises: it must not pass for a backend
# that works. The legacy stream, which the call refuses, is recognised before calling.
_BATCH_FALLBACK_ERRORS = ("cudaErrorNotSupported", "cudaErrorCallRequiresNewerDriver")


class BatchBackend(IOBackend):
    """All fragments in one ``cudaMemcpyBatchAsync`` (see module docstring)."""

    name = "batch"

    def unavailable(self, plan: TransferPlan) -> str | None:
        if not plan.route.on_cuda:
            return None  # CPU tensors: the pieces are copied with torch
        ok, reason = cuda_runtime_status()
        return None if ok else reason

    def __init__(self) -> None:
        self.last_fallback: str | None = None
        self._warned: set[str] = set()

    def wants_host_indices(self, plan: TransferPlan) -> bool:
        return True

    def _fallback(self, reason: str, issue_direct: Callable[[Any], None], stream: Any) -> None:
        self.last_fallback = reason
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"io-backend 'batch' fell back to 'direct': {reason}", RuntimeWarning, stacklevel=4)
        issue_direct(stream)

    def _prepare(self, plan: TransferPlan) -> Callable[[], None]:
        frags = plan_fragments(plan)
        if len(frags) == 0:
            return nothing
        dst, src, size = split_rows(frags)
        if not plan.route.on_cuda:
            memory = TensorMemory(plan.tensors)

            def pieces() -> None:
                self.last_fallback = None
                memory.copy_pieces(dst, src, size)

            return pieces
        ext = load_extension()
        stream = plan_stream(plan)
        device = plan.route.device.index
        issue_direct = DirectBackend.issuer(frags)  # the fallback, ready without planning again
        if stream.cuda_stream in _LEGACY_STREAM_HANDLES:

            def legacy() -> None:
                with torch.cuda.device(device):
                    self._fallback("the legacy default stream is refused by cudaMemcpyBatchAsync", issue_direct, stream)
                _ = plan  # keeps the pools alive with the callable

            return legacy
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, size)]
        pointers = [a.ctypes.data for a in arrays]
        count, h2d = int(arrays[2].size), int(plan.direction == "h2d")

        def batch() -> None:
            self.last_fallback = None
            with torch.cuda.device(device):
                code = ext.memcpy_batch(*pointers, count, h2d, stream.cuda_stream)
                if code != 0:
                    name = ext.error_name(code)
                    if name not in _BATCH_FALLBACK_ERRORS:
                        raise RuntimeError(f"io-backend 'batch': cudaMemcpyBatchAsync failed: {name} (error {code})")
                    self._fallback(f"cudaMemcpyBatchAsync returned {name}", issue_direct, stream)
            _ = arrays, plan  # keep the arrays the pointers point into, and the pools, alive with the callable

        return batch


@functools.cache
def _compute_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def _bulk_image(device: torch.device) -> tuple[int, int] | str:
    """``(binaryVersion, ptxVersion)`` of the bulk kernel's code the driver loads for ``device``, or why
    it has none (asked once per device: the query loads the module there)."""
    try:
        binary, ptx = load_extension().bulk_image_versions(device.index)
    except RuntimeError as exc:
        return str(exc)
    return int(binary), int(ptx)


class _SkipCounter:
    """One device's counter of skipped units (``tensor``, int32), and the streams that launched counting
    kernels into it since it was last read, each with an event recorded after its latest such launch.
    Launches and reads exclude each other (they may come from several threads), so a launch is either
    waited for by a read or issued after that read's reset completed."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._launched: dict[int, tuple[Any, Any]] = {}  # stream handle -> (stream, event)
        self._lock = threading.Lock()

    def counted_launch(self, launch: Callable[[], None], handle: int, stream: Any) -> None:
        """Issue ``launch``, a kernel counting into ``tensor`` on ``stream`` (handle ``handle``), so that
        the next read waits for it. ``stream`` None: under graph capture, where the kernel runs at
        replay (read its count after syncing that) and no event can be waited on outside the graph."""
        with self._lock:
            launch()
            if stream is not None:
                entry = self._launched.get(handle)
                if entry is None:
                    entry = self._launched[handle] = (stream, torch.cuda.Event())
                entry[1].record(stream)

    def read_and_reset(self, device: torch.device) -> int:
        """The count, then zero, on ``device``'s current stream (where torch runs the tensor ops) after
        every counting kernel issued so far, whatever stream it ran on. The reset has completed when this
        returns (the read syncs that stream), so it precedes every later launch."""
        with self._lock:
            reader = torch.cuda.current_stream(device)
            for _, event in self._launched.values():
                reader.wait_event(event)
            self._launched.clear()
            count = self.tensor.clone()
            self.tensor.zero_()
            return int(count.item())


class KernelBackend(IOBackend):
    """Zero-copy CUDA kernels on a bounded grid (see module docstring).

    ``count_skipped=True`` makes the kernels count the work units they skip for an out-of-range
    index (in fast mode, ``check_indices=False``) in a device counter, without any sync;
    :meth:`skipped` reads it (one sync) and resets it. A unit is one (index pair, K/V, layer, chunk).
    Each counting launch records an event on its stream (not under graph capture), so the read waits
    for counting kernels on any stream, such as a controller's copy streams.

    ``design="bulk"`` runs the bulk-copy kernel where it can (:meth:`bulk_unsupported`) and the
    register kernel elsewhere; ``last_design`` names the design the last prepared copy uses and
    ``last_design_reason`` says why it is not the bulk one asked for (None otherwise).

    A route's descriptors, device tables, host alias and alignment are built by its first launch
    (:func:`hicache_kernels.launch.gpu_route`) and reused: later calls issue one extension call.
    """

    name = "kernel"

    DESIGNS = ("register", "bulk")

    def __init__(
        self, num_blocks: int = 4, warps_per_block: int = 32, count_skipped: bool = False, design: str = "register"
    ) -> None:
        if design not in self.DESIGNS:
            raise ValueError(f"design: expected one of {', '.join(self.DESIGNS)}, got {design!r}")
        self.design = design
        self.last_design: str | None = None  # the design the last prepared copy uses
        self.last_design_reason: str | None = None  # why that is not the design asked for
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: expected a positive int, got {num_blocks!r}")
        if not isinstance(warps_per_block, int) or not 1 <= warps_per_block <= 32:
            raise ValueError(f"warps_per_block: expected an int in [1, 32], got {warps_per_block!r}")
        self.num_blocks = num_blocks
        self.warps_per_block = warps_per_block
        self.count_skipped = count_skipped
        self._skipped: dict[torch.device, _SkipCounter] = {}

    def _skip_counter(self, device: torch.device) -> _SkipCounter:
        if device not in self._skipped:
            self._skipped[device] = _SkipCounter(torch.zeros(1, dtype=torch.int32, device=device))
        return self._skipped[device]

    def skipped(self) -> int:
        """Units skipped for out-of-range indices since the last call. Waits for the counting kernels
        issued so far on any stream (each counter's device's current stream waits for their events) and
        syncs with that stream."""
        if not self.count_skipped:
            raise ValueError("count_skipped: this KernelBackend was built without count_skipped=True")
        return sum(counter.read_and_reset(device) for device, counter in list(self._skipped.items()))

    def unavailable(self, plan: TransferPlan) -> str | None:
        reason = cuda_reason(plan)
        if reason is not None:
            return reason
        ok, reason = cuda_runtime_status()
        return pinned_reason(plan) if ok else reason

    def _prepare(self, plan: TransferPlan) -> Callable[[], None]:
        n = plan.src_indices.numel()
        if n == 0:
            return nothing
        ext = load_extension()
        route = plan.route
        device = route.device
        handle, stream = stream_handle(plan)
        g = route.launch_state.get("gpu")
        counter: _SkipCounter | None = None
        counted_on: Any = None  # the stream a counting launch records its event on (None under capture)
        if g is None or handle not in g.recorded or self.count_skipped:
            # First launch of this route or on this stream: build (uploads, aliases) with the pool's
            # device current, where the capture check and the allocations must happen.
            with on_device(plan):
                capture = launch.capturing()
                g = launch.gpu_route(plan, capturing=capture)
                if not capture:
                    g.use_tables_on(handle, stream)
                if self.count_skipped:
                    counter = self._skip_counter(device)
                    if stream is None:
                        stream = torch.cuda.current_stream(device)  # the stream `handle` came from
                    if not capture:
                        counted_on = stream
        idx = self._launch_indices(plan, device, stream)
        args = (
            g.src_desc, route.src.is_table, g.dst_desc, route.dst.is_table, idx[0].data_ptr(), idx[1].data_ptr(), n,
            route.layer_begin, route.layer_count, route.num_kv, route.num_chunks, route.chunk_bytes, g.align,
            self.num_blocks, self.warps_per_block, 0 if counter is None else counter.tensor.data_ptr(), handle,
        )  # fmt: skip
        index = device.index
        self.last_design, self.last_design_reason = "register", None
        if self.design == "bulk":
            self.last_design_reason = self.bulk_unsupported(g.align, device)
            if self.last_design_reason is None:
                self.last_design = "bulk"
        if self.last_design == "bulk":
            launch_fn: Callable[[], None] = functools.partial(ext.transfer_bulk, *args)
        else:  # the store cache policy follows the destination: streaming to host memory only
            launch_fn = functools.partial(ext.transfer, *args, route.dst.is_host)

        def issue() -> None:
            with torch.cuda.device(index):  # the extension launches on the current device
                if counter is None:
                    launch_fn()
                else:
                    counter.counted_launch(launch_fn, handle, counted_on)
            _ = idx, plan  # the kernel reads these indices (device ones at every launch) and pools: keep them alive

        return issue

    @staticmethod
    def bulk_unsupported(align: int, device: torch.device) -> str | None:
        """Why the bulk-copy design cannot move a route with this alignment on ``device``, or None.

        It needs every address, stride and chunk a multiple of 16 bytes, an sm_90 or newer GPU, and the
        bulk kernel's image for that GPU compiled for sm_90+ (binaryVersion and ptxVersion >= 90): a
        build without sm_90 code reaches an H100 as older PTX the driver JIT-compiles, whose kernel
        body is only a trap. Otherwise ``design="bulk"`` uses the register kernel for that route, and
        ``last_design`` / ``last_design_reason`` say so: a fallback, not an error, as for alignment.
        """
        if align % 16:
            return f"addresses, strides and chunks are {align}-byte aligned; bulk copies need 16"
        major, minor = _compute_capability(device)
        if major < 9:
            return f"the GPU is sm_{major}{minor}; bulk copies need sm_90 or newer"
        image = _bulk_image(device)
        if isinstance(image, str):
            return f"the driver has no bulk-kernel image for {device}: {image}"
        binary, ptx = image
        if min(binary, ptx) < 90:
            loaded = f"sm_{binary} code" if binary == ptx else f"compute_{ptx} PTX JIT-compiled for sm_{binary}"
            return (f"bulk copies need sm_90 SASS; the bulk kernel's image for {device} is {loaded} (binaryVersion "
                    f"{binary}, ptxVersion {ptx}): the extension was built without sm_90+ code for it, e.g. "
                    f"for archs '8.0+PTX', and there its body only traps")  # fmt: skip
        return None

    @staticmethod
    def _launch_indices(plan: TransferPlan, device: torch.device, stream: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's index tensors on ``device``. Host indices are copied on the launch stream itself
        (``stream``, None for the current one): ordered before the kernel (a copy from pageable memory
        may still be in flight when it returns), and allocated for that stream."""
        s_idx, d_idx = plan.src_indices, plan.dst_indices
        if s_idx.device == device and d_idx.device == device:
            return s_idx, d_idx
        with torch.cuda.stream(stream):
            return (s_idx if s_idx.device == device else s_idx.to(device, non_blocking=True),
                    d_idx if d_idx.device == device else d_idx.to(device, non_blocking=True))  # fmt: skip


class TritonBackend(IOBackend):
    """Triton gather/scatter (see :mod:`hicache_kernels.triton_transfer`)."""

    name = "triton"

    def unavailable(self, plan: TransferPlan) -> str | None:
        if plan.route.on_cuda:
            return pinned_reason(plan)
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing triton"
        return None

    def _run(self, plan: TransferPlan) -> None:
        from .triton_transfer import run_triton

        run_triton(plan)


def _default_auto_path() -> Path:
    env = os.environ.get("HICACHE_AUTO_CONFIG")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "hicache_kernels" / "auto.json"


AUTO_DESIGNS = ("kernel", "kernel-bulk", "staged", "batch", "direct")
"""The designs ``auto`` chooses between, as its decision table and ``last_choice`` name them:
``kernel-bulk`` is ``kernel`` with ``design="bulk"``."""
_AUTO_DIRECTIONS = ("d2h", "h2d")


def fragment_bucket(fragment_bytes: int) -> int:
    """The decision table's bucket of a fragment size: the largest power of two not above it."""
    return 1 << (max(1, int(fragment_bytes)).bit_length() - 1)


class AutoBackend(IOBackend):
    """Chooses per call, by direction and estimated fragment size, the design a benchmark measured fastest.

    A fragment is a run of consecutive slots; callers allocate whole pages, so its size is estimated
    without looking at the indices (which may sit on the GPU) as ``item_bytes * page_size``
    (``chunk_bytes * page_size`` for ``page_head``), then bucketed to a power of two
    (:func:`fragment_bucket`). The decision table (``table``, written by ``bench --tune-auto``) holds,
    per direction (``d2h``/``h2d``) and measured bucket, the designs of :data:`AUTO_DESIGNS` ranked
    fastest first, measured with the kernels on ``sm_budget`` blocks, which is what auto's kernels
    use. A call takes the nearest measured bucket of its direction (by ratio; a tie goes to the
    smaller) and the first design in its ranking that can run the plan: available
    (``unavailable(plan)`` None), ``kernel-bulk`` only where bulk copies are supported (sm_90+,
    16-byte alignment), ``batch`` not on the legacy default stream; ``direct`` when none can. A
    direction the table does not hold uses the single-threshold rule: ``kernel`` below
    ``kernel_max_fragment_bytes``, else ``batch`` (on a non-default stream) or ``direct``.
    CPU tensors always go to ``direct``. ``last_choice`` names the design the last prepared call
    uses and ``last_reason`` says why.

    Settings load from ``HICACHE_AUTO_CONFIG`` or ``~/.config/hicache_kernels/auto.json`` (a JSON
    object: ``kernel_max_fragment_bytes``, and optionally ``sm_budget`` and ``table``, e.g.
    ``{"d2h": {"4096": ["kernel-bulk", "kernel", "batch", "direct", "staged"]}}``; a file with only
    ``kernel_max_fragment_bytes``, the format before the table, still loads) and :meth:`save` writes
    them, so a benchmark can re-tune. ``thresholds=`` takes the same object.
    """

    name = "auto"
    DEFAULTS = {"kernel_max_fragment_bytes": 256 * 1024}
    DEFAULT_SM_BUDGET = 4  # KernelBackend's default num_blocks
    KEYS = ("kernel_max_fragment_bytes", "sm_budget", "table")

    def __init__(self, thresholds: dict[str, Any] | None = None, path: Path | None = None) -> None:
        self.path = path or _default_auto_path()
        self.thresholds = dict(self.DEFAULTS)
        config: dict[str, Any] = {}
        where = "thresholds"
        if thresholds is None and self.path.exists():
            config, where = json.loads(self.path.read_text()), str(self.path)
            if not isinstance(config, dict):
                raise ValueError(f"{self.path}: expected a JSON object, got {type(config).__name__}")
            unknown = set(config) - set(self.KEYS)
            if unknown:
                raise ValueError(f"{self.path}: unknown auto thresholds {sorted(unknown)}")
        elif thresholds is not None:
            config = thresholds
            unknown = set(config) - set(self.KEYS)
            if unknown:
                raise ValueError(f"thresholds: unknown keys {sorted(unknown)}; expected {sorted(self.KEYS)}")
        if "kernel_max_fragment_bytes" in config:
            self.thresholds["kernel_max_fragment_bytes"] = int(config["kernel_max_fragment_bytes"])
        self.sm_budget = int(config.get("sm_budget", self.DEFAULT_SM_BUDGET))
        if self.sm_budget < 1:
            raise ValueError(f"{where}: sm_budget: expected an int >= 1, got {self.sm_budget}")
        self.table = self._parse_table(config.get("table", {}), where)
        self.kernel = KernelBackend(num_blocks=self.sm_budget)
        self.kernel_bulk = KernelBackend(num_blocks=self.sm_budget, design="bulk")
        self.staged = StagedBackend()
        self.batch = BatchBackend()
        self.direct = DirectBackend()
        self.last_choice: str | None = None
        self.last_reason: str | None = None

    @staticmethod
    def _parse_table(table: Any, where: str) -> dict[str, dict[int, tuple[str, ...]]]:
        """``table`` checked: directions, power-of-two buckets (JSON keys are strings), rankings of
        distinct known designs. ValueError naming ``where`` and the bad entry."""
        if not isinstance(table, dict):
            raise ValueError(f"{where}: table: expected an object of directions, got {type(table).__name__}")
        parsed: dict[str, dict[int, tuple[str, ...]]] = {}
        for direction, rows in table.items():
            if direction not in _AUTO_DIRECTIONS or not isinstance(rows, dict):
                raise ValueError(f"{where}: table: expected d2h/h2d mapping buckets to rankings, got {direction!r}")
            for bucket, ranking in rows.items():
                size = int(bucket) if isinstance(bucket, int) or str(bucket).isdigit() else 0
                if size < 1 or size & (size - 1):
                    raise ValueError(f"{where}: table[{direction}]: bucket {bucket!r} is not a power of two")
                if (not isinstance(ranking, list | tuple) or not ranking or len(set(ranking)) != len(ranking)
                        or set(ranking) - set(AUTO_DESIGNS)):  # fmt: skip
                    raise ValueError(f"{where}: table[{direction}][{bucket}]: expected distinct designs of "
                                     f"{', '.join(AUTO_DESIGNS)}, got {ranking!r}")  # fmt: skip
                parsed.setdefault(direction, {})[size] = tuple(ranking)
        return parsed

    def settings(self) -> dict[str, Any]:
        """What :meth:`save` writes: the threshold alone when there is no table (the old format)."""
        out: dict[str, Any] = dict(self.thresholds)
        if self.table or self.sm_budget != self.DEFAULT_SM_BUDGET:
            out["sm_budget"] = self.sm_budget
        if self.table:
            out["table"] = {d: {str(b): list(r) for b, r in sorted(rows.items())} for d, rows in self.table.items()}
        return out

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.settings(), indent=2) + "\n")
        return self.path

    def _ranking(self, direction: str, fragment: int) -> tuple[int, tuple[str, ...]] | None:
        """(measured bucket, ranking) nearest ``fragment`` in ``direction``'s table, or None."""
        rows = self.table.get(direction)
        if not rows:
            return None
        want = fragment_bucket(fragment).bit_length()
        best = min(rows, key=lambda b: (abs(b.bit_length() - want), b))
        return best, rows[best]

    def _design(self, name: str) -> IOBackend:
        return {"kernel": self.kernel, "kernel-bulk": self.kernel_bulk, "staged": self.staged,
                "batch": self.batch, "direct": self.direct}[name]  # fmt: skip

    def _why_not(self, name: str, plan: TransferPlan) -> str | None:
        """Why design ``name`` cannot run ``plan`` (CUDA tensors), or None."""
        if name == "batch" and plan_stream(plan).cuda_stream in _LEGACY_STREAM_HANDLES:
            return "the legacy default stream is refused by cudaMemcpyBatchAsync"
        reason = self._design(name).unavailable(plan)
        if reason is None and name == "kernel-bulk":
            g = plan.route.launch_state.get("gpu")  # the launch's alignment (host aliases included) once built
            align = g.align if g is not None else plan.route.alignment()
            reason = KernelBackend.bulk_unsupported(align, plan.route.device)
        return reason

    def decide(self, plan: TransferPlan) -> tuple[str, str]:
        """``(design, why)`` for ``plan``: see the class docstring."""
        if not plan.route.on_cuda:
            return "direct", "CPU tensors"
        fragment = plan.chunk_bytes * plan.route.page_size
        found = self._ranking(plan.direction, fragment)
        if found is None:
            limit = self.thresholds["kernel_max_fragment_bytes"]
            rule = f"no {plan.direction} table: threshold rule, {fragment} B fragments vs {limit} B"
            ranking: tuple[str, ...] = ("kernel", "batch", "direct") if fragment < limit else ("batch", "direct")
        else:
            bucket, ranking = found
            rule = f"{plan.direction} table, bucket {bucket} B (nearest to {fragment} B fragments)"
        skipped = []
        for name in (*ranking, "direct") if "direct" not in ranking else ranking:
            why = None if name == "direct" else self._why_not(name, plan)
            if why is None:
                return name, rule + "".join(f"; {s}" for s in skipped)
            skipped.append(f"{name} skipped: {why}")
        raise AssertionError("unreachable: direct always runs")

    def choose(self, plan: TransferPlan) -> IOBackend:
        return self._design(self.decide(plan)[0])

    def wants_host_indices(self, plan: TransferPlan) -> bool:
        return self.choose(plan).wants_host_indices(plan)

    def _prepare(self, plan: TransferPlan) -> Callable[[], None]:
        name, why = self.decide(plan)
        self.kernel_bulk.last_design = None  # set by a launch only (an empty copy launches nothing)
        copy = self._design(name).prepare(plan)
        if name == "kernel-bulk" and self.kernel_bulk.last_design == "register":
            # E.g. the launch's alignment (host aliases included) turned out below 16 bytes.
            why += f"; kernel-bulk ran the register kernel: {self.kernel_bulk.last_design_reason}"
            name = "kernel"
        self.last_choice, self.last_reason = name, why
        return copy


_FACTORIES: dict[str, Callable[..., IOBackend]] = {
    "direct": DirectBackend,
    "batch": BatchBackend,
    "kernel": KernelBackend,
    "triton": TritonBackend,
    "auto": AutoBackend,
    "staged": StagedBackend,
}
assert tuple(_FACTORIES) == IO_BACKENDS, "hicache_kernels._names.IO_BACKENDS lists the backends defined here"
_DEFAULTS: dict[str, IOBackend] = {}


def get_backend(name: str | IOBackend, **options: Any) -> IOBackend:
    """An io-backend by name (``direct``, ``batch``, ``kernel``, ``triton``, ``auto``, ``staged``).

    Without options the shared instance is returned (its caches live across calls); with options a
    new one is built, e.g. ``get_backend("kernel", num_blocks=2)``.
    """
    if isinstance(name, IOBackend):
        if options:
            raise ValueError("options: cannot be combined with a backend instance")
        return name
    if not isinstance(name, str):  # before the lookup: an unhashable name would raise an unrelated TypeError
        raise TypeError(f"backend: expected a backend name (str) or an IOBackend, got {type(name).__name__}")
    if name not in _FACTORIES:
        raise ValueError(f"backend: expected one of {', '.join(IO_BACKENDS)}, got {name!r}")
    if options:
        return _FACTORIES[name](**options)
    if name not in _DEFAULTS:
        _DEFAULTS[name] = _FACTORIES[name]()
    return _DEFAULTS[name]
