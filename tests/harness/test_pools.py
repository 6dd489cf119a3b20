"""Warm pools: reuse across tests, recycling after failures and leaks, never skipping."""

from __future__ import annotations

import os

import pytest

from distconform.harness import Outcome
from distconform.harness.controller.pools import PoolManager, PoolStartFailure
from distconform.harness.controller.process.pool import ProcessPool, ProcessPoolSpec
from tests.harness import rank_bodies
from tests.harness.conftest import KEY4, task_for


def run(pools: PoolManager, fn, *args, seed: int = 0):
    return pools.run(KEY4, task_for(fn, *args, seed=seed), deadline=20.0, peer_grace=0.5)


def test_a_pool_serves_many_tests(pools):
    for _ in range(5):
        result = run(pools, rank_bodies.all_reduce_rank_sum)
        assert result.values == [10.0] * 4
    assert pools.spawn_count == 1 and pools.recycle_count == 0


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling classes")
def test_cpu_ranks_leave_the_parents_cpu_to_the_parent(pools):
    # harness/rank/worker.py: a batch-class rank does not preempt the parent handing
    # the test to the next rank.
    assert run(pools, rank_bodies.scheduling_policy).values == [os.SCHED_BATCH] * 4


def test_a_failure_recycles_the_pool_and_the_next_test_passes(pools):
    assert run(pools, rank_bodies.all_reduce_rank_sum).ok
    failed = run(pools, rank_bodies.raise_on, 2)
    assert not failed.ok and pools.recycle_count == 1
    after = run(pools, rank_bodies.all_reduce_rank_sum)
    assert after.ok and after.values == [10.0] * 4
    assert pools.spawn_count == 2


def test_creating_a_2d_mesh_is_not_a_leak(pools):
    result = run(pools, rank_bodies.build_2d_mesh_and_reduce)
    assert result.ok and result.values == [2.0] * 4
    assert result.hygiene_violations == {}
    # The mesh's groups are destroyed when the next test arrives, not before.
    assert run(pools, rank_bodies.live_groups).values == [1] * 4
    assert pools.spawn_count == 1 and pools.recycle_count == 0


@pytest.mark.parametrize(
    ("leak", "expected"),
    [
        (rank_bodies.leak_a_thread, "thread 'leaky' started by the test is still running"),
        (rank_bodies.leak_an_env_var, "environment variable DISTCONFORM_LEAKED changed"),
        (rank_bodies.leave_an_unmatched_collective, "default process group (rank 0: 1"),
        (rank_bodies.leave_an_unmatched_send, "rank 0 sent 1 message(s) to rank 1"),
        (rank_bodies.leak_a_torch_global, "torch default dtype changed"),
        (rank_bodies.destroy_the_default_group, "default process group was destroyed"),
    ],
    ids=["thread", "env", "unmatched-collective", "unmatched-send", "torch-global", "world"],
)
def test_a_leak_recycles_the_pool_and_the_next_test_is_clean(pools, leak, expected):
    leaked = run(pools, leak)
    assert all(r.outcome is Outcome.PASSED for r in leaked.results)
    violations = [v for vs in leaked.hygiene_violations.values() for v in vs]
    assert any(expected in v for v in violations), violations
    assert pools.recycle_count == 1
    clean = run(pools, rank_bodies.rng_state_digest)
    assert clean.ok and clean.hygiene_violations == {}
    assert {env for _, env in clean.values} == {None}


def test_every_test_starts_with_the_same_rng_state_on_every_rank(pools):
    first = run(pools, rank_bodies.rng_state_digest, seed=11)
    second = run(pools, rank_bodies.rng_state_digest, seed=11)
    other = run(pools, rank_bodies.rng_state_digest, seed=12)
    draws = {value for value, _ in first.values}
    assert len(draws) == 1
    assert draws == {value for value, _ in second.values}
    assert draws != {value for value, _ in other.values}


def test_a_changed_environment_gets_a_new_pool(monkeypatch):
    from distconform.harness.controller.pools import env_fingerprint

    before = env_fingerprint()
    monkeypatch.setenv("DISTCONFORM_POOL_KEY_PROBE", "1")
    assert env_fingerprint() != before
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "something else")
    monkeypatch.delenv("DISTCONFORM_POOL_KEY_PROBE")
    assert env_fingerprint() == before


def test_a_pool_whose_ranks_died_while_idle_is_replaced_not_blamed(pools):
    import os
    import signal
    import time

    assert run(pools, rank_bodies.all_reduce_rank_sum).ok
    for pid in pools._pools[KEY4].pids:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)  # let the kernel finish the kill
    after = run(pools, rank_bodies.all_reduce_rank_sum)
    assert after.ok and after.values == [10.0] * 4
    assert pools.spawn_count == 2


