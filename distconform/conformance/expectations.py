"""Expectations of one implementation: known failures and tolerance overrides (TOML).

A file lives with whoever maintains the implementation (``suites/expectations/torch-<version>.toml``
for torch's own ``fully_shard``; a vendor keeps theirs in their repository and passes
``--expectations FILE``)::

    [[xfail]]
    id = "suites/test_x.py::test_y[ws2-*"       # a test-id pattern (see ``matches``)
    reason = "what differs, with the evidence"
    category = "NUMERICS"                      # NOT_SUPPORTED, NUMERICS, COMM, ERROR_MESSAGE, OTHER
    link = "https://github.com/pytorch/pytorch/issues/..."
    devices = ["cuda"]                         # optional: only on these device types

    [[tolerance]]                              # loosen a comparison instead of giving up on it
    id = "suites/test_x.py::test_z"
    rtol = 1e-4
    atol = 1e-5
    reason = "why the default is too tight for this implementation"

An xfail entry adds a non-strict ``xfail`` marker at collection: the test still runs, a
failure is XFAIL and a pass is XPASS (the entry is out of date). Tolerances are never
xfails: a test asks for its tolerance through ``suites.expectations_helpers`` (the
``conformance_tolerance`` fixture) and keeps asserting with it.

An implementation built on another (``Implementation.built_on``) also meets that one's
recorded deviations: :func:`inherit` adds them, each entry marked with the name it comes
from, behind the implementation's own entries.
"""

from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

CATEGORIES = ("NOT_SUPPORTED", "NUMERICS", "COMM", "ERROR_MESSAGE", "OTHER")
_GLOB_CHARS = frozenset("*?[")


class ExpectationsError(ValueError):
    """An expectations file is malformed; the message names the file and the entry."""


def matches(pattern: str, nodeid: str) -> bool:
    """Whether a test-id pattern selects ``nodeid``.

    A pattern is the exact id, a glob over the whole id (``*`` also crosses ``/`` and
    ``::``), or, without glob characters, a prefix of the id ending where the id continues with
    ``::`` (a file or class) or ``[`` (every parametrization of one test). The prefix rule
    means ``suites/test_x.py::test_y`` selects ``test_y[ws2]`` and ``test_y[ws4]``; a
    literal ``[`` is written ``[[]`` as in any glob.
    """
    if nodeid == pattern:
        return True
    if _GLOB_CHARS & set(pattern):
        return fnmatch.fnmatchcase(nodeid, pattern)
    return nodeid.startswith(pattern) and nodeid[len(pattern) :].startswith(("::", "["))


@dataclass(frozen=True)
class Entry:
    """One ``[[xfail]]`` or ``[[tolerance]]`` table of a file."""

    kind: str  # "xfail" or "tolerance"
    pattern: str
    reason: str
    source: Path
    line: int
    category: str = "OTHER"
    link: str = ""
    rtol: float | None = None
    atol: float | None = None
    #: The device types the entry holds on (empty: every one).
    devices: tuple[str, ...] = ()
    #: The implementation whose expectations the entry comes from, when the one under test
    #: is built on it (:func:`inherit`); None for the implementation's own entries.
    inherited_from: str | None = None

    def matches(self, nodeid: str) -> bool:
        return matches(self.pattern, nodeid)

    @property
    def file_part(self) -> str:
        """The id's path part (before ``::``), for deciding whether an entry is stale."""
        return self.pattern.split("::", 1)[0]

    def describe(self) -> str:
        return f"{self.source}:{self.line}: {self.kind} entry {self.pattern!r}"

    def xfail_reason(self) -> str:
        inherited = f"inherited from {self.inherited_from}: " if self.inherited_from else ""
        text = f"[{self.category}] {inherited}{self.reason}"
        return f"{text} ({self.link})" if self.link else text


@dataclass
class Expectations:
    """Every entry of one file (or of several, see :func:`combine`), in file order."""

    xfails: list[Entry] = field(default_factory=list)
    tolerances: list[Entry] = field(default_factory=list)
    #: Every file read (several when the backend's are combined in), in order.
    sources: list[Path] = field(default_factory=list)

    @property
    def source(self) -> Path | None:
        """The first file read, or None when none was."""
        return self.sources[0] if self.sources else None

    @property
    def entries(self) -> list[Entry]:
        return [*self.xfails, *self.tolerances]

    def on_device(self, device_type: str) -> Expectations:
        """The entries that hold on ``device_type`` (an entry naming ``devices`` holds on
        those alone): a difference seen only on an accelerator expects nothing on the CPU."""
        holds = [e for e in self.xfails if not e.devices or device_type in e.devices]
        return Expectations(xfails=holds, tolerances=self.tolerances, sources=self.sources)

    def xfail_for(self, nodeid: str) -> Entry | None:
        """The first xfail entry selecting ``nodeid`` (file order decides)."""
        return next((entry for entry in self.xfails if entry.matches(nodeid)), None)

    def tolerance_for(self, nodeid: str) -> Entry | None:
        """The last tolerance entry selecting ``nodeid``: a later, narrower entry wins."""
        found = [entry for entry in self.tolerances if entry.matches(nodeid)]
        return found[-1] if found else None


