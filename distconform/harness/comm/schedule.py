"""Inline expected comm schedules with expecttest, written by rank 0 only."""

from __future__ import annotations

import difflib
import os

from distconform.harness.comm.tracer import CommTracer, current_rank


def assert_schedule(
    trace: CommTracer | str,
    expected: str,
    *,
    with_phase: bool = True,
    with_site: bool = False,
) -> None:
    """Assert the trace's schedule equals the string literal ``expected``.

    ``expected`` must be a string literal at the call site. With ``EXPECTTEST_ACCEPT=1``
    rank 0 rewrites that literal in the test file (expecttest); other ranks never write
    and, while accepting, do not compare either (rank 0's schedule becomes the truth and
    the next run compares every rank against it).
    """
    actual = (
        trace
        if isinstance(trace, str)
        else trace.schedule(with_phase=with_phase, with_site=with_site)
    )
    rank = current_rank()
    if rank == 0:
        import expecttest  # a test dependency: imported only by tests that assert schedules

        # skip=1: the literal to rewrite is in our caller's frame, not here.
        expecttest.assert_expected_inline(actual, expected, skip=1)
        return
    if os.getenv("EXPECTTEST_ACCEPT") or actual == expected:
        return
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            actual.splitlines(keepends=True),
            "expected",
            f"rank {rank}",
        )
    )
    raise AssertionError(f"rank {rank}'s comm schedule differs from the expected one:\n{diff}")
