"""The GPU's PCIe link as NVML reports it: a device's NVML handle, link facts, theoretical bandwidth."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .. import _env


def nvml_for_device(index: int, uuid: str | None = None) -> tuple[Any | None, Any | None, str]:
    """``(nvml, handle, "ok")`` for a CUDA device, or ``(None, None, reason)``."""
    nvml, reason = _env._nvml()
    if nvml is None:
        return None, None, reason
    try:
        return nvml, _env._nvml_handle(nvml, index, uuid), "ok"
    except Exception as exc:
        return None, None, f"NVML has no handle for device {index}: {type(exc).__name__}: {exc}"


def cuda_device_uuid(index: int) -> str | None:
    """The CUDA device's UUID as torch reports it (NVML and torch may number GPUs differently)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return str(getattr(props, "uuid", "") or "") or None


def link_facts(nvml: Any | None, handle: Any, reason: str = "ok") -> dict[str, Any]:
    """The PCIe link as NVML reports it now (generation, width, theoretical GB/s), or its ``error``."""
    if nvml is None:
        return asdict(_env.PcieLink(error=reason))
    return asdict(_env._pcie(nvml, handle))


def theoretical_of(link: dict[str, Any]) -> float | None:
    """The link's theoretical one-direction GB/s: at its max generation/width (links train down when
    idle, so the current one read before a run often says Gen1), else the current one."""
    return link.get("max_gbps") or link.get("current_gbps")


def device_link(index: int) -> tuple[float | None, dict[str, Any]]:
    """A CUDA device's theoretical one-direction GB/s (None when NVML cannot say) and its link facts
    (``error`` says why not)."""
    nvml, handle, reason = nvml_for_device(index, cuda_device_uuid(index))
    link = link_facts(nvml, handle, reason)
    return theoretical_of(link), link
