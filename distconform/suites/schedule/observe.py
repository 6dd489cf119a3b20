"""Module events: where the program is, told by hooks the suite (not the implementation) owns.

Installed after sharding, so that they bracket the implementation's own work:

* ``F>`` a forward pre-hook put *in front of* every other pre-hook of the group's module:
  it fires before the implementation unshards anything for that module;
* ``F.`` a forward pre-hook on each leaf inside the group (not inside a nested group): the
  group's own computation starts, so its parameters must be unsharded by now;
* ``F<`` a forward hook appended after every other one: the group's forward is over;
* ``B>`` an identity autograd function on the group's outputs, added after the
  implementation saw them: its backward runs as the gradient arrives, before any hook the
  implementation put on those outputs;
* ``B.`` the same on each leaf's outputs: the backward of the group's own computation starts.

A group whose module has no children gets no ``F.``/``B.`` events (its computation is
the module's ``forward`` itself, which no hook can separate from the implementation's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from distconform.suites.schedule.oracle import (
    BACKWARD_COMPUTE,
    BACKWARD_ENTER,
    FORWARD_COMPUTE,
    FORWARD_ENTER,
    FORWARD_EXIT,
)
from distconform.suites.schedule.plan import GroupPlan, ShardingPlan

EventSink = Callable[[str, GroupPlan, int], None]


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward calls ``on_backward`` first."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], tensor: torch.Tensor) -> torch.Tensor:
        ctx.on_backward = on_backward
        # A copy, not a view: implementations warn about (and in-place ops on) view outputs.
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.on_backward()
        return None, grad


def _mark_outputs(value: Any, on_backward: Callable[[], None]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.requires_grad and torch.is_grad_enabled():
            return _BackwardMark.apply(on_backward, value)
        return value
    if isinstance(value, tuple | list):
        return type(value)(_mark_outputs(v, on_backward) for v in value)
    if isinstance(value, dict):
        return {k: _mark_outputs(v, on_backward) for k, v in value.items()}
    return value


def _leaves(group: GroupPlan, plan: ShardingPlan) -> list[nn.Module]:
    """Childless modules inside ``group`` but outside every group nested in it."""
    nested = {
        id(sub)
        for other in plan.groups
        if plan.nested(other, group)
        for own in other.modules
        for sub in own.modules()
    }
    own_modules = {id(m) for m in group.modules}
    return [
        sub
        for own in group.modules
        for sub in own.modules()
        if id(sub) not in nested and id(sub) not in own_modules and not list(sub.children())
    ]


def install(plan: ShardingPlan, emit: EventSink) -> list[RemovableHandle]:
    """Hook every group of ``plan``; ``emit(code, group, module_index)`` gets each event.

    ``F.`` and ``B.`` are emitted once per entry of the group (the first leaf to run).
    """
    handles: list[RemovableHandle] = []
    for group in plan.groups:
        state = {"computing": False, "backward_computing": False}

        def enter(group=group, state=state, index=0):
            def hook(module: nn.Module, args: Any) -> None:
                state["computing"] = False
                emit(FORWARD_ENTER, group, index)

            return hook

        def exit_(group=group, state=state, index=0):
            def on_backward() -> None:
                state["backward_computing"] = False
                emit(BACKWARD_ENTER, group, index)

            def hook(module: nn.Module, args: Any, output: Any) -> Any:
                emit(FORWARD_EXIT, group, index)
                return _mark_outputs(output, on_backward)

            return hook

        for index, module in enumerate(group.modules):
            handles.append(module.register_forward_pre_hook(enter(index=index), prepend=True))
            handles.append(module.register_forward_hook(exit_(index=index)))

        def compute_pre_hook(module: nn.Module, args: Any, group=group, state=state) -> None:
            if not state["computing"]:
                state["computing"] = True
                emit(FORWARD_COMPUTE, group, 0)

        def compute_hook(module: nn.Module, args: Any, output: Any, group=group, state=state):
            def on_backward() -> None:
                if not state["backward_computing"]:
                    state["backward_computing"] = True
                    emit(BACKWARD_COMPUTE, group, 0)

            return _mark_outputs(output, on_backward)

        for leaf in _leaves(group, plan):
            handles.append(leaf.register_forward_pre_hook(compute_pre_hook))
            handles.append(leaf.register_forward_hook(compute_hook))
    return handles
