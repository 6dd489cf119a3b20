"""1F1B-style microbatching: accumulate without resharding, sync on the last.

Every block and the root keep parameters after forward; over 3 microbatches gradient sync,
``set_is_last_backward`` and (without ``rab``) reshard-after-backward are on only for the
last one; optionally every module is unsharded ahead of time with ``unshard(async_op=True)``
and the handles dropped (forward must wait for them). Gradients after the accumulation and
parameters after the step equal the reference's, and each microbatch's collectives are
FSDP2's schedule for its flags (``suites/schedule``): the first gathers every group, the
next ones gather nothing while the groups are held, only the last reduces.
"""

from __future__ import annotations

import copy

import pytest
import torch

from distconform.api import assert_losses_equal, assert_sharded_parity, average_gradients
from distconform.suites.cases import conformance, grid
from distconform.suites.models import ModelArgs, Transformer
from distconform.suites.schedule import ScheduleRecorder, ShardingPlan
from distconform.suites.training import adamw, blocks

MICROBATCHES = 3


def run_microbatching(rank_ctx, impl, manage: str, point: dict, **kwargs) -> None:
    with torch.device(rank_ctx.device):
        model = Transformer(ModelArgs(dropout_p=0.0))
    reference = copy.deepcopy(model)
    plan = ShardingPlan(impl)
    for block in [*blocks(model), model]:
        getattr(plan, manage)(block, **kwargs)
    recorder = ScheduleRecorder(plan, model)
    optimizer, ref_optimizer = adamw(model.parameters()), adamw(reference.parameters())
    torch.manual_seed(42 + rank_ctx.rank + 1)
    inputs = [torch.randint(0, 8, (2, 16), device=rank_ctx.device) for _ in range(MICROBATCHES)]
    losses, ref_losses = [], []
    controls = plan.controls(model)
    for index, inp in enumerate(inputs):
        last = index == MICROBATCHES - 1
        with recorder.step(f"microbatch {index}"):
            if point["explicit_unshard"]:
                for group in plan.groups:
                    plan.controls(group.modules[0]).unshard(async_op=True)
            controls.set_requires_gradient_sync(last)
            model.set_is_last_backward(last)
            if not point["rab"]:
                controls.set_reshard_after_backward(last)
            loss = model(inp).sum()
            loss.backward()
        losses.append(loss.detach())
        ref_loss = reference(inp).sum()
        ref_loss.backward()
        ref_losses.append(ref_loss.detach())
    average_gradients(reference)
    for index, (loss, ref_loss) in enumerate(zip(losses, ref_losses, strict=True)):
        assert_losses_equal(index, loss, ref_loss)
    assert_sharded_parity(reference, model)
    for opt in (optimizer, ref_optimizer):
        opt.step()
    assert_sharded_parity(reference, model, check_grads=False)


MICROBATCH_GRID = grid(explicit_unshard=[False, True], rab=[False, True])


@conformance("fsdp.microbatching.1f1b")
@pytest.mark.parametrize("point", MICROBATCH_GRID)
def test_1f1b_microbatching(rank_ctx, impl, point):
    run_microbatching(rank_ctx, impl, "fully_shard", point, reshard_after_forward=False)


@conformance("replicate.microbatching.1f1b")
@pytest.mark.parametrize("point", MICROBATCH_GRID)
def test_replicate_1f1b_microbatching(rank_ctx, impl, point):
    run_microbatching(rank_ctx, impl, "replicate", point)
