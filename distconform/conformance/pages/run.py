"""``conformance.html``: one conformance run as a page a vendor can publish.

Top to bottom: the headline (the verdicts, whose colours the page's banner takes, complete
or not, pass rate, profiles), the feature x world
size matrix coloured by outcome, the declared capabilities and the UNSUPPORTED cases, the
expectations applied with their evidence, the environment, then every test, grouped by
feature, each row expanding to its failure headline, per-rank outcomes, reproduce command
and failure text.

The matrix has one cell for every feature and every world size of the run; a cell no test
fills says so (``·``), so a missing world size is visible, not a gap in the grid.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Sequence
from typing import Any

from distconform.conformance.pages.html import badge, esc, page, slug, status_chips, table
from distconform.conformance.report import ConformanceReport, TestResult
from distconform.conformance.statuses import (
    APPLIED_STATUSES,
    PASS_RATE_DEFINITION,
    conformance_percent,
    percent_text,
    worst_status,
)

GENERATOR = "distconform conformance report"


def render_run(report: ConformanceReport) -> str:
    """The run's whole page."""
    title = f"Conformance: {report.title}"
    body = "\n".join(
        [
            f"<h1>{esc(title)}</h1>",
            _headline(report),
            _matrix_section(report),
            _capabilities_section(report),
            _expectations_section(report),
            _environment_section(report),
            _cases_section(report),
        ]
    )
    return page(title, body, generator=GENERATOR)


# --- headline --------------------------------------------------------------------------


def _headline(report: ConformanceReport) -> str:
    counts = report.counts()
    applied = sum(counts[s] for s in APPLIED_STATUSES)
    parts = []
    verdict, profile_verdicts = report.verdicts()
    if profile_verdicts:
        # The verdict opens the page and sets its colours: a rate alone reads as a grade.
        parts.append(
            f'<p class="banner {verdict.tone}" id="verdict">{esc(verdict.line())}</p>'
            '<ul class="verdicts">'
            + "".join(
                f'<li class="verdict {v.tone}">{esc(v.line())}</li>' for v in profile_verdicts
            )
            + "</ul>"
        )
    incomplete = report.incomplete_line()
    if incomplete:
        parts.append(f'<p class="banner bad" id="completeness">{esc(incomplete)}</p>')
    else:
        parts.append(
            f'<p class="banner neutral" id="completeness">Complete: all {len(report.tests)} '
            f"tests selected ran to their end.</p>"
        )
    parts.append(
        '<div class="headline">'
        f'<span class="rate" id="pass-rate">{esc(percent_text(report.percent()))}</span>'
        f'<span class="muted">pass rate {esc(PASS_RATE_DEFINITION)}</span>'
        f"<span>{applied} of {len(report.tests)} tests applied</span>"
        f"{status_chips(counts)}</div>"
    )
    results = report.profile_results()
    if results:
        rows = []
        for result, profile_verdict in zip(results, profile_verdicts, strict=True):
            profile = result.profile
            rate = (
                "no pass rate: capabilities missing"
                if result.withheld
                else percent_text(result.percent())
            )
            unsupported = "; ".join(
                f"{len(nodeids)} need {' + '.join(needs)}"
                for needs, nodeids in result.unsupported()
            )
            rows.append(
                [
                    f"<strong>{esc(profile.name)}</strong><br>"
                    f'<span class="muted">{esc(profile.description)}</span>',
                    f'<span class="verdict {profile_verdict.tone}">'
                    f"{esc(profile_verdict.status)}</span>",
                    "required" if profile.required else "extension",
                    f"{result.applied()} of {len(result.tests)}",
                    esc(rate),
                    esc(unsupported or "-"),
                ]
            )
        parts.append(
            table(
                ["profile", "verdict", "kind", "cases applied", "pass rate", "UNSUPPORTED"],
                rows,
                cls="profiles",
            )
        )
    return "\n".join(parts)


# --- matrix ----------------------------------------------------------------------------


def world_size_columns(tests: Sequence[TestResult]) -> list[int | None]:
    """The run's world sizes in order; None (tests without one) last."""
    sizes = {test.world_size for test in tests}
    return sorted(s for s in sizes if s is not None) + ([None] if None in sizes else [])


def _ws_text(world_size: int | None) -> str:
    return "no ws" if world_size is None else f"ws {world_size}"


