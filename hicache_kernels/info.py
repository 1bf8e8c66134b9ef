"""``python -m hicache_kernels.info``: what this installation and machine can do.

Prints versions (the package's, and the one its build was given, with its local label), the archs
compiled in, the CUDA version built with and the oldest driver that can run it, CUDA runtime and driver
versions, each visible GPU with its PCIe link and the theoretical bandwidth it implies, and what a call
of each io-backend does here on CPU tensors (found by making one) and on CUDA tensors: how it copies, or
why it cannot; for ``auto``, the designs it can take and where its ranking comes from (``python -m
hicache.info`` adds what the cache layer takes: its compiled host core and its radix-tree core).
``--json`` prints the same as one JSON object. It never fails for lack of a GPU, a driver or NVML: it
says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._archs import cuda_version_text


def _said(status: dict[str, Any]) -> str:
    return f"{'usable' if status['usable'] else 'unusable'}: {status['reason']}"


def format_report(r: dict[str, Any]) -> str:
    b = r["build"]
    built_as = f"built as {b['version']}" if b.get("version") else "the build recorded no version"
    lines = [f"hicache-kernels {r['package']['version']} ({built_as})"]
    if b["cuda_built"] and "archs" in b:
        lines.append(
            f"  CUDA extension: built for sm {', '.join(b['archs'])} (chosen by {b.get('archs_source')}), "
            f"CUDA {cuda_version_text(b['cuda_version'])}, {b.get('cudart')} cudart; needs a driver supporting CUDA "
            f"{cuda_version_text(b['min_driver_cuda_version'])} or newer"
        )
    else:
        lines.append(f"  CUDA extension: NOT available: {b.get('extension_error') or b.get('skip_reason')}")
        rec = b.get("record") or {}
        if rec.get("cuda_built"):  # built, yet the extension does not import: say what the build recorded
            said = [f"archs {rec.get('archs')}"]
            if "cuda_version" in rec:
                said.append(f"CUDA {cuda_version_text(rec['cuda_version'])}")
            if "min_driver_cuda_version" in rec:
                said.append(
                    f"needs a driver supporting CUDA {cuda_version_text(rec['min_driver_cuda_version'])} or newer"
                )
            lines.append("    the build record says: " + ", ".join(said))
    t = r["torch"]
    lines.append(f"  torch: {t.get('version') or 'not installed'} (CUDA {t.get('cuda') or 'none: CPU build'})")
    lines.append(f"  triton: {r['triton'].get('version') or 'not installed'}")
    c = r["cuda"]
    lines.append(
        f"  CUDA runtime (extension): {c.get('extension_runtime') or '-'}; torch's: {c.get('torch_cuda') or '-'}; "
        f"driver: {c.get('driver') or '-'} (supports CUDA {c.get('driver_cuda') or '-'})"
    )
    if c.get("driver_error"):
        lines.append(f"    driver: {c['driver_error']}")
    if c.get("extension_runtime_error"):
        lines.append(f"    extension runtime cannot run: {c['extension_runtime_error']}")
    if not r["gpus"]:
        lines.append("  GPUs: none visible")
    for g in r["gpus"]:
        mem = f"{g['memory_gib']} GiB" if g["memory_gib"] is not None else "? GiB"
        sms = g["sm_count"] if g["sm_count"] is not None else "?"
        lines.append(
            f"  GPU {g['index']}: {g['name']}, sm_{(g['compute_capability'] or '?').replace('.', '')}, {sms} SMs, {mem}"
        )
        cover = "yes" if g["kernels_cover_arch"] else "NO"
        lines.append(f"    kernels cover this arch: {cover} ({g['coverage']})")
        p = g["pcie"]
        if p.get("error"):
            lines.append(f"    PCIe: unknown ({p['error']})")
        else:
            lines.append(
                f"    PCIe: Gen{p['current_generation']} x{p['current_width']} now (max Gen{p['max_generation']} "
                f"x{p['max_width']}); theoretical {p['current_gbps']} GB/s now, {p['max_gbps']} GB/s at max, "
                "per direction (links may train down when idle)"
            )
    for note in r["notes"]:
        lines.append(f"  note: {note}")
    lines.append("  io-backends:")
    for name, s in r["io_backends"].items():
        lines.append(f"    {name:<7} on CPU tensors: {_said(s['cpu'])}")
        lines.append(f"    {'':<7} on CUDA tensors: {_said(s['cuda'])}")
        ranking = s.get("ranking")
        if ranking is not None:
            if "error" in ranking:
                lines.append(f"    {'':<7} ranks nothing: {ranking['path']} ({ranking['named_by']}) does not load")
            else:
                lines.append(f"    {'':<7} ranks {', '.join(ranking['designs'])}: {ranking['rule']}")
    sw = r.get("sglang_switch")
    if sw is not None:
        state = "ON" if sw["on"] else "off"
        patched = f"; SGLang modules patched: {', '.join(sw['patched'])}" if sw["patched"] else ""
        lines.append(f"  SGLang kernel switch (HICACHE_SGL_KERNEL={sw['env'] or 'unset'}): {state}{patched}")
    hc = r.get("host_core")
    if hc is not None:
        where = f"built ({hc['file']})" if hc["built"] else f"NOT available: {hc['reason']}"
        lines.append(f"  hicache host core (hicache._core): {where}")
    tc = r.get("tree_core")
    if tc is not None:
        lines.append(f"  hicache radix-tree core: {tc['core'] or 'none'} ({tc['reason']})")
    for name, sb in r.get("storage_backends", {}).items():
        if sb["available"]:
            where = f"{sb['module']} {sb.get('version') or ''}".strip()
            lines.append(f"  hicache storage backend {name}: available ({where})")
            for plugin, state in sb.get("file_plugins", {}).items():
                lines.append(f"    {plugin:<7} {state}")
        else:
            lines.append(f"  hicache storage backend {name}: NOT available: {sb['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, extra: Any = None, prog: str = "python -m hicache_kernels.info") -> int:
    """The command; ``extra(report)`` adds a package's own entries to the report first (the cache layer's
    ``hicache.info`` does)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    from ._env import gather

    report = gather()
    from .compat.sglang_switch import status

    report["sglang_switch"] = status()
    if extra is not None:
        extra(report)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
