"""--launcher thread: rank threads in a host process that is replaced after a hang or a test
that left it changed, and kept after a failure that changed nothing."""

from __future__ import annotations

import signal
import tempfile
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from distconform.harness import Outcome
from distconform.harness.controller.dispatch import make_pool
from distconform.harness.controller.failure_report import verdict_headline
from distconform.harness.controller.pools import PoolKey, PoolManager
from tests.harness import rank_bodies
from tests.harness.conftest import task_for

THREAD_KEY = PoolKey(
    launcher="thread", world_size=4, backend="threaded", device_type="cpu", threads_per_rank=1
)


@pytest.fixture
def thread_pools():
    manager = PoolManager(lambda key: make_pool(key, echo=None))
    yield manager
    manager.shutdown()


def run(pools: PoolManager, fn, *args, deadline: float = 20.0):
    return pools.run(THREAD_KEY, task_for(fn, *args), deadline=deadline, peer_grace=0.5)


def test_rank_threads_share_one_warm_host(thread_pools):
    for _ in range(3):
        assert run(thread_pools, rank_bodies.all_reduce_rank_sum).values == [10.0] * 4
    assert thread_pools.spawn_count == 1


def test_a_hung_rank_thread_is_reported_and_its_host_replaced(thread_pools):
    assert run(thread_pools, rank_bodies.all_reduce_rank_sum).ok
    host_pid = thread_pools._pools[THREAD_KEY].pids[0]
    hung = run(thread_pools, rank_bodies.loop_on, 2, deadline=3.0)
    assert hung.results[2].outcome is Outcome.HUNG
    assert "spin_forever" in hung.results[2].stacks
    assert hung.primary_failure() is hung.results[2]
    # The host with the spinning thread is gone; the next test gets a new one.
    assert not psutil.pid_exists(host_pid) or psutil.Process(host_pid).status() == "zombie"
    after = run(thread_pools, rank_bodies.all_reduce_rank_sum)
    assert after.ok and thread_pools.spawn_count == 2


def test_an_error_in_one_rank_thread_fails_the_test_and_releases_the_others(thread_pools):
    result = run(thread_pools, rank_bodies.raise_on, 1)
    assert result.results[1].outcome is Outcome.FAILED
    assert "deliberate failure on rank 1" in result.results[1].traceback
    peers = [r for r in result.results if r.rank != 1]
    assert all(r.outcome is Outcome.ABORTED_BY_PEER for r in peers)
    assert result.finished_at - result.started_at < 5


def test_a_failure_that_changed_nothing_keeps_the_host(thread_pools):
    assert run(thread_pools, rank_bodies.all_reduce_rank_sum).ok
    host_pid = thread_pools._pools[THREAD_KEY].pids[0]
    failed = run(thread_pools, rank_bodies.raise_on, 1)
    assert failed.primary_failure() is failed.results[1]
    after = run(thread_pools, rank_bodies.all_reduce_rank_sum)
    assert after.values == [10.0] * 4
    assert thread_pools._pools[THREAD_KEY].pids == [host_pid]
    assert thread_pools.spawn_count == 1


def test_a_test_that_leaves_the_host_changed_gets_it_replaced(thread_pools):
    leaky = run(thread_pools, rank_bodies.leak_an_env_var)  # sets it in the host process
    assert leaky.ok
    assert sorted(leaky.hygiene_violations) == [0, 1, 2, 3]
    assert all("DISTCONFORM_LEAKED" in " ".join(v) for v in leaky.hygiene_violations.values())
    # The next test does not see the variable: it runs in a new host.
    after = run(thread_pools, rank_bodies.rng_state_digest)
    assert [env for _, env in after.values] == [None] * 4
    assert thread_pools.spawn_count == 2


THREAD_KEY_2 = replace(THREAD_KEY, world_size=2)


def test_every_world_size_shares_one_host(thread_pools):
    assert run(thread_pools, rank_bodies.all_reduce_rank_sum).values == [10.0] * 4
    two = thread_pools.run(
        THREAD_KEY_2, task_for(rank_bodies.all_reduce_rank_sum), deadline=20.0, peer_grace=0.5
    )
    assert two.values == [3.0] * 2
    (host_pid,) = thread_pools._pools[THREAD_KEY].pids
    assert thread_pools._pools[THREAD_KEY_2].pids == [host_pid]


def test_a_host_replaced_for_one_world_size_serves_the_others_next(thread_pools):
    assert run(thread_pools, rank_bodies.all_reduce_rank_sum).ok
    (first_host,) = thread_pools._pools[THREAD_KEY].pids
    leaky = thread_pools.run(
        THREAD_KEY_2, task_for(rank_bodies.leak_an_env_var), deadline=20.0, peer_grace=0.5
    )
    assert leaky.hygiene_violations  # the host is replaced
    after = run(thread_pools, rank_bodies.rng_state_digest)
    assert [env for _, env in after.values] == [None] * 4
    assert thread_pools._pools[THREAD_KEY].pids != [first_host]
    # Only the pool the leaking test broke counts as replaced for a broken test.
    assert thread_pools.recycle_count == 1


def test_a_fresh_pool_test_gets_a_host_of_its_own(thread_pools):
    assert run(thread_pools, rank_bodies.all_reduce_rank_sum).ok
    (warm_host,) = thread_pools._pools[THREAD_KEY].pids
    fresh = thread_pools.run(
        THREAD_KEY_2,
        task_for(rank_bodies.process_id),
        deadline=20.0,
        peer_grace=0.5,
        fresh=True,
    )
    assert fresh.ok
    (fresh_host,) = set(fresh.values)
    assert fresh_host != warm_host


def test_rank_threads_draw_from_their_own_generators(thread_pools):
    draws = run(thread_pools, rank_bodies.rng_state_digest).values
    assert len({value for value, _ in draws}) == 1  # same seed, isolated generators


def test_a_rank_thread_that_exits_the_host_is_the_one_blamed(thread_pools):
    result = run(thread_pools, rank_bodies.exit_on, 3, 7)
    assert result.primary_failure() is result.results[3]
    assert result.results[3].outcome is Outcome.CRASHED and result.results[3].exit_code == 7
    assert "os._exit(7)" in result.results[3].note
    assert all(r.outcome is Outcome.ABORTED_BY_PEER for r in result.results[:3])
    assert verdict_headline(result).startswith("rank 3 crashed: exited with code 7")


def test_a_host_killed_by_a_signal_blames_no_rank(thread_pools):
    result = run(thread_pools, rank_bodies.signal_on, 2, signal.SIGKILL)
    headline = verdict_headline(result)
    assert headline.startswith("the thread host process killed by SIGKILL")
    assert "which rank caused it is unknown" in headline
    assert "rank 0" not in headline


def test_the_parent_removes_the_host_temp_files_after_the_host_dies(tmp_path, monkeypatch):
    # The host's files live in its pool's directory, which the parent removes itself: a
    # host that dies (or is killed) cannot clean up after itself. A temporary directory of
    # its own (here and in the processes it starts): other runs on the machine use /tmp too.
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))

    def leftovers() -> set[str]:
        return {p.name for p in Path(tempfile.gettempdir()).glob("distconform-*")}

    before = leftovers()
    manager = PoolManager(lambda key: make_pool(key, echo=None))
    try:
        assert not run(manager, rank_bodies.exit_on, 1, 3).ok
        assert not run(manager, rank_bodies.raise_on, 1).ok
        assert run(manager, rank_bodies.all_reduce_rank_sum).ok
    finally:
        manager.shutdown()
    assert leftovers() - before == set()
