"""Quality of the compiled transfer kernels and launcher checks, all without a GPU.

- ``csrc/transfer.cu`` compiled for sm_90 with ``-Xptxas -v``: every instantiation of the kernel
  template exists, with no stack frame and no spills (no local memory at all).
- Its SASS: each vector width moves data with exactly its width (128-bit ``LDG``/``STG`` for 16-byte
  kernels), with the cache operators chosen in ``transfer.cuh`` (``.NA`` no-L1-allocate loads;
  ``.EF`` streaming stores into host memory, plain write-back stores into device memory, which
  attention reads next), and every kernel issues its unrolled loads before the matching stores.
- The vector-width rule of the extension (its argument checks: ``tests/kernels/test_ext_args.py``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import hicache_kernels

from cudatools import CUDA_HOME, NVCC, cuobjdump

ROOT = Path(__file__).resolve().parents[2]
SIDES = ("Affine", "Table")
STORES = ("Streaming", "WriteBack")  # the store policies of transfer.cuh: host and device destinations
VEC_BYTES = (16, 8, 4, 2, 1)
UNROLL = 4  # kTransferUnroll in csrc/transfer.cuh: independent vectors in flight per lane
# SASS of the data accesses per vector width: ld.global.nc.L1::no_allocate -> LDG.E.NA...CONSTANT,
# st.global.cs -> STG.E.EF..., st.global -> STG.E... (nvcc 13, sm_90).
DATA_LOAD = {
    16: "LDG.E.NA.128.CONSTANT",
    8: "LDG.E.NA.64.CONSTANT",
    4: "LDG.E.NA.CONSTANT",
    2: "LDG.E.NA.U16.CONSTANT",
    1: "LDG.E.NA.U8.CONSTANT",
}
DATA_STORE = {
    "Streaming": {16: "STG.E.EF.128", 8: "STG.E.EF.64", 4: "STG.E.EF", 2: "STG.E.EF.U16", 1: "STG.E.EF.U8"},
    "WriteBack": {16: "STG.E.128", 8: "STG.E.64", 4: "STG.E", 2: "STG.E.U16", 1: "STG.E.U8"},
}
KERNEL_RE = re.compile(
    r"void hicache::transfer_kernel<hicache::(\w+)Side, hicache::(\w+)Side, hicache::(\w+)Store, (\d+)>"
)
ALL_KERNELS = {(s, d, st, v) for s in SIDES for d in SIDES for st in STORES for v in VEC_BYTES}

needs_nvcc = pytest.mark.skipif(not NVCC.exists(), reason=f"no nvcc under {CUDA_HOME}")
needs_extension = pytest.mark.skipif(
    not hicache_kernels.build_info()["cuda_built"], reason="the CUDA extension was not built (HICACHE_SKIP_CUDA)"
)


def demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    assert cxxfilt, "c++filt (binutils) is needed to name the kernels"
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines(), strict=True))


def kernel_key(demangled: str) -> tuple[str, str, str, int] | None:
    m = KERNEL_RE.search(demangled)
    return (m.group(1), m.group(2), m.group(3), int(m.group(4))) if m else None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(ptxas -v report, SASS) of csrc/transfer.cu for sm_90, with setup.py's device flags."""
    out = tmp_path_factory.mktemp("kernels") / "transfer.cubin"
    cmd = [
        str(NVCC),
        "-O3",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        f"-I{ROOT / 'csrc'}",
        f"-I{CUDA_HOME / 'include'}",
        "-arch=sm_90",
        "-cubin",
        "-Xptxas",
        "-v",
        str(ROOT / "csrc" / "transfer.cu"),
        "-o",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sass = subprocess.run([cuobjdump(), "-sass", str(out)], capture_output=True, text=True, check=True).stdout
    return proc.stdout + proc.stderr, sass


def ptxas_properties(report: str) -> dict[tuple[str, str, str, int], tuple[int, int, int]]:
    """kernel -> (stack frame, spill stores, spill loads) in bytes."""
    found = re.findall(
        r"Function properties for (\S+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
        report,
    )
    names = demangle([f[0] for f in found])
    props = {}
    for name, *numbers in found:
        key = kernel_key(names[name])
        if key is not None:
            props[key] = tuple(int(x) for x in numbers)
    return props


def sass_functions(sass: str) -> dict[tuple[str, str, str, int], list[tuple[int, str]]]:
    """kernel -> [(address, opcode with modifiers)], predicates dropped."""
    sections = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)
    names = demangle(sections[1::2])
    funcs = {}
    for name, body in zip(sections[1::2], sections[2::2], strict=True):
        key = kernel_key(names[name])
        if key is None:
            continue
        funcs[key] = [
            (int(addr, 16), op)
            for addr, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", body)
        ]
    return funcs


