"""``set_post_optim_event``: the next all-gathers wait for an event recorded after the
optimizer step instead of the whole stream (fully_shard and replicate).

Needs real device events: skipped on CPU (cases.toml), where ``record_event()`` gives None.
A step post-hook records the current stream's event and hands it to the root; the device is
then kept busy for 25 ms, so an all-gather that did not wait for the event would read
parameters the optimizer had not finished writing.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from harness.comm import device_sleep
from harness.parity import ReferenceModel, assert_losses_equal
from suites.cases import conformance
from suites.models import ModelArgs, Transformer
from suites.training import STEPS, adamw

SLEEP_AFTER_STEP_S = 0.025


def record_post_optim_event(model: nn.Module, optimizer, args, kwargs) -> None:
    event = torch.accelerator.current_stream().record_event()
    model.set_post_optim_event(event)


def run_post_optim_event(rank_ctx, distribute) -> None:
    with torch.device(rank_ctx.device):
        model = Transformer(ModelArgs(dropout_p=0.0))
        reference = ReferenceModel(model, adamw)
        for layer in model.layers:
            distribute(layer)
        distribute(model)
        optimizer = adamw(model.parameters())
        optimizer.register_step_post_hook(functools.partial(record_post_optim_event, model))
        torch.manual_seed(42 + rank_ctx.rank)
        inputs = [torch.randint(0, 8, (2, 8)) for _ in range(STEPS)]
        ref_losses = []
        for inp in inputs:
            ref_losses.append(reference.forward_backward(lambda m, inp=inp: m(inp).sum()))
            reference.step()
        for step, inp in enumerate(inputs):
            loss = model(inp).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            device_sleep(SLEEP_AFTER_STEP_S)
            assert_losses_equal(step, loss, ref_losses[step])


@conformance("fsdp.post_optim_event")
def test_post_optim_event(rank_ctx, impl):
    run_post_optim_event(rank_ctx, impl.fully_shard)


@conformance("replicate.post_optim_event")
def test_replicate_post_optim_event(rank_ctx, impl):
    run_post_optim_event(rank_ctx, impl.replicate)
