"""Mixed precision and casting after init (cases.md §2.3, §2.5, §5.1 item 7).

``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)``: the
all-gather and the unsharded parameters are in ``param_dtype``, gradients are reduced in
``reduce_dtype`` (default: ``param_dtype``), sharded parameters and their gradients keep the
original dtype, outputs are cast to ``output_dtype``, and floating-point inputs are cast to
``param_dtype`` before every module of a group.

The bf16 reference applies the same casts by hand: each step it runs a ``param_dtype`` copy of
its fp32 master weights on ``param_dtype`` inputs, casts the gradients to the reduce dtype,
averages them over ranks and steps the fp32 master with Adam. Comparisons use bf16 tolerances.

A grouped module's policy casting the inputs of every module of the group (cases.md §2.5) is
``suites/test_partial_forward.py::test_grouped_module_cast_forward_inputs``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from harness.comm import CommTracer
from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients, tolerance
from suites.models import MLP, MLPStack
from tests.impl.test_training_parity import adam

slow = pytest.mark.slow
BF16_RTOL, BF16_ATOL = tolerance(torch.bfloat16)


class CastingReference:
    """An fp32 master model trained through a ``param_dtype`` compute copy, like FSDP2's MP."""

    def __init__(
        self, model: nn.Module, param_dtype: torch.dtype, reduce_dtype: torch.dtype | None
    ) -> None:
        self.master = copy.deepcopy(model)
        self.optimizer = adam(self.master.parameters())
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype or param_dtype

    def forward_backward(self, inp: torch.Tensor, *, sync: bool = True) -> torch.Tensor:
        compute = copy.deepcopy(self.master).to(self.param_dtype)
        for p in compute.parameters():
            p.grad = None
        loss = compute(inp.to(self.param_dtype)).sum()
        loss.backward()
        for master, low in zip(self.master.parameters(), compute.parameters(), strict=True):
            grad = low.grad.to(self.reduce_dtype)
            if sync:
                dist.all_reduce(grad)
                grad /= dist.get_world_size()
            grad = grad.to(master.dtype)
            master.grad = grad if master.grad is None else master.grad + grad
        return loss.detach()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def shard_mlp_stack(impl, model: nn.Module, mp_policy) -> None:
    for mlp in model:
        impl.fully_shard(mlp, mp_policy=mp_policy)
    impl.fully_shard(model, mp_policy=mp_policy)


def record_unsharded_dtypes(module: nn.Module, seen: list[torch.dtype]) -> None:
    # Registered after fully_shard's own pre-hook, so it sees the unsharded parameters.
    module.register_forward_pre_hook(lambda m, _args: seen.append(m.in_proj.weight.dtype))


MP_CASES = [
    pytest.param(torch.float32, id="reduce=fp32"),
    pytest.param(None, id="reduce=bf16", marks=slow),
]


@pytest.mark.world_size(2, 4, slow=(4,))
@pytest.mark.parametrize("reduce_dtype", MP_CASES)
def test_bf16_training_parity(rank_ctx, impl, reduce_dtype):
    run_bf16_parity(rank_ctx, impl, reduce_dtype)


def run_bf16_parity(rank_ctx, impl, reduce_dtype: torch.dtype | None) -> None:
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    model = MLPStack(8)
    reference = CastingReference(model, torch.bfloat16, reduce_dtype)
    shard_mlp_stack(impl, model, mp)
    optimizer = adam(model.parameters())
    unsharded_dtypes: list[torch.dtype] = []
    record_unsharded_dtypes(model[1], unsharded_dtypes)
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for step in range(5):
        inp = torch.randn(4, 8)
        with CommTracer(functional=False) as trace:
            out = model(inp)
            loss = out.sum()
            loss.backward()
        assert out.dtype == torch.bfloat16
        reference_loss = reference.forward_backward(inp)
        assert_losses_equal(step, loss, reference_loss)
        gathered = {d for c in trace.calls if c.kind == "all_gather" for d in c.dtypes}
        reduced = {d for c in trace.calls if c.kind == "reduce_scatter" for d in c.dtypes}
        assert gathered == {"bf16"}, gathered
        assert reduced == {"f32" if reduce_dtype is torch.float32 else "bf16"}, reduced
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) and param.dtype == torch.float32, name
            assert param.grad.dtype == torch.float32, name
            assert param.grad.to_local().dtype == torch.float32, name
        assert_sharded_parity(reference.master, model, rtol=BF16_RTOL, atol=BF16_ATOL)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference.step()
    # Unsharded (compute) parameters were bf16 in every forward.
    assert unsharded_dtypes == [torch.bfloat16] * 5, unsharded_dtypes
    assert_sharded_parity(
        reference.master, model, check_grads=False, rtol=BF16_RTOL, atol=BF16_ATOL
    )


