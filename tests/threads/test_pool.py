"""ThreadPool: the runner behind distconform.harness.controller.pools' RankPool interface, fed real
RankTasks."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from distconform.harness import get_rank_context
from distconform.harness.rank.thread_ranks import ThreadPool
from distconform.harness.shared.outcomes import Outcome
from distconform.harness.shared.task import RankTask, pack_call

_release = threading.Event()


def _task(fn, *args, seed: int = 0) -> RankTask:
    payload, modules = pack_call(fn, args, {})
    return RankTask(
        test_id=fn.__qualname__,
        payload=payload,
        modules=modules,
        sys_path=tuple(p for p in sys.path if p),
        seed=seed,
        pg_timeout=30.0,
    )


def rank_sum_and_context() -> tuple[float, int, str]:
    ctx = get_rank_context()
    print(f"rank {ctx.rank} says hi")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item(), ctx.rank, ctx.launcher


def raise_on(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()


def skip_everywhere() -> None:
    import pytest

    pytest.skip("not here")


def wait_for_release_on(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        _release.wait(30)
    dist.barrier()


def test_passing_task_returns_every_rank_value():
    pool = ThreadPool(3)
    try:
        run = pool.run(_task(rank_sum_and_context), deadline=30.0, peer_grace=1.0)
        assert run.ok, run
        assert run.values == [(6.0, r, "thread") for r in range(3)]
        assert [r.output for r in run.results] == [f"rank {r} says hi\n" for r in range(3)]
        assert not pool.broken
        again = pool.run(_task(rank_sum_and_context), deadline=30.0, peer_grace=1.0)
        assert again.ok
    finally:
        pool.close()


def test_failure_is_primary_and_peers_are_released():
    pool = ThreadPool(3)
    try:
        run = pool.run(_task(raise_on, 1), deadline=30.0, peer_grace=1.0)
    finally:
        pool.close()
    assert run.finished_at - run.started_at < 1.0
    primary = run.primary_failure()
    assert primary is not None and primary.rank == 1
    assert primary.error_type == "ValueError"
    assert "deliberate failure on rank 1" in primary.traceback
    for peer in (0, 2):
        assert run.results[peer].outcome is Outcome.FAILED
        assert run.results[peer].comm_error  # demoted to aborted-by-peer by the report
        assert "because rank 1 failed: ValueError: deliberate failure on rank 1" in (
            run.results[peer].error_message
        )


def test_a_failure_that_changed_nothing_leaves_the_pool_serving():
    pool = ThreadPool(3)
    try:
        failed = pool.run(_task(raise_on, 1), deadline=30.0, peer_grace=1.0)
        assert not failed.ok and not failed.hygiene_violations
        assert not pool.broken
        # The next run joins a new world: the failed run's abort does not reach it.
        after = pool.run(_task(rank_sum_and_context), deadline=30.0, peer_grace=1.0)
        assert after.ok, after
        assert after.values == [(6.0, r, "thread") for r in range(3)]
    finally:
        pool.close()


def set_a_variable_then_raise_on(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        os.environ["DISTCONFORM_LEFT_BY_A_FAILURE"] = "1"
        raise ValueError("deliberate failure after changing the environment")
    dist.barrier()


def start_a_thread() -> None:
    if dist.get_rank() == 0:
        threading.Thread(target=_release.wait, args=(30,), name="left-running", daemon=True).start()


@pytest.mark.parametrize(
    ("body", "args", "violation"),
    [
        (set_a_variable_then_raise_on, (1,), "DISTCONFORM_LEFT_BY_A_FAILURE"),
        (start_a_thread, (), "thread 'left-running' started by the test is still running"),
    ],
    ids=["a failure that set a variable", "a pass that left a thread running"],
)
def test_a_run_that_changed_the_process_breaks_the_pool(body, args, violation, monkeypatch):
    monkeypatch.delenv("DISTCONFORM_LEFT_BY_A_FAILURE", raising=False)
    _release.clear()
    pool = ThreadPool(2)
    try:
        run = pool.run(_task(body, *args), deadline=30.0, peer_grace=1.0)
    finally:
        pool.close()
        _release.set()
    # The ranks share the process: which of them changed it is unknown, so every rank
    # carries the violation, and the pool (its host, under the thread launcher) is replaced.
    assert sorted(run.hygiene_violations) == [0, 1]
    assert all(violation in " ".join(v) for v in run.hygiene_violations.values())
    assert pool.broken


def test_skip_on_every_rank():
    pool = ThreadPool(2)
    try:
        run = pool.run(_task(skip_everywhere), deadline=30.0, peer_grace=1.0)
    finally:
        pool.close()
    assert run.all_skipped


def test_hang_reports_stacks_and_breaks_the_pool():
    _release.clear()
    threads_before = set(threading.enumerate())
    pool = ThreadPool(2)
    try:
        run = pool.run(_task(wait_for_release_on, 0), deadline=0.5, peer_grace=1.0)
        hung = run.results[0]
        assert hung.outcome is Outcome.HUNG
        assert "wait_for_release_on" in hung.stacks
        assert run.results[1].outcome in (Outcome.ABORTED_BY_PEER, Outcome.FAILED)
        assert pool.broken
    finally:
        pool.kill()
        _release.set()
        # Only this test's rank threads: other tests may leave hung ones behind on purpose.
        for thread in threading.enumerate():
            if thread.name.startswith("distconform-rank") and thread not in threads_before:
                thread.join(5)
