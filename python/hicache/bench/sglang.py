"""SGLang's newest radix tree for ``hicache.bench.tree``'s match + insert comparison: SGLang 0.5.23's
``UnifiedRadixCache`` on its Rust core (``tree_core_backend="rust"``, components ``(FULL,)``).

It runs in a child process (:func:`run_child`): importing it brings about 5,000 modules (transformers
among them) that would otherwise sit in the heap our side is timed in, and it can be loaded from an
unpacked wheel without touching the environment. Prepare a directory once (SGLang is not a dependency
of this project; nothing is installed into the environment)::

    pip download --no-deps sglang==0.5.23 -d DIR
    python -m zipfile -e DIR/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl DIR/sglang
    pip install --no-deps --target DIR/deps <the modules in MODULES>

and run ``python -m hicache.bench.tree --compare sglang-latest --sglang-path DIR/sglang:DIR/deps`` (or
set ``HICACHE_SGLANG_PATH``). The wheel bundles the Rust core
(``sglang/srt/mem_cache/rust_tree_core/mem_cache.*.so``, linked against libtorch; SGLang accepts torch
2.11 to 2.14). When anything is missing, the comparison says exactly what, in the printout and the JSON;
it never falls back to another tree (if SGLang picks its Python TreeCore, that is reported as unavailable,
with SGLang's reason).

One stand-in, recorded in the results: when ``torchvision`` does not import (PyPI's builds need a CUDA
libtorch), a module with only ``transforms.InterpolationMode`` takes its place, after transformers has
decided that torchvision is absent. ``sglang.srt.configs`` imports two multimodal configs that use it
at import time; the radix cache never calls it.

The loop is ``hicache.bench.tree``'s SGLang loop: per request ``match_prefix``, the prefix's device slots
(``path_device_indices``, what the scheduler's ``prefix_device_indices`` reads), new slots from a counter
(as for SGLang 0.5.2: no allocator work, which flatters it slightly) and ``insert`` with
``prev_prefix_len`` = the hit, as ``cache_finished_req`` passes it. Prompts reach it as ``array('q')``,
the type SGLang's ``Req`` holds its token ids in, converted before the clock starts.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from array import array
from collections.abc import Callable
from typing import Any

import torch

LATEST_VERSION = "0.5.23"
PATH_ENV = "HICACHE_SGLANG_PATH"
# What SGLang 0.5.23's mem_cache imports beyond this project's environment, as pip names (pins: SGLang's).
MODULES = (
    "annotated-types anyio apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 dill distro gguf h11 httpcore2 httpx "
    "httpx2 huggingface-hub ipython loguru msgspec openai==2.8.0 orjson partial-json-parser psutil pybase64 pydantic "
    "pydantic-core pyyaml pyzmq regex safetensors sentencepiece==0.2.1 sniffio starlette tokenizers==0.23.2 tqdm "
    "traitlets transformers==5.19.0 truststore typing-inspection"
)
CHILD_TIMEOUT_S = 1800


class Unavailable(RuntimeError):
    """SGLang's UnifiedRadixCache on its Rust core cannot run here; the message says why."""


def _torchvision_stand_in() -> str | None:
    """Put the stand-in in place of a torchvision that does not import (module docstring); what was done,
    or None when the real one imports."""
    try:
        import torchvision  # noqa: F401, PLC0415
    except Exception as exc:  # noqa: BLE001 - any failure: the real one is unusable here
        why = f"{type(exc).__name__}: {exc}"
    else:
        return None
    try:
        from transformers.utils.import_utils import is_torchvision_available  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"transformers does not import ({type(exc).__name__}: {exc})") from exc
    if is_torchvision_available():  # decided now, before the stand-in exists, and cached by transformers
        raise Unavailable(f"torchvision is installed but does not import ({why}); transformers would use it")

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    mods = {}
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        mods[name] = m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__path__ = []
    mods["torchvision"].transforms = mods["torchvision.transforms"]
    mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]
    mods["torchvision.transforms"].InterpolationMode = InterpolationMode
    mods["torchvision.transforms.functional"].InterpolationMode = InterpolationMode
    sys.modules.update(mods)
    return f"torchvision replaced by a stand-in with transforms.InterpolationMode only ({why})"


