"""CPU-side quality guard for the Triton kernel: compiled ahead of time for sm_90 (no GPU needed), its
PTX must use 16-byte vector loads and stores whenever the launcher allows them (VEC > 1), and plain
ones when it does not.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from hicache_kernels.backends import triton as tt  # noqa: E402

try:  # the ahead-of-time API these tests use (Triton 3.8 spelling)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
except ImportError as exc:  # pragma: no cover - depends on the installed Triton
    pytest.skip(f"this Triton has no ahead-of-time compile API ({exc})", allow_module_level=True)

ELEM_TYPE = {8: "i64", 4: "i32", 2: "i16", 1: "u8"}


def global_accesses(src_table: bool, dst_table: bool, multi_chunk: bool, width: int, vec: int) -> set[str]:
    tt._import_triton()
    fn = JITFunction(tt._transfer_kernel)  # compiled, whatever TRITON_INTERPRET says
    names = fn.arg_names
    elem = "*" + ELEM_TYPE[width]
    sig = dict.fromkeys(names, "i64")
    sig.update(anchor=elem, src="*i64" if src_table else elem, dst="*i64" if dst_table else elem,
               src_idx="*i64", dst_idx="*i64")  # fmt: skip
    constexprs = {"SRC_TABLE": src_table, "DST_TABLE": dst_table, "MULTI_CHUNK": multi_chunk,
                  "ELEM": tt._tl_elem(width), "WIDTH": width, "VEC": vec, "ROWS": 4, "BLOCK": 256}  # fmt: skip
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    # Pointers as Triton specialises them at launch (16-byte aligned); integers left unspecialised
    # (e.g. 82 elements of a 656-byte item), the harder case.
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("anchor", "src", "dst", "src_idx", "dst_idx")}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32))  # fmt: skip
    ptx = compiled.asm["ptx"]
    return {m.group(0) for m in re.finditer(r"\b(ld|st)\.global[\w.]*", ptx)}


@pytest.mark.parametrize(("src_table", "dst_table"), [(True, False), (False, True)], ids=["backup", "load"])
@pytest.mark.parametrize("multi_chunk", [False, True], ids=["item", "page_head-chunks"])
@pytest.mark.parametrize(("width", "vector"), [(8, "v2.b64"), (4, "v4.b32"), (2, "v4.b32")])
def test_vector_accesses_when_aligned(src_table, dst_table, multi_chunk, width, vector):
    ops = global_accesses(src_table, dst_table, multi_chunk, width, 16 // width)
    assert f"ld.global.{vector}" in ops and f"st.global.{vector}" in ops, ops


def test_scalar_accesses_when_not_aligned():
    ops = global_accesses(True, False, False, 2, 1)
    assert "st.global.b16" in ops and not any(".v2." in o or ".v4." in o for o in ops), ops
