"""``reshard_after_forward``: what a group keeps between forward and backward.

``True`` frees the unsharded parameters after forward, so backward all-gathers them again over
the whole shard group; ``False`` keeps them; an int ``k`` keeps a ``1/k`` slice, so the
backward all-gather runs over ``k`` consecutive ranks of the shard group and carries ``S/k``
times the forward one's elements per rank. Numerics are the same in all three, so the cases
hold each step's collectives to FSDP2's schedule (``suites/schedule``) next to parity.
"""

from __future__ import annotations

import pytest
from torch import nn

from distconform.suites.cases import conformance, grid
from distconform.suites.schedule import ShardingPlan
from distconform.suites.training import train_width_stack


@conformance("fsdp.reshard_after_forward.schedule")
@pytest.mark.parametrize("point", grid(raf=[2, True, False]))
def test_reshard_after_forward_schedule(rank_ctx, impl, point):
    def shard(plan: ShardingPlan, model: nn.Module) -> None:
        for layer in model.layers:
            plan.fully_shard(layer, reshard_after_forward=point["raf"])
        plan.fully_shard(model, reshard_after_forward=point["raf"])

    train_width_stack(rank_ctx, impl, 3, shard)
