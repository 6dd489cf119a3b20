"""``fully_shard(ignored_params=...)`` and ``replicate(ignored_params=...)``: the named
parameters are left alone.

An ignored parameter stays a plain local ``nn.Parameter`` (no ``DTensor``), is never
all-gathered, and its gradient is not reduced: each rank keeps the gradient of its own
batch. Everything else in the group trains as usual (gradients averaged over ranks). The
schedule oracle sizes the group's all-gather and reduce-scatter without the ignored
parameter, so one that is gathered or reduced anyway shows up on the wire.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distconform.api import assert_sharded_parity, assert_tensors_close, average_gradients
from distconform.suites.cases import conformance
from distconform.suites.schedule import ScheduleRecorder, ShardingPlan


def run_ignored_params(rank_ctx, impl, kind: str) -> None:
    torch.manual_seed(0)
    with torch.device(rank_ctx.device):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    plan = ShardingPlan(impl)
    apply = plan.replicate if kind == "replicate" else plan.fully_shard
    apply(model, ignored_params={model[2].weight})
    recorder = ScheduleRecorder(plan, model)
    assert not isinstance(model[2].weight, DTensor), "the ignored weight became a DTensor"
    assert model[2].weight.shape == (4, 16), "the ignored weight is not whole"
    assert isinstance(model[2].bias, DTensor) and isinstance(model[0].weight, DTensor)

    for step in range(2):
        torch.manual_seed(100 + 10 * step + rank_ctx.rank)  # a different batch on every rank
        batch = torch.randn(3, 8, device=rank_ctx.device)
        with recorder.step(f"step {step}"):
            model(batch).sum().backward()
        reference(batch).sum().backward()
        # The ignored weight's gradient is this rank's own (accumulated over the steps);
        # with different batches an averaged one would differ from it.
        assert not isinstance(model[2].weight.grad, DTensor)
        assert_tensors_close("ignored weight grad", model[2].weight.grad, reference[2].weight.grad)
    average_gradients(reference)
    reference[2].weight.grad = None  # not part of the sharded comparison
    model[2].weight.grad = None
    assert_sharded_parity(reference, model)


@conformance("fsdp.ignored_params")
def test_ignored_params_stay_local_and_unreduced(rank_ctx, impl):
    run_ignored_params(rank_ctx, impl, "fully_shard")


@conformance("replicate.ignored_params")
def test_replicate_ignored_params_stay_local_and_unreduced(rank_ctx, impl):
    """Fails on ``tests.suites.broken:ignore_ignored_params_torch`` ("the ignored weight
    became a DTensor")."""
    run_ignored_params(rank_ctx, impl, "replicate")
