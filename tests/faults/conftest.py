"""Collects the fault battery's table and prints it at the end of the session.

Set ``DISTCONFORM_FAULT_TABLE=path`` to also write it as Markdown (for docs/results/reliability.md).
"""

from __future__ import annotations

import os

_ROWS: list[tuple[str, str, int, str, float]] = []


def record_row(fault: str, launcher: str, world_size: int, outcome: str, seconds: float) -> None:
    _ROWS.append((fault, launcher, world_size, outcome, seconds))


def fault_table() -> list[str]:
    lines = ["| fault | launcher | ws | reported as | seconds |", "|---|---|---|---|---|"]
    for fault, launcher, world_size, outcome, seconds in sorted(_ROWS):
        lines.append(f"| {fault} | {launcher} | {world_size} | {outcome} | {seconds:.2f} |")
    return lines


def pytest_terminal_summary(terminalreporter) -> None:
    if not _ROWS:
        return
    terminalreporter.write_sep("=", "fault battery")
    for line in fault_table():
        terminalreporter.write_line(line)
    path = os.environ.get("DISTCONFORM_FAULT_TABLE")
    if path:
        with open(path, "w") as handle:
            handle.write("\n".join(fault_table()) + "\n")
