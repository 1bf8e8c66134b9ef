"""Build entry point for hicache-kernels.

Two extensions, each through its own generated ninja file:

- ``hicache._core`` (csrc/host/): the cache layer's host core (radix tree, page stack, eviction
  candidates, page checksums), plain C++ and pybind11 compiled by the host C++ compiler (``CXX``,
  default ``c++``) alone. Built in EVERY build, HICACHE_SKIP_CUDA=1 and no toolkit included; without
  a host compiler the build fails saying so.
- ``hicache_kernels._C`` (csrc/'s own files): the CUDA extension, compiled by nvcc (kernels) and the
  host C++ compiler (pybind11 bindings), and linked against the *static* CUDA runtime.

Neither includes or links torch, so one wheel serves every torch version.

Environment:
  HICACHE_CUDA_ARCHS    target archs, e.g. "90" or "80;90;100;120" ("9.0" and "+PTX" accepted);
                        falls back to TORCH_CUDA_ARCH_LIST, then to the default in _archs.py.
  HICACHE_SKIP_CUDA=1   build without the CUDA extension (Triton and torch io-backends only); the host
                        core hicache._core is still built.
  CXX                   the host C++ compiler (default: c++).
  CUDA_HOME / CUDA_PATH the toolkit to use; when set it is authoritative. Otherwise /usr/local/cuda,
                        then the toolkit around the first ``nvcc`` on PATH.
  MAX_JOBS              parallel compile jobs (default: number of CPUs).
  NVCC_APPEND_FLAGS     extra nvcc flags.
  HICACHE_LOCAL_VERSION the wheel's local version label (after "+"). Default: "cu<CUDA major><minor>"
                        and one "sm<arch>" per arch ("ptx" appended where PTX is embedded), e.g.
                        "cu130.sm80.sm90ptx"; "cpu" for a build without CUDA. Empty: no label.

The version is ``__version__`` of hicache_kernels/__init__.py plus that label; an sdist carries none.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import setuptools
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
META_NAME = "_build_meta.json"
HOST_CORE = "hicache._core"  # csrc/host/: the cache layer's radix tree, page stack, candidates, checksums
CUDA_EXT = "hicache_kernels._C"  # csrc/: transfers, copy engine, runtime facts
# The host compiler's flags for both extensions' C++ units.
HOST_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden"]
# The one translation unit compiled with the arch list (HICACHE_ARCH_LIST), so that a new arch list
# recompiles it and the kernels but not the pybind11 bindings.
BUILD_FACTS = "build_facts.cpp"


def _load_archs_module():
    spec = importlib.util.spec_from_file_location("_hicache_archs", ROOT / "hicache_kernels" / "_archs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while creating the class
    spec.loader.exec_module(mod)
    return mod


_archs = _load_archs_module()


def _toolkit_root(nvcc: Path) -> Path | None:
    root = nvcc.resolve().parent.parent
    return root if (root / "include" / "cuda_runtime.h").exists() else None


def find_cuda() -> tuple[Path | None, str]:
    """Return ``(cuda_home, reason)``; ``cuda_home`` is None when no usable toolkit is found."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            nvcc = Path(value) / "bin" / "nvcc"
            if not nvcc.exists():
                return None, f"{var}={value} is set but {nvcc} does not exist"
            return Path(value), f"{var}={value}"
    default = Path("/usr/local/cuda")
    if (default / "bin" / "nvcc").exists():
        return default, str(default)
    on_path = shutil.which("nvcc")
    if on_path:
        # Wrapper scripts (e.g. /usr/local/bin/nvcc) do not sit inside a toolkit: check for headers.
        root = _toolkit_root(Path(on_path))
        if root is not None:
            return root, f"nvcc on PATH ({on_path})"
        return None, f"nvcc on PATH ({on_path}) is not inside a CUDA toolkit; set CUDA_HOME"
    return None, "nvcc not found (set CUDA_HOME, or install the CUDA toolkit)"


