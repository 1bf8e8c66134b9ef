"""`python -m hicache_kernels.info` on this machine, and its GPU paths with a fake NVML."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import hicache_kernels
from hicache_kernels import BackendUnavailableError, _env, _ext, backends, info, ops
from hicache_kernels._names import IO_BACKENDS
from hicache_kernels.backends import AUTO_DESIGNS, AutoBackend, copy_engine, get_backend
from hicache_kernels.backends import kernel as kernel_module

from kvdata import expected_after, make_indices, make_pools


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
        for on in ("cpu", "cuda"):  # what a call does on CPU tensors and on CUDA tensors
            assert isinstance(status[on]["usable"], bool) and status[on]["reason"]
        assert status["usable"] is (status["cpu"]["usable"] or status["cuda"]["usable"])
    auto = report["io_backends"]["auto"]
    assert set(auto["choices"]) == {"cpu", "cuda"} and list(auto["designs"]) == list(AUTO_DESIGNS)
    assert {"path", "named_by", "exists", "designs", "rule", "table"} <= set(auto["ranking"])
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
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    report = json.loads(run_info("--json").stdout)
    assert report["gpus"] == []
    assert report["notes"], "no reason given for seeing no GPU"
    said = report["io_backends"]
    assert said["direct"]["usable"] is said["direct"]["cpu"]["usable"] is True
    assert said["kernel"]["usable"] is False and said["kernel"]["cuda"]["reason"]
    for name in IO_BACKENDS:  # no CUDA tensors without a GPU: every backend says why not
        assert said[name]["cuda"]["usable"] is False and said[name]["cuda"]["reason"], name
    assert said["auto"]["choices"] == {"cpu": ["direct"], "cuda": []}


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


def with_driver(
    monkeypatch: pytest.MonkeyPatch,
    version: int,
    capability: tuple[int, int] = (9, 0),
    auto_config: Path = Path("/nonexistent/hicache-test/auto.json"),
) -> dict[str, _env.BackendStatus]:
    """io-backend status as a machine with a (covered) GPU of ``capability`` and torch CUDA would see it,
    with a driver supporting CUDA ``version`` (0: none) and auto's settings in ``auto_config`` (default:
    no such file)."""
    monkeypatch.setattr(_ext, "driver_version", lambda: version)
    monkeypatch.setattr(_env, "_torch_cuda", lambda: (object(), "ok"))
    pretend_gpu(monkeypatch, capability)
    monkeypatch.setenv("HICACHE_AUTO_CONFIG", str(auto_config))
    monkeypatch.setattr(backends, "_DEFAULTS", {})  # get_backend("auto") loads the settings anew
    gpu = dataclasses.replace(H200, compute_capability=f"{capability[0]}.{capability[1]}")
    return _env.io_backend_status([gpu])


def pretend_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    """CUDA devices are sm_<capability>, and the driver loads the bulk kernel's code built for them."""
    arch = 10 * capability[0] + capability[1]
    monkeypatch.setattr(kernel_module, "_compute_capability", lambda device: capability)
    monkeypatch.setattr(kernel_module, "_bulk_image", lambda device: (arch, arch))


@needs_cuda13_build
def test_io_backends_on_an_old_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    status = with_driver(monkeypatch, 12040)
    too_old = "the NVIDIA driver supports CUDA 12.4, older than the CUDA 13.0"
    for name in ("kernel", "batch"):
        assert status[name].cuda.usable is False and status[name].cuda.reason.startswith(too_old), status[name]
    assert status["direct"].cuda.usable is True
    assert status["direct"].cuda.reason.startswith("torch copies") and too_old in status["direct"].cuda.reason
    auto = status["auto"]
    assert auto.choices["cuda"] == ["direct"] and auto.cuda.reason.startswith("always direct; never kernel (")
    assert "kernel-bulk (not ranked), staged (not ranked), batch (unusable here)" in auto.cuda.reason


@needs_cuda13_build
def test_io_backends_on_a_cuda13_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    status = with_driver(monkeypatch, 13000)
    assert status["kernel"].cuda.usable and status["batch"].cuda == _env.TensorStatus(
        True, "one cudaMemcpyBatchAsync of the fragments' 1-D pieces (direct on the legacy default stream)"
    )
    assert status["direct"].cuda.usable and status["direct"].cuda.reason.startswith("copy engines: a cudaMemcpyAsync")
    auto = status["auto"]
    assert auto.choices["cuda"] == ["kernel", "batch", "direct"] == list(AutoBackend.THRESHOLD_RANKING)
    assert auto.cuda.reason == ("the first of its ranking that can run the plan, among kernel, batch, direct; "
                                "never kernel-bulk (not ranked), staged (not ranked)")  # fmt: skip
    assert auto.designs["kernel-bulk"].usable and auto.designs["staged"].usable


