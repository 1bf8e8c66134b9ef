"""CUDA architecture lists (parsing, nvcc flags, coverage) and the identity of a build.

This module is imported by ``setup.py`` by file path, before the package or torch can be imported, so
it depends on the standard library alone.

Accepted spellings, separated by ``;``, ``,`` or spaces: ``90``, ``9.0``, ``sm_90``, ``compute_90``,
arch-specific ``90a`` / ``9.0a`` / ``100f``, any of them with a ``+PTX`` suffix (also embed PTX for that
arch so newer GPUs can JIT it), and the family names torch uses (``Hopper``, ``Ampere``, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Architectures nvcc 13.0 can target (``nvcc --list-gpu-arch``); Volta and older were dropped in 13.0.
NVCC13_ARCHS: tuple[str, ...] = ("75", "80", "86", "87", "88", "89", "90", "100", "103", "110", "120", "121")

# The default when neither HICACHE_CUDA_ARCHS nor TORCH_CUDA_ARCH_LIST is set: every data-centre and
# consumer generation nvcc 13 still supports, with PTX of the newest so later GPUs can JIT it.
DEFAULT_ARCHS = "75;80;86;89;90;100;120+PTX"

_FAMILIES = {
    "turing": "7.5",
    "ampere": "8.0;8.6",
    "ada": "8.9",
    "hopper": "9.0",
    "blackwell": "10.0;12.0",
}

# A PEP 440 local version label: alphanumeric segments separated by dots (we accept no other separator).
_LOCAL_LABEL = re.compile(r"^[a-z0-9]+(?:\.[a-z0-9]+)*$", re.IGNORECASE)

_TOKEN = re.compile(r"^(?:sm_|compute_)?(\d+)(?:\.(\d))?([af]?)(\+ptx)?$", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class CudaArch:
    """One target: ``number`` like ``"90"``, ``suffix`` ``""``/``"a"``/``"f"``, ``ptx`` embeds PTX."""

    number: str
    suffix: str = ""
    ptx: bool = False

    @property
    def name(self) -> str:
        return f"{self.number}{self.suffix}"

    @property
    def sm(self) -> str:
        return f"sm_{self.name}"

    def gencode(self) -> list[str]:
        """nvcc flags: a cubin for ``sm_XX``, plus PTX for ``compute_XX`` when ``ptx`` is set."""
        flags = [f"-gencode=arch=compute_{self.name},code=sm_{self.name}"]
        if self.ptx:
            flags.append(f"-gencode=arch=compute_{self.name},code=compute_{self.name}")
        return flags

    def __str__(self) -> str:
        return self.name + ("+PTX" if self.ptx else "")


def parse_arch_list(text: str, supported: tuple[str, ...] | None = NVCC13_ARCHS) -> list[CudaArch]:
    """Parse an arch list such as ``"80;9.0+PTX"`` into sorted, de-duplicated :class:`CudaArch`.

    Raises ``ValueError`` naming the offending entry when an entry is malformed or, when ``supported``
    is given, names an arch outside it. An entry given both with and without ``+PTX`` keeps PTX.
    """
    tokens = [t for t in re.split(r"[;,\s]+", text.strip()) if t]
    if not tokens:
        raise ValueError(f"CUDA arch list {text!r} is empty")
    expanded: list[str] = []
    for tok in tokens:
        fam = _FAMILIES.get(tok.lower().removesuffix("+ptx"))
        if fam is None:
            expanded.append(tok)
            continue
        parts = fam.split(";")
        if tok.lower().endswith("+ptx"):
            parts[-1] += "+PTX"
        expanded.extend(parts)
    found: dict[tuple[str, str], bool] = {}
    for tok in expanded:
        m = _TOKEN.match(tok)
        if m is None:
            raise ValueError(
                f"CUDA arch {tok!r} in {text!r} is not understood; expected e.g. '90', '9.0', '90a' or '9.0+PTX'"
            )
        major, minor, suffix, ptx = m.groups()
        number = major + minor if minor is not None else major
        if len(number) < 2:
            raise ValueError(f"CUDA arch {tok!r} in {text!r} is not understood; write major and minor, e.g. '9.0'")
        if supported is not None and number not in supported:
            raise ValueError(
                f"CUDA arch {tok!r} in {text!r} is not supported by this nvcc; supported: {', '.join(supported)}"
            )
        key = (number, suffix.lower())
        found[key] = found.get(key, False) or bool(ptx)
    return sorted((CudaArch(n, s, p) for (n, s), p in found.items()), key=lambda a: (int(a.number), a.suffix))


def select_arch_list(env: dict[str, str]) -> tuple[str, str]:
    """Return ``(arch_list_text, where_it_came_from)`` by precedence.

    ``HICACHE_CUDA_ARCHS`` wins, then ``TORCH_CUDA_ARCH_LIST``, then :data:`DEFAULT_ARCHS`.
    """
    for var in ("HICACHE_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST"):
        value = env.get(var, "").strip()
        if value:
            return value, var
    return DEFAULT_ARCHS, "default"


def covers(archs: list[CudaArch], major: int, minor: int) -> tuple[bool, str]:
    """Whether a build with ``archs`` can run on a GPU of compute capability ``major.minor``.

    A cubin runs on its own arch and on later minor versions of the same major (``sm_80`` code runs
    on an 8.6 GPU); arch-specific ``a`` cubins run only on exactly their arch; PTX can be JIT-compiled
    by the driver for any later GPU. Returns ``(ok, how)`` with ``how`` saying which image applies.
    """
    cc = major * 10 + minor
    best = None
    for a in archs:
        n = int(a.number)
        if a.suffix == "a" and n == cc:
            return True, f"cubin {a.sm}"
        if a.suffix in ("", "f") and n // 10 == major and n % 10 <= minor:
            if best is None or n > int(best.number):
                best = a
    if best is not None:
        return True, f"cubin {best.sm}"
    ptx = [a for a in archs if a.ptx and int(a.number) <= cc and a.suffix == ""]
    if ptx:
        return True, f"PTX compute_{ptx[-1].name} (JIT-compiled by the driver)"
    return False, f"no cubin or PTX in [{', '.join(map(str, archs))}] runs on compute capability {major}.{minor}"


# ------------------------------------------------------------------------------ a build's identity


def cuda_version_text(version: int) -> str:
    """CUDA's integer versions (13000, 12080) as "13.0", "12.8"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def min_driver_version(cuda_version: int) -> int:
    """The oldest driver CUDA version a static CUDA runtime of ``cuda_version`` runs on: its major
    version's ``.0`` (CUDA minor-version compatibility), e.g. 13000 for any CUDA 13.x build."""
    return cuda_version // 1000 * 1000


