"""distconform's four top-level packages must be its own, not a vendor's of the same name.

``harness``, ``impl``, ``suites`` and ``conformance`` are generic names. A repository with its
own ``impl/`` folder (or ``suites.py``) on ``sys.path`` before site-packages, typically the
directory pytest or the command is started from, would hand distconform someone else's
module, and the run would fail later with an import error that names neither. This module
finds where each name resolves, without importing it, and says which one is shadowed, by
which file, and what to do, in one line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGES = ("harness", "impl", "suites", "conformance")
#: Where distconform's packages live side by side: the tree, or site-packages.
ROOT = Path(__file__).resolve().parent.parent


class ShadowedPackageError(ImportError):
    """One of distconform's package names resolves to another project's file."""


def _location(name: str) -> Path | None:
    """The directory (a package) or file (a module) ``name`` resolves to; None if nothing."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin not in (None, "namespace"):
        origin = Path(spec.origin).resolve()
        return origin.parent if origin.name == "__init__.py" else origin
    locations = list(spec.submodule_search_locations or ())
    return Path(locations[0]).resolve() if locations else None


def shadowed_message() -> str | None:
    """The one line saying which package is shadowed and how to fix it; None if none is."""
    for name in PACKAGES:
        found = _location(name)
        expected = ROOT / name
        if found is not None and found != expected:
            return (
                f"distconform: '{name}' resolves to {found}, not distconform's {expected}: "
                f"a folder or module named '{name}' earlier on sys.path (the current directory "
                f"or PYTHONPATH) hides it; run from another directory, or take that path off "
                f"sys.path"
            )
    return None


def refuse_shadowed_packages() -> None:
    """Raise :class:`ShadowedPackageError` with :func:`shadowed_message` if one is shadowed."""
    message = shadowed_message()
    if message is not None:
        raise ShadowedPackageError(message)
