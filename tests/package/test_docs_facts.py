"""What README.md and docs/architecture.md state about the code is what the code does.

Each test reads a document and checks one kind of statement against the code: the names it tells users
to import exist, every environment variable the code reads is documented, every console script is named,
the default arch list covers what the README says it covers, the defaults it lists are the signatures'
defaults, the deferred-model suites it lists are the ones CI runs, and the architecture table names every
module of each folder. (The README's figures are checked against their files in test_readme_figures.py.)
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from hicache_kernels import _archs

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
ARCH = (ROOT / "docs" / "architecture.md").read_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


def _resolve(dotted: str) -> None:
    """Import the longest importable module prefix of ``dotted`` and get the rest as attributes. A module
    that needs a serving framework this environment lacks (the integrations) counts when its file exists."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name or (e.name and not e.name.startswith(("hicache", "hicache_kernels"))):
                rel = Path(*parts[:i])
                if e.name != name and any((base / rel).with_suffix(".py").exists() for base in (ROOT, ROOT / "python")):
                    return  # the module exists; its optional dependency is missing here
                continue
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return
    raise AssertionError(f"{dotted}: no such module")


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_every_dotted_name_the_docs_give_exists(doc):
    text = (ROOT / doc).read_text()
    names = sorted(set(re.findall(r"`((?:hicache|hicache_kernels)(?:\.[A-Za-z_]\w*)+)", text)))
    assert len(names) > 10, "the docs name the package's modules and classes"
    bad = []
    for name in names:
        try:
            _resolve(name)
        except (AssertionError, AttributeError, ImportError) as e:
            bad.append(f"{name}: {e}")
    assert not bad, f"{doc} names what does not exist: {bad}"


def test_prefetch_policy_is_where_users_look():
    from hicache.storage import PrefetchPolicy
    from hicache.storage.tier import PrefetchPolicy as Tier

    assert PrefetchPolicy is Tier
    assert "hicache.storage.PrefetchPolicy" in README


# Names the code uses that are not user settings: C macros and a test's own knob.
NOT_SETTINGS = {"HICACHE_STORE_SWITCH", "HICACHE_ARCH_LIST", "HICACHE_CHECK_ARG", "HICACHE_TEST_HANG_S"}


def _env_vars_read() -> set[str]:
    found: set[str] = set()
    files = [ROOT / "setup.py", ROOT / ".ci" / "run", *(ROOT / "scripts").glob("*.sh")]
    files += [*(ROOT / "scripts").glob("*.py")]
    files += [*(ROOT / "benchmarks").glob("*.sh"), *(ROOT / "hicache_kernels").rglob("*.py")]
    files += [*(ROOT / "python" / "hicache").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    for f in files:
        found |= set(re.findall(r"\bHICACHE_[A-Z][A-Z0-9_]*[A-Z0-9]\b", f.read_text(errors="replace")))
    return found - NOT_SETTINGS


def test_every_environment_variable_the_code_reads_is_documented():
    found = _env_vars_read()
    assert {"HICACHE_CUDA_ARCHS", "HICACHE_DEFERRED_SEED", "HICACHE_SGLANG_PATH", "HICACHE_AUTO_CONFIG"} <= found
    missing = sorted(v for v in found if f"`{v}" not in README)
    assert not missing, f"README.md does not document: {missing}"
    for other in ("XDG_CONFIG_HOME", "PYTHON", "CUDA_HOME", "MAX_JOBS"):
        assert f"`{other}`" in README, other


def test_every_console_script_is_named():
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    scripts = re.findall(r"^([\w-]+) = ", section, re.M)
    assert len(scripts) >= 7
    missing = [name for name in scripts if f"`{name}`" not in README]
    assert not missing, f"README.md does not name the console scripts {missing}"


def test_the_default_arch_list_covers_what_the_readme_says():
    row = next(line for line in README.splitlines() if line.startswith("| (neither) |"))
    assert f"`{_archs.DEFAULT_ARCHS}`" in row
    archs = _archs.parse_arch_list(_archs.DEFAULT_ARCHS)
    uncovered = [a for a in _archs.NVCC13_ARCHS if not _archs.covers(archs, int(a[:-1]), int(a[-1]))[0]]
    assert uncovered == ["110"], uncovered
    assert "only 11.0 (Jetson Thor) is not covered" in _flat(row)
    # the later minors the row says run on an earlier cubin
    for cc, cubin in (("87", "86"), ("88", "86"), ("103", "100"), ("121", "120")):
        assert _archs.covers(archs, int(cc[:-1]), int(cc[-1])) == (True, f"cubin sm_{cubin}")


def _default(func, name):
    return inspect.signature(func).parameters[name].default


def test_the_defaults_the_readme_lists_are_the_signatures():
    from hicache import HiRadixCache, HostKVPool
    from hicache_kernels import ops

    flat = _flat(README)
    for name in ("io_backend", "write_policy", "eviction_policy", "prefetch_policy"):
        assert f'`{name}="{_default(HiRadixCache.__init__, name)}"`' in flat, name
    assert f"`load_back_threshold={_default(HiRadixCache.__init__, 'load_back_threshold')}`" in flat
    layout, ratio = _default(HostKVPool.__init__, "layout"), _default(HostKVPool.__init__, "ratio")
    assert f'`layout="{layout}"`, `ratio={ratio}`' in flat
    for op in (ops.backup_layer, ops.backup_all_layers, ops.load_layer, ops.load_all_layers):
        assert _default(op, "backend") == "auto" and _default(op, "check_indices") is True, op.__name__
    assert '`backend="auto"` and `check_indices=True`' in flat


def test_the_deferred_suites_the_readme_lists_are_the_ones_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    suites = re.search(r'DEFERRED_SUITES="([^"]*)"', ci).group(1).split()
    flat = _flat(README)
    listed = re.search(r"as `DEFERRED_SUITES` in `\.ci/run` lists them: (.*?)\);", flat).group(1)
    assert re.findall(r"`([^`]+)`", listed) == [s.removeprefix("tests/") for s in suites]


def test_the_architecture_table_names_every_module_of_each_folder():
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| \d+ \| `hicache/(\w+)/` \| ([^|]*) \|", ARCH, re.M)}
    assert len(rows) == 9, sorted(rows)
    for folder, listed in rows.items():
        modules = {p.stem for p in (ROOT / "python" / "hicache" / folder).glob("*.py") if p.stem != "__init__"}
        named = set(re.findall(r"`(\w+)`", listed))
        assert modules <= named, f"docs/architecture.md's {folder}/ row lacks {sorted(modules - named)}"
    backends = {p.stem for p in (ROOT / "hicache_kernels" / "backends").glob("*.py") if p.stem != "__init__"}
    assert all(f"`{b}`" in ARCH for b in backends)


def test_the_load_back_trace_names_the_calls_the_engine_makes():
    sources = "".join(p.read_text() for p in (ROOT / "python" / "hicache").rglob("*.py"))  # the engine's too
    trace = ARCH[ARCH.index("## A load-back") : ARCH.index("## Who owns")]
    for call in re.findall(r"(?:cache|model|controller|device_pool)\.(\w+)\(", trace):
        assert call in sources, call
    from hicache import MatchResult

    assert f"MatchResult({', '.join(MatchResult.__dataclass_fields__)})" in trace