def test_torch_fsdp_resharding_to_a_sub_mesh_passes_twice_on_one_pool(pools):
    # Issue 3: DTensor's caches kept the first test's mesh, whose groups the harness had
    # destroyed; the second test failed with "Could not resolve the process group".
    first = run(pools, rank_bodies.fsdp_resharded_to_two_then_gathered)
    assert first.ok, first.results
    second = run(pools, rank_bodies.fsdp_resharded_to_two_then_gathered)
    assert second.ok, [r.error_message for r in second.results]
    for (names_before, total_before), (names_after, total_after) in zip(
        first.values, second.values, strict=True
    ):
        # New groups for the second mesh: the old names were destroyed with the first test.
        assert not set(names_before) & set(names_after), (names_before, names_after)
        assert total_before == total_after
    assert first.hygiene_violations == second.hygiene_violations == {}
    assert pools.spawn_count == 1 and pools.recycle_count == 0


def test_balanced_collectives_and_matched_sends_keep_the_pool_warm(pools):
    # Equal default-group counts skip the between-tests barrier; point-to-point calls,
    # which need not balance per rank, still get it: neither recycles the pool.
    assert run(pools, rank_bodies.all_reduce_rank_sum).ok
    exchanged = run(pools, rank_bodies.send_and_receive)
    assert exchanged.ok and exchanged.values[:2] == [0.0, 0.0]
    assert run(pools, rank_bodies.all_reduce_rank_sum).ok
    assert pools.spawn_count == 1 and pools.recycle_count == 0


def test_a_call_refused_on_the_spot_does_not_unbalance_the_ledger(pools):
    refused = run(pools, rank_bodies.refused_send)
    assert refused.ok and all("contiguous" in value for value in refused.values)
    assert pools.recycle_count == 0 and not refused.hygiene_violations


