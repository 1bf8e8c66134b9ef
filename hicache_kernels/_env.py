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
class BackendStatus:
    usable: bool
    reason: str


def io_backend_status(gpus: list[GpuInfo] | None = None) -> dict[str, BackendStatus]:
    """Whether each io-backend can run on this machine, and why not when it cannot."""
    torch, torch_reason = _torch_cuda()
    if gpus is None:
        gpus, _ = list_gpus()
    mod, ext_reason = _load()
    runtime_ok, runtime_reason = _ext.cuda_runtime_status()
    status: dict[str, BackendStatus] = {}
    try:
        importlib.import_module("torch")
        if torch is None:
            direct = "torch indexing on CPU tensors"
        elif runtime_ok:
            direct = "copy engines (cudaMemcpyAsync) on CUDA tensors"
        else:
            direct = (
                f"torch copies (cudaMemcpyAsync through torch) on CUDA tensors, not the extension: {runtime_reason}"
            )
        status["direct"] = BackendStatus(True, direct)
    except ImportError as exc:
        status["direct"] = BackendStatus(False, f"torch does not import: {exc}")
    if mod is None:
        gpu_reason = ext_reason
    elif not runtime_ok:
        gpu_reason = runtime_reason
    elif torch is None:
        gpu_reason = torch_reason
    elif not any(g.kernels_cover_arch for g in gpus):
        gpu_reason = "no visible GPU is covered by the compiled archs: " + "; ".join(g.coverage for g in gpus)
    else:
        gpu_reason = ""
    status["kernel"] = BackendStatus(not gpu_reason, gpu_reason or "zero-copy SM kernels over pinned host memory")
    if gpu_reason:
        status["batch"] = BackendStatus(False, gpu_reason)
    else:
        drv = _ext.driver_version()
        ok = drv >= 12080
        status["batch"] = BackendStatus(
            ok,
            "cudaMemcpyBatchAsync" if ok else f"driver supports CUDA {_version(drv)} < 12.8; falls back to 'direct'",
        )
    try:
        importlib.import_module("triton")
        if torch is not None:
            status["triton"] = BackendStatus(True, "Triton kernels on the GPU")
        elif os.environ.get("TRITON_INTERPRET") == "1":
            status["triton"] = BackendStatus(True, "Triton interpreter on CPU tensors (TRITON_INTERPRET=1; slow)")
        else:
            status["triton"] = BackendStatus(False, f"{torch_reason}; set TRITON_INTERPRET=1 to run on CPU tensors")
    except ImportError as exc:
        status["triton"] = BackendStatus(False, f"triton does not import: {exc}")
    if not status["direct"].usable:
        status["staged"] = BackendStatus(False, status["direct"].reason)
    elif torch is None:
        status["staged"] = BackendStatus(True, "torch packing and copies on CPU tensors")
    else:
        copies = "copy engines" if runtime_ok else f"torch copies (not the extension: {runtime_reason})"
        status["staged"] = BackendStatus(
            True, f"torch gather into a GPU staging buffer, then {copies} per host run (needs a pinned host pool)"
        )
    picks = [n for n in ("kernel", "batch", "direct") if status[n].usable]
    status["auto"] = BackendStatus(bool(picks), "chooses among: " + ", ".join(picks) if picks else "nothing usable")
    return status


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
