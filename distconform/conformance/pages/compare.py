"""The page of ``python -m distconform conformance compare --html``: the changes between runs.

One section per compared run: both headlines, what differs in how the runs were made, then
one row per changed test with its status on each side; the row expands to the new side's
failure, ranks and reproduce command (the same row as on the run's own page).
"""

from __future__ import annotations

from distconform.conformance.compare import Comparison
from distconform.conformance.pages.html import badge, esc, page, table
from distconform.conformance.pages.run import case_row
from distconform.conformance.statuses import percent_text

GENERATOR = "distconform conformance compare"


def render_comparisons(comparisons: list[Comparison], command: str) -> str:
    failures = sum(len(c.new_failures) for c in comparisons)
    verdict = (
        f'<p class="banner bad" id="verdict">{failures} new '
        f"{'FAIL' if failures == 1 else 'FAILs'}</p>"
        if failures
        else '<p class="banner good" id="verdict">No new FAIL</p>'
    )
    sections = [_comparison_section(index, c) for index, c in enumerate(comparisons)]
    body = "\n".join(
        [
            "<h1>Conformance: what changed</h1>",
            verdict,
            f'<p class="muted">Made by <code>{esc(command)}</code></p>',
            *sections,
        ]
    )
    return page("Conformance: what changed", body, generator=GENERATOR)


def _comparison_section(index: int, comparison: Comparison) -> str:
    baseline, other = comparison.baseline, comparison.other
    parts = [
        f'<h2 id="comparison-{index}">{esc(other.label)}</h2>',
        table(
            ["", "run", "pass rate", "tests"],
            [
                [
                    "baseline",
                    esc(baseline.label),
                    esc(percent_text(baseline.percent())),
                    str(len(baseline.tests)),
                ],
                [
                    "this run",
                    esc(other.label),
                    esc(percent_text(other.percent())),
                    str(len(other.tests)),
                ],
            ],
        ),
    ]
    context = comparison.environment_changes()
    if context:
        parts.append("<ul>" + "".join(f"<li>{esc(line)}</li>" for line in context) + "</ul>")
    if not comparison.changes and not comparison.new_stale_entries:
        parts.append("<p>No test changed its outcome.</p>")
        return "\n".join(parts)
    rows = []
    for change in comparison.changes:
        status = change.after_status
        rows.append(
            f'<tr class="change" data-kind="{esc(change.kind)}" data-nodeid="{esc(change.nodeid)}">'
            f"<td>{badge(status if status != '-' else 'none', change.kind)}</td>"
            f"<td>{_status(change.before_status)}</td><td>{_status(change.after_status)}</td>"
            f"<td><code>{esc(change.nodeid)}</code></td></tr>"
        )
    for entry in comparison.new_stale_entries:
        rows.append(
            '<tr class="change" data-kind="stale expectation">'
            f"<td>{badge('XPASS', 'stale expectation')}</td><td>-</td><td>-</td>"
            f"<td><code>{esc(entry.id)}</code> selects no test "
            f"({esc(entry.file)}:{esc(entry.line)})</td></tr>"
        )
    parts.append(
        "<table><thead><tr><th>change</th><th>baseline</th><th>this run</th><th>test</th>"
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )
    shown = [c for c in comparison.changes if c.after is not None and c.after.status != "PASS"]
    if shown:
        parts.append("<h3>This run's side of each change</h3>")
        parts.extend(case_row(change.after, other) for change in shown)
    return "\n".join(parts)


def _status(status: str) -> str:
    return "-" if status == "-" else badge(status)
