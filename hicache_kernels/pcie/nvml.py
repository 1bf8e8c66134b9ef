"""NVML's PCIe throughput counters, sampled in background threads while a pcie point runs."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

# NVML reports PCIe throughput in KB/s over a ~20 ms window; taken as 1024-byte KB.
NVML_KB = 1024
NVML_WINDOW_S = 0.02


class NvmlPcieSampler:
    """Samples NVML's PCIe TX and RX throughput counters in two background threads.

    Each ``nvmlDeviceGetPcieThroughput`` call measures a ~20 ms window and returns KB/s; a sample is
    kept with its start and end time. TX is what the GPU sends (device to host), RX what it receives.
    :meth:`begin`/:meth:`end` bracket a point: the samples whose window lies wholly inside it.

    Parameters
    ----------
    nvml
        The ``pynvml`` module (or a fake with ``nvmlDeviceGetPcieThroughput`` and the two constants).
    handle
        The NVML device handle.
    gap_s
        Pause between two samples of one counter.
    """

    def __init__(self, nvml: Any, handle: Any, gap_s: float = 0.001, clock: Callable[[], float] = time.monotonic):
        self.nvml = nvml
        self.handle = handle
        self.gap_s = gap_s
        self.clock = clock
        self.counters = {
            "tx": getattr(nvml, "NVML_PCIE_UTIL_TX_BYTES", 0),
            "rx": getattr(nvml, "NVML_PCIE_UTIL_RX_BYTES", 1),
        }
        self.samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in self.counters}
        self.errors: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _loop(self, name: str, counter: int) -> None:
        while not self._stop.is_set():
            t_a = self.clock()
            try:
                kbps = self.nvml.nvmlDeviceGetPcieThroughput(self.handle, counter)
            except Exception as exc:  # NVMLError_NotSupported etc.: stop this counter, keep the reason
                with self._lock:
                    self.errors[name] = f"{type(exc).__name__}: {exc}"
                return
            t_b = self.clock()
            with self._lock:
                self.samples[name].append((t_a, t_b, float(kbps) * NVML_KB / 1e9))
            self._stop.wait(self.gap_s)

    def start(self) -> NvmlPcieSampler:
        """Start both sampling threads (daemons); returns self."""
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._loop, args=(n, c), name=f"nvml-pcie-{n}", daemon=True)
            for n, c in self.counters.items()
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop and join the threads."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=1.0)

    def __enter__(self) -> NvmlPcieSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def begin(self) -> float:
        """Mark the start of a point."""
        return self.clock()

    @staticmethod
    def empty_window() -> dict[str, Any]:
        return {
            "nvml_tx_gbps_max": None,
            "nvml_rx_gbps_max": None,
            "nvml_tx_gbps_mean": None,
            "nvml_rx_gbps_mean": None,
            "nvml_samples": 0,
        }

    def end(self, t0: float) -> dict[str, Any]:
        """Max and mean TX/RX in GB/s over the samples wholly inside [t0, now] (None when there are none:
        a point shorter than NVML's ~20 ms window), and how many samples that was."""
        t1 = self.clock()
        out = self.empty_window()
        with self._lock:
            for name, samples in self.samples.items():
                vals = [v for a, b, v in samples if a >= t0 and b <= t1]
                if vals:
                    out[f"nvml_{name}_gbps_max"] = max(vals)
                    out[f"nvml_{name}_gbps_mean"] = statistics.fmean(vals)
                out["nvml_samples"] += len(vals)
        return out

    def summary(self) -> dict[str, Any]:
        """All samples of the run: count, max and mean per counter, the window and any errors."""
        out: dict[str, Any] = {"unit": "GB/s (NVML KB/s x 1024 / 1e9)", "window_s": NVML_WINDOW_S}
        with self._lock:
            for name, samples in self.samples.items():
                vals = [v for _, _, v in samples]
                out[f"{name}_samples"] = len(vals)
                out[f"{name}_gbps_max"] = max(vals) if vals else None
                out[f"{name}_gbps_mean"] = statistics.fmean(vals) if vals else None
            out["errors"] = dict(self.errors)
        return out
