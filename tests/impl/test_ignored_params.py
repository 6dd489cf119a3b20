"""``fully_shard(ignored_params=...)``: the named parameters are left alone.

An ignored parameter stays a plain local ``nn.Parameter`` (no ``DTensor``), is never
all-gathered, and its gradient is not reduced: each rank keeps the gradient of its own
batch. Everything else in the group trains as usual (gradients averaged over ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from harness.parity import assert_sharded_parity, assert_tensors_close, average_gradients
from tests.impl.comm_count import count_collectives


def model_with_ignored(impl):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    ignored = {model[2].weight}
    impl.fully_shard(model, ignored_params=ignored)
    return model, reference


@pytest.mark.world_size(2)
def test_ignored_params_stay_local_and_unreduced(rank_ctx, impl):
    if not impl.supports("ignored_params"):
        pytest.skip(f"UNSUPPORTED: {impl.name} does not declare ignored_params")
    model, reference = model_with_ignored(impl)
    assert not isinstance(model[2].weight, DTensor)
    assert model[2].weight.shape == (4, 16)  # whole, not a shard
    assert isinstance(model[2].bias, DTensor) and isinstance(model[0].weight, DTensor)

    torch.manual_seed(100 + rank_ctx.rank)  # a different batch on every rank
    batch = torch.randn(3, 8)
    with count_collectives() as counts:
        model(batch).sum().backward()
    reference(batch).sum().backward()
    local_weight_grad = reference[2].weight.grad.clone()

    # The ignored weight's gradient is this rank's own; with different batches an
    # averaged one would differ from it.
    assert not isinstance(model[2].weight.grad, DTensor)
    assert_tensors_close("ignored weight grad", model[2].weight.grad, local_weight_grad)
    # One group: one all-gather (root keeps it after forward) and one reduce-scatter.
    assert counts["all_gather_single"] == 1 and counts["reduce_scatter_single"] == 1, counts

    average_gradients(reference)
    reference[2].weight.grad = None  # not part of the sharded comparison
    model[2].weight.grad = None
    assert_sharded_parity(reference, model)
