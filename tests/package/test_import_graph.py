"""The packages' import graph, read from the source with ``ast`` (every import counts: lazy ones inside
functions and type-only ones too): imports flow one way, ``hicache`` -> ``hicache_kernels``, and inside
``hicache`` down its floors (the folders of docs/architecture.md's layer table), and no module imports
itself back through others. Exceptions would be listed below (there are none); the test fails on
anything new, and on an entry that is no longer true (strike it off)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"hicache_kernels": ROOT / "hicache_kernels", "hicache": ROOT / "python" / "hicache"}

# Exceptions, each to be untangled: an upward import (the kernel package reaching into the cache
# package), a circle. Issue 22 emptied both; an entry added here needs a reason beside it.
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_CYCLES: list[set[str]] = []

# The cache package's floors, top down (docs/architecture.md, "The layers"): a module imports modules of
# its own folder and of folders on lower floors, never a folder on its own floor or above. The kernel
# package is the floor below them all. ``hicache`` (the package's public names) and ``hicache.info`` (a
# report on everything) are the faces on top: they may import any floor, and no floor imports them.
FLOORS: list[tuple[str, ...]] = [
    ("hicache.bench",),
    ("hicache.serving",),
    ("hicache.integrations",),
    ("hicache.cache",),
    ("hicache.controller",),
    ("hicache.storage", "hicache.pools"),
    ("hicache.streams", "hicache.tree"),
    ("hicache.native",),
    ("hicache_kernels",),
]
FACES = ("hicache", "hicache.info")


def room(module: str) -> str:
    """The folder (``hicache.<folder>``) or face a module belongs to; the kernel package is one room."""
    parts = module.split(".")
    if parts[0] == "hicache_kernels":
        return "hicache_kernels"
    return ".".join(parts[:2])


def floor_of(room_name: str) -> int | None:
    return next((i for i, rooms in enumerate(FLOORS) if room_name in rooms), None)


def floor_violations(edges: dict[str, set[str]]) -> list[str]:
    """Every import that runs up or sideways between the cache package's rooms, as readable lines."""
    out = []
    for a, bs in sorted(edges.items()):
        if not a.startswith("hicache"):
            continue
        ra = room(a)
        for b in sorted(bs):
            rb = room(b)
            if ra == rb or ra in FACES:
                continue
            if rb in FACES:
                out.append(f"{a} imports {b}: {rb} is a face on top, no floor imports it")
                continue
            fa, fb = floor_of(ra), floor_of(rb)
            if fa is None or fb is None:
                out.append(f"{a} imports {b}: {ra if fa is None else rb} is on no floor of FLOORS")
            elif fb == fa:
                out.append(f"{a} imports {b}: {ra} and {rb} share a floor and must not import each other")
            elif fb < fa:
                out.append(f"{a} imports {b}: upward, {ra} (floor {fa}) -> {rb} (floor {fb})")
    return out


def modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for f in sorted(root.rglob("*.py")):
            parts = [pkg, *f.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (a parent package is left out: it is imported first anyway)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        for t in targets:
            if t in known and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_the_kernel_package_never_imports_the_cache_package():
    edges = graph()
    upward = {(a, b) for a, bs in edges.items() if a.startswith("hicache_kernels") for b in bs
              if b.split(".")[0] == "hicache"}  # fmt: skip
    assert upward - KNOWN_UPWARD == set(), "new upward imports"
    assert KNOWN_UPWARD - upward == set(), "gone: strike them off KNOWN_UPWARD"


def test_the_cache_package_uses_only_public_kernel_modules():
    """``hicache`` builds on the kernel package's public modules: a private one (``_names``, ``_env``, ...)
    may change under it without notice."""
    edges = graph()

    def is_private_kernel_module(name: str) -> bool:
        top, *rest = name.split(".")
        return top == "hicache_kernels" and any(x.startswith("_") for x in rest)

    kernel_private = {b for bs in edges.values() for b in bs if is_private_kernel_module(b)}
    private = {(a, b) for a, bs in edges.items() if a.split(".")[0] == "hicache" for b in bs & kernel_private}
    assert private == set()


def test_the_cache_package_imports_only_down_its_floors():
    assert floor_violations(graph()) == []


def test_every_cache_module_lives_in_a_room():
    """No flat modules: besides the faces and the compiled core's loader, every module of ``hicache``
    sits in a folder that is on a floor."""
    misplaced = [
        m for m in modules() if m.startswith("hicache.") and room(m) not in FACES and floor_of(room(m)) is None
    ]
    assert misplaced == []
    assert {m for m in modules() if m.count(".") == 1 and m.startswith("hicache.")} <= {
        "hicache.info", "hicache.native", *(r for rooms in FLOORS for r in rooms)
    }  # fmt: skip


def test_no_import_circles():
    found = cycles(graph())
    new = [c for c in found if not any(c <= k for k in KNOWN_CYCLES)]
    assert new == [], "new import circles"
    assert all(any(c == k for c in found) for k in KNOWN_CYCLES), "a known circle changed or is gone: update it"


def test_the_checker_finds_what_it_looks_for():
    """The checks themselves: a circle and an upward edge in a made-up graph are found."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(edges) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []
    known = modules()
    assert "hicache.cache.radix_cache" in known and "hicache_kernels.ops" in known and "hicache_kernels.bench" in known
    # Relative imports resolve, parent packages excluded: ops imports the backends and the bound pools.
    ops = imports_of("hicache_kernels.ops", known["hicache_kernels.ops"], known)
    assert {"hicache_kernels.backends", "hicache_kernels.bound_pools", "hicache_kernels._custom_ops"} <= ops
    assert "hicache_kernels" not in ops
    # The floors: an upward, a sideways and a face import are each named; a downward one passes.
    made_up = {
        "hicache.pools.device_pool": {"hicache.cache.radix_cache", "hicache_kernels.ops"},
        "hicache.tree.core": {"hicache.streams.devices", "hicache.native"},
        "hicache.cache.lookups": {"hicache", "hicache.tree.nodes"},
        "hicache.bench.tree": {"hicache.cache.radix_cache", "hicache.pools"},
    }
    assert floor_violations(made_up) == [
        "hicache.cache.lookups imports hicache: hicache is a face on top, no floor imports it",
        "hicache.pools.device_pool imports hicache.cache.radix_cache: upward, hicache.pools (floor 5) -> "
        "hicache.cache (floor 3)",
        "hicache.tree.core imports hicache.streams.devices: hicache.tree and hicache.streams share a floor and "
        "must not import each other",
    ]
