"""``model.to(float64)`` after sharding converts parameters and gradients.

Under swap-tensors mode (``torch.__future__.set_swap_module_params_on_conversion``), the
conversion swaps the registered DTensors: their local shards, global dtype and gradients are
float64 from then on, and 3 Adam steps match a float64 reference with explicit averaging.

Casting later, after training started, while groups are unsharded (``raf=False`` and a
forward without backward) and gradients exist: the gradients are converted too, and the next
backward accumulates into them. torch 2.13's FSDP2 fixes its all-gather dtypes at lazy init,
so it fails that case (``suites/expectations/torch-<version>.toml``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator

import pytest
import torch
from torch.distributed.tensor import DTensor

from distconform.api import assert_losses_equal, assert_sharded_parity, average_gradients, tolerance
from distconform.suites.cases import conformance, grid
from distconform.suites.models import MLP
from distconform.suites.training import STEPS, zero_grad


@contextlib.contextmanager
def swap_tensors_on_conversion() -> Iterator[None]:
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def assert_float64(tensor: torch.Tensor, what: str) -> None:
    assert tensor.dtype == torch.float64, f"{what}: {tensor.dtype}"
    if isinstance(tensor, DTensor):
        assert tensor.to_local().dtype == torch.float64, f"{what} (local shard)"


def run_cast_after_init(rank_ctx, distribute) -> None:
    with swap_tensors_on_conversion():
        model = MLP(4, rank_ctx.device)
        # A frozen parameter stays frozen through the cast: no gradient, no optimizer update.
        model.in_proj.bias.requires_grad_(False)
        reference = copy.deepcopy(model).to(torch.float64)
        ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
        for module in (model.in_proj, model.out_proj, model):
            distribute(module)
        model.to(torch.float64)
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), "a parameter stopped being a DTensor after .to()"
            assert_float64(p, "parameter after .to(float64)")
            expected = reference.get_parameter(name).requires_grad
            assert p.requires_grad == expected, (
                f"{name}: requires_grad={p.requires_grad} after .to(float64), was {expected}"
            )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        assert_sharded_parity(reference, model, check_grads=False)
        torch.manual_seed(42 + rank_ctx.rank + 1)
        for step in range(STEPS):
            inp = torch.randn(2, 4, dtype=torch.float64, device=rank_ctx.device)
            loss = model(inp).sum()
            loss.backward()
            ref_loss = reference(inp).sum()
            ref_loss.backward()
            average_gradients(reference)
            assert_losses_equal(step, loss, ref_loss)
            assert_sharded_parity(reference, model)
            for name, p in model.named_parameters():
                assert_float64(p, "parameter")
                if p.requires_grad:
                    assert_float64(p.grad, "gradient")
                else:
                    assert p.grad is None, f"frozen {name} got a gradient"
            for opt in (optimizer, ref_optimizer):
                opt.step()
                zero_grad(opt, step)
        assert_sharded_parity(reference, model, check_grads=False)


@conformance("fsdp.cast_after_init")
@pytest.mark.parametrize("point", grid(offload=["none", "cpu"]))
def test_to_float64_after_init(rank_ctx, impl, point):
    """With ``CPUOffloadPolicy`` the sharded parameters live on the CPU, and the cast keeps
    them there: an implementation that refuses CPU-resident shards when it rebuilds its
    buffers after the cast fails."""
    options = {}
    if point["offload"] == "cpu":
        options["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=rank_ctx.device.type != "cpu")
    run_cast_after_init(rank_ctx, functools.partial(impl.fully_shard, **options))


@conformance("replicate.cast_after_init")
def test_replicate_to_float64_after_init(rank_ctx, impl):
    run_cast_after_init(rank_ctx, impl.replicate)


@conformance("fsdp.cast_after_training")
def test_to_dtype_with_gradients_and_while_unsharded(rank_ctx, impl):
    model = MLP(6, rank_ctx.device)
    reference = copy.deepcopy(model)
    impl.fully_shard(model.in_proj, reshard_after_forward=False)
    impl.fully_shard(model, reshard_after_forward=False)
    inp = torch.randn(3, 6, device=rank_ctx.device)
    model(inp).sum().backward()
    reference(inp).sum().backward()
    average_gradients(reference)
    model(inp)  # no backward: both groups stay unsharded
    model.to(torch.float64)
    reference.to(torch.float64)
    for name, param in model.named_parameters():
        assert_float64(param, name)
        assert_float64(param.grad, f"{name}.grad")
    # The first gradients were reduced in fp32: compare at fp32 tolerances.
    rtol, atol = tolerance(torch.float32)
    assert_sharded_parity(reference, model, rtol=rtol, atol=atol)

    inp64 = inp.to(torch.float64)
    second = copy.deepcopy(reference)
    second.zero_grad(set_to_none=True)
    second(inp64).sum().backward()
    average_gradients(second)
    for p, q in zip(reference.parameters(), second.parameters(), strict=True):
        p.grad += q.grad
    model(inp64).sum().backward()
    assert_sharded_parity(reference, model, rtol=rtol, atol=atol)
    for name, param in model.named_parameters():
        assert_float64(param.grad, f"{name}.grad")
