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
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import mha, mla  # noqa: E402

from hicache_kernels.compat import sgl_kernel as compat  # noqa: E402

compat.use_backend("triton")  # CPU tensors: the Triton interpreter runs the pointer-table transfers
calls: list[str] = []
for _name in sglang_switch.KVCACHEIO:  # count what SGLang calls, by name, through the bound functions
    for _mod in (mha, mla):
        _fn = getattr(_mod, _name, None)
        if _fn is not None and _fn is getattr(compat, _name):

            def _counted(*a, _fn=_fn, _name=_name, **k):
                calls.append(_name)
                return _fn(*a, **k)

            setattr(_mod, _name, _counted)

PAGE, LAYERS = 4, 3


def random_bytes(t: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = t.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def pages(*firsts: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in firsts])


def run(kind: str, layout: str, io: str) -> dict:
    if kind == "mha":
        kv = MHATokenToKVPool(
            256, PAGE, torch.bfloat16, 2, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
        )
        host = mha.MHATokenToKVPoolHost(
            kv.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            PAGE,
            layout,
            pin_memory=False,
            device_capacity_tokens=kv.size,
            start_layer=0,
            end_layer=LAYERS - 1,
            write_back_staging=kv.hicache_write_back_staging,
        )
        device = [kv.k_buffer[i] for i in range(LAYERS)] + [kv.v_buffer[i] for i in range(LAYERS)]
    else:
        kv = MLATokenToKVPool(
            256, PAGE, torch.bfloat16, 16, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
        )
        host = mla.MLATokenToKVPoolHost(
            kv.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            PAGE,
            layout,
            pin_memory=False,
            device_capacity_tokens=kv.size,
            start_layer=0,
            end_layer=LAYERS - 1,
            target_layer_num=LAYERS,
        )
        device = [kv.kv_buffer[i] for i in range(LAYERS)]
    for i, t in enumerate(device):
        random_bytes(t, i)
    random_bytes(host.kv_buffer, 99)  # host slots hold other bytes before the backup
    host_slots = host.alloc(3 * PAGE)
    src = pages(7, 2, 11)
    want = [t[src].clone().view(torch.uint8) for t in device]
    del calls[:]
    try:
        host.backup_from_device_all_layer(kv, host_slots, src, io)
        for t in device:
            t.view(torch.uint8).fill_(0xA5)  # poison: unwritten rows show
        dst = pages(20, 5, 30)
        for layer in range(LAYERS):
            host.load_to_device_per_layer(kv, host_slots, dst, layer, io)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    got = [t[dst].clone().view(torch.uint8) for t in device]
    return {
        "exact": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
        "jit": bool(getattr(host, "can_use_jit", False)),
        "calls": sorted(set(calls)),
    }


cases = {
    "mha": ["layer_first", "page_first", "page_first_direct", "page_head"],
    "mla": ["layer_first", "page_first", "page_first_direct"],
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
