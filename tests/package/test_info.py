"""`python -m hicache_kernels.info` on this machine, and its GPU paths with a fake NVML."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from dataclasses import asdict
from pathlib import Path

import pytest

import hicache_kernels
from hicache_kernels import _env, _ext, info
from hicache_kernels._names import IO_BACKENDS


def run_info(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hicache_kernels.info", *args], capture_output=True, text=True)


def test_info_text_runs() -> None:
    proc = run_info()
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stdout.startswith("hicache-kernels ")
    assert "io-backends:" in proc.stdout
    for name in IO_BACKENDS:
        assert f"    {name} " in proc.stdout


def test_info_json_schema() -> None:
    proc = run_info("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) >= {"package", "build", "torch", "triton", "cuda", "gpus", "notes", "io_backends"}
    assert not {"tree_core", "host_core"} & set(report)  # the cache layer's: python -m hicache.info
    import hicache_kernels

    assert report["package"]["version"] == hicache_kernels.__version__
    assert set(report["io_backends"]) == set(IO_BACKENDS)
    for status in report["io_backends"].values():
        assert isinstance(status["usable"], bool) and status["reason"]
    assert report["build"] == json.loads(json.dumps(hicache_kernels.build_info()))


def test_info_reports_the_build_record() -> None:
    """The version the build was given (with its local label), its archs, CUDA version and minimum driver."""
    report = json.loads(run_info("--json").stdout)
    b = report["build"]
    record = json.loads((Path(hicache_kernels.__file__).parent / "_build_meta.json").read_text())
    assert b["record"] == record and b["version"] == record.get("version")
    if b["cuda_built"]:
        assert b["min_driver_cuda_version"] == _ext.required_driver_version() == b["cuda_version"] // 1000 * 1000
        assert ";".join(b["archs"]) == record["archs"] and b["cuda_version"] == record["cuda_version"]
    text = run_info().stdout.splitlines()
    assert text[0] == f"hicache-kernels {hicache_kernels.__version__} (built as {record['version']})"
    if b["cuda_built"]:
        assert text[1].endswith(f"needs a driver supporting CUDA {b['cuda_version'] // 1000}.0 or newer")


BUILT = {
    "cuda_built": True,
    "version": "0.1.0+cu130.sm80.sm90ptx",
    "archs": ["80", "90+PTX"],
    "cuda_version": 13020,
    "cudart": "static",
    "min_driver_cuda_version": 13000,
    "archs_source": "HICACHE_CUDA_ARCHS",
}


@pytest.mark.parametrize(
    ("build", "lines"),
    [
        (
            BUILT,
            [
                "hicache-kernels 0.1.0 (built as 0.1.0+cu130.sm80.sm90ptx)",
                "  CUDA extension: built for sm 80, 90+PTX (chosen by HICACHE_CUDA_ARCHS), CUDA 13.2, static cudart; "
                "needs a driver supporting CUDA 13.0 or newer",
            ],
        ),
        (
            {
                "cuda_built": True,
                "version": "0.1.0+cu130.sm90",
                "extension_error": "the CUDA extension was built but does not import: boom",
                "record": {"cuda_built": True, "archs": "90", "cuda_version": 13000, "min_driver_cuda_version": 13000},
            },
            [
                "hicache-kernels 0.1.0 (built as 0.1.0+cu130.sm90)",
                "  CUDA extension: NOT available: the CUDA extension was built but does not import: boom",
                "    the build record says: archs 90, CUDA 13.0, needs a driver supporting CUDA 13.0 or newer",
            ],
        ),
        (
            {"cuda_built": False, "version": "0.1.0+cpu", "skip_reason": "HICACHE_SKIP_CUDA is set", "record": {}},
            ["hicache-kernels 0.1.0 (built as 0.1.0+cpu)", "  CUDA extension: NOT available: HICACHE_SKIP_CUDA is set"],
        ),
    ],
)
def test_info_text_build_lines(build: dict, lines: list[str]) -> None:
    report = {**_env.gather(), "package": {"name": "hicache-kernels", "version": "0.1.0"}, "build": build}
    assert info.format_report(report).splitlines()[: len(lines)] == lines


def test_info_without_gpu_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    report = json.loads(run_info("--json").stdout)
    assert report["gpus"] == []
    assert report["notes"], "no reason given for seeing no GPU"
    assert report["io_backends"]["direct"]["usable"] is True
    assert report["io_backends"]["kernel"]["usable"] is False
    assert report["io_backends"]["kernel"]["reason"]


@pytest.mark.parametrize(
    ("gen", "width", "gbps"),
    [(5, 16, 63.02), (4, 16, 31.51), (3, 16, 15.75), (5, 8, 31.51), (6, 16, 121.0), (1, 1, 0.25), (2, 4, 2.0)],
)
def test_pcie_theoretical(gen: int, width: int, gbps: float) -> None:
    assert _env.pcie_theoretical_gbps(gen, width) == pytest.approx(gbps, abs=0.01)


def test_pcie_unknown_generation() -> None:
    assert _env.pcie_theoretical_gbps(9, 16) is None
    assert _env.pcie_theoretical_gbps(5, 0) is None


class FakeNvml(types.SimpleNamespace):
    """One H200-like GPU on a Gen5 x16 link that idles at Gen1."""

    def __init__(self) -> None:
        super().__init__(
            nvmlDeviceGetCount=lambda: 1,
            nvmlDeviceGetHandleByIndex=lambda i: ("h", i),
            nvmlDeviceGetHandleByUUID=lambda u: ("h", 0),
            nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
            nvmlDeviceGetName=lambda h: "NVIDIA H200",
            nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=141 * 2**30),
            nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 1,
            nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 5,
            nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16,
            nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
            nvmlSystemGetDriverVersion=lambda: "580.65.06",
            nvmlSystemGetCudaDriverVersion=lambda: 13000,
        )


def test_gpu_listing_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_env, "_nvml", lambda: (FakeNvml(), "ok"))
    monkeypatch.setattr(_env, "_torch_cuda", lambda: (None, "torch sees no GPU (test)"))
    gpus, notes = _env.list_gpus()
    assert notes == ["torch sees no GPU (test)"]
    (g,) = gpus
    assert (g.name, g.compute_capability, g.memory_gib, g.sm_count) == ("NVIDIA H200", "9.0", 141.0, None)
    assert (g.pcie.current_generation, g.pcie.max_generation, g.pcie.max_width) == (1, 5, 16)
    assert g.pcie.current_gbps == pytest.approx(4.0) and g.pcie.max_gbps == pytest.approx(63.02, abs=0.01)
    built = _env.build_info()
    if built["cuda_built"]:
        assert g.kernels_cover_arch is ("90" in built["archs"] or "90+PTX" in built["archs"])
    else:
        assert g.kernels_cover_arch is False and "not built" in g.coverage
    text = info.format_report(
        {**_env.gather(), "gpus": [asdict(g)], "cuda": {**_env.cuda_versions(), "driver": "580.65.06"}}
    )
    assert "GPU 0: NVIDIA H200, sm_90, ? SMs, 141.0 GiB" in text
    assert "Gen1 x16 now (max Gen5 x16)" in text and "63.02 GB/s at max" in text


def test_nvml_errors_become_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml()

    def broken(h: object) -> int:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    fake.nvmlDeviceGetCurrPcieLinkGeneration = broken
    monkeypatch.setattr(_env, "_nvml", lambda: (fake, "ok"))
    monkeypatch.setattr(_env, "_torch_cuda", lambda: (None, "no torch GPU (test)"))
    (g,), _ = _env.list_gpus()
    assert g.pcie.current_gbps is None and "NOT_SUPPORTED" in (g.pcie.error or "")
    assert "PCIe: unknown" in info.format_report({**_env.gather(), "gpus": [asdict(g)]})


def test_driver_answer_overrides_arch_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a GPU the driver's own answer (cudaFuncGetAttributes on a kernel) decides coverage."""

    class FakeExt:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def build_info(self) -> dict:
            return {"archs": "90", "cuda_version": 13000, "cudart": "static"}

        def kernel_image_versions(self, device: int) -> tuple[int, int]:
            if self.fail:
                raise RuntimeError("cudaFuncGetAttributes failed: cudaErrorNoKernelImageForDevice")
            return 90, 90

    monkeypatch.setattr(_env._ext, "cuda_runtime_status", lambda: (True, "ok"))  # a driver that can run it
    for fail in (False, True):
        monkeypatch.setattr(_env, "_load", lambda f=fail: (FakeExt(f), "ok"))
        monkeypatch.setattr(_env, "build_info", lambda: {"cuda_built": True, "archs": ["90"]})
        g = _env.GpuInfo(0, "NVIDIA H200", "9.0", 132, 139.8)
        _env._mark_coverage([g], can_launch=True)
        assert g.kernels_cover_arch is (not fail)
        assert ("NoKernelImage" in g.coverage) if fail else ("binaryVersion 90" in g.coverage)