def cudart_version_from_header(text: str) -> int:
    """``CUDART_VERSION`` (e.g. 13000) from the text of a toolkit's ``cuda_runtime_api.h``.

    Raises ``ValueError`` when the header does not define it.
    """
    m = re.search(r"^\s*#\s*define\s+CUDART_VERSION\s+(\d+)\s*$", text, re.MULTILINE)
    if m is None:
        raise ValueError("cuda_runtime_api.h does not #define CUDART_VERSION")
    return int(m.group(1))


def local_version(env: dict[str, str], cuda_version: int | None, archs: list[CudaArch] | None) -> str | None:
    """The PEP 440 local version label that tells wheels apart, or None for none.

    ``HICACHE_LOCAL_VERSION`` decides when set: empty for none, else the label itself (a leading ``+``
    is allowed; ``ValueError`` naming the variable when it is not a valid label). Otherwise a build with
    the CUDA extension is ``cu<major><minor>`` and one ``sm<arch>`` per compiled arch (``ptx`` appended
    where PTX is embedded too), e.g. ``cu130.sm80.sm90ptx``; a pure-Python build (``cuda_version`` None)
    is ``cpu``.
    """
    if "HICACHE_LOCAL_VERSION" in env:
        label = env["HICACHE_LOCAL_VERSION"].strip().removeprefix("+")
        if not label:
            return None
        if not _LOCAL_LABEL.match(label):
            raise ValueError(
                f"HICACHE_LOCAL_VERSION={env['HICACHE_LOCAL_VERSION']!r} is not a PEP 440 local version label: "
                "use letters and digits in segments separated by dots, e.g. 'cu130.sm90', or '' for none"
            )
        return label
    if cuda_version is None:
        return "cpu"
    if not archs:
        raise ValueError("a CUDA build needs at least one arch to name")
    return ".".join(
        [
            f"cu{cuda_version_text(cuda_version).replace('.', '')}",
            *(f"sm{a.name}{'ptx' if a.ptx else ''}".lower() for a in archs),
        ]
    )
