"""Tensor parallel composed with fully_shard and replicate (cases.md §2.10, §2.11, §3.9).

The MLP stack is first parallelised with ``torch.distributed.tensor.parallel`` (its
parameters become DTensors on the ``tp`` mesh), then the data-parallel implementation puts its
own mesh dimensions in front: ``("dp", "tp")`` at world size 4, ``("dp_replicate",
"dp_shard", "tp")`` at world size 8 (HSDP), ``("dp_replicate", "tp")`` for replicate. Each is
trained next to a plain copy whose gradients are averaged over the data-parallel ranks (the
TP ranks of one replica see the same data): losses equal every step at fp32 default
tolerance; parameters' ``full_tensor()`` (strided sharding when dp and tp split the same dim)
equal the copy's before training and after it, and gradients every step (losses alone would
miss a missing average: Adam is invariant to the gradients' scale).

Activation checkpointing wraps each child's ``forward`` in ``torch.utils.checkpoint``
(non-reentrant) on the instance, so the data-parallel hooks of the module still run around
it and parameter names do not change.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from harness.parity import ReferenceModel, assert_losses_equal, assert_tensors_close
from suites.models import MLPStack

requires = pytest.mark.requires_capabilities
default_run = pytest.mark.default_run
STEPS = 10
MLP_DIMS = (3, 5, 16, 17)


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, foreach=False)


def mlp_stack_tp_plan() -> dict:
    """The catalogue's plan for ``MLPStack`` without sequence parallel."""
    plan: dict = {}
    for index in range(3):
        plan[f"{index}.in_proj"] = ColwiseParallel(use_local_output=False)
        plan[f"{index}.out_proj"] = RowwiseParallel(use_local_output=False)
    plan["2.out_proj"] = RowwiseParallel()
    return plan


def checkpoint_forward(module: nn.Module) -> None:
    forward = module.forward

    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def assert_full_parity(reference: nn.Module, model: nn.Module, *, grads: bool) -> None:
    """Every parameter (and gradient) gathered whole equals the reference's, by name."""
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        ref_param = ref_params[name]
        assert_tensors_close(f"parameter {name!r}", full(param.detach()), ref_param.detach())
        if grads:
            assert (param.grad is None) == (ref_param.grad is None), f"gradient of {name!r}"
            if param.grad is not None:
                assert_tensors_close(f"gradient of {name!r}", full(param.grad), ref_param.grad)


def assert_meshes(model: nn.Module, names: tuple[str, ...]) -> None:
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is a {type(param).__name__}, not a DTensor"
        assert param.device_mesh.mesh_dim_names == names, (name, param.device_mesh)
        assert len(param.placements) == len(names), (name, param.placements)


def grid(*axes: tuple[str, tuple]) -> list:
    """The cartesian product of named axes, ids ``name=value-...``; AC values need the
    activation-checkpointing capability."""
    params = []
    for values in itertools.product(*(choices for _, choices in axes)):
        named = dict(zip((name for name, _ in axes), values, strict=True))
        marks = [requires("activation_checkpointing")] if named.get("ac") else []
        params.append(
            pytest.param(
                *values, marks=marks, id="-".join(f"{k}={v}" for k, v in named.items())
            )
        )
    return params


def train_with_data_parallel(
    rank_ctx,
    model: nn.Module,
    reference: ReferenceModel,
    dp_rank: int,
    mlp_dim: int,
    *,
    check_grads: bool,
) -> None:
    optimizer = adam(model.parameters())
    assert_full_parity(reference.module, model, grads=False)
    torch.manual_seed(42 + dp_rank + 1)
    for step in range(STEPS):
        inp = torch.randn(8, mlp_dim, device=rank_ctx.device)
        loss = model(inp).sum()
        loss.backward()
        reference_loss = reference.forward_backward(lambda m, inp=inp: m(inp).sum())
        assert_losses_equal(step, loss, reference_loss)
        if check_grads:
            assert_full_parity(reference.module, model, grads=True)
        optimizer.step()
        set_to_none = step % 2 == 0
        optimizer.zero_grad(set_to_none=set_to_none)
        reference.step(set_to_none=set_to_none)
    assert_full_parity(reference.module, model, grads=False)