# ----------------------------------------------------------------------- what the driver allows (#6)

needs_cuda13_build = pytest.mark.skipif(
    not hicache_kernels.build_info().get("cuda_version", 0) // 1000 == 13,
    reason="needs the extension built with CUDA 13",
)
H200 = _env.GpuInfo(0, "NVIDIA H200", "9.0", 132, 139.8, kernels_cover_arch=True, coverage="test")


def with_driver(monkeypatch: pytest.MonkeyPatch, version: int) -> dict[str, _env.BackendStatus]:
    """io-backend status as a machine with a (covered) GPU and torch CUDA would see it, with a driver
    supporting CUDA ``version`` (0: none)."""
    monkeypatch.setattr(_ext, "driver_version", lambda: version)
    monkeypatch.setattr(_env, "_torch_cuda", lambda: (object(), "ok"))
    return _env.io_backend_status([H200])


@needs_cuda13_build
def test_io_backends_on_an_old_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    status = with_driver(monkeypatch, 12040)
    too_old = "the NVIDIA driver supports CUDA 12.4, older than the CUDA 13.0"
    for name in ("kernel", "batch"):
        assert status[name].usable is False and status[name].reason.startswith(too_old), status[name]
    assert status["direct"].usable is True
    assert status["direct"].reason.startswith("torch copies") and too_old in status["direct"].reason
    assert status["auto"] == _env.BackendStatus(True, "chooses among: direct")


