"""Every figure the README quotes is in the result file it names, and every result file it names records
the command, the commit and the machine.

``FIGURES`` ties each passage of README.md that quotes measurements to its file under
``benchmarks/results/`` and says how each number is read from that file (an expression over the loaded
JSON). The tests check that:

- each passage is in the README (whitespace aside), and the file it reads is named in the same
  paragraph;
- each number, read from the file and rounded as the README writes it, is the number the README writes;
- every measured-looking number in the README (a time, a rate, a ratio, a speed-up, a percentage; code
  blocks and inline code left out) lies in a passage of ``FIGURES`` or of ``NOT_MEASURED`` (thresholds,
  parameters and plans, each with the reason it is not a measurement): a figure added without a file
  fails here;
- the files record their provenance: ``command``, ``commit`` and ``machine`` at the top level, or, for
  the raw output of a GPU run, a folder whose README.md gives the commands and commit and whose
  machine.txt describes the machine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
README = (ROOT / "README.md").read_text()


def flat(text: str) -> str:
    return " ".join(text.split())


# --------------------------------------------------------------------------- reading result files
def mode(d: dict, name: str) -> dict:
    """A serving run's row for ``name`` (recompute, device, hierarchical, storage)."""
    return next(r for r in d["results"] if r["mode"] == name)


def hit(d: dict, name: str) -> float:
    """A serving mode's hit rate: the prompt tokens found on any tier."""
    r = mode(d, name)
    return r["device_hit_rate"] + r["host_hit_rate"] + r["storage_hit_rate"]


def p50_ms(d: dict, name: str) -> float:
    return mode(d, name)["ttft_p50_s"] * 1e3


def target(d: dict, what: str) -> float:
    """What ``hicache-targets`` measures for the target whose name contains ``what``."""
    from hicache_kernels import targets

    rows = [r for r in targets.evaluate(d) if what in r["target"]]
    assert len(rows) == 1, what
    return rows[0]["measured"]


def tenants(d: dict, key: str) -> list[float]:
    return [t[key] for t in mode(d, "hierarchical")["by_tenant"].values()]


def eager(d: dict, check: bool) -> list[float]:
    """Medians (us) of the eager op calls of a ``--host-overhead`` run, with or without index checks."""
    return [p["median_us"] for p in d["points"] if p.get("path") == "eager" and p["check_indices"] is check]


def prefetch_ms(d: dict, pages: int) -> float:
    return 1e3 * next(p["latency_s"] for p in d["prefetch"] if p["hit_pages"] == pages)


def staged(d: dict, key: str) -> list[float]:
    return [o[key] for o in d["objects"] if not o["zero_copy"]]


def rps(d: dict, page: int, side: str) -> float:
    return next(r for r in d["results"] if r["page_size"] == page)[side]["requests_per_s"]


def cmp(d: dict, page: int, key: str) -> float:
    return next(r for r in d["results"] if r["page_size"] == page)[key]


def scale(d: dict, key: str) -> list[float]:
    return [r[key] for r in d["results"]]


def by_round_ms(d: dict, name: str) -> list[float]:
    return [1e3 * v for _, v in sorted(mode(d, name)["ttft_p50_by_round_s"].items(), key=lambda kv: int(kv[0]))]


HELPERS = {
    "prefetch_ms": prefetch_ms, "staged": staged, "rps": rps, "cmp": cmp, "scale": scale, "by_round_ms": by_round_ms,
    "mode": mode, "hit": hit, "p50_ms": p50_ms, "target": target, "tenants": tenants, "eager": eager,
}  # fmt: skip


def load(name: str) -> Any:
    path = RESULTS / name
    if path.suffix == ".json":
        d = json.loads(path.read_text())
        if "points" in d and "meta" in d:  # a hicache_kernels.bench run: as hicache-targets reads it
            from hicache_kernels import targets

            return targets.load_bench_result(str(path))
        return d
    return path.read_text()


@dataclass
class Fig:
    """A README passage (``text``) quoting figures from ``file``; ``values`` maps each number as written
    (``"77.9"``, ``"55.2k"``, ``"105%"``, ``"1.68x"``) to an expression over the file's JSON ``d``."""

    file: str
    text: str
    values: dict[str, str] = field(default_factory=dict)
    named_as: str = ""  # how the README names the file when it names several at once (a pattern)


