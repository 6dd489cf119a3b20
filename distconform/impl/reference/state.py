"""Per-call state and the hooks that drive one training step.

One ``FSDPState`` per ``fully_shard``/``replicate`` call, shared by the call's modules. A
training step, in order:

1. **Pre-forward** (module forward pre-hook). The first state to run forward lazily becomes
   the root (``lazy_init``): it claims every state below it, decides the default
   reshard-after-forward of each, and rejects parameters tied across groups. The root moves
   forward inputs to the device. Every state unshards its group (one all-gather).
2. **Post-forward** (module forward hook). Once all modules of a group have run, the group
   reshards if its reshard-after-forward policy says so. A hook is put on each output that
   requires grad, so that the group's *pre-backward* runs when the first gradient reaches it.
3. **Pre-backward** (tensor hook). Unshard again if resharded (one more all-gather), and
   queue the end-of-backward callback once per backward.
4. **Post-backward** (post-accumulate-grad hook on the unsharded parameters, see ``group.py``).
   When every gradient the group expects has arrived: reduce them (one reduce-scatter, or one
   all-reduce for replicate) unless gradient sync is off, then reshard unless told not to.
5. **End of backward** (queued callback). Groups that did not see all their gradients (unused
   parameters, partial forwards) get their post-backward now; per-iteration state is reset.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distconform.impl import _torch_private
from distconform.impl.reference.group import ParamGroup
from distconform.impl.reference.policies import (
    MixedPrecisionPolicy,
    cast_forward_inputs,
    cast_forward_output,
)

# Weak both ways: a state refers to its modules, so a strong value would keep every sharded
# model (and the process groups of its mesh) alive for the rest of the process. The module's
# own hooks, bound methods of the state, are what keep a state alive exactly as long as it.
_STATE_OF_MODULE: weakref.WeakKeyDictionary[nn.Module, weakref.ref[FSDPState]] = (
    weakref.WeakKeyDictionary()
)


def state_of(module: nn.Module) -> FSDPState | None:
    ref = _STATE_OF_MODULE.get(module)
    return ref() if ref is not None else None


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"


class StateContext:
    """What the states under one root share: the iteration's bookkeeping."""

    def __init__(self, states: list[FSDPState]) -> None:
        self.all_states = states
        self.iter_forward_root: FSDPState | None = None
        self.final_callback_queued = False
        self.is_last_backward = True
        # set_manual_backward_finalization: the end of backward leaves the groups' flush
        # (reduction of what is still unreduced, reshard) to finalize_backward.
        self.manual_backward_finalization = False
        # States in the order their groups finished forward, with multiplicity (a module
        # called twice appears twice): backward walks it in reverse to prefetch implicitly.
        self.post_forward_order: list[FSDPState] = []

    @property
    def in_backward(self) -> bool:
        """A backward of this root's states is running (its final callback is queued)."""
        return self.final_callback_queued

    def queue_final_callback(self) -> None:
        if self.final_callback_queued:
            return
        self.final_callback_queued = True
        _torch_private.queue_autograd_callback(self.end_of_backward)

    def end_of_backward(self) -> None:
        # Reverse forward order, like autograd: later groups' gradients are complete first.
        for state in reversed(self.all_states):
            state.modules_to_run_forward.clear()
            state.post_forward_indices.clear()
            if state.group is not None and not self.manual_backward_finalization:
                state.group.post_backward()
            state.training = TrainingState.IDLE
        self.iter_forward_root = None
        self.final_callback_queued = False
        self.post_forward_order.clear()

    def finalize_backward(self) -> None:
        """What the end of backward leaves to the caller in manual mode: every group reduces
        what it still holds (as gradient sync now says) and reshards (as it is set to)."""
        for state in reversed(self.all_states):
            if state.group is not None:
                state.group.post_backward()


class GradientReductionHandle:
    """Returned by ``finalize_backward(async_op=True)``. The reference reduces synchronously,
    so the gradients are final when it is returned and ``wait()`` has nothing to wait for."""

    def wait(self) -> None:
        return None


