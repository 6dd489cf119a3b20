"""The pipeline suites' bookkeeping, without ranks: which stages a rank holds under each
schedule, and how far ahead of its consumer ``ActionLog`` counts a receive."""

from __future__ import annotations

import pytest

from distconform.suites.composition.pipeline import (
    SCHEDULES,
    ActionLog,
    PipelineLayout,
    stage_placement,
)


@pytest.mark.parametrize(
    ("schedule", "placements"),
    [
        ("1F1B", [[0], [1]]),
        ("Interleaved1F1B", [[0, 2], [1, 3]]),
        ("LoopedBFS", [[0, 2], [1, 3]]),
        ("ZBVZeroBubble", [[0, 3], [1, 2]]),
        ("DualPipeV", [[0, 3], [1, 2]]),
    ],
)
def test_stage_placement_on_two_ranks(schedule, placements):
    assert [stage_placement(schedule, rank, 2) for rank in range(2)] == placements


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_stage_is_placed_once(schedule):
    placed = sorted(index for rank in range(3) for index in stage_placement(schedule, rank, 3))
    assert placed == list(range(len(placed)))


def test_the_v_placement_puts_the_last_stage_on_the_first_rank():
    first = PipelineLayout("ZBVZeroBubble", pp_rank=0, pp_size=2, n_layers=8)
    second = PipelineLayout("ZBVZeroBubble", pp_rank=1, pp_size=2, n_layers=8)
    assert (first.is_first_rank, first.is_last_rank) == (True, True)
    assert (second.is_first_rank, second.is_last_rank) == (False, False)
    looped_last = PipelineLayout("Interleaved1F1B", pp_rank=1, pp_size=2, n_layers=8)
    assert looped_last.is_last_rank and not looped_last.is_first_rank


def test_receive_leads_count_computations_before_the_consumer():
    log = ActionLog(
        entries=[
            ("recv_forward", 1, 0),
            ("forward", 1, 0),
            ("recv_forward", 1, 1),
            ("recv_backward", 1, 0),
            ("forward", 2, 0),
            ("weight", 2, 0),
            ("forward", 1, 1),
            ("backward", 1, 0),
        ]
    )
    assert log.receive_leads() == {
        ("recv_forward", 1, 0): 0,
        # Another receive in between is no computation.
        ("recv_forward", 1, 1): 2,
        ("recv_backward", 1, 0): 3,
    }