@dataclass
class NotMeasured:
    """A README passage whose numbers are not measurements (a threshold, a parameter, a plan)."""

    text: str
    why: str


# A serving run's usual sentence, in its order: hit rate device-only and hierarchical; TTFT p50 of recompute,
# device-only, hierarchical; their ratio; TTFT p50 with the store and the share of prompt tokens from it.
SERVING = ("hit(d, 'device')", "hit(d, 'hierarchical')", "p50_ms(d, 'recompute')", "p50_ms(d, 'device')",
           "p50_ms(d, 'hierarchical')", "d['target']['measured']", "p50_ms(d, 'storage')",
           "mode(d, 'storage')['storage_hit_rate']")  # fmt: skip


def serving(file: str, text: str, *written: str) -> Fig:
    """A serving run's passage whose numbers, as written, come in :data:`SERVING`'s order."""
    assert len(written) == len(SERVING), written
    return Fig(file, text, dict(zip(written, SERVING, strict=True)))


GPU = "2026-12-04_h200_gpu-check/"

FIGURES: list[Fig] = [
    # ------------------------------------------------------------------ the H200 run
    Fig(GPU + "call1-stage1/bench_core.json",
        "P1 `kernel` / copy engine 0.919 d2h (pass) and 0.834 h2d (miss: the one-layer load at 4 SMs), P2 "
        "`kernel` / `direct` 56.5x (pass), P3 `kernel` / `batch` 12.3x (pass)",
        {"0.919": "target(d, 'd2h')", "0.834": "target(d, 'h2d')", "56.5x": "target(d, 'kernel / direct')",
         "12.3x": "target(d, 'kernel / batch')"}),
    Fig(GPU + "call2-stage2-bench/bench_quick.json",
        "`auto` 1.04 of the best backend's time (pass), P4 overlapped load 1.03 of compute-only (pass), P5 a "
        "GEMM beside the register kernel 105% slower at 4 SMs (miss)",
        {"1.04": "target(d, 'auto time')", "1.03": "target(d, 'overlapped load')",
         "105%": "100 * target(d, 'GEMM slowdown')"}),
    Fig(GPU + "call2-stage2-bench/serving.json",
        "P8 hierarchical TTFT p50 0.223 of device-only", {"0.223": "d['target']['measured']"}),
    Fig(GPU + "call1-stage1/summary.txt", "on the H200 run it took 154 s",
        {"154 s": "int(re.search(r'elapsed (\\d+)s', d).group(1))"}),
    Fig(GPU + "call1-stage1/host_overhead.json",
        "the checks' device synchronization made a checked call 187-337 us against 6.0-6.7 us without",
        {"187": "min(eager(d, True))", "337": "max(eager(d, True))", "6.0": "min(eager(d, False))",
         "6.7": "max(eager(d, False))"}),
    # ------------------------------------------------------------------ the 2-core machine, 2026-12-06
    Fig("2026-12-06_cpu-2core_build-and-tests.json",
        "the full suite ran 4799 tests (1943 more skipped: GPU tests, and clients absent there) in 869 s with "
        "`-n auto`",
        {"869 s": "d['tests']['full']['wall_s']"}),
    Fig("2026-12-06_cpu-2core_build-and-tests.json", "wheel builds and took 392 s",
        {"392 s": "d['tests']['quick']['wall_s']"}),
    Fig("2026-12-06_cpu-2core_build-and-tests.json",
        "a clean sm_90 build (the host core included) took 28.7 s, a rebuild for sm_80 in the same `build/` "
        "folder 11.0 s",
        {"28.7 s": "d['builds']['clean_sm90_s']", "11.0 s": "d['builds']['rebuild_sm80_s']"}),
    Fig("2026-12-06_cpu-2core_host-overhead.json",
        "an eager op call took 4.7-5.2 us with `check_indices=False` and 7.3-7.8 us with the index checks",
        {"4.7": "min(eager(d, False))", "5.2": "max(eager(d, False))", "7.3": "min(eager(d, True))",
         "7.8": "max(eager(d, True))"}),
    Fig("2026-12-06_cpu-2core_storage-prefetch-page_head-group1.json",
        "a 128-page prefetch took 116.9 ms in `page_head` with groups of 1", {"116.9": "prefetch_ms(d, 128)"},
        "2026-12-06_cpu-2core_storage-prefetch-L-groupG.json"),
    Fig("2026-12-06_cpu-2core_storage-prefetch-page_head-group8.json", "against 89.7 ms with `storage_head_group=8`",
        {"89.7": "prefetch_ms(d, 128)"}, "2026-12-06_cpu-2core_storage-prefetch-L-groupG.json"),
    Fig("2026-12-06_cpu-2core_storage-prefetch-page_first-group1.json", "and 393.7 ms against",
        {"393.7": "prefetch_ms(d, 128)"}, "2026-12-06_cpu-2core_storage-prefetch-L-groupG.json"),
    Fig("2026-12-06_cpu-2core_storage-prefetch-page_first-group8.json", "against 195.4 ms in `page_first`",
        {"195.4": "prefetch_ms(d, 128)"}, "2026-12-06_cpu-2core_storage-prefetch-L-groupG.json"),
    Fig("2026-12-06_cpu-2core_storage-prefetch-page_head-group1.json",
        "its gather ran at 6.0-6.9 GB/s and its scatter at 8.6-10.8 GB/s",
        {"6.0": "min(staged(d, 'gather_gbps'))", "6.9": "max(staged(d, 'gather_gbps'))",
         "8.6": "min(staged(d, 'scatter_gbps'))", "10.8": "max(staged(d, 'scatter_gbps'))"},
        "`page_head-group1` file"),
    Fig("2026-12-06_cpu-2core_tree.json",
        "the compiled core 18.6k req/s at page 1 and 18.3k at page 16 (24.1k and 25.4k on `array('q')` prompts), "
        "the Python core 6.4k and 5.5k",
        {"18.6k": "rps(d, 1, 'hicache')", "18.3k": "rps(d, 16, 'hicache')", "24.1k": "rps(d, 1, 'hicache_array')",
         "25.4k": "rps(d, 16, 'hicache_array')", "6.4k": "rps(d, 1, 'hicache_python')",
         "5.5k": "rps(d, 16, 'hicache_python')"}),
    Fig("2026-12-06_cpu-2core_tree-scale.json", "(host pool 4x; 512 / 32.7k / 261k nodes)",
        {"4": "d['config']['host_ratio']", "512": "scale(d, 'nodes')[0]", "32.7k": "scale(d, 'nodes')[1]",
         "261k": "scale(d, 'nodes')[2]"}),
    Fig("2026-12-06_cpu-2core_tree-scale.json",
        "median 188 / 212 / 221 us, p99 528 / 683 / 700 us, growth 1.18x",
        {"188": "scale(d, 'median_us')[0]", "212": "scale(d, 'median_us')[1]", "221": "scale(d, 'median_us')[2]",
         "528": "scale(d, 'p99_us')[0]", "683": "scale(d, 'p99_us')[1]", "700": "scale(d, 'p99_us')[2]",
         "1.18x": "d['growth_ratio']"}),
    Fig("2026-12-03_cpu-2core_issue22-no-slower/summary.json", "gave medians from 114 to 223 us",
        {"114": "min(min(r) for k in ('median_us_old', 'median_us_new') for r in d['tree_scale'][k])",
         "223": "max(max(r) for k in ('median_us_old', 'median_us_new') for r in d['tree_scale'][k])"}),
    Fig("2026-12-06_cpu-2core_tree-vs-sglang-0.5.23.json",
        "1.60x SGLang 0.5.23's Rust core at page 1 and 1.66x at page 16, hit rates equal; with our prompts as "
        "lists, 1.18x and 1.25x",
        {"1.60x": "cmp(d, 1, 'speedup_vs_sglang_latest_same_input')",
         "1.66x": "cmp(d, 16, 'speedup_vs_sglang_latest_same_input')",
         "1.18x": "cmp(d, 1, 'speedup_vs_sglang_latest')", "1.25x": "cmp(d, 16, 'speedup_vs_sglang_latest')"}),
    serving("2026-12-06_cpu-2core_serving-multiturn.json",
        "hit rate 0.40 device-only vs 0.78 hierarchical; TTFT p50 254.1 ms recompute, 129.9 ms device-only, "
        "54.5 ms hierarchical (0.42 of device-only), 93.0 ms with the store below a host pool half the working "
        "set (0.13 of the prompt tokens",
        "0.40", "0.78", "254.1", "129.9", "54.5", "0.42", "93.0", "0.13"),
    Fig("2026-12-06_cpu-2core_serving-gpu-shape.json",
        "TTFT p50 1112.9 / 599.2 / 244.1 ms (hierarchical 0.41 of device-only), 25.9 / 43.8 / 70.6 generated "
        "tokens/s",
        {"1112.9": "p50_ms(d, 'recompute')", "599.2": "p50_ms(d, 'device')", "244.1": "p50_ms(d, 'hierarchical')",
         "0.41": "d['target']['measured']", "25.9": "mode(d, 'recompute')['throughput_tokens_per_s']",
         "43.8": "mode(d, 'device')['throughput_tokens_per_s']",
         "70.6": "mode(d, 'hierarchical')['throughput_tokens_per_s']"}),
    Fig("2026-12-06_cpu-2core_serving-longqa.json",
        "hit rate 0.00 device-only vs 0.73 hierarchical (from the host); TTFT p50 2769.3 ms recompute, 2859.2 "
        "ms device-only, 149.8 ms hierarchical (0.052 of device-only), 1042.2 ms with the store below a host "
        "pool of half the documents (0.66 of the prompt tokens prefetched from the store, 0.49 host hits); per "
        "question on a document, hierarchical p50 2.8 s for the first (cold in every mode) and 146-147 ms for "
        "each later one",
        {"0.00": "hit(d, 'device')", "0.73": "hit(d, 'hierarchical')", "2769.3": "p50_ms(d, 'recompute')",
         "2859.2": "p50_ms(d, 'device')", "149.8": "p50_ms(d, 'hierarchical')", "0.052": "d['target']['measured']",
         "1042.2": "p50_ms(d, 'storage')", "0.66": "mode(d, 'storage')['storage_hit_rate']",
         "0.49": "mode(d, 'storage')['host_hit_rate']", "2.8 s": "by_round_ms(d, 'hierarchical')[0] / 1e3",
         "146": "min(by_round_ms(d, 'hierarchical')[1:])", "147": "max(by_round_ms(d, 'hierarchical')[1:])"}),
    # ------------------------------------------------------------------ serving on the 2-core machine
    serving("2026-12-05_cpu-2core_serving-mla-indexer-fp8.json",
        "hit rate 0.40 device-only vs 0.78 hierarchical; TTFT p50 214.1 ms recompute, 114.6 ms device-only, "
        "44.1 ms hierarchical (0.38 of device-only), 65.4 ms with the store (0.13 of the prompt tokens from it)",
        "0.40", "0.78", "214.1", "114.6", "44.1", "0.38", "65.4", "0.13"),
    Fig("2026-12-05_cpu-2core_serving-mla-indexer.json", "289.5 / 163.9 / 52.5 / 58.9 ms",
        {"289.5": "p50_ms(d, 'recompute')", "163.9": "p50_ms(d, 'device')", "52.5": "p50_ms(d, 'hierarchical')",
         "58.9": "p50_ms(d, 'storage')"}),
    serving("2026-12-05_cpu-2core_serving-mla-indexer-recurrent.json",
        "hit rate 0.40 device-only vs 0.78 hierarchical; TTFT p50 274.8 ms recompute, 135.2 ms device-only, "
        "47.0 ms hierarchical (0.35 of device-only), 60.3 ms with the store (0.14 of the prompt tokens from it)",
        "0.40", "0.78", "274.8", "135.2", "47.0", "0.35", "60.3", "0.14"),
    Fig("2026-12-05_cpu-2core_serving-swa-window-pool.json",
        "hit rate 0.00 device-only vs 0.74 hierarchical (a shared system prompt's window is gone once its "
        "request moved on, and device-only eviction deletes the conversations' ends, where the windows are); "
        "TTFT p50 141.0 ms recompute, 158.8 ms device-only, 33.5 ms hierarchical",
        {"0.00": "hit(d, 'device')", "0.74": "hit(d, 'hierarchical')", "141.0": "p50_ms(d, 'recompute')",
         "158.8": "p50_ms(d, 'device')", "33.5": "p50_ms(d, 'hierarchical')"}),
    Fig("2026-12-05_cpu-2core_serving-multitenant.json",
        "hit rate 0.14 device-only vs 0.78 hierarchical (0.13-0.17 device and 0.61-0.65 host per tenant); TTFT "
        "p50 153.5 ms recompute, 140.6 ms device-only, 48.7 ms hierarchical (0.35 of device-only; 47.5-48.7 ms "
        "per tenant), 84.7 ms with the store (0.24 of the prompt tokens from it)",
        {"0.14": "hit(d, 'device')", "0.78": "hit(d, 'hierarchical')",
         "0.13": "min(tenants(d, 'device_hit_rate'))", "0.17": "max(tenants(d, 'device_hit_rate'))",
         "0.61": "min(tenants(d, 'host_hit_rate'))", "0.65": "max(tenants(d, 'host_hit_rate'))",
         "153.5": "p50_ms(d, 'recompute')", "140.6": "p50_ms(d, 'device')", "48.7": "p50_ms(d, 'hierarchical')",
         "0.35": "d['target']['measured']", "47.5": "1e3 * min(tenants(d, 'ttft_p50_s'))",
         "84.7": "p50_ms(d, 'storage')", "0.24": "mode(d, 'storage')['storage_hit_rate']"}),
]  # fmt: skip