class FSDPState:
    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        device: torch.device,
        group: ParamGroup | None,
        reshard_after_forward: bool | int | None,
        replicated: bool,
        tied_elsewhere: list[tuple[str, FSDPState]],
    ) -> None:
        self.modules = modules
        self.device = device
        self.group = group
        self.replicated = replicated
        self.requested_reshard_after_forward = reshard_after_forward
        # (fqn, owning state) of parameters of this group that another group already manages
        # (a weight tied across groups); an error at lazy init, where module names are known.
        self.tied_elsewhere = tied_elsewhere
        self.is_root: bool | None = None
        self.ctx = StateContext([self])
        self.training = TrainingState.IDLE
        self.modules_to_run_forward: set[nn.Module] = set()
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        # This state's positions in ``ctx.post_forward_order``; pre-backward pops the last.
        self.post_forward_indices: list[int] = []
        self.unshard_in_backward = True
        self.post_optim_event: Any = None
        # Set by fully_shard/replicate: inputs and outputs of every module call are cast by it.
        self.mp_policy = MixedPrecisionPolicy()
        for module in modules:
            _STATE_OF_MODULE[module] = weakref.ref(self)
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward, prepend=False)

    # --- root --------------------------------------------------------------------------

    def lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        states = _states_below(self.modules)
        for state in states:
            if state.tied_elsewhere:
                raise ValueError(self._tied_across_groups_message(state))
        ctx = StateContext(states)
        # Set on the root before its first forward, when it had a context of its own.
        ctx.is_last_backward = self.ctx.is_last_backward
        ctx.manual_backward_finalization = self.ctx.manual_backward_finalization
        for state in states:
            if state is not self:
                state.is_root = False
            state.ctx = ctx
            state._resolve_reshard_after_forward()

    def _tied_across_groups_message(self, state: FSDPState) -> str:
        names: dict[nn.Module, str] = {}
        for index, top in enumerate(self.modules):
            prefix = f"[{index}]" if len(self.modules) > 1 else ""
            for name, module in top.named_modules():
                names.setdefault(module, ".".join(p for p in (prefix, name) if p) or "<root>")

        def describe(owner: FSDPState) -> str:
            return " + ".join(
                f"{names.get(m, '<outside this root>')} ({type(m).__name__})" for m in owner.modules
            )

        lines = [
            f"parameter {fqn!r} of the fully_shard group of {describe(state)} is already managed "
            f"by another fully_shard group, that of {describe(owner)}"
            for fqn, owner in state.tied_elsewhere
        ]
        return (
            "; ".join(lines) + ". Parameters shared between modules (weight tying) must be in "
            "one group, e.g. fully_shard([module_a, module_b])"
        )

    def _resolve_reshard_after_forward(self) -> None:
        if self.group is None:
            return
        requested = self.requested_reshard_after_forward
        if self.replicated:
            resharded = False  # replicate keeps parameters unsharded until backward ends
        elif requested is None:
            # The root's parameters are needed again right away by backward.
            resharded = not self.is_root
        else:
            # An int k > 1 reshards to groups of k ranks (the group's post-forward mesh).
            resharded = requested if isinstance(requested, bool) else requested > 1
        self.group.reshard_after_forward = resharded

    # --- forward -----------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.training is TrainingState.PRE_BACKWARD:
            # Recomputation (activation checkpointing) inside backward needs the parameters.
            if self.group is not None:
                self.group.unshard()
            return cast_forward_inputs(self.mp_policy, args, kwargs)
        first_module_of_pass = self.training is not TrainingState.FORWARD
        self.training = TrainingState.FORWARD
        if first_module_of_pass:
            self.lazy_init()
            if self.ctx.iter_forward_root is None:
                self.ctx.iter_forward_root = self
                if self.is_root:
                    args, kwargs = _move_to_device((args, kwargs), self.device)
                    self._wait_for_post_optim_event()
            self.modules_to_run_forward = set(self.modules)
        args, kwargs = cast_forward_inputs(self.mp_policy, args, kwargs)
        if self.group is not None:
            self.group.unshard(self.group.unshard_async_op)
            self.group.wait_for_unshard()
        if first_module_of_pass:
            for target in self.forward_prefetch:
                if target.group is not None:
                    target.group.unshard(async_op=True)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.training is TrainingState.PRE_BACKWARD:
            return cast_forward_output(self.mp_policy, output)
        self.modules_to_run_forward.discard(module)
        if not self.modules_to_run_forward:
            self._finish_forward()
        output = self._hook_pre_backward(output)
        if self.ctx.iter_forward_root is self:
            # A group whose modules did not all run (a partial forward) finishes here.
            for state in self.ctx.all_states:
                if state is not self and state.modules_to_run_forward:
                    state.modules_to_run_forward.clear()
                    state._finish_forward()
            self.ctx.iter_forward_root = None
        return cast_forward_output(self.mp_policy, output)

    def _wait_for_post_optim_event(self) -> None:
        # The optimizer may have run on another stream: this forward's all-gathers, issued
        # on the current stream, must not read parameters it is still writing. Used once,
        # as FSDP2 clears it: a later forward waiting on a stale event would be a bug.
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None:
            torch.accelerator.current_stream(self.device).wait_event(event)

    def _finish_forward(self) -> None:
        if self.group is not None and not self.ctx.in_backward:
            # Recomputation (activation checkpointing) inside backward keeps the parameters:
            # this group's own backward, which needs them, is about to run.
            self.group.reshard_after_forward_step()
            if torch.is_grad_enabled():
                self.post_forward_indices.append(len(self.ctx.post_forward_order))
                self.ctx.post_forward_order.append(self)
        self.training = TrainingState.IDLE

    def _hook_pre_backward(self, output: Any) -> Any:
        if torch.is_grad_enabled():
            for tensor in _tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(self.pre_backward)
        return output

    # --- backward ----------------------------------------------------------------------

    def pre_backward(self, grad: torch.Tensor) -> None:
        if self.training is TrainingState.PRE_BACKWARD:
            return
        self.training = TrainingState.PRE_BACKWARD
        self.ctx.queue_final_callback()
        if self.group is not None and self.unshard_in_backward:
            self.group.unshard()
        # Explicit lists replace the implicit one-module-ahead prefetch.
        targets = self.backward_prefetch or self._implicit_backward_prefetch_target()
        for target in targets:
            if target.group is not None and target.unshard_in_backward:
                target.group.unshard(async_op=True)

    def _implicit_backward_prefetch_target(self) -> list[FSDPState]:
        """The group that finished forward just before this one: backward needs it next.

        Reverse post-forward order is a guess: a module whose forward ran but whose backward
        does not (or runs out of order) makes it prefetch the wrong group, which costs memory
        for a while, never correctness: every group still unshards itself before use.
        """
        if not self.post_forward_indices:
            return []
        index = self.post_forward_indices.pop() - 1
        return [self.ctx.post_forward_order[index]] if index >= 0 else []

    def reset_iter_state(self) -> None:
        for state in self.ctx.all_states:
            state.modules_to_run_forward.clear()
            state.post_forward_indices.clear()
            state.training = TrainingState.IDLE
            if state.group is not None:
                state.group.reset()
        self.ctx.iter_forward_root = None
        self.ctx.final_callback_queued = False
        self.ctx.post_forward_order.clear()


def _states_below(modules: tuple[nn.Module, ...]) -> list[FSDPState]:
    """Every state in the subtrees of ``modules``, each once, in pre-order (forward order)."""
    seen: dict[int, FSDPState] = {}
    for root in modules:
        for module in root.modules():
            state = state_of(module)
            if state is not None and id(state) not in seen:
                seen[id(state)] = state
    return list(seen.values())


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors_in(item)]
    return []


def _move_to_device(value: Any, device: torch.device) -> Any:
    return _map_tensors(value, lambda t: t if t.device == device else t.to(device))


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value
