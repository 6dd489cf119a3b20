"""pytest's warning filters inside the ranks, and the ranks' warnings back in pytest.

Most of a distributed test runs in the ranks, out of reach of pytest's warning
capture. The parent ships its filters (ini ``filterwarnings`` and ``-W``) with each
task; the rank applies them (so ``error::FutureWarning:impl.*`` fails a test whose
rank calls a deprecated API) and records what was not turned into an error. The
parent re-emits those warnings, prefixed with the rank, inside the test, where
pytest's warnings summary shows them.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class RankWarning:
    category: str  # "module:qualname"
    message: str
    filename: str
    lineno: int


def _category(path: str) -> type[Warning]:
    module, _, qualname = path.partition(":")
    try:
        value = importlib.import_module(module)
        for part in qualname.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError):
        return UserWarning
    return value if isinstance(value, type) and issubclass(value, Warning) else UserWarning


def _category_name(category: type[Warning]) -> str:
    return f"{category.__module__}:{category.__qualname__}"


def _apply_filter(spec: str, literal: bool) -> None:
    """One ``action:message:category:module:lineno`` filter, as pytest reads it.

    Like pytest, message and module are regular expressions in the ini file and
    literal text (matched whole) on the command line.
    """
    parts = [p.strip() for p in spec.split(":")]
    parts += [""] * (5 - len(parts))
    action, message, category, module, lineno = parts[:5]
    category_class = Warning
    if category:
        dotted = category.rsplit(".", 1)
        path = f"{dotted[0]}:{dotted[1]}" if len(dotted) == 2 else f"builtins:{category}"
        category_class = _category(path)
    if literal:
        message = re.escape(message)
        module = re.escape(module) + r"\Z" if module else ""
    warnings.filterwarnings(
        action or "default",
        message=message,
        category=category_class,
        module=module,
        lineno=int(lineno) if lineno else 0,
    )


@contextlib.contextmanager
def rank_warning_capture(
    filters: tuple[tuple[str, bool], ...],
) -> Iterator[list[RankWarning]]:
    """Apply ``filters`` and record warnings while a task runs; no filters, no capture.

    Rank threads share one warnings state, which ``catch_warnings`` cannot split
    between threads, so the thread launcher ships no filters and captures nothing.
    """
    caught: list[RankWarning] = []
    if not filters:
        yield caught
        return
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for spec, literal in filters:
            _apply_filter(spec, literal)
        try:
            yield caught
        finally:
            seen = set()
            for record in records:
                warning = RankWarning(
                    category=_category_name(record.category),
                    message=str(record.message),
                    filename=record.filename,
                    lineno=record.lineno,
                )
                if warning not in seen:
                    seen.add(warning)
                    caught.append(warning)


def reemit(rank_warnings: dict[int, list[RankWarning]]) -> None:
    """Warn once per distinct warning, naming every rank that raised it."""
    ranks_of: dict[RankWarning, list[int]] = {}
    for rank, items in sorted(rank_warnings.items()):
        for item in items:
            ranks_of.setdefault(item, []).append(rank)
    for item, ranks in ranks_of.items():
        listed = ", ".join(str(r) for r in ranks)
        warnings.warn_explicit(
            f"[rank {listed}] {item.message}",
            _category(item.category),
            item.filename,
            item.lineno,
        )


def filters_from_config(config) -> tuple[tuple[str, bool], ...]:
    """The ini ``filterwarnings`` lines, then ``-W`` options (later ones win).

    Each comes with whether its text is literal (command line) or a regex (ini).
    """
    ini = [(line.strip(), False) for line in config.getini("filterwarnings") if line.strip()]
    cli = [(line, True) for line in config.known_args_namespace.pythonwarnings or []]
    return (*ini, *cli)
