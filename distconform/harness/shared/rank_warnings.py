"""A warning a rank recorded, as it crosses to the parent.

The rank records what pytest's filters did not turn into an error
(:mod:`distconform.harness.rank.warning_capture`); the parent re-emits it inside the test
(:mod:`distconform.harness.controller.warning_reemit`), where pytest's warnings summary shows it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class RankWarning:
    category: str  # "module:qualname"
    message: str
    filename: str
    lineno: int


def category_of(path: str) -> type[Warning]:
    module, _, qualname = path.partition(":")
    try:
        value = importlib.import_module(module)
        for part in qualname.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError):
        return UserWarning
    return value if isinstance(value, type) and issubclass(value, Warning) else UserWarning
