"""hicache_kernels.compat.pytest_plugin on CPU: a test module written the way sgl-kernel's and SGLang's
transfer tests are (transfers imported from sgl_kernel.kvcacheio, SGLang's is_hip and CI registration,
sgl-kernel's module-wide CUDA 13 skip) runs against this package's compat functions, byte-exact; only
the CUDA 13 skip is removed; without the plugin the module does not import. The upstream files
themselves run on a GPU (benchmarks/gpu_check.sh, step client-tests)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hicache_kernels.compat.pytest_plugin import _missing

UPSTREAM_STYLE = """
import pytest
import torch
from sgl_kernel.kvcacheio import transfer_kv_direct, transfer_kv_per_layer

from sglang.srt.utils import is_hip
from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=1, stage="base-b")
pytestmark = pytest.mark.skipif(True, reason="test_kvcacheio segfaults on CUDA 13.x (sgl-kernel bug)")


def test_copies_through_our_functions():
    import hicache_kernels.compat.sgl_kernel as compat

    assert transfer_kv_per_layer is compat.transfer_kv_per_layer and not is_hip()
    g = torch.Generator().manual_seed(5)
    src = [torch.randint(0, 256, (64, 3, 8), dtype=torch.uint8, generator=g) for _ in range(2)]
    dst = [torch.full((64, 3, 8), 0xA5, dtype=torch.uint8) for _ in range(2)]
    si, di = torch.arange(16, 32), torch.arange(40, 56)
    ref = [d.clone() for d in dst]
    for r, s in zip(ref, src):
        r[di] = s[si]
    transfer_kv_direct(src, dst, si, di, page_size=16)
    assert all(torch.equal(d, r) for d, r in zip(dst, ref))
    with pytest.raises(RuntimeError, match="same length"):
        transfer_kv_direct(src, dst, si, di[:8], page_size=8)


@pytest.mark.skipif(True, reason="an unrelated skip")
def test_other_skips_stay():
    raise AssertionError("must not run")
"""


def run(tmp_path, *plugin):
    (tmp_path / "test_upstream_style.py").write_text(UPSTREAM_STYLE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), HICACHE_SGL_KERNEL="1")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs", *plugin, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_plugin_runs_upstream_style_tests_over_the_compat_functions(tmp_path):
    rc, out = run(tmp_path, "-p", "hicache_kernels.compat.pytest_plugin")
    assert rc == 0, out
    assert "1 passed, 1 skipped" in out and "an unrelated skip" in out, out
    assert "sgl_kernel.kvcacheio's transfers are hicache_kernels': True" in out, out
    assert "removed 1 CUDA 13 skip mark(s)" in out and "test_kvcacheio segfaults on CUDA 13.x" in out, out
    if _missing("sgl_kernel"):
        assert "provided: sgl_kernel.kvcacheio (sgl-kernel is not installed)" in out, out
    if _missing("sglang"):
        assert "provided: sglang.srt.utils.is_hip" in out, out


@pytest.mark.skipif(not _missing("sgl_kernel"), reason="sgl-kernel is installed here")
def test_without_the_plugin_the_module_does_not_import(tmp_path):
    rc, out = run(tmp_path)
    assert rc != 0 and "No module named 'sgl_kernel'" in out, out
