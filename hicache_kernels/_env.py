"""Facts about this machine: CUDA runtime and driver, GPUs, PCIe links, and which io-backends can run.

Every probe here degrades to a reason string instead of raising, so ``python -m hicache_kernels.info``
works on a machine with no GPU, no driver, no NVML or no compiled extension.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from . import _archs, _ext
from ._ext import _load, build_info

# Bytes per second per lane, per direction, after line encoding (8b/10b up to Gen2, 128b/130b for
# Gen3-5, FLIT 242/256 for Gen6), in GB/s (1e9 B/s). Packet (TLP/DLLP) overhead is not subtracted.
PCIE_LANE_GBPS = {
    1: 0.25,
    2: 0.5,
    3: 8 * 128 / 130 / 8,
    4: 16 * 128 / 130 / 8,
    5: 32 * 128 / 130 / 8,
    6: 64 * 242 / 256 / 8,
}


def pcie_theoretical_gbps(generation: int, width: int) -> float | None:
    """Theoretical one-direction bandwidth in GB/s of a PCIe link, or None for an unknown generation."""
    lane = PCIE_LANE_GBPS.get(int(generation))
    return None if lane is None or width <= 0 else round(lane * width, 2)


def _version(v: int) -> str | None:
    """CUDA's integer versions (13000, 12080) as "13.0", "12.8"; None for 0 (no driver)."""
    return None if not v else f"{v // 1000}.{(v % 1000) // 10}"


@dataclass
class PcieLink:
    current_generation: int | None = None
    max_generation: int | None = None
    current_width: int | None = None
    max_width: int | None = None
    current_gbps: float | None = None
    max_gbps: float | None = None
    error: str | None = None


@dataclass
class GpuInfo:
    index: int
    name: str
    compute_capability: str | None
    sm_count: int | None
    memory_gib: float | None
    uuid: str | None = None
    kernels_cover_arch: bool | None = None
    coverage: str = ""
    pcie: PcieLink = field(default_factory=PcieLink)


@functools.lru_cache(maxsize=1)
def _nvml() -> tuple[Any | None, str]:
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return None, f"NVML unavailable: {type(exc).__name__}: {exc}"
    return pynvml, "ok"


def _torch_cuda() -> tuple[Any | None, str]:
    try:
        import torch
    except ImportError as exc:
        return None, f"torch does not import: {exc}"
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return None, f"torch {torch.__version__} is a CPU-only build"
        return None, "torch.cuda.is_available() is False (no GPU visible or no driver)"
    return torch, "ok"


