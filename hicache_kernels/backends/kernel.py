"""The ``kernel`` io-backend: the CUDA kernels of ``csrc/`` on a bounded grid.

SM threads read and write pinned host memory through its device-mapped address (zero copy), on
``num_blocks`` blocks (CTAs) of ``warps_per_block`` warps. The default is the warps of 4 SMs
(:data:`DEFAULT_SM_BUDGET`) cut into 8-warp CTAs: 16 CTAs of 256 threads for the register kernel
(a 1024-thread CTA cannot become resident on an SM where a GEMM or attention CTA leaves less than
a whole CTA's threads or registers free, so a layer load waited for SMs to drain), and 4 CTAs of
the bulk kernel (2 warps and its ring each). :meth:`KernelBackend.for_sm_budget` builds that shape
for any budget. Two designs:
``register`` (loads and stores through registers) and ``bulk`` (the bulk-copy kernel, sm_90+ with
16-byte alignment; elsewhere the register kernel runs and :class:`KernelBackend` says why).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import launch
from .._ext import cuda_runtime_status, load_extension
from ..plan import TransferPlan
from .base import IOBackend, cuda_reason, device_indices, nothing, on_device, pinned_reason, prepare_gpu_launch

__all__ = ["DEFAULT_SM_BUDGET", "DEFAULT_WARPS_PER_BLOCK", "KernelBackend", "blocks_for_sm_budget"]

#: SMs' worth of warps the kernel backend uses by default (and ``auto``'s default budget).
DEFAULT_SM_BUDGET = 4
#: The register kernel's default CTA: 8 warps. Small enough to sit beside another kernel's CTAs on
#: an SM (Hopper: 64 warps and 64 Ki registers per SM), large enough that a CTA's issue overhead
#: stays small. Not yet measured against 32-warp CTAs on a GPU (the first GPU run used 4 x 32).
DEFAULT_WARPS_PER_BLOCK = 8
_WARPS_PER_SM = 32  # a budget of B SMs: the warps of B full 1024-thread CTAs


def blocks_for_sm_budget(
    sm_budget: int, design: str = "register", warps_per_block: int = DEFAULT_WARPS_PER_BLOCK
) -> int:
    """CTAs for a budget of ``sm_budget`` SMs' worth of work.

    The register kernel gets ``sm_budget * 32 / warps_per_block`` CTAs (the warps of ``sm_budget``
    SMs at 32 warps each, rounded up to whole CTAs); the bulk kernel, whose CTA is two warps and a
    ring of at most 32 KiB, one CTA per SM of the budget.
    """
    if not isinstance(sm_budget, int) or isinstance(sm_budget, bool) or sm_budget < 1:
        raise ValueError(f"sm_budget: expected a positive int, got {sm_budget!r}")
    if not isinstance(warps_per_block, int) or not 1 <= warps_per_block <= 32:
        raise ValueError(f"warps_per_block: expected an int in [1, 32], got {warps_per_block!r}")
    if design == "bulk":
        return sm_budget
    if design != "register":
        raise ValueError(f"design: expected one of register, bulk, got {design!r}")
    return -(-sm_budget * _WARPS_PER_SM // warps_per_block)


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

    Parameters
    ----------
    num_blocks : int, optional
        CTAs of the grid (at most that many busy at once). Default: :data:`DEFAULT_SM_BUDGET` SMs'
        worth (:func:`blocks_for_sm_budget`): 16 for the register design, 4 for the bulk one.
    warps_per_block : int
        Warps per CTA of the register kernel, in [1, 32] (default 8). The bulk kernel's CTA is
        always two warps.
    count_skipped : bool
        Make the kernels count the work units they skip for an out-of-range index (in fast mode,
        ``check_indices=False``) in a device counter, without any sync; :meth:`skipped` reads it (one
        sync) and resets it. A unit is one (index pair, K/V, layer, chunk). Each counting launch
        records an event on its stream (not under graph capture), so the read waits for counting
        kernels on any stream, such as a controller's copy streams.
    design : str
        ``"register"`` or ``"bulk"``: the bulk-copy kernel where it can run (:meth:`bulk_unsupported`)
        and the register kernel elsewhere; ``last_design`` names the design the last prepared copy
        uses and ``last_design_reason`` says why it is not the bulk one asked for (None otherwise).

    Notes
    -----
    A route's descriptors, device tables, host alias and alignment are built by its first launch
    (:func:`~hicache_kernels.backends.base.prepare_gpu_launch`) and reused: later calls issue one
    extension call.
    """

    name = "kernel"

    DESIGNS = ("register", "bulk")

    def __init__(
        self,
        num_blocks: int | None = None,
        warps_per_block: int = DEFAULT_WARPS_PER_BLOCK,
        count_skipped: bool = False,
        design: str = "register",
    ) -> None:
        if design not in self.DESIGNS:
            raise ValueError(f"design: expected one of {', '.join(self.DESIGNS)}, got {design!r}")
        self.design = design
        self.last_design: str | None = None  # the design the last prepared copy uses
        self.last_design_reason: str | None = None  # why that is not the design asked for
        if not isinstance(warps_per_block, int) or not 1 <= warps_per_block <= 32:
            raise ValueError(f"warps_per_block: expected an int in [1, 32], got {warps_per_block!r}")
        if num_blocks is None:
            num_blocks = blocks_for_sm_budget(DEFAULT_SM_BUDGET, design, warps_per_block)
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: expected a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.warps_per_block = warps_per_block
        self.count_skipped = count_skipped
        self._skipped: dict[torch.device, _SkipCounter] = {}

    @classmethod
    def for_sm_budget(cls, sm_budget: int, design: str = "register", **kwargs: Any) -> KernelBackend:
        """A backend on ``sm_budget`` SMs' worth of CTAs (:func:`blocks_for_sm_budget`), with
        ``warps_per_block`` and the other arguments as the constructor takes them."""
        warps = kwargs.pop("warps_per_block", DEFAULT_WARPS_PER_BLOCK)
        blocks = blocks_for_sm_budget(sm_budget, design, warps)
        return cls(num_blocks=blocks, warps_per_block=warps, design=design, **kwargs)

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

    def warm(self, plan: TransferPlan) -> bool:
        """Load the kernel ``plan``'s route launches (CUDA loads each kernel's module at its first launch
        under lazy loading, the default): one launch whose out-of-range pairs are skipped, not counted."""
        if self.unavailable(plan) is not None:
            return False
        self._prepare(plan, count=False)()
        return True

    def _prepare(self, plan: TransferPlan, count: bool = True) -> Callable[[], None]:
        n = plan.src_indices.numel()
        if n == 0:
            return nothing
        ext = load_extension()
        route = plan.route
        device = route.device
        g, handle, stream = prepare_gpu_launch(plan)
        counter: _SkipCounter | None = None
        counted_on: Any = None  # the stream a counting launch records its event on (None under capture)
        if self.count_skipped and count:
            with on_device(plan):
                counter = self._skip_counter(device)
                if stream is None:
                    stream = torch.cuda.current_stream(device)  # the stream `handle` came from
                if not launch.capturing():
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

    # The plan's indices on the launch device (a method, so a test without a GPU can replace it).
    _launch_indices = staticmethod(device_indices)