@pytest.mark.world_size(2)
def test_bf16_accumulates_unsynced_gradients_in_reduce_dtype(rank_ctx, impl):
    """Gradient sync off: microbatch gradients add up in fp32 (reduce_dtype), not in bf16."""
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = MLPStack(8)
    reference = CastingReference(model, torch.bfloat16, torch.float32)
    shard_mlp_stack(impl, model, mp)
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for microbatch in range(4):
        last = microbatch == 3
        model.set_requires_gradient_sync(last)
        inp = torch.randn(4, 8)
        model(inp).sum().backward()
        # The reference sums fp32-cast local gradients, then averages once.
        reference.forward_backward(inp, sync=False)
    for p in reference.master.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    # Same bf16 compute on both sides; only the order of the fp32 sums differs, so fp32
    # tolerances hold, and accumulating in bf16 instead would be caught.
    assert_sharded_parity(reference.master, model)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.world_size(2)
def test_bf16_replicate_parity(rank_ctx, impl):
    """replicate with param_dtype: no all-gather, the unsharded copy is a local cast."""
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = MLPStack(8)
    reference = CastingReference(model, torch.bfloat16, torch.float32)
    for mlp in model:
        impl.replicate(mlp, mp_policy=mp)
    impl.replicate(model, mp_policy=mp)
    optimizer = adam(model.parameters())
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for step in range(3):
        inp = torch.randn(4, 8)
        with CommTracer(functional=False) as trace:
            loss = model(inp).sum()
            loss.backward()
        assert_losses_equal(step, loss, reference.forward_backward(inp))
        assert [c.kind for c in trace.calls] == ["all_reduce"] * 3
        assert {d for c in trace.calls for d in c.dtypes} == {"f32"}
        assert_sharded_parity(reference.master, model, rtol=BF16_RTOL, atol=BF16_ATOL)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference.step()


# --- casting inputs and outputs ----------------------------------------------------------------


class RecordsInputDtype(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)
        self.input_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input_dtypes.append(x.dtype)
        return self.lin(x.to(self.lin.weight.dtype))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("cast_forward_inputs", [True, False], ids=lambda v: f"cast={v}")
def test_cast_forward_inputs(rank_ctx, impl, cast_forward_inputs):
    model = RecordsInputDtype(8)
    mp = impl.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, cast_forward_inputs=cast_forward_inputs
    )
    impl.fully_shard(model, mp_policy=mp)
    out = model(torch.randn(2, 8))
    out.sum().backward()
    expected = torch.bfloat16 if cast_forward_inputs else torch.float32
    assert model.input_dtypes == [expected], model.input_dtypes
    assert out.dtype == torch.bfloat16
    assert model.lin.weight.grad.dtype == torch.float32


class Upcast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


@pytest.mark.world_size(2)
def test_output_dtype(rank_ctx, impl):
    """output_dtype alone: compute stays fp32, each managed module's outputs are cast."""
    model = nn.Sequential(MLP(8), Upcast(), MLP(8))
    impl.fully_shard(model[0], mp_policy=impl.MixedPrecisionPolicy(output_dtype=torch.bfloat16))
    impl.fully_shard(model, mp_policy=impl.MixedPrecisionPolicy(output_dtype=torch.float64))
    inner_outputs: list[torch.dtype] = []
    # Registered after fully_shard's post-hook, so it sees the output that hook returned.
    model[0].register_forward_hook(lambda _m, _i, out: inner_outputs.append(out.dtype))
    out = model(torch.randn(2, 8))
    assert inner_outputs == [torch.bfloat16], inner_outputs
    assert out.dtype == torch.float64
    out.sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


