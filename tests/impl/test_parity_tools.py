"""Each parity tool in harness/parity.py passes on matching input and fails on a wrong one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from distconform.harness.parity import (
    LossHistory,
    ParityError,
    ReferenceModel,
    assert_losses_equal,
    assert_sharded_parity,
    assert_tensors_close,
    average_gradients,
    tolerance,
)

# --- tolerances and tensor comparison (no ranks) -----------------------------------------------


def test_tolerances_are_pytorchs_defaults():
    assert tolerance(torch.float32) == (1.3e-6, 1e-5)
    assert tolerance(torch.bfloat16) == (1.6e-2, 1e-5)
    assert tolerance(torch.float16) == (1e-3, 1e-5)
    assert tolerance(torch.float64) == (1e-7, 1e-7)
    assert tolerance(torch.int64) == (0.0, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_tensor_comparison_uses_the_dtype_tolerance(dtype):
    rtol, atol = tolerance(dtype)
    expected = torch.linspace(1, 2, 32, dtype=torch.float64).to(dtype)
    inside = (expected.double() * (1 + rtol / 2)).to(dtype)
    assert_tensors_close("x", inside if dtype is torch.float64 else expected, expected)
    outside = (expected.double() * (1 + 4 * rtol) + 4 * atol).to(dtype)
    with pytest.raises(ParityError, match=r"x differs on rank 0: \d+/32 elements") as info:
        assert_tensors_close("x", outside, expected)
    assert "max abs diff" in str(info.value) and "max rel diff" in str(info.value)


def test_tensor_comparison_reports_the_largest_differences():
    expected = torch.tensor([1.0, 2.0, 4.0])
    actual = torch.tensor([1.0, 2.5, 4.0])
    with pytest.raises(ParityError) as info:
        assert_tensors_close("w", actual, expected)
    message = str(info.value)
    assert "1/3 elements" in message
    assert "max abs diff 5.000e-01" in message
    assert "max rel diff 2.500e-01" in message


def test_tensor_comparison_requires_equal_dtype_and_shape():
    with pytest.raises(ParityError, match=r"dtype torch\.float64"):
        assert_tensors_close("x", torch.zeros(2, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(ParityError, match=r"shape \(3,\)"):
        assert_tensors_close("x", torch.zeros(3), torch.zeros(2))


def test_nan_in_one_tensor_only_is_a_mismatch():
    with pytest.raises(ParityError, match="max abs diff inf"):
        assert_tensors_close("x", torch.tensor([float("nan")]), torch.tensor([1.0]))
    assert_tensors_close("x", torch.tensor([float("nan")]), torch.tensor([float("nan")]))


def test_loss_comparison_names_the_step():
    assert_losses_equal(3, torch.tensor(1.0), torch.tensor(1.0 + 1e-7))
    with pytest.raises(ParityError, match="loss at step 3 differs"):
        assert_losses_equal(3, torch.tensor(1.0), torch.tensor(1.01))


def test_loss_history_finds_the_first_diverging_step():
    history = LossHistory()
    for step in range(5):
        history.record(torch.tensor(float(step)), torch.tensor(float(step) + (step >= 3)))
    with pytest.raises(ParityError, match="loss at step 3 differs"):
        history.check()
    history.losses.pop()
    with pytest.raises(ParityError, match="4 losses recorded, but 5 reference losses"):
        history.check()


def test_sharded_parity_on_plain_modules():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    reference = copy.deepcopy(model)
    assert_sharded_parity(reference, model, check_grads=False)
    with torch.no_grad():
        model.bias[1] += 1e-3
    with pytest.raises(ParityError, match="parameter 'bias' differs on rank 0"):
        assert_sharded_parity(reference, model, check_grads=False)


def test_sharded_parity_checks_names_counts_and_missing_grads():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ParityError, match=r"model has '0\.weight' where reference has 'weight'"):
        assert_sharded_parity(nn.Linear(2, 2), model, check_grads=False)
    with pytest.raises(ParityError, match="model has 2 parameters, reference has 1"):
        assert_sharded_parity(nn.Linear(2, 2, bias=False), nn.Linear(2, 2), check_grads=False)

    model = nn.Linear(2, 2)
    reference = copy.deepcopy(model)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(ParityError, match="gradient of 'weight' on rank 0: model has one"):
        assert_sharded_parity(reference, model)


def test_prefixes_are_ignored_when_pairing_names():
    torch.manual_seed(0)
    inner = nn.Linear(2, 2)
    wrapped = nn.Sequential(copy.deepcopy(inner))
    assert_sharded_parity(inner, wrapped, check_grads=False, prefixes_to_ignore=("0.",))


# --- distributed tools ----------------------------------------------------------------------


@pytest.mark.world_size(2)
def test_average_gradients_takes_the_mean_over_ranks(rank_ctx):
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model(torch.full((1, 2), float(rank_ctx.rank + 1))).sum().backward()
    assert torch.equal(model.weight.grad, torch.full((1, 2), float(rank_ctx.rank + 1)))
    average_gradients(model)
    assert torch.equal(model.weight.grad, torch.full((1, 2), 1.5))


@pytest.mark.world_size(2)
def test_sharded_parity_catches_a_wrong_shard_on_one_rank(rank_ctx):
    mesh = rank_ctx.mesh(rank_ctx.world_size)
    reference = nn.Linear(5, 3)  # 3 rows over 2 ranks: uneven
    model = copy.deepcopy(reference)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    model.bias = nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Shard(0)]))
    assert_sharded_parity(reference, model, check_grads=False)

    if rank_ctx.rank == 1:
        with torch.no_grad():
            model.weight.to_local()[0, 0] += 0.1
    failed = torch.zeros(1)
    try:
        assert_sharded_parity(reference, model, check_grads=False)
    except ParityError as error:
        failed += 1
        assert "parameter 'weight' differs on rank 1" in str(error)
        assert "max abs diff 1.000e-01" in str(error)
    # Only the rank whose shard is wrong notices; the test asserts that on every rank.
    seen = [torch.zeros(1) for _ in range(rank_ctx.world_size)]
    dist.all_gather(seen, failed)
    assert [int(s) for s in seen] == [0, 1]


@pytest.mark.world_size(2)
def test_sharded_parity_catches_unaveraged_gradients(rank_ctx):
    mesh = rank_ctx.mesh(rank_ctx.world_size)
    reference = ReferenceModel(nn.Linear(4, 4), lambda ps: torch.optim.SGD(ps, lr=0.1))
    model = copy.deepcopy(reference.module)
    for name in ("weight", "bias"):
        full = getattr(model, name).detach()
        setattr(model, name, nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
    inp = torch.full((2, 4), float(rank_ctx.rank + 1))
    reference.forward_backward(lambda m: m(inp).sum())
    # A "distributed" model whose gradients are this rank's own, not the mean: must fail.
    local_model = copy.deepcopy(reference.module)
    local_model.zero_grad()
    local_model(inp).sum().backward()
    for name in ("weight", "bias"):
        grad = getattr(local_model, name).grad
        getattr(model, name).grad = distribute_tensor(grad, mesh, [Shard(0)], src_data_rank=None)
    with pytest.raises(ParityError, match="gradient of 'weight' differs"):
        assert_sharded_parity(reference.module, model)
    # Averaged the same way, the same check passes.
    average_gradients(local_model)
    for name in ("weight", "bias"):
        grad = getattr(local_model, name).grad
        getattr(model, name).grad = distribute_tensor(grad, mesh, [Shard(0)], src_data_rank=None)
    assert_sharded_parity(reference.module, model)
