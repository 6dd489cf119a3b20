"""The case catalogues: ``docs/cases.md`` rendered from the implementation's case table
(``suites/cases.toml``) and ``docs/backend-cases.md`` from the backend suite's
(``suites/backend/cases.toml``).

``python -m distconform.suites.catalogue`` writes both; ``python -m distconform.suites.catalogue
--check`` exits non-zero when the committed file differs from what the table renders to
(``tests/suites/test_catalogue.py`` runs the same check). The table is read like the suites read it
(:func:`distconform.suites.cases.read_cases`: known capabilities, a description on every row), so a
row without a description fails here too.

Cases are grouped by the ``# --- area ---`` comment lines of the table, in table order; for each
the catalogue gives its description, the upstream test it mirrors, its world sizes, the
capabilities it needs (also per grid value), what a CPU run does with it and the suite function
that implements it (found by reading the module for ``@conformance("<id>")``, without importing
it). The profiles come first, the generated one-capability extensions included, then the
public API coverage (``suites/coverage/*.toml``, one table per API family the suites claim, and
``suites/backend/api_coverage.toml``).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from distconform.suites.api_coverage import BACKEND_COVERAGE_FILE, FAMILIES, ApiRow, parse_coverage
from distconform.suites.cases import (
    BACKEND,
    BACKEND_CASES_FILE,
    CASES_FILE,
    IMPLEMENTATION,
    LAUNCHERS,
    Case,
    Profile,
    known_capabilities,
    parse_profiles,
    read_cases,
    with_extensions,
)

SUITES_DIR = Path(__file__).resolve().parent
REPO_ROOT = SUITES_DIR.parents[1]
CATALOGUE_FILE = REPO_ROOT / "docs" / "cases.md"
BACKEND_CATALOGUE_FILE = REPO_ROOT / "docs" / "backend-cases.md"
#: subject -> (its case table, its catalogue).
CATALOGUES = {
    IMPLEMENTATION: (CASES_FILE, CATALOGUE_FILE),
    BACKEND: (BACKEND_CASES_FILE, BACKEND_CATALOGUE_FILE),
}
#: How each catalogue names what it tests and where its capabilities are listed.
_SUBJECT_WORDS = {
    IMPLEMENTATION: (
        "implementation",
        "`distconform.impl.api.KNOWN_CAPABILITIES`",
        "suites/cases.toml",
    ),
    BACKEND: (
        "backend",
        "`suites/backend_capabilities.py`, declared per backend in "
        "`suites/backend/declarations/<backend>.toml`",
        "suites/backend/cases.toml",
    ),
}
COMMAND = "python -m distconform.suites.catalogue"

_AREA_LINE = re.compile(r"^# -{3} (?P<title>.+?) -*$")
_CASE_LINE = re.compile(r"""^\[case\.(?P<quote>["'])(?P<id>.+?)(?P=quote)\]""")
OTHER_AREA = "other cases"


def case_areas(text: str) -> dict[str, str]:
    """Each case id's area: the title of the last ``# --- title ---`` line above its row."""
    areas: dict[str, str] = {}
    area = OTHER_AREA
    for line in text.splitlines():
        if match := _AREA_LINE.match(line):
            area = match.group("title")
        elif match := _CASE_LINE.match(line):
            areas[match.group("id")] = area
    return areas


def conformance_functions(module: Path) -> dict[str, str]:
    """``case id -> function name`` for the functions of ``module`` decorated
    ``@conformance("<id>")`` (read from the source; nothing is imported)."""
    tree = ast.parse(module.read_text(), filename=str(module))
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for decorator in node.decorator_list:
            if (
                isinstance(decorator, ast.Call)
                and isinstance(decorator.func, ast.Name)
                and decorator.func.id == "conformance"
                and decorator.args
                and isinstance(decorator.args[0], ast.Constant)
                and isinstance(decorator.args[0].value, str)
            ):
                found[decorator.args[0].value] = node.name
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`"


def _implementation(row: Case, suites_dir: Path) -> str:
    if not row.suite:
        return "not implemented (recorded only)"
    module = suites_dir / f"{row.suite}.py"
    if not module.is_file():
        raise ValueError(f"case {row.case_id!r}: suite module {module} does not exist")
    function = conformance_functions(module).get(row.case_id)
    if function is None:
        raise ValueError(
            f"case {row.case_id!r}: {module.name} has no function decorated "
            f"@conformance({row.case_id!r})"
        )
    return f"`suites/{row.suite}.py::{function}`"


def _world_sizes(row: Case) -> str:
    text = ", ".join(str(size) for size in row.world_sizes)
    if row.launchers != LAUNCHERS:
        text += f" ({', '.join(sorted(row.launchers))} launcher only)"
    return text


def _capabilities(row: Case) -> str:
    if row.only_undeclared:
        parts = ["one item per capability the implementation does not declare"]
    else:
        parts = [", ".join(_code(cap) for cap in row.requires) or "none"]
    for token, extra in row.param_requires.items():
        parts.append(f"items with {_code(token)} need {', '.join(_code(cap) for cap in extra)}")
    return "; ".join(parts)


def _upstream(row: Case) -> str:
    """The upstream test's dotted name as code, any note after it as text."""
    match = re.fullmatch(r"(?P<name>[A-Za-z_][\w.]*)(?P<note>.*)", row.upstream)
    if match is None:  # "(none: ...)"
        return row.upstream or "(none)"
    return _code(match.group("name")) + match.group("note")


def _strip_cpu(reason: str) -> str:
    return reason.removeprefix("CPU:").strip()


def _cpu(row: Case) -> str:
    if not row.cpu:
        return f"skipped: {_strip_cpu(row.cpu_reason)}"
    if not row.cpu_skip:
        return "runs"
    skips = "; ".join(
        f"{_code(token)} skipped: {_strip_cpu(reason)}" for token, reason in row.cpu_skip.items()
    )
    return f"runs; {skips}"


def _profile_rows(profiles: Sequence[Profile]) -> list[str]:
    lines = [
        "| profile | required | capabilities | description |",
        "|---|---|---|---|",
    ]
    for profile in profiles:
        lines.append(
            "| "
            + " | ".join(
                [
                    _code(profile.name),
                    "yes" if profile.required else "no",
                    ", ".join(_code(cap) for cap in profile.capabilities),
                    _cell(" ".join(profile.description.split())),
                ]
            )
            + " |"
        )
    return lines


@dataclass(frozen=True)
class CoverageSection:
    """One coverage table as the catalogue shows it."""

    title: str
    scope: str
    table: Path
    rows: Sequence[ApiRow]


#: subject -> (title, what the table lists, its file) of each of its coverage tables.
COVERAGE_TABLES = {
    IMPLEMENTATION: [(family.title, family.scope, family.table) for family in FAMILIES],
    BACKEND: [
        (
            "c10d: `torch.distributed.distributed_c10d`",
            "Every public name of torch's c10d Python API "
            "(`torch.distributed.distributed_c10d.__all__`).",
            BACKEND_COVERAGE_FILE,
        )
    ],
}

_STATUSES = ("covered", "out of scope", "uncovered")

#: subject -> what its coverage tables promise and what holds them to it.
COVERAGE_INTRO = {
    IMPLEMENTATION: "Every public name of the APIs the suites claim, in the releases distconform "
    "supports, generated from the installed torch (`suites/api_surface.py`): each argument, "
    "field and method, and each value class of an argument whose annotation offers a choice "
    "(`fully_shard(reshard_after_forward=int)`, `StateDictOptions.strict=False`). "
    "`tests/suites/test_api_coverage.py` fails when the installed torch has a name no row lists "
    "or a row leaves uncovered. A covered name's cases are proven, not claimed: "
    "`tests/suites/test_parameter_mutants.py` runs each name's mutant (the argument dropped, the "
    "value replaced by another class, the setter doing nothing) on the cases' quick items and "
    "requires a failure.",
    BACKEND: "Every public name of torch's c10d Python API in the releases distconform "
    "supports. `tests/suites/test_api_coverage.py` fails when the installed torch has a public "
    "name no row lists.",
}


def _counts(rows: Sequence[ApiRow]) -> dict[str, int]:
    return {
        status: sum(len(row.names) for row in rows if row.status == status) for status in _STATUSES
    }


def _coverage_section(sections: Sequence[CoverageSection], subject: str) -> list[str]:
    lines = [
        "## Public API coverage",
        "",
        COVERAGE_INTRO[subject],
        "",
        "| table | names | covered | out of scope | uncovered |",
        "|---|---:|---:|---:|---:|",
    ]
    for section in sections:
        counts = _counts(section.rows)
        link = f"[{section.title}](#{_anchor(section.title)})"
        total = sum(counts.values())
        lines.append(
            f"| {_cell(link)} | {total} | {counts['covered']} | {counts['out of scope']} "
            f"| {counts['uncovered']} |"
        )
    lines.append("")
    for section in sections:
        lines += [
            f"### {section.title}",
            "",
            f"{section.scope} From `{_display(section.table)}`.",
            "",
            "| names | since | status | cases, or why not |",
            "|---|---|---|---|",
        ]
        for row in section.rows:
            if row.cases:
                why = ", ".join(_code(case) for case in row.cases)
            else:
                why = row.out_of_scope or row.uncovered
            names_cell = ", ".join(_code(name) for name in row.names)
            status = row.status if row.cases else f"**{row.status}**"
            since = f"{row.since} ({row.build})" if row.build else row.since
            cells = (names_cell, since, status, why)
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
        lines.append("")
    return lines


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def render(
    text: str,
    cases: dict[str, Case],
    *,
    suites_dir: Path = SUITES_DIR,
    subject: str = IMPLEMENTATION,
    coverage: Sequence[CoverageSection] = (),
) -> str:
    """The catalogue for the table ``text`` whose parsed cases are ``cases``, with the
    public API coverage tables ``coverage``."""
    known = known_capabilities(subject)
    profiles = with_extensions(parse_profiles(text, known_capabilities=known), known)
    who, capability_list, table = _SUBJECT_WORDS[subject]
    title = "Backend case catalogue" if subject == BACKEND else "Conformance case catalogue"
    areas = case_areas(text)
    grouped: dict[str, list[Case]] = {}
    for case_id, row in cases.items():
        grouped.setdefault(areas.get(case_id, OTHER_AREA), []).append(row)

    lines = [
        f"<!-- Generated from {table} by `{COMMAND}`; do not edit by hand. -->",
        "",
        f"# {title}",
        "",
        f"Every conformance case of the {who} suites: {len(cases)} cases, one per row of "
        f"`{table}`, grouped by area. Edit the table, then run "
        f"`{COMMAND}` to regenerate this file; `{COMMAND} --check` (and "
        "`tests/suites/test_catalogue.py`) fails while it is out of date.",
        "",
        "Columns of the case tables:",
        "",
        "- **upstream**: the upstream PyTorch test the case mirrors, or `(none: ...)` for a "
        "behaviour upstream leaves untested.",
        "- **world sizes**: one pytest item per size; grid points outside the case's `fast` "
        'patterns run only in the slow run (`-m "slow or not slow"`).',
        f"- **capabilities**: what the {who} must declare "
        f"({capability_list}); an item needing one it does not declare is skipped "
        "`UNSUPPORTED`. A grid value (a token of the item's parameter id) can add more.",
        "- **CPU**: what a `--device cpu` run does with the case's items (`CPU:` skips).",
        '- **implemented by**: the suite function decorated `@conformance("<case id>")`.',
        "",
        "## Profiles",
        "",
        "A case item belongs to a required profile when every capability it needs is one of the "
        "profile's (or it needs none), otherwise to the extension named after each other "
        "capability it needs. Every capability no profile of the table lists is an extension "
        "of its own.",
        "",
        *_profile_rows(profiles),
        "",
        *(_coverage_section(coverage, subject) if coverage else []),
        "## Cases",
        "",
    ]
    for area, rows in grouped.items():
        lines.append(f"- [{area}](#{_anchor(area)}) ({len(rows)})")
    lines.append("")
    for area, rows in grouped.items():
        lines += [
            f"### {area}",
            "",
            "| case | what it checks | upstream | world sizes | capabilities | CPU "
            "| implemented by |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            cells = [
                _code(row.case_id),
                row.description,
                _upstream(row),
                _world_sizes(row),
                _capabilities(row),
                _cpu(row),
                _implementation(row, suites_dir),
            ]
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def render_file(cases_file: Path = CASES_FILE, subject: str = IMPLEMENTATION) -> tuple[str, int]:
    """The catalogue for a case table file validated like the project's table (its suites are
    looked up in ``suites/``; with its public API coverage table), and its number of cases."""
    cases = read_cases(cases_file, subject)
    coverage = [
        CoverageSection(title, scope, table, _parse_table(table, cases))
        for title, scope, table in COVERAGE_TABLES[subject]
    ]
    return render(cases_file.read_text(), cases, subject=subject, coverage=coverage), len(cases)


def _parse_table(table: Path, cases: Mapping[str, Case]) -> list[ApiRow]:
    try:
        return parse_coverage(table.read_text(), cases)
    except ValueError as error:  # named by its own file, not the case table's
        raise ValueError(f"{_display(table)}: {error}") from None


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Render docs/cases.md from suites/cases.toml and docs/backend-cases.md "
        "from suites/backend/cases.toml.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the catalogue file is missing or out of date",
    )
    # One table and catalogue instead of the project's two (the tests' temporary files).
    parser.add_argument("--cases", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--subject", default=IMPLEMENTATION, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cases or args.output:
        default_cases, default_output = CATALOGUES[args.subject]
        jobs = [(args.subject, args.cases or default_cases, args.output or default_output)]
    else:
        jobs = [(subject, *files) for subject, files in CATALOGUES.items()]
    worst = 0
    for subject, cases_file, output in jobs:
        worst = max(worst, _catalogue(subject, cases_file, output, check=args.check))
    return worst


def _catalogue(subject: str, cases_file: Path, output: Path, *, check: bool) -> int:
    try:
        rendered, n_cases = render_file(cases_file, subject)
    except ValueError as error:  # tomllib.TOMLDecodeError included
        print(f"{_display(cases_file)}: {error}", file=sys.stderr)
        return 2
    if check:
        current = output.read_text() if output.is_file() else None
        if current != rendered:
            state = "is missing" if current is None else "is out of date"
            print(
                f"{_display(output)} {state} with {_display(cases_file)}: "
                f"run `{COMMAND}` and commit the result",
                file=sys.stderr,
            )
            return 1
        print(f"{_display(output)} is up to date")
        return 0
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(rendered)
    print(f"wrote {_display(output)} ({n_cases} cases)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
