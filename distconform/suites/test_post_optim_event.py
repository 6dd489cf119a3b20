"""``set_post_optim_event``: the next all-gathers wait for an event recorded after the
optimizer step instead of the whole stream, and the event is discarded once waited on
(fully_shard and replicate).

Needs device events: skipped on CPU (cases.toml). A step post-hook records the current
stream's event after the steps with an even index and hands it to the root; after every
step (four) the device is kept busy for 25 ms, so an all-gather that waited for neither the event
nor the stream would read parameters the optimizer had not finished writing. The step
between (no event) checks that the event was discarded: a root that keeps waiting on the
old event lets the next forward run ahead of that step's optimizer.

On a device that checks stream safety (the fake device,
:mod:`distconform.harness.rank.stream_safety`) such a read fails the case every time, with both
stacks; elsewhere the sleep makes it change the losses. Where the device also keeps a record of
which event each stream waited on (:func:`distconform.harness.devices.event_wait_record`), the case
checks that the forward after an event waited for that event (it is the API's point: no false
dependency on the rest of the stream) and for no older one.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from distconform.api import ReferenceModel, assert_losses_equal, device_sleep, event_wait_record
from distconform.suites.cases import conformance
from distconform.suites.models import ModelArgs, Transformer
from distconform.suites.training import adamw

SLEEP_AFTER_STEP_S = 0.025
#: Events after steps 0 and 2, none after 1: forward 2 checks the event was discarded,
#: forward 3 that a new one replaces the old.
STEPS = 4


def record_post_optim_event(
    model: nn.Module, events: list[torch.Event | None], optimizer, args, kwargs
) -> None:
    """After even steps, hand the root this step's event; after odd ones, none."""
    if len(events) % 2:
        events.append(None)
        return
    event = torch.accelerator.current_stream().record_event()
    events.append(event)  # kept alive: an event's id is not reused while it lives
    model.set_post_optim_event(event)


def check_forward_waits(step: int, waited: set[int], events: list[torch.Event | None]) -> None:
    """The forward of ``step`` waited for the event set after the step before, if one was,
    and for no older one."""
    stale = [
        index
        for index, event in enumerate(events[: step - 1])
        if event is not None and event.event_id in waited
    ]
    assert not stale, (
        f"the forward of step {step} waited on the post-optim event of step {stale[0]}, a stale "
        f"one: the event is meant for the next forward only"
    )
    latest = events[step - 1]
    assert latest is None or latest.event_id in waited, (
        f"the forward of step {step} did not wait for the post-optim event recorded after "
        f"step {step - 1} (set_post_optim_event): it waits on the whole stream instead"
    )


def run_post_optim_event(rank_ctx, distribute) -> None:
    take_waits = event_wait_record(rank_ctx.device_type)
    events: list[torch.Event | None] = []
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
        losses = []
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
            # Compared after the loop: reading a loss here would make the host wait for the
            # stream, and then every later all-gather would be ordered after the step anyway.
            losses.append(loss.detach())
        for step, loss in enumerate(losses):
            assert_losses_equal(step, loss, ref_losses[step])


@conformance("fsdp.post_optim_event")
def test_post_optim_event(rank_ctx, impl):
    run_post_optim_event(rank_ctx, impl.fully_shard)


@conformance("replicate.post_optim_event")
def test_replicate_post_optim_event(rank_ctx, impl):
    run_post_optim_event(rank_ctx, impl.replicate)
