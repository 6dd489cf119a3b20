"""Property: sharded training equals a plain model trained with explicit averaging.

For any layer stack (sizes not divisible by the world size, layers thinner than it), any
grouping into ``fully_shard`` calls, world sizes 1 to 8, 1-D or (with ``hsdp``) 2-D meshes,
any ``reshard_after_forward`` the implementation declares, and 1 to 3 microbatches of
gradient accumulation: every microbatch's loss, every gradient after the last microbatch
and every parameter after each SGD step equal the plain model's, shard by shard (fp32
defaults of ``distconform.harness.parity``, or the expectations file's tolerance override).
"""

from __future__ import annotations

import itertools
import os
import shlex
from typing import Any

import pytest

from distconform.suites.cases import MISSING_DEPENDENCY_PREFIX

pytest.importorskip(
    "hypothesis",
    reason=f"{MISSING_DEPENDENCY_PREFIX} hypothesis is not installed; the property cases need "
    "it: reinstall distconform, or pip install hypothesis next to a plain copy of the tree",
)

import torch
from hypothesis import given
from torch import nn

from distconform.api import (
    DistributedFailure,
    ReferenceModel,
    assert_losses_equal,
    assert_sharded_parity,
    get_rank_context,
    run_in_session,
)
from distconform.suites.properties.strategies import (
    MAX_WORLD_SIZE,
    REPLAY_ENV,
    TrainingExample,
    profile,
    training_examples,
)

LEARNING_RATE = 0.1


def build_model(dims: tuple[int, ...], device: torch.device) -> nn.Sequential:
    with torch.device(device):
        blocks = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(dims)]
    return nn.Sequential(*blocks)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LEARNING_RATE)


def train_and_compare(impl: Any, example: TrainingExample, tolerance: dict[str, Any]) -> None:
    """Runs on every rank of ``example.world_size``."""
    ctx = get_rank_context()
    names = ("replicate", "shard") if len(example.mesh_shape) == 2 else ("shard",)
    mesh = ctx.mesh(example.mesh_shape, names)
    model = build_model(example.dims, ctx.device)
    reference = ReferenceModel(model, sgd)
    for block, own in zip(model, example.own_group, strict=True):
        if own:
            impl.fully_shard(block, mesh=mesh, reshard_after_forward=example.reshard_after_forward)
    impl.fully_shard(model, mesh=mesh, reshard_after_forward=example.reshard_after_forward)
    optimizer = sgd(model.parameters())
    assert_sharded_parity(reference.module, model, check_grads=False)
    torch.manual_seed(1000 + ctx.rank)  # different data on every rank: averaging matters
    for step in range(example.steps):
        for micro in range(example.microbatches):
            last = micro == example.microbatches - 1
            if example.microbatches > 1:
                model.set_requires_gradient_sync(last)
            inp = torch.randn(example.batch, example.dims[0], device=ctx.device)
            loss = model(inp).mean()
            loss.backward()
            if last:
                reference_loss = reference.forward_backward(lambda m, x=inp: m(x).mean())
            else:  # accumulate locally; the last microbatch averages the sum
                reference_loss = reference.module(inp).mean()
                reference_loss.backward()
            assert_losses_equal(step, loss.detach(), reference_loss.detach(), **tolerance)
        assert_sharded_parity(reference.module, model, **tolerance)
        optimizer.step()
        optimizer.zero_grad()
        reference.step()
        assert_sharded_parity(reference.module, model, check_grads=False, **tolerance)


def check_example(
    request: pytest.FixtureRequest, impl: Any, example: TrainingExample, tolerance: Any
) -> None:
    try:
        run_in_session(
            request.config,
            train_and_compare,
            example.world_size,
            {"impl": impl, "example": example, "tolerance": tolerance.resolve()},
            context=f"{request.node.nodeid} with {example}",
            # torch's fully_shard keeps an int reshard_after_forward's sub-mesh past the
            # harness's group teardown; ranks of its own keep examples independent.
            fresh=not isinstance(example.reshard_after_forward, bool),
            device_audit=True,  # as every conformance case (distconform.suites.cases.conformance)
        )
    except DistributedFailure as failure:
        command = (
            f"{REPLAY_ENV}={shlex.quote(example.to_json())} python -m pytest "
            f"{shlex.quote(request.node.nodeid)} --impl {shlex.quote(impl.spec)} -p no:randomly"
        )
        raise AssertionError(
            f"{failure}\n\nexample: {example}\nreplay just this example with:\n  {command}"
        ) from None


def run_property(
    request: pytest.FixtureRequest, impl: Any, tolerance: Any, settings, max_world_size: int
) -> None:
    replay = os.environ.get(REPLAY_ENV)
    if replay:
        check_example(request, impl, TrainingExample.from_json(replay), tolerance)
        return

    @settings
    @given(example=training_examples(frozenset(impl.capabilities), max_world_size))
    def sharded_training_matches(example: TrainingExample) -> None:
        check_example(request, impl, example, tolerance)

    sharded_training_matches()


def test_sharded_training_matches_a_plain_model(request, impl, conformance_tolerance):
    # The default run stays cheap: world sizes up to 4; the slow test draws up to 8.
    run_property(request, impl, conformance_tolerance, profile("distconform-ci"), 4)


@pytest.mark.slow
def test_sharded_training_matches_a_plain_model_many_examples(request, impl, conformance_tolerance):
    run_property(request, impl, conformance_tolerance, profile("distconform-slow"), MAX_WORLD_SIZE)
