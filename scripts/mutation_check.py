"""The mutation check: deliberately broken copies of the code must each fail a test.

Each mutant below is one small edit that corrupts data or breaks a documented rule (an ordering, an
invariant, a byte format, a counter), each one a blind spot the suite once had. The script copies the
repository (tracked and untracked-not-ignored files, plus the built extensions) to a temporary folder,
checks that every mutant's tests pass there unmutated, then applies each edit in turn and runs its tests
(``pytest -x``, under the deferred device model where the rule is about ordering) with imports taken
from the copy. A mutant that no test catches, an edit whose text is no longer in the code, or a
baseline that fails makes the script exit 1; it prints which test caught each mutant, and how long that
took.

    python scripts/mutation_check.py [--only NAME[,NAME...]] [--list] [--json PATH]

Run it from the repository's environment after building (``bash scripts/setup.sh``): the copy reuses the
built ``hicache_kernels._C`` and ``hicache._core``. When you add a rule, add its mutant here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFERRED = {"HICACHE_DEFERRED_SEED": "1"}


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str  # what it breaks, and which issue item it stands for
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions
    env: dict[str, str] = field(default_factory=dict)
    group: str = "core"  # "sglang": needs SGLang's modules (run with --group sglang where they import)


_SIDECAR_LAYER = (
    "                    if layer >= d.num_layers:  # a sidecar of fewer layers: all issued with the first ones\n"
    "                        continue\n"
)
_LAUNCH_LAYER = (
    "                for load, d, h in loads:\n"
    + _SIDECAR_LAYER
    + "                    work = lambda s, layer=layer, load=load: load(layer)  # noqa: E731\n"
    "                    self._launch(stream, work, op, (h, h_idx), (d, d_idx), layer)\n"
)
_SIGNAL_LAYER = (
    "                self.layer_counter.layer_issued(layer, stream, op.generation)  # the layer of every pool\n"
)
_WAIT_READY = (
    "                if op.ready is not None:  # the copy's data is ready (nothing waits here)\n"
    "                    stream.wait_event(op.ready)\n"
)
_RECORD_START = (
    "                ack.start.record(stream)  # after the wait: the copy's time is its own, not the queue's\n"
)
_SGLANG_TESTS = "tests/integrations/test_sglang_storage.py"
_VLLM_TESTS = "tests/integrations/test_vllm_tier.py"
_REQUIRE = {"HICACHE_REQUIRE_CLIENTS": "1"}
CACHE_SUITES = ("tests/cache/test_radix_cache.py", "tests/controller/test_controller.py")

MUTANTS = [
    Mutant(
        "runs-cross-source-pages",
        "find_runs does not split a run at a source page boundary (30 #1)",
        "hicache_kernels/fragments.py",
        "        cont &= s[1:] % src_page != 0\n",
        "        pass\n",
        ("tests/kernels/test_ops.py", "-k", "crossing"),
    ),
    Mutant(
        "runs-cross-destination-pages",
        "find_runs does not split a run at a destination page boundary (30 #1)",
        "hicache_kernels/fragments.py",
        "        cont &= d[1:] % dst_page != 0\n",
        "        pass\n",
        ("tests/kernels/test_ops.py", "-k", "crossing"),
    ),
    Mutant(
        "kv-fingerprint-repeats",
        "the cache tests' KV fingerprint rounds away everything but token and position (30 #2)",
        "tests/cachedata.py",
        "    return fingerprint(slot_key(token, position), kv_index(layer, kv))\n",
        "    return torch.full((HEAD_NUM, HEAD_DIM), float(token * 1_000_000 + position * 1_000))\n",
        ("tests/cache/test_byte_format.py", "-k", "fingerprint"),
    ),
    Mutant(
        "controller-swaps-k-and-v",
        "the controller binds V as K and K as V: round trips still agree, the stored format does not (30 #3)",
        "python/hicache/controller/controller.py",
        "self.binding = KVBinding(device_pool.device_k, device_pool.device_v, host_pool.buffer,",
        "self.binding = KVBinding(*((device_pool.device_v, device_pool.device_k) if device_pool.device_v is not None "
        "else (device_pool.device_k, None)), host_pool.buffer,",
        ("tests/cache/test_byte_format.py",),
    ),
    Mutant(
        "lfu-is-lru",
        "LFU orders by last access alone (30 #4)",
        "python/hicache/tree/policies.py",
        "        return (node.hit_count, node.last_access_time, node.id)\n",
        "        return (node.last_access_time, node.id)\n",
        ("tests/tree/test_policies.py",),
    ),
    Mutant(
        "slru-threshold-off-by-one",
        "SLRU protects a node only past protected_hits, not at it (30 #4)",
        "python/hicache/tree/policies.py",
        "node.hit_count >= self.protected_hits",
        "node.hit_count > self.protected_hits",
        ("tests/tree/test_policies.py",),
    ),
    Mutant(
        "misses-include-host-hits",
        "miss_tokens counts host hits as misses (30 #5)",
        "python/hicache/cache/lookups.py",
        "        m.miss_tokens += len(tokens) - dev_len - host_len\n",
        "        m.miss_tokens += len(tokens) - dev_len\n",
        ("tests/cache/test_radix_cache.py", "-k", "metrics"),
    ),
    Mutant(
        "bytes-loaded-in-tokens",
        "bytes_loaded counts tokens (30 #5)",
        "python/hicache/controller/copy_completions.py",
        "            m.bytes_loaded += nbytes\n",
        "            m.bytes_loaded += ack.tokens\n",
        ("tests/cache/test_radix_cache.py", "-k", "metrics"),
    ),
    Mutant(
        "load-time-not-summed",
        "load_time_s is never added to (30 #5)",
        "python/hicache/controller/copy_completions.py",
        "            m.load_time_s += elapsed\n",
        "            pass\n",
        ("tests/cache/test_radix_cache.py", "-k", "metrics"),
    ),
    Mutant(
        "staged-span-loosened",
        "the staged backend takes scattered staging rows for one contiguous span (30 #6)",
        "hicache_kernels/backends/staged.py",
        "if pos[-1] - pos[0] == pos.size - 1 else None",
        "if pos[-1] - pos[0] <= pos.size else None",
        ("tests/kernels/test_staged.py", "-k", "layer_counts"),
    ),
    Mutant(
        "backup-ignores-ready-event",
        "a backup does not wait for the KV its forward is still writing (30 #7)",
        "python/hicache/controller/controller.py",
        _WAIT_READY,
        _WAIT_READY.replace("stream.wait_event(op.ready)", "pass"),
        CACHE_SUITES,
        DEFERRED,
    ),
    Mutant(
        "deferred-model-overwrites-a-later-write",
        "the deferred model lands an earlier queued write over a later one's poison (a false hazard, and a "
        "reader of the later write's slots not caught)",
        "python/hicache/streams/deferred.py",
        "                later = self._later_writer(sp)\n                if not later.any():",
        "                later = np.zeros(len(sp.addrs), bool)\n                if not later.any():",
        ("tests/streams/test_deferred.py",),
    ),
    Mutant(
        "no-exit-hook",
        "the package's threads are not stopped before the interpreter finalizes: a process that ends with "
        "copies in flight aborts (31)",
        "python/hicache/streams/lifetime.py",
        "            _hooked = True\n            _hook()\n",
        "            _hooked = True\n",
        ("tests/package/test_exit.py", "-k", "eager and not mooncake and not nixl and not tp_rank and not sigint"),
    ),
    Mutant(
        "worker-keeps-its-last-op",
        "a copy worker keeps the op it ran while it waits for the next: through the op's events the "
        "device's queued copies keep a dropped controller, its threads and pools alive (31)",
        "python/hicache/controller/controller.py",
        "            del op\n",
        "            pass\n",
        ("tests/controller/test_controller.py", "-k", "dropped and queued_kv"),
        {"HICACHE_TEST_HANG_S": "10"},
    ),
    Mutant(
        "file-threads-started-on-demand",
        "the file backend starts its I/O threads when a batch needs them: a backup running at exit fails "
        "on Python 3.12, which refuses new threads during finalization (31)",
        "python/hicache/storage/file.py",
        "        self._pool = _started_pool(num_threads)\n",
        '        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="hicache-file")\n',
        ("tests/storage/test_storage.py", "-k", "start_no_thread"),
    ),
    Mutant(
        "mooncake-call-counted-without-its-thread",
        "a Mooncake call whose thread could not start stays counted as running: the exit hook waits its "
        "whole timeout for it (31)",
        "python/hicache/storage/mooncake_calls.py",
        "                    self._busy -= 1\n                    self._lock.notify_all()\n                raise\n",
        "                    pass\n                raise\n",
        ("tests/storage/test_storage_mooncake.py", "-k", "cannot_start"),
    ),
    Mutant(
        "host-setup-skips-a-share",
        "the host buffer's last share of pages is not populated by the set-up threads: those pages fault "
        "in later, in the registration or the first copies (32 #7)",
        "python/hicache/pools/host_memory.py",
        "    shares = [(bounds[i], bounds[i + 1]) for i in range(threads) if bounds[i + 1] > bounds[i]]\n",
        "    shares = [(bounds[i], bounds[i + 1]) for i in range(threads - 1) if bounds[i + 1] > bounds[i]]\n",
        ("tests/pools/test_host_memory.py", "-k", "populate"),
    ),
    Mutant(
        "host-pages-not-bound-to-the-node",
        "HostSetup(numa_node=...) does not bind the pages: they land where the touching thread runs (32 #7)",
        "python/hicache/pools/host_memory.py",
        "            _bind(libc, ptr, size, setup.numa_node)\n",
        "            pass\n",
        ("tests/pools/test_host_memory.py", "-k", "numa"),
    ),
    Mutant(
        "pinned-pool-unregistered-under-queued-copies",
        "a dropped pinned pool is unregistered without waiting for its device: copies still queued read or "
        "write memory that is gone (32 #6)",
        "python/hicache/pools/host_memory.py",
        "        torch.cuda.synchronize(device_index)\n",
        "        pass\n",
        ("tests/pools/test_host_memory.py", "-k", "waits_for_its_device"),
    ),
    Mutant(
        "triton-grid-not-persistent",
        "each Triton program takes one work item and stops: with the grid capped, row blocks and layers "
        "past the cap are never copied (32 #4)",
        "hicache_kernels/backends/triton.py",
        "    for work in range(pid, row_blocks * units, num_programs):\n",
        "    for work in range(pid, pid + 1):\n",
        ("tests/kernels/test_triton_transfer.py", "-k", "capped"),
    ),
    Mutant(
        "warm-with-indices-inside-the-pools",
        "KVBinding.warm launches with slot 0 instead of a slot outside both pools: warming overwrites KV (32 #4)",
        "hicache_kernels/binding.py",
        "        outside = torch.tensor([-1], dtype=torch.int64)\n",
        "        outside = torch.tensor([0], dtype=torch.int64)\n",
        ("tests/kernels/test_binding.py", "-k", "warm"),
    ),
    Mutant(
        "load-stream-at-default-priority",
        "the controller's load stream has the default priority: layer loads queue behind backups and compute (32 #5)",
        "python/hicache/controller/controller.py",
        '        self._load_stream = self.device.new_stream("load", high_priority=True)',
        '        self._load_stream = self.device.new_stream("load")',
        ("tests/streams/test_devices.py",),
    ),
    Mutant(
        "upload-buffer-reused-under-its-copy",
        "the upload ring writes a pinned buffer again without waiting for its previous copy: indices "
        "still being read by the DMA are overwritten (32 #6)",
        "hicache_kernels/uploads.py",
        "                slot.event.synchronize()  # its previous upload has been read by the DMA\n",
        "                pass\n",
        ("tests/kernels/test_uploads.py",),
    ),
    Mutant(
        "copy-timed-from-before-its-wait",
        "a copy's start event is recorded before its stream waits for the forward: copy times include the "
        "queue behind compute (32 #6)",
        "python/hicache/controller/controller.py",
        _WAIT_READY + _RECORD_START,
        _RECORD_START + _WAIT_READY,
        ("tests/streams/test_deferred.py", "-k", "timed_from"),
    ),
    Mutant(
        "the-kernel-reads-strided-indices",
        "a strided index view reaches the kernels, which read indices at stride 1 (32 #1)",
        "hicache_kernels/_validate.py",
        "    return t if t.is_contiguous() else t.contiguous()\n",
        "    return t\n",
        ("tests/kernels/test_backends.py", "-k", "strided"),
    ),
    Mutant(
        "a-side-stream-does-not-follow-its-caller",
        "a launch on a side stream is not ordered after the caller's stream that made its indices (32 #2)",
        "hicache_kernels/launch.py",
        "    stream.wait_stream(current)\n",
        "    pass\n",
        ("tests/kernels/test_backends.py", "-k", "side_stream_follows"),
    ),
    Mutant(
        "triton-specializes-per-call-arguments",
        "Triton specializes n and layer_begin on 1 and multiples of 16: a route compiles a dozen variants, "
        "each a stall the first time it shows up mid-serving (32 #4)",
        "hicache_kernels/backends/triton.py",
        'PER_CALL_ARGS = ("src_idx_stride", "dst_idx_stride", "n", "layer_begin", "layer_count", "units")',
        'PER_CALL_ARGS = ("src_idx_stride", "dst_idx_stride")',
        ("tests/kernels/test_triton_transfer.py", "-k", "61_layer"),
    ),
    Mutant(
        "host-pool-registered-on-the-current-device",
        "a pinned host pool is registered with whatever device is current, not its pool's (32 #6)",
        "python/hicache/pools/host_memory.py",
        '    on = torch.cuda.device(device) if device is not None and device.type == "cuda" else '
        "contextlib.nullcontext()",
        "    on = contextlib.nullcontext()",
        ("tests/pools/test_host_memory.py", "-k", "registered_with"),
    ),
    Mutant(
        "backup-does-not-lock-its-node",
        "a backup in flight does not lock its node: it can be evicted under the copy (30 #8)",
        "python/hicache/cache/copy_acks.py",
        "        self.tree.inc_lock_ref(node)  # released by the ack\n",
        "        pass\n",
        CACHE_SUITES,
        DEFERRED,
    ),
    Mutant(
        "write-back-eviction-does-not-wait",
        "write-back eviction drops the device copy before its host copy has landed (30 #8)",
        "python/hicache/cache/radix_cache.py",
        "                    self.controller.flush_writes()\n                    self.check_acks()\n",
        "                    self.check_acks()\n",
        CACHE_SUITES,
        DEFERRED,
    ),
    Mutant(
        "write-back-eviction-starts-load-backs",
        "a write-back eviction waits for every copy and starts the queued load-backs, unagreed ones too (32 #3)",
        "python/hicache/cache/radix_cache.py",
        "                    self.controller.flush_writes()\n",
        "                    self.controller.flush()\n",
        ("tests/cache/test_load_backs.py", "-k", "write_back_eviction"),
    ),
    Mutant(
        "load-back-host-slots-not-held",
        "a load-back's host slots stay SYNCED (evictable) while the copy reads them (30 #8)",
        "python/hicache/controller/controller.py",
        "        self.host_pool.mark_loading(host_indices)\n        self._pending_loads.append(",
        "        self._pending_loads.append(",
        CACHE_SUITES,
        DEFERRED,
    ),
    Mutant(
        "layer-signalled-before-issued",
        "a layer of a load-back is signalled done before its copy is issued (30 #8)",
        "python/hicache/controller/controller.py",
        _LAUNCH_LAYER + _SIGNAL_LAYER,
        _SIGNAL_LAYER + _LAUNCH_LAYER,
        ("tests/serving/test_engine.py", "tests/controller/test_layer_counter.py"),
        DEFERRED,
    ),
    Mutant(
        "sglang-switch-leaves-jit-on",
        "HICACHE_SGL_KERNEL=1 binds the compat functions but leaves SGLang's JIT kernels first (33 #2)",
        "hicache_kernels/compat/sglang_switch.py",
        "            setattr(module, name, _no_jit)\n",
        "            pass\n",
        ("tests/kernels/test_sglang_switch.py",),
    ),
    Mutant(
        "sglang-switch-pth-not-inert",
        "the .pth line imports the package in every interpreter, switch or not (33 #2)",
        "hicache_kernels/compat/sglang_switch.py",
        """os.environ.get("HICACHE_SGL_KERNEL", "0") != "0" and '""",
        """os.environ.get("HICACHE_SGL_KERNEL", "0") != "x" and '""",
        ("tests/kernels/test_sglang_switch.py",),
    ),
    Mutant(
        "ranges-destinations-misordered",
        "copy_ranges pairs each source range with another range's destination (33 #3b)",
        "hicache_kernels/ranges.py",
        'dst=_table(dst[pick], direction == "d2h")',
        'dst=_table(dst[pick[::-1]], direction == "d2h")',
        ("tests/kernels/test_ranges.py",),
    ),
    Mutant(
        "compat-errors-not-runtime",
        "the compat functions' argument errors are plain ValueError/TypeError: code written against "
        "sgl-kernel (its TORCH_CHECK raises RuntimeError; sgl-kernel's own tests match on it) misses them (33 #6)",
        "hicache_kernels/compat/sgl_kernel.py",
        "    globals()[_name] = _torch_check_errors(globals()[_name])",
        "    globals()[_name] = globals()[_name]",
        ("tests/kernels/test_compat_sgl_kernel.py",),
    ),
    Mutant(
        "client-plugin-keeps-cuda13-skip",
        "the upstream-test plugin no longer removes sgl-kernel's CUDA 13 skip: test_kvcacheio.py skips "
        "itself whole on the GPU image and the client-tests step proves nothing (33 #6)",
        "hicache_kernels/compat/pytest_plugin.py",
        'CUDA13_SKIP = "segfaults on CUDA 13"',
        'CUDA13_SKIP = "segfaults on CUDA 14"',
        ("tests/kernels/test_compat_pytest_plugin.py",),
    ),
    Mutant(
        "switch-leaves-mamba-unbound",
        "the SGLang switch binds sgl-kernel's transfers but not the Mamba state transfers: a hybrid Mamba "
        "model's states still go through SGLang's JIT kernel, or nothing on a CPU (33 #2)",
        "hicache_kernels/compat/sglang_switch.py",
        "    for name in (*KVCACHEIO, *MAMBA):",
        "    for name in KVCACHEIO:",
        ("tests/kernels/test_sglang_switch.py",),
    ),
    Mutant(
        "compat-mamba-load-wrong-layer",
        "the compat Mamba load reads layer 0 of the host states whatever layer_id says (33 #2)",
        "hicache_kernels/compat/sgl_kernel.py",
        "transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim)",
        "transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, 0, item_size, src_layout_dim)",
        ("tests/kernels/test_compat_sgl_kernel.py",),
    ),
    Mutant(
        "compat-embedding-ranges-unchecked",
        "transfer_embedding_ranges_direct stops checking ranges against the tensors: a range past the end "
        "is copied from/to whatever memory follows (33 #2)",
        "hicache_kernels/compat/_direct.py",
        "        over = np.nonzero(starts + n > t.shape[0])[0]",
        "        over = np.nonzero(starts + n > 10**9)[0]",
        ("tests/kernels/test_compat_sgl_kernel.py",),
    ),
    Mutant(
        "namespaces-share-the-tree",
        "a request's extra_key no longer moves its tokens into its own namespace: tenants match each "
        "other's prefixes on the device and the host (34 #3)",
        "python/hicache/cache/namespaces.py",
        '        return _ids(tokens, "with an extra_key").astype(np.int64) + (ns << SHIFT)',
        '        return _ids(tokens, "with an extra_key").astype(np.int64)',
        ("tests/cache/test_request_namespaces.py",),
    ),
    Mutant(
        "namespaces-share-storage-keys",
        "a namespace's storage chain starts from the tier's root digest: another tenant reads its stored pages (34 #3)",
        "python/hicache/cache/namespaces.py",
        "        if ns == 0:\n            return base_hex\n",
        "        if ns >= 0:\n            return base_hex\n",
        ("tests/cache/test_request_namespaces.py",),
    ),
    Mutant(
        "sidecar-not-backed-up",
        "a backup copies the KV but not its sidecar pool: the host holds pages without their indexer rows (34 #1)",
        "python/hicache/controller/controller.py",
        '        if op.kind == "write":\n            for b, d, h in pairs:\n',
        '        if op.kind == "write":\n            for b, d, h in pairs[:1]:\n',
        (
            "tests/cache/test_sidecar_pools.py",
            "tests/cache/test_cache_stress.py::test_random_operations_with_a_sidecar_pool",
        ),
    ),
    Mutant(
        "sidecar-not-loaded-by-layer",
        "a layer-wise load-back signals a layer done after the KV's copy only: the sidecar's rows are never "
        "loaded (34 #1)",
        "python/hicache/controller/controller.py",
        "                     for b, d, h in pairs]  # fmt: skip",
        "                     for b, d, h in pairs[:1]]  # fmt: skip",
        ("tests/cache/test_sidecar_pools.py",),
    ),
    Mutant(
        "sidecar-unkeyed-in-storage",
        "the storage namespace leaves the sidecar pools out: a cache whose sidecar has another host layout "
        "reads a stored page's sidecar rows in the wrong order (34 #1)",
        "python/hicache/storage/keys.py",
        "        if not self.sidecars:\n",
        "        if True:\n",
        ("tests/cache/test_sidecar_pools.py",),
    ),
    Mutant(
        "engine-indexer-off-the-cache",
        "the engine keeps the indexer's keys in a pool of its own beside a cache: a prefix from the cache "
        "comes back without its index keys and the indexer picks other tokens (34 #2)",
        "python/hicache/serving/engine.py",
        "                self.index = _cached_sidecar(\n",
        "                self.index = index_pool(c, pool.size, pool.page_size, pool.device) or _cached_sidecar(\n",
        ("tests/serving/test_engine.py::test_indexer_model_served_equals_recompute",),
    ),
    Mutant(
        "indexer-fp8-scale-per-batch",
        "the FP8 index keys are scaled by the batch's amax, not each token's own: a token's stored key then "
        "depends on what was computed with it, and a prefix from the cache scores otherwise than recomputed (34 #1)",
        "python/hicache/serving/config.py",
        "    scale = (keys.float().abs().amax(dim=-1, keepdim=True) / _FP8_MAX).clamp_min(1e-12)",
        "    scale = (keys.float().abs().amax().expand(len(keys), 1).contiguous() / _FP8_MAX).clamp_min(1e-12)",
        ("tests/serving/test_engine.py::test_indexer_model_served_equals_recompute",),
    ),
    Mutant(
        "sidecar-state-loaded-with-the-last-layer",
        "a sidecar of fewer layers (a recurrent layer's checkpoints) is loaded with the KV's last layers instead "
        "of its first: the forward's recurrent layer resumes from a checkpoint still in flight (34 #1)",
        "python/hicache/controller/controller.py",
        _SIDECAR_LAYER + "                    work = lambda s, layer=layer, load=load: load(layer)  # noqa: E731\n"
        "                    self._launch(stream, work, op, (h, h_idx), (d, d_idx), layer)\n",
        "                    own = layer - (dp.num_layers - d.num_layers)\n"
        "                    if own < 0:\n"
        "                        continue\n"
        "                    work = lambda s, layer=own, load=load: load(layer)  # noqa: E731\n"
        "                    self._launch(stream, work, op, (h, h_idx), (d, d_idx), own)\n",
        ("tests/serving/test_hybrid_models.py",),
        DEFERRED,
    ),
    Mutant(
        "engine-state-off-the-cache",
        "the engine keeps the recurrent checkpoints in a pool of its own beside a cache: a prefix from the cache "
        "resumes from a checkpoint that is not its own (34 #1, #2)",
        "python/hicache/serving/engine.py",
        "                self.state = _cached_sidecar(\n",
        "                self.state = state_pool(c, pool.size, pool.page_size, pool.device) or _cached_sidecar(\n",
        ("tests/serving/test_hybrid_models.py",),
    ),
    Mutant(
        "recurrent-checkpoint-a-token-early",
        "a page's checkpoint is the state before its last token, not after: a prefix resumed from it skips a "
        "token of the recurrence (34 #1)",
        "python/hicache/serving/model.py",
        "                    put(0, page, partial(_put, (rows,), page, (h.view(ps, 1, -1),)), pool)",
        "                    put(0, page, partial(_put, (rows,), page, (ys[max(0, len(ys) - 2)].view(ps, 1, -1),)), "
        "pool)",
        ("tests/serving/test_hybrid_models.py",),
    ),
    Mutant(
        "window-reads-a-key-too-few",
        "a windowed layer resuming from the cache reads its prefix's K/V from one position too late: the first "
        "query's window misses its oldest key (34 #1, #2)",
        "python/hicache/serving/model.py",
        "                    first = max(0, start - wlen + 1) if wlen else 0",
        "                    first = max(0, start - wlen + 2) if wlen else 0",
        ("tests/serving/test_hybrid_models.py",),
    ),
    Mutant(
        "window-match-not-cut",
        "a sliding-window model's match is not cut where its window's rows are gone: a request resumes from a "
        "prefix whose windowed layers' K/V is not there (34 #1)",
        "python/hicache/cache/radix_cache.py",
        "            if usable < matched:",
        "            if False and usable < matched:",
        (
            "tests/cache/test_window_pool.py",
            "tests/cache/test_cache_stress.py::test_random_operations_with_a_window_pool",
        ),
    ),
    Mutant(
        "window-rows-not-loaded",
        "a load-back brings the KV pages back without their window rows: the rows given to them hold whatever "
        "was there (34 #1)",
        "python/hicache/controller/controller.py",
        "            op.window = self.window.plan_load(op.device_indices, op.host_indices)",
        "            op.window = None",
        (
            "tests/cache/test_window_pool.py",
            "tests/cache/test_cache_stress.py::test_random_operations_with_a_window_pool",
        ),
    ),
    Mutant(
        "window-host-rows-always-flagged",
        "a backup flags every host page as carrying window rows, also those whose device page had none: a "
        "load-back then hands out rows nobody wrote (34 #1)",
        "python/hicache/pools/window_pool.py",
        "        self._host_rows[self._pages_host(host_slots)] = present",
        "        self._host_rows[self._pages_host(host_slots)] = True",
        (
            "tests/cache/test_window_pool.py",
            "tests/cache/test_cache_stress.py::test_random_operations_with_a_window_pool",
        ),
    ),
    Mutant(
        "window-step-trim-past-the-cache-boundary",
        "a running request trims the rows its next token's window no longer needs, forgetting the page "
        "boundary it will be cached up to: its cached sequence's last window is not whole (34 #1)",
        "python/hicache/serving/engine.py",
        "            keep_from = max(0, nxt - nxt % ps - w + 1) // ps * ps",
        "            keep_from = max(0, nxt - w + 1) // ps * ps",
        ("tests/serving/test_hybrid_models.py::test_cached_sequences_keep_their_last_window",),
    ),
    Mutant(
        "window-rows-not-adopted",
        "a request's copies of pages another request cached first are freed with their window rows: the cached "
        "pages keep none, and the sequence's last window is not whole (34 #1)",
        "python/hicache/serving/engine.py",
        "            if self.window is not None:  # their window rows go to the cached pages that have none",
        "            if False:",
        ("tests/serving/test_hybrid_models.py::test_cached_sequences_keep_their_last_window",),
    ),
    Mutant(
        "sidecar-rows-left-out-of-mha-objects",
        "an MHA page's head-group objects are stored without the sidecar rows: a page comes back from the store "
        "without its indexer keys or checkpoints (34 #1)",
        "python/hicache/storage/objects.py",
        "            out += [[(start + off, n) for off, n in obj] + rows for obj in self._pattern]",
        "            out += [[(start + off, n) for off, n in obj] for obj in self._pattern]",
        ("tests/cache/test_sidecar_pools.py",),
    ),
    Mutant(
        "window-flag-of-the-wrong-page",
        "a stored page's objects carry its window rows but the rows flag of host page 0, not its own: a page read "
        "back from the store claims rows its writer never had, or loses those it had (34 #1)",
        "python/hicache/storage/objects.py",
        "            flag = [(w.host_flags.data_ptr() + p, 1)]  # the page's rows flag, last",
        "            flag = [(w.host_flags.data_ptr(), 1)]",
        (
            "tests/cache/test_window_pool.py",
            "tests/cache/test_cache_stress.py::test_random_operations_with_a_window_pool_and_storage",
        ),
    ),
    Mutant(
        "recurrent-layer-waits-for-nothing",
        "a recurrent layer without attention does not wait for the step's load-backs before it reads the "
        "checkpoints new requests resume from: it reads one still in flight (34 #2, deferred model)",
        "python/hicache/serving/model.py",
        "                    wait_layer(li)  # the checkpoints new sequences resume from have landed",
        "                    pass",
        ("tests/serving/test_hybrid_models.py",),
        DEFERRED,
    ),
    # The SGLang storage adapter (issue 33): run where SGLang's host pools import (CI's GPU-image leg,
    # HICACHE_SGLANG_PATH set), with HICACHE_REQUIRE_CLIENTS=1 so a skip cannot pass for a catch.
    Mutant(
        "sglang-dcp-ranks-share-keys",
        "the namespace leaves the DCP rank out: two DCP ranks' shards of a page go under one key (33 #1, DCP)",
        "python/hicache/integrations/sglang.py",
        '            fields["dcp"] = [int(cfg.dcp_rank), dcp_size]',
        '            fields["dcp"] = [0, dcp_size]',
        (_SGLANG_TESTS,),
        _REQUIRE,
        "sglang",
    ),
    Mutant(
        "sglang-dcp-physical-page-step",
        "object ids step through the host pool's logical (DCP) slots by the physical page: a DCP page is "
        "split into two objects, misread (33 #1, DCP)",
        "python/hicache/integrations/sglang.py",
        'self.page_size = int(getattr(host_pool, "logical_page_size", host_pool.page_size))',
        "self.page_size = int(host_pool.page_size)",
        (_SGLANG_TESTS,),
        _REQUIRE,
        "sglang",
    ),
    Mutant(
        "sglang-v2-sidecar-not-required",
        "batch_exists_v2 counts a trailing-pages sidecar (a Mamba state) as present without looking: a "
        "prefix whose state is missing is loaded without it (34 #4)",
        "python/hicache/integrations/sglang.py",
        "                    ok = {n for n in range(1, kv + 1) if all(present[max(0, n - trailing) : n])}",
        "                    ok = set(range(1, kv + 1))",
        (_SGLANG_TESTS,),
        _REQUIRE,
        "sglang",
    ),
    Mutant(
        "sglang-v2-pool-geometry-unkeyed",
        "a v2 pool's namespace leaves its page bytes out: a pool of another state shape reads the page (34 #4)",
        "python/hicache/integrations/sglang.py",
        '            "geometry": _pool_geometry(host_pool),\n',
        "",
        (_SGLANG_TESTS,),
        _REQUIRE,
        "sglang",
    ),
    Mutant(
        "sglang-namespace-drops-dtype",
        "the adapter's namespace leaves the KV dtype out: another dtype reads the bytes (33 #1, sglang#33268)",
        "python/hicache/integrations/sglang.py",
        '            "dtype": str(host.dtype),\n',
        "",
        (_SGLANG_TESTS,),
        _REQUIRE,
        "sglang",
    ),
    Mutant(
        "sglang-mha-shard-not-keyed",
        "an MHA rank's heads are left out of its namespace: a rank reads another rank's shard (33 #1)",
        "python/hicache/integrations/sglang.py",
        '                fields["heads"] = [cfg.tp_rank * heads, heads]',
        "                pass",
        (_SGLANG_TESTS,),
        _REQUIRE,
        "sglang",
    ),
    Mutant(
        "sglang-non-writer-stores",
        "an MLA rank that is not SGLang's storage writer stores pages too (33 #1)",
        "python/hicache/integrations/sglang.py",
        "        self.writer = bool(storage_config.is_storage_writer)\n",
        "        self.writer = True\n",
        (_SGLANG_TESTS,),
        _REQUIRE,
        "sglang",
    ),
    Mutant(
        "sglang-fault-raises",
        "a store fault in a zero-copy read escapes into SGLang's prefetch thread (33 #1)",
        "python/hicache/integrations/sglang.py",
        "        except Exception as exc:  # a store fault is a miss\n",
        "        except NotImplementedError as exc:\n",
        (_SGLANG_TESTS,),
        _REQUIRE,
        "sglang",
    ),
    Mutant(
        "sglang-head-group-order",
        "a split page_head flat page is cut into consecutive pieces, not K and V of each head group (33 #1)",
        "python/hicache/integrations/sglang.py",
        "                parts = [flat] if groups == 1 else self._split_page(flat)\n",
        "                parts = [flat] if groups == 1 else list(flat.reshape(groups, -1))\n",
        (_SGLANG_TESTS,),
        _REQUIRE,
        "sglang",
    ),
    # The vLLM tier (issue 33 #3): run where vLLM's tiering modules import (HICACHE_VLLM_PATH set).
    Mutant(
        "vllm-namespace-drops-dtype",
        "the tier's namespace leaves the KV dtype out: another dtype reads the rows (33 #3)",
        "python/hicache/integrations/vllm.py",
        '        "dtype": str(config.model.dtype),\n',
        "",
        (_VLLM_TESTS,),
        _REQUIRE,
        "vllm",
    ),
    Mutant(
        "vllm-result-before-backend-lets-go",
        "a job's result is posted while the backend may still touch its rows: vLLM reuses them (33 #3)",
        "python/hicache/integrations/vllm.py",
        "        self._settle(ids)\n        self._post(JobResult(job_id=job_id, success=ok,",
        "        self._post(JobResult(job_id=job_id, success=ok,",
        (_VLLM_TESTS,),
        _REQUIRE,
        "vllm",
    ),
    Mutant(
        "vllm-failed-load-not-a-miss",
        "a failed promotion leaves the tier's cached lookup a hit: vLLM promotes it again forever (33 #3)",
        "python/hicache/integrations/vllm.py",
        "                self._lookups.mark_miss([k for k in load_keys if k not in loaded])\n",
        "                pass\n",
        (_VLLM_TESTS,),
        _REQUIRE,
        "vllm",
    ),
    Mutant(
        "vllm-region-kept-at-shutdown",
        "the tier keeps its view of vLLM's region after shutdown: vLLM cannot unmap it (33 #3)",
        "python/hicache/integrations/vllm.py",
        "        self.objects.release()\n",
        "",
        (_VLLM_TESTS,),
        _REQUIRE,
        "vllm",
    ),
    Mutant(
        "info-batch-unusable-on-cpu",
        "info says batch cannot copy CPU tensors, which it does (35 #3: info reports what a call does)",
        "hicache_kernels/_env.py",
        "        if why is not None:\n            out[name] = TensorStatus(False, why)\n",
        '        if why is not None or name == "batch":\n'
        '            out[name] = TensorStatus(False, why or "no CUDA driver")\n',
        ("tests/package/test_info.py", "-k", "cpu_tensors"),
    ),
    Mutant(
        "storage-prefetch-not-the-median",
        "the storage bench's prefetch latency is the last repeat, not the median (35 #4: figures from repeats)",
        "python/hicache/bench/storage.py",
        "            dt = statistics.median(times)\n",
        "            dt = times[-1]\n",
        ("tests/bench/test_bench_storage.py", "-k", "median"),
    ),
    Mutant(
        "provenance-hides-dirty-tree",
        "a result from an uncommitted tree records a clean commit (35 #4: every JSON records its commit)",
        "hicache_kernels/benchutil/output.py",
        '    return head.stdout.strip() + ("-dirty" if untracked or status.stdout.strip() else ""), None\n',
        "    return head.stdout.strip(), None\n",
        ("tests/kernels_bench/test_provenance.py",),
    ),
    Mutant(
        "prefetch-policy-not-in-storage",
        "PrefetchPolicy is not where users look for it, hicache.storage (35 #5)",
        "python/hicache/storage/__init__.py",
        "from .tier import PrefetchPolicy\n",
        "",
        ("tests/package/test_docs_facts.py", "-k", "prefetch_policy"),
    ),
]


def repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()  # fmt: skip
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def built() -> list[Path]:
    found = [*ROOT.glob("hicache_kernels/_C*.so"), *ROOT.glob("python/hicache/_core*.so")]
    meta = ROOT / "hicache_kernels" / "_build_meta.json"
    if not any(p.name.startswith("_core") for p in found) or not meta.exists():
        sys.exit("mutation_check: build the package first (bash scripts/setup.sh): hicache._core is not built")
    return [*found, meta]


def copy_tree(dest: Path) -> None:
    for f in repo_files():
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, target)
    for p in built():
        shutil.copy2(p, dest / p.relative_to(ROOT))


def run_pytest(copy: Path, args: tuple[str, ...], env: dict[str, str], stop_early: bool) -> tuple[int, str, float]:
    full_env = {k: v for k, v in os.environ.items() if k != "HICACHE_DEFERRED_SEED"}  # only where a mutant says
    full_env.update(env, PYTHONPATH=f"{copy}{os.pathsep}{copy / 'python'}", PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-m", "not slow and not build",
           *(["-x"] if stop_early else []), *args]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=copy, env=full_env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def first_failure(output: str) -> str | None:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0]
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/mutation_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated mutant names")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--group",
        default="core",
        choices=sorted({m.group for m in MUTANTS}),
        help="which mutants: core (default), sglang (needs SGLang's modules: HICACHE_SGLANG_PATH) or vllm "
        "(needs vLLM's: HICACHE_VLLM_PATH)",
    )
    a = p.parse_args(argv)
    mutants = [m for m in MUTANTS if m.group == a.group]
    if a.only:
        names = a.only.split(",")
        unknown = sorted(set(names) - {m.name for m in MUTANTS})
        if unknown:
            p.error(f"--only: no mutant named {', '.join(unknown)}")
        mutants = [m for m in MUTANTS if m.name in names]  # by name, whatever their group
    if a.list:
        for m in mutants:
            print(f"{m.name:36} {m.path}: {m.why}")
        return 0
    results, bad = [], 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hicache-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        probe = subprocess.run([sys.executable, "-c", "import hicache, hicache_kernels; print(hicache.__file__); "
                                "print(hicache_kernels.__file__)"], cwd=copy, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{copy / 'python'}"})  # fmt: skip
        if probe.returncode or any(not line.startswith(tmp) for line in probe.stdout.split()):
            print(f"mutation_check: the copy's packages do not import from {tmp}:\n{probe.stdout}{probe.stderr}")
            return 1
        # Every selection passes unmutated, or a failure proves nothing.
        for key in dict.fromkeys((m.tests, tuple(sorted(m.env.items()))) for m in mutants):
            code, out, secs = run_pytest(copy, key[0], dict(key[1]), False)
            print(f"baseline {' '.join(key[0])} {dict(key[1]) or ''}: exit {code} in {secs:.1f} s", flush=True)
            if code != 0:
                print(out[-3000:])
                bad += 1
        if bad:
            print("mutation_check: a baseline fails: fix the suite first")
            return 1
        for m in mutants:
            path = copy / m.path
            text = path.read_text()
            if text.count(m.old) != 1:
                results.append({"mutant": m.name, "status": "STALE", "caught_by": None, "seconds": 0.0})
                print(f"{m.name}: its text occurs {text.count(m.old)} times in {m.path} (expected once): update it")
                bad += 1
                continue
            path.write_text(text.replace(m.old, m.new))
            try:
                code, out, secs = run_pytest(copy, m.tests, m.env, True)
            finally:
                path.write_text(text)
            caught = first_failure(out) if code == 1 else None
            status = "caught" if caught else "SURVIVED"
            if not caught:
                bad += 1
                print(out[-2000:])
            results.append({"mutant": m.name, "status": status, "caught_by": caught, "seconds": round(secs, 1),
                            "why": m.why, "exit": code})  # fmt: skip
            print(f"{m.name:36} {status:9} {secs:6.1f} s  {caught or ''}", flush=True)
    total = time.perf_counter() - start
    print(f"mutation_check: {sum(r['status'] == 'caught' for r in results)} of {len(mutants)} mutants caught "
          f"in {total:.0f} s")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "seconds": round(total, 1)}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