@needs_cuda13_build
def test_io_backends_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    status = with_driver(monkeypatch, 0)
    for name in ("kernel", "batch"):
        reason = status[name].cuda.reason
        assert reason.startswith("no CUDA driver is installed") and "older" not in reason


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


# ------------------------------------------------------ what a call does, checked by making the call (#35)


def cpu_plan(direction: str = "d2h", page_size: int = 4) -> tuple[object, object, object]:
    """A plan over fresh CPU pools (page_first_direct, fp16 items of 32 B; not info's own two-slot
    layer_first probe), its pools, and what they must hold after it ran."""
    layout = "page_first_direct"
    pools = make_pools(layout=layout, mla=False, dtype=torch.float16, page_size=page_size, direction=direction)
    d_idx, h_idx = make_indices("pages", 96, 48 if page_size == 1 else 4 * page_size, page_size, count=8, seed=0)
    plan = ops.build_plan(direction, pools.device_k, pools.device_v, pools.host, d_idx, h_idx, layout=layout,
                          page_size=page_size)  # fmt: skip
    return plan, pools, expected_after(pools, direction, d_idx, h_idx, None)


@pytest.mark.parametrize("interpret", [None, "0"])  # TRITON_INTERPRET as the tests run, then without it
@pytest.mark.parametrize("name", IO_BACKENDS)
def test_info_on_cpu_tensors_says_what_a_call_does(monkeypatch, tmp_path, name: str, interpret: str | None) -> None:
    """Each backend's CPU line, in the JSON report and the text, against the real call on CPU pools: usable
    exactly when the call copies the plan's bytes, unusable with the reason the call raises."""
    if interpret is not None:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setenv("HICACHE_AUTO_CONFIG", str(tmp_path / "auto.json"))
    monkeypatch.setattr(backends, "_DEFAULTS", {})
    report = json.loads(json.dumps(_env.gather()))
    said = report["io_backends"][name]["cpu"]
    (line,) = [t for t in info.format_report(report).splitlines() if t.startswith(f"    {name:<7} on CPU tensors: ")]
    assert line.endswith(f"{'usable' if said['usable'] else 'unusable'}: {said['reason']}")
    for direction in ("d2h", "h2d"):
        plan, pools, expected = cpu_plan(direction)
        try:
            get_backend(name).run(plan)
            raised = None
        except BackendUnavailableError as exc:
            raised = str(exc)
        outcome = "ran" if raised is None else f"raised: {raised}"
        assert said["usable"] is (raised is None), f"info: {line.strip()}; the call {outcome}"
        if raised is None:
            assert pools.equal(expected), f"{name} ran on CPU tensors but did not copy the plan ({direction})"
        else:
            assert raised.endswith(said["reason"])


def test_info_names_what_batch_does_on_cpu_tensors() -> None:
    """batch runs on CPU tensors (torch copies of its 1-D pieces, not cudaMemcpyBatchAsync)."""
    said = _env.io_backend_status()["batch"]
    assert said.cpu == _env.TensorStatus(True, _env._CPU_HOW["batch"]) and said.usable
    assert "1-D pieces" in said.cpu.reason


def test_auto_on_cpu_tensors_takes_what_info_lists(monkeypatch, tmp_path) -> None:
    """A table ranks designs for CUDA tensors only: on CPU tensors auto takes direct, and info says so,
    naming the settings file it read."""
    path = tmp_path / "auto.json"
    path.write_text(json.dumps({"table": {"d2h": {"32": ["kernel", "staged"]}, "h2d": {"32": ["batch"]}}}))
    monkeypatch.setenv("HICACHE_AUTO_CONFIG", str(path))
    monkeypatch.setattr(backends, "_DEFAULTS", {})
    said = json.loads(json.dumps(_env.gather()))["io_backends"]["auto"]
    plan, pools, expected = cpu_plan()
    auto = AutoBackend()
    auto.run(plan)
    assert pools.equal(expected)
    assert said["choices"]["cpu"] == [auto.last_choice] == ["direct"]
    assert said["cpu"] == {"usable": True, "reason": f"takes direct ({auto.last_reason})"}
    assert said["ranking"]["path"] == str(path) and said["ranking"]["named_by"] == "$HICACHE_AUTO_CONFIG"
    assert said["ranking"]["designs"] == ["kernel", "staged", "batch", "direct"] == list(auto.candidates())
    assert said["ranking"]["rule"].startswith(f"by the table in {path} ($HICACHE_AUTO_CONFIG)")


