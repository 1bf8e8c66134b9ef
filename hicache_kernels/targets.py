"""The benchmark targets, read from a bench JSON (never from a timed test).

``python -m hicache_kernels.targets bench.json`` prints one row per target: what was measured, the
threshold, and pass / MISS / n/a (not measured in that run). The targets (an H200 on PCIe Gen5 x16):

1. kernel >= 90% of the same-run copy-engine ceiling, both directions, items >= 512 B, every page
   size, with <= 4 SMs;
2. kernel / direct >= 10x at page size 1;
3. kernel / batch >= 2x for fragments (item x page size) <= 4 KiB;
4. auto within 5% of the best backend at every point;
5. GEMM slowdown beside a kernel-backend transfer <= 5%;
6. layer-wise overlapped load <= 1.05 x compute-only when the transfer takes no longer than compute.

Host overhead, read from ``python -m hicache_kernels.bench --host-overhead`` (a no-op io-backend, so
only the Python side is timed; medians, in microseconds; rows with ``check_indices=True``, which on a
GPU include the index check's device sync, are reported by the bench but not judged):

7. <= 10 us per eager op call (``ops.backup_layer`` ... ``ops.load_all_layers``), every pool;
8. <= 10 us per sgl-kernel compat call, every pool;
9. <= 25 us per call through the custom op (``torch.ops.hicache_kernels.backup`` / ``load``);
10. layer-wise load of a 61-layer pool: <= 25 us of host time per layer;
11. not growing with the number of layers: the 61-layer pool's time per call over the 3-layer pool's
    of the same kind (MLA), same path, op and index checking, <= 1.5.

Points are compared only with points of the same transfer (model, op, layout, page size, pages). A
``batch`` measurement that fell back to ``direct`` in any of its runs (``batch_fallback``) fails the
targets that compare against it (3 and 4), and the row names the fallback.

Exit status: 0 when no target missed (``n/a`` is not a miss; the last line counts pass / MISS / n/a,
and the bench's no-GPU functional check, mode ``cpu-functional-check``, reads as all n/a); 1 when a
target missed; 2, with one line on stderr, for a file that cannot be read, is not JSON, is not a bench
result (e.g. a pcie JSON, or ``{}``) or is malformed, and for a run whose link check failed (a
copy-engine ceiling or point faster than the PCIe link allows: a timing error).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

# What each target covers: one home for these facts, read by evaluate() below and by the bench's
# --targets-core plan (hicache_kernels.bench), which measures exactly the points they select.
T1_MIN_ITEM_BYTES = 512
T1_MAX_SMS = 4
T1_MIN_RATIO = 0.90
T2_PAGE_SIZE = 1
T2_MIN_RATIO = 10.0
T3_MAX_FRAGMENT_BYTES = 4096
T3_MIN_RATIO = 2.0
T4_MAX_RATIO = 1.05
# The host-overhead targets (7-11): microseconds of host time, and the growth from 3 to 61 layers.
H_EAGER_MAX_US = 10.0
H_COMPAT_MAX_US = 10.0
H_CUSTOM_OP_MAX_US = 25.0
H_LAYERWISE_MAX_US = 25.0
H_LAYERWISE_LAYERS = 61
H_GROWTH_MAX = 1.5
H_JUDGED_CHECK_INDICES = False  # judged rows: check_indices False (compat: none, it does not check)
# The exit statuses of main() (module docstring).
EXIT_OK, EXIT_MISS, EXIT_REFUSED = 0, 1, 2
FUNCTIONAL_CHECK_MODE = "cpu-functional-check"  # bench's no-GPU run: no figures
HOST_OVERHEAD_MODE = "host-overhead"  # bench --host-overhead: host-overhead points only


def in_target1(p: dict[str, Any]) -> bool:
    """A kernel point target 1 (kernel vs the copy-engine ceiling) judges."""
    return p["backend"] == "kernel" and p["item_bytes"] >= T1_MIN_ITEM_BYTES and (p.get("sm_budget") or 0) <= T1_MAX_SMS


def in_target2(p: dict[str, Any]) -> bool:
    """A kernel point, or its direct rival, that target 2 (kernel / direct) judges."""
    return p["backend"] in ("kernel", "direct") and p["page_size"] == T2_PAGE_SIZE


def in_target3(p: dict[str, Any]) -> bool:
    """A kernel point, or its batch rival, that target 3 (kernel / batch) judges."""
    return p["backend"] in ("kernel", "batch") and p["item_bytes"] * p["page_size"] <= T3_MAX_FRAGMENT_BYTES


def _row(
    target: str, measured: float | None, threshold: str, ok: bool | None, where: str = "", fallback: str | None = None
) -> dict[str, Any]:
    status = "n/a" if ok is None else ("pass" if ok else "MISS")
    return {"target": target, "measured": measured, "threshold": threshold, "status": status, "worst_at": where,
            "fallback": fallback}  # fmt: skip


def _where(p: dict[str, Any]) -> str:
    return f"{p['model']} {p['op']} {p['layout']} page {p['page_size']} sm {p.get('sm_budget')}"


def _key(p: dict[str, Any]) -> tuple:
    """The transfer a point measured (any backend): points with equal keys moved the same bytes."""
    return (p["model"], p["op"], p["layout"], p["page_size"], p.get("num_pages"))


def link_check_failure(doc: dict[str, Any]) -> str | None:
    """Why the bench refused its own measurements (a ceiling or point above the link), or None."""
    check = doc.get("meta", {}).get("link_check") or {}
    return None if check.get("passed") is not False else str(check.get("note") or "link check failed")


def evaluate(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target (see module docstring), worst case first-class: the minimum (or maximum)
    over every point the target covers, and where it occurred. A point whose batch run fell back to
    direct (``batch_fallback``) fails targets 3 and 4, which compare against batch, with the fallback
    shown in the row. Raises ValueError for a document whose bench refused its own figures."""
    refused = link_check_failure(doc)
    if refused is not None:
        raise ValueError(f"the bench refused this run's figures: {refused}")
    pts = doc.get("points", [])
    transfer = [p for p in pts if p.get("kind") == "transfer"]
    kernel = [p for p in transfer if p["backend"] == "kernel"]
    batch_at = {_key(p): p for p in transfer if p["backend"] == "batch"}
    rows = []

    # 1. Best kernel configuration with <= 4 SMs per transfer, then the worst of those.
    for direction in ("d2h", "h2d"):
        best: dict[tuple, dict] = {}
        for p in kernel:
            if p["direction"] == direction and in_target1(p):
                key = _key(p)
                if key not in best or p["ratio_to_ceiling"] > best[key]["ratio_to_ceiling"]:
                    best[key] = p
        worst = min(best.values(), key=lambda p: p["ratio_to_ceiling"], default=None)
        ratio = None if worst is None else worst["ratio_to_ceiling"]
        rows.append(_row(
            f"kernel / copy-engine ceiling, {direction}, items >= {T1_MIN_ITEM_BYTES} B, <= {T1_MAX_SMS} SMs",
            ratio, f">= {T1_MIN_RATIO:.2f}", None if ratio is None else ratio >= T1_MIN_RATIO,
            "" if worst is None else _where(worst),
        ))  # fmt: skip

    def ratio_row(name: str, key: str, threshold: float, select, rival_fallback) -> None:
        sel = [p for p in kernel if select(p) and p.get(key) is not None]
        fell_back = [p for p in sel if rival_fallback(p)]
        if fell_back:  # the ratio is to direct under batch's name: the target is not met
            p = fell_back[0]
            note = f"batch fell back to direct: {rival_fallback(p)}"
            rows.append(_row(name, p[key], f">= {threshold:g}", False, f"{_where(p)}; {note}", rival_fallback(p)))
            return
        worst = min(sel, key=lambda p: p[key], default=None)
        if worst is None:
            rows.append(_row(name, None, f">= {threshold:g}", None))
        else:
            rows.append(_row(name, worst[key], f">= {threshold:g}", worst[key] >= threshold, _where(worst)))

    def no_fallback(p: dict[str, Any]) -> str | None:
        return None

    def batch_fallback(p: dict[str, Any]) -> str | None:
        return (batch_at.get(_key(p)) or {}).get("batch_fallback")

    ratio_row(f"kernel / direct at page size {T2_PAGE_SIZE}", "kernel_over_direct", T2_MIN_RATIO, in_target2,
              no_fallback)  # fmt: skip
    ratio_row(f"kernel / batch, fragments <= {T3_MAX_FRAGMENT_BYTES // 1024} KiB", "kernel_over_batch", T3_MIN_RATIO,
              in_target3, batch_fallback)  # fmt: skip

    # 4. auto against the best backend of the same transfer (main sweep: kernel at auto's SM budget).
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for p in transfer:
        groups[_key(p)].append(p)
    worst_auto, worst_ratio, fallback_at = None, None, None
    for members in groups.values():
        autos = [p for p in members if p["backend"] == "auto"]
        if not autos:
            continue
        auto = autos[0]
        rivals = [p for p in members if p["backend"] != "auto" and (p["backend"] != "kernel"
                  or p.get("sm_budget") == auto.get("sm_budget"))]  # fmt: skip
        if not rivals:
            continue
        # auto's own batch run or the batch rival fell back: either figure is direct's under batch's name.
        fell_back = next((p for p in [auto, *rivals] if p.get("batch_fallback")), None)
        if fell_back is not None and fallback_at is None:
            fallback_at = (auto, fell_back)
        ratio = auto["median_ms"] / min(p["median_ms"] for p in rivals)
        if worst_ratio is None or ratio > worst_ratio:
            worst_auto, worst_ratio = auto, ratio
    name = "auto time / best backend's time"
    if fallback_at is not None:
        auto, fell_back = fallback_at
        note = f"{fell_back['backend']} point's batch run fell back to direct: {fell_back['batch_fallback']}"
        rows.append(_row(name, worst_ratio, f"<= {T4_MAX_RATIO:g}", False, f"{_where(auto)}; {note}",
                         fell_back["batch_fallback"]))  # fmt: skip
    else:
        rows.append(_row(name, worst_ratio, f"<= {T4_MAX_RATIO:g}",
                         None if worst_ratio is None else worst_ratio <= T4_MAX_RATIO,
                         "" if worst_auto is None else _where(worst_auto)))  # fmt: skip

    # The kernel at the SM budgets target 1 allows (interference is also measured at larger budgets,
    # for the record; a kernel given more SMs is expected to take more from a GEMM).
    inter = [p for p in pts if p.get("kind") == "interference" and p["backend"] == "kernel"
             and (p.get("sm_budget") is None or p["sm_budget"] <= T1_MAX_SMS)]  # fmt: skip
    worst_inter = max(inter, key=lambda p: p["slowdown"], default=None)
    rows.append(_row(f"GEMM slowdown beside a kernel transfer, <= {T1_MAX_SMS} SMs",
                     None if worst_inter is None else worst_inter["slowdown"], "<= 0.05",
                     None if worst_inter is None else worst_inter["slowdown"] <= 0.05,
                     "" if worst_inter is None else f"at {worst_inter.get('sm_budget')} SMs"))  # fmt: skip

    over = [p for p in pts if p.get("kind") == "overlap"]
    applicable = [p for p in over if p.get("transfer_le_compute")]
    worst_over = max(applicable, key=lambda p: p["overlap_ratio"], default=None)
    note = "" if worst_over or not over else "transfer took longer than compute: target does not apply"
    rows.append(_row("overlapped load / compute-only", None if worst_over is None else worst_over["overlap_ratio"],
                     "<= 1.05", None if worst_over is None else worst_over["overlap_ratio"] <= 1.05, note))  # fmt: skip
    return rows + host_overhead_rows(pts)