NOT_MEASURED: list[NotMeasured] = [
    NotMeasured("at most 4 x 8 KiB", "a size of the kernel's ring"),
    NotMeasured("(median <= 100 us, p99 <= 400 us, growth <= 1.3x)", "issue 21's targets"),
    NotMeasured("(host pool 4x;", "a parameter of the run"),
    NotMeasured("hit rate about 0.84), at page", "the workload's design (the file's hit_rate says 0.84)"),
    NotMeasured("with the working set at least 4x the device pool", "the serving target's condition"),
    NotMeasured("which is 4.00x the pool", "the workload's design, printed by the run"),
    NotMeasured("stage 1 (planned to fit 5 minutes on an H200", "a plan for the GPU check, not a measurement"),
    NotMeasured("every `gpu` test (60 s per test)", "a time limit"),
    NotMeasured("(default 480 s)", "a time limit"),
    NotMeasured("(100k seeded steps", "a parameter of the slow tests"),
    NotMeasured("the batched copy engine reaches 4-7 GB/s on 4-24 KiB blocks",
                "vLLM's figure, cited from vllm#42212 (not ours)"),
]  # fmt: skip


# --------------------------------------------------------------------------- finding figures in the README
_NUM = r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?"
_UNIT = r"(?:\s?(?:us|µs|ms|s|minutes|GB/s|MB)(?![\w/])|%|x(?!\w)|k(?: req/s)?(?!\w)| req/s| (?:generated )?tokens/s)"
_FIGURE = re.compile(
    rf"-?{_NUM}(?:(?:%|x)?\s?(?:-|/)\s?{_NUM})*{_UNIT}"  # 12.3x, 185-237 ms, 814 / 500 / 188 ms, 55.2k
    rf"|(?<![\w.])\d+\.\d+(?![\d.])(?=\s+(?:of|d2h|h2d|device-only|hierarchical|host|device))"  # ratios
    rf"|(?<![\w.-])0\.\d+(?![\d.])"  # any other fraction
)


