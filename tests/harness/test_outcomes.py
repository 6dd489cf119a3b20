"""Every way a rank can end, at world sizes 2 and 4, through the programmatic API."""

from __future__ import annotations

import signal

import pytest

from distconform.harness import Outcome, launch, run_on_ranks
from distconform.harness.controller.failure_report import DistributedFailure, render_failure
from tests.harness import rank_bodies

WORLD_SIZES = [2, 4]


@pytest.fixture(params=WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def world_size(request) -> int:
    return request.param


def test_values_come_back_from_every_rank(world_size):
    expected = world_size * (world_size + 1) / 2
    assert run_on_ranks(rank_bodies.all_reduce_rank_sum, world_size) == [expected] * world_size


def test_exception_on_one_rank_is_the_primary_failure(world_size):
    bad = world_size - 1
    run = launch(rank_bodies.raise_on, world_size, (bad,), peer_grace=0.5)
    primary = run.primary_failure()
    assert primary is not None and primary.rank == bad
    assert primary.outcome is Outcome.FAILED
    assert "deliberate failure on rank" in primary.traceback
    assert "raise ValueError" in primary.traceback
    # The traceback starts at the test body: the harness's frames that called it are dropped.
    assert "distconform/harness" not in primary.traceback, primary.traceback
    peers = [r for r in run.results if r.rank != bad]
    assert all(r.outcome is Outcome.ABORTED_BY_PEER for r in peers), run.results
    text = render_failure(run, context="ctx", reproducer="repro")
    # The root cause comes first; the peers only appear in the table.
    assert text.startswith(f"rank {bad} failed: ValueError: deliberate failure on rank {bad}")
    assert text.count("Traceback (most recent call last)") == 1


def test_the_same_error_on_every_rank_is_shown_once(world_size):
    run = launch(rank_bodies.raise_everywhere, world_size)
    assert all(r.outcome is Outcome.FAILED for r in run.results)
    text = render_failure(run, context="ctx", reproducer=None)
    assert text.count("Traceback (most recent call last)") == 1
    assert text.count("same error as rank") == world_size - 1


def test_os_exit_is_a_crash_with_its_exit_code(world_size):
    run = launch(rank_bodies.exit_on, world_size, (1, 3), peer_grace=0.5)
    crashed = run.results[1]
    assert crashed.outcome is Outcome.CRASHED
    assert crashed.exit_code == 3 and crashed.signal_name is None
    assert run.primary_failure() is crashed
    assert "exited with code 3" in render_failure(run, context="", reproducer=None)
    assert all(r.outcome is Outcome.ABORTED_BY_PEER for r in run.results if r.rank != 1)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV], ids=["SIGKILL", "SIGSEGV"])
def test_death_by_signal_names_the_signal(world_size, signum):
    run = launch(rank_bodies.signal_on, world_size, (0, int(signum)), peer_grace=0.5)
    crashed = run.results[0]
    assert crashed.outcome is Outcome.CRASHED
    assert crashed.signal_name == signum.name
    assert f"killed by {signum.name}" in render_failure(run, context="", reproducer=None)
    if signum == signal.SIGSEGV:
        # faulthandler wrote the Python stack of the faulting thread.
        assert "Segmentation fault" in crashed.stacks
        assert "signal_on" in crashed.stacks


def test_infinite_loop_is_reported_as_hung_with_stacks_within_the_deadline(world_size):
    deadline = 6.0
    run = launch(rank_bodies.loop_on, world_size, (0,), deadline=deadline)
    hung = run.results[0]
    assert hung.outcome is Outcome.HUNG
    assert "spin_forever" in hung.stacks and "loop_on" in hung.stacks
    # Every other rank either timed out in its collective (and says so) or was
    # stopped with its stacks: no rank is left without an account.
    for result in run.results[1:]:
        assert result.outcome is Outcome.ABORTED_BY_PEER or result.outcome is Outcome.FAILED
        assert result.stacks or result.traceback, result
    assert run.finished_at - run.started_at <= deadline + 10
    assert run.primary_failure() is hung


def test_inconsistent_skip_is_a_failure_naming_the_ranks(world_size):
    run = launch(rank_bodies.skip_on, world_size, ((0,),))
    assert run.inconsistent_skip and not run.ok
    with pytest.raises(DistributedFailure) as excinfo:
        run_on_ranks(rank_bodies.skip_on, world_size, ((0,),))
    others = ", ".join(str(r) for r in range(1, world_size))
    assert "inconsistent skip: ranks 0 skipped" in str(excinfo.value)
    assert f"but ranks {others} did not" in str(excinfo.value)


def test_a_skip_on_every_rank_is_a_skip(world_size):
    run = launch(rank_bodies.skip_on, world_size, (tuple(range(world_size)),))
    assert run.all_skipped and run.ok


def test_ranks_split_the_cores_and_share_the_seed(world_size):
    described = run_on_ranks(rank_bodies.describe_rank, world_size, seed=7)
    assert [d["rank"] for d in described] == list(range(world_size))
    assert {d["backend"] for d in described} == {"gloo"}
    assert {d["threads"] for d in described} == {d["threads"] for d in described[:1]}
    assert described[0]["omp"] == str(described[0]["threads"])
    # Seeded identically: every rank draws the same first number.
    assert len({d["random"] for d in described}) == 1
