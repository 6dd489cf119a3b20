"""The rank's half of pytest's warning filters: apply them while a task runs, record the rest.

The parent ships its filters with each task and re-emits what comes back
(:mod:`distconform.harness.shared.rank_warnings`).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator

from distconform.harness.shared.rank_warnings import RankWarning, category_of


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
        category_class = category_of(path)
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
