"""Build entry point for hicache-kernels.

The CUDA extension ``hicache_kernels._C`` is compiled by nvcc (kernels) and the host C++ compiler
(pybind11 bindings) through a generated ninja file, and linked against the *static* CUDA runtime. It
never includes or links torch, so one wheel serves every torch version.

Environment:
  HICACHE_CUDA_ARCHS    target archs, e.g. "90" or "80;90;100;120" ("9.0" and "+PTX" accepted);
                        falls back to TORCH_CUDA_ARCH_LIST, then to the default in _archs.py.
  HICACHE_SKIP_CUDA=1   build the pure-Python package only (Triton and torch backends).
  CUDA_HOME / CUDA_PATH the toolkit to use; when set it is authoritative. Otherwise /usr/local/cuda,
                        then the toolkit around the first ``nvcc`` on PATH.
  MAX_JOBS              parallel compile jobs (default: number of CPUs).
  NVCC_APPEND_FLAGS     extra nvcc flags.
  HICACHE_LOCAL_VERSION the wheel's local version label (after "+"). Default: "cu<CUDA major><minor>"
                        and one "sm<arch>" per arch ("ptx" appended where PTX is embedded), e.g.
                        "cu130.sm80.sm90ptx"; "cpu" for a pure-Python build. Empty: no label.

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
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
META_NAME = "_build_meta.json"
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

    skip_reason: str | None = None  # set: a pure-Python build, and why
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


class NinjaCudaBuild(build_ext):
    """Compile ``hicache_kernels._C`` with nvcc + ninja, or skip it and say why."""

    plan: BuildPlan  # set before setup() runs

    def build_extensions(self) -> None:
        plan = self.plan
        version = self.distribution.get_version()
        meta: dict = {"version": version, "cuda_built": False}
        ext = self.extensions[0]
        out_path = Path(self.get_ext_fullpath(ext.name))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        if plan.skip_reason is not None:
            meta["skip_reason"] = plan.skip_reason
            if out_path.exists():  # a stale in-place build must not outlive the skip
                out_path.unlink()
            _announce(
                [
                    f"building WITHOUT the CUDA extension: {plan.skip_reason}.",
                    "The package installs as pure Python (torch and Triton io-backends only);",
                    "the 'kernel' and 'batch' io-backends will raise, naming this reason.",
                ]
            )
        else:
            if plan.error is not None:
                raise plan.error
            cuda = _archs.cuda_version_text(plan.cuda_version)
            _announce(
                [
                    f"building the CUDA extension with {plan.where} (CUDA {cuda}) for archs {plan.arch_names} "
                    f"(from {plan.archs_source}) as version {version}"
                ]
            )
            self._ninja_build(ext, plan, out_path)
            meta.update(
                cuda_built=True,
                archs=plan.arch_names,
                archs_source=plan.archs_source,
                cuda_version=plan.cuda_version,
                min_driver_cuda_version=_archs.min_driver_version(plan.cuda_version),
            )
        (out_path.parent / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")

    def get_outputs(self) -> list[str]:
        outputs = [o for o in super().get_outputs() if Path(o).exists()]
        meta = Path(self.get_ext_fullpath(self.extensions[0].name)).parent / META_NAME
        return [*outputs, str(meta)]

    def copy_extensions_to_source(self) -> None:
        # In-place and editable builds: copy the extension (when built) and the build record into
        # the source tree, and remove a stale extension left there by an earlier build.
        build_py = self.get_finalized_command("build_py")
        inplace_file, regular_file = self._get_inplace_equivalent(build_py, self.extensions[0])
        if Path(regular_file).exists():
            self.copy_file(regular_file, inplace_file, level=self.verbose)
        elif Path(inplace_file).exists():
            Path(inplace_file).unlink()
        self.copy_file(
            str(Path(regular_file).parent / META_NAME), str(Path(inplace_file).parent / META_NAME), level=self.verbose
        )

    def _get_output_mapping(self):
        if not self.inplace:
            return
        build_py = self.get_finalized_command("build_py")
        inplace_file, regular_file = self._get_inplace_equivalent(build_py, self.extensions[0])
        if Path(regular_file).exists():
            yield inplace_file, regular_file
        yield str(Path(inplace_file).parent / META_NAME), str(Path(regular_file).parent / META_NAME)

    def _ninja_build(self, ext: Extension, plan: BuildPlan, out_path: Path) -> None:
        ninja = shutil.which("ninja")
        if ninja is None:
            try:
                import ninja as ninja_pkg  # the PyPI package ships the binary

                ninja = str(Path(ninja_pkg.BIN_DIR) / "ninja")
            except ImportError as exc:
                raise RuntimeError("ninja is required to build the CUDA extension: pip install ninja") from exc
        import pybind11

        build_dir = Path(self.build_temp).resolve() / "hicache_C"
        build_dir.mkdir(parents=True, exist_ok=True)
        cuda_home = plan.cuda_home
        includes = [str(ROOT / "csrc"), str(cuda_home / "include")]
        py_includes = [sysconfig.get_paths()["include"], pybind11.get_include()]
        cxx = os.environ.get("CXX", "c++")
        common = ["-O3", "-std=c++17"]
        nvcc_flags = [
            *common,
            "-Xcompiler=-fPIC",
            "-Xcompiler=-fvisibility=hidden",
            "--expt-relaxed-constexpr",
            "-lineinfo",
            *[flag for a in plan.archs for flag in a.gencode()],
            *[f"-I{i}" for i in includes],
            *shlex.split(os.environ.get("NVCC_APPEND_FLAGS", "")),
        ]
        cxx_flags = [
            *common,
            "-fPIC",
            "-fvisibility=hidden",
            *[f"-I{i}" for i in includes + py_includes],
        ]
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
        q = lambda args: " ".join(shlex.quote(a) for a in args)  # noqa: E731
        lines = [
            "ninja_required_version = 1.3",
            f"nvcc = {shlex.quote(str(cuda_home / 'bin' / 'nvcc'))}",
            f"cxx = {shlex.quote(cxx)}",
            f"nvcc_flags = {q(nvcc_flags)}",
            f"cxx_flags = {q(cxx_flags)}",
            f"ldflags = {q(ldflags)}",
            "rule nvcc",
            "  command = $nvcc $nvcc_flags -MD -MF $out.d -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = NVCC $in",
            "rule cxx",
            "  command = $cxx $cxx_flags $defines -MMD -MF $out.d -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = CXX $in",
            "rule link",
            "  command = $cxx $in $ldflags -o $out",
            "  description = LINK $out",
        ]
        objects = []
        for src in ext.sources:
            src_path = (ROOT / src).resolve()
            obj = build_dir / (src_path.name + ".o")
            rule = "nvcc" if src_path.suffix == ".cu" else "cxx"
            lines.append(f"build {_ninja_escape(str(obj))}: {rule} {_ninja_escape(str(src_path))}")
            if src_path.name == BUILD_FACTS:
                lines.append("  defines = " + q([f'-DHICACHE_ARCH_LIST="{plan.arch_names}"']))
            objects.append(_ninja_escape(str(obj)))
        so = build_dir / out_path.name
        lines.append(f"build {_ninja_escape(str(so))}: link {' '.join(objects)}")
        (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run([ninja, "-C", str(build_dir), "-j", jobs], check=True)
        shutil.copyfile(so, out_path)


class SourceDist(sdist):
    """The sdist is the same whatever the arch list: its version has no local label (a wheel built
    from it gets its own)."""

    def run(self) -> None:
        self.distribution.metadata.version = base_version()
        super().run()


NinjaCudaBuild.plan = plan_build(os.environ)
setup(
    version=wheel_version(NinjaCudaBuild.plan, os.environ),
    **license_metadata(),
    ext_modules=[
        Extension(
            "hicache_kernels._C",
            sources=sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cpp")),
        )
    ],
    cmdclass={"build_ext": NinjaCudaBuild, "sdist": SourceDist},
)