@needs_nvcc
def test_every_instantiation_has_no_local_memory(compiled: tuple[str, str]) -> None:
    props = ptxas_properties(compiled[0])
    assert set(props) == ALL_KERNELS
    bad = {k: v for k, v in props.items() if v != (0, 0, 0)}
    assert not bad, f"(stack frame, spill stores, spill loads) bytes not all zero: {bad}"


@needs_nvcc
def test_sass_has_no_local_memory_access(compiled: tuple[str, str]) -> None:
    funcs = sass_functions(compiled[1])
    assert set(funcs) == ALL_KERNELS
    local = {k: sorted({op for _, op in ins if op.startswith(("LDL", "STL"))}) for k, ins in funcs.items()}
    assert not any(local.values()), local


@needs_nvcc
@pytest.mark.parametrize("vec", VEC_BYTES)
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize(("src", "dst"), [(s, d) for s in SIDES for d in SIDES])
def test_data_accesses_use_the_vector_width(
    compiled: tuple[str, str], src: str, dst: str, store: str, vec: int
) -> None:
    ins = sass_functions(compiled[1])[(src, dst, store, vec)]
    # Data loads are the only .NA (no L1 allocate) loads; index and table loads are plain 64-bit.
    loads = [(a, op) for a, op in ins if op.startswith("LDG") and ".NA" in op]
    stores = [(a, op) for a, op in ins if op.startswith("STG")]
    assert [op for _, op in loads] == [DATA_LOAD[vec]] * UNROLL
    # The kernel's only global stores are its data stores, each with its policy's cache operator.
    assert [op for _, op in stores] == [DATA_STORE[store][vec]] * UNROLL
    # All loads of a round are issued before its first store: UNROLL vectors in flight per lane.
    assert max(a for a, _ in loads) < min(a for a, _ in stores)


@needs_nvcc
def test_host_direction_kernels_move_128_bit_vectors(compiled: tuple[str, str]) -> None:
    """A backup (d2h: into an affine host pool) streams its stores past L2 (evict-first); a load (h2d:
    into a per-layer device pool) keeps the default write-back policy, as attention reads it next."""
    funcs = sass_functions(compiled[1])
    for key, store in [(("Table", "Affine", "Streaming", 16), "STG.E.EF.128"),
                       (("Affine", "Table", "WriteBack", 16), "STG.E.128")]:  # fmt: skip
        ops = {op for _, op in funcs[key]}
        assert "LDG.E.NA.128.CONSTANT" in ops and store in ops, (key, sorted(ops))


@needs_nvcc
def test_the_destination_decides_the_store_policy(tmp_path: Path) -> None:
    """The one place mapping the destination to the store policy (HICACHE_STORE_SWITCH, which the
    launcher dispatches through): a host destination gets streaming stores, a device one write-back."""
    probe = tmp_path / "store_policy.cu"
    probe.write_text(
        '#include "transfer.cuh"\n'
        "namespace hicache {\n"
        "constexpr bool evict_first(bool dst_host) {\n"
        "  HICACHE_STORE_SWITCH(dst_host, Store, { return Store::kEvictFirst; })\n"
        "}\n"
        'static_assert(evict_first(true), "host destinations: streaming (evict-first) stores");\n'
        'static_assert(!evict_first(false), "device destinations: write-back stores");\n'
        "}  // namespace hicache\n"
    )
    cmd = [str(NVCC), "-std=c++17", f"-I{ROOT / 'csrc'}", "-arch=sm_90", "-c", str(probe), "-o",
           str(tmp_path / "store_policy.o")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_extension
@pytest.mark.parametrize(
    ("align", "expected"),
    [(0, 16), (1, 1), (2, 2), (3, 1), (4, 4), (6, 2), (8, 8), (12, 4), (16, 16), (48, 16), (656, 16), (1 << 40, 16)],
)
def test_vector_width_rule(align: int, expected: int) -> None:
    from hicache_kernels._ext import load_extension

    assert load_extension().vector_bytes(align) == expected


@needs_extension
def test_vector_width_rejects_negative_alignment() -> None:
    from hicache_kernels._ext import load_extension

    with pytest.raises(ValueError, match="align_bytes"):
        load_extension().vector_bytes(-16)
