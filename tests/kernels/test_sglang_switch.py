"""hicache_kernels.compat.sglang_switch without SGLang: the import hook patches a module it targets when
that module loads (or at once, when it loaded before), binds every kvcacheio name to the compat
function, turns the JIT predicates off, and leaves every other module alone; the .pth line is inert
without HICACHE_SGL_KERNEL; info reports the switch. SGLang's own pools over it: tests/integrations."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hicache_kernels.compat import sgl_kernel as compat
from hicache_kernels.compat import sglang_switch as sw

FAKE = """
def can_use_hicache_jit_kernel(*args, **kwargs):
    return True

def can_use_write_back_jit_kernel(*args, **kwargs):
    return True

transfer_kv_per_layer = "sgl-kernel's"

def _resolve_device_accessible_ptr_fn():
    return None  # as SGLang's resolver answers without sgl-kernel's function
"""


@pytest.fixture
def fake(monkeypatch, tmp_path):
    for name in ("fake_sgl_pool", "fake_sgl_other"):
        (tmp_path / f"{name}.py").write_text(FAKE)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sw, "TARGETS", ("fake_sgl_pool",))
    monkeypatch.setattr(sw, "_patched", [])
    sw.uninstall()
    yield
    sw.uninstall()


def test_the_hook_patches_a_target_when_it_loads(fake):
    assert sw.install() is True and sw.install() is False  # idempotent
    import fake_sgl_other
    import fake_sgl_pool

    for name in (*sw.KVCACHEIO, *sw.MAMBA):
        assert getattr(fake_sgl_pool, name) is getattr(compat, name), name
    assert fake_sgl_pool._resolve_device_accessible_ptr_fn() is compat.get_device_accessible_ptr
    assert fake_sgl_other._resolve_device_accessible_ptr_fn() is None
    assert fake_sgl_pool.can_use_hicache_jit_kernel(1, x=2) is False
    assert fake_sgl_pool.can_use_write_back_jit_kernel() is False
    assert fake_sgl_other.transfer_kv_per_layer == "sgl-kernel's"  # not a target: untouched
    assert fake_sgl_other.can_use_hicache_jit_kernel() is True
    assert sw.status()["on"] and sw.status()["patched"] == ["fake_sgl_pool"]
    sw.uninstall()
    assert not sw.status()["on"]


def test_a_target_loaded_before_install_is_patched_at_once(fake):
    import fake_sgl_pool

    assert fake_sgl_pool.transfer_kv_per_layer == "sgl-kernel's"
    sw.install()
    assert fake_sgl_pool.transfer_kv_per_layer is compat.transfer_kv_per_layer
    assert fake_sgl_pool.can_use_hicache_jit_kernel() is False


@pytest.mark.parametrize(("value", "on"), [(None, False), ("0", False), ("1", True), ("true", False)])
def test_the_pth_line_in_a_fresh_interpreter(value, on):
    env = {k: v for k, v in os.environ.items() if k != sw.ENV}
    if value is not None:
        env[sw.ENV] = value
    code = sw.PTH_LINE + (
        "import sys, json\n"
        "m = sys.modules.get('hicache_kernels.compat.sglang_switch')\n"
        "print(json.dumps({'imported': 'hicache_kernels' in sys.modules, 'on': bool(m and m.status()['on'])}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["on"] is on
    if value in (None, "0"):
        assert out["imported"] is False  # inert: not even the package is imported
    if value == "true":
        assert "is not 0 or 1" in proc.stderr


def test_info_reports_the_switch(monkeypatch, capsys):
    from hicache_kernels import info

    monkeypatch.setenv(sw.ENV, "1")
    assert info.main([]) == 0
    text = capsys.readouterr().out
    assert "SGLang kernel switch (HICACHE_SGL_KERNEL=1):" in text
    assert info.main(["--json"]) == 0
    import json

    assert set(json.loads(capsys.readouterr().out)["sglang_switch"]) == {"env", "on", "patched"}