@needs_cuda13_build
def test_io_backends_on_a_cuda13_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    status = with_driver(monkeypatch, 13000)
    assert status["kernel"].usable and status["batch"] == _env.BackendStatus(True, "cudaMemcpyBatchAsync")
    assert status["direct"] == _env.BackendStatus(True, "copy engines (cudaMemcpyAsync) on CUDA tensors")
    assert status["auto"] == _env.BackendStatus(True, "chooses among: kernel, batch, direct")


@needs_cuda13_build
def test_io_backends_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    status = with_driver(monkeypatch, 0)
    for name in ("kernel", "batch"):
        assert status[name].reason.startswith("no CUDA driver is installed") and "older" not in status[name].reason


@needs_cuda13_build
@pytest.mark.parametrize(("version", "line"), [
    (12040, "    extension runtime cannot run: the NVIDIA driver supports CUDA 12.4, older than the CUDA 13.0"),
    (0, "    extension runtime cannot run: no CUDA driver is installed"),
])  # fmt: skip
def test_info_text_says_the_extension_cannot_run(monkeypatch: pytest.MonkeyPatch, version: int, line: str) -> None:
    monkeypatch.setattr(_ext, "driver_version", lambda: version)
    cuda = _env.cuda_versions()
    assert cuda["driver_cuda"] == _env._version(version)
    text = info.format_report({**_env.gather(), "cuda": cuda})
    assert any(t.startswith(line) for t in text.splitlines()), text
    monkeypatch.setattr(_ext, "driver_version", lambda: 13000)
    assert "extension_runtime_error" not in _env.cuda_versions()


@needs_cuda13_build
def test_an_old_driver_is_not_asked_for_coverage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver cannot load this build's runtime: the compiled arch list answers instead."""

    class NotToBeAsked:
        def kernel_image_versions(self, device: int) -> tuple[int, int]:
            raise AssertionError("asked a driver that cannot run the extension")

    monkeypatch.setattr(_ext, "driver_version", lambda: 12040)
    monkeypatch.setattr(_env, "_load", lambda: (NotToBeAsked(), "ok"))
    monkeypatch.setattr(_env, "build_info", lambda: {"cuda_built": True, "archs": ["90"]})
    g = _env.GpuInfo(0, "NVIDIA H200", "9.0", 132, 139.8)
    _env._mark_coverage([g], can_launch=True)
    assert g.kernels_cover_arch is True and "binaryVersion" not in g.coverage


def test_the_cache_layers_info_names_the_tree_core_and_a_bad_setting(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from hicache import info as cache_info

    monkeypatch.setenv("HICACHE_TREE_CORE", "python")
    assert cache_info.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hicache-kernels ") and "io-backends:" in out  # the kernel package's report, too
    assert "hicache radix-tree core: python (asked for (HICACHE_TREE_CORE=python))" in out
    assert "hicache host core (hicache._core): built (" in out
    monkeypatch.setenv("HICACHE_TREE_CORE", "quick")
    assert cache_info.main([]) == 0
    assert "hicache radix-tree core: none (ValueError: HICACHE_TREE_CORE: expected one of" in capsys.readouterr().out
    monkeypatch.delenv("HICACHE_TREE_CORE")
    proc = subprocess.run([sys.executable, "-m", "hicache.info", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["tree_core"] == {"core": "compiled", "reason": "hicache._core.RadixTree (HICACHE_TREE_CORE=auto)"}
    assert report["host_core"]["built"] is True and report["host_core"]["file"].endswith(".so")
    assert {"build", "io_backends"} <= set(report)
