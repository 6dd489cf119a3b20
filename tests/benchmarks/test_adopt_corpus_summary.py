"""The corpus table of benchmarks/adopt_torch_files.py: each difference between the harnesses
is named with both times, and a hang is called one, so the table shows what it cost."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "adopt_torch_files.py"


def _script():
    spec = importlib.util.spec_from_file_location("adopt_torch_files", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def _session(mode: str, wall: float, tests: dict) -> dict:
    return {"mode": mode, "wall_s": wall, "exit_code": 0, "tests": tests}


RESULT = {
    "file": "test_sample.py",
    "sessions": [
        _session(
            "torch",
            40.0,
            {
                "A::test_same": ["passed", 7.0, ""],
                "A::test_hangs_adopted": ["passed", 12.0, ""],
                "A::test_hangs_under_torch": ["failed", 300.0, "Timing out after 300 seconds"],
            },
        ),
        _session(
            "adopt",
            25.0,
            {
                "A::test_same": ["passed", 0.1, ""],
                "A::test_hangs_adopted": [
                    "failed",
                    20.1,
                    "rank 0 hung: still running at the 20.0 s deadline",
                ],
                "A::test_hangs_under_torch": ["passed", 0.2, ""],
            },
        ),
    ],
}


def test_each_difference_is_named_with_both_times_and_a_hang_is_called_one():
    row = _script().summary_row(RESULT)
    assert row["differences"] == [
        "A::test_hangs_adopted: passed (12.0 s) under torch's harness, failed (20.1 s, hung) "
        "adopted",
        "A::test_hangs_under_torch: failed (300.0 s, hung) under torch's harness, passed "
        "(0.2 s) adopted",
    ]
    assert (row["passed_torch"], row["passed_adopted"], row["ran_both"]) == (2, 2, 3)
    assert row["ran_both_torch_s"] == 319.0
    assert abs(row["ran_both_adopted_s"] - 20.4) < 1e-9


def test_the_summary_sums_the_files():
    table = _script().format_summary([RESULT, RESULT]).splitlines()
    assert table[-1].startswith("| **all** | 6 | 4 / 4 | 4 | 80.0 / 50.0 | 1.6x | 6 |")
