"""Inline expected schedules: compared on every rank, rewritten by rank 0 only."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distconform.harness import torch_api
from distconform.harness.comm import CommTracer, assert_schedule

REPO = Path(__file__).resolve().parents[2]


def _step(mesh) -> CommTracer:
    model = torch.nn.Linear(4, 4)
    model.register_forward_pre_hook(
        lambda m, a: torch_api.all_gather_single(
            torch.empty(4 * mesh.size()), torch.ones(4), group=mesh.get_group()
        )
    )
    with CommTracer(mesh=mesh) as trace:
        model(torch.ones(1, 4)).sum().backward()
        with trace.phase("optimizer"):
            dist.all_reduce(torch.ones(2, 2, dtype=torch.bfloat16))
    return trace


@pytest.mark.world_size(2, 4)
def test_the_schedule_matches_the_inline_expectation_on_every_rank(rank_ctx):
    trace = _step(rank_ctx.mesh(rank_ctx.world_size, ("dp",)))
    assert_schedule(
        trace,
        """\
forward   all_gather dp f32[4]
optimizer all_reduce dp bf16[2x2]
""",
    )


@pytest.mark.world_size(2)
def test_another_rank_with_another_schedule_fails_with_a_diff(rank_ctx):
    with CommTracer() as trace:
        dist.all_reduce(torch.ones(4))
    actual = trace.schedule()
    if rank_ctx.rank == 0:
        assert_schedule(actual, "- all_reduce world f32[4]\n")
        return
    with pytest.raises(AssertionError, match="rank 1's comm schedule differs") as failure:
        assert_schedule(actual.replace("f32[4]", "f32[5]"), "- all_reduce world f32[4]\n")
    assert "+- all_reduce world f32[5]" in str(failure.value)


ACCEPTED_MODULE = """
import pytest
import torch
import torch.distributed as dist

from distconform.harness.comm import CommTracer, assert_schedule


@pytest.mark.world_size(2)
@pytest.mark.deadline(60)
def test_schedule(rank_ctx):
    with CommTracer() as trace:
        if rank_ctx.rank == 0:
            dist.send(torch.ones(3), dst=1)
        else:
            dist.recv(torch.empty(3), src=0)
    assert_schedule(trace, '''wrong''')
"""


def test_accept_rewrites_the_literal_once_with_rank_0s_schedule(pytester, monkeypatch):
    # Process ranks: the case where several writers could exist. (Rank 1 comparing and
    # failing without accept is test_another_rank_with_another_schedule_fails_with_a_diff.)
    path = pytester.makepyfile(test_accept=textwrap.dedent(ACCEPTED_MODULE))
    monkeypatch.setenv("EXPECTTEST_ACCEPT", "1")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--launcher", "process")
    result.assert_outcomes(passed=1)
    text = Path(path).read_text()
    # Rank 0 (the sender) wrote; rank 1 (the receiver) compared nothing, wrote nothing.
    assert "'''wrong'''" not in text
    assert text.count("- send world f32[3] peer=1") == 1, text
    assert "- recv" not in text, text
