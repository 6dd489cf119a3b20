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


def _same_tests(mode: str, wall: float, outcome: str = "passed") -> dict:
    return _session(
        mode, wall, {"A::test_same": ["passed", 1.0, ""], "A::test_b": [outcome, 1, ""]}
    )


def test_a_file_with_close_walls_is_judged_on_the_medians_of_its_interleaved_pairs():
    result = {
        "file": "test_close.py",
        "sessions": [_same_tests("torch", 10.0), _same_tests("adopt", 11.0)],
        "repeats": [
            {"order": "adopt first", "adopt": _same_tests("adopt", 8.0),
             "torch": _same_tests("torch", 12.0)},
            {"order": "torch first", "torch": _same_tests("torch", 9.0),
             "adopt": _same_tests("adopt", 9.0, outcome="failed")},
        ],
    }  # fmt: skip
    row = _script().summary_row(result)
    assert (row["pairs"], row["wall_torch_s"], row["wall_adopted_s"]) == (3, 10.0, 9.0)
    assert row["pair_ratios"] == [10 / 11, 1.5, 1.0]
    # An outcome that differs in any pair is a difference, named with its pair.
    assert row["differences"] == [
        "A::test_b: passed (1.0 s) under torch's harness, failed (1.0 s) adopted (pair 3 of 3)"
    ]
    line = _script().format_summary([result]).splitlines()[2]
    assert "| 10.0 / 9.0 (medians of 3 interleaved pairs) | 1.00x (0.91x, 1.50x, 1.00x) |" in line


def test_only_walls_closer_than_the_fraction_get_more_pairs():
    close = _script().close
    assert close(10.0, 11.0, 0.2) and close(11.0, 10.0, 0.2)
    assert not close(10.0, 12.5, 0.2) and not close(100.0, 10.0, 0.2)
