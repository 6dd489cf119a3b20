"""A failure to start ranks or join their group, before the test body: reported as the
machine's failure, retried once on a fresh pool, and the retry shown; a failure inside the
body is never retried."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from distconform.harness.controller.failure_report import verdict_headline
from distconform.harness.controller.pools import PoolKey, PoolManager, PoolStartFailure
from distconform.harness.shared.outcomes import (
    INFRASTRUCTURE_HEADLINE,
    Outcome,
    RankResult,
    RunResult,
)
from distconform.harness.shared.task import RankTask

ROOT = Path(__file__).resolve().parents[2]
KEY = PoolKey("process", 2, "gloo", "cpu", 1)
TASK = RankTask("t::x", b"", (), (), seed=0, pg_timeout=10.0)
CONNECT_FAILED = "Gloo connectFullMesh failed: Connection closed by peer"


class ScriptedPool:
    """A pool whose start fails while ``starts_failing`` says so, and whose run returns
    ``outcome`` on every rank."""

    launcher = "process"

    def __init__(self, fails_to_start: bool, outcome: Outcome) -> None:
        self.broken = False
        self.fails_to_start = fails_to_start
        self.outcome = outcome
        self.runs = 0

    def start(self, timeout: float | None = None) -> None:
        if self.fails_to_start:
            raise PoolStartFailure(
                f"could not start 2 rank processes: rank 1 failed ({CONNECT_FAILED})",
                [RankResult(0, Outcome.ABORTED_BY_PEER), RankResult(1, Outcome.FAILED)],
            )

    def alive(self) -> bool:
        return True

    def run(self, task: RankTask, deadline: float, peer_grace: float) -> RunResult:
        self.runs += 1
        now = time.monotonic()
        results = [
            RankResult(rank, self.outcome, error_type="AssertionError", error_message="body")
            if self.outcome is Outcome.FAILED
            else RankResult(rank, self.outcome)
            for rank in range(2)
        ]
        return RunResult(results, seed=0, deadline=deadline, started_at=now, finished_at=now)

    def close(self, timeout: float = 10.0) -> None:
        pass

    def kill(self) -> None:
        pass


def manager_of(*pools: ScriptedPool) -> tuple[PoolManager, list[ScriptedPool]]:
    made: list[ScriptedPool] = []
    queue = list(pools)

    def factory(key: PoolKey) -> ScriptedPool:
        made.append(queue.pop(0))
        return made[-1]

    return PoolManager(factory), made


def test_a_start_failure_is_retried_once_on_a_fresh_pool_and_says_so():
    manager, made = manager_of(
        ScriptedPool(fails_to_start=True, outcome=Outcome.PASSED),
        ScriptedPool(fails_to_start=False, outcome=Outcome.PASSED),
    )
    run = manager.run(KEY, TASK, deadline=10.0, peer_grace=1.0)
    assert len(made) == 2 and made[1].runs == 1
    assert run.ok and run.infrastructure_failure is None
    assert CONNECT_FAILED in run.infrastructure_retry
    assert any("retried on a fresh pool" in note for note in run.harness_notes)


def test_a_second_start_failure_is_reported_as_infrastructure_not_retried_again():
    manager, made = manager_of(
        ScriptedPool(fails_to_start=True, outcome=Outcome.PASSED),
        ScriptedPool(fails_to_start=True, outcome=Outcome.PASSED),
    )
    run = manager.run(KEY, TASK, deadline=10.0, peer_grace=1.0)
    assert len(made) == 2
    assert not run.ok
    assert verdict_headline(run).startswith(f"{INFRASTRUCTURE_HEADLINE}: could not start")
    assert any(note.startswith("first attempt:") for note in run.harness_notes)


@pytest.mark.parametrize("outcome", [Outcome.FAILED, Outcome.PASSED])
def test_a_run_whose_ranks_started_is_never_retried(outcome):
    manager, made = manager_of(ScriptedPool(fails_to_start=False, outcome=outcome))
    run = manager.run(KEY, TASK, deadline=10.0, peer_grace=1.0)
    assert len(made) == 1 and made[0].runs == 1
    assert run.infrastructure_retry is None and run.infrastructure_failure is None
    assert run.ok is (outcome is Outcome.PASSED)


SESSION_TEST = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.world_size(2)
def test_sum(rank_ctx):
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2
"""


def test_a_session_shows_the_retry_in_its_summary_and_junit(pytester, monkeypatch):
    pytester.makepyfile(test_retry=SESSION_TEST)
    # the launcher module is tests.harness.flaky_start_launcher, from this checkout
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    result = pytester.runpytest_subprocess(
        "-p", "tests.harness.flaky_start_launcher", "--launcher", "flaky-start",
        "--junitxml", "junit.xml", "-p", "no:cacheprovider",
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*1 distributed test(s) retried after an infrastructure failure*",
            "test_retry.py::test_sum*first attempt: could not start 2 rank processes*scripted*",
        ]
    )
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="infrastructure_retry"' in junit and "scripted" in junit


def test_a_failing_body_is_not_retried_in_a_session(pytester):
    pytester.makepyfile(
        test_body="""
import pytest

@pytest.mark.world_size(2)
def test_fails(rank_ctx):
    assert rank_ctx.rank == 0, "rank 1 disagrees"
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "after an infrastructure failure" not in result.stdout.str()
