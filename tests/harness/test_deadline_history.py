"""Deadlines from recorded durations: a test with a recorded run gets max(k x longest, floor),
one without gets the default, a deadline named for the test or the run wins, and a hang's
report says which deadline applied and why."""

from __future__ import annotations

import re
import time

import pytest

from distconform.harness.controller import deadline_history
from distconform.harness.controller.deadline_history import CACHE_KEY, DurationHistory
from distconform.harness.shared.outcomes import Outcome, RankResult, RunResult

SWITCHED = """
import os, time
import pytest
import torch.distributed as dist

@pytest.mark.world_size(2)
def test_switched(rank_ctx):
    if os.environ.get("HANG_NOW") == "1" and rank_ctx.rank == 0:
        while True:
            time.sleep(0.05)
    dist.barrier()
"""


class FakeCache:
    def __init__(self, stored=None):
        self.stored = dict(stored or {})

    def get(self, key, default):
        return self.stored.get(key, default)

    def set(self, key, value):
        self.stored[key] = value


def run_result(seconds: float, outcome: Outcome = Outcome.PASSED) -> RunResult:
    ranks = [
        RankResult(rank=r, outcome=outcome, started_at=100.0 + r, finished_at=100.0 + seconds)
        for r in range(2)
    ]
    return RunResult(
        results=ranks, started_at=99.0, finished_at=101.0 + seconds, seed=0, deadline=300.0
    )


def test_without_a_record_the_default_applies_and_with_one_k_times_it_or_the_floor():
    history = DurationHistory(FakeCache({CACHE_KEY: {"a::slow": 12.0, "a::fast": 0.5}}))
    assert history.deadline("a::new", 300.0) == (300.0, "the default: no recorded run of this test")
    seconds, why = history.deadline("a::slow", 300.0)
    assert seconds == deadline_history.MULTIPLIER * 12.0
    assert "longest recorded run (12.00 s)" in why
    assert history.deadline("a::fast", 300.0)[0] == deadline_history.FLOOR_S


def test_only_passing_runs_are_recorded_and_the_longest_is_kept():
    cache = FakeCache({CACHE_KEY: {"a::t": 5.0}})
    history = DurationHistory(cache)
    history.record("a::t", run_result(2.0))
    history.record("a::u", run_result(3.0))
    history.record("a::u", run_result(1.0))
    history.record("a::v", run_result(50.0, Outcome.FAILED))
    history.save()
    assert cache.stored[CACHE_KEY] == {"a::t": 5.0, "a::u": 3.0}


def test_without_a_cache_nothing_is_kept():
    history = DurationHistory(None)
    history.record("a::t", run_result(2.0))
    history.save()
    assert history.deadline("a::t", 300.0)[0] == 300.0


def test_a_hang_after_a_recorded_run_costs_the_adapted_deadline_and_says_so(pytester, monkeypatch):
    pytester.makepyfile(test_switched=SWITCHED)
    pytester.makeini("[pytest]\ndist_deadline_floor = 3\n")
    first = pytester.runpytest_subprocess()
    first.assert_outcomes(passed=1)
    assert pytester.path.joinpath(".pytest_cache").exists()
    monkeypatch.setenv("HANG_NOW", "1")
    started = time.monotonic()
    hung = pytester.runpytest_subprocess()
    elapsed = time.monotonic() - started
    hung.assert_outcomes(failed=1)
    text = hung.stdout.str()
    assert re.search(r"deadline 3 s: 10 x its longest recorded run \([0-9.]+ s\)", text), text
    assert elapsed < 60, "the default 300 s deadline applied"


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_a_deadline_named_for_the_run_wins_over_the_record(pytester, monkeypatch):
    pytester.makepyfile(test_switched=SWITCHED)
    pytester.makeini("[pytest]\ndist_deadline_floor = 3\n")
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    monkeypatch.setenv("HANG_NOW", "1")
    hung = pytester.runpytest_subprocess("--dist-deadline", "5")
    hung.assert_outcomes(failed=1)
    assert "deadline 5 s: named for the run (--dist-deadline or ini dist_deadline)" in (
        hung.stdout.str()
    )


class IniOnly:
    """A config with ini values and no cache (``-p no:cacheprovider``), without a session:
    an in-process session would close the shared fork server of the session running this."""

    def __init__(self, **ini: str) -> None:
        self.stash = pytest.Stash()
        self._ini = {"dist_deadline_multiplier": "10", "dist_deadline_floor": "30", **ini}

    def getini(self, name: str) -> str:
        return self._ini[name]


def test_without_pytests_cache_the_default_applies():
    assert deadline_history.history_of(IniOnly()).deadline("x::y", 300.0)[0] == 300.0


def test_a_bad_multiplier_is_a_usage_error():
    with pytest.raises(pytest.UsageError, match="dist_deadline_multiplier must be a positive"):
        deadline_history.history_of(IniOnly(dist_deadline_multiplier="0"))
