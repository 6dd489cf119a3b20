"""A failure, a hang and a pass after them, on the device under test (any, the CPU too).

Not collected by default (no ``test_`` prefix): ``python -m distconform gpu-check`` runs this
file by path and checks the report of each test: the failure names its rank and its
assertion, the hang ends as ``hung`` with the rank's stacks inside its deadline, and the test
after them passes on fresh ranks.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

#: The hang's deadline, in seconds; the check allows this plus the harness's grace.
HANG_DEADLINE_S = 15


@pytest.mark.world_size(1)
def test_fails_on_rank_0(rank_ctx):
    value = torch.ones(2, device=rank_ctx.device)
    dist.all_reduce(value)
    assert value.tolist() == [2.0, 2.0], "a device sum that cannot be right"


@pytest.mark.world_size(1)
@pytest.mark.deadline(HANG_DEADLINE_S)
def test_hangs_on_rank_0(rank_ctx):
    torch.ones(1, device=rank_ctx.device).sum().item()  # the device is in use when it hangs
    while True:
        time.sleep(0.05)


@pytest.mark.world_size(1)
def test_passes_after_the_failure_and_the_hang(rank_ctx):
    value = torch.full((3,), 2.0, device=rank_ctx.device)
    dist.all_reduce(value)
    assert value.tolist() == [2.0 * rank_ctx.world_size] * 3
