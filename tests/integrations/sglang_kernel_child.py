"""Run in a fresh interpreter by test_sglang_kernels.py: SGLang 0.5.23's own host pools move KV
between its own device pools and host pools with ``backup_from_device_all_layer`` and
``load_to_device_per_layer``. The first statement is the line of the ``.pth`` file the wheel installs;
with HICACHE_SGL_KERNEL=1 it turns the switch on. Prints one JSON object."""

import json
import sys

from hicache_kernels.compat import sglang_switch

exec(sglang_switch.PTH_LINE)  # what site.py runs for the installed .pth file
loaded_at_start = "hicache_kernels.compat.sgl_kernel" in sys.modules

import torch  # noqa: E402
from sglang.srt.mem_cache.pool_host import mamba, mha, mla  # noqa: E402
from sglang_pools import LAYERS, PAGE, mamba_pools, mha_pools, mla_pools, random_bytes  # noqa: E402

from hicache_kernels.compat import sgl_kernel as compat  # noqa: E402

compat.use_backend("triton")  # CPU tensors: the Triton interpreter runs the pointer-table transfers
calls: list[str] = []
for _name in (*sglang_switch.KVCACHEIO, *sglang_switch.MAMBA):  # count what SGLang calls, by name
    for _mod in (mha, mla, mamba):
        _fn = getattr(_mod, _name, None)
        if _fn is not None and _fn is getattr(compat, _name):

            def _counted(*a, _fn=_fn, _name=_name, **k):
                calls.append(_name)
                return _fn(*a, **k)

            setattr(_mod, _name, _counted)


def pages(*firsts: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in firsts])


def run(kind: str, layout: str, io: str) -> dict:
    if kind == "mamba":  # one state per request slot (page size 1): states of [LAYERS, slots, ...]
        device, host = mamba_pools(layout)
        kv = None
        host_buffers = [host.temporal_buffer, *host.conv_buffer]
        host_slots, src, dst = host.alloc(3), torch.tensor([7, 2, 11]), torch.tensor([20, 5, 30])
        rows = lambda t, idx: t[:, idx]  # noqa: E731 - every layer's slots
    else:
        kv, host = mha_pools(layout) if kind == "mha" else mla_pools(layout)
        if kind == "mha":
            device = [kv.k_buffer[i] for i in range(LAYERS)] + [kv.v_buffer[i] for i in range(LAYERS)]
        else:
            device = [kv.kv_buffer[i] for i in range(LAYERS)]
        host_buffers = [host.kv_buffer]
        host_slots, src, dst = host.alloc(3 * PAGE), pages(7, 2, 11), pages(20, 5, 30)
        rows = lambda t, idx: t[idx]  # noqa: E731
    for i, t in enumerate(device):
        random_bytes(t, i)
    for i, t in enumerate(host_buffers):
        random_bytes(t, 99 + i)  # host slots hold other bytes before the backup
    want = [rows(t, src).clone().view(torch.uint8) for t in device]
    del calls[:]
    try:
        host.backup_from_device_all_layer(kv, host_slots, src, io)
        for t in device:
            t.view(torch.uint8).fill_(0xA5)  # poison: unwritten rows show
        for layer in range(LAYERS):
            host.load_to_device_per_layer(kv, host_slots, dst, layer, io)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    got = [rows(t, dst).clone().view(torch.uint8) for t in device]
    return {
        "exact": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
        "jit": bool(getattr(host, "can_use_jit", False)),
        "calls": sorted(set(calls)),
    }


cases = {
    "mha": ["layer_first", "page_first", "page_first_direct", "page_head"],
    "mla": ["layer_first", "page_first", "page_first_direct"],
    "mamba": ["page_first", "page_first_direct"],  # the layouts SGLang's MambaPoolHost takes
}
out = {
    "status": sglang_switch.status(),
    "loaded_at_start": loaded_at_start,
    "results": {
        f"{k} {layout} {io}": run(k, layout, io)
        for k, layouts in cases.items()
        for layout in layouts
        for io in ("kernel", "direct")
    },
}
print(json.dumps(out))
