"""Line charts as inline SVG: the history page's plots, with no plotting library.

A chart has one x position per run (evenly spaced, in date order: nightly runs are a
sequence, and gaps in the calendar say nothing about conformance), any number of series of
points (None where a run has no value), an optional band per series (a confidence
interval) and an optional horizontal reference line (1.0 for a ratio). Everything is drawn
in user units of a fixed view box, so the page scales it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from distconform.conformance.pages.html import esc

PALETTE = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#6e7781", "#bf3989")
WIDTH, HEIGHT = 720, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 190, 14, 40
_Scale = Callable[[float], float]


@dataclass
class Series:
    name: str
    values: Sequence[float | None]
    #: (low, high) per run, drawn as a shaded band behind the line; None where unknown.
    band: Sequence[tuple[float, float] | None] = field(default_factory=list)


def line_chart(
    series: Sequence[Series],
    x_labels: Sequence[str],
    *,
    y_label: str,
    y_range: tuple[float, float] | None = None,
    reference: float | None = None,
    y_format: str = "{:.2f}",
) -> str:
    """An SVG line chart; ``y_range`` defaults to the values' span with a margin."""
    count = len(x_labels)
    values = [v for s in series for v in s.values if v is not None]
    values += [edge for s in series for b in s.band if b is not None for edge in b]
    if reference is not None:
        values.append(reference)
    low, high = y_range if y_range is not None else _padded_span(values)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x_at(index: int) -> float:
        return LEFT + (plot_w / 2 if count <= 1 else plot_w * index / (count - 1))

    def y_at(value: float) -> float:
        return TOP + plot_h * (1 - (value - low) / (high - low))

    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{esc(y_label)}" xmlns="http://www.w3.org/2000/svg">',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#ffffff" '
        f'stroke="#d1d9e0"/>',
    ]
    for tick in _ticks(low, high):
        y = y_at(tick)
        parts.append(
            f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eaeef2"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{esc(y_format.format(tick))}</text>"
        )
    if reference is not None:
        y = y_at(reference)
        parts.append(
            f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="#57606a" stroke-dasharray="4 3"/>'
        )
    for index, label in enumerate(x_labels):
        if count > 12 and index % (count // 12 + 1):
            continue  # keep the axis readable; every point is still drawn
        parts.append(
            f'<text x="{x_at(index):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">'
            f"{esc(label)}</text>"
        )
    parts.append(
        f'<text x="14" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {TOP + plot_h / 2:.1f})">{esc(y_label)}</text>'
    )
    for number, one in enumerate(series):
        colour = PALETTE[number % len(PALETTE)]
        parts.extend(_band(one, colour, x_at, y_at))
        parts.extend(_line(one, colour, x_at, y_at))
        legend_y = TOP + 12 + 16 * number
        parts.append(
            f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 30}" y1="{legend_y - 4}" '
            f'y2="{legend_y - 4}" stroke="{colour}" stroke-width="2"/>'
            f'<text x="{WIDTH - RIGHT + 36}" y="{legend_y}">{esc(one.name)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _line(one: Series, colour: str, x_at: _Scale, y_at: _Scale) -> list[str]:
    parts = []
    run: list[str] = []
    for index, value in enumerate([*one.values, None]):
        if value is None:
            if len(run) > 1:
                parts.append(
                    f'<polyline fill="none" stroke="{colour}" stroke-width="2" '
                    f'points="{" ".join(run)}"/>'
                )
            run = []
            continue
        point = f"{x_at(index):.1f},{y_at(value):.1f}"
        run.append(point)
        parts.append(
            f'<circle cx="{x_at(index):.1f}" cy="{y_at(value):.1f}" r="3" fill="{colour}">'
            f"<title>{esc(one.name)}: {value:.4g}</title></circle>"
        )
    return parts


def _band(one: Series, colour: str, x_at: _Scale, y_at: _Scale) -> list[str]:
    points = [(i, b) for i, b in enumerate(one.band) if b is not None]
    if len(points) < 2:
        return [
            f'<line x1="{x_at(i):.1f}" x2="{x_at(i):.1f}" y1="{y_at(lo):.1f}" y2="{y_at(hi):.1f}" '
            f'stroke="{colour}" stroke-opacity="0.35" stroke-width="6"/>'
            for i, (lo, hi) in points
        ]
    upper = [f"{x_at(i):.1f},{y_at(hi):.1f}" for i, (_, hi) in points]
    lower = [f"{x_at(i):.1f},{y_at(lo):.1f}" for i, (lo, _) in reversed(points)]
    return [
        f'<polygon fill="{colour}" fill-opacity="0.15" stroke="none" '
        f'points="{" ".join(upper + lower)}"/>'
    ]


def _padded_span(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 1.0
    low, high = min(values), max(values)
    margin = (high - low) * 0.1 or abs(high) * 0.1 or 1.0
    return low - margin, high + margin


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    step = (high - low) / (count - 1)
    return [low + step * index for index in range(count)]
