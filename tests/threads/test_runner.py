"""The thread runner: RNG isolation, failure release, deadlock and hang detection, cleanup."""

from __future__ import annotations

import random
import sys
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from distconform.harness import _torch_private, torch_api
from distconform.harness.shared.outcomes import Outcome, RunFailedError
from distconform.harness.threads import (
    CollectiveDeadlockError,
    CollectiveMismatchError,
    RankAbortedError,
    ThreadRunner,
    add_collective_listener,
    run_threaded,
)

# --- RNG isolation --------------------------------------------------------------------------


def _draw() -> tuple:
    return (torch.rand(3).tolist(), random.random(), float(np.random.rand()))


def _reference_draws(seed: int, steps: int) -> list:
    """What one process seeded with ``seed`` draws: the stream each rank must see."""
    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        return [_draw() for _ in range(steps)]
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


def _draws_between_collectives(reseed_by_rank: bool, chain: bool, steps: int) -> list:
    r, ws = dist.get_rank(), dist.get_world_size()
    if reseed_by_rank:
        torch.manual_seed(r)
        random.seed(r)
        np.random.seed(r)
    draws = []
    for _ in range(steps):
        if chain and r > 0:
            # Ranks run strictly one after another, in a different order than below.
            dist.recv(torch.zeros(1), src=r - 1)
        draws.append(_draw())
        if chain and r < ws - 1:
            dist.send(torch.zeros(1), dst=r + 1)
        # Every rank gives the baton up here, so generator states change hands.
        dist.all_reduce(torch.ones(1))
    return draws


@pytest.mark.parametrize("chain", [False, True], ids=["free", "chained"])
@pytest.mark.parametrize("ws", [2, 4])
def test_each_rank_owns_its_rng_stream(runners, ws, chain):
    _draw()  # move the caller's streams off the seed; the runs must leave them here
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    same = runners.run(ws, _draws_between_collectives, False, chain, 3)
    assert same == [_reference_draws(0, 3)] * ws  # seeded identically: identical streams
    distinct = runners.run(ws, _draws_between_collectives, True, chain, 3)
    assert distinct == [_reference_draws(r, 3) for r in range(ws)]
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


def _one_normal_per_turn(steps: int) -> list[float]:
    """Each rank draws one legacy normal per turn of the baton: the second of every pair
    comes from numpy's cached Gaussian, which changes no Mersenne Twister state."""
    draws = []
    rank = dist.get_rank()
    for _ in range(steps):
        if rank == 1:
            dist.recv(torch.zeros(1), src=0)
        draws.append(float(np.random.randn()))
        if rank == 0:
            dist.send(torch.zeros(1), dst=1)
            dist.recv(torch.zeros(1), src=1)
        else:
            dist.send(torch.zeros(1), dst=0)
    return draws


def test_a_cached_gaussian_used_up_between_hand_overs_is_not_drawn_twice(runners):
    reference = np.random.RandomState(0)
    expected = [float(reference.randn()) for _ in range(6)]
    assert runners.run(2, _one_normal_per_turn, 6) == [expected, expected]


def test_seed_option():
    result = run_threaded(lambda: _draw(), 2, seed=7)
    result.raise_on_failure()
    assert result.values == [_reference_draws(7, 1)[0]] * 2


def _log_interleaving(log: list) -> None:
    r = dist.get_rank()
    peer = r + 1 if r % 2 == 0 else r - 1
    for step in range(3):
        log.append((r, step, "issue"))
        work = dist.all_reduce(torch.ones(1), async_op=True)
        if (r + step) % 2:
            work.wait()
            log.append((r, step, "reduced"))
        p2p = (
            dist.isend(torch.ones(1), peer)
            if r % 2 == step % 2
            else dist.irecv(torch.ones(1), peer)
        )
        p2p.wait()
        log.append((r, step, "exchanged"))
        work.wait()
    log.append((r, "end"))


def test_interleaving_is_repeatable(runners):
    logs = []
    for _ in range(5):
        log: list = []
        runners.run(4, _log_interleaving, log)
        logs.append(log)
    assert logs[0][:4] == [(0, 0, "issue"), (1, 0, "issue"), (2, 0, "issue"), (3, 0, "issue")]
    assert all(log == logs[0] for log in logs)


# --- failures release the other ranks ------------------------------------------------------


def _fail_on(failing: int, after_first_collective: bool) -> None:
    if after_first_collective:
        dist.all_reduce(torch.ones(1))
    if dist.get_rank() == failing:
        raise ValueError("rank body failed on purpose")
    dist.all_reduce(torch.ones(1))  # the failed rank never joins this one
    dist.barrier()