def combine(*parts: Expectations) -> Expectations:
    """The entries of several files as one set, in the order given (the implementation's,
    then the backend's): the first matching xfail wins, the last matching tolerance."""
    sources = [path for part in parts for path in part.sources]
    return Expectations(
        xfails=[entry for part in parts for entry in part.xfails],
        tolerances=[entry for part in parts for entry in part.tolerances],
        sources=sources,
    )


def inherit(own: Expectations, base: Expectations, base_name: str) -> Expectations:
    """The expectations of an implementation built on ``base_name``: ``own`` plus ``base``'s
    entries, each marked inherited from ``base_name``. Where both select a test, ``own``
    wins: its xfails come first (the first matching xfail wins) and its tolerances last
    (the last matching tolerance wins)."""
    xfails = [replace(entry, inherited_from=base_name) for entry in base.xfails]
    tolerances = [replace(entry, inherited_from=base_name) for entry in base.tolerances]
    return Expectations(
        xfails=[*own.xfails, *xfails],
        tolerances=[*tolerances, *own.tolerances],
        sources=[*own.sources, *base.sources],
    )


def load(path: str | Path) -> Expectations:
    """Parse ``path``; raises ExpectationsError naming the file and the bad entry."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ExpectationsError(f"expectations file {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ExpectationsError(f"expectations file {path}: {exc}") from None
    unknown = set(data) - {"xfail", "tolerance"}
    if unknown:
        raise ExpectationsError(
            f"expectations file {path}: unknown table(s) {sorted(unknown)}; "
            f"expected [[xfail]] and [[tolerance]]"
        )
    lines = text.splitlines()
    found = Expectations(sources=[path])
    for kind, target in (("xfail", found.xfails), ("tolerance", found.tolerances)):
        tables = data.get(kind, [])
        if not isinstance(tables, list):
            raise ExpectationsError(f"expectations file {path}: write [[{kind}]], not [{kind}]")
        for index, table in enumerate(tables):
            target.append(_entry(kind, index, table, path, lines))
    return found


def _entry(kind: str, index: int, table: dict, path: Path, lines: list[str]) -> Entry:
    where = f"expectations file {path}, [[{kind}]] #{index + 1}"
    pattern = table.get("id")
    if not isinstance(pattern, str) or not pattern:
        raise ExpectationsError(f'{where}: needs id = "<test-id pattern>"')
    reason = table.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise ExpectationsError(f"{where} ({pattern}): needs a reason")
    line = _line_of(pattern, lines)
    if kind == "xfail":
        allowed = {"id", "reason", "category", "link", "devices"}
        category = table.get("category", "OTHER")
        if category not in CATEGORIES:
            raise ExpectationsError(
                f"{where} ({pattern}): category {category!r} is not one of {', '.join(CATEGORIES)}"
            )
        _no_extra_keys(table, allowed, where, pattern)
        devices = table.get("devices", [])
        if not isinstance(devices, list) or not all(isinstance(d, str) and d for d in devices):
            raise ExpectationsError(
                f'{where} ({pattern}): devices must be a list of device types, e.g. ["cuda"]'
            )
        link = str(table.get("link", ""))
        return Entry(kind, pattern, reason, path, line, category, link, devices=tuple(devices))
    _no_extra_keys(table, {"id", "reason", "rtol", "atol", "link"}, where, pattern)
    rtol, atol = table.get("rtol"), table.get("atol")
    if rtol is None and atol is None:
        raise ExpectationsError(f"{where} ({pattern}): give rtol, atol or both")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (not isinstance(value, int | float) or value < 0):
            raise ExpectationsError(f"{where} ({pattern}): {name} must be a number >= 0")
    return Entry(
        kind,
        pattern,
        reason,
        path,
        line,
        link=str(table.get("link", "")),
        rtol=None if rtol is None else float(rtol),
        atol=None if atol is None else float(atol),
    )


def _no_extra_keys(table: dict, allowed: set[str], where: str, pattern: str) -> None:
    extra = set(table) - allowed
    if extra:
        raise ExpectationsError(f"{where} ({pattern}): unknown key(s) {sorted(extra)}")


def _line_of(pattern: str, lines: list[str]) -> int:
    """The line that writes ``id = "<pattern>"`` (1-based; 1 when it cannot be found)."""
    for number, text in enumerate(lines, start=1):
        if text.lstrip().startswith("id") and pattern in text:
            return number
    return 1
