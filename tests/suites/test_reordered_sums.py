"""The reordered-sum bound against sums actually reordered, and the Adam drift against two
trainings that differ by nothing but the order of their sums, or by a bug."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distconform.harness.parity import ParityError
from distconform.suites.reordered_sums import AdamDrift, longest_reduction, reordered_sum_bound


@pytest.mark.parametrize("length", [16, 256, 4096, 65536])
def test_two_orders_of_one_sum_stay_within_the_bound(length):
    generator = torch.Generator().manual_seed(length)
    terms = torch.randn(64, length, generator=generator)
    forward = terms.sum(dim=1)  # torch's own (vectorised, pairwise) order
    sequential = torch.zeros(64)
    for column in terms.unbind(dim=1):  # one term at a time, left to right
        sequential += column
    magnitude = terms.abs().sum(dim=1)
    bounds = torch.tensor([reordered_sum_bound(torch.float32, length, m) for m in magnitude])
    assert bool(((forward - sequential).abs() <= bounds).all())
    # Not vacuous: a mistake of a thousandth of the sum's size is outside it.
    assert bool((bounds < 1e-3 * magnitude).all())


def test_the_bound_grows_with_the_square_root_of_the_length_and_the_dtypes_roundoff():
    short = reordered_sum_bound(torch.float32, 100, 1.0)
    assert reordered_sum_bound(torch.float32, 400, 1.0) == pytest.approx(2 * short)
    assert reordered_sum_bound(torch.bfloat16, 100, 1.0) == pytest.approx(short * 2**16)


def test_the_longest_reduction_is_the_widest_layer_or_the_tokens():
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    assert longest_reduction(model, tokens=8) == 64
    assert longest_reduction(model, tokens=512) == 512


def train(model: nn.Module, inputs: list[torch.Tensor], grad_change) -> tuple[nn.Module, list]:
    """Adam steps on ``model``; ``grad_change`` alters each gradient before the step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    for inp in inputs:
        model(inp).sum().backward()
        for param in model.parameters():
            param.grad = grad_change(param.grad)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def drift_of_reference(reference: nn.Module, inputs: list[torch.Tensor]) -> AdamDrift:
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=False)
    drift = AdamDrift(reference, optimizer, longest_reduction(reference, tokens=8))
    for inp in inputs:
        reference(inp).sum().backward()
        drift.before_step()
        optimizer.step()
        optimizer.zero_grad()
        drift.after_step()
    return drift


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))


INPUTS = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def rounding_noise(grad: torch.Tensor) -> torch.Tensor:
    """The gradient as another summation order might have given it: a few ulps per entry."""
    ulps = torch.randint(-3, 4, grad.shape, generator=torch.Generator().manual_seed(1))
    return grad + ulps * torch.finfo(grad.dtype).eps * grad.abs().max() / 4


def test_a_training_that_differs_by_rounding_stays_within_the_drift():
    reference = mlp()
    drift = drift_of_reference(reference, INPUTS)
    trained, _ = train(mlp(), INPUTS, rounding_noise)
    for (name, param), expected in zip(
        trained.named_parameters(), reference.parameters(), strict=True
    ):
        drift.assert_within(f"parameter {name!r}", name, param.detach(), expected.detach())


def test_a_training_with_a_bug_does_not():
    reference = mlp()
    drift = drift_of_reference(reference, INPUTS)

    # Every other entry's gradient comes with the wrong sign (Adam ignores a wrong scale).
    def flip_every_other(grad: torch.Tensor) -> torch.Tensor:
        signs = torch.where(torch.arange(grad.numel()) % 2 == 0, -1.0, 1.0)
        return grad * signs.reshape(grad.shape)

    buggy, _ = train(mlp(), INPUTS, flip_every_other)
    with pytest.raises(ParityError, match="more than rounding can explain"):
        for (name, param), expected in zip(
            buggy.named_parameters(), reference.parameters(), strict=True
        ):
            drift.assert_within(f"parameter {name!r}", name, param.detach(), expected.detach())