@pytest.mark.parametrize("after_first_collective", [False, True])
def test_error_in_one_rank_releases_the_others(after_first_collective):
    with ThreadRunner(4, deadline=30.0) as runner:
        result = runner.run(_fail_on, 2, after_first_collective)
    assert not result.ok and not result.hung
    assert result.duration < 1.0
    failed = result.results[2]
    assert failed.outcome is Outcome.FAILED
    assert isinstance(failed.error, ValueError)
    assert "rank body failed on purpose" in failed.traceback
    assert result.primary_failure() is failed
    for peer in (0, 1, 3):
        run = result.results[peer]
        assert run.outcome is Outcome.ABORTED_BY_PEER, result.describe()
        assert isinstance(run.error, RankAbortedError)
        assert "aborted because rank 2 failed: ValueError" in str(run.error)
        assert run.finished_at - failed.finished_at < 1.0
    with pytest.raises(RunFailedError, match="rank 2: failed ValueError"):
        result.raise_on_failure()


def _skip_on_rank_one() -> None:
    if dist.get_rank() == 1:
        pytest.skip("not on this rank")
    dist.barrier()


def test_skip_in_one_rank_is_reported_and_releases_peers():
    result = run_threaded(_skip_on_rank_one, 2, deadline=30.0)
    assert [r.outcome for r in result.results] == [
        Outcome.ABORTED_BY_PEER,
        Outcome.SKIPPED,
    ]


def _mismatch() -> None:
    t = torch.ones(2)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def test_mismatched_collectives_fail_every_participant():
    result = run_threaded(_mismatch, 2, deadline=30.0)
    assert result.duration < 1.0
    for run in result.results:
        assert run.outcome is Outcome.FAILED
        assert isinstance(run.error, CollectiveMismatchError)
        assert "allreduce #0" in str(run.error) and "broadcast #0" in str(run.error)


def _shape_mismatch() -> None:
    dist.all_reduce(torch.ones(2 + dist.get_rank()))


def test_a_shape_mismatch_fails_every_participant_as_a_mismatch():
    result = run_threaded(_shape_mismatch, 2, deadline=30.0)
    for run in result.results:
        assert run.outcome is Outcome.FAILED, result.describe()
        assert isinstance(run.error, RuntimeError)
        message = str(run.error)
        assert "ranks disagree on the collective: allreduce #0" in message
        assert "(2,)" in message and "(3,)" in message
    # Each rank raised its own exception object (tracebacks are per rank).
    assert result.results[0].error is not result.results[1].error


# --- deadlocks and hangs -------------------------------------------------------------------


def _rank_one_skips_the_collective() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))


def test_deadlock_is_detected_without_waiting_for_the_deadline():
    result = run_threaded(_rank_one_skips_the_collective, 2, deadline=60.0)
    assert result.duration < 1.0
    stuck, early = result.results
    assert early.outcome is Outcome.PASSED
    assert stuck.outcome is Outcome.HUNG
    assert isinstance(stuck.error, CollectiveDeadlockError)
    assert "rank 0: waits in allreduce #0" in str(stuck.error)
    assert "rank 1: finished" in str(stuck.error)
    assert "_rank_one_skips_the_collective" in stuck.traceback  # where it waited


def _rank_one_waits_on_the_default_group_while_rank_zero_times_out() -> float:
    import time
    from datetime import timedelta

    short = dist.new_group(timeout=timedelta(seconds=1))
    if dist.get_rank() == 1:
        dist.barrier()  # released once rank 0's all_reduce has timed out
        return 0.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"within 1\.0 s"):
        dist.all_reduce(torch.ones(1), group=short)
    waited = time.monotonic() - start
    dist.barrier()
    return waited


def test_a_short_group_timeout_fires_instead_of_the_deadlock_report():
    """Every rank blocked, but rank 0 only until its group's 1 s timeout: not a deadlock."""
    result = run_threaded(
        _rank_one_waits_on_the_default_group_while_rank_zero_times_out, 2, deadline=30.0
    )
    result.raise_on_failure()
    # At least the 1 s timeout; well under the 30 s deadline whatever the machine's load.
    assert 1.0 <= result.values[0] < 20.0


def _async_never_waited() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)


def test_unmatched_async_collective_fails_the_run():
    result = run_threaded(_async_never_waited, 2, deadline=30.0)
    assert not result.ok
    assert "unmatched collectives" in result.describe()


# --- the collective listener ---------------------------------------------------------------


def _listened() -> None:
    dist.all_reduce(torch.zeros(3, 4))
    pair = dist.new_group([0, 1])
    if dist.get_rank() in (0, 1):
        out = torch.zeros(4, dtype=torch.float64)
        torch_api.all_gather_single(out, torch.zeros(2, dtype=torch.float64), group=pair)


