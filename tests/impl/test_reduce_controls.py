"""``set_gradient_divide_factor`` and ``set_force_sum_reduction_for_comms`` (issue 6).

By default a reduced gradient is the sum over the data-parallel ranks divided by their number
(shard size x replicate size). ``set_gradient_divide_factor(f)`` divides the sum by ``f``
instead; ``set_force_sum_reduction_for_comms(True)`` makes the collectives use SUM and divide
locally, which changes how, not what, is computed. Both apply to the module's own group only
(FSDP2's semantics), so the tests call them on every managed module.

torch's FSDP2 implements a divide factor other than the shard size with
``ReduceOp.PREMUL_SUM`` unless sum reduction is forced; gloo has no PREMUL_SUM, so that one
combination is skipped for ``--impl torch`` on gloo. The reference always sums and divides.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.parity import assert_sharded_parity
from suites.models import MLPStack
from tests.impl.comm_count import count_collectives

slow = pytest.mark.slow


def run_reduce_controls(
    rank_ctx, impl, mesh_shape: tuple[int, ...], factor: float | None, force_sum: bool
) -> None:
    if (
        impl.name == "torch"
        and rank_ctx.backend == "gloo"
        and not force_sum
        and factor not in (None, mesh_shape[-1])
    ):
        pytest.skip("torch's FSDP2 divides by this factor with PREMUL_SUM, which gloo lacks")
    mesh = rank_ctx.mesh(mesh_shape, None if len(mesh_shape) == 1 else ("rep", "shard"))
    model = MLPStack(8)
    reference = copy.deepcopy(model)
    for mlp in model:
        impl.fully_shard(mlp, mesh=mesh)
    impl.fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, impl.FSDPModule):
            if factor is not None:
                module.set_gradient_divide_factor(factor)
            module.set_force_sum_reduction_for_comms(force_sum)
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for _ in range(2):  # the second backward accumulates into the sharded gradients
        inp = torch.randn(4, 8)
        with count_collectives() as counts:
            model(inp).sum().backward()
        reference(inp).sum().backward()
        assert counts["reduce_scatter_single"] == 3, dict(counts)
        assert counts["all_reduce"] == (3 if len(mesh_shape) == 2 else 0), dict(counts)
    divisor = factor if factor is not None else rank_ctx.world_size
    for param in reference.parameters():
        dist.all_reduce(param.grad)
        param.grad /= divisor
    assert_sharded_parity(reference, model)


CASES_1D = [
    pytest.param(None, True, id="default-factor-force-sum"),
    pytest.param(3.0, True, id="factor=3-force-sum"),
    pytest.param(2.0, False, id="factor=shard-size"),
    pytest.param(3.0, False, id="factor=3"),
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("factor, force_sum", CASES_1D)
def test_divide_factor_and_sum_reduction(rank_ctx, impl, factor, force_sum):
    run_reduce_controls(rank_ctx, impl, (2,), factor, force_sum)


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "factor, force_sum",
    [
        pytest.param(3.0, True, id="factor=3-force-sum"),
        pytest.param(None, True, id="default-factor-force-sum", marks=slow),
        pytest.param(2.0, False, id="factor=shard-size", marks=slow),
        pytest.param(5.0, False, id="factor=5", marks=slow),
    ],
)
def test_divide_factor_and_sum_reduction_hsdp(rank_ctx, impl, factor, force_sum):
    run_reduce_controls(rank_ctx, impl, (2, 2), factor, force_sum)


@pytest.mark.world_size(2)
def test_divide_factor_applies_to_own_group_only(rank_ctx, impl):
    """FSDP2's setters are not recursive: the root's factor leaves its children's groups alone."""
    model = nn.Sequential(nn.Linear(8, 8), MLPStack(8))
    reference = copy.deepcopy(model)
    for mlp in model[1]:
        impl.fully_shard(mlp)
    impl.fully_shard(model)
    model.set_gradient_divide_factor(8.0)
    model.set_force_sum_reduction_for_comms(True)  # no PREMUL_SUM needed (gloo has none)
    inp = torch.randn(4, 8)
    model(inp).sum().backward()
    reference(inp).sum().backward()
    for name, param in reference.named_parameters():
        dist.all_reduce(param.grad)
        # Only model[0] belongs to the root's group.
        param.grad /= 8.0 if name.startswith("0.") else dist.get_world_size()
    assert_sharded_parity(reference, model)