def fully_shard_after_tp(impl, model: MLPStack, tp_mesh, dp_mesh, ac: bool, raf: bool) -> None:
    parallelize_module(model, tp_mesh, mlp_stack_tp_plan())
    for child in model:
        if ac:
            checkpoint_forward(child)
        impl.fully_shard(child, mesh=dp_mesh, reshard_after_forward=raf)
    impl.fully_shard(model, mesh=dp_mesh, reshard_after_forward=raf)


FSDP_TP_GRID = grid(("raf", (False, True)), ("ac", (False, True)), ("dim", MLP_DIMS))


@pytest.mark.world_size(4)
@requires("tp")
@default_run("ws4-raf=True-ac=False-dim=17")
@pytest.mark.parametrize(("raf", "ac", "mlp_dim"), FSDP_TP_GRID)
def test_2d_fully_shard_tp(rank_ctx, impl, raf, ac, mlp_dim):
    mesh = rank_ctx.mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(42)
    model = MLPStack(mlp_dim)
    reference = ReferenceModel(model, adam, group=mesh["dp"].get_group())
    fully_shard_after_tp(impl, model, mesh["tp"], mesh["dp"], ac, raf)
    train_with_data_parallel(
        rank_ctx, model, reference, mesh["dp"].get_local_rank(), mlp_dim, check_grads=True
    )
    assert_meshes(model, ("dp", "tp"))


@pytest.mark.world_size(8)
@requires("tp", "hsdp")
@default_run()
@pytest.mark.parametrize(("raf", "ac", "mlp_dim"), FSDP_TP_GRID)
def test_3d_hsdp_tp(rank_ctx, impl, raf, ac, mlp_dim):
    names = ("dp_replicate", "dp_shard", "tp")
    mesh = rank_ctx.mesh((2, 2, 2), names)
    # The data-parallel ranks of one TP coordinate, as one group for the reference: the same
    # ranks, row-major, as the (dp_replicate, dp_shard) sub-mesh.
    dp_flat = rank_ctx.mesh((4, 2), ("dp", "tp"))["dp"]
    torch.manual_seed(42)
    model = MLPStack(mlp_dim)
    reference = ReferenceModel(model, adam, group=dp_flat.get_group())
    fully_shard_after_tp(impl, model, mesh["tp"], mesh["dp_replicate", "dp_shard"], ac, raf)
    train_with_data_parallel(
        rank_ctx, model, reference, dp_flat.get_local_rank(), mlp_dim, check_grads=True
    )
    assert_meshes(model, names)


@pytest.mark.world_size(4)
@requires("tp", "replicate")
@default_run("ws4-ac=False-dim=5")
@pytest.mark.parametrize(("ac", "mlp_dim"), grid(("ac", (False, True)), ("dim", MLP_DIMS)))
def test_replicate_tp(rank_ctx, impl, ac, mlp_dim):
    names = ("dp_replicate", "tp")
    mesh = rank_ctx.mesh((2, 2), names)
    torch.manual_seed(42)
    model = MLPStack(mlp_dim)
    reference = ReferenceModel(model, adam, group=mesh["dp_replicate"].get_group())
    parallelize_module(model, mesh["tp"], mlp_stack_tp_plan())
    for child in model:
        if ac:
            checkpoint_forward(child)
        impl.replicate(child, mesh=mesh["dp_replicate"])
    impl.replicate(model, mesh=mesh["dp_replicate"])
    train_with_data_parallel(
        rank_ctx, model, reference, mesh["dp_replicate"].get_local_rank(), mlp_dim,
        check_grads=True,
    )
    assert_meshes(model, names)