def _matrix_section(report: ConformanceReport) -> str:
    columns = world_size_columns(report.tests)
    cells: dict[tuple[str, int | None], Counter] = {}
    for test in report.tests:
        cells.setdefault((test.feature, test.world_size), Counter())[test.status] += 1
    features = sorted({test.feature for test in report.tests})
    header = "".join(f'<th class="num">{esc(_ws_text(ws))}</th>' for ws in columns)
    rows = []
    for feature in features:
        row = [f'<th><a href="#feature-{slug(feature)}">{esc(feature)}</a></th>']
        for ws in columns:
            row.append(_matrix_cell(feature, ws, cells.get((feature, ws), Counter())))
        rows.append("<tr>" + "".join(row) + "</tr>")
    legend = " ".join(
        badge(status, text)
        for status, text in (
            ("PASS", "all pass"),
            ("FAIL", "a failure"),
            ("XFAIL", "expected failure"),
            ("XPASS", "unexpected pass"),
            ("UNSUPPORTED", "unsupported"),
            ("SKIP", "skipped"),
            ("none", "· no test"),
        )
    )
    return (
        '<h2 id="matrix">Features by world size</h2>'
        f'<p class="muted">A cell shows passes of the tests applied there and takes the colour '
        f"of its most telling outcome. {legend}</p>"
        f'<table class="matrix"><thead><tr><th>feature</th>{header}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _matrix_cell(feature: str, world_size: int | None, counts: Counter) -> str:
    status = worst_status(counts) or "none"
    ws_attr = "" if world_size is None else str(world_size)
    attributes = (
        f'class="cell s-{status}" data-feature="{esc(feature)}" data-ws="{ws_attr}" '
        f'data-status="{status}"'
    )
    if not counts:
        return f'<td {attributes} title="no test">·</td>'
    applied = sum(counts[s] for s in APPLIED_STATUSES)
    good = counts["PASS"] + counts["XPASS"]
    text = f"{good}/{applied}" if applied else status
    detail = ", ".join(f"{s} {n}" for s, n in counts.items() if n)
    rate = conformance_percent(counts)
    title = f"{feature}, {_ws_text(world_size)}: {detail}" + (
        f" ({percent_text(rate)})" if rate is not None else ""
    )
    anchor = f"#feature-{slug(feature)}"
    return f'<td {attributes} title="{esc(title)}"><a href="{anchor}">{esc(text)}</a></td>'


# --- capabilities, expectations, environment ------------------------------------------------


def _capabilities_section(report: ConformanceReport) -> str:
    env = report.environment
    parts = ['<h2 id="capabilities">Declared capabilities</h2>']
    impl = env.get("implementation") or {}
    if impl.get("name"):
        spec = f"<code>{esc(impl.get('spec'))}</code>"
        parts.append(_declares("Implementation", impl, spec))
        if impl.get("built_on"):
            parts.append(
                f'<p id="built-on">It is built on <strong>{esc(impl["built_on"])}</strong> '
                f"and inherits its recorded deviations (marked inherited below); its own "
                f"expectations win where both list a test.</p>"
            )
        if impl.get("error"):
            parts.append(f'<p class="banner bad">It failed to load: {esc(impl["error"])}</p>')
    backend = env.get("backend_declaration") or {}
    if backend.get("name"):
        source = esc(backend.get("declaration") or "no declaration file")
        parts.append(_declares("Backend", backend, source))
        reasons = backend.get("not_declared") or {}
        if reasons:
            parts.append(
                table(
                    ["not declared", "why"],
                    [[f"<code>{esc(c)}</code>", esc(why)] for c, why in reasons.items()],
                )
            )
    unsupported = [test for test in report.tests if test.status == "UNSUPPORTED"]
    if unsupported:
        by_reason: dict[str, list[TestResult]] = {}
        for test in unsupported:
            by_reason.setdefault(test.reason, []).append(test)
        rows = [
            [
                esc(reason),
                f'<span class="num">{len(tests)}</span>',
                "<br>".join(f"<code>{esc(t.nodeid)}</code>" for t in tests),
            ]
            for reason, tests in sorted(by_reason.items())
        ]
        parts.append("<h3>UNSUPPORTED cases</h3>")
        parts.append(table(["reason", "tests", "which"], rows, cls="unsupported"))
    else:
        parts.append('<p class="muted">No case was UNSUPPORTED.</p>')
    return "\n".join(parts)


def _declares(subject: str, record: dict[str, Any], source_html: str) -> str:
    declared = ", ".join(record.get("capabilities") or []) or "none"
    return (
        f"<p>{subject} <strong>{esc(record['name'])}</strong> ({source_html}) declares: "
        f"{esc(declared)}</p>"
    )


def _expectations_section(report: ConformanceReport) -> str:
    parts = ['<h2 id="expectations">Expectations applied</h2>']
    files = report.environment.get("expectations")
    parts.append(f"<p>Expectations files: {esc(files or 'none')}</p>")
    listed = [test for test in report.tests if test.status in ("XFAIL", "XPASS")]
    if listed:
        rows = []
        for test in listed:
            evidence = f'<a href="{esc(test.link)}">{esc(test.link)}</a>' if test.link else "-"
            rows.append(
                [
                    badge(test.status),
                    f"<code>{esc(test.nodeid)}</code>",
                    esc(test.category or "-"),
                    esc(test.inheritance_note or test.reason or "-"),
                    evidence,
                ]
            )
        parts.append(table(["status", "test", "category", "reason", "evidence"], rows))
    else:
        parts.append('<p class="muted">No test was expected to fail.</p>')
    if report.stale:
        rows = [
            [
                f"<code>{esc(entry.id)}</code>",
                esc(entry.kind),
                esc(f"{entry.file}:{entry.line}"),
            ]
            for entry in report.stale
        ]
        parts.append("<h3>Stale expectations (they select no test)</h3>")
        parts.append(table(["entry", "kind", "where"], rows))
    return "\n".join(parts)


_ENVIRONMENT_KEYS = (
    ("torch", "torch_version"),
    ("python", "python"),
    ("platform", "platform"),
    ("launcher", "launcher"),
    ("backend", "backend"),
    ("device", "device"),
    ("world sizes", "world_sizes"),
    ("seed", "seed"),
    ("date", "date"),
    ("backend plug-ins", "backend_plugins"),
)


def _environment_section(report: ConformanceReport) -> str:
    env = report.environment
    rows = [[esc(label), esc(_value_text(env.get(key)))] for label, key in _ENVIRONMENT_KEYS]
    command = env.get("command")
    if command:
        rows.append(["command", f"<code>{esc(shlex.join(map(str, command)))}</code>"])
    return '<h2 id="environment">Environment</h2>' + table(
        ["setting", "value"], rows, cls="environment"
    )


def _value_text(value: Any) -> str:
    if value is None or value == []:
        return "all" if value is None else "none"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


# --- every test --------------------------------------------------------------------------


def _cases_section(report: ConformanceReport) -> str:
    by_feature: dict[str, list[TestResult]] = {}
    for test in report.tests:
        by_feature.setdefault(test.feature, []).append(test)
    parts = [
        '<h2 id="cases">Tests</h2>',
        '<p class="muted">Click a row to see its outcome on every rank, the command that '
        "reproduces it and the failure text.</p>",
    ]
    for feature in sorted(by_feature):
        tests = sorted(
            by_feature[feature], key=lambda t: -1 if t.world_size is None else t.world_size
        )
        counts = Counter(test.status for test in tests)
        parts.append(f'<h3 id="feature-{slug(feature)}">{esc(feature)} {status_chips(counts)}</h3>')
        parts.extend(case_row(test, report) for test in tests)
    return "\n".join(parts)


def case_row(test: TestResult, report: ConformanceReport | None = None) -> str:
    """One expandable row: the status and id, then everything needed to act on it."""
    meta = [_ws_text(test.world_size), f"{test.duration_s:.2f} s"]
    if test.case:
        meta.append(f"case {test.case}")
    if test.inherited_from:
        meta.append(f"inherited from {test.inherited_from}")
    headline = (
        f' <span class="muted">{esc(_first_line(test.headline))}</span>'
        if test.status != "PASS" and test.headline
        else ""
    )
    summary = (
        f'{badge(test.status)} <code class="nodeid">{esc(test.nodeid)}</code> '
        f'<span class="muted">({esc(", ".join(meta))})</span>{headline}'
    )
    body = []
    if test.headline:
        body.append(f'<p class="failure-headline"><strong>{esc(test.headline)}</strong></p>')
    if test.inheritance_note:
        body.append(f'<p class="inherited">{esc(test.inheritance_note)}</p>')
    if test.category or test.link:
        link = f' <a href="{esc(test.link)}">{esc(test.link)}</a>' if test.link else ""
        body.append(f"<p>category: {esc(test.category or '-')}{link}</p>")
    if test.capabilities:
        body.append(f"<p>needs: {esc(', '.join(test.capabilities))}</p>")
    if test.ranks:
        rows = [[str(rank["rank"]), _rank_outcome(rank["outcome"])] for rank in test.ranks]
        body.append(table(["rank", "outcome"], rows, cls="ranks"))
    reproduce = test.reproduce or _fallback_reproducer(test, report)
    if test.status in ("FAIL", "XFAIL") and reproduce:
        body.append(
            f'<p>reproduce with:</p><pre class="reproduce"><code>{esc(reproduce)}</code></pre>'
        )
    if test.detail:
        body.append(
            f'<details class="detail"><summary>failure text</summary>'
            f"<pre>{esc(test.detail)}</pre></details>"
        )
    if not body:
        body.append('<p class="muted">Nothing more was recorded for this test.</p>')
    return (
        f'<details class="case" data-status="{esc(test.status)}" data-nodeid="{esc(test.nodeid)}">'
        f'<summary>{summary}</summary><div class="body">{"".join(body)}</div></details>'
    )


def _rank_outcome(outcome: str) -> str:
    status = {"passed": "PASS", "skipped": "SKIP", "xfailed": "XFAIL"}.get(outcome, "FAIL")
    return badge(status, outcome)


def _fallback_reproducer(test: TestResult, report: ConformanceReport | None) -> str:
    """For a test with no recorded command (not distributed, or an older report): pytest on
    its id with the run's implementation, backend, device and launcher."""
    args = ["python", "-m", "pytest", test.nodeid]
    env = report.environment if report is not None else {}
    spec = (env.get("implementation") or {}).get("spec")
    for option, value in (
        ("--impl", spec),
        ("--launcher", env.get("launcher")),
        ("--backend", env.get("backend")),
        ("--device", env.get("device")),
    ):
        if value:
            args += [option, str(value)]
    return shlex.join(args)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 160 else line[:157] + "..."