def _locate() -> str:
    """The directory of the ``sglang`` package that would import, checked (without importing it: its
    ``__init__`` already imports transformers) to hold the UnifiedRadixCache and the bundled Rust core."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(
            f"SGLang is not importable: pass the directories of an unpacked sglang=={LATEST_VERSION} wheel and its "
            f"modules as --sglang-path or {PATH_ENV} (see hicache.bench.sglang)"
        )
    root = list(spec.submodule_search_locations)[0]
    mem_cache = os.path.join(root, "srt", "mem_cache")
    if not os.path.isfile(os.path.join(mem_cache, "unified_radix_cache.py")):
        raise Unavailable(
            f"the sglang package at {root} has no srt/mem_cache/unified_radix_cache.py (SGLang {LATEST_VERSION} has)"
        )
    core = os.path.join(mem_cache, "rust_tree_core")
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    if not os.path.isdir(core) or not any(
        f.startswith("mem_cache.") and f.endswith(tuple(suffixes)) for f in os.listdir(core)
    ):
        raise Unavailable(
            f"the sglang package at {root} bundles no Rust TreeCore for this Python "
            f"(no srt/mem_cache/rust_tree_core/mem_cache{suffixes[0]})"
        )
    return root


def load_unified() -> types.SimpleNamespace:
    """Import SGLang's UnifiedRadixCache and what building one takes; check it runs on the Rust core.
    :class:`Unavailable` (with the reason) when it cannot."""
    _locate()
    notes = [n for n in (_torchvision_stand_in(),) if n]
    try:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: PLC0415
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams  # noqa: PLC0415
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: PLC0415
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: PLC0415
        from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: PLC0415
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: PLC0415
        from sglang.srt.mem_cache.unified_cache.tree_core_registry import _rust_fallback_reason  # noqa: PLC0415
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: PLC0415
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 - what failed is the reason
        raise Unavailable(
            f"SGLang's UnifiedRadixCache does not import ({type(exc).__name__}: {exc}); see hicache.bench.sglang "
            f"for the directory to pass as --sglang-path or {PATH_ENV}"
        ) from exc
    import sglang  # noqa: PLC0415

    sgl = types.SimpleNamespace(
        version=getattr(sglang, "__version__", "unknown"),
        path=os.path.dirname(os.path.dirname(os.path.abspath(sglang.__file__))),
        notes=notes,
        InsertParams=InsertParams,
        MatchPrefixParams=MatchPrefixParams,
        RadixKey=RadixKey,
    )

    def build(page_size: int, slots: int) -> tuple[Any, Any]:
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
        kv = MHATokenToKVPool(size=slots, page_size=page_size, dtype=torch.float16, head_num=1, head_dim=1,
                              layer_num=1, device="cpu", enable_memory_saver=False)  # fmt: skip
        common = {"size": slots, "dtype": torch.float16, "device": "cpu", "kvcache": kv, "need_sort": False}
        if page_size == 1:
            alloc = TokenToKVPoolAllocator(**common)
        else:
            alloc = PagedTokenToKVPoolAllocator(page_size=page_size, **common)
        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                 page_size=page_size, tree_components=(ComponentType.FULL,),
                                 tree_core_backend="rust")  # fmt: skip
        try:
            cache = UnifiedRadixCache(params=params)
        except Exception as exc:  # noqa: BLE001 - e.g. the Rust extension does not load against this torch
            raise Unavailable(
                f"UnifiedRadixCache(tree_core_backend='rust') raised {type(exc).__name__}: {exc}"
            ) from exc
        if cache._tree_core_backend != "rust":
            raise Unavailable(
                f"UnifiedRadixCache chose its {cache._tree_core_backend} TreeCore, not the Rust one: "
                f"{_rust_fallback_reason(params)}"
            )
        return cache, alloc

    sgl.build = build
    cache, _ = build(1, 64)  # the Rust core is checked once, before anything is timed
    sgl.tree_core_class = f"{type(cache.tree_core).__module__}.{type(cache.tree_core).__qualname__}"
    return sgl


def unified_runner(sgl: types.SimpleNamespace, page_size: int, total_tokens: int) -> Callable[[list[list[int]]], int]:
    """``run(requests) -> hit tokens`` over a new UnifiedRadixCache (module docstring); ``run.elapsed``
    the loop's seconds."""

    def run(requests: list[list[int]]) -> int:
        slots = (total_tokens // page_size + 1) * page_size
        cache, alloc = sgl.build(page_size, slots)
        keys = [array("q", t) for t in requests]  # as SGLang's Req holds them: not timed
        free_before = alloc.available_size()
        match, insert, key_of, params = cache.match_prefix, cache.insert, sgl.RadixKey, sgl.MatchPrefixParams
        next_slot = hits = 0
        t0 = time.perf_counter()
        for toks in keys:
            m = match(params(key=key_of(toks)))
            hit = m.device_prefix_len
            prefix = cache.path_device_indices(m.last_device_node)[:hit]
            key_len = len(toks) - len(toks) % page_size
            new = torch.arange(next_slot, next_slot + key_len - hit, dtype=torch.int64)
            next_slot += key_len - hit
            insert(sgl.InsertParams(key=key_of(toks[:key_len]), value=torch.cat([prefix, new]), prev_prefix_len=hit))
            hits += hit
        run.elapsed = time.perf_counter() - t0  # type: ignore[attr-defined]
        if alloc.available_size() != free_before:  # it freed slots: the counter's slots were not its own
            raise RuntimeError("SGLang's tree freed device slots during the run; the counter's slots cannot stand in")
        return hits

    return run


def search_path(arg: str | None) -> list[str]:
    """The directories to import SGLang from: ``--sglang-path`` or ``HICACHE_SGLANG_PATH`` (``os.pathsep``
    separated), each made absolute; empty when neither is set (then only an installed SGLang is found)."""
    raw = arg if arg is not None else os.environ.get(PATH_ENV, "")
    return [os.path.abspath(p) for p in raw.split(os.pathsep) if p]


def run_child(argv: list[str], paths: list[str]) -> dict[str, Any]:
    """Run ``python -m hicache.bench.tree <argv>`` (its SGLang child mode) with ``paths`` first on the
    import path; the JSON object it prints last, or ``{"available": False, "reason": ...}`` when it
    printed none."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    try:
        proc = subprocess.run([sys.executable, "-m", "hicache.bench.tree", *argv], env=env, capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": f"the SGLang child process ran past {CHILD_TIMEOUT_S} s"}
    lines = proc.stdout.strip().splitlines()
    if lines:
        try:
            out = json.loads(lines[-1])
        except json.JSONDecodeError:
            out = None
        if isinstance(out, dict) and "available" in out:
            return out
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    return {"available": False, "reason": f"the SGLang child process exited {proc.returncode} without a result: {tail}"}
