"""A unit of work shipped from the parent to every rank, and how it is (un)packed.

Functions and classes are pickled by reference (``module.qualname``), so the rank
must be able to import the modules the parent used. Under pytest's
``--import-mode=importlib`` (or for a script's ``__main__``) those modules are not
importable by name, so the task carries each module's file and the rank loads it
from there under the parent's module name.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import pickle
import re
import sys
from dataclasses import dataclass
from typing import Any

from distconform.harness._pytest_private import AssertionSettings
from distconform.harness.shared import rewritten_imports
from distconform.harness.shared.rewritten_imports import RewrittenModules

MAIN_ALIAS = "__distconform_main__"
#: Its modules are unpickled first in a rank (see module_refs).
HARNESS_PACKAGE = "distconform.harness"


class TaskPackingError(TypeError):
    """The test function or one of its arguments cannot be shipped to the ranks."""


@dataclass(frozen=True)
class ModuleRef:
    name: str
    path: str | None
    is_package: bool = False


@dataclass(frozen=True)
class RankTask:
    test_id: str
    payload: bytes
    modules: tuple[ModuleRef, ...]
    sys_path: tuple[str, ...]
    seed: int
    pg_timeout: float
    task_id: int = 0
    memory_limit: int | None = None
    # pytest's warning filters: (filter, whether its text is literal).
    warning_filters: tuple[tuple[str, bool], ...] = ()
    # Fail device-less tensor factories in the test body (harness/rank/device_audit.py).
    device_audit: bool = False
    # Check the body's stream safety where the device can (harness/rank/stream_safety.py).
    stream_check: bool = True
    # Modules pytest rewrote in the parent, rewritten again where a rank imports them, and
    # how to explain a failed comparison; None under ``--assert=plain``.
    rewritten: RewrittenModules = ()
    assertions: AssertionSettings | None = None


def pack_call(fn: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[bytes, tuple[ModuleRef, ...]]:
    """Pickle ``fn(*args, **kwargs)`` and list the modules needed to unpickle it."""
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        names = ", ".join(_unpicklable_names(args, kwargs)) or getattr(fn, "__qualname__", fn)
        raise TaskPackingError(
            f"cannot ship to the ranks: {names} could not be pickled ({exc}). Test functions "
            f"must be defined at module level, and fixture and parameter values must be "
            f"picklable; build rank-local objects (groups, meshes, models) inside the test, "
            f"or return a harness.RankLocal from the fixture."
        ) from exc
    return payload, _module_refs(payload)


def _unpicklable_names(args: tuple, kwargs: dict[str, Any]) -> list[str]:
    bad = []
    for label, value in [*((f"argument {i}", v) for i, v in enumerate(args)), *kwargs.items()]:
        try:
            pickle.dumps(value)
        except Exception:
            bad.append(f"{label!s} ({type(value).__name__})")
    return bad


# Protocol-4 pickles name modules with SHORT_BINUNICODE (opcode 0x8c, one length byte).
_SHORT_STRING = re.compile(rb"\x8c([\x01-\xff])", re.DOTALL)
_MODULE_NAME = re.compile(r"[A-Za-z_][\w.]*\Z")


def _module_refs(payload: bytes) -> tuple[ModuleRef, ...]:
    """Every loaded module whose name appears as a string in the pickle stream.

    A byte scan rather than a full opcode walk (it runs for every test): a false hit
    is harmless, because only names of modules loaded here count, and importing an
    importable module in the rank does no harm.
    """
    strings = set()
    for match in _SHORT_STRING.finditer(payload):
        start = match.end()
        try:
            text = payload[start : start + match.group(1)[0]].decode()
        except UnicodeDecodeError:
            continue
        if _MODULE_NAME.match(text):
            strings.add(text)
    refs: dict[str, ModuleRef] = {}
    # The harness's own modules first: a rank-side module may prepare the rank for the test's
    # (distconform.harness.adopt.rank serves init_process_group to names a test module binds on
    # import).
    for name in sorted(strings, key=lambda name: (not _is_harness(name), name)):
        if name not in sys.modules or name in sys.builtin_module_names:
            continue
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            module = sys.modules.get(prefix)
            if module is None or prefix in refs:
                continue
            refs[prefix] = ModuleRef(
                name=prefix,
                path=getattr(module, "__file__", None),
                is_package=hasattr(module, "__path__"),
            )
    return tuple(refs.values())


def _is_harness(name: str) -> bool:
    return name == HARNESS_PACKAGE or name.startswith(f"{HARNESS_PACKAGE}.")


# --- rank side -----------------------------------------------------------------------


def ensure_modules(task: RankTask) -> None:
    """Make every module the payload references importable under the parent's name, with
    pytest's assertion rewriting where the parent had it."""
    rewritten_imports.prepare(task.rewritten, task.assertions)
    for entry in reversed(task.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    for ref in task.modules:
        if ref.name == "__main__":
            _load_from_file(MAIN_ALIAS, ref.path, is_package=False)
            continue
        if ref.name in sys.modules:
            continue
        try:
            importlib.import_module(ref.name)
        except ModuleNotFoundError as exc:
            # Only "not on sys.path" falls back to the file; an import error raised by
            # the module's own code is the test's failure and is reported as it is.
            if ref.path is None or exc.name not in _prefixes(ref.name):
                raise
            _load_from_file(ref.name, ref.path, ref.is_package)


def _prefixes(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[: i + 1]) for i in range(len(parts))}


def _load_from_file(name: str, path: str | None, is_package: bool) -> None:
    if name in sys.modules or path is None:
        return
    locations = [os.path.dirname(path)] if is_package else None
    spec = rewritten_imports.rewriting_spec(name, path) or importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=locations
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load module {name!r} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


class _RankUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "__main__":
            module = MAIN_ALIAS
        return super().find_class(module, name)


def unpack_call(payload: bytes) -> tuple[Any, tuple, dict[str, Any]]:
    return _RankUnpickler(io.BytesIO(payload)).load()
