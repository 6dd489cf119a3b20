"""python -m distconform gpu-check: its judges, its limits and budget, and runs on a fake GPU.

The judges read artifacts written here by hand (a JUnit file, a conformance report), so each
verdict is checked against what the artifact says, both ways. The check itself runs on the
fake accelerator with one device (``FAKEACCEL_DEVICE_COUNT=1``), as it would meet one GPU: a
short smoke in the default run, every step in the slow set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distconform.harness.gpu_check import steps
from distconform.harness.gpu_check.cli import DEFAULT_BUDGET_S, TREE
from distconform.harness.gpu_check.runner import MIN_STEP_S, run_all, run_step
from distconform.harness.gpu_check.steps import (
    ERROR,
    FAIL,
    PASS,
    SKIPPED,
    TIMEOUT,
    Step,
    StepRun,
    Verdict,
)


def _run(folder: Path, returncode: int | None = 0) -> StepRun:
    return StepRun("step", folder, returncode, 1.0, False, folder / "log.txt")


def _junit(folder: Path, *cases: tuple[str, str, str, float]) -> None:
    body = []
    for name, outcome, message, seconds in cases:
        inner = {
            "passed": "",
            "failed": f'<failure message="{message}">{message}</failure>',
            "skipped": f'<skipped message="{message}"/>',
        }[outcome]
        body.append(f'<testcase classname="m" name="{name}" time="{seconds}">{inner}</testcase>')
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "junit.xml").write_text(
        f"<testsuites><testsuite name='pytest'>{''.join(body)}</testsuite></testsuites>"
    )


def test_pytest_judge_passes_only_when_something_ran_and_nothing_failed(tmp_path):
    _junit(tmp_path / "a", ("test_x[ws1]", "passed", "", 0.1), ("test_y[ws1]", "skipped", "", 0))
    assert steps.judge_pytest(_run(tmp_path / "a")).status == PASS
    _junit(tmp_path / "b", ("test_x[ws1]", "failed", "rank 0 failed", 0.1))
    assert steps.judge_pytest(_run(tmp_path / "b", 1)).status == FAIL
    _junit(tmp_path / "c", ("test_x[ws1]", "skipped", "needs an accelerator", 0))
    verdict = steps.judge_pytest(_run(tmp_path / "c"))
    assert verdict.status == FAIL and verdict.summary.startswith("nothing ran")
    assert steps.judge_pytest(_run(tmp_path / "missing", 3)).status == ERROR


def _conformance(folder: Path, counts: dict[str, int], complete: bool = True) -> None:
    report = folder / "report"
    report.mkdir(parents=True)
    tests = [{"nodeid": "suites/t.py::test_a[ws2]", "status": "FAIL", "message": "boom"}]
    (report / "conformance.json").write_text(
        json.dumps(
            {
                "complete": complete,
                "summary": {"counts": counts, "conformance_percent": 50.0},
                "verdict": {
                    "status": "NOT CONFORMANT" if counts.get("FAIL") else "CONFORMANT",
                    "line": "verdict: (as written by the run)",
                },
                "tests": tests if counts.get("FAIL") else [],
            }
        )
    )


def test_conformance_judge_reads_the_report_not_the_exit_status(tmp_path):
    _conformance(tmp_path / "ok", {"PASS": 9, "XFAIL": 1, "FAIL": 0})
    assert steps.judge_conformance(_run(tmp_path / "ok")).status == PASS
    _conformance(tmp_path / "red", {"PASS": 9, "FAIL": 1})
    verdict = steps.judge_conformance(_run(tmp_path / "red", 0))
    assert verdict.status == FAIL
    assert verdict.summary.startswith("verdict: (as written by the run); PASS 9, FAIL 1")
    assert verdict.details["verdict"] == "NOT CONFORMANT"
    assert verdict.details["failures"] == [{"test": "suites/t.py::test_a[ws2]", "message": "boom"}]
    _conformance(tmp_path / "cut", {"PASS": 9}, complete=False)
    assert steps.judge_conformance(_run(tmp_path / "cut")).status == FAIL
    _conformance(tmp_path / "empty", {"PASS": 0, "SKIP": 4})
    assert steps.judge_conformance(_run(tmp_path / "empty")).status == FAIL


def test_continuous_judge_needs_every_documented_outcome_and_adopted_a_rank(tmp_path):
    failure = "rank 0 failed: AssertionError: 0 != -1 : cannot be right [ws 1, process/nccl/cuda]"
    outcomes = {**steps.CONTINUOUS_EXPECTED}
    good = [(name, outcome, "", 1.0) for name, outcome in outcomes.items()]
    adopted = [(n, o, failure if o == "failed" else m, t) for n, o, m, t in good]
    _junit(tmp_path / "adopted", *adopted)
    verdict = steps.judge_continuous(adopted=True)(_run(tmp_path / "adopted"))
    assert verdict.status == PASS and "rank 0 failed" in verdict.summary
    torchs = [(n, o, "Process 0 exited with error code 10" if o == "failed" else m, t)
              for n, o, m, t in good]  # fmt: skip
    _junit(tmp_path / "torch", *torchs)
    assert steps.judge_continuous(adopted=False)(_run(tmp_path / "torch")).status == PASS
    # torch's wording is not the harness's report
    assert steps.judge_continuous(adopted=True)(_run(tmp_path / "torch")).status == FAIL
    not_poisoned = [(n, "passed" if o == "skipped" else o, m, t) for n, o, m, t in adopted]
    _junit(tmp_path / "no-pill", *not_poisoned)
    verdict = steps.judge_continuous(adopted=True)(_run(tmp_path / "no-pill"))
    assert verdict.status == FAIL
    assert "test_2_skipped_after_the_failure: passed, expected skipped" in verdict.summary
    refused = tmp_path / "refused"
    refused.mkdir()
    (refused / "log.txt").write_text(
        "$ python -m pytest\nERROR: --dist-adopt ... needs expecttest\n"
    )
    verdict = steps.judge_continuous(adopted=True)(_run(refused))
    assert (verdict.status, verdict.summary) == (ERROR, "ERROR: --dist-adopt ... needs expecttest")
    _junit(tmp_path / "missing", *adopted[1:])
    verdict = steps.judge_continuous(adopted=True)(_run(tmp_path / "missing"))
    assert "not run" in verdict.summary


def test_faults_judge_needs_a_named_failure_a_timely_hang_and_a_pass_after(tmp_path):
    deadline = steps.HANG_DEADLINE_S
    good = (
        ("test_fails_on_rank_0[ws1]", "failed", "rank 0 failed: a sum that cannot be right", 1),
        ("test_hangs_on_rank_0[ws1]", "failed", "rank 0 hung: stacks", deadline + 1),
        ("test_passes_after_the_failure_and_the_hang[ws1]", "passed", "", 1),
    )
    _junit(tmp_path / "good", *good)
    assert steps.judge_faults(_run(tmp_path / "good")).status == PASS
    slow_hang = (good[0], (good[1][0], "failed", "rank 0 hung", deadline + 100), good[2])
    _junit(tmp_path / "slow", *slow_hang)
    verdict = steps.judge_faults(_run(tmp_path / "slow"))
    assert verdict.status == FAIL and "to report" in verdict.summary
    anonymous = ((good[0][0], "failed", "AssertionError", 1), good[1], good[2])
    _junit(tmp_path / "anon", *anonymous)
    assert "name rank 0" in steps.judge_faults(_run(tmp_path / "anon")).summary


def _sleeper(name: str, seconds: float, wave: int = 1, needs: str | None = None) -> Step:
    # The child starts a grandchild, as pytest starts ranks: both must end at the limit.
    code = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep({seconds})']); "
        f"time.sleep({seconds})"
    )
    return Step(
        name,
        "sleeps",
        30,
        (sys.executable, "-c", code),
        lambda run: Verdict(PASS if run.returncode == 0 else FAIL, "slept"),
        wave=wave,
        needs=needs,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_step_past_its_limit_is_stopped_with_everything_it_started(tmp_path):
    started = time.monotonic()
    result = run_step(_sleeper("sleepy", 60), tmp_path, TREE, limit_s=1.0)
    assert result.verdict.status == TIMEOUT
    assert "1 s limit" in result.verdict.summary
    assert time.monotonic() - started < 20
    leftovers = subprocess.run(
        ["pgrep", "-f", "time.sleep(60)"], capture_output=True, text=True
    ).stdout.split()
    assert not [pid for pid in leftovers if _alive(int(pid))]


def test_steps_that_need_a_missing_file_or_more_budget_are_skipped(tmp_path):
    missing = run_step(_sleeper("absent", 0, needs="no/such/file.py"), tmp_path, TREE, 5)
    assert missing.verdict.status == SKIPPED and "no/such/file.py" in missing.verdict.summary
    # The first wave starts with MIN_STEP_S + 1 s left and spends 2 s: the second would start
    # with less than MIN_STEP_S and is skipped.
    results = run_all(
        [_sleeper("first", 2.0, wave=1), _sleeper("second", 0.1, wave=2)],
        tmp_path,
        TREE,
        budget_s=MIN_STEP_S + 1.0,
        progress=lambda line: None,
    )
    assert [r.verdict.status for r in results] == [PASS, SKIPPED]
    assert "budget" in results[1].verdict.summary


def test_steps_of_one_wave_run_together(tmp_path):
    started = time.monotonic()
    results = run_all(
        [_sleeper(f"s{i}", 2.0, wave=1) for i in range(3)],
        tmp_path,
        TREE,
        budget_s=60,
        progress=lambda line: None,
    )
    assert [r.verdict.status for r in results] == [PASS] * 3
    assert time.monotonic() - started < 5.5  # three 2 s sleeps side by side, not 6 s


def test_the_plan_has_every_step_of_the_issue_in_order():
    plan = steps.Plan(python=sys.executable, device="cuda", backend="nccl", shared_backend="x")
    built = steps.build_steps(plan, Path("/out"))
    assert [s.name for s in built][:2] == ["environment", "accelerator-tests"]
    longest_of_each_wave: dict[int, float] = {}
    for step in built:
        longest_of_each_wave[step.wave] = max(longest_of_each_wave.get(step.wave, 0), step.limit_s)
    # Every step gets its whole limit within the default budget (8 minutes).
    assert sum(longest_of_each_wave.values()) <= DEFAULT_BUDGET_S == 8 * 60
    shared = next(s for s in built if s.name == "conformance-torch-shared")
    assert "--dist-share-devices" in shared.argv and "2,4" in shared.argv
    assert [s.name for s in built][-2:] == ["adopt-continuous", "adopt-continuous-torch"]
    # torch's own worker processes never load a device distconform registers (the fake one).
    fake = steps.build_steps(steps.Plan(sys.executable, "fakeaccel", None, "x"), Path("/out"))
    assert [s.name for s in fake][-2:] == ["failure-and-hang", "adopt-continuous"]


ONE_FAKE_DEVICE = {**os.environ, "FAKEACCEL_DEVICE_COUNT": "1"}


def test_gpu_check_on_one_fake_device_writes_both_reports(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "distconform", "gpu-check", "--device", "fakeaccel", "--out",
         str(tmp_path), "--only", "environment,accelerator-tests"],
        cwd=TREE,
        env=ONE_FAKE_DEVICE,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr
    document = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["status"] for s in document["steps"]] == [PASS, PASS]
    assert document["environment"]["device_count"] == 1
    markdown = (tmp_path / "gpu-check.md").read_text()
    assert "| accelerator-tests | PASS |" in markdown


@pytest.mark.slow
def test_the_whole_check_passes_on_one_fake_device_within_its_budget(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "distconform", "gpu-check", "--device", "fakeaccel",
         "--out", str(tmp_path)],
        cwd=TREE,
        env=ONE_FAKE_DEVICE,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    document = json.loads((tmp_path / "gpu-check.json").read_text())
    statuses = {s["name"]: s["status"] for s in document["steps"]}
    assert set(statuses.values()) == {PASS}, (statuses, completed.stderr[-3000:])
    assert document["wall_s"] < DEFAULT_BUDGET_S
