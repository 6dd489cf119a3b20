"""CPU offload: where every tensor lives between steps, on 1-D and HSDP meshes.

The parity side of upstream's ``test_train_parity_multi_group_cpu_offload_eager`` is
``test_training_parity``'s; here an MLP stack is checked tensor by tensor.

With ``CPUOffloadPolicy`` the sharded parameters, their gradients and hence the optimizer
state live on the CPU between steps; forward and backward run on the compute device (the
rank's device), so every unshard copies the shard there first. Offload changes where
tensors live, not what is communicated: each step's collectives must be the same schedule as
without offload (``suites/schedule``), on the compute device.

On a CPU-only machine the two devices coincide, so the location checks cannot tell an
implementation that offloads from one that does not; they bite on accelerator runs. What a
CPU run does check: the schedule, the numerics, that between steps every parameter is still
a sharded ``DTensor`` whose shard and gradient are on the CPU (a group that never reshards
fails here), and that ``pin_memory=True`` without an accelerator is refused at once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distconform.api import assert_losses_equal, assert_sharded_parity, average_gradients
from distconform.suites.cases import conformance, grid
from distconform.suites.models import MLPStack
from distconform.suites.schedule import ScheduleRecorder, ShardingPlan
from distconform.suites.training import adam

CPU = torch.device("cpu")


def offload_policy(impl, device: torch.device):
    # Pinned host memory exists only to speed up copies to an accelerator.
    return impl.CPUOffloadPolicy(pin_memory=device.type != "cpu")


def assert_offloaded(model: nn.Module, optimizer: torch.optim.Optimizer, pinned: bool) -> None:
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is not a sharded DTensor between steps"
        assert param.device == CPU and param.to_local().device == CPU, (
            f"{name} lives on {param.to_local().device} between steps, not on the CPU"
        )
        if pinned:
            assert param.to_local().is_pinned(), f"{name} is not in pinned memory"
        if param.grad is not None:
            assert param.grad.to_local().device == CPU, (
                f"{name}.grad lives on {param.grad.to_local().device}, not on the CPU"
            )
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if isinstance(value, DTensor) else value
                assert local.device == CPU, f"optimizer state {key} lives on {local.device}"


def run_offload_parity(rank_ctx, impl, mesh_shape: tuple[int, ...], raf: bool) -> None:
    device = rank_ctx.device
    mesh = rank_ctx.mesh(mesh_shape, ("replicate", "shard")) if len(mesh_shape) > 1 else None
    with torch.device(device):
        model = MLPStack(8)
    reference = copy.deepcopy(model)
    policy = offload_policy(impl, device)
    plan = ShardingPlan(impl, mesh=mesh)
    for mlp in model:
        plan.fully_shard(mlp, mesh=mesh, reshard_after_forward=raf, offload_policy=policy)
    plan.fully_shard(model, mesh=mesh, reshard_after_forward=raf, offload_policy=policy)
    recorder = ScheduleRecorder(plan, model)
    optimizer = adam(model.parameters())
    reference_optimizer = adam(reference.parameters())
    compute_devices: list[torch.device] = []
    model[1].register_forward_pre_hook(
        lambda m, _args: compute_devices.append(m.in_proj.weight.device)
    )
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for step in range(5):
        inp = torch.randn(4, 8, device=device)
        with recorder.step(f"step {step}"):
            loss = model(inp).sum()
            loss.backward()
        reference_loss = reference(inp).sum()
        reference_loss.backward()
        average_gradients(reference)
        assert_losses_equal(step, loss, reference_loss)
        assert_sharded_parity(reference, model)
        optimizer.step()
        reference_optimizer.step()
        assert_offloaded(model, optimizer, pinned=policy.pin_memory)
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        reference_optimizer.zero_grad(set_to_none=step % 2 == 0)
    # The unsharded parameters (what forward computes with) are on the compute device.
    assert set(compute_devices) == {torch.device(device)}, compute_devices


@conformance("fsdp.offload.parity")
@pytest.mark.parametrize("point", grid(raf=[True, False]))
def test_cpu_offload_training_parity(rank_ctx, impl, point):
    run_offload_parity(rank_ctx, impl, (rank_ctx.world_size,), raf=point["raf"])


@conformance("fsdp.offload.hsdp")
def test_cpu_offload_hsdp_training_parity(rank_ctx, impl):
    run_offload_parity(rank_ctx, impl, (2, rank_ctx.world_size // 2), raf=True)


@conformance("fsdp.offload.pin_memory_refused")
@pytest.mark.parametrize("point", grid(manage=["fully_shard", "replicate"]))
def test_pin_memory_without_accelerator_is_refused(rank_ctx, impl, point):
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is available: pin_memory=True is legitimate here")
    with torch.device(rank_ctx.device):
        model = MLPStack(8)
    manage = getattr(impl, point["manage"])
    # torch refuses when it first pins (fully_shard); the reference refuses in fully_shard.
    with pytest.raises(RuntimeError):
        manage(model, offload_policy=impl.CPUOffloadPolicy(pin_memory=True))
        model(torch.randn(2, 8, device=rank_ctx.device)).sum().backward()
