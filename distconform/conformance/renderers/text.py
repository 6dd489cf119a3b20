"""The lines of the report that Markdown and the terminal share: the run's header, the
table per feature and world size, the verdicts and the notable tests.

Each takes ``markdown`` where the two differ (bold names, list bullets, blank lines between
paragraphs); the rest is the same text in both.
"""

from __future__ import annotations

from collections import Counter

from distconform.conformance.report import ConformanceReport
from distconform.conformance.statuses import STATUSES, conformance_percent, percent_text
from distconform.extension import STREAM_SAFETY_HEADLINE
from distconform.suites.cases import BACKEND, IMPLEMENTATION


def header_lines(report: ConformanceReport) -> list[str]:
    env = report.environment
    subjects = report.subjects() or [IMPLEMENTATION]
    lines = []
    if IMPLEMENTATION in subjects:
        impl = env.get("implementation", {})
        capabilities = ", ".join(impl.get("capabilities", [])) or "none declared"
        built_on = (
            f"; built on {impl['built_on']}, whose recorded deviations it inherits"
            if impl.get("built_on")
            else ""
        )
        lines.append(
            f"implementation: {impl.get('name', '?')} (spec {impl.get('spec', '?')}); "
            f"capabilities: {capabilities}{built_on}"
        )
    if BACKEND in subjects:
        backend = env.get("backend_declaration", {})
        declared_in = backend.get("declaration") or "no declaration: every capability held"
        not_declared = ", ".join(backend.get("not_declared", {})) or "none"
        lines.append(
            f"backend under test: {backend.get('name', '?')} ({declared_in}); "
            f"{len(backend.get('capabilities', []))} capabilities declared; not declared: "
            f"{not_declared}"
        )
    sizes = env.get("world_sizes") or "all"
    return [
        *lines,
        f"torch {env.get('torch_version')}, launcher {env.get('launcher')}, backend "
        f"{env.get('backend')}, device {env.get('device')}, world sizes {sizes}, "
        f"seed {env.get('seed')}, {env.get('date')}",
        f"expectations: {env.get('expectations') or 'none'}"
        + (
            f"; backend plug-ins: {', '.join(env['backend_plugins'])}"
            if env.get("backend_plugins")
            else ""
        ),
    ]


def table_lines(report: ConformanceReport) -> list[str]:
    header = ["feature", "ws", *STATUSES, "conformance"]
    body = []
    for feature, ws, row in report.rows():
        body.append(
            [
                feature,
                "-" if ws is None else str(ws),
                *(str(row[s]) for s in STATUSES),
                percent_text(conformance_percent(row)),
            ]
        )
    total = report.counts()
    body.append(
        ["**total**", "", *(str(total[s]) for s in STATUSES), percent_text(report.percent())]
    )
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [
            cell.ljust(widths[i]) if i < 2 else cell.rjust(widths[i])
            for i, cell in enumerate(cells)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|" + "|".join("-" * (w + 1) + ("-" if i < 2 else ":") for i, w in enumerate(widths)) + "|"
    )
    return [line(header), rule, *(line(cells) for cells in body)]


def verdict_lines(report: ConformanceReport, *, markdown: bool = False) -> list[str]:
    """The run's verdict, then each profile's and each suite module not run; empty when
    there is neither a profile nor a module not run (a project's own tests)."""
    run, profiles = report.verdicts()
    if not profiles and not report.not_run():
        return []
    bullet = "- " if markdown else "  "
    gap = [""] if markdown else []
    return [
        run.line(markdown=markdown),
        *gap,
        *(f"{bullet}{verdict.line(markdown=markdown)}" for verdict in profiles),
        *(f"{bullet}NOT RUN {r.nodeid}: {r.reason}" for r in report.not_run()),
    ]


def headline_lines(report: ConformanceReport, *, markdown: bool = False) -> list[str]:
    """The verdicts, then one line of figures per profile; empty without profiles."""
    results = report.profile_results()
    if not results:
        return verdict_lines(report, markdown=markdown)
    # Markdown needs blank lines between paragraphs and before a list.
    gap = [""] if markdown else []
    bullet = "- " if markdown else "  "
    stream_safety = stream_safety_line(report)
    return [
        *verdict_lines(report, markdown=markdown),
        "",
        "profiles (cases applied of those collected from the case table; pass rate over "
        "the applied ones):",
        *gap,
        *(f"{bullet}{result.line(markdown=markdown)}" for result in results),
        *([f"{bullet}{stream_safety}"] if stream_safety else []),
    ]


def stream_safety_line(report: ConformanceReport) -> str | None:
    """Whether the run checked stream safety, and how many tests failed on it."""
    state = report.environment.get("stream_check")
    device = report.environment.get("device")
    if state is None:
        return None
    if state == "unavailable":
        return (
            f"stream safety: not checked ({device} has no stream checker; --device fakeaccel "
            f"checks every kernel, wait and free)"
        )
    if state == "off":
        return "stream safety: not checked (--no-dist-stream-check)"
    failed = [r for r in report.tests if r.status == "FAIL" and STREAM_SAFETY_HEADLINE in r.message]
    return (
        f"stream safety: checked on {device} in every distributed test; {len(failed)} failed "
        f"on accesses no synchronisation orders"
    )


def notable_lines(report: ConformanceReport) -> list[str]:
    lines: list[str] = []
    for status, label in (
        ("FAIL", "failed"),
        ("XPASS", "passed although expected to fail (update the expectations file)"),
        ("XFAIL", "expected failures"),
    ):
        found = [r for r in report.tests if r.status == status]
        if not found:
            continue
        # A blank line first: CommonMark would continue the previous bullet list.
        lines += ["", f"{status} — {label}:"]
        for r in found:
            extra = f" [{r.category}]" if r.category else ""
            # An inherited deviation says whose it is first: not the vendor's own to fix.
            what = ": ".join(part for part in (r.inheritance_note, r.message) if part)
            lines.append(f"- `{r.nodeid}`{extra}: {what or r.reason}"[:400])
    retried = [r for r in report.tests if r.infrastructure_retry]
    if retried:
        lines += ["", "retried once on a fresh pool after an infrastructure failure:"]
        lines += [f"- `{r.nodeid}` ({r.status}): {r.infrastructure_retry}"[:400] for r in retried]
    unsupported = Counter(r.reason for r in report.tests if r.status == "UNSUPPORTED")
    if unsupported:
        lines += ["", "UNSUPPORTED:"]
        lines += [f"- {n} x {reason}" for reason, n in unsupported.most_common()]
    if report.stale:
        lines.append("")
    for entry in report.stale:
        lines.append(f"stale expectation: {entry.describe()}")
    return lines[1:] if lines[:1] == [""] else lines


def not_declared_lines(report: ConformanceReport) -> list[str]:
    """The backend's reasons for each capability it leaves out (Markdown bullets)."""
    if BACKEND not in report.subjects():
        return []
    reasons = report.subject_record(BACKEND).get("not_declared") or {}
    if not reasons:
        return []
    return [
        "",
        "Not declared by the backend:",
        "",
        *(f"- `{cap}`: {why}" for cap, why in reasons.items()),
    ]
