"""The SGLang kernel switch (``HICACHE_SGL_KERNEL=1``, hicache_kernels.compat.sglang_switch) driven by
SGLang 0.5.23's own host pools: in a fresh interpreter that runs the ``.pth`` file's line first, SGLang's
``backup_from_device_all_layer`` and ``load_to_device_per_layer`` move random KV between its own CPU
device pools and host pools through this package's compat functions (the Triton interpreter runs them),
byte for byte, for every layout and io-backend SGLang accepts, with its JIT kernels off. Without the
switch SGLang has no transfer functions on a CPU at all (the control)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need

need(["sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla"])

CHILD = Path(__file__).with_name("sglang_kernel_child.py")
# (kind, layout, io-backend) that SGLang 0.5.23 itself refuses ("Unsupported layout"); all others run.
REFUSED_BY_SGLANG = {("mha", "page_first", "direct"), ("mha", "page_first_direct", "kernel"),
                     ("mha", "page_head", "direct"), ("mla", "page_first", "direct"),
                     ("mla", "page_first_direct", "kernel")}  # fmt: skip


def run_child(env_value: str | None) -> tuple[dict | None, str]:
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_SGL_KERNEL"}
    if env_value is not None:
        env["HICACHE_SGL_KERNEL"] = env_value
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([*sys.path])
    proc = subprocess.run([sys.executable, str(CHILD)], env=env, capture_output=True, text=True, timeout=900)
    lines = proc.stdout.strip().splitlines()
    return (json.loads(lines[-1]) if proc.returncode == 0 and lines else None), proc.stderr[-3000:]


@pytest.fixture(scope="module")
def switched():
    out, err = run_child("1")
    assert out is not None, err
    return out


def test_switch_is_on_and_patched_sglangs_pools(switched):
    status = switched["status"]
    assert status["on"] and status["env"] == "1"
    pools = {f"sglang.srt.mem_cache.pool_host.{m}" for m in ("mha", "mla", "mamba", "common")}
    assert pools <= set(status["patched"])
    assert not switched["loaded_at_start"]  # the hook loads the compat functions only with SGLang's modules


def test_sglangs_own_backup_and_load_run_our_functions_byte_exact(switched):
    ran = 0
    for case, res in switched["results"].items():
        kind, layout, io = case.split()
        if (kind, layout, io) in REFUSED_BY_SGLANG:
            assert res.get("error", "").startswith("ValueError: Unsupported layout"), (case, res)
            continue
        assert "error" not in res, (case, res)
        assert res["exact"] and not res["jit"], (case, res)
        assert res["calls"], (case, "no compat function was called")
        ran += 1
    for layout in ("page_first", "page_first_direct"):  # the Mamba states moved by the Mamba transfers
        assert switched["results"][f"mamba {layout} kernel"]["calls"] == ["transfer_kv_mamba_lf_pf",
                                                                          "transfer_kv_mamba_pf_lf"]  # fmt: skip
    assert ran == 13  # MHA 5, MLA 4, Mamba 4 (layout x io-backend pairs SGLang accepts)


def test_without_the_switch_the_pth_line_imports_nothing_and_sglang_has_no_transfers():
    out, err = run_child(None)
    assert out is not None, err
    assert not out["status"]["on"] and out["status"]["patched"] == []
    errors = [r.get("error", "") for r in out["results"].values()]
    assert all(e.startswith(("NameError", "ValueError: Unsupported layout")) for e in errors), errors
    assert sum(e.startswith("NameError") for e in errors) == 13  # the control: nothing to call on a CPU


def test_a_value_other_than_0_or_1_is_refused_and_leaves_it_off():
    out, err = run_child("yes")
    assert out is not None and not out["status"]["on"], err
    assert "HICACHE_SGL_KERNEL='yes' is not 0 or 1" in err


def test_every_sglang_module_importing_from_kvcacheio_is_switched():
    """SGLang's own source is the list: each module of SGLang 0.5.23 that imports from
    ``sgl_kernel.kvcacheio`` is a switch target, and each name it imports has a compat function."""
    import importlib.util
    import re

    from hicache_kernels.compat import sgl_kernel as compat
    from hicache_kernels.compat import sglang_switch

    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    found: dict[str, set[str]] = {}
    pattern = re.compile(r"from sgl_kernel\.kvcacheio import\s*(?:\(([^)]*)\)|([^\n]*))")
    for path in root.rglob("*.py"):
        module = "sglang." + ".".join(path.relative_to(root).with_suffix("").parts)
        if module == "sglang.srt.mem_cache.pool_host._kvcacheio":
            continue  # Intel XPU only (sgl-kernel-xpu's wheel); CUDA pools import sgl_kernel.kvcacheio themselves
        for m in pattern.finditer(path.read_text(errors="replace")):
            names = {n for n in re.split(r"[,\s]+", m.group(1) or m.group(2)) if n and not n.startswith("#")}
            found.setdefault(module, set()).update(names)
    assert len(found) >= 10, sorted(found)  # SGLang 0.5.23 has 10 such modules
    for module, names in found.items():
        assert module in sglang_switch.TARGETS, module
        for name in names:
            assert name in sglang_switch.KVCACHEIO and callable(getattr(compat, name)), (module, name)
