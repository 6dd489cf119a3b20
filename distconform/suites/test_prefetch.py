"""Prefetching: which all-gathers run early, and in which order.

Prefetching changes no number, so these cases hold the implementation to FSDP2's schedule
(``suites/schedule``) every step, next to the usual parity checks:

* **explicit** (upstream): an 8-layer Transformer; layer i prefetches layers i+1 and i+2 in
  forward (i < 6) and layers i-1 and i-2 in backward (i >= 2): their all-gathers must come
  before layer i computes, and none may be added.
* **orders**: blocks of distinct sizes (so each all-gather names its block), with lists in
  orders FSDP2 does not pick by itself: forward ``[i+2, i+1]``, backward ``[i-2, i-1]`` or a
  single block two back. The all-gathers must follow the list order.
* **implicit**: no lists; entering a block's backward must all-gather the block whose
  forward finished just before it, ahead of the block's own backward computation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distconform.suites.cases import conformance, grid
from distconform.suites.models import ModelArgs, Transformer
from distconform.suites.schedule import ShardingPlan
from distconform.suites.training import adamw, train_width_stack, train_with_parity

N_LAYERS = 8
STEPS = 3  # the schedule is the same every step; three show it is kept across steps


def set_upstream_prefetching(plan: ShardingPlan, model: nn.Module) -> None:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        controls = plan.controls(layer)
        if i < N_LAYERS - 2:
            controls.set_modules_to_forward_prefetch([layers[i + 1], layers[i + 2]])
        if i >= 2:
            controls.set_modules_to_backward_prefetch([layers[i - 1], layers[i - 2]])


def run_upstream_prefetching(rank_ctx, impl, manage: str) -> None:
    plan = ShardingPlan(impl)

    def shard(model: nn.Module) -> None:
        for layer in [*model.layers, model]:
            getattr(plan, manage)(layer)
        set_upstream_prefetching(plan, model)

    with torch.device(rank_ctx.device):
        model = Transformer(ModelArgs(n_layers=N_LAYERS, dropout_p=0.0))
    train_with_parity(
        rank_ctx.rank,
        model,
        shard,
        lambda: torch.randint(0, 8, (2, 8), device=rank_ctx.device),
        schedule=plan,
        make_optimizer=adamw,
        seed_offset=0,
    )


@conformance("fsdp.prefetch.explicit")
def test_explicit_prefetching(rank_ctx, impl):
    run_upstream_prefetching(rank_ctx, impl, "fully_shard")


@conformance("replicate.prefetch.explicit")
def test_replicate_explicit_prefetching(rank_ctx, impl):
    run_upstream_prefetching(rank_ctx, impl, "replicate")


def forward_lists(layers: list[nn.Module], order: str) -> dict[int, list[nn.Module]]:
    n = len(layers)
    if order == "reversed":  # the farther block first
        return {i: [layers[i + 2], layers[i + 1]] for i in range(n - 2)}
    return {}


def backward_lists(layers: list[nn.Module], order: str) -> dict[int, list[nn.Module]]:
    n = len(layers)
    if order == "reversed":
        return {i: [layers[i - 2], layers[i - 1]] for i in range(2, n)}
    if order == "skip_one":  # only the block two back: the one in between gathers itself
        return {i: [layers[i - 2]] for i in range(2, n)}
    return {}


def run_width_stack(rank_ctx, impl, forward_order: str, backward_order: str) -> None:
    def shard(plan: ShardingPlan, model: nn.Module) -> None:
        layers = list(model.layers)
        for layer in layers:
            plan.fully_shard(layer)
        plan.fully_shard(model)
        for i, targets in forward_lists(layers, forward_order).items():
            plan.controls(layers[i]).set_modules_to_forward_prefetch(targets)
        for i, targets in backward_lists(layers, backward_order).items():
            plan.controls(layers[i]).set_modules_to_backward_prefetch(targets)

    train_width_stack(rank_ctx, impl, 6, shard, steps=STEPS)


@conformance("fsdp.prefetch.orders")
@pytest.mark.parametrize(
    "point",
    grid(forward=["reversed", "none"], backward=["reversed", "skip_one"]),
)
def test_prefetch_list_order(rank_ctx, impl, point):
    run_width_stack(rank_ctx, impl, point["forward"], point["backward"])


@conformance("fsdp.prefetch.implicit")
def test_implicit_backward_prefetch(rank_ctx, impl):
    run_width_stack(rank_ctx, impl, "none", "none")