@pytest.mark.parametrize(
    ("xdg", "expected"),
    [("/tmp/xdg-test", "/tmp/xdg-test/hicache_kernels/auto.json"), ("", "~/.config/hicache_kernels/auto.json")],
)
def test_info_names_auto_settings_from_xdg_config_home(monkeypatch, xdg: str, expected: str) -> None:
    """Without HICACHE_AUTO_CONFIG: $XDG_CONFIG_HOME, and ~/.config where it is unset or empty."""
    monkeypatch.delenv("HICACHE_AUTO_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", xdg)
    monkeypatch.setattr(backends, "_DEFAULTS", {})
    ranking = _env.io_backend_status()["auto"].ranking
    assert ranking["path"] == str(Path(expected).expanduser()) == str(AutoBackend().path)
    assert ranking["named_by"] == ("$XDG_CONFIG_HOME" if xdg else "the default path")


def test_info_says_when_auto_settings_do_not_load(monkeypatch, tmp_path) -> None:
    path = tmp_path / "auto.json"
    path.write_text(json.dumps({"kernel_max": 1}))
    monkeypatch.setenv("HICACHE_AUTO_CONFIG", str(path))
    monkeypatch.setattr(backends, "_DEFAULTS", {})
    said = _env.io_backend_status()["auto"]
    with pytest.raises(ValueError, match="unknown auto thresholds") as exc:
        get_backend("auto")
    assert not said.usable and said.cpu.reason == said.cuda.reason == str(exc.value)
    text = info.format_report(json.loads(json.dumps(_env.gather())))
    assert f"ranks nothing: {path} ($HICACHE_AUTO_CONFIG) does not load" in text


def knock_out_sequence(auto: AutoBackend, plan) -> list[str]:
    """The designs ``auto`` takes for ``plan``, one after another as each taken design is made unable to
    run the plan: its ranking, as far as this machine can run it, then direct."""
    taken = [auto.decide(plan)[0]]
    while taken[-1] != "direct":
        auto._design(taken[-1]).unavailable = lambda plan: "knocked out by the test"
        taken.append(auto.decide(plan)[0])
    return taken


@needs_cuda13_build
@pytest.mark.parametrize(
    "table",
    [
        None,  # no settings file: the threshold rule
        {"d2h": {"32": list(AUTO_DESIGNS)}, "h2d": {"512": list(reversed(AUTO_DESIGNS))}},
        {"d2h": {"32": ["staged", "direct"], "512": ["kernel-bulk", "batch"]}},  # h2d: the threshold rule
        {"d2h": {"512": ["batch"]}, "h2d": {"32": ["kernel-bulk", "staged"]}},
    ],
)
@pytest.mark.parametrize(("version", "capability"), [(13000, (9, 0)), (13000, (8, 0)), (12040, (9, 0))])
def test_auto_on_cuda_tensors_lists_what_it_takes(monkeypatch, tmp_path, table, version, capability) -> None:
    """info's CUDA choices for auto are the designs its calls take on this (pretend) machine, in its
    ranking order: for every direction and fragment size, taking designs away one by one."""
    path = tmp_path / "auto.json"
    if table is not None:
        path.write_text(json.dumps({"kernel_max_fragment_bytes": 64, "table": table}))
    report = _env.gather()  # this machine's, for the text below
    said = with_driver(monkeypatch, version, capability, auto_config=path)["auto"]
    stream = types.SimpleNamespace(cuda_stream=7, device=None)  # a side stream: batch may run
    monkeypatch.setattr(copy_engine, "plan_stream", lambda plan: stream)
    taken: set[str] = set()
    for direction in ("d2h", "h2d"):
        for page_size in (1, 16):  # 32 B and 512 B fragments: either side of the 64 B threshold
            plan, _, _ = cpu_plan(direction, page_size)
            plan = dataclasses.replace(plan, route=dataclasses.replace(plan.route, device=torch.device("cuda", 0),
                                                                       gpu_addressable=True))  # fmt: skip
            sequence = knock_out_sequence(AutoBackend(), plan)
            if table is None and page_size == 1:  # the threshold rule's ranking, in its order
                assert sequence == [d for d in said.choices["cuda"] if d in AutoBackend.THRESHOLD_RANKING]
            taken.update(sequence)
    assert said.choices["cuda"] == sorted(taken, key=AUTO_DESIGNS.index)
    assert said.ranking["designs"] == list(AutoBackend(path=path).candidates())
    assert set(said.choices["cuda"]) <= set(said.ranking["designs"])
    assert said.ranking["exists"] is (table is not None)
    text = info.format_report({**report, "io_backends": {"auto": dataclasses.asdict(said)}})
    assert f"among {', '.join(said.choices['cuda'])}" in text or f"always {said.choices['cuda'][0]}" in text
