"""``state_dict()`` and ``load_state_dict()`` while parameters are unsharded.

FSDP2's state dict is sharded whatever state the parameters are in: each value is the
parameter's ``DTensor`` (``Shard(0)`` over the mesh, the rank's ``torch.chunk`` of the full
parameter), and a load lands in the sharded parameters, the ones the optimizer steps and the
next all-gather reads. Both hold between an explicit ``unshard()`` and the next reshard, and
after a forward with ``reshard_after_forward=False``, where the registered parameters are the
plain unsharded tensors. The oracle is the plain model copied before sharding: its parameters
chunked per rank, and its forward and backward with the loaded values.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from distconform.api import assert_sharded_parity
from distconform.suites.cases import conformance, grid
from distconform.suites.models import MLPStack
from distconform.suites.schedule import ShardingPlan

MLP_DIM = 8
#: Added to every loaded value: different from any value the model holds.
LOAD_DELTA = 0.25


def sharded_stack(rank_ctx, impl, reshard_after_forward: bool) -> tuple[Any, nn.Module, Any]:
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = MLPStack(MLP_DIM)
    reference = copy.deepcopy(model)
    plan = ShardingPlan(impl)
    for mlp in model:
        plan.fully_shard(mlp, reshard_after_forward=reshard_after_forward)
    plan.fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model, reference, plan


def make_unsharded(model: nn.Module, plan: ShardingPlan, how: str, inp: torch.Tensor):
    """Unshard every group: explicitly, or by a forward that keeps them unsharded. Returns
    the forward's output (None for an explicit unshard)."""
    if how == "explicit_unshard":
        for module in [model, *model]:
            plan.controls(module).unshard()
        return None
    return model(inp)


def assert_sharded_state_dict(state: dict, reference: nn.Module, when: str) -> None:
    """Every value is a DTensor holding this rank's Shard(0) chunk of the full parameter."""
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = dict(reference.named_parameters())
    assert set(state) == set(expected), (
        f"state_dict() {when}: keys {sorted(state)}, expected the plain model's {sorted(expected)}"
    )
    for name, value in state.items():
        assert isinstance(value, DTensor), (
            f"state_dict() {when}: {name!r} is a plain {type(value).__name__} of shape "
            f"{tuple(value.shape)}, not the sharded DTensor: the state dict must stay sharded "
            f"while the parameters are unsharded"
        )
        assert tuple(value.placements) == (Shard(0),), (
            f"state_dict() {when}: {name!r} has placements {value.placements}, expected (Shard(0),)"
        )
        chunks = torch.chunk(expected[name].detach(), world, dim=0)
        local = chunks[rank] if rank < len(chunks) else expected[name].new_empty(0)
        torch.testing.assert_close(
            value.to_local().reshape(local.shape),
            local,
            msg=lambda m, n=name: f"state_dict() {when}: rank {rank}'s shard of {n!r}: {m}",
        )


@conformance("fsdp.state_dict.while_unsharded")
@pytest.mark.parametrize("point", grid(how=["explicit_unshard", "raf_false_forward"]))
def test_state_dict_while_unsharded_is_sharded(rank_ctx, impl, point):
    """Fails on ``tests.suites.broken:state_dict_skips_reshard`` ("'0.in_proj.weight' is a plain
    Tensor of shape (24, 8), not the sharded DTensor")."""
    how = point["how"]
    model, reference, plan = sharded_stack(rank_ctx, impl, how != "raf_false_forward")
    torch.manual_seed(7 + rank_ctx.rank)
    inp = torch.randn(4, MLP_DIM, device=rank_ctx.device)
    out = make_unsharded(model, plan, how, inp)
    assert_sharded_state_dict(model.state_dict(), reference, f"after {how}")
    if out is not None:
        # The step the state dict interrupted still completes with the right gradients.
        out.sum().backward()
        reference(inp).sum().backward()
        for param in reference.parameters():
            dist.all_reduce(param.grad)
            param.grad /= rank_ctx.world_size
        assert_sharded_parity(reference, model)


@conformance("fsdp.state_dict.load_while_unsharded")
@pytest.mark.parametrize("point", grid(how=["explicit_unshard", "raf_false_forward"]))
def test_load_state_dict_while_unsharded_lands_in_the_sharded_parameters(rank_ctx, impl, point):
    """Fails on ``tests.suites.broken:load_into_unsharded`` (the loaded values reach only the
    unsharded copy, which the next reshard drops: "state_dict() load after explicit_unshard,
    then reshard: rank 0's shard of '0.in_proj.weight': Tensor-likes are not close!")."""
    how = point["how"]
    model, reference, plan = sharded_stack(rank_ctx, impl, how != "raf_false_forward")
    torch.manual_seed(7 + rank_ctx.rank)
    inp = torch.randn(4, MLP_DIM, device=rank_ctx.device)
    loaded = {}
    for name, value in model.state_dict().items():
        assert isinstance(value, DTensor), f"state_dict(): {name!r} is not a DTensor"
        loaded[name] = DTensor.from_local(
            value.to_local() + LOAD_DELTA, value.device_mesh, value.placements, run_check=False
        )
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(LOAD_DELTA)
    make_unsharded(model, plan, how, inp)
    model.load_state_dict(loaded)
    # Reshard everything, so the next forward gathers whatever the sharded parameters hold.
    for module in [model, *model]:
        plan.controls(module).reshard()
    assert_sharded_state_dict(model.state_dict(), reference, f"load after {how}, then reshard")
    torch.testing.assert_close(
        model(inp),
        reference(inp),
        msg=lambda m: f"after reshard and forward, the loaded values are not the ones used: {m}",
    )
