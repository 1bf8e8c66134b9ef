"""The ``auto`` io-backend: per call, the design a benchmark measured fastest for the direction and
fragment size, from a decision table that persists in a JSON file (``bench --tune-auto`` writes it)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..plan import TransferPlan
from .base import IOBackend
from .copy_engine import BatchBackend, DirectBackend, legacy_stream_reason
from .kernel import DEFAULT_SM_BUDGET as _KERNEL_SM_BUDGET
from .kernel import KernelBackend
from .staged import StagedBackend

__all__ = ["AUTO_DESIGNS", "AutoBackend", "auto_config_path", "fragment_bucket"]


def auto_config_path() -> tuple[Path, str]:
    """``(path, where)``: the settings file ``AutoBackend()`` loads, and what named it: ``$HICACHE_AUTO_CONFIG``,
    else ``$XDG_CONFIG_HOME/hicache_kernels/auto.json``, else ``~/.config/hicache_kernels/auto.json`` (an
    empty variable counts as unset, as the XDG spec says)."""
    env = os.environ.get("HICACHE_AUTO_CONFIG")
    if env:
        return Path(env), "$HICACHE_AUTO_CONFIG"
    xdg = os.environ.get("XDG_CONFIG_HOME")
    if xdg:
        return Path(xdg) / "hicache_kernels" / "auto.json", "$XDG_CONFIG_HOME"
    return Path.home() / ".config" / "hicache_kernels" / "auto.json", "the default path"


AUTO_DESIGNS = ("kernel", "kernel-bulk", "staged", "batch", "direct")
"""The designs ``auto`` chooses between, as its decision table and ``last_choice`` name them:
``kernel-bulk`` is ``kernel`` with ``design="bulk"``."""
_AUTO_DIRECTIONS = ("d2h", "h2d")


def fragment_bucket(fragment_bytes: int) -> int:
    """The decision table's bucket of a fragment size: the largest power of two not above it."""
    return 1 << (max(1, int(fragment_bytes)).bit_length() - 1)


