"""The one audited place where the harness touches private pytest names.

Two needs have no public API. First, pytest rewrites ``assert`` statements only in
modules its import hook loads, and only in its own process. Ranks run in other processes
(or in a host process) and import the test modules themselves, so they need the rewriting
and the comparison explanations that pytest keeps in ``_pytest.assertion``. Second, a skip
raised by the harness is reported at the harness's line unless it asks for the test's
(:func:`skip_at_the_items_location`).

Every accessor checks the installed pytest version. On a version nobody audited, rewriting
is skipped (the ranks report plain ``AssertionError`` messages, as before) and
``audit_problem()`` says why; ``tests/harness/test_pytest_private.py`` fails loudly there,
so a new pytest release is audited before it is trusted.
"""

from __future__ import annotations

import ast
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

AUDITED_PYTEST = ((9, 2),)

# Module-level names pytest's rewriter adds to every module it rewrites.
_REWRITE_MARKERS = ("@py_builtins", "@pytest_ar")

# The ini options pytest's comparison explanation reads (pytest_assertrepr_compare and
# its truncation), copied from the parent's config for the ranks.
_COMPARISON_INI = ("assertion_text_diff_style", "truncation_limit_lines", "truncation_limit_chars")


def installed_pytest_version() -> tuple[int, int]:
    major, minor = pytest.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def audit_problem() -> str | None:
    """Why rank-side assertion rewriting is off on this pytest, or None when it is on."""
    version = installed_pytest_version()
    if version in AUDITED_PYTEST:
        return None
    audited = ", ".join(f"{a}.{b}" for a, b in AUDITED_PYTEST)
    return (
        f"harness/_pytest_private.py was audited for pytest {audited}, but pytest "
        f"{pytest.__version__} is installed: ranks report assertions without pytest's "
        f"rewritten messages. Check that the names it uses still mean the same, then add "
        f"the version to AUDITED_PYTEST."
    )


def skip_at_the_items_location(reason: str) -> NoReturn:
    """``pytest.skip(reason)``, reported at the test's own line rather than at the harness
    line that raised it: a skip decided on the ranks (or before them, by an adopted class's
    own harness) belongs to the test. pytest's skip markers do this through
    ``Skipped(_use_item_location=True)``, which has no public spelling; on a pytest nobody
    audited it is a plain skip."""
    if audit_problem() is None:
        raise pytest.skip.Exception(reason, _use_item_location=True)
    pytest.skip(reason)


@dataclass(frozen=True)
class AssertionSettings:
    """What the ranks need to explain a failed comparison as the parent's pytest would."""

    verbosity: int
    ini: tuple[tuple[str, Any], ...]


def assertion_settings(config: pytest.Config) -> AssertionSettings | None:
    """The parent's settings, or None when ranks should not rewrite (``--assert=plain``,
    or an unaudited pytest)."""
    if audit_problem() is not None or config.getvalue("assertmode") != "rewrite":
        return None
    ini = []
    for name in _COMPARISON_INI:
        try:
            ini.append((name, config.getini(name)))
        except ValueError:  # an option this pytest does not define
            continue
    return AssertionSettings(
        verbosity=config.get_verbosity(pytest.Config.VERBOSITY_ASSERTIONS), ini=tuple(ini)
    )


def is_rewritten(module: types.ModuleType) -> bool:
    """Whether pytest rewrote this module's asserts when it imported it."""
    namespace = getattr(module, "__dict__", {})
    return all(name in namespace for name in _REWRITE_MARKERS)


# --- rank side ---------------------------------------------------------------------------


def rewritten_code(source: bytes, path: str) -> types.CodeType:
    """``source`` compiled with pytest's assertion rewriting, as its import hook would."""
    from _pytest.assertion.rewrite import rewrite_asserts

    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path, None)
    return compile(tree, path, "exec", dont_inherit=True)


def cached_rewritten_code(path: str) -> types.CodeType | None:
    """The rewritten code pytest's import hook cached for ``path``, or None.

    The parent's pytest writes it to ``__pycache__`` (unless bytecode writing is off) when
    it imports a test module. The cache is keyed by the source's hash, so a stale one is
    never used. Reading it spares each rank rewriting the module again, which costs about
    a millisecond per ``assert`` statement in the module.
    """
    if audit_problem() is not None:
        return None
    from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, get_cache_dir

    source = Path(path)
    return _read_pyc(source, get_cache_dir(source) / (source.name[:-3] + PYC_TAIL))


class _ConfigStandIn:
    """The few ``pytest.Config`` answers pytest's comparison code asks for, from a snapshot.

    A rank has no pytest session; building a real Config there would load every plugin.
    """

    class _NoPlugins:
        def has_plugin(self, name: str) -> bool:
            return False  # no terminal: explanations stay plain text, as in a report

    def __init__(self, settings: AssertionSettings) -> None:
        self._settings = settings
        self._ini = dict(settings.ini)
        self.pluginmanager = self._NoPlugins()

    def get_verbosity(self, verbosity_type: str | None = None) -> int:
        return self._settings.verbosity

    def getini(self, name: str) -> Any:
        return self._ini.get(name)

    def getvalue(self, name: str) -> Any:
        return "rewrite" if name == "assertmode" else None


def install_comparison_explanations(settings: AssertionSettings) -> None:
    """Make rewritten asserts in this process explain comparisons (``At index 2 diff``)
    as pytest does during a test; without this they show only ``assert 3 == 4``."""
    from _pytest.assertion import pytest_assertrepr_compare, util

    config = _ConfigStandIn(settings)

    def explain(op: str, left: object, right: object) -> str | None:
        lines: Iterable[str] | None = pytest_assertrepr_compare(
            config=config,  # type: ignore[arg-type]
            op=op,
            left=left,
            right=right,
        )
        if not lines:
            return None
        # As pytest's own hook wrapper: newlines escaped for format_explanation, and
        # "%" doubled because the rewritten code %-formats the result.
        return "\n~".join(line.replace("\n", "\\n") for line in lines).replace("%", "%%")

    util._reprcompare = explain
    util._config = config  # type: ignore[assignment]
