"""The GPU side of pcie: whether the kernel can run, and the buffers and copies of every point (LinkBench)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .measure import Workload
from .planning import MiB, PointSpec, Sweep, kernel_chunk_bytes


def kernel_unavailable(device_index: int) -> str | None:
    """Why this package's kernel cannot run on the device, or None."""
    from .._ext import cuda_runtime_status, load_extension

    ok, reason = cuda_runtime_status()  # built, importable, and a driver new enough for its runtime
    if not ok:
        return reason
    try:
        load_extension().kernel_image_versions(device_index)
    except RuntimeError as exc:
        return str(exc)
    return None


def _fill_pattern(t: torch.Tensor, device: torch.device, salt: int) -> None:
    """Fill a uint8 buffer (CPU or CUDA) with a position-dependent pattern, 64 MiB at a time."""
    step = 64 * MiB
    flat = t.view(-1)
    for start in range(0, flat.numel(), step):
        end = min(start + step, flat.numel())
        vals = (torch.arange(start, end, device=device, dtype=torch.int64) * 131 + salt) % 251
        flat[start:end].copy_(vals.to(torch.uint8))
    torch.cuda.synchronize(device)


class LinkBench:
    """Buffers and copies for one CUDA device: what :func:`run_sweep` needs from a GPU.

    Device ``dev_src`` (device-to-host source) and ``dev_dst``; per host memory kind a source
    ``host_src`` (host-to-device) and a destination ``host_dst``. Sources hold a pattern and are never
    written, so a destination cleared then copied into must equal its source.
    """

    def __init__(self, device: torch.device, sweep: Sweep, kernel: bool) -> None:
        self.device = device
        self.sweep = sweep
        n = sweep.max_bytes
        self.dev_src = torch.empty(n, dtype=torch.uint8, device=device)
        self.dev_dst = torch.zeros(n, dtype=torch.uint8, device=device)
        _fill_pattern(self.dev_src, device, 7)
        self.host_src: dict[str, torch.Tensor] = {}
        self.host_dst: dict[str, torch.Tensor] = {}
        memories = set(sweep.memories) | ({"pinned"} if kernel else set())
        for mem in memories:
            pin = mem == "pinned"
            self.host_src[mem] = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
            self.host_dst[mem] = torch.zeros(n, dtype=torch.uint8, pin_memory=pin)  # zeros: pages touched
            _fill_pattern(self.host_src[mem], device, 11)
        self.side_streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self.ext = None
        self.alias: dict[str, int] = {}
        if kernel:
            from .._ext import load_extension

            self.ext = load_extension()
            # The device alias of pinned memory: equal to the host address under UVA on Linux x86, not
            # everywhere; always ask.
            self.alias = {
                "src": self.ext.host_device_pointer(self.host_src["pinned"].data_ptr()),
                "dst": self.ext.host_device_pointer(self.host_dst["pinned"].data_ptr()),
            }
        self._arange: dict[int, torch.Tensor] = {}

    def _ends(self, memory: str, direction: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if direction == "h2d":
            return self.host_src[memory][:n], self.dev_dst[:n]
        return self.dev_src[:n], self.host_dst[memory][:n]

    def _indices(self, n: int) -> torch.Tensor:
        if n not in self._arange:
            self._arange[n] = torch.arange(n, dtype=torch.int64, device=self.device)
        return self._arange[n]

    def issuer(
        self, spec: PointSpec, direction: str, stream: torch.cuda.Stream | None = None
    ) -> tuple[Callable[[], None], dict[str, Any]]:
        """A callable that issues one ``direction`` copy of ``spec.nbytes`` on ``stream`` (None: the stream
        current now, without switching streams per call: that would add to the latency), and point info."""
        src, dst = self._ends(spec.memory, direction, spec.nbytes)
        if spec.method == "copy_engine":
            if stream is None:
                return (lambda: dst.copy_(src, non_blocking=True)), {}

            def copy() -> None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)

            return copy, {}
        if self.ext is None or spec.sm_budget is None:
            raise RuntimeError(f"{spec.label()}: the kernel method needs the extension and an SM budget")
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        wpb = self.sweep.warps_per_block
        chunk = kernel_chunk_bytes(spec.nbytes, spec.sm_budget, wpb, self.sweep.chunk_bytes)
        slots = spec.nbytes // chunk
        src_base = self.alias["src"] if direction == "h2d" else src.data_ptr()
        dst_base = dst.data_ptr() if direction == "h2d" else self.alias["dst"]
        # One layer, one kv, page_size 1: slot i is bytes [i * chunk, (i + 1) * chunk) of the buffer.
        src_desc = (src_base, 1, 0, 0, chunk, 0, 0, 1, slots)
        dst_desc = (dst_base, 1, 0, 0, chunk, 0, 0, 1, slots)
        idx = self._indices(slots).data_ptr()
        handle, ext, blocks = stream.cuda_stream, self.ext, spec.sm_budget
        dst_host = direction == "d2h"  # the kernel's store policy: streaming to host memory only

        def launch() -> None:
            ext.transfer(src_desc, False, dst_desc, False, idx, idx, slots, 0, 1, 1, 1, chunk, 0, blocks, wpb, 0,
                         handle, dst_host)  # fmt: skip

        return launch, {"chunk_bytes": chunk, "warps_per_block": wpb}

    def _check(self, memory: str, direction: str, n: int) -> str | None:
        src, dst = self._ends(memory, direction, n)
        if torch.equal(src.to(self.device), dst.to(self.device)):
            return None
        return f"{direction}: destination differs from source after one copy of {n} bytes"

    def workload(self, spec: PointSpec) -> Workload:
        """The :class:`Workload` of a point: single directions on the current stream; ``bidir`` as h2d on
        one side stream and d2h on another, both forked from and joined back to the current stream."""
        main = torch.cuda.current_stream(self.device)
        directions = ("h2d", "d2h") if spec.direction == "bidir" else (spec.direction,)

        def verify() -> str | None:
            for d in directions:
                self._ends(spec.memory, d, spec.nbytes)[1].zero_()
            torch.cuda.synchronize(self.device)
            run()
            torch.cuda.synchronize(self.device)
            problems = [p for d in directions if (p := self._check(spec.memory, d, spec.nbytes))]
            return "; ".join(problems) or None

        if spec.direction != "bidir":
            run, info = self.issuer(spec, spec.direction)
            return Workload(run, verify=verify if self.sweep.verify else None, info=info)

        s_h2d, s_d2h = self.side_streams
        h2d, info = self.issuer(spec, "h2d", s_h2d)
        d2h, _ = self.issuer(spec, "d2h", s_d2h)
        events: list[tuple[torch.cuda.Event, ...]] = []

        def run() -> None:
            ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(4))
            s_h2d.wait_stream(main)
            s_d2h.wait_stream(main)
            ev[0].record(s_h2d)
            h2d()
            ev[1].record(s_h2d)
            ev[2].record(s_d2h)
            d2h()
            ev[3].record(s_d2h)
            main.wait_stream(s_h2d)
            main.wait_stream(s_d2h)
            events.append(ev)

        def direction_ms() -> dict[str, list[float]]:
            torch.cuda.synchronize(self.device)
            return {
                "h2d": [e[0].elapsed_time(e[1]) for e in events],
                "d2h": [e[2].elapsed_time(e[3]) for e in events],
            }

        return Workload(run, direction_ms=direction_ms, verify=verify if self.sweep.verify else None, info=info)
