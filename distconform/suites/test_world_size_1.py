"""At world size 1 sharding is the identity and issues no collective at all.

The schedule oracle expects nothing on the wire for a one-rank plan, so any collective
fails the step."""

from __future__ import annotations

import pytest
import torch

from distconform.suites.cases import conformance, grid
from distconform.suites.schedule import ShardingPlan
from distconform.suites.test_training_parity import LIN_SHAPES, two_linears
from distconform.suites.training import train_with_parity


@conformance("fsdp.world_size_1")
@pytest.mark.parametrize("point", grid(lin_shapes=list(LIN_SHAPES)))
def test_train_parity_single_worldsize1(rank_ctx, impl, point):
    label = point["lin_shapes"]
    plan = ShardingPlan(impl)
    with torch.device(rank_ctx.device):
        model = two_linears(label)
    train_with_parity(
        rank_ctx.rank,
        model,
        plan.fully_shard,
        lambda: torch.randn(4, LIN_SHAPES[label][0][0], device=rank_ctx.device),
        schedule=plan,
    )
