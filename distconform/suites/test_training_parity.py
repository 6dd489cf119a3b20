"""Training parity with one and several groups, under fully_shard and replicate.

Every case trains 3 Adam steps (``distconform.suites.training.STEPS``) next to a plain copy with
explicit gradient averaging, on different data per rank (seed ``42 + rank + 1``): losses
every step, parameters and gradients shard by shard every step, and every step's
collectives against FSDP2's schedule for the sharding plan (``suites/schedule``: kind,
ranks, dtype, elements per rank, and where each is issued relative to the modules' forward
and backward).
Unlike the replicate upstream tests, the optimizer steps before ``zero_grad`` (the upstream
order made every step a no-op), and parameters are compared after each step.

Multi-group cases inject the upstream delays (``distconform.suites.training.inject_delay``: 100 ms
on an accelerator's stream, 10 ms of host time on the CPU) before each all-gather, before each
gradient reduction (the all-reduce for replicate), after forward and before the optimizer; none, one
at a time, or all four.

Beyond upstream, the same checks cover other groupings: three MLP groups under a root that
owns no parameter, the default reshard policy (``reshard_after_forward=None``: the root keeps
its parameters after forward, every block reshards), the whole Transformer as one group, and
``fully_shard([a, b])`` as one group next to the root's own parameters.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from distconform.suites.cases import conformance, grid
from distconform.suites.models import MLP, MLPStack
from distconform.suites.schedule import ShardingPlan
from distconform.suites.training import (
    SUMMED_LOGITS_GRAD_TOLERANCE,
    blocks,
    collective_delays,
    delay_id,
    delay_sets,
    host_delay,
    train_with_parity,
    transformer,
    transformer_tokens,
)

LIN_SHAPES = {
    "16x15_15x8": [(16, 15), (15, 8)],
    "7x15_15x3": [(7, 15), (15, 3)],
    "16x17_17x8": [(16, 17), (17, 8)],
}
DELAY_SETS = {delay_id(d): d for d in delay_sets()}


def two_linears(label: str) -> nn.Module:
    shapes = LIN_SHAPES.get(label) or [(32, 16), (16, 8)]
    return nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(), nn.Linear(*shapes[1]))


def shard_largest_dim(param: nn.Parameter) -> Shard:
    return Shard(param.shape.index(max(param.shape)))


def run_single_group(
    rank_ctx, impl, label: str, *, replicate: bool = False, placement_fn=None
) -> None:
    in_dim = (LIN_SHAPES.get(label) or [(32, 16)])[0][0]
    inp = torch.randn(4, in_dim, device=rank_ctx.device)  # upstream: fixed across steps
    plan = ShardingPlan(impl)
    with torch.device(rank_ctx.device):
        model = two_linears(label)

    def distribute(model: nn.Module) -> None:
        if replicate:
            plan.replicate(model)
            return
        plan.fully_shard(model, shard_placement_fn=placement_fn)
        if placement_fn is not None:
            placements = {p.placements for p in model.parameters()}
            assert (Shard(1),) in placements, f"no parameter sharded on dim 1: {placements}"

    train_with_parity(rank_ctx.rank, model, distribute, lambda: inp, schedule=plan)


@conformance("fsdp.parity.single_group")
@pytest.mark.parametrize("point", grid(lin_shapes=list(LIN_SHAPES)))
def test_train_parity_single_group_shard_dim0(rank_ctx, impl, point):
    run_single_group(rank_ctx, impl, point["lin_shapes"])


@conformance("fsdp.parity.single_group_largest_dim")
def test_train_parity_single_group_shard_largest_dim(rank_ctx, impl):
    run_single_group(rank_ctx, impl, "32x16_16x8", placement_fn=shard_largest_dim)


@conformance("replicate.parity.single_group")
@pytest.mark.parametrize("point", grid(lin_shapes=list(LIN_SHAPES)))
def test_replicate_train_parity_single_group(rank_ctx, impl, point):
    run_single_group(rank_ctx, impl, point["lin_shapes"], replicate=True)


def run_multi_group(
    rank_ctx,
    impl,
    *,
    raf: bool | int = True,
    delays: tuple[str, ...] = (),
    offload_policy=None,
    unshard_async: bool = False,
    replicate: bool = False,
) -> None:
    model = transformer(3, device=rank_ctx.device)
    mesh = rank_ctx.mesh((rank_ctx.world_size,), ("replicate",) if replicate else None)
    plan = ShardingPlan(impl, mesh=mesh)

    def distribute(m: nn.Module) -> None:
        for module in [*blocks(m), m]:
            if replicate:
                plan.replicate(module, mesh=mesh, offload_policy=offload_policy)
            else:
                plan.fully_shard(
                    module, mesh=mesh, reshard_after_forward=raf, offload_policy=offload_policy
                )
            if unshard_async:
                impl.set_unshard_async_op(module, True)

    train_with_parity(
        rank_ctx.rank,
        model,
        distribute,
        lambda: transformer_tokens(rank_ctx.device),
        schedule=plan,
        model_context=collective_delays(delays, rank_ctx.device, replicate=replicate),
        after_forward=host_delay("after_forward" in delays, rank_ctx.device),
        before_step=host_delay("before_optim" in delays, rank_ctx.device),
        grad_tolerance=SUMMED_LOGITS_GRAD_TOLERANCE,
    )


@conformance("fsdp.parity.multi_group")
@pytest.mark.parametrize("point", grid(raf=[True, False, 2], delays=list(DELAY_SETS)))
def test_train_parity_multi_group(rank_ctx, impl, point):
    run_multi_group(rank_ctx, impl, raf=point["raf"], delays=DELAY_SETS[point["delays"]])


@conformance("fsdp.parity.multi_group_cpu_offload")
@pytest.mark.parametrize("point", grid(pin_memory=[True, False], delays=list(DELAY_SETS)))
def test_train_parity_multi_group_cpu_offload(rank_ctx, impl, point):
    run_multi_group(
        rank_ctx,
        impl,
        raf=True,
        delays=DELAY_SETS[point["delays"]],
        offload_policy=impl.CPUOffloadPolicy(pin_memory=point["pin_memory"]),
    )


@conformance("fsdp.parity.multi_group_unshard_async")
@pytest.mark.parametrize("point", grid(delays=list(DELAY_SETS)))
def test_train_parity_multi_group_unshard_async_op(rank_ctx, impl, point):
    run_multi_group(
        rank_ctx, impl, raf=True, delays=DELAY_SETS[point["delays"]], unshard_async=True
    )


@conformance("replicate.parity.multi_group")
@pytest.mark.parametrize("point", grid(delays=list(DELAY_SETS)))
def test_replicate_train_parity_multi_group(rank_ctx, impl, point):
    run_multi_group(rank_ctx, impl, delays=DELAY_SETS[point["delays"]], replicate=True)


@conformance("replicate.parity.multi_group_cpu_offload")
@pytest.mark.parametrize("point", grid(pin_memory=[True, False], delays=list(DELAY_SETS)))
def test_replicate_train_parity_multi_group_cpu_offload(rank_ctx, impl, point):
    run_multi_group(
        rank_ctx,
        impl,
        delays=DELAY_SETS[point["delays"]],
        offload_policy=impl.CPUOffloadPolicy(pin_memory=point["pin_memory"]),
        replicate=True,
    )


# --- other groupings ----------------------------------------------------------------------------


@conformance("fsdp.parity.mlp_stack")
@pytest.mark.parametrize("point", grid(raf=[True, False, 2], mlp_dim=[5, 17]))
def test_train_parity_mlp_stack(rank_ctx, impl, point):
    """Each MLP a group, the root owning no parameter of its own."""
    plan = ShardingPlan(impl)

    def distribute(model: nn.Module) -> None:
        for mlp in model:
            plan.fully_shard(mlp, reshard_after_forward=point["raf"])
        plan.fully_shard(model, reshard_after_forward=point["raf"])

    dim = point["mlp_dim"]
    with torch.device(rank_ctx.device):
        model = MLPStack(dim)
    train_with_parity(
        rank_ctx.rank,
        model,
        distribute,
        lambda: torch.randn(8, dim, device=rank_ctx.device),
        schedule=plan,
    )


def run_transformer_groups(rank_ctx, impl, distribute) -> None:
    """``distribute(plan, model)`` shards a 2-block Transformer through the plan."""
    plan = ShardingPlan(impl)
    train_with_parity(
        rank_ctx.rank,
        transformer(2, device=rank_ctx.device),
        lambda model: distribute(plan, model),
        lambda: transformer_tokens(rank_ctx.device),
        schedule=plan,
        # Gradients of a sum over 3 x 64 x 1024 logits, reduced from flat group buffers.
        grad_tolerance=SUMMED_LOGITS_GRAD_TOLERANCE,
    )


@conformance("fsdp.parity.default_reshard_policy")
def test_train_parity_default_reshard_policy(rank_ctx, impl):
    def distribute(plan: ShardingPlan, model: nn.Module) -> None:
        for module in [*blocks(model), model]:
            plan.fully_shard(module, reshard_after_forward=None)

    run_transformer_groups(rank_ctx, impl, distribute)


@conformance("fsdp.parity.root_only")
def test_train_parity_transformer_root_only(rank_ctx, impl):
    run_transformer_groups(rank_ctx, impl, lambda plan, model: plan.fully_shard(model))


class TwoLinearsAndHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = MLP(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(torch.relu(self.a(x))))


@conformance("fsdp.parity.grouped_modules")
def test_train_parity_grouped_modules(rank_ctx, impl):
    """``fully_shard([a, b])`` is one group (gathered and reduced once for both), which
    reshards after forward; the root owns the head."""
    plan = ShardingPlan(impl)

    def distribute(model: nn.Module) -> None:
        plan.fully_shard([model.a, model.b])
        plan.fully_shard(model)

    with torch.device(rank_ctx.device):
        model = TwoLinearsAndHead()
    train_with_parity(
        rank_ctx.rank,
        model,
        distribute,
        lambda: torch.randn(4, 8, device=rank_ctx.device),
        schedule=plan,
    )
