"""What the stream checker costs: the quick conformance run on the fake device with and
without it, in interleaved pairs.

    python benchmarks/stream_check_cost.py                  # 3 pairs, the reference
    python benchmarks/stream_check_cost.py --impl torch --pairs 2

Each pair runs ``python -m distconform conformance --quick --device fakeaccel`` once as is (the
checker on, the default) and once with ``--no-dist-stream-check``, alternating which goes
first, and compares the pytest session walls the runs print (the fake device's build and
interpreter start are outside them). The table gives every pair's ratio and their median;
``--json`` writes the measurements (``benchmarks/results/stream_check_cost-<date>.json``,
rendered into ``docs/results/benchmarks.md`` by ``benchmarks/tables.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
_SESSION_WALL = re.compile(r" in (?P<seconds>[0-9.]+)s")


def run_once(impl: str, checked: bool) -> dict[str, Any]:
    """One quick run: its session wall and its counts."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "distconform", "conformance", "--quick", "--device", "fakeaccel",
            "--impl", impl, "--out", out,
        ]  # fmt: skip
        if not checked:
            command.append("--no-dist-stream-check")
        completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        walls = _SESSION_WALL.findall(completed.stdout)
        if not walls:
            raise SystemExit(f"no session wall in the output of {command}:\n{completed.stdout}")
        report = json.loads((Path(out) / "conformance.json").read_text())
    failed = [
        {"nodeid": test["nodeid"], "message": (test.get("message") or "")[:400]}
        for test in report["tests"]
        if test["status"] == "FAIL"
    ]
    counts = report["summary"]["counts"]
    return {"checked": checked, "session_s": float(walls[-1]), "counts": counts, "failed": failed}


def measure(impl: str, pairs: int) -> dict[str, Any]:
    rows = []
    for pair in range(pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        runs = {checked: run_once(impl, checked) for checked in order}
        row = {
            "pair": pair + 1,
            "first": "with" if order[0] else "without",
            "with_s": runs[True]["session_s"],
            "without_s": runs[False]["session_s"],
            "counts_with": runs[True]["counts"],
            "counts_without": runs[False]["counts"],
            # A failure makes a wall meaningless (a hang waits out its deadline): kept to say so.
            "failed_with": runs[True]["failed"],
            "failed_without": runs[False]["failed"],
        }
        row["ratio"] = row["with_s"] / row["without_s"]
        rows.append(row)
        print(format_row(row), flush=True)
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}, Python "
        f"{platform.python_version()}",
        "command": f"python -m distconform conformance --quick --device fakeaccel --impl {impl} "
        "[--no-dist-stream-check]",
        "impl": impl,
        "rows": rows,
        "median_ratio": statistics.median(clean)
        if (
            clean := [
                row["ratio"] for row in rows if not row["failed_with"] and not row["failed_without"]
            ]
        )
        else None,
    }


def format_row(row: dict[str, Any]) -> str:
    failures = len(row.get("failed_with", ())) + len(row.get("failed_without", ()))
    note = f" ({failures} failed: not comparable)" if failures else ""
    return (
        f"| {row['pair']} | {row['first']} | {row['with_s']:.1f} s | {row['without_s']:.1f} s "
        f"| {row['ratio']:.2f}{note} |"
    )


def format_table(data: dict[str, Any]) -> str:
    """The pairs, then the median ratio (``benchmarks/tables.py`` renders it)."""
    lines = [
        f"{data['command']}, {data['machine']}, {data['date']}:",
        "",
        "| pair | first | with the checker | without | ratio |",
        "|---:|---|---:|---:|---:|",
        *(format_row(row) for row in data["rows"]),
        "",
        f"median ratio {data['median_ratio']:.2f} over the pairs without a failure (the goal: at "
        "most 1.5)"
        if data["median_ratio"] is not None
        else "no pair without a failure: no ratio",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="reference")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the measurements here")
    options = parser.parse_args(argv)
    data = measure(options.impl, options.pairs)
    print(format_table(data))
    if options.json:
        options.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
