"""Names a public module exports, imported on first use.

The public modules (:mod:`distconform.api`, :mod:`distconform.extension`) name everything a
user or an extension needs, but importing one must not import torch or the pytest side: a
device plug-in loaded in every rank, or ``distconform --help``, pays only for what it uses.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

#: Marks a ``homes`` entry whose name is a module of its own.
MODULE_PREFIX = "module:"


def lazy_exports(
    module_name: str, homes: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a module whose names live in ``homes``: name -> the
    module that defines it (``"module:attribute"`` where the name there differs), or
    ``"module:" + MODULE`` for a name that is itself a module. Each value is cached in
    ``namespace`` once read."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        if home.startswith(MODULE_PREFIX):
            value = importlib.import_module(home.removeprefix(MODULE_PREFIX))
        else:
            module, _, attribute = home.partition(":")
            value = getattr(importlib.import_module(module), attribute or name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