def _prose(text: str) -> str:
    """The README with code blocks and inline code masked (commands and code are not figures); same length,
    so positions match the README's."""

    def mask(m: re.Match) -> str:
        return re.sub(r"[^\n]", "_", m.group(0))

    return re.sub(r"`[^`]*`", mask, re.sub(r"```.*?```", mask, text, flags=re.S))


def _numbers(token: str) -> list[str]:
    return re.findall(r"\d+(?:,\d{3})*(?:\.\d+)?", token)


def figures_in(text: str) -> list[tuple[int, int, str]]:
    return [(m.start(), m.end(), m.group(0)) for m in _FIGURE.finditer(text)]


def find(passage: str, text: str = README) -> tuple[int, int] | None:
    """Where ``passage`` is in ``text``, whatever the line breaks."""
    m = re.search(r"\s+".join(map(re.escape, passage.split())), text)
    return (m.start(), m.end()) if m else None


# --------------------------------------------------------------------------- the tests
def _written_number(written: str) -> str:
    """The number of a figure as written (``"55.2k"`` -> ``"55.2"``, ``"2.8 s"`` -> ``"2.8"``)."""
    return written.rstrip("%xk").split(" ")[0]


def _value_matches(written: str, value: float) -> bool:
    number = _written_number(written).replace(",", "")
    scale = 1e3 if written.endswith("k") else 1.0
    decimals = len(number.split(".")[1]) if "." in number else 0
    return f"{value / scale:.{decimals}f}" == number


