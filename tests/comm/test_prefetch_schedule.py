"""The explicit-prefetching order of an 8-layer Transformer, asserted through a trace.

Each layer's forward and backward pre-hooks put a mark in the trace, so the schedule shows
which all-gathers happen before which layer runs. With explicit prefetching, entering
layer i all-gathers layers i+1 and i+2 ahead of their turn (backward: i-1 and i-2). The
root has no list, so its pre-backward prefetches the last layer implicitly, before that
layer's backward mark (torch's fully_shard and the reference agree). An
implementation that ignores the prefetch lists all-gathers each layer on entry, and the
same assertion fails (shown with an adapter that drops the lists).
"""

from __future__ import annotations

import pytest
import torch

from harness.comm import CommTracer, assert_schedule
from suites.models import ModelArgs, Transformer

N_LAYERS = 8


class IgnoresPrefetchLists:
    """A broken adapter: the wrapped implementation, except that prefetch lists are dropped."""

    def __init__(self, impl) -> None:
        self._impl = impl

    def fully_shard(self, module, **kwargs):
        sharded = self._impl.fully_shard(module, **kwargs)
        sharded.set_modules_to_forward_prefetch = lambda modules: None
        sharded.set_modules_to_backward_prefetch = lambda modules: None
        return sharded


def traced_step(impl) -> CommTracer:
    torch.manual_seed(42)
    model = Transformer(ModelArgs(n_layers=N_LAYERS, dropout_p=0.0))
    trace = CommTracer()
    layers = list(model.layers)
    for layer in layers:
        impl.fully_shard(layer)
    impl.fully_shard(model)
    for i, layer in enumerate(layers):
        # Prepended, so each mark precedes the implementation's own pre-hooks: the
        # all-gathers under a mark are the ones issued on entering that layer.
        layer.register_forward_pre_hook(
            lambda *a, i=i: trace.mark(f"forward layers.{i}"), prepend=True
        )
        layer.register_full_backward_pre_hook(
            lambda *a, i=i: trace.mark(f"backward layers.{i}"), prepend=True
        )
    for i, layer in enumerate(layers):
        if i < N_LAYERS - 2:
            layer.set_modules_to_forward_prefetch([layers[i + 1], layers[i + 2]])
        if i >= 2:
            layer.set_modules_to_backward_prefetch([layers[i - 1], layers[i - 2]])
    inp = torch.randint(0, 8, (2, 8))
    with trace:
        model(inp).sum().backward()
    return trace


def first_forward_gathers(schedule: str) -> int:
    """All-gathers between the marks of layers 0 and 1 in forward."""
    block = schedule.split("== forward layers.0\n")[1].split("== forward layers.1\n")[0]
    return block.count("all_gather")


@pytest.mark.world_size(2)
def test_explicit_prefetching_order(rank_ctx, impl):
    if "prefetch" not in impl.capabilities:
        pytest.skip(f"{impl.name} does not declare prefetch")
    trace = traced_step(impl)
    assert first_forward_gathers(trace.schedule()) == 3  # layer 0, and layers 1 and 2 ahead
    assert_schedule(
        trace,
        """\
forward  all_gather     world f32[208]
== forward layers.0
forward  all_gather     world f32[1608]
forward  all_gather     world f32[1608]
forward  all_gather     world f32[1608]
== forward layers.1
forward  all_gather     world f32[1608]
== forward layers.2
forward  all_gather     world f32[1608]
== forward layers.3
forward  all_gather     world f32[1608]
== forward layers.4
forward  all_gather     world f32[1608]
== forward layers.5
forward  all_gather     world f32[1608]
== forward layers.6
== forward layers.7
backward all_gather     world f32[1608]
== backward layers.7
backward all_gather     world f32[1608]
backward all_gather     world f32[1608]
backward reduce_scatter world f32[3216]
== backward layers.6
backward all_gather     world f32[1608]
backward reduce_scatter world f32[3216]
== backward layers.5
backward all_gather     world f32[1608]
backward reduce_scatter world f32[3216]
== backward layers.4
backward all_gather     world f32[1608]
backward reduce_scatter world f32[3216]
== backward layers.3
backward all_gather     world f32[1608]
backward reduce_scatter world f32[3216]
== backward layers.2
backward all_gather     world f32[1608]
backward reduce_scatter world f32[3216]
== backward layers.1
backward reduce_scatter world f32[3216]
== backward layers.0
backward reduce_scatter world f32[3216]
backward reduce_scatter world f32[416]
""",
    )


@pytest.mark.world_size(2)
def test_the_order_check_fails_when_prefetch_lists_are_ignored(rank_ctx, impl):
    if "prefetch" not in impl.capabilities:
        pytest.skip(f"{impl.name} does not declare prefetch")
    correct = traced_step(impl).schedule()
    broken = traced_step(IgnoresPrefetchLists(impl)).schedule()
    assert broken != correct
    assert first_forward_gathers(broken) == 1  # layer 0 only: nothing was prefetched
    # Same collectives, in another order relative to the layers.
    assert sorted(broken.splitlines()) == sorted(correct.splitlines())
