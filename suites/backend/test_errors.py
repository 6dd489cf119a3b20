"""Error semantics, each checked without hanging: every check runs on a sub-group with a short
timeout, so a backend that hangs where it should raise fails within seconds, and the pool
that saw it is replaced (``fresh_pool``) instead of reused."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from suites.cases import conformance, grid_id

#: The sub-groups' timeout.
TIMEOUT = timedelta(seconds=2)
#: How much later than the timeout the error may come (scheduling on a loaded machine).
SLACK_S = 3.0


def _timed_group() -> dist.ProcessGroup:
    return dist.new_group(timeout=TIMEOUT)


@conformance("backend.timeout")
@pytest.mark.fresh_pool
def test_absent_rank_times_the_others_out(rank_ctx) -> None:
    """The last rank never joins an all_reduce: every other rank gets an error within the
    group's timeout (plus slack), not a hang and not a wrong result."""
    group = _timed_group()
    last = rank_ctx.world_size - 1
    if rank_ctx.rank == last:
        # Stay (on the default group) until the others have their errors: leaving the test
        # would close this rank's connections, and a peer would then fail for that reason
        # instead of the timeout.
        dist.barrier()
        return
    tensor = torch.ones(4, device=rank_ctx.device)
    start = time.monotonic()
    try:
        with pytest.raises(Exception) as raised:  # RuntimeError, DistBackendError, ...
            dist.all_reduce(tensor, group=group)
    finally:
        waited = time.monotonic() - start
        dist.barrier()
    limit = TIMEOUT.total_seconds() + SLACK_S
    assert waited <= limit, (
        f"the error came after {waited:.1f} s, the group's timeout is "
        f"{TIMEOUT.total_seconds():.0f} s: {raised.value}"
    )


@conformance("backend.abort")
@pytest.mark.fresh_pool
def test_aborted_group_refuses_later_collectives(rank_ctx) -> None:
    """After ``abort()`` a group must refuse work promptly: a group that keeps working would
    let a job continue on a communicator its error handling has given up."""
    group = _timed_group()
    tensor = torch.ones(4, device=rank_ctx.device)
    dist.all_reduce(tensor, group=group)  # the group worked before the abort
    group.abort()
    start = time.monotonic()
    try:
        dist.all_reduce(tensor, group=group)
    except Exception as exc:  # the expected outcome: any error, soon
        waited = time.monotonic() - start
        assert waited < TIMEOUT.total_seconds(), (
            f"the aborted group raised only after {waited:.1f} s, at its timeout: it waited "
            f"for peers instead of refusing ({exc})"
        )
        return
    pytest.fail(
        "all_reduce on an aborted group completed: abort() left the group usable "
        f"(result {tensor.tolist()})"
    )


MISMATCHES = {
    "shape": lambda rank, device: torch.ones(4 + rank, device=device),
    "dtype": lambda rank, device: torch.ones(
        4, dtype=torch.float32 if rank % 2 == 0 else torch.float64, device=device
    ),
}


@conformance("backend.mismatch")
@pytest.mark.fresh_pool
@pytest.mark.parametrize(
    "mismatch", [pytest.param(name, id=grid_id(mismatch=name)) for name in MISMATCHES]
)
def test_mismatched_calls_raise_on_every_rank(mismatch: str, rank_ctx) -> None:
    """Ranks that disagree on an all_reduce's shape or dtype must all get an error, none a
    result (which would be computed from misread bytes)."""
    group = _timed_group()
    tensor = MISMATCHES[mismatch](rank_ctx.rank, rank_ctx.device)
    try:
        dist.all_reduce(tensor, group=group)
    except Exception:
        return
    pytest.fail(
        f"rank {rank_ctx.rank}'s all_reduce of {tuple(tensor.shape)} {tensor.dtype} "
        f"completed while another rank passed a different {mismatch}"
    )
