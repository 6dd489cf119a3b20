"""Which conformance cases exercise each public name of torch's FSDP2, and of c10d.

``suites/api_coverage.toml`` gives, for every public name of ``torch.distributed.fsdp`` (and
FSDP2's ``replicate``) in each release of the window, the cases that exercise it, or why it
is out of scope, or the gap no case fills yet, stated; ``suites/backend/api_coverage.toml``
does the same for ``torch.distributed.distributed_c10d`` against the backend cases. A vendor
reads them (rendered into ``docs/cases.md`` and ``docs/backend-cases.md``) to know what
"conformant" covers; :func:`coverage_problems` holds each to the installed torch's surface
(:mod:`suites.api_surface`), so a name a new release adds fails the tests until a row lists
it. Nothing here imports torch: the catalogue renders the tables on any machine.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.torch_window import SUPPORTED_TORCH, Version
from suites.cases import Case

COVERAGE_FILE = Path(__file__).resolve().parent / "api_coverage.toml"
BACKEND_COVERAGE_FILE = Path(__file__).resolve().parent / "backend" / "api_coverage.toml"
FIRST_RELEASE = "2.11"
_KEYS = {"names", "cases", "out_of_scope", "uncovered", "since", "build"}
_VERDICTS = ("cases", "out_of_scope", "uncovered")


@dataclass(frozen=True)
class ApiRow:
    """One row of the table: names, and what covers them."""

    names: tuple[str, ...]
    cases: tuple[str, ...] = ()
    out_of_scope: str = ""
    uncovered: str = ""
    since: str = FIRST_RELEASE
    #: Set for names only some builds of a release have (NCCL's classes in CUDA builds): the
    #: builds, and their absence from the installed torch is no error.
    build: str = ""

    @property
    def status(self) -> str:
        if self.cases:
            return "covered"
        return "out of scope" if self.out_of_scope else "uncovered"


def release(text: str) -> Version:
    """``"2.13"`` as ``(2, 13)``."""
    try:
        major, minor = (int(part) for part in text.split("."))
    except ValueError:
        raise ValueError(f"{text!r} is not a torch release like 2.13") from None
    return major, minor


def parse_coverage(text: str, cases: Mapping[str, Case]) -> list[ApiRow]:
    """The rows of a coverage table, validated against the case table ``cases``."""
    rows = []
    seen: set[str] = set()
    for index, raw in enumerate(tomllib.loads(text).get("api") or (), start=1):
        where = f"[[api]] row {index}"
        unknown = set(raw) - _KEYS
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        names = tuple(raw.get("names") or ())
        if not names or not all(isinstance(name, str) and name for name in names):
            raise ValueError(f"{where}: names must be a non-empty list of names")
        where = f"[[api]] row {index} ({names[0]})"
        given = [key for key in _VERDICTS if raw.get(key)]
        if len(given) != 1:
            raise ValueError(
                f"{where}: give exactly one of cases, out_of_scope or uncovered, got {given}"
            )
        for case_id in raw.get("cases") or ():
            case = cases.get(case_id)
            if case is None:
                raise ValueError(f"{where}: no case {case_id!r} in the case table")
            if not case.suite:
                raise ValueError(f"{where}: case {case_id!r} is recorded only, not implemented")
        twice = seen.intersection(names)
        if twice:
            raise ValueError(f"{where}: {sorted(twice)} listed in an earlier row too")
        seen.update(names)
        since = str(raw.get("since") or FIRST_RELEASE)
        if release(since) not in SUPPORTED_TORCH:
            raise ValueError(f"{where}: since {since!r} is not a release of the window")
        rows.append(
            ApiRow(
                names=names,
                cases=tuple(raw.get("cases") or ()),
                out_of_scope=str(raw.get("out_of_scope") or ""),
                uncovered=str(raw.get("uncovered") or ""),
                since=since,
                build=str(raw.get("build") or ""),
            )
        )
    return rows


def read_coverage(cases: Mapping[str, Case], path: Path = COVERAGE_FILE) -> list[ApiRow]:
    return parse_coverage(path.read_text(), cases)


def display_path(path: Path) -> str:
    """``path`` as the repository names it (``suites/...``)."""
    parts = path.resolve().parts
    return "/".join(parts[parts.index("suites") :]) if "suites" in parts else str(path)


def coverage_problems(
    rows: Iterable[ApiRow],
    surface: Iterable[str],
    torch: Version,
    table: Path = COVERAGE_FILE,
) -> list[str]:
    """What ``table`` gets wrong about a torch whose surface is ``surface``: names it does
    not list, and names it claims for this release that the release lacks."""
    rows = list(rows)
    listed = {name: row for row in rows for name in row.names}
    present = set(surface)
    problems = [
        f"{name}: public in torch {torch[0]}.{torch[1]} but in no row of {display_path(table)} "
        f"(add it with the cases that exercise it, or why it is out of scope or uncovered)"
        for name in sorted(present - set(listed))
    ]
    for name, row in sorted(listed.items()):
        if name not in present and release(row.since) <= torch and not row.build:
            problems.append(
                f"{name}: listed for torch {row.since} and later, but torch "
                f"{torch[0]}.{torch[1]} does not have it (fix its row's since)"
            )
    return problems