class AutoBackend(IOBackend):
    """Chooses per call, by direction and estimated fragment size, the design a benchmark measured fastest.

    A fragment is a run of consecutive slots; callers allocate whole pages, so its size is estimated
    without looking at the indices (which may sit on the GPU) as ``item_bytes * page_size``
    (``chunk_bytes * page_size`` for ``page_head``), then bucketed to a power of two
    (:func:`fragment_bucket`). The decision table (``table``, written by ``bench --tune-auto``) holds,
    per direction (``d2h``/``h2d``) and measured bucket, the designs of :data:`AUTO_DESIGNS` ranked
    fastest first, measured with the kernels on ``sm_budget`` blocks, which is what auto's kernels
    use. A call takes the nearest measured bucket of its direction (by ratio; a tie goes to the
    smaller) and the first design in its ranking that can run the plan: available
    (``unavailable(plan)`` None), ``kernel-bulk`` only where bulk copies are supported (sm_90+,
    16-byte alignment), ``batch`` not on the legacy default stream; ``direct`` when none can. A
    direction the table does not hold uses the single-threshold rule: ``kernel`` below
    ``kernel_max_fragment_bytes``, else ``batch`` (on a non-default stream) or ``direct``.
    CPU tensors always go to ``direct``. ``last_choice`` names the design the last prepared call
    uses and ``last_reason`` says why.

    Settings load from ``HICACHE_AUTO_CONFIG``, else ``$XDG_CONFIG_HOME/hicache_kernels/auto.json``
    (``~/.config`` without it: :func:`auto_config_path`), a JSON object: ``kernel_max_fragment_bytes``,
    and optionally ``sm_budget`` and ``table``, e.g.
    ``{"d2h": {"4096": ["kernel-bulk", "kernel", "batch", "direct", "staged"]}}``; a file with only
    ``kernel_max_fragment_bytes``, the format before the table, still loads; :meth:`save` writes
    them, so a benchmark can re-tune. ``thresholds=`` takes the same object.
    """

    name = "auto"
    DEFAULTS = {"kernel_max_fragment_bytes": 256 * 1024}
    DEFAULT_SM_BUDGET = _KERNEL_SM_BUDGET  # the kernel backend's default: 4 SMs' worth of CTAs
    KEYS = ("kernel_max_fragment_bytes", "sm_budget", "table")
    THRESHOLD_RANKING: tuple[str, ...] = ("kernel", "batch", "direct")
    """The ranking of a direction the table lacks: below ``kernel_max_fragment_bytes``; without ``kernel`` above."""

    def __init__(self, thresholds: dict[str, Any] | None = None, path: Path | None = None) -> None:
        self.path = path or auto_config_path()[0]
        self.thresholds = dict(self.DEFAULTS)
        config: dict[str, Any] = {}
        where = "thresholds"
        if thresholds is None and self.path.exists():
            config, where = json.loads(self.path.read_text()), str(self.path)
            if not isinstance(config, dict):
                raise ValueError(f"{self.path}: expected a JSON object, got {type(config).__name__}")
            unknown = set(config) - set(self.KEYS)
            if unknown:
                raise ValueError(f"{self.path}: unknown auto thresholds {sorted(unknown)}")
        elif thresholds is not None:
            config = thresholds
            unknown = set(config) - set(self.KEYS)
            if unknown:
                raise ValueError(f"thresholds: unknown keys {sorted(unknown)}; expected {sorted(self.KEYS)}")
        if "kernel_max_fragment_bytes" in config:
            self.thresholds["kernel_max_fragment_bytes"] = int(config["kernel_max_fragment_bytes"])
        self.sm_budget = int(config.get("sm_budget", self.DEFAULT_SM_BUDGET))
        if self.sm_budget < 1:
            raise ValueError(f"{where}: sm_budget: expected an int >= 1, got {self.sm_budget}")
        self.table = self._parse_table(config.get("table", {}), where)
        self.kernel = KernelBackend.for_sm_budget(self.sm_budget)
        self.kernel_bulk = KernelBackend.for_sm_budget(self.sm_budget, design="bulk")
        self.staged = StagedBackend()
        self.batch = BatchBackend()
        self.direct = DirectBackend()
        self.last_choice: str | None = None
        self.last_reason: str | None = None

    @staticmethod
    def _parse_table(table: Any, where: str) -> dict[str, dict[int, tuple[str, ...]]]:
        """``table`` checked: directions, power-of-two buckets (JSON keys are strings), rankings of
        distinct known designs. ValueError naming ``where`` and the bad entry."""
        if not isinstance(table, dict):
            raise ValueError(f"{where}: table: expected an object of directions, got {type(table).__name__}")
        parsed: dict[str, dict[int, tuple[str, ...]]] = {}
        for direction, rows in table.items():
            if direction not in _AUTO_DIRECTIONS or not isinstance(rows, dict):
                raise ValueError(f"{where}: table: expected d2h/h2d mapping buckets to rankings, got {direction!r}")
            for bucket, ranking in rows.items():
                size = int(bucket) if isinstance(bucket, int) or str(bucket).isdigit() else 0
                if size < 1 or size & (size - 1):
                    raise ValueError(f"{where}: table[{direction}]: bucket {bucket!r} is not a power of two")
                if (not isinstance(ranking, list | tuple) or not ranking or len(set(ranking)) != len(ranking)
                        or set(ranking) - set(AUTO_DESIGNS)):  # fmt: skip
                    raise ValueError(f"{where}: table[{direction}][{bucket}]: expected distinct designs of "
                                     f"{', '.join(AUTO_DESIGNS)}, got {ranking!r}")  # fmt: skip
                parsed.setdefault(direction, {})[size] = tuple(ranking)
        return parsed

    def settings(self) -> dict[str, Any]:
        """What :meth:`save` writes: the threshold alone when there is no table (the old format)."""
        out: dict[str, Any] = dict(self.thresholds)
        if self.table or self.sm_budget != self.DEFAULT_SM_BUDGET:
            out["sm_budget"] = self.sm_budget
        if self.table:
            out["table"] = {d: {str(b): list(r) for b, r in sorted(rows.items())} for d, rows in self.table.items()}
        return out

    def save(self) -> Path:
        """Write :meth:`settings` to ``path`` (its folder made if needed) and return ``path``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.settings(), indent=2) + "\n")
        return self.path

    def _ranking(self, direction: str, fragment: int) -> tuple[int, tuple[str, ...]] | None:
        """(measured bucket, ranking) nearest ``fragment`` in ``direction``'s table, or None."""
        rows = self.table.get(direction)
        if not rows:
            return None
        want = fragment_bucket(fragment).bit_length()
        best = min(rows, key=lambda b: (abs(b.bit_length() - want), b))
        return best, rows[best]

    def candidates(self) -> tuple[str, ...]:
        """The designs a call on CUDA tensors can take, in :data:`AUTO_DESIGNS` order: those the table
        ranks, the threshold rule's for a direction it lacks, and ``direct`` (where every call ends when
        nothing before it can run). Whether each can run a given plan is its own question (``decide``)."""
        ranked = {name for rows in self.table.values() for ranking in rows.values() for name in ranking}
        if set(self.table) != set(_AUTO_DIRECTIONS):
            ranked |= set(self.THRESHOLD_RANKING)
        return tuple(name for name in AUTO_DESIGNS if name in ranked or name == "direct")

    def _design(self, name: str) -> IOBackend:
        return {"kernel": self.kernel, "kernel-bulk": self.kernel_bulk, "staged": self.staged,
                "batch": self.batch, "direct": self.direct}[name]  # fmt: skip

    def _why_not(self, name: str, plan: TransferPlan) -> str | None:
        """Why design ``name`` cannot run ``plan`` (CUDA tensors), or None."""
        if name == "batch":
            reason = legacy_stream_reason(plan)
            if reason is not None:
                return reason
        reason = self._design(name).unavailable(plan)
        if reason is None and name == "kernel-bulk":
            g = plan.route.launch_state.get("gpu")  # the launch's alignment (host aliases included) once built
            align = g.align if g is not None else plan.route.alignment()
            reason = KernelBackend.bulk_unsupported(align, plan.route.device)
        return reason

    def decide(self, plan: TransferPlan) -> tuple[str, str]:
        """``(design, why)`` for ``plan``: see the class docstring."""
        if not plan.route.on_cuda:
            return "direct", "CPU tensors"
        fragment = plan.chunk_bytes * plan.route.page_size
        found = self._ranking(plan.direction, fragment)
        if found is None:
            limit = self.thresholds["kernel_max_fragment_bytes"]
            rule = f"no {plan.direction} table: threshold rule, {fragment} B fragments vs {limit} B"
            ranking = self.THRESHOLD_RANKING if fragment < limit else self.THRESHOLD_RANKING[1:]
        else:
            bucket, ranking = found
            rule = f"{plan.direction} table, bucket {bucket} B (nearest to {fragment} B fragments)"
        skipped = []
        for name in (*ranking, "direct") if "direct" not in ranking else ranking:
            why = None if name == "direct" else self._why_not(name, plan)
            if why is None:
                return name, rule + "".join(f"; {s}" for s in skipped)
            skipped.append(f"{name} skipped: {why}")
        raise AssertionError("unreachable: direct always runs")

    def choose(self, plan: TransferPlan) -> IOBackend:
        """The backend :meth:`decide` picks for ``plan``."""
        return self._design(self.decide(plan)[0])

    def wants_host_indices(self, plan: TransferPlan) -> bool:
        return self.choose(plan).wants_host_indices(plan)

    def warm(self, plan: TransferPlan) -> bool:
        return self.choose(plan).warm(plan)

    def _prepare(self, plan: TransferPlan) -> Callable[[], None]:
        name, why = self.decide(plan)
        self.kernel_bulk.last_design = None  # set by a launch only (an empty copy launches nothing)
        copy = self._design(name).prepare(plan)
        if name == "kernel-bulk" and self.kernel_bulk.last_design == "register":
            # E.g. the launch's alignment (host aliases included) turned out below 16 bytes.
            why += f"; kernel-bulk ran the register kernel: {self.kernel_bulk.last_design_reason}"
            name = "kernel"
        self.last_choice, self.last_reason = name, why
        return copy