def test_listener_sees_every_collective_with_sizes():
    records = []
    with add_collective_listener(records.append):
        run_threaded(_listened, 3).raise_on_failure()
    allreduce = sorted((r for r in records if r.op == "allreduce"), key=lambda r: r.rank)
    assert [r.rank for r in allreduce] == [0, 1, 2]
    assert {(r.shapes, r.dtypes, r.numel, r.nbytes, r.group_ranks) for r in allreduce} == {
        (((3, 4),), (torch.float32,), 12, 48, (0, 1, 2))
    }
    gathers = [r for r in records if r.op == "all_gather_single"]
    assert sorted(r.rank for r in gathers) == [0, 1]
    assert {(r.group_ranks, r.nbytes, r.out_nbytes) for r in gathers} == {((0, 1), 16, 32)}
    assert gathers[0].group_name != allreduce[0].group_name
    count = len(records)
    run_threaded(_listened, 3).raise_on_failure()  # handle removed on exit: no new records
    assert len(records) == count


def _print_per_rank() -> None:
    r = dist.get_rank()
    print(f"hello from rank {r}")
    dist.barrier()
    print(f"rank {r} to stderr", file=sys.stderr)


def test_output_is_captured_per_rank(capsys):
    stdout, stderr = sys.stdout, sys.stderr
    with ThreadRunner(3, capture_output=True) as runner:
        result = runner.run(_print_per_rank)
    result.raise_on_failure()
    for rank, run in enumerate(result.results):
        assert run.output == f"hello from rank {rank}\nrank {rank} to stderr\n"
    assert sys.stdout is stdout and sys.stderr is stderr
    assert capsys.readouterr() == ("", "")  # nothing leaked to the shared streams


# --- one set of rank threads and groups, run after run ---------------------------------------

_thread_marks = threading.local()


def _mark_thread_and_count_groups() -> tuple[int, int, bool]:
    """(id of the default group, groups beside it, whether this thread ran a run before)."""
    seen = getattr(_thread_marks, "seen", False)
    _thread_marks.seen = True
    groups = len(list(_torch_private.iter_non_default_groups()))
    dist.new_group([0, 1])  # left for the runner to destroy
    dist.all_reduce(torch.ones(1))
    return id(dist.group.WORLD), groups, seen


def test_rank_threads_and_their_groups_serve_run_after_run():
    with ThreadRunner(2) as runner:
        first = runner.run(_mark_thread_and_count_groups)
        second = runner.run(_mark_thread_and_count_groups)
    first.raise_on_failure()
    second.raise_on_failure()
    assert [v[2] for v in first.values] == [False, False]
    assert [v[2] for v in second.values] == [True, True]  # the same threads
    assert [v[0] for v in second.values] == [v[0] for v in first.values]  # the same groups
    assert [v[1] for v in second.values] == [0, 0]  # but not the first run's new group


def _fail_on_rank_1_after_a_collective() -> None:
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    dist.all_reduce(torch.ones(1))


def _sum_of_ranks() -> tuple[bool, float]:
    """(whether an earlier run used this default group, the sum of the ranks)."""
    world = dist.group.WORLD
    used = getattr(world, "_used_by_a_test", False)
    world._used_by_a_test = True  # the threaded backend's groups are Python objects
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return used, value.item()


def test_a_run_that_did_not_pass_leaves_new_groups_to_the_next():
    with ThreadRunner(2) as runner:
        before = runner.run(_sum_of_ranks)
        failed = runner.run(_fail_on_rank_1_after_a_collective)
        after = runner.run(_sum_of_ranks)
    assert not failed.ok
    after.raise_on_failure()
    before.raise_on_failure()
    assert after.values == [(False, 1.0), (False, 1.0)]  # new groups, positions in step


def _leave_grad_disabled_on_rank_0() -> bool:
    seen = getattr(_thread_marks, "seen", False)
    _thread_marks.seen = True
    grad = torch.is_grad_enabled()
    if dist.get_rank() == 0:
        torch.set_grad_enabled(False)
    dist.all_reduce(torch.ones(1))
    return seen, grad


def test_a_rank_thread_left_without_grad_gives_way_to_a_fresh_thread():
    with ThreadRunner(2) as runner:
        first = runner.run(_leave_grad_disabled_on_rank_0)
        second = runner.run(_leave_grad_disabled_on_rank_0)
    first.raise_on_failure()
    assert "rank 0: grad mode left at False" in " ".join(first.harness_notes)
    second.raise_on_failure()
    assert second.values[0] == (False, True)  # a fresh thread, with grad on
    assert second.values[1] == (True, True)  # rank 1 kept its thread


def _destroy_the_default_group_on_every_rank() -> None:
    dist.barrier()
    dist.destroy_process_group()


def test_a_run_that_destroyed_the_default_group_leaves_new_groups_to_the_next():
    with ThreadRunner(2) as runner:
        runner.run(_sum_of_ranks).raise_on_failure()
        runner.run(_destroy_the_default_group_on_every_rank).raise_on_failure()
        after = runner.run(_sum_of_ranks)
    after.raise_on_failure()
    assert after.values == [(False, 1.0), (False, 1.0)]
