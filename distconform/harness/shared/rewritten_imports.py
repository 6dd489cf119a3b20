"""pytest's assertion rewriting for the modules ranks import.

The parent lists the modules pytest rewrote there (test modules, conftests, helpers
registered with ``pytest.register_assert_rewrite``); each rank imports those same modules
through a finder that rewrites them, so ``assert a == b`` failing on rank 1 reads as it
would in plain pytest. Other modules import as usual.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from importlib.machinery import ModuleSpec

from distconform.harness import _pytest_private
from distconform.harness._pytest_private import AssertionSettings

RewrittenModules = tuple[tuple[str, str], ...]  # (module name, source file)


# --- parent side -----------------------------------------------------------------------

_cache: tuple[int, RewrittenModules] = (-1, ())


def rewritten_modules() -> RewrittenModules:
    """Every module in this process that pytest rewrote, with its file.

    Scanned again only when a module was imported since the last call: tests ship one task
    each, and sys.modules rarely changes between them.
    """
    global _cache
    loaded = len(sys.modules)
    if _cache[0] != loaded:
        found = []
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if path and path.endswith(".py") and _pytest_private.is_rewritten(module):
                found.append((name, path))
        _cache = (loaded, tuple(sorted(found)))
    return _cache[1]


# --- rank side -------------------------------------------------------------------------


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname: str) -> types.CodeType:
        # Never Python's own cached bytecode: a plain import may have written it without
        # rewriting. pytest's cache holds the parent's rewritten code.
        cached = _pytest_private.cached_rewritten_code(self.path)
        if cached is not None:
            return cached
        return _pytest_private.rewritten_code(self.get_data(self.path), self.path)


class _RewritingFinder:
    """A meta-path finder for the parent's rewritten modules, first on ``sys.meta_path``."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}
        # The settings comparisons are explained with in this process, once installed.
        self.settings: AssertionSettings | None = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: object = None
    ) -> ModuleSpec | None:
        file = self.files.get(fullname)
        return None if file is None else spec_for(fullname, file)


def spec_for(name: str, file: str) -> ModuleSpec | None:
    is_package = os.path.basename(file) == "__init__.py"
    return importlib.util.spec_from_file_location(
        name,
        file,
        loader=_RewritingLoader(name, file),
        submodule_search_locations=[os.path.dirname(file)] if is_package else None,
    )


_finder = _RewritingFinder()


def prepare(modules: RewrittenModules, settings: AssertionSettings | None) -> None:
    """Rewrite ``modules`` when this process imports them, and explain comparisons with
    the parent's ``settings``; ``settings`` None (``--assert=plain``) leaves imports alone."""
    if settings is None:
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    _finder.files.update(modules)
    if settings != _finder.settings:
        _pytest_private.install_comparison_explanations(settings)
        _finder.settings = settings


def rewriting_spec(name: str, file: str | None) -> ModuleSpec | None:
    """The rewriting spec for a module loaded by file (``--import-mode=importlib``), if
    the parent rewrote the module of that name."""
    if file is not None and _finder.files.get(name) == file:
        return spec_for(name, file)
    return None