def test_a_rank_that_dies_starting_shows_its_exception():
    # Before, the fork server's child ended in os._exit(1) with the exception unprinted, and
    # a start failure read "crashed (exited with code 1)" with nothing to act on.
    pool = ProcessPool(
        ProcessPoolSpec(
            world_size=2, backend="no_such_backend", device_type="cpu", threads_per_rank=1
        )
    )
    try:
        with pytest.raises(PoolStartFailure) as excinfo:
            pool.start(timeout=60)
    finally:
        pool.kill()
    crashed = [r for r in excinfo.value.results if r.outcome is Outcome.CRASHED]
    assert crashed, excinfo.value.results
    assert "Unknown backend type no_such_backend" in (crashed[0].output or "")


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_pools_started_after_the_first_fork_with_dynamo_loaded(pytester):
    # The fork server imports torch._dynamo once it idles; DTensor's first call would
    # otherwise import it in every rank of every pool (0.6 s of CPU each).
    pytester.makepyfile(
        test_warm="""
        import sys
        import time

        import pytest


        @pytest.mark.world_size(2)
        def test_first_pool_forks_before_the_warm_up(rank_ctx):
            time.sleep(6)  # the fork server idles 3 s, then imports


        @pytest.mark.world_size(3)  # a new pool, started after the first test
        def test_a_later_pool_has_it(rank_ctx):
            assert "torch._dynamo" in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_the_pytest_process_runs_and_reports_tests_without_importing_dtensor(pytester):
    # DTensor and what it pulls in (sympy, the symbolic shapes) cost a second of CPU; the
    # pytest process only starts pools and reads the flight traces of a failed test.
    pytester.makeconftest(
        """
        import sys


        def pytest_sessionfinish(session):
            with open("parent_modules.txt", "w") as handle:
                handle.write("\\n".join(sorted(sys.modules)))
        """
    )
    pytester.makepyfile(
        test_parent="""
        import pytest
        import torch
        import torch.distributed as dist


        @pytest.mark.world_size(2)
        def test_passes(rank_ctx):
            dist.all_reduce(torch.ones(1))


        @pytest.mark.world_size(2)
        def test_fails_on_one_rank(rank_ctx):
            dist.all_reduce(torch.ones(1))
            assert rank_ctx.rank == 0
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    modules = set((pytester.path / "parent_modules.txt").read_text().split())
    assert (
        "distconform.harness.controller.process.pool" in modules
        and "distconform.harness.comm.flight_files" in modules
    )
    assert "torch.distributed.tensor" not in modules


def test_the_plugins_load_without_torch():
    # So the fork server, started before the pytest process imports torch, imports it at
    # the same time (two cores) instead of after it.
    import subprocess
    import sys

    code = (
        "import sys, distconform.harness.plugin, distconform.conformance.plugin; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_the_fork_server_starts_at_configure_when_the_last_session_had_distributed_tests(
    pytester,
):
    pytester.makeconftest(
        """
        import pytest

        from distconform.harness.controller.process.spawning import shared_zygote


        @pytest.hookimpl(trylast=True)
        def pytest_configure(config):
            with open("fork_server_at_configure.txt", "a") as handle:
                handle.write(f"{shared_zygote().pid is not None}\\n")
        """
    )
    pytester.makepyfile(
        test_one="""
        import pytest


        @pytest.mark.world_size(2)
        def test_distributed(rank_ctx):
            pass
        """,
        test_plain="""
        def test_plain():
            pass
        """,
    )
    # Collecting is what counts, so no session here needs a pool: the first knows nothing
    # yet (and a collect-only session never starts the server), the second follows one
    # that collected a distributed test, the third one that did not.
    pytester.runpytest_subprocess("--collect-only", "test_one.py").assert_outcomes()
    for _ in range(2):
        pytester.runpytest_subprocess("test_plain.py").assert_outcomes(passed=1)
    started = (pytester.path / "fork_server_at_configure.txt").read_text().split()
    assert started == ["False", "True", "False"]


def test_adoption_starts_the_fork_server_only_for_a_file_of_torchs_harness(pytester):
    pytester.makeconftest(
        """
        import pytest

        from distconform.harness.controller.process.spawning import shared_zygote


        def _record(when):
            with open("fork_server.txt", "a") as handle:
                handle.write(f"{when}={shared_zygote().pid is not None} ")


        def pytest_sessionstart(session):  # every plugin has been configured
            _record("configured")


        @pytest.hookimpl(trylast=True)
        def pytest_collection_finish(session):
            _record("collected")


        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionfinish(session):
            _record("finished")
            with open("fork_server.txt", "a") as handle:
                handle.write("\\n")
        """
    )
    plain = "import unittest\n\nclass TestPlain(unittest.TestCase):\n"
    plain += "    def test_plain(self):\n        pass\n"
    pytester.mkdir("found")
    pytester.path.joinpath("found", "test_found.py").write_text(
        f"# a MultiProcessTestCase would be adopted here too\n{plain}"
    )
    pytester.makepyfile(
        test_plain=plain,
        # Named in the text, as a module that subclasses torch's classes names them.
        test_names_it=f"# a MultiProcessTestCase would be adopted here\n{plain}",
    )
    # Each file alone; then a folder, whose file is found only by collecting it.
    for where in ("test_plain.py", "test_names_it.py", "found"):
        args = ["-p", "no:cacheprovider", "--dist-adopt", where]
        pytester.runpytest_subprocess(*args).assert_outcomes(passed=1)
    plain_run, named_run, found_run = (pytester.path / "fork_server.txt").read_text().splitlines()
    # No test of the plain file needs ranks: no fork server, at any point of the session.
    assert plain_run.split() == ["configured=False", "collected=False", "finished=False"]
    # A file the command line names and that names torch's harness: started at configure,
    # before pytest's process imports torch, so that the two imports overlap.
    assert named_run.split() == ["configured=True", "collected=True", "finished=True"]
    # One found by collection: started while it is collected.
    assert found_run.split() == ["configured=False", "collected=True", "finished=True"]


def test_a_fresh_pool_test_gets_ranks_no_other_test_used(pytester, monkeypatch):
    pytester.makepyfile(
        test_fresh="""
        import os

        import pytest

        PIDS = os.environ["PIDS_FILE"]


        def record(rank_ctx, name):
            if rank_ctx.rank == 0:
                with open(PIDS, "a") as handle:
                    handle.write(f"{name} {os.getpid()}\\n")


        @pytest.mark.world_size(2)
        def test_a_warm(rank_ctx):
            record(rank_ctx, "warm")


        @pytest.mark.fresh_pool
        @pytest.mark.world_size(2)
        def test_b_fresh(rank_ctx):
            record(rank_ctx, "fresh")


        @pytest.mark.world_size(2)
        def test_c_after(rank_ctx):
            record(rank_ctx, "after")
        """
    )
    pids_file = pytester.path / "pids.txt"
    monkeypatch.setenv("PIDS_FILE", str(pids_file))
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=3)
    pids = dict(line.split() for line in pids_file.read_text().splitlines())
    assert len(set(pids.values())) == 3, pids
