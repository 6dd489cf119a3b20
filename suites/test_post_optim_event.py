"""``set_post_optim_event``: the next all-gathers wait for an event recorded after the
optimizer step instead of the whole stream (fully_shard and replicate).

Needs real device events: skipped on CPU (cases.toml), where ``record_event()`` gives None.
A step post-hook records the current stream's event and hands it to the root; the device is
then kept busy for 25 ms, so an all-gather that did not wait for the event would read
parameters the optimizer had not finished writing.

Where the device keeps a record of which event each stream waited on
(:func:`harness.devices.event_wait_record`; the fake accelerator does), the case also checks
the waits themselves: each forward after the first waits for the event of the step just
before it, and for no older one. An implementation whose forward never waits, or that keeps
waiting on the first step's event, fails there even on a device whose work is synchronous.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from harness.comm import device_sleep
from harness.devices import event_wait_record
from harness.parity import ReferenceModel, assert_losses_equal
from suites.cases import conformance
from suites.models import ModelArgs, Transformer
from suites.training import STEPS, adamw

SLEEP_AFTER_STEP_S = 0.025


def record_post_optim_event(
    model: nn.Module, events: list[torch.Event], optimizer, args, kwargs
) -> None:
    event = torch.accelerator.current_stream().record_event()
    events.append(event)  # kept alive: an event's id is not reused while it lives
    model.set_post_optim_event(event)


def check_forward_waits(step: int, waited: set[int], events: list[torch.Event]) -> None:
    """The forward of ``step`` (after the first) waited for the previous step's event only."""
    stale = [index for index, event in enumerate(events[: step - 1]) if event.event_id in waited]
    assert not stale, (
        f"the forward of step {step} waited on the post-optim event of step {stale[0]}, a stale "
        f"one: the event is meant for the next forward only"
    )
    assert events[step - 1].event_id in waited, (
        f"the forward of step {step} did not wait for the post-optim event recorded after "
        f"step {step - 1} (set_post_optim_event): its all-gathers may read parameters the "
        f"optimizer is still writing"
    )


def run_post_optim_event(rank_ctx, distribute) -> None:
    take_waits = event_wait_record(rank_ctx.device_type)
    events: list[torch.Event] = []
    with torch.device(rank_ctx.device):
        model = Transformer(ModelArgs(dropout_p=0.0))
        reference = ReferenceModel(model, adamw)
        for layer in model.layers:
            distribute(layer)
        distribute(model)
        optimizer = adamw(model.parameters())
        optimizer.register_step_post_hook(functools.partial(record_post_optim_event, model, events))
        torch.manual_seed(42 + rank_ctx.rank)
        inputs = [torch.randint(0, 8, (2, 8)) for _ in range(STEPS)]
        ref_losses = []
        for inp in inputs:
            ref_losses.append(reference.forward_backward(lambda m, inp=inp: m(inp).sum()))
            reference.step()
        for step, inp in enumerate(inputs):
            if take_waits is not None:
                take_waits()  # what came before this forward
            loss = model(inp).sum()
            if take_waits is not None and step > 0:
                check_forward_waits(step, {row[2] for row in take_waits()}, events)
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
