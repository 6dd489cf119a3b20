"""The rank tests of this directory again, on the thread launcher (an inner pytest session).

There the tracer's wrappers are process-global and shared by the rank threads, the torch
function mode is per thread, and the threaded backend's listener adds what it executes:
the same counts, bytes, delays and schedules must come out.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RANK_TEST_MODULES = (
    "test_counts.py",
    "test_flight_coverage.py",
    "test_injection.py",
    "test_min_bytes.py",
    "test_schedule.py",
)


def test_the_rank_tests_pass_on_the_thread_launcher(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(REPO),
        "-c",
        str(REPO / "pyproject.toml"),
        "--launcher",
        "thread",
        "-k",
        "not accept_rewrites",  # spawns its own inner session on process ranks
        *(str(HERE / name) for name in RANK_TEST_MODULES),
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("error", 0) == 0, result.stdout.str()
    # CommDebugMode's cross-check is process-only: its two world sizes skip, nothing else.
    assert outcomes.get("skipped", 0) == 2, outcomes
    assert outcomes["passed"] >= 20, outcomes
