"""Arch-list parsing, precedence and coverage rules (hicache_kernels/_archs.py)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from hicache_kernels import _archs
from hicache_kernels._archs import CudaArch, covers, parse_arch_list, select_arch_list


def names(text: str) -> list[str]:
    return [str(a) for a in parse_arch_list(text)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90", ["90"]),
        ("9.0", ["90"]),
        ("sm_90", ["90"]),
        ("compute_90", ["90"]),
        ("90;80", ["80", "90"]),
        ("8.0 9.0+PTX", ["80", "90+PTX"]),
        ("8.0,9.0+ptx", ["80", "90+PTX"]),
        ("80;90;100;120", ["80", "90", "100", "120"]),
        ("90a", ["90a"]),
        ("9.0a", ["90a"]),
        ("90;90a", ["90", "90a"]),
        ("100f", ["100f"]),
        ("90;90+PTX", ["90+PTX"]),
        ("10.0;12.0", ["100", "120"]),
        ("Hopper", ["90"]),
        ("Ampere+PTX", ["80", "86+PTX"]),
        ("  90 ;; 80  ", ["80", "90"]),
    ],
)
def test_parse(text: str, expected: list[str]) -> None:
    assert names(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        (" ; ", "empty"),
        ("9", "major and minor"),
        ("sm90x", "not understood"),
        ("90+SASS", "not understood"),
        ("70", "not supported"),
        ("5.2", "not supported"),
        ("91", "not supported"),
    ],
)
def test_parse_rejects(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_arch_list(text)


def test_unsupported_check_can_be_disabled() -> None:
    assert [a.name for a in parse_arch_list("70", supported=None)] == ["70"]


def test_gencode_flags() -> None:
    assert CudaArch("90").gencode() == ["-gencode=arch=compute_90,code=sm_90"]
    assert CudaArch("120", ptx=True).gencode() == [
        "-gencode=arch=compute_120,code=sm_120",
        "-gencode=arch=compute_120,code=compute_120",
    ]
    assert CudaArch("90", "a").gencode() == ["-gencode=arch=compute_90a,code=sm_90a"]


def test_precedence() -> None:
    assert select_arch_list({"HICACHE_CUDA_ARCHS": "90", "TORCH_CUDA_ARCH_LIST": "8.0"}) == ("90", "HICACHE_CUDA_ARCHS")
    assert select_arch_list({"HICACHE_CUDA_ARCHS": " ", "TORCH_CUDA_ARCH_LIST": "8.0"}) == (
        "8.0",
        "TORCH_CUDA_ARCH_LIST",
    )
    assert select_arch_list({}) == (_archs.DEFAULT_ARCHS, "default")


def test_default_list_is_supported_by_nvcc13() -> None:
    archs = parse_arch_list(_archs.DEFAULT_ARCHS)  # raises if any entry is outside NVCC13_ARCHS
    assert "90" in [a.name for a in archs] and archs[-1].ptx


@pytest.mark.skipif(shutil.which("/usr/local/cuda/bin/nvcc") is None, reason="no CUDA toolkit at /usr/local/cuda")
def test_supported_table_matches_local_nvcc() -> None:
    out = subprocess.run(["/usr/local/cuda/bin/nvcc", "--list-gpu-arch"], capture_output=True, text=True, check=True)
    listed = {a.removeprefix("compute_") for a in out.stdout.split()}
    assert set(_archs.NVCC13_ARCHS) <= listed


@pytest.mark.parametrize(
    ("archs", "cc", "ok", "how"),
    [
        ("90", (9, 0), True, "sm_90"),
        ("80", (8, 6), True, "sm_80"),  # same major, older minor: binary compatible
        ("80;86", (8, 9), True, "sm_86"),  # picks the newest compatible cubin
        ("86", (8, 0), False, "no cubin"),
        ("90", (10, 0), False, "no cubin"),
        ("90+PTX", (10, 0), True, "PTX compute_90"),
        ("90a", (9, 0), True, "sm_90a"),
        ("90a", (10, 0), False, "no cubin"),
        ("100+PTX", (9, 0), False, "no cubin"),  # PTX runs only on newer GPUs
    ],
)
def test_covers(archs: str, cc: tuple[int, int], ok: bool, how: str) -> None:
    got_ok, got_how = covers(parse_arch_list(archs), *cc)
    assert got_ok is ok
    assert how in got_how


# ------------------------------------------------------------------------------ a build's identity


@pytest.mark.parametrize(
    ("env", "cuda", "archs", "label"),
    [
        ({}, 13000, "90", "cu130.sm90"),
        ({}, 13000, "8.0;9.0+PTX", "cu130.sm80.sm90ptx"),
        ({}, 12080, "90a;100f", "cu128.sm90a.sm100f"),
        ({}, 13010, _archs.DEFAULT_ARCHS, "cu131.sm75.sm80.sm86.sm89.sm90.sm100.sm120ptx"),
        ({}, None, None, "cpu"),  # pure-Python build
        ({"HICACHE_LOCAL_VERSION": ""}, 13000, "90", None),
        ({"HICACHE_LOCAL_VERSION": "  "}, None, None, None),
        ({"HICACHE_LOCAL_VERSION": "site.h200"}, 13000, "90", "site.h200"),
        ({"HICACHE_LOCAL_VERSION": "+cu130.sm90"}, None, None, "cu130.sm90"),
        ({"HICACHE_LOCAL_VERSION": "+"}, 13000, "90", None),
    ],
)
def test_local_version(env: dict[str, str], cuda: int | None, archs: str | None, label: str | None) -> None:
    parsed = parse_arch_list(archs) if archs else None
    assert _archs.local_version(env, cuda, parsed) == label


@pytest.mark.parametrize("bad", ["cu130-sm90", "cu130_sm90", "a..b", ".a", "a b", "++x"])
def test_local_version_rejects_invalid_labels(bad: str) -> None:
    with pytest.raises(ValueError, match="HICACHE_LOCAL_VERSION"):
        _archs.local_version({"HICACHE_LOCAL_VERSION": bad}, 13000, parse_arch_list("90"))


def test_cudart_version_from_header() -> None:
    assert _archs.cudart_version_from_header("/* x */\n#define CUDART_VERSION  13000\n") == 13000
    assert _archs.cudart_version_from_header("#  define CUDART_VERSION 12080\n") == 12080
    with pytest.raises(ValueError, match="CUDART_VERSION"):
        _archs.cudart_version_from_header("#define CUDART_VERSION_MINOR 1\n")


@pytest.mark.skipif(shutil.which("/usr/local/cuda/bin/nvcc") is None, reason="no CUDA toolkit at /usr/local/cuda")
def test_cudart_version_of_local_toolkit_matches_nvcc() -> None:
    header = open("/usr/local/cuda/include/cuda_runtime_api.h").read()
    out = subprocess.run(["/usr/local/cuda/bin/nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    release = re.search(r"release (\d+)\.(\d+)", out)
    assert release is not None, out
    version = _archs.cudart_version_from_header(header)
    assert _archs.cuda_version_text(version) == f"{release[1]}.{release[2]}"


@pytest.mark.parametrize(("cuda", "driver"), [(13000, 13000), (13020, 13000), (12080, 12000)])
def test_min_driver_version(cuda: int, driver: int) -> None:
    assert _archs.min_driver_version(cuda) == driver
