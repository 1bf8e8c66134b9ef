"""Plot helpers: whether matplotlib is there, a figure without pyplot's global state, saving it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


class PlotUnavailableError(RuntimeError):
    """``--plot`` was asked for but matplotlib does not import."""


def plot_unavailable() -> str | None:
    """Why ``--plot`` cannot work here (matplotlib is not installed), or None; checked before measuring."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken install
        found = False
    return None if found else "needs matplotlib, which is not installed (pip install matplotlib)"


def new_figure(**kwargs: Any) -> Any:
    """A ``matplotlib.figure.Figure`` (no pyplot: nothing global, no display needed).

    Raises
    ------
    PlotUnavailableError
        matplotlib does not import (the message names ``pip install matplotlib``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError(
            f"--plot needs matplotlib, which does not import ({exc}): pip install matplotlib"
        ) from exc
    return Figure(**kwargs)


def save_figure(fig: Any, path: str | Path) -> Path:
    """``fig`` as a PNG at ``path`` (parent folders made); returns the path."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return Path(path)