def _pcie(nvml: Any, handle: Any) -> PcieLink:
    link = PcieLink()
    try:
        link.current_generation = int(nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))
        link.max_generation = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
        link.current_width = int(nvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
        link.max_width = int(nvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
    except Exception as exc:
        link.error = f"{type(exc).__name__}: {exc}"
        return link
    link.current_gbps = pcie_theoretical_gbps(link.current_generation, link.current_width)
    link.max_gbps = pcie_theoretical_gbps(link.max_generation, link.max_width)
    return link


def _nvml_handle(nvml: Any, index: int, uuid: str | None) -> Any:
    if uuid:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception:
            pass
    return nvml.nvmlDeviceGetHandleByIndex(index)


def list_gpus() -> tuple[list[GpuInfo], list[str]]:
    """Visible GPUs (from torch, else from NVML) and notes on whatever could not be read."""
    notes: list[str] = []
    gpus: list[GpuInfo] = []
    torch, torch_reason = _torch_cuda()
    nvml, nvml_reason = _nvml()
    if nvml is None:
        notes.append(nvml_reason)
    if torch is not None:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            uuid = str(getattr(p, "uuid", "") or "") or None
            gpus.append(
                GpuInfo(
                    i, p.name, f"{p.major}.{p.minor}", p.multi_processor_count, round(p.total_memory / 2**30, 2), uuid
                )
            )
    else:
        notes.append(torch_reason)
        if nvml is not None:
            for i in range(nvml.nvmlDeviceGetCount()):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
                name = nvml.nvmlDeviceGetName(h)
                mem = nvml.nvmlDeviceGetMemoryInfo(h).total
                gpus.append(GpuInfo(i, str(name), f"{major}.{minor}", None, round(mem / 2**30, 2), None))
    if nvml is not None:
        for g in gpus:
            try:
                g.pcie = _pcie(nvml, _nvml_handle(nvml, g.index, g.uuid))
            except Exception as exc:
                g.pcie = PcieLink(error=f"{type(exc).__name__}: {exc}")
    elif gpus:
        for g in gpus:
            g.pcie = PcieLink(error=nvml_reason)
    _mark_coverage(gpus, torch is not None)
    return gpus, notes


def _mark_coverage(gpus: list[GpuInfo], can_launch: bool) -> None:
    info = build_info()
    if not info["cuda_built"]:
        for g in gpus:
            g.kernels_cover_arch, g.coverage = False, "CUDA extension not built"
        return
    archs = _archs.parse_arch_list(";".join(info["archs"]), supported=None)
    mod, _ = _load()
    # Only a driver that can run the extension's runtime can be asked (else the arch table answers).
    ask_driver = can_launch and mod is not None and _ext.cuda_runtime_status()[0]
    for g in gpus:
        major, minor = (int(x) for x in (g.compute_capability or "0.0").split("."))
        g.kernels_cover_arch, g.coverage = _archs.covers(archs, major, minor)
        if ask_driver:
            # Ask the driver itself: the authoritative answer, and it catches a broken image.
            try:
                binary, ptx = mod.kernel_image_versions(g.index)
                g.kernels_cover_arch, g.coverage = True, f"driver loads binaryVersion {binary}, ptxVersion {ptx}"
            except RuntimeError as exc:
                g.kernels_cover_arch, g.coverage = False, str(exc)


def cuda_versions() -> dict[str, Any]:
    """CUDA runtime versions (the extension's static one, torch's) and the driver's, with reasons."""
    out: dict[str, Any] = {"extension_runtime": None, "torch_cuda": None, "driver_cuda": None, "driver": None}
    mod, reason = _load()
    if mod is not None:
        out["extension_runtime"] = _version(mod.runtime_version())
        try:
            out["driver_cuda"] = _version(_ext.driver_version())
        except RuntimeError as exc:
            out["driver_error"] = str(exc)
        if out["driver_cuda"] is None and "driver_error" not in out:
            out["driver_error"] = "no CUDA driver installed (cudaDriverGetVersion returned 0)"
        ok, reason = _ext.cuda_runtime_status()
        if not ok:
            # The static runtime cannot run here: kernel and batch are unusable, direct uses torch.
            out["extension_runtime_error"] = reason
    else:
        out["extension_error"] = reason
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    nvml, nvml_reason = _nvml()
    if nvml is not None:
        try:
            drv = nvml.nvmlSystemGetDriverVersion()
            out["driver"] = drv.decode() if isinstance(drv, bytes) else str(drv)
            if out["driver_cuda"] is None:
                out["driver_cuda"] = _version(nvml.nvmlSystemGetCudaDriverVersion())
        except Exception as exc:
            out.setdefault("driver_error", f"{type(exc).__name__}: {exc}")
    else:
        out.setdefault("driver_error", nvml_reason)
    return out


@dataclass
class TensorStatus:
    """What a call of an io-backend does on one kind of tensors here: ``usable``, then how it copies, else
    why it cannot (what the call raises)."""

    usable: bool
    reason: str

    def __str__(self) -> str:
        return f"{'usable' if self.usable else 'unusable'}: {self.reason}"


@dataclass
class BackendStatus:
    """An io-backend here: a call on CPU tensors (``cpu``: found by making one, :func:`cpu_backend_status`)
    and on CUDA tensors (``cuda``: from the extension, the driver, the GPUs and torch,
    :func:`cuda_backend_status`). ``usable``: on either; ``reason``: both in one line."""

    cpu: TensorStatus
    cuda: TensorStatus
    usable: bool = field(init=False)
    reason: str = field(init=False)

    def __post_init__(self) -> None:
        self.usable = self.cpu.usable or self.cuda.usable
        self.reason = f"on CPU tensors: {self.cpu}; on CUDA tensors: {self.cuda}"


@dataclass
class AutoStatus(BackendStatus):
    """``auto`` here, and also: ``choices`` (``cpu``, ``cuda``: the designs a call can take here, in
    ``AUTO_DESIGNS`` order), ``designs`` (each of ``AUTO_DESIGNS`` on CUDA tensors) and ``ranking``
    (its settings file: ``path``, ``named_by``, ``exists``; ``designs``: those its table or threshold
    rule ranks, :meth:`~hicache_kernels.backends.AutoBackend.candidates`; ``rule``: how it ranks them;
    ``kernel_max_fragment_bytes``, ``sm_budget``, ``table``; or ``error``: why the settings do not load)."""

    choices: dict[str, list[str]] = field(default_factory=dict)
    designs: dict[str, TensorStatus] = field(default_factory=dict)
    ranking: dict[str, Any] = field(default_factory=dict)


# How each io-backend copies CPU tensors (backends/*.py); auto says what it took.
_CPU_HOW = {
    "direct": "torch copies of the plan's fragments (runs of consecutive slots)",
    "batch": "torch copies of the fragments split into 1-D pieces (no cudaMemcpyBatchAsync on CPU tensors)",
    "triton": "the Triton interpreter (TRITON_INTERPRET=1; slow)",
    "staged": "torch gather/scatter through a CPU staging buffer and a torch copy per host run",
}


def cpu_backend_status() -> dict[str, TensorStatus]:
    """Each io-backend called here as a caller would (``get_backend(name)``, ``unavailable``, ``run``) on
    a two-slot ``d2h`` plan over CPU tensors: usable when it copied the plan's bytes, else its
    ``unavailable`` reason or what the call raised."""
    from ._names import IO_BACKENDS

    try:
        import torch

        from . import ops
        from .backends import get_backend
    except ImportError as exc:
        return {name: TensorStatus(False, f"does not import: {exc}") for name in IO_BACKENDS}
    out: dict[str, TensorStatus] = {}
    k = torch.arange(8, dtype=torch.float32).reshape(1, 2, 1, 4)  # [layers, slots, heads, head_dim]
    v = k + 8
    idx = torch.arange(2)
    for name in IO_BACKENDS:
        host = torch.full((2, 1, 2, 1, 4), -1.0)  # layer_first: [K/V, layers, slots, heads, head_dim], poisoned
        try:
            backend = get_backend(name)
            plan = ops.build_plan("d2h", k, v, host, idx, idx, layout="layer_first", page_size=1)
            why = backend.unavailable(plan)
            if why is None:
                backend.run(plan)
                if not (torch.equal(host[0], k) and torch.equal(host[1], v)):
                    why = "ran, but did not copy the plan's bytes"
        except Exception as exc:  # what the call raises is the reason
            why = str(exc) or type(exc).__name__
        if why is not None:
            out[name] = TensorStatus(False, why)
        elif name == "auto":
            out[name] = TensorStatus(True, f"takes {backend.last_choice} ({backend.last_reason})")
        else:
            out[name] = TensorStatus(True, _CPU_HOW.get(name, "copies the plan"))
    return out


def cuda_backend_status(gpus: list[GpuInfo]) -> dict[str, TensorStatus]:
    """What a call of each io-backend (and ``kernel-bulk``, auto's bulk design of ``kernel``) does on CUDA
    tensors here, from the extension, its runtime, the driver, the GPUs and torch: the checks the
    backends make (``unavailable``, ``run_triton``, ``bulk_unsupported``) and what they fall back to."""
    torch, torch_reason = _torch_cuda()
    runtime_ok, runtime_reason = _ext.cuda_runtime_status()  # not ok without the extension, too: its reason
    out: dict[str, TensorStatus] = {}
    if torch is None:
        out["direct"] = TensorStatus(False, torch_reason)
    elif runtime_ok:
        out["direct"] = TensorStatus(True, "copy engines: a cudaMemcpyAsync (2-D for strided rows) per run of slots")
    else:
        out["direct"] = TensorStatus(True, f"torch copies of the same fragments, not the extension: {runtime_reason}")
    needs = runtime_reason if not runtime_ok else (torch_reason if torch is None else None)
    if needs is not None:
        out["batch"] = TensorStatus(False, needs)
    else:
        built, drv = _ext._runtime_cuda_version(), _ext.driver_version()
        fallback = "falls back to direct (copy engines) with a warning and last_fallback"
        if built < 12080:
            batch = f"{fallback}: the extension's CUDA {_version(built)} has no cudaMemcpyBatchAsync (12.8+)"
        elif drv < 12080:
            batch = f"{fallback}: the driver supports CUDA {_version(drv)}; cudaMemcpyBatchAsync needs 12.8"
        else:
            batch = "one cudaMemcpyBatchAsync of the fragments' 1-D pieces (direct on the legacy default stream)"
        out["batch"] = TensorStatus(True, batch)
    covered = [g for g in gpus if g.kernels_cover_arch]
    if needs is None and not covered:
        listed = "; ".join(g.coverage for g in gpus)
        needs = f"no visible GPU is covered by the compiled archs: {listed}" if gpus else "no GPU visible"
    kernel = "zero-copy SM kernels (register design) over a pinned host pool"
    out["kernel"] = TensorStatus(needs is None, needs or kernel)
    if needs is not None:
        out["kernel-bulk"] = out["kernel"]
    else:
        import torch as torch_module  # the module itself (``torch`` above is what _torch_cuda found usable)

        from .backends.kernel import KernelBackend

        whys = []
        for g in covered:
            try:  # what auto asks of a route; 16: the alignment is the plan's, not the machine's
                why = KernelBackend.bulk_unsupported(16, torch_module.device("cuda", g.index))
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
            if why is None:
                break
            whys.append(f"GPU {g.index}: {why}")
        else:
            out["kernel-bulk"] = TensorStatus(False, "; ".join(whys))
        out.setdefault("kernel-bulk", TensorStatus(True, "the bulk-copy kernel (sm_90+) on 16-byte-aligned routes"))
    try:
        importlib.import_module("triton")
        if torch is None:
            out["triton"] = TensorStatus(False, torch_reason)
        elif os.environ.get("TRITON_INTERPRET") == "1":
            out["triton"] = TensorStatus(False, "TRITON_INTERPRET=1 is set: the interpreter cannot run CUDA tensors")
        else:
            out["triton"] = TensorStatus(True, "compiled Triton gather/scatter, zero copy over a pinned host pool")
    except Exception as exc:  # ImportError, or a broken install failing at import time
        out["triton"] = TensorStatus(False, f"triton does not import: {exc}")
    if torch is None:
        out["staged"] = TensorStatus(False, torch_reason)
    else:
        copies = "the extension's copy engines" if runtime_ok else f"torch copies (not the extension: {runtime_reason})"
        out["staged"] = TensorStatus(
            True, f"torch packing into a GPU staging buffer, then {copies} per host run (needs a pinned host pool)"
        )
    return out


def _never(name: str, ranked: list[str], cuda: dict[str, TensorStatus]) -> str:
    """Why auto never takes design ``name`` on CUDA tensors here, in a few words."""
    if name not in ranked:
        return "not ranked"
    if name == "kernel-bulk" and cuda["kernel"].usable:
        return cuda[name].reason  # the bulk kernel's own reason (the GPU, its image), not kernel's
    return "unusable here"


def auto_status(cpu: TensorStatus, cuda: dict[str, TensorStatus]) -> AutoStatus:
    """``auto`` here: on CPU tensors as :func:`cpu_backend_status` found it (the design its call took),
    on CUDA tensors the designs its ranking holds that can run here, and where that ranking comes from."""
    from .backends.auto import AUTO_DESIGNS, auto_config_path

    path, named_by = auto_config_path()
    ranking: dict[str, Any] = {"path": str(path), "named_by": named_by, "exists": path.exists()}
    designs = {name: cuda[name] for name in AUTO_DESIGNS}
    try:
        from .backends import get_backend

        auto = get_backend("auto")  # the instance the CPU call used: its settings, its last choice
    except Exception as exc:  # settings that do not load: get_backend("auto") raises this for every call
        ranking["error"] = f"{type(exc).__name__}: {exc}"
        why = TensorStatus(False, str(exc))
        return AutoStatus(cpu, why, {"cpu": [], "cuda": []}, designs, ranking)
    limit = auto.thresholds["kernel_max_fragment_bytes"]
    tables = auto.settings().get("table", {})
    ranking.update(designs=list(auto.candidates()), kernel_max_fragment_bytes=limit, sm_budget=auto.sm_budget,
                   table=tables)  # fmt: skip
    threshold = f"the threshold rule (kernel below {limit} B fragments, else batch)"
    where = f"{path} ({named_by})"
    if not tables:
        said = "does not exist" if not ranking["exists"] else "holds no table"
        ranking["rule"] = f"by {threshold}, direct last: {where} {said}"
    else:
        parts = [f"{d} {len(tables[d])} buckets" if d in tables else f"{d} by {threshold}" for d in ("d2h", "h2d")]
        ranking["rule"] = f"by the table in {where}, its own order per bucket: {', '.join(parts)}; direct last"
    choices = {"cpu": [auto.last_choice] if cpu.usable and auto.last_choice else []}
    if not cuda["direct"].usable:
        choices["cuda"] = []
        on_cuda = TensorStatus(False, cuda["direct"].reason)
    else:
        choices["cuda"] = [name for name in auto.candidates() if cuda[name].usable]
        never = [f"{name} ({_never(name, ranking['designs'], cuda)})" for name in AUTO_DESIGNS
                 if name not in choices["cuda"]]  # fmt: skip
        if len(choices["cuda"]) > 1:
            said = f"the first of its ranking that can run the plan, among {', '.join(choices['cuda'])}"
        else:
            said = f"always {choices['cuda'][0]}"
        on_cuda = TensorStatus(True, said + (f"; never {', '.join(never)}" if never else ""))
    return AutoStatus(cpu, on_cuda, choices, designs, ranking)


def io_backend_status(gpus: list[GpuInfo] | None = None) -> dict[str, BackendStatus]:
    """What a call of each io-backend does here, on CPU tensors and on CUDA tensors: usable and how it
    copies, or why it cannot."""
    from ._names import IO_BACKENDS

    if gpus is None:
        gpus, _ = list_gpus()
    cpu = cpu_backend_status()
    cuda = cuda_backend_status(gpus)
    return {name: auto_status(cpu[name], cuda) if name == "auto" else BackendStatus(cpu[name], cuda[name])
            for name in IO_BACKENDS}  # fmt: skip


def gather() -> dict[str, Any]:
    """Everything ``python -m hicache_kernels.info`` reports, as JSON-ready data."""
    from . import __version__

    report: dict[str, Any] = {"package": {"name": "hicache-kernels", "version": __version__}}
    report["build"] = build_info()
    try:
        import torch

        report["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda}
    except ImportError as exc:
        report["torch"] = {"version": None, "error": str(exc)}
    try:
        import triton

        report["triton"] = {"version": triton.__version__}
    except ImportError as exc:
        report["triton"] = {"version": None, "error": str(exc)}
    report["cuda"] = cuda_versions()
    gpus, notes = list_gpus()
    report["gpus"] = [asdict(g) for g in gpus]
    report["notes"] = notes
    report["io_backends"] = {k: asdict(v) for k, v in io_backend_status(gpus).items()}
    return report
