"""Conformance reports read back from their ``conformance.json``.

:func:`load_run` accepts every schema version that :mod:`distconform.conformance.report` has written
since the report was published (4, and 5 with per-rank outcomes and a reproduce command): a
nightly job compares tonight's run with last night's, and the two may straddle an upgrade.
Fields a version lacks read as empty. Anything else (another file, a newer schema, a file
cut short) is a :class:`SavedRunError` that names the file and says what it found.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distconform.conformance.statuses import SCHEMA, STATUSES, RunState, conformance_percent

READABLE_VERSIONS = (4, 5, 6)


class SavedRunError(ValueError):
    """A file is not a conformance report this version can read."""


@dataclass(frozen=True)
class SavedTest:
    nodeid: str
    feature: str
    world_size: int | None
    status: str
    duration_s: float
    reason: str
    message: str
    detail: str
    category: str
    link: str
    case: str | None
    capabilities: tuple[str, ...]
    ranks: tuple[tuple[int, str], ...]
    reproduce: str

    @property
    def headline(self) -> str:
        """What a reader sees first: the failure's message, else the skip or xfail reason."""
        return self.message or self.reason


@dataclass(frozen=True)
class SavedRun:
    path: Path
    data: dict[str, Any]
    tests: tuple[SavedTest, ...]

    @property
    def environment(self) -> dict[str, Any]:
        return self.data.get("environment") or {}

    @property
    def date(self) -> str:
        return str(self.environment.get("date") or "")

    @property
    def implementation(self) -> str:
        """The name of the implementation (or backend) under test, as the report gives it."""
        env = self.environment
        backend = env.get("backend_declaration") or {}
        impl = env.get("implementation") or {}
        if impl.get("name"):
            return str(impl["name"])
        return f"backend {backend.get('name')}" if backend.get("name") else "?"

    @property
    def label(self) -> str:
        """How a page or a table names this run: implementation, date and file."""
        return f"{self.implementation} {self.date or '(no date)'} ({self.path})"

    @property
    def complete(self) -> bool:
        return bool(self.data.get("complete"))

    def run_state(self) -> RunState:
        data = self.data
        return RunState(
            exit_status=data.get("exit_status"),
            stopped_because=data.get("stopped_because"),
            tests_expected=data.get("tests_expected"),
            tests_cut_short=int(data.get("tests_cut_short") or 0),
        )

    def by_nodeid(self) -> dict[str, SavedTest]:
        return {test.nodeid: test for test in self.tests}

    def counts(self) -> Counter:
        return Counter(test.status for test in self.tests)

    def percent(self) -> float | None:
        return conformance_percent(self.counts())

    def features(self) -> dict[str, Counter]:
        """Status counts per feature, all world sizes together."""
        grouped: dict[str, Counter] = {}
        for test in self.tests:
            grouped.setdefault(test.feature, Counter())[test.status] += 1
        return grouped

    def stale_expectations(self) -> list[dict[str, Any]]:
        return list(self.data.get("stale_expectations") or [])


def load_run(path: str | Path) -> SavedRun:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SavedRunError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SavedRunError(f"{path}: not a readable JSON file ({exc})") from None
    return run_from_json(data, path)


def run_from_json(data: Any, path: Path) -> SavedRun:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise SavedRunError(
            f"{path}: not a conformance report (schema {found!r}, expected {SCHEMA!r}): give "
            f"the conformance.json a conformance run wrote"
        )
    version = data.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise SavedRunError(
            f"{path}: schema version {version!r}; this distconform reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade distconform to read newer ones"
        )
    try:
        tests = tuple(_test_from_json(raw) for raw in data["tests"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SavedRunError(f"{path}: a test entry is malformed ({exc!r})") from None
    return SavedRun(path, data, tests)


def _test_from_json(raw: dict[str, Any]) -> SavedTest:
    status = raw["status"]
    if status not in STATUSES:
        raise ValueError(f"status {status!r} of {raw.get('nodeid')!r}")
    return SavedTest(
        nodeid=raw["nodeid"],
        feature=raw["feature"],
        world_size=raw.get("world_size"),
        status=status,
        duration_s=float(raw.get("duration_s") or 0.0),
        reason=raw.get("reason") or "",
        message=raw.get("message") or "",
        detail=raw.get("detail") or "",
        category=raw.get("category") or "",
        link=raw.get("link") or "",
        case=raw.get("case"),
        capabilities=tuple(raw.get("capabilities") or ()),
        ranks=tuple((int(r["rank"]), str(r["outcome"])) for r in raw.get("ranks") or ()),
        reproduce=raw.get("reproduce") or "",
    )
