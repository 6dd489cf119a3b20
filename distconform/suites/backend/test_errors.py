"""Error semantics, each checked without hanging: every check runs on a sub-group with a short
timeout, and the abort and mismatch checks wait for their work with that timeout
(``async_op=True`` then ``wait(timeout)``, which blocks the host even on backends whose calls
return before the device finishes), so a backend that hangs where it should raise fails
within seconds; the pool that saw it is replaced (``fresh_pool``) instead of reused."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from distconform.suites.cases import conformance, grid_id

#: The sub-groups' timeout.
TIMEOUT = timedelta(seconds=2)
#: How much later than the timeout the error may come (scheduling on a loaded machine).
SLACK_S = 3.0


def _timed_group() -> dist.ProcessGroup:
    return dist.new_group(timeout=TIMEOUT)


def _all_reduce_and_wait(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    dist.all_reduce(tensor, group=group, async_op=True).wait(TIMEOUT)


@conformance("backend.timeout")
@pytest.mark.fresh_pool
def test_absent_rank_times_the_others_out(rank_ctx) -> None:
    """The last rank never joins an all_reduce: every other rank gets an error once the
    group's timeout has passed (not before, not a hang, not a result)."""
    group = _timed_group()
    _all_reduce_and_wait(torch.ones(4, device=rank_ctx.device), group)  # the group works
    last = rank_ctx.world_size - 1
    if rank_ctx.rank == last:
        # Stay (on the default group) until the others have their errors: leaving the test
        # would close this rank's connections, and a peer would then fail for that reason
        # instead of the timeout.
        dist.barrier()
        return
    start = time.monotonic()
    try:
        with pytest.raises(Exception) as raised:  # RuntimeError, DistBackendError, ...
            # wait() with no timeout of its own: the group's timeout is what is checked.
            # (NCCL enforces it on the host only with TORCH_NCCL_BLOCKING_WAIT=1; otherwise
            # its watchdog aborts the process, which this check reports as a crash.)
            dist.all_reduce(
                torch.ones(4, device=rank_ctx.device), group=group, async_op=True
            ).wait()
    finally:
        waited = time.monotonic() - start
        dist.barrier()
    timeout = TIMEOUT.total_seconds()
    assert waited >= timeout / 2, (
        f"the error came after only {waited:.1f} s, before the group's {timeout:.0f} s "
        f"timeout: it is not a timeout ({raised.value})"
    )
    assert waited <= timeout + SLACK_S, (
        f"the error came after {waited:.1f} s, the group's timeout is {timeout:.0f} s: "
        f"{raised.value}"
    )


@conformance("backend.abort")
@pytest.mark.fresh_pool
def test_aborted_group_refuses_later_collectives(rank_ctx) -> None:
    """After ``abort()`` a group must refuse work promptly: a group that keeps working would
    let a job continue on a communicator its error handling has given up."""
    group = _timed_group()
    tensor = torch.ones(4, device=rank_ctx.device)
    _all_reduce_and_wait(tensor, group)  # the group worked before the abort
    group.abort()
    start = time.monotonic()
    try:
        _all_reduce_and_wait(tensor, group)
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
    """Ranks that disagree on an all_reduce's shape or dtype must all get an error, well
    before the group's timeout: a result would be computed from misread bytes, and an error
    only at the timeout means the backend waited instead of detecting the mismatch."""
    group = _timed_group()
    _all_reduce_and_wait(torch.ones(4, device=rank_ctx.device), group)  # the group works
    tensor = MISMATCHES[mismatch](rank_ctx.rank, rank_ctx.device)
    start = time.monotonic()
    try:
        _all_reduce_and_wait(tensor, group)
    except Exception as exc:
        waited = time.monotonic() - start
        assert waited < TIMEOUT.total_seconds() / 2, (
            f"the mismatch raised only after {waited:.1f} s, near the group's timeout: the "
            f"backend waited instead of detecting it ({exc})"
        )
        return
    pytest.fail(
        f"rank {rank_ctx.rank}'s all_reduce of {tuple(tensor.shape)} {tensor.dtype} "
        f"completed while another rank passed a different {mismatch}"
    )