def base_version() -> str:
    """The package version without a local label: ``__version__`` in hicache_kernels/__init__.py."""
    init = ROOT / "hicache_kernels" / "__init__.py"
    m = re.search(r'^__version__ = "([^"]+)"$', init.read_text(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f'{init} does not define __version__ = "..."')
    return m.group(1)


def _nvcc_archs(cuda_home: Path) -> tuple[str, ...]:
    out = subprocess.run(
        [str(cuda_home / "bin" / "nvcc"), "--list-gpu-arch"], capture_output=True, text=True, check=True
    ).stdout.split()
    return tuple(sorted({a.removeprefix("compute_").rstrip("af") for a in out}, key=int))


@dataclass
class BuildPlan:
    """What this build does, decided once from the environment: the wheel's version names it, and
    the version is needed before build_ext runs."""

    skip_reason: str | None = None  # set: a build without the CUDA extension, and why
    cuda_home: Path | None = None
    where: str = ""  # how the toolkit was found
    cuda_version: int | None = None  # CUDART_VERSION of the toolkit, e.g. 13000
    archs: list = field(default_factory=list)  # of _archs.CudaArch
    archs_source: str = ""
    # A setting the CUDA build refuses (e.g. an arch this nvcc cannot target). build_ext raises it, so
    # no wheel is made; metadata and sdist commands, which compile nothing, still run.
    error: Exception | None = None

    @property
    def arch_names(self) -> str:
        return ";".join(str(a) for a in self.archs)


def plan_build(env: dict[str, str]) -> BuildPlan:
    if env.get("HICACHE_SKIP_CUDA", "0").strip().lower() not in ("", "0", "false", "no"):
        return BuildPlan(skip_reason="HICACHE_SKIP_CUDA is set")
    cuda_home, where = find_cuda()
    if cuda_home is None:
        return BuildPlan(skip_reason=where)
    plan = BuildPlan(cuda_home=cuda_home, where=where)
    try:
        header = cuda_home / "include" / "cuda_runtime_api.h"
        plan.cuda_version = _archs.cudart_version_from_header(header.read_text())
        arch_text, plan.archs_source = _archs.select_arch_list(env)
        plan.archs = _archs.parse_arch_list(arch_text, supported=_nvcc_archs(cuda_home))
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        plan.error = exc
    return plan


def wheel_version(plan: BuildPlan, env: dict[str, str]) -> str:
    """``__version__`` plus the local label (:func:`_archs.local_version`) of this build."""
    if plan.error is not None:
        return base_version()  # build_ext raises plan.error: no wheel is made
    cuda_version = plan.cuda_version if plan.skip_reason is None else None
    label = _archs.local_version(env, cuda_version, plan.archs)
    return f"{base_version()}+{label}" if label else base_version()


def license_metadata() -> dict[str, str]:
    """The license, as the running setuptools can record it: setuptools >= 77 writes an SPDX
    License-Expression (and deprecates both the free-text field and pyproject's table form); older
    ones, down to the floor of 64, know only the free-text License field."""
    if int(setuptools.__version__.split(".")[0]) >= 77:
        return {"license_expression": "Apache-2.0"}
    return {"license": "Apache-2.0"}


def _announce(lines: list[str]) -> None:
    bar = "=" * 78
    text = "\n".join([bar, *[f"hicache-kernels: {line}" for line in lines], bar])
    print(text, file=sys.stderr, flush=True)


def _ninja_escape(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def find_cxx(env: dict[str, str]) -> list[str]:
    """The host C++ compiler command (``CXX``, default ``c++``) as arguments; ``RuntimeError`` saying
    what to do when it is not there: every build needs it, for the host core at least."""
    cxx = shlex.split(env.get("CXX") or "c++")
    if not cxx or shutil.which(cxx[0]) is None:
        raise RuntimeError(
            f"hicache-kernels: no host C++ compiler: {'CXX=' + repr(env['CXX']) if env.get('CXX') else 'c++'} "
            f"was not found. Every build compiles the cache layer's host core {HOST_CORE} with it (also with "
            "HICACHE_SKIP_CUDA=1 or without CUDA): install one (e.g. g++) or point CXX at it."
        )
    return cxx


def _ninja() -> str:
    ninja = shutil.which("ninja")
    if ninja is not None:
        return ninja
    try:
        import ninja as ninja_pkg  # the PyPI package ships the binary
    except ImportError as exc:
        raise RuntimeError("ninja is required to build the extensions: pip install ninja") from exc
    return str(Path(ninja_pkg.BIN_DIR) / "ninja")


def _q(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


class NinjaBuild(build_ext):
    """Compile the host core ``hicache._core`` with the host C++ compiler, always, and
    ``hicache_kernels._C`` with nvcc + the host compiler, or skip ``_C`` and say why. Each extension
    has its own generated ninja file and build folder."""

    plan: BuildPlan  # set before setup() runs

    def build_extensions(self) -> None:
        plan = self.plan
        version = self.distribution.get_version()
        if plan.skip_reason is None and plan.error is not None:
            raise plan.error  # a setting the CUDA build refuses: fail before compiling anything
        exts = {ext.name: ext for ext in self.extensions}
        cxx = find_cxx(dict(os.environ))
        self._build_host_core(exts[HOST_CORE], cxx)
        meta: dict = {"version": version, "cuda_built": False}
        ext = exts[CUDA_EXT]
        out_path = Path(self.get_ext_fullpath(ext.name))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        if plan.skip_reason is not None:
            meta["skip_reason"] = plan.skip_reason
            if out_path.exists():  # a stale in-place build must not outlive the skip
                out_path.unlink()
            _announce(
                [
                    f"building WITHOUT the CUDA extension: {plan.skip_reason}.",
                    f"The package installs without {CUDA_EXT} (torch and Triton io-backends only);",
                    "the 'kernel' and 'batch' io-backends will raise, naming this reason.",
                    f"The cache layer's host core {HOST_CORE} is built (host C++ compiler only).",
                ]
            )
        else:
            cuda = _archs.cuda_version_text(plan.cuda_version)
            _announce(
                [
                    f"building the CUDA extension with {plan.where} (CUDA {cuda}) for archs {plan.arch_names} "
                    f"(from {plan.archs_source}) as version {version}"
                ]
            )
            self._build_cuda(ext, plan, cxx, out_path)
            meta.update(
                cuda_built=True,
                archs=plan.arch_names,
                archs_source=plan.archs_source,
                cuda_version=plan.cuda_version,
                min_driver_cuda_version=_archs.min_driver_version(plan.cuda_version),
            )
        (out_path.parent / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")

    def _meta_path(self) -> Path:
        """The build record: next to ``hicache_kernels._C``, built or not."""
        return Path(self.get_ext_fullpath(CUDA_EXT)).parent / META_NAME

    def get_outputs(self) -> list[str]:
        outputs = [o for o in super().get_outputs() if Path(o).exists()]
        return [*outputs, str(self._meta_path())]

    def copy_extensions_to_source(self) -> None:
        # In-place and editable builds: copy each extension (when built) and the build record into the
        # source tree, and remove a stale extension left there by an earlier build.
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            if Path(regular_file).exists():
                self.copy_file(regular_file, inplace_file, level=self.verbose)
            elif Path(inplace_file).exists():
                Path(inplace_file).unlink()
            if ext.name == CUDA_EXT:
                meta = str(Path(regular_file).parent / META_NAME)
                self.copy_file(meta, str(Path(inplace_file).parent / META_NAME), level=self.verbose)

    def _get_output_mapping(self):
        if not self.inplace:
            return
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            if Path(regular_file).exists():
                yield inplace_file, regular_file
            if ext.name == CUDA_EXT:
                yield str(Path(inplace_file).parent / META_NAME), str(Path(regular_file).parent / META_NAME)

    def _build_host_core(self, ext: Extension, cxx: list[str]) -> None:
        import pybind11

        _announce([f"building the host core {HOST_CORE} with {_q(cxx)}"])
        out_path = Path(self.get_ext_fullpath(ext.name))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        includes = [str(ROOT / "csrc" / "host"), sysconfig.get_paths()["include"], pybind11.get_include()]
        cxx_flags = [*HOST_FLAGS, *[f"-I{i}" for i in includes]]
        build_dir = Path(self.build_temp).resolve() / "hicache_core"
        lines = [
            "ninja_required_version = 1.3",
            f"cxx = {_q(cxx)}",
            f"cxx_flags = {_q(cxx_flags)}",
            "ldflags = -shared",
            *_CXX_RULES,
        ]
        self._run_ninja(build_dir, lines, [(src, "cxx", None) for src in ext.sources], out_path)

    def _build_cuda(self, ext: Extension, plan: BuildPlan, cxx: list[str], out_path: Path) -> None:
        import pybind11

        cuda_home = plan.cuda_home
        includes = [str(ROOT / "csrc"), str(cuda_home / "include")]
        py_includes = [sysconfig.get_paths()["include"], pybind11.get_include()]
        nvcc_flags = [
            "-O3",
            "-std=c++17",
            "-Xcompiler=-fPIC",
            "-Xcompiler=-fvisibility=hidden",
            "--expt-relaxed-constexpr",
            "-lineinfo",
            *[flag for a in plan.archs for flag in a.gencode()],
            *[f"-I{i}" for i in includes],
            *shlex.split(os.environ.get("NVCC_APPEND_FLAGS", "")),
        ]
        cxx_flags = [*HOST_FLAGS, *[f"-I{i}" for i in includes + py_includes]]
        ldflags = [
            "-shared",
            f"-L{cuda_home / 'lib64'}",
            f"-L{cuda_home / 'lib'}",
            "-Wl,--exclude-libs,ALL",
            "-lcudart_static",
            "-ldl",
            "-lrt",
            "-lpthread",
        ]
        lines = [
            "ninja_required_version = 1.3",
            f"nvcc = {shlex.quote(str(cuda_home / 'bin' / 'nvcc'))}",
            f"cxx = {_q(cxx)}",
            f"nvcc_flags = {_q(nvcc_flags)}",
            f"cxx_flags = {_q(cxx_flags)}",
            f"ldflags = {_q(ldflags)}",
            "rule nvcc",
            "  command = $nvcc $nvcc_flags -MD -MF $out.d -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = NVCC $in",
            *_CXX_RULES,
        ]
        units = []
        for src in ext.sources:
            rule = "nvcc" if src.endswith(".cu") else "cxx"
            defines = [f'-DHICACHE_ARCH_LIST="{plan.arch_names}"'] if Path(src).name == BUILD_FACTS else None
            units.append((src, rule, defines))
        self._run_ninja(Path(self.build_temp).resolve() / "hicache_C", lines, units, out_path)

    def _run_ninja(self, build_dir: Path, lines: list[str], units: list, out_path: Path) -> None:
        """Write ``lines`` plus one build statement per ``(source, rule, defines)`` and the link into
        ``build_dir/build.ninja``, run ninja there, and copy the linked library to ``out_path``."""
        build_dir.mkdir(parents=True, exist_ok=True)
        lines = list(lines)
        objects = []
        for src, rule, defines in units:
            src_path = (ROOT / src).resolve()
            obj = build_dir / (src_path.name + ".o")
            lines.append(f"build {_ninja_escape(str(obj))}: {rule} {_ninja_escape(str(src_path))}")
            if defines:
                lines.append("  defines = " + _q(defines))
            objects.append(_ninja_escape(str(obj)))
        so = build_dir / out_path.name
        lines.append(f"build {_ninja_escape(str(so))}: link {' '.join(objects)}")
        (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run([_ninja(), "-C", str(build_dir), "-j", jobs], check=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(so, out_path)


# The host compiler's rules of both ninja files: compile a C++ unit, link the shared library.
_CXX_RULES = [
    "rule cxx",
    "  command = $cxx $cxx_flags $defines -MMD -MF $out.d -c $in -o $out",
    "  depfile = $out.d",
    "  deps = gcc",
    "  description = CXX $in",
    "rule link",
    "  command = $cxx $in $ldflags -o $out",
    "  description = LINK $out",
]


def _sglang_switch():
    """hicache_kernels/compat/sglang_switch.py loaded by path (it imports only the standard library at
    load time): its .pth file name and line."""
    spec = importlib.util.spec_from_file_location(
        "_hicache_sglang_switch", ROOT / "hicache_kernels/compat/sglang_switch.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PTH_NAME, module.PTH_LINE


# The SGLang kernel switch: a .pth file at the top of the install runs its line at every interpreter
# start; the line imports nothing unless HICACHE_SGL_KERNEL is set.
SGL_PTH, SGL_PTH_LINE = _sglang_switch()


class BuildPy(build_py):
    """The packages, and the SGLang switch's .pth file beside them (so a wheel installs it)."""

    def run(self) -> None:
        super().run()
        Path(self.build_lib, SGL_PTH).write_text(SGL_PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, SGL_PTH))]


class SourceDist(sdist):
    """The sdist is the same whatever the arch list: its version has no local label (a wheel built
    from it gets its own)."""

    def run(self) -> None:
        self.distribution.metadata.version = base_version()
        super().run()


def _sources(folder: Path, suffixes: tuple[str, ...]) -> list[str]:
    """The translation units directly in ``folder`` (not in its subfolders), relative to the root."""
    return sorted(str(p.relative_to(ROOT)) for p in folder.iterdir() if p.is_file() and p.suffix in suffixes)


NinjaBuild.plan = plan_build(os.environ)
setup(
    version=wheel_version(NinjaBuild.plan, os.environ),
    **license_metadata(),
    ext_modules=[
        # Plain C++ (csrc/host/), host compiler only: in every build.
        Extension(HOST_CORE, sources=_sources(ROOT / "csrc" / "host", (".cpp",))),
        # csrc/'s own .cu/.cpp files (csrc/host/ is the core's): skipped without CUDA.
        Extension(CUDA_EXT, sources=_sources(ROOT / "csrc", (".cu", ".cpp"))),
    ],
    cmdclass={"build_ext": NinjaBuild, "build_py": BuildPy, "sdist": SourceDist},
)