def _host_where(p: dict[str, Any]) -> str:
    check = "" if p.get("check_indices") is None else f" check_indices={p['check_indices']}"
    return f"{p['path']} {p['op']} {p['pool']} ({p['num_layers']} layers){check}"


def host_overhead_rows(pts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Targets 7-11 (module docstring): the worst median over the points each covers, and where."""
    host = [p for p in pts if p.get("kind") == "host_overhead"]
    judged = [p for p in host if p.get("check_indices") in (None, H_JUDGED_CHECK_INDICES)]
    rows = []

    def worst_row(name: str, sel: list[dict[str, Any]], limit: float) -> None:
        worst = max(sel, key=lambda p: p["median_us"], default=None)
        measured = None if worst is None else worst["median_us"]
        rows.append(_row(name, measured, f"<= {limit:g} us", None if worst is None else measured <= limit,
                         "" if worst is None else _host_where(worst)))  # fmt: skip

    check = f"check_indices={H_JUDGED_CHECK_INDICES}"
    worst_row(f"host us per eager op call, {check}", [p for p in judged if p["path"] == "eager"], H_EAGER_MAX_US)
    worst_row("host us per compat call", [p for p in judged if p["path"] == "compat"], H_COMPAT_MAX_US)
    worst_row(f"host us per custom-op call, {check}", [p for p in judged if p["path"] == "custom_op"],
              H_CUSTOM_OP_MAX_US)  # fmt: skip
    worst_row(f"layer-wise load of a {H_LAYERWISE_LAYERS}-layer pool, host us per layer, {check}",
              [p for p in judged if p["path"] == "layerwise" and p["num_layers"] == H_LAYERWISE_LAYERS],
              H_LAYERWISE_MAX_US)  # fmt: skip

    # 11. The same call on pools of one kind that differ in layers: the most layers over the fewest.
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for p in host:
        if p["path"] != "layerwise":  # already per layer
            groups[(p["path"], p["op"], p.get("check_indices"), p.get("mla"))].append(p)
    worst, worst_ratio = None, None
    for members in groups.values():
        most = max(members, key=lambda p: p["num_layers"])
        fewest = min(members, key=lambda p: p["num_layers"])
        if most["num_layers"] == fewest["num_layers"] or fewest["median_us"] <= 0:
            continue
        ratio = most["median_us"] / fewest["median_us"]
        if worst_ratio is None or ratio > worst_ratio:
            worst, worst_ratio = (most, fewest), ratio
    where = "" if worst is None else f"{_host_where(worst[0])} / {worst[1]['pool']} ({worst[1]['num_layers']} layers)"
    rows.append(_row(f"host time, {H_LAYERWISE_LAYERS}-layer / 3-layer pool (eager, custom op, compat)", worst_ratio,
                     f"<= {H_GROWTH_MAX:g}", None if worst_ratio is None else worst_ratio <= H_GROWTH_MAX,
                     where))  # fmt: skip
    return rows


def load_bench_result(path: str) -> dict[str, Any]:
    """The bench JSON at ``path``. ValueError, one line, when it cannot be read, is not JSON, is not a
    bench result, is a run whose link check failed, or is malformed (bench's own validation)."""
    from .bench.results import validate_bench_json

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    except UnicodeDecodeError:
        raise ValueError("not a text file (not UTF-8)") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    meta = doc.get("meta") if isinstance(doc, dict) else None
    tool = meta.get("tool") if isinstance(meta, dict) else None
    if tool != "bench":
        why = f"meta.tool is {tool!r}" if tool is not None else "it has no meta.tool"
        raise ValueError(f"not a bench result ({why}); expected a JSON written by python -m hicache_kernels.bench "
                         "--json")  # fmt: skip
    if doc.get("mode", FUNCTIONAL_CHECK_MODE) not in (FUNCTIONAL_CHECK_MODE, HOST_OVERHEAD_MODE):
        raise ValueError(f"unknown bench mode {doc['mode']!r}")
    refused = link_check_failure(doc)
    if refused is not None:
        raise ValueError(f"the bench refused this run's figures: {refused}")
    problems = validate_bench_json(doc)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ValueError(f"not a well-formed bench result: {problems[0]}{more}")
    return doc


def main(argv: list[str] | None = None) -> int:
    """``python -m hicache_kernels.targets`` (also ``hicache-targets``); returns the exit status."""
    from .benchutil import OneLineParser, format_table

    parser = OneLineParser(prog="python -m hicache_kernels.targets", description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", help="a JSON written by python -m hicache_kernels.bench --json")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    try:
        doc = load_bench_result(args.bench_json)
        rows = evaluate(doc)
    except ValueError as exc:
        print(f"targets: {args.bench_json}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    count = {status: sum(r["status"] == status for r in rows) for status in ("pass", "MISS", "n/a")}
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        if doc.get("mode") == FUNCTIONAL_CHECK_MODE:
            print(f"targets: {args.bench_json} is the bench's no-GPU functional check: no figures, every target n/a")
        elif doc.get("mode") == HOST_OVERHEAD_MODE:
            print(f"targets: {args.bench_json} is a bench --host-overhead run: only the host-overhead targets apply")
        cols = [("target", "target"), ("measured", "measured"), ("threshold", "threshold"), ("status", "status"),
                ("worst_at", "worst at")]  # fmt: skip
        print(format_table(rows, cols))
        print(f"targets: {count['pass']} pass, {count['MISS']} MISS, {count['n/a']} n/a (not measured in this run, "
              "not a miss)")  # fmt: skip
    return EXIT_MISS if count["MISS"] else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
