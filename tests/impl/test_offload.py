"""CPU offload (cases.md §2.4 multi_group_cpu_offload_eager, §2.12; §6.1).

With ``CPUOffloadPolicy`` the sharded parameters, their gradients and hence the optimizer
state live on the CPU; forward and backward run on the compute device (the rank's device),
so every unshard copies the shard there first. On a CPU-only machine the two devices
coincide and offload is bookkeeping, but the numerics and placement rules still hold:
training matches the reference, and everything the optimizer touches is on the CPU.
``pin_memory=True`` needs an accelerator; without one it is refused at once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients
from suites.models import MLPStack
from tests.impl.comm_count import count_collectives
from tests.impl.test_training_parity import adam

slow = pytest.mark.slow
CPU = torch.device("cpu")


def offload_policy(impl, device: torch.device):
    # Pinned host memory exists only to speed up copies to an accelerator.
    return impl.CPUOffloadPolicy(pin_memory=device.type != "cpu")


def assert_on_cpu(model: nn.Module, optimizer: torch.optim.Optimizer, pinned: bool) -> None:
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.device == CPU and param.to_local().device == CPU, (name, param.device)
        if pinned:
            assert param.to_local().is_pinned(), name
        if param.grad is not None:
            assert param.grad.to_local().device == CPU, (name, param.grad.device)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if isinstance(value, DTensor) else value
                assert local.device == CPU, (key, local.device)


def run_offload_parity(rank_ctx, impl, mesh_shape: tuple[int, ...], raf: bool) -> None:
    device = rank_ctx.device
    mesh = rank_ctx.mesh(mesh_shape) if len(mesh_shape) > 1 else None
    model = MLPStack(8).to(device)
    reference = copy.deepcopy(model)
    policy = offload_policy(impl, device)
    for mlp in model:
        impl.fully_shard(mlp, mesh=mesh, reshard_after_forward=raf, offload_policy=policy)
    impl.fully_shard(model, mesh=mesh, reshard_after_forward=raf, offload_policy=policy)
    optimizer = adam(model.parameters())
    reference_optimizer = adam(reference.parameters())
    compute_devices: list[torch.device] = []
    model[1].register_forward_pre_hook(
        lambda m, _args: compute_devices.append(m.in_proj.weight.device)
    )
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for step in range(5):
        inp = torch.randn(4, 8, device=device)
        with count_collectives() as counts:
            loss = model(inp).sum()
            loss.backward()
        reference_loss = reference(inp).sum()
        reference_loss.backward()
        average_gradients(reference)
        assert_losses_equal(step, loss, reference_loss)
        # Offload changes where tensors live, not what is communicated.
        assert counts["reduce_scatter_single"] == (3 if mesh_shape[-1] > 1 else 0), dict(counts)
        assert_sharded_parity(reference, model)
        optimizer.step()
        reference_optimizer.step()
        assert_on_cpu(model, optimizer, pinned=policy.pin_memory)
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        reference_optimizer.zero_grad(set_to_none=step % 2 == 0)
    # The unsharded parameters (what forward computes with) are on the compute device.
    assert set(compute_devices) == {torch.device(device)}, compute_devices


@pytest.mark.world_size(2, 4, slow=(4,))
@pytest.mark.parametrize("raf", [True, pytest.param(False, marks=slow)], ids=lambda v: f"raf={v}")
def test_cpu_offload_training_parity(rank_ctx, impl, raf):
    run_offload_parity(rank_ctx, impl, (rank_ctx.world_size,), raf=raf)


@slow
@pytest.mark.world_size(4)
def test_cpu_offload_hsdp_training_parity(rank_ctx, impl):
    run_offload_parity(rank_ctx, impl, (2, 2), raf=True)


@pytest.mark.world_size(1)
def test_cpu_offload_world_size_1(rank_ctx, impl):
    """No all-gather: the unshard is a copy from the CPU shard to the compute device."""
    run_offload_parity(rank_ctx, impl, (1,), raf=True)


@pytest.mark.world_size(2)
def test_pin_memory_without_accelerator_is_refused(rank_ctx, impl):
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is available: pin_memory=True is legitimate here")
    model = MLPStack(8)
    # torch refuses when it first pins (fully_shard); the reference refuses in fully_shard
    # too, with a message that says what to pass instead.
    with pytest.raises(RuntimeError) as info:
        impl.fully_shard(model, offload_policy=impl.CPUOffloadPolicy(pin_memory=True))
        model(torch.randn(2, 8)).sum().backward()
    if impl.name == "reference":
        assert "pin_memory=False" in str(info.value), info.value