def _paragraph_of(index: int) -> str:
    """The paragraph or list item of the README around ``index``."""
    starts = [0] + [m.end() for m in re.finditer(r"\n\s*\n|\n(?=\s*- )", README)] + [len(README)]
    i = max(k for k, s in enumerate(starts) if s <= index)
    return flat(README[starts[i] : starts[i + 1]])


@pytest.mark.parametrize("fig", FIGURES, ids=lambda f: f.file + ":" + f.text[:30])
def test_each_figure_is_the_number_its_file_holds(fig):
    assert find(fig.text), f"not in README.md: {fig.text!r}"
    assert (RESULTS / fig.file).exists(), fig.file
    d = load(fig.file)
    tokens = [tok for _, _, tok in figures_in(_prose(fig.text))]
    numbers = [n for tok in tokens for n in _numbers(tok)]
    unread = [n for n in numbers if n not in map(_written_number, fig.values)]
    assert not unread, f"figures in the passage with no reading from {fig.file}: {unread}"
    wrong = []
    for written_as, expr in fig.values.items():
        value = eval(expr, {"re": re, "d": d, **HELPERS})  # noqa: S307 - expressions of this file
        if not _value_matches(written_as, float(value)):
            wrong.append(f"{written_as}: the file gives {value!r} ({expr})")
    assert not wrong, f"{fig.file}: {wrong}"


