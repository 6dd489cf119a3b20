"""``set_gradient_divide_factor`` and ``set_force_sum_reduction_for_comms``.

By default a reduced gradient is the sum over the data-parallel ranks divided by their number
(shard size x replicate size). ``set_gradient_divide_factor(f)`` divides the sum by ``f``
instead; ``set_force_sum_reduction_for_comms(True)`` makes the collectives reduce with SUM and
divide locally, which changes how, not what, is computed: the schedule oracle holds every
reduction of such a group to ``op=SUM``. Both apply to the module's own group only (FSDP2's
setters do not recurse), so the cases call them on every managed module, and one case checks
that a root's factor leaves its children alone.

A divide factor other than the shard size without forced SUM needs a backend that can scale
inside the reduction (FSDP2 uses ``PREMUL_SUM``); gloo cannot, so that item is expected to
fail for torch's FSDP2 on gloo (``suites/expectations/torch-<version>.toml``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.parity import assert_sharded_parity
from suites.cases import conformance, grid
from suites.models import MLPStack
from suites.schedule import ScheduleRecorder, ShardingPlan


def run_reduce_controls(
    rank_ctx, impl, mesh_shape: tuple[int, ...], factor: float | None, force_sum: bool
) -> None:
    mesh = rank_ctx.mesh(mesh_shape, None if len(mesh_shape) == 1 else ("rep", "shard"))
    with torch.device(rank_ctx.device):
        model = MLPStack(8)
    reference = copy.deepcopy(model)
    plan = ShardingPlan(impl, mesh=mesh)
    for mlp in model:
        plan.fully_shard(mlp, mesh=mesh)
    plan.fully_shard(model, mesh=mesh)
    for module in [*model, model]:
        controls = plan.controls(module)
        if factor is not None:
            controls.set_gradient_divide_factor(factor)
        controls.set_force_sum_reduction_for_comms(force_sum)
    recorder = ScheduleRecorder(plan, model)
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for step in range(2):  # the second backward accumulates into the sharded gradients
        inp = torch.randn(4, 8, device=rank_ctx.device)
        with recorder.step(f"backward {step}"):
            model(inp).sum().backward()
        reference(inp).sum().backward()
    divisor = factor if factor is not None else rank_ctx.world_size
    for param in reference.parameters():
        dist.all_reduce(param.grad)
        param.grad /= divisor
    assert_sharded_parity(reference, model)


FACTORS = {"none": None, "3": 3.0, "shard": "shard", "5": 5.0}


def factor_of(point: dict, mesh_shape: tuple[int, ...]) -> float | None:
    factor = FACTORS[point["factor"]]
    return float(mesh_shape[-1]) if factor == "shard" else factor


@conformance("fsdp.reduce_controls.divide_factor")
@pytest.mark.parametrize(
    "point",
    [
        *grid(factor=["none", "3"], force_sum=[True]),
        *grid(factor=["shard", "3"], force_sum=[False]),
    ],
)
def test_divide_factor_and_sum_reduction(rank_ctx, impl, point):
    shape = (rank_ctx.world_size,)
    run_reduce_controls(rank_ctx, impl, shape, factor_of(point, shape), point["force_sum"])


@conformance("fsdp.reduce_controls.divide_factor_hsdp")
@pytest.mark.parametrize(
    "point",
    [
        *grid(factor=["3", "none"], force_sum=[True]),
        *grid(factor=["shard", "5"], force_sum=[False]),
    ],
)
def test_divide_factor_and_sum_reduction_hsdp(rank_ctx, impl, point):
    shape = (2, rank_ctx.world_size // 2)
    run_reduce_controls(rank_ctx, impl, shape, factor_of(point, shape), point["force_sum"])


@conformance("fsdp.reduce_controls.own_group_only")
def test_divide_factor_applies_to_own_group_only(rank_ctx, impl):
    """FSDP2's setters are not recursive: the root's factor leaves its children's groups alone."""
    with torch.device(rank_ctx.device):
        model = nn.Sequential(nn.Linear(8, 8), MLPStack(8))
    reference = copy.deepcopy(model)
    plan = ShardingPlan(impl)
    for mlp in model[1]:
        plan.fully_shard(mlp)
    plan.fully_shard(model)
    plan.controls(model).set_gradient_divide_factor(8.0)
    plan.controls(model).set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    recorder = ScheduleRecorder(plan, model)
    inp = torch.randn(4, 8, device=rank_ctx.device)
    with recorder.step("backward"):
        model(inp).sum().backward()
    reference(inp).sum().backward()
    for name, param in reference.named_parameters():
        dist.all_reduce(param.grad)
        # Only model[0] belongs to the root's group.
        param.grad /= 8.0 if name.startswith("0.") else dist.get_world_size()
    assert_sharded_parity(reference, model)
