"""The ``recurse`` argument of FSDPModule's setters, and both values of each setter.

``recurse=True`` (the default) sets every group in the module's subtree, ``recurse=False``
the module's own group only (FSDP2's docstrings: "whether to set for all FSDP submodules or
just the passed-in module"). Each item calls one setter on the root of a two-block model
whose root owns a group of its own: first the non-default value with ``recurse=True``, so
every group changes, then the default with ``recurse=False``, so the root's group goes back
while the blocks keep the non-default value (and, where the blocks' deferred work shows only
later, the default with ``recurse=True`` last). An implementation that ignores ``recurse``,
or either value, leaves the groups in other states, which each setter's oracle tells apart
(``set_separate_reduce_scatter_group``'s recurse is checked by its own case in
``test_reduce_controls``):

* ``set_requires_gradient_sync``, ``set_reshard_after_forward``,
  ``set_reshard_after_backward``: every step's collectives against FSDP2's schedule for the
  flags in force (``suites/schedule``; the plan's controls apply ``recurse`` as documented);
* ``set_requires_all_reduce``: on a ``(world, 1)`` HSDP mesh, which groups all-reduce in
  each step;
* ``set_reduce_scatter_unused_params``: a parameter no rank uses gets a zero gradient in a
  group with the flag, and none (as in a plain model) in a group without it.

The blocks have distinct widths, so the size of a collective names its group. Every item
ends with the gradients of a plain model run on the same inputs, summed over the steps and
averaged over the ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconform.api import CollectiveCall, CommTracer, assert_sharded_parity, average_gradients
from distconform.suites.cases import conformance, grid
from distconform.suites.models import WidthStack
from distconform.suites.schedule import ScheduleRecorder, ShardingPlan

#: (value, recurse) of the call on the root before each step; ``None``: no call.
Phases = list[tuple[bool | None, bool | None]]
#: Per setter, the calls on the root before each step: the non-default value everywhere, the
#: default on the root alone, then the default everywhere.
SCHEDULE_PHASES: dict[str, Phases] = {
    "requires_gradient_sync": [(False, True), (True, False), (True, True)],
    # Unsharded parameters kept after backward show in the next forward (no all-gather), so
    # a fourth step follows the last call.
    "reshard_after_backward": [(False, True), (True, False), (True, True), (None, None)],
    # True is the non-root groups' own default and False the root's: set False everywhere
    # first, so that True on the root alone differs from True passed on to the blocks. The
    # first call comes before the first forward: it must outlive the root's lazy init, which
    # resolves the defaults of the groups nobody set.
    "reshard_after_forward": [(False, True), (True, False), (True, True)],
}
SETTERS = [*SCHEDULE_PHASES, "requires_all_reduce", "unused_params"]


def two_block_stack(rank_ctx, impl, mesh=None) -> tuple[WidthStack, WidthStack, ShardingPlan]:
    """A :class:`WidthStack` of two blocks, a group each, under a root group that owns the
    head; its plain copy; and the plan it was sharded through."""
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = WidthStack(n_blocks=2)
    reference = copy.deepcopy(model)
    plan = ShardingPlan(impl, mesh=mesh)
    kwargs = {} if mesh is None else {"mesh": mesh}
    for layer in model.layers:
        plan.fully_shard(layer, **kwargs)
    plan.fully_shard(model, **kwargs)
    plan.name_groups(model)
    return model, reference, plan


def forward_backward(rank_ctx, model: nn.Module, reference: nn.Module) -> None:
    inp = torch.randn(4, 4, device=rank_ctx.device)
    model(inp).sum().backward()
    reference(inp).sum().backward()


def groups_of(plan: ShardingPlan, calls: Iterable[CollectiveCall], kind: str) -> list[str]:
    """The group each call of ``kind`` belongs to, named by its size: a reduce-scatter sends a
    group's padded gradients, an all-reduce its reduce-scatter output."""
    sizes = {}
    for group in plan.groups:
        padded = group.layout.padded_numel(group.ranks.shard_size)
        sizes[padded if kind == "reduce_scatter" else padded // group.ranks.shard_size] = group
    named = []
    for call in calls:
        group = sizes.get(call.numel)
        assert group is not None, f"a {kind} of {call.numel} elements belongs to no group"
        named.append(group.name)
    return named


def run_schedule_phases(rank_ctx, impl, setter: str) -> None:
    model, reference, plan = two_block_stack(rank_ctx, impl)
    recorder = ScheduleRecorder(plan, model)
    root = plan.controls(model)
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for index, (value, recurse) in enumerate(SCHEDULE_PHASES[setter]):
        if value is not None:
            getattr(root, f"set_{setter}")(value, recurse=recurse)
        with recorder.step(f"step {index}, after set_{setter}({value}, recurse={recurse})"):
            forward_backward(rank_ctx, model, reference)
    recorder.close()
    average_gradients(reference)
    assert_sharded_parity(reference, model)


def run_requires_all_reduce(rank_ctx, impl) -> None:
    # A shard group of one rank: every group's gradient goes through the all-reduce alone.
    mesh = rank_ctx.mesh((rank_ctx.world_size, 1), ("replicate", "shard"))
    model, reference, plan = two_block_stack(rank_ctx, impl, mesh)
    everyone = {group.name for group in plan.groups}
    expected = [(False, True, set()), (True, False, {"root"}), (True, True, everyone)]
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for value, recurse, all_reducing in expected:
        model.set_requires_all_reduce(value, recurse=recurse)
        with CommTracer(functional=False) as trace:
            forward_backward(rank_ctx, model, reference)
        seen = sorted(groups_of(plan, trace.select("all_reduce"), "all_reduce"))
        assert seen == sorted(all_reducing), (
            f"after set_requires_all_reduce({value}, recurse={recurse}) on the root: "
            f"all-reduces of {seen}, expected {sorted(all_reducing)}\n{trace.schedule()}"
        )
    average_gradients(reference)
    assert_sharded_parity(reference, model)


class WithSpare(nn.Module):
    """``relu(used(x))``; ``spare`` is never called."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.used = nn.Linear(dim, dim)
        self.spare = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.used(x))


class SpareStack(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([WithSpare(dim), WithSpare(dim)])
        self.head = WithSpare(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def run_unused_params(rank_ctx, impl) -> None:
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = SpareStack()
    reference = copy.deepcopy(model)
    for layer in model.layers:
        impl.fully_shard(layer)
    impl.fully_shard(model)
    # (value, recurse, the spare parameters' owners that get a zero gradient)
    expected = [
        (True, True, {"layers.0", "layers.1", "head"}),
        (False, False, {"layers.0", "layers.1"}),
    ]
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for value, recurse, zeroed in expected:
        model.set_reduce_scatter_unused_params(value, recurse=recurse)
        forward_backward(rank_ctx, model, reference)
        average_gradients(reference)
        for name, param in reference.named_parameters():
            if name.rsplit(".spare.", 1)[0] in zeroed:
                param.grad = torch.zeros_like(param)
        assert_sharded_parity(reference, model)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)


@conformance("fsdp.setters.recurse")
@pytest.mark.parametrize("point", grid(setter=SETTERS))
def test_setter_recurse_reaches_the_subtree_or_the_group(rank_ctx, impl, point):
    setter = point["setter"]
    if setter in SCHEDULE_PHASES:
        run_schedule_phases(rank_ctx, impl, setter)
    elif setter == "requires_all_reduce":
        run_requires_all_reduce(rank_ctx, impl)
    else:
        run_unused_params(rank_ctx, impl)
