"""A directory of past runs, read as a history: conformance reports and the step benchmarks
(``benchmarks/impl_step.py --out``) that sit alongside them, each in date order.

Conformance reports are recognised by their schema name, benchmark files by their shape
(``rows`` of world size, model and ratio), so a directory of CI artifacts can be given as it
is. A report this version cannot read is listed with the reason, never dropped silently.
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distconform.conformance.report import ConformanceReport, UnreadableReportError
from distconform.conformance.statuses import SCHEMA

_DATE_IN_NAME = re.compile(r"(\d{4}-\d{2}-\d{2})(?:[T_](\d{2})[:-]?(\d{2}))?")
COLLECTIVE_BYTES = ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "other_bytes")


@dataclass(frozen=True)
class StepCase:
    """One (world size, model, reshard_after_forward) row of a step benchmark."""

    label: str
    ratio: float | None
    ratio_ci95: tuple[float, float] | None
    aa_ratio: float | None
    peak_ratio: float | None
    #: Bytes one rank sent and received in the traced step, largest over ranks, per arm.
    bytes_per_rank: dict[str, int]
    expected_bytes: int | None


@dataclass(frozen=True)
class StepBenchmark:
    path: Path
    date: str
    cases: tuple[StepCase, ...]


@dataclass
class History:
    runs: list[ConformanceReport] = field(default_factory=list)
    benchmarks: list[StepBenchmark] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    def implementations(self) -> list[str]:
        """What the runs assessed, each once (:attr:`ConformanceReport.title`)."""
        return sorted({run.title for run in self.runs})

    def runs_of(self, implementation: str) -> list[ConformanceReport]:
        return [run for run in self.runs if run.title == implementation]


def collect(directory: str | Path) -> History:
    """Every JSON file under ``directory`` read once, and kept if it is a conformance report
    or a step benchmark."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UnreadableReportError(
            f"{directory}: not a directory: give the directory of past reports"
        )
    history = History()
    for path in sorted(directory.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # not ours to judge: a directory of artifacts holds other JSON
        if not isinstance(data, dict):
            continue
        if data.get("schema") == SCHEMA:
            try:
                history.runs.append(ConformanceReport.from_json(data, path))
            except UnreadableReportError as exc:
                history.unreadable.append(str(exc))
        else:
            benchmark = _step_benchmark(data, path)
            if benchmark is not None:
                history.benchmarks.append(benchmark)
    history.runs.sort(key=lambda run: (run.date, str(run.source)))
    history.benchmarks.sort(key=lambda b: (b.date, str(b.path)))
    return history


def _step_benchmark(data: dict[str, Any], path: Path) -> StepBenchmark | None:
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows or not all(_is_step_row(row) for row in rows):
        return None
    return StepBenchmark(path, _date_of(data, path), tuple(_step_case(row) for row in rows))


def _is_step_row(row: Any) -> bool:
    return isinstance(row, dict) and {"world_size", "model", "ratio"} <= row.keys()


def _date_of(data: dict[str, Any], path: Path) -> str:
    """The benchmark's own date, else one in the file name, else the file's modification
    time (UTC, ISO 8601 like the conformance reports)."""
    if isinstance(data.get("date"), str):
        return data["date"]
    found = _DATE_IN_NAME.search(path.name)
    if found:
        day, hour, minute = found.groups()
        return f"{day}T{hour or '00'}:{minute or '00'}:00Z"
    stamp = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


def _step_case(row: dict[str, Any]) -> StepCase:
    ratio = row.get("ratio") or {}
    ci = ratio.get("ci95")
    traffic = row.get("traffic") or {}
    bytes_per_rank = {
        arm: max(
            (sum(int(rank.get(key, 0)) for key in COLLECTIVE_BYTES) for rank in record["per_rank"]),
            default=0,
        )
        for arm, record in traffic.items()
        if isinstance(record, dict) and record.get("per_rank")
    }
    expected = row.get("expected_traffic") or {}
    expected_bytes = (
        sum(int(expected.get(key, 0)) for key in COLLECTIVE_BYTES) if expected else None
    )
    raf = row.get("raf")
    return StepCase(
        label=f"ws{row['world_size']} {row['model']} raf={raf}",
        ratio=ratio.get("median"),
        ratio_ci95=(float(ci[0]), float(ci[1])) if ci else None,
        aa_ratio=(row.get("aa_ratio") or {}).get("median"),
        peak_ratio=row.get("peak_ratio"),
        bytes_per_rank=bytes_per_rank,
        expected_bytes=expected_bytes,
    )