# --- model.to(dtype) after init ------------------------------------------------------------------


def assert_dtype(tensor: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert tensor.dtype == dtype, f"{what}: {tensor.dtype}"
    assert isinstance(tensor, DTensor), f"{what} is not a DTensor"
    assert tensor.to_local().dtype == dtype, f"{what} local: {tensor.to_local().dtype}"


@pytest.mark.world_size(2)
def test_to_float64_after_init(rank_ctx, impl):
    """cases.md §2.3: params, grads and their DTensor metadata follow module.to(float64)."""
    model = MLP(4)
    reference_model = copy.deepcopy(model).to(torch.float64)
    impl.fully_shard(model.in_proj)
    impl.fully_shard(model.out_proj)
    impl.fully_shard(model)
    model.to(torch.float64)
    for name, param in model.named_parameters():
        assert_dtype(param, torch.float64, name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    reference_optimizer = torch.optim.Adam(reference_model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for step in range(4):
        inp = torch.randn(2, 4, dtype=torch.float64)
        loss = model(inp).sum()
        loss.backward()
        reference_loss = reference_model(inp).sum()
        reference_loss.backward()
        average_gradients(reference_model)
        assert_losses_equal(step, loss, reference_loss)
        assert_sharded_parity(reference_model, model)
        for name, param in model.named_parameters():
            assert_dtype(param, torch.float64, name)
            assert_dtype(param.grad, torch.float64, f"{name}.grad")
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        reference_optimizer.zero_grad(set_to_none=step % 2 == 0)


@pytest.mark.world_size(2)
def test_to_dtype_with_gradients_and_while_unsharded(rank_ctx, impl):
    """Cast while groups are unsharded (raf=False, forward without backward) and gradients
    exist: gradients are converted, and the next backward accumulates into them.

    torch 2.13's FSDP2 fixes its all-gather dtypes at lazy init, so casting after the first
    forward fails in its all-gather copy-out ("Expected out tensor to have dtype double"):
    an expected failure for torch, which turns into a pass if torch starts handling it.
    """
    try:
        cast_after_training(impl)
    except RuntimeError as error:
        if impl.name == "torch" and "Expected out tensor to have dtype" in str(error):
            pytest.xfail(f"torch FSDP2 cannot cast after lazy init: {error}")
        raise


def cast_after_training(impl) -> None:
    model = MLP(6)
    reference_model = copy.deepcopy(model)
    impl.fully_shard(model.in_proj, reshard_after_forward=False)
    impl.fully_shard(model, reshard_after_forward=False)
    inp = torch.randn(3, 6)
    model(inp).sum().backward()
    reference_model(inp).sum().backward()
    average_gradients(reference_model)
    model(inp)  # no backward: both groups stay unsharded
    model.to(torch.float64)
    reference_model.to(torch.float64)
    for name, param in model.named_parameters():
        assert_dtype(param, torch.float64, name)
        assert_dtype(param.grad, torch.float64, f"{name}.grad")
    # The first gradients were reduced in fp32: compare at fp32 tolerances.
    rtol, atol = tolerance(torch.float32)
    assert_sharded_parity(reference_model, model, rtol=rtol, atol=atol)

    inp64 = inp.to(torch.float64)
    second = copy.deepcopy(reference_model)
    second.zero_grad(set_to_none=True)
    second(inp64).sum().backward()
    average_gradients(second)
    for p, q in zip(reference_model.parameters(), second.parameters(), strict=True):
        p.grad += q.grad
    model(inp64).sum().backward()
    assert_sharded_parity(reference_model, model, rtol=rtol, atol=atol)
    for name, param in model.named_parameters():
        assert_dtype(param.grad, torch.float64, f"{name}.grad")
