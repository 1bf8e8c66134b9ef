"""Command-line helpers shared by the CLIs: a parser whose errors are one line, and comma-list parsing."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (``prog: error: ...``) with exit status 2, without
    the usage block that, for this many options, would bury the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def comma_list(text: str, cast: Callable[[str], Any] = str) -> list[Any]:
    """The non-empty items of a comma list, stripped and passed through ``cast``."""
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def names(flag: str, text: str, known: Sequence[str]) -> list[str]:
    """A comma list of names from ``known``: ValueError naming ``flag`` for an empty list, an unknown
    name or a repeat."""
    items = comma_list(text)
    if not items:
        raise ValueError(f"{flag}: empty; choose from {', '.join(known)}")
    for name in items:
        if name not in known:
            raise ValueError(f"{flag}: unknown {name!r}; choose from {', '.join(known)}")
    no_repeats(flag, items)
    return items


def counts(flag: str, text: str, *, allow_empty: bool = False) -> list[int]:
    """A comma list of integers >= 1: ValueError naming ``flag`` for anything else (or a repeat)."""
    values = []
    for x in comma_list(text):
        try:
            value = int(x)
        except ValueError:
            raise ValueError(f"{flag}: {x!r} is not an integer") from None
        if value < 1:
            raise ValueError(f"{flag}: expected integers >= 1, got {value}")
        values.append(value)
    if not values and not allow_empty:
        raise ValueError(f"{flag}: empty; expected a comma list of integers >= 1")
    no_repeats(flag, values)
    return values


def no_repeats(flag: str, values: list[Any]) -> None:
    """ValueError naming ``flag`` and the first value given twice."""
    seen = set()
    for v in values:
        if v in seen:
            raise ValueError(f"{flag}: {v} is given twice")
        seen.add(v)


def flagged(parse: Callable[[str], Any], text: str, flag: str) -> Any:
    """``parse(text)``, its ValueError prefixed with ``flag``."""
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
