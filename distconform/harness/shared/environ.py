"""The process environment as the harness compares it: cheaply, volatile variables aside.

Both sides read the whole environment for every test: the parent to key the warm pool
by what ranks inherit, each rank to catch a test that changed it. ``dict(os.environ)``
decodes every entry (30 us for 70 entries); the interpreter's own mapping behind it
copies in 1 us, so comparisons work on that and decode only what they report.
"""

from __future__ import annotations

import os
from typing import Any

# Variables that change while a session runs without meaning anything to the ranks:
# pytest sets the current test's id, and torch points its compiler caches at a default
# directory the first time anything imports inductor.
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"})
_VOLATILE_KEYS = VOLATILE_ENV | {os.fsencode(key) for key in VOLATILE_ENV}


def raw_environment() -> dict[Any, Any]:
    """A copy of the environment: bytes to bytes on POSIX, else ``str`` to ``str``."""
    raw = getattr(os.environ, "_data", None)
    return dict(raw) if isinstance(raw, dict) else dict(os.environ)


def lasting_items(environ: dict[Any, Any]) -> frozenset[tuple[Any, Any]]:
    """The items of ``environ`` but the volatile ones."""
    return frozenset(item for item in environ.items() if item[0] not in _VOLATILE_KEYS)


def changed_variables(before: dict[Any, Any], after: dict[Any, Any]) -> list[str]:
    """One line per lasting variable set, changed or removed between two copies."""
    if after == before:
        return []
    changes = []
    for key in sorted((before.keys() | after.keys()) - _VOLATILE_KEYS):
        old, new = before.get(key), after.get(key)
        if old != new:
            changes.append(
                f"environment variable {_text(key)} changed from {_text(old)!r} to {_text(new)!r}"
            )
    return changes


def _text(value: Any) -> Any:
    return os.fsdecode(value) if isinstance(value, bytes) else value
