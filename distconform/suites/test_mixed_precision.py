"""Mixed precision: the dtypes of the wire, the parameters, the gradients and the outputs.

``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)``: the
all-gather and the unsharded parameters are in ``param_dtype``, gradients are reduced in
``reduce_dtype`` (default: ``param_dtype``), sharded parameters and their gradients keep the
original dtype, outputs are cast to ``output_dtype``, and floating-point inputs are cast to
``param_dtype`` before every module of a group.

A bf16 model's losses barely move when the reduction runs in bf16 instead of fp32, so the
reduce dtype is held to the wire: every step's collectives must be FSDP2's schedule for the
plan (``suites/schedule``), whose all-gathers carry ``param_dtype`` and whose reductions carry
``reduce_dtype``. The plain reference applies the same casts by hand: each step it runs a
``param_dtype`` copy of its fp32 master weights on ``param_dtype`` inputs, casts the
gradients to the reduce dtype, averages them over ranks and steps the fp32 master with Adam;
comparisons use bf16 tolerances.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distconform.api import assert_losses_equal, assert_sharded_parity, average_gradients, tolerance
from distconform.suites.cases import conformance, grid
from distconform.suites.models import MLP, MLPStack
from distconform.suites.schedule import ScheduleRecorder, ShardingPlan
from distconform.suites.training import adam

BF16_RTOL, BF16_ATOL = tolerance(torch.bfloat16)
REDUCE_DTYPES = {"fp32": torch.float32, "none": None}


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


def shard_mlp_stack(plan: ShardingPlan, model: nn.Module, mp_policy, manage: str) -> None:
    for mlp in model:
        getattr(plan, manage)(mlp, mp_policy=mp_policy)
    getattr(plan, manage)(model, mp_policy=mp_policy)


def run_bf16_parity(rank_ctx, impl, reduce_dtype: torch.dtype | None, manage: str) -> None:
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    with torch.device(rank_ctx.device):
        model = MLPStack(8)
    reference = CastingReference(model, torch.bfloat16, reduce_dtype)
    plan = ShardingPlan(impl)
    shard_mlp_stack(plan, model, mp, manage)
    recorder = ScheduleRecorder(plan, model)
    optimizer = adam(model.parameters())
    unsharded_dtypes: list[torch.dtype] = []
    # Registered after the implementation's own pre-hook: it sees the unsharded parameters.
    model[1].register_forward_pre_hook(
        lambda m, _args: unsharded_dtypes.append(m.in_proj.weight.dtype)
    )
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for step in range(5):
        inp = torch.randn(4, 8, device=rank_ctx.device)
        with recorder.step(f"step {step}"):
            out = model(inp)
            loss = out.sum()
            loss.backward()
        assert out.dtype == torch.bfloat16, f"output dtype {out.dtype}, expected bf16"
        assert_losses_equal(step, loss, reference.forward_backward(inp))
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) and param.dtype == torch.float32, name
            assert param.grad.dtype == torch.float32, f"{name}.grad is {param.grad.dtype}"
            assert param.grad.to_local().dtype == torch.float32, name
        assert_sharded_parity(reference.master, model, rtol=BF16_RTOL, atol=BF16_ATOL)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference.step()
    assert unsharded_dtypes == [torch.bfloat16] * 5, (
        f"unsharded parameters in forward: {unsharded_dtypes}, expected bf16"
    )
    assert_sharded_parity(
        reference.master, model, check_grads=False, rtol=BF16_RTOL, atol=BF16_ATOL
    )


@conformance("fsdp.mixed_precision.parity")
@pytest.mark.parametrize("point", grid(reduce=list(REDUCE_DTYPES)))
def test_bf16_training_parity(rank_ctx, impl, point):
    run_bf16_parity(rank_ctx, impl, REDUCE_DTYPES[point["reduce"]], "fully_shard")


@conformance("replicate.mixed_precision.parity")
def test_replicate_bf16_training_parity(rank_ctx, impl):
    """replicate with ``param_dtype``: no all-gather (the unsharded copy is a local cast),
    fp32 all-reduces."""
    run_bf16_parity(rank_ctx, impl, torch.float32, "replicate")


@conformance("fsdp.mixed_precision.unsynced_accumulation")
def test_bf16_accumulates_unsynced_gradients_in_reduce_dtype(rank_ctx, impl):
    """Gradient sync off: microbatch gradients add up in fp32 (reduce_dtype), not in bf16."""
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with torch.device(rank_ctx.device):
        model = MLPStack(8)
    reference = CastingReference(model, torch.bfloat16, torch.float32)
    plan = ShardingPlan(impl)
    shard_mlp_stack(plan, model, mp, "fully_shard")
    recorder = ScheduleRecorder(plan, model)
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for microbatch in range(4):
        last = microbatch == 3
        plan.controls(model).set_requires_gradient_sync(last)
        inp = torch.randn(4, 8, device=rank_ctx.device)
        with recorder.step(f"microbatch {microbatch}"):
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


class RecordsInputDtype(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)
        self.input_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input_dtypes.append(x.dtype)
        return self.lin(x.to(self.lin.weight.dtype))


@conformance("fsdp.mixed_precision.cast_forward_inputs")
def test_cast_forward_inputs(rank_ctx, impl):
    """Both values in one item: ``True`` casts a floating-point input to ``param_dtype``,
    ``False`` hands the module its fp32 input."""
    for cast in (True, False):
        with torch.device(rank_ctx.device):
            model = RecordsInputDtype(8)
        mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=cast)
        impl.fully_shard(model, mp_policy=mp)
        out = model(torch.randn(2, 8, device=rank_ctx.device))
        out.sum().backward()
        expected = torch.bfloat16 if cast else torch.float32
        assert model.input_dtypes == [expected], (
            f"cast_forward_inputs={cast}: the module saw inputs of {model.input_dtypes}, "
            f"expected [{expected}]"
        )
        assert out.dtype == torch.bfloat16, f"cast_forward_inputs={cast}: output {out.dtype}"
        assert model.lin.weight.grad.dtype == torch.float32


class Upcast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


@conformance("fsdp.mixed_precision.output_dtype")
def test_output_dtype(rank_ctx, impl):
    """output_dtype alone: compute stays fp32, each managed module's outputs are cast to its
    own policy's output_dtype, and a group whose output_dtype is None returns what it
    computed (fp32). Values and gradients against the plain model with the same casts."""
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = nn.Sequential(MLP(8), Upcast(), MLP(8), MLP(8))
    reference = copy.deepcopy(model)
    mp = impl.MixedPrecisionPolicy
    impl.fully_shard(model[0], mp_policy=mp(output_dtype=torch.bfloat16))
    impl.fully_shard(model[2], mp_policy=mp())
    impl.fully_shard(model, mp_policy=mp(output_dtype=torch.float64))
    outputs: dict[int, list[torch.dtype]] = {0: [], 2: []}
    # Registered after the implementation's post-hooks: they see the outputs those returned.
    for index, dtypes in outputs.items():
        model[index].register_forward_hook(lambda _m, _i, out, d=dtypes: d.append(out.dtype))
    torch.manual_seed(42 + rank_ctx.rank + 1)
    inp = torch.randn(2, 8, device=rank_ctx.device)
    out = model(inp)
    assert outputs == {0: [torch.bfloat16], 2: [torch.float32]}, (
        f"output dtypes of model[0] (output_dtype bf16) and model[2] (None): {outputs}"
    )
    assert out.dtype == torch.float64, f"root output {out.dtype}, expected float64"
    # The plain model with the casts FSDP2 documents: fp32 compute, outputs cast per group.
    hidden = reference[0](inp).to(torch.bfloat16).float()
    expected = reference[3](reference[2](hidden)).to(torch.float64)
    torch.testing.assert_close(out, expected, msg=lambda m: f"output: {m}")
    out.sum().backward()
    expected.sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    average_gradients(reference)
    assert_sharded_parity(reference, model)
