"""The schedule oracle against hand counts, and the check against hand-made traces.

``suites/schedule`` is the specification the wire-level cases hold implementations to, so
its own rules are pinned here without any implementation: a plan of one rank's view (no
process group), a hand-written sequence of module events, and every expected collective
worked out by hand below from FSDP2's padding rule (a parameter's dim 0 padded to a multiple
of the shard group's size).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from distconform.harness.comm import CollectiveCall
from distconform.suites.models import WidthStack
from distconform.suites.schedule.check import StepRecord, mismatches
from distconform.suites.schedule.oracle import (
    BACKWARD_COMPUTE,
    BACKWARD_ENTER,
    FLAG,
    FORWARD_COMPUTE,
    FORWARD_ENTER,
    FORWARD_EXIT,
    Event,
    ExpectedCall,
    Oracle,
)
from distconform.suites.schedule.plan import ShardingPlan


class RecordingImplementation:
    """Stands in for an implementation: the plan only needs ``fully_shard`` to be callable."""

    def fully_shard(self, module, **kwargs):
        return module

    def replicate(self, module, **kwargs):
        return module


def width_stack_plan(rank: int, raf) -> tuple[ShardingPlan, nn.Module]:
    """WidthStack(3): Linear(4, 5), Linear(5, 6), Linear(6, 7) blocks and a Linear(7, 3) head,
    seen from ``rank`` of 4, each block its own group, the head the root's."""
    model = WidthStack(n_blocks=3)
    plan = ShardingPlan(RecordingImplementation(), rank=rank, world_size=4)
    for layer in model.layers:
        plan.fully_shard(layer, reshard_after_forward=raf)
    plan.fully_shard(model)
    plan.name_groups(model)
    return plan, model


def one_step(plan: ShardingPlan) -> list[Event]:
    """The events of one forward and backward through WidthStack(3), in program order."""
    root, *layers = [plan.groups[-1], *plan.groups[:-1]]
    events = [Event(FORWARD_ENTER, root)]
    for layer in layers:
        events += [
            Event(FORWARD_ENTER, layer),
            Event(FORWARD_COMPUTE, layer),
            Event(FORWARD_EXIT, layer),
        ]
    events += [Event(FORWARD_COMPUTE, root), Event(FORWARD_EXIT, root)]
    events += [Event(BACKWARD_ENTER, root), Event(BACKWARD_COMPUTE, root)]
    for layer in reversed(layers):
        events += [Event(BACKWARD_ENTER, layer), Event(BACKWARD_COMPUTE, layer)]
    return events


# Elements per rank, by hand. Padded to 4 rows: layers.0 weight 5x4 -> 8x4 = 32, bias 5 -> 8:
# 40; layers.1 8x5 + 8 = 48; layers.2 8x6 + 8 = 56; the head 4x7 + 4 = 32.
PADDED = {"layers.0": 40, "layers.1": 48, "layers.2": 56, "root": 32}


def summary(calls: list[ExpectedCall]) -> list[tuple[str, str, tuple[int, ...], int]]:
    return [(c.kind, c.group, c.ranks, c.numel) for c in calls]


