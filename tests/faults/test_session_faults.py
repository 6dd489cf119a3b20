"""Faults that need a whole pytest session: timeouts, xdist, import errors, privacy."""

from __future__ import annotations

import os
import re
import socket
import stat
import textwrap
import uuid

import psutil
import pytest

from distconform.harness.controller.process.pool import ProcessPool, ProcessPoolSpec
from tests.harness.test_lifecycle import _processes_tagged

HANGING_MODULE = textwrap.dedent(
    """
    import pytest
    import torch.distributed as dist

    @pytest.mark.world_size(2)
    def test_warm(rank_ctx):  # the pool starts here, not inside the hanging test's budget
        dist.barrier()

    @pytest.mark.world_size(2)
    def test_hangs(rank_ctx):
        if rank_ctx.rank == 1:
            while True:
                pass
        dist.barrier()

    @pytest.mark.world_size(2)
    def test_after(rank_ctx):
        dist.barrier()
    """
)


# The thread method is the same check through another pytest-timeout path: nightly.
@pytest.mark.parametrize("method", ["signal", pytest.param("thread", marks=pytest.mark.slow)])
def test_the_harness_reports_before_pytest_timeout_with_either_method(pytester, method):
    pytester.makepyfile(test_hang=HANGING_MODULE)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--timeout", "12", "--timeout-method", method
    )
    result.assert_outcomes(failed=1, passed=2)
    text = result.stdout.str()
    # rank 0 is in the barrier long before the deadline, on a busy machine too: the pool
    # started in test_warm, so the whole cut deadline is the body's.
    assert re.search(
        r"rank 1 hung: still running at the [0-9.]+ s deadline, cut from 300 s to fit "
        r"pytest-timeout's 12 s limit",
        text,
    )
    # The note says why the deadline shrank and what to raise.
    assert re.search(
        r"the 300 s deadline was cut to [0-9.]+ s to report before pytest-timeout's 12 s limit "
        r"for this test \(less 3.0 s kept for the report, less [0-9.]+ s spent before the ranks "
        r"started, pool start-up included\): raise --timeout or the test's timeout marker to at "
        r"least 30[0-9] s, or lower its deadline",
        text,
    )
    assert "Timeout" not in text


@pytest.mark.slow  # 20 s of four xdist workers starting pools; nightly
def test_xdist_workers_run_process_pools_side_by_side(pytester):
    pytester.makepyfile(
        test_many="""
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.world_size(2)
        @pytest.mark.parametrize("index", range(8))
        def test_sum(rank_ctx, index):
            value = torch.full((1,), float(index + rank_ctx.rank))
            dist.all_reduce(value)
            assert value.item() == 2 * index + 1
        """
    )
    tag = uuid.uuid4().hex
    os.environ["DISTCONFORM_TEST_TAG"] = tag
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "4")
    finally:
        del os.environ["DISTCONFORM_TEST_TAG"]
    result.assert_outcomes(passed=8)
    _gone, alive = psutil.wait_procs(_processes_tagged(tag), timeout=10)
    assert not alive, f"processes outlived the xdist session: {alive}"


def test_a_module_that_cannot_be_imported_in_the_ranks_fails_once(pytester):
    pytester.makepyfile(
        test_rank_import="""
        import sys
        import pytest

        if "distconform.harness.rank.worker" in sys.modules:
            raise ImportError("this module cannot be imported inside a rank")

        @pytest.mark.world_size(2)
        def test_never_runs(rank_ctx):
            pass
        """
    )
    for launcher in ("process", "thread"):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--launcher", launcher)
        result.assert_outcomes(failed=1)
        text = result.stdout.str()
        assert "ImportError: this module cannot be imported inside a rank" in text
        # Count in the failure report only: newer pytest repeats it in the short summary.
        report = text.split("short test summary info")[0]
        assert report.count("Traceback (most recent call last)") == 1


def test_rendezvous_is_private():
    pool = ProcessPool(
        ProcessPoolSpec(
            world_size=2, backend="gloo", device_type="cpu", threads_per_rank=1, rendezvous="tcp"
        )
    )
    pool.start()
    try:
        assert stat.S_IMODE(os.stat(pool.rendezvous_dir).st_mode) == 0o700
        listening = [
            c
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening, "the TCPStore is not listening"
        assert {c.laddr.ip for c in listening} == {"127.0.0.1"}
        assert all(c.family == socket.AF_INET for c in listening)
    finally:
        pool.close()
