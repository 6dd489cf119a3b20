"""Frozen parameters (``requires_grad=False``) inside and across ``fully_shard`` groups.

FSDP2 shards a frozen parameter like any other and gathers it for forward, but it gets no
gradient: the group reduces only the gradients its trainable parameters produced, a group
whose parameters are all frozen reduces nothing, and the optimizer leaves frozen parameters
as they are. Freezing is a user's call on the registered (sharded) parameters, before
``fully_shard`` or between steps.

Each item trains 3 steps of an ``MLPStack`` (each MLP its own group, then the root) next to a
plain copy frozen the same way, on different data per rank: losses every step, parameters and
gradients shard by shard (a frozen parameter's gradient is ``None`` on both sides and its
values never move), and the collectives of every step: one reduce-scatter per group that has
a trainable parameter, none for a frozen group, and the all-gathers FSDP2's schedule gives
(``suites/schedule``).

* ``per_group``: before ``fully_shard``, the biases of the first MLP and the whole ``in_proj``
  of the second are frozen: every group mixes trainable and frozen parameters.
* ``across_groups``: the second MLP is frozen whole before ``fully_shard``; after the first
  step it is unfrozen and the third frozen instead (the plain copy likewise), so a group
  starts and stops reducing between steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distconform.suites.cases import conformance, grid
from distconform.suites.models import MLPStack
from distconform.suites.schedule import ShardingPlan
from distconform.suites.training import train_with_parity

DIM = 8


def freeze(module: nn.Module | nn.Parameter, frozen: bool = True) -> None:
    params = [module] if isinstance(module, nn.Parameter) else module.parameters()
    for param in params:
        param.requires_grad_(not frozen)


def freeze_before_sharding(model: nn.Module, how: str) -> None:
    if how == "per_group":
        freeze(model[0].in_proj.bias)
        freeze(model[0].out_proj.bias)
        freeze(model[1].in_proj)
    else:
        freeze(model[1])


def swap_frozen_groups(step: int, model: nn.Module, reference: nn.Module) -> None:
    """After the first step the second MLP trains again and the third stops, on both."""
    if step != 0:
        return
    for target in (model, reference):
        freeze(target[1], frozen=False)
        freeze(target[2])


@conformance("fsdp.frozen_params")
@pytest.mark.parametrize("point", grid(frozen=["per_group", "across_groups"]))
def test_train_parity_with_frozen_params(rank_ctx, impl, point):
    with torch.device(rank_ctx.device):
        model = MLPStack(DIM)
    freeze_before_sharding(model, point["frozen"])
    plan = ShardingPlan(impl)

    def distribute(m: nn.Module) -> None:
        for mlp in m:
            plan.fully_shard(mlp)
        plan.fully_shard(m)

    train_with_parity(
        rank_ctx.rank,
        model,
        distribute,
        lambda: torch.randn(2, DIM, device=rank_ctx.device),
        schedule=plan,
        between_steps=swap_frozen_groups if point["frozen"] == "across_groups" else None,
    )