def test_an_int_reshard_after_forward_gathers_over_consecutive_ranks_in_backward():
    plan, _ = width_stack_plan(rank=2, raf=2)
    world = (0, 1, 2, 3)
    pair = (2, 3)  # rank 2's block of 2 consecutive ranks
    calls = Oracle(plan).expected(one_step(plan))
    assert summary(calls) == [
        ("all_gather", "root", world, 32 // 4),
        ("all_gather", "layers.0", world, 40 // 4),
        ("all_gather", "layers.1", world, 48 // 4),
        ("all_gather", "layers.2", world, 56 // 4),
        # The root keeps its parameters (its default); it prefetches the block that finished
        # forward just before it, which kept half of its group.
        ("all_gather", "layers.2", pair, 56 // 2),
        ("all_gather", "layers.1", pair, 48 // 2),
        ("all_gather", "layers.0", pair, 40 // 2),
        ("reduce_scatter", "root", world, 32),
        ("reduce_scatter", "layers.2", world, 56),
        ("reduce_scatter", "layers.1", world, 48),
        ("reduce_scatter", "layers.0", world, 40),
    ]
    assert [c.why for c in calls[4:7]] == [
        "implicit backward prefetch by root",
        "implicit backward prefetch by layers.2",
        "implicit backward prefetch by layers.1",
    ]


def test_windows_follow_the_module_events():
    plan, _ = width_stack_plan(rank=0, raf=True)
    events = one_step(plan)
    calls = Oracle(plan).expected(events)
    by_why = {c.why: c for c in calls}

    def label(index):
        return None if index is None else events[index].label()

    # A block's own all-gather: after it is entered, before it computes.
    own = by_why["forward of layers.1"]
    assert (label(own.after), label(own.before)) == ("F> layers.1", "F. layers.1")
    # A block's reduction: after its backward computation starts, before the backward
    # reaches the block before it; the root's, any time after its backward began.
    reduce = by_why["gradients of layers.2"]
    assert (label(reduce.after), label(reduce.before)) == ("B. layers.2", "B> layers.1")
    root = by_why["gradients of root"]
    assert (label(root.after), label(root.before)) == ("B. root", None)


def test_explicit_lists_replace_the_implicit_prefetch_and_keep_their_order():
    plan, model = width_stack_plan(rank=0, raf=True)
    layers = list(model.layers)
    for layer in layers:  # what the plan's controls forward to, on a plain module
        layer.set_modules_to_forward_prefetch = lambda modules: None
        layer.set_modules_to_backward_prefetch = lambda modules: None
    plan.controls(layers[0]).set_modules_to_forward_prefetch([layers[2], layers[1]])
    plan.controls(layers[2]).set_modules_to_backward_prefetch([layers[0], layers[1]])
    events = one_step(plan)
    calls = Oracle(plan).expected(events)
    in_forward = [events[c.after].code.startswith("F") for c in calls]
    forward = [c for c, fwd in zip(calls, in_forward, strict=True) if fwd]
    assert [(c.group, c.why) for c in forward] == [
        ("root", "forward of root"),
        ("layers.0", "forward of layers.0"),
        ("layers.2", "forward prefetch by layers.0"),
        ("layers.1", "forward prefetch by layers.0"),
    ]
    assert len({c.block for c in forward[1:]}) == 1  # one ordered block
    backward = [
        (c.group, c.why)
        for c, fwd in zip(calls, in_forward, strict=True)
        if c.kind == "all_gather" and not fwd
    ]
    assert backward == [
        ("layers.2", "implicit backward prefetch by root"),
        ("layers.0", "backward prefetch by layers.2"),
        ("layers.1", "backward prefetch by layers.2"),
    ]


def test_gradient_sync_off_skips_the_reductions_and_mixed_precision_sets_the_dtypes():
    model = WidthStack(n_blocks=3)
    plan = ShardingPlan(RecordingImplementation(), rank=0, world_size=4)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        plan.fully_shard(layer, mp_policy=mp)
    plan.fully_shard(model, mp_policy=mp)
    plan.name_groups(model)
    events = one_step(plan)
    calls = Oracle(plan).expected(events)
    assert {c.dtype for c in calls if c.kind == "all_gather"} == {"bf16"}
    assert {c.dtype for c in calls if c.kind == "reduce_scatter"} == {"f32"}
    no_sync = [Event(FLAG, g, 0, {"requires_gradient_sync": False}) for g in plan.groups]
    calls = Oracle(plan).expected(no_sync + events)
    assert not [c for c in calls if c.kind == "reduce_scatter"]


# --- the check ------------------------------------------------------------------------------


# The check reads only an event's label; a stand-in group names it.
EVENT_GROUP = SimpleNamespace(name="g")


def traced(kind: str, ranks: tuple[int, ...], numel: int, seq: int, op=None) -> CollectiveCall:
    return CollectiveCall(
        seq=seq,
        group_seq=seq,
        kind=kind,
        api=f"dist.{kind}",
        group="world",
        group_name="0",
        group_ranks=ranks,
        shapes=((numel,),),
        dtypes=("f32",),
        numel=numel,
        nbytes=4 * numel,
        out_numel=numel,
        out_nbytes=4 * numel,
        wire_bytes=0,
        phase="-",
        site="here",
        op=op,
    )


def expected(kind: str, numel: int, after: int, before: int | None, block: int, op=None):
    return ExpectedCall(kind, (0, 1), "f32", numel, "g", "why", after, before, block, op, "world")


@pytest.mark.parametrize(
    ("calls", "positions", "complaint"),
    [
        pytest.param([("all_gather", 8)], [0, 1, 1], "missing: reduce_scatter", id="missing"),
        pytest.param(
            [("all_gather", 8), ("reduce_scatter", 16), ("all_reduce", 1)],
            [0, 1, 2],
            "unexpected: all_reduce",
            id="unexpected",
        ),
        pytest.param(
            [("all_gather", 8), ("reduce_scatter", 16)],
            [1, 2, 2],  # the all-gather came before the event it is due after
            "out of place: all_gather",
            id="out-of-place",
        ),
        pytest.param(
            [("reduce_scatter", 16), ("all_gather", 8)],
            [0, 0, 0],
            "out of order",
            id="out-of-order",
        ),
    ],
)
def test_the_check_names_what_departs(calls, positions, complaint):
    oracle = [expected("all_gather", 8, 0, 1, 1), expected("reduce_scatter", 16, 0, None, 1)]
    trace = [traced(kind, (0, 1), numel, seq) for seq, (kind, numel) in enumerate(calls)]
    events = [
        Event(FORWARD_ENTER, EVENT_GROUP),
        Event(FORWARD_EXIT, EVENT_GROUP),
        Event(BACKWARD_ENTER, EVENT_GROUP),
    ]
    problems = mismatches(oracle, StepRecord(trace, events, positions))
    assert any(problem.startswith(complaint) for problem in problems), problems


def test_the_check_holds_a_forced_sum_to_its_op():
    oracle = [expected("reduce_scatter", 16, 0, None, 1, op="SUM")]
    events = [Event(BACKWARD_ENTER, EVENT_GROUP)]
    ok = StepRecord([traced("reduce_scatter", (0, 1), 16, 0, op="SUM")], events, [0])
    avg = StepRecord([traced("reduce_scatter", (0, 1), 16, 0, op="AVG")], events, [0])
    assert mismatches(oracle, ok) == []
    assert any("wrong reduce op" in p for p in mismatches(oracle, avg))