def test_each_figure_names_its_file_in_its_paragraph():
    for fig in FIGURES:
        span = find(fig.text)
        assert span, fig.text
        para = _paragraph_of(span[0])
        names = [fig.file, fig.file.split("/")[0], fig.file.split("/", 1)[-1], fig.named_as]
        assert any(n and n in para for n in names), f"the paragraph quoting {fig.text[:40]!r} does not name {fig.file}"


def test_every_figure_in_the_readme_is_tied_to_a_file():
    prose = _prose(README)
    covered = []
    for passage in [f.text for f in FIGURES] + [n.text for n in NOT_MEASURED]:
        span = find(passage)
        assert span, f"not in README.md: {passage!r}"
        covered.append(span)
    loose = [
        f"{tok!r} in ...{flat(README[max(0, a - 60) : b + 20])}..."
        for a, b, tok in figures_in(prose)
        if not any(s <= a and b <= e for s, e in covered)
    ]
    why = "README figures with no result file (add them to FIGURES, or to NOT_MEASURED with why):\n"
    assert not loose, why + "\n".join(loose)


def _keys_missing(path: Path) -> list[str]:
    """The provenance keys a result JSON lacks (or leaves empty)."""
    d = json.loads(path.read_text())
    return [k for k in ("command", "commit", "machine") if not d.get(k)]


def _provenance_missing(name: str) -> list[str]:
    folder = RESULTS / name.split("/")[0]
    if folder.is_dir():  # a run's raw output, in a folder of its own
        return [w for w in ("README.md", "machine.txt") if not (folder / w).exists()]
    return _keys_missing(RESULTS / name)


def test_each_quoted_file_records_command_commit_and_machine():
    missing = {f.file: m for f in FIGURES if (m := _provenance_missing(f.file))}
    assert not missing, f"result files without their provenance: {missing}"


def test_new_result_files_record_command_commit_and_machine():
    """From 2026-12-06 on, every result JSON carries its own provenance (older ones are history)."""
    new = [p for p in RESULTS.glob("*.json") if p.name >= "2026-12-06"]
    missing = {p.name: m for p in new if (m := _keys_missing(p))}
    assert not missing, missing
