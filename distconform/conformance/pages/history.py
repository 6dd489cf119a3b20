"""The page of ``python -m distconform conformance history DIR``: conformance over time.

For each implementation found: its pass rate per run (a chart), then the pass rate of every
feature in every run (a table coloured like the run page's matrix, one column per run, the
newest on the right). Then, when step benchmarks sit in the directory, the reference/torch
step-time ratio and the peak-memory ratio per benchmark case over time, and the latest
benchmark's bytes per rank next to the bytes the sharding needs at least.
"""

from __future__ import annotations

import math
from collections import Counter

from distconform.conformance.history import History, StepBenchmark
from distconform.conformance.pages.html import badge, esc, page, slug, table
from distconform.conformance.pages.svg import Series, line_chart
from distconform.conformance.report import ConformanceReport
from distconform.conformance.statuses import conformance_percent, percent_text, worst_status

GENERATOR = "distconform conformance history"


def render_history(history: History, source: str) -> str:
    parts = [
        "<h1>Conformance history</h1>",
        f'<p class="muted">{len(history.runs)} conformance runs and '
        f"{len(history.benchmarks)} step benchmarks from <code>{esc(source)}</code>.</p>",
    ]
    if history.unreadable:
        parts.append(
            '<p class="banner bad">Not read:</p><ul>'
            + "".join(f"<li>{esc(message)}</li>" for message in history.unreadable)
            + "</ul>"
        )
    for implementation in history.implementations():
        parts.append(_implementation_section(implementation, history.runs_of(implementation)))
    if not history.runs:
        parts.append("<p>No conformance report (conformance.json) was found.</p>")
    if history.benchmarks:
        parts.append(_benchmark_section(history.benchmarks))
    return page("Conformance history", "\n".join(parts), generator=GENERATOR)


def _short_date(date: str) -> str:
    """``2026-11-24T22:50:25Z`` as ``11-24 22:50`` (axis labels and column heads)."""
    return date[5:16].replace("T", " ") if len(date) >= 16 else date or "?"


def _implementation_section(implementation: str, runs: list[ConformanceReport]) -> str:
    dates = [_short_date(run.date) for run in runs]
    rates = [run.percent() for run in runs]
    # Nightly changes are a few tests in hundreds: a 0-100 axis would flatten them.
    lowest = min((rate for rate in rates if rate is not None), default=0.0)
    chart = line_chart(
        [Series(implementation, rates)],
        dates,
        y_label="pass rate (%)",
        y_range=(max(0.0, math.floor(lowest) - 5.0), 100.0),
        y_format="{:.1f}",
    )
    per_run = [run.counts_by_feature() for run in runs]
    features = sorted({feature for counts in per_run for feature in counts})
    head = ["feature", *(esc(d) for d in dates)]
    rows = []
    for feature in features:
        cells = [f"<strong>{esc(feature)}</strong>"]
        for counts in per_run:
            cells.append(_rate_cell(counts.get(feature, Counter())))
        rows.append(cells)
    totals = ["<strong>all</strong>"] + [_rate_cell(run.counts()) for run in runs]
    return "\n".join(
        [
            f'<h2 id="impl-{slug(implementation)}">{esc(implementation)}</h2>',
            chart,
            "<h3>Pass rate per feature</h3>",
            table(head, [*rows, totals], cls="history"),
        ]
    )


def _rate_cell(counts: Counter) -> str:
    status = worst_status(counts)
    if status is None:
        return '<span class="muted">·</span>'
    rate = conformance_percent(counts)
    text = percent_text(rate) if rate is not None else status
    return badge(status, text)


def _benchmark_section(benchmarks: list[StepBenchmark]) -> str:
    dates = [_short_date(b.date) for b in benchmarks]
    labels = sorted({case.label for b in benchmarks for case in b.cases})
    by_label = [{case.label: case for case in b.cases} for b in benchmarks]
    # One chart per world size: a dozen lines in one plot cannot be told apart.
    groups: dict[str, list[str]] = {}
    for label in labels:
        groups.setdefault(label.split()[0], []).append(label)
    charts = []
    for world_size, members in groups.items():
        ratio_series, peak_series = [], []
        for label in members:
            cases = [cases.get(label) for cases in by_label]
            ratio_series.append(
                Series(
                    label,
                    [c.ratio if c else None for c in cases],
                    [c.ratio_ci95 if c else None for c in cases],
                )
            )
            peak_series.append(Series(label, [c.peak_ratio if c else None for c in cases]))
        charts += [
            f"<h3>{esc(world_size)}</h3>",
            line_chart(ratio_series, dates, y_label="step time ratio", reference=1.0),
            line_chart(peak_series, dates, y_label="peak memory ratio", reference=1.0),
        ]
    latest = benchmarks[-1]
    arms = sorted({arm for case in latest.cases for arm in case.bytes_per_rank})
    rows = []
    for case in latest.cases:
        ci = case.ratio_ci95
        rows.append(
            [
                esc(case.label),
                _number(case.ratio),
                esc(f"{ci[0]:.3f} to {ci[1]:.3f}") if ci else "-",
                _number(case.aa_ratio),
                _number(case.peak_ratio),
                *(_mib(case.bytes_per_rank.get(arm)) for arm in arms),
                _mib(case.expected_bytes),
            ]
        )
    return "\n".join(
        [
            '<h2 id="benchmarks">Step benchmark: reference against torch</h2>',
            '<p class="muted">Per world size: the median paired step-time ratio reference / '
            "torch per case, with its 95 % interval, then the peak memory above the post-init "
            "baseline, reference / torch (below 1: the reference is faster or smaller).</p>",
            *charts,
            f"<h3>Latest benchmark ({esc(latest.date)}, {esc(latest.path.name)})</h3>",
            table(
                [
                    "case",
                    "ratio",
                    "95 % interval",
                    "A/A ratio",
                    "peak ratio",
                    *(f"MiB per rank, {esc(arm)}" for arm in arms),
                    "MiB per rank, least possible",
                ],
                rows,
                cls="benchmark",
            ),
        ]
    )


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"
