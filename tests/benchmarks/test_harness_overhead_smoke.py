"""The overhead benchmark still runs end to end (a tiny count, our two fastest variants).

The numbers are not checked: a busy CI machine makes them meaningless. What is checked is
that every generated test passed and every measured column is there, so the script
cannot rot between the runs that fill the table in docs/results/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "harness_overhead.py"


@pytest.mark.slow  # runs the benchmark end to end (15 s): nightly
def test_benchmark_runs_and_reports_every_column(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    completed = subprocess.run(
        [
            sys.executable,
            str(BENCHMARK),
            "--tests",
            "3",
            "--variants",
            "warm,thread",
            "--json",
            str(out),
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "| distconform warm pool (--launcher process) | 3 |" in completed.stdout
    assert "| distconform thread launcher (--launcher thread) | 3 |" in completed.stdout
    data = json.loads(out.read_text())
    assert data["tests"] == 3
    assert [v["key"] for v in data["variants"]] == ["warm", "thread"]
    for variant in data["variants"]:
        assert variant["passed"] == 3
        assert len(variant["durations_ms"]) == 3
        for column in (
            "median_ms", "p90_ms", "first_ms", "sum_s", "wall_s", "one_test_session_s",
            "session_s",
        ):  # fmt: skip
            assert math.isfinite(variant[column]) and variant[column] > 0, column
        assert math.isfinite(variant["marginal_ms"])  # with 3 tests it may be below 0
        assert len(variant["one_test_walls_s"]) == len(variant["session_walls_s"]) == 1


def test_unknown_variant_is_a_usage_error() -> None:
    completed = subprocess.run(
        [sys.executable, str(BENCHMARK), "--variants", "warm,nope"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2
    assert "nope" in completed.stderr
