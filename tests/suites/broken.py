"""Deliberately broken implementations: every suite check must fail on at least one.

Each wraps a working implementation (the reference by default; the ``*_torch`` factories
wrap torch's ``fully_shard``, the way realistic bugs would sit in it) and breaks one
behaviour through the public surface only (the arguments passed on, the managed module's
methods), so the breakage survives changes inside the implementations:

numerics
* ``skip_grad_average``: gradients come out summed over the ranks, not averaged (every
  reduce-scatter's input is multiplied by its group's size);
* ``ignore_gradient_sync``: ``set_requires_gradient_sync`` does nothing (every backward
  reduces);
* ``ignore_divide_factor``: ``set_gradient_divide_factor`` does nothing;
* ``ignore_reduce_scatter_divide_factor``: its older name ``set_reduce_scatter_divide_factor``
  does nothing;
* ``ignore_all_reduce_hook``: ``set_all_reduce_hook`` does nothing;
* ``ignore_custom_all_gather`` / ``ignore_custom_reduce_scatter``: ``set_custom_all_gather`` /
  ``set_custom_reduce_scatter`` do nothing;
* ``custom_all_gather_output_discarded``: the custom all-gather is called, into its own buffer,
  and then that buffer is overwritten by a plain all-gather of the same input;
* ``max_input_buffers_unchecked``: ``set_reduce_scatter_max_input_buffers`` raises a cap below 1
  to 1 instead of refusing it;
* ``dp_mesh_dims_on_the_wrong_dim``: ``dp_mesh_dims`` is passed on with its dims moved: shard
  and replicate swapped when both are named, otherwise the named dim replaced by another mesh
  dim;
* ``finalize_backward_does_nothing``: ``finalize_backward`` returns at once (with a handle that
  waits for nothing), finishing no pending reduction or reshard;
* ``ignore_keep_unsharded_storage``: ``set_keep_unsharded_storage`` does nothing;
* ``ignore_reduce_scatter_unused_params``: ``set_reduce_scatter_unused_params`` does nothing;
* ``ignore_separate_reduce_scatter_group``: ``set_separate_reduce_scatter_group`` does nothing;
* ``skip_post_divide``: the fp16/fp64 reduction leaves out its division after the SUM (the
  gradients come out scaled by the post factor: 1 at world size 2, 2 at 4);
* ``sum_before_divide``: the fp16/fp64 reduction sums before dividing (the same numbers until
  the sum overflows);

structure
* ``never_reshard``: parameters stay unsharded after forward and backward, and ``reshard()``
  does nothing;
* ``drop_hsdp_all_reduce``: the all-reduce across HSDP replicas is never issued;
* ``always_communicate``: every managed module's forward issues an extra all-reduce, even at
  world size 1;
* ``ignore_ignored_params``: ``ignored_params`` is dropped, so those parameters are sharded,
  gathered and reduced like the rest;
* ``pipeline_scales_by_stages``: pipeline stages divide the step's gradients by the number
  of stages, not of microbatches;
* ``state_dict_skips_reshard``: ``state_dict()`` while unsharded gives the registered plain
  tensors, not the sharded DTensors;
* ``load_into_unsharded``: ``load_state_dict()`` while unsharded copies into the unsharded
  tensors only, which the next reshard drops;

the wire (numerics unchanged)
* ``ignore_forward_prefetch`` / ``ignore_backward_prefetch``: the explicit prefetch lists are
  dropped;
* ``reverse_backward_prefetch``: the backward prefetch list is issued back to front;
* ``no_implicit_prefetch``: each module's backward prefetch list is set to itself, which
  turns implicit backward prefetching off;
* ``fsdp_over_dim1``: fully_shard splits every matrix along dim 1 instead of dim 0 (the
  whole parameters, and so the numbers, stay the same);
* ``int_reshard_as_true``: an int ``reshard_after_forward`` is passed on as ``True`` (the
  backward all-gather runs over the whole shard group);
* ``ignore_reduce_dtype``: ``MixedPrecisionPolicy.reduce_dtype`` is dropped (gradients are
  reduced in ``param_dtype``);
* ``blocking_async_unshard``: ``unshard(async_op=True)`` unshards synchronously and returns a
  handle with nothing left to wait for;
* ``forward_method_once``: a registered forward method gets the hooks on its first call only;

streams (numerics unchanged on the fake device: only the stream checker fails them; see
``broken_streams.py``)
* ``skip_all_gather_wait``: the compute stream does not wait for the all-gather before using
  the unsharded parameters;
* ``skip_reduce_scatter_stream_wait``: the reduce-scatter stream does not wait for the compute
  stream before reading the gradients;
* ``skip_final_wait``: backward ends without waiting for the last reductions;
* ``free_reduce_scatter_input_early``: the reduce-scatter input is dropped when issued;
* ``unshard_wait_on_wrong_stream``: ``unshard(async_op=True).wait()`` waits on a side stream;

* ``post_optim_event_kept``: the post-optim event stays in force after the forward it was
  set for, so a later forward waits on it, not on the step before it;

and ``hidden_broken_gradient_sync``: ``ignore_gradient_sync`` with ``gradient_accumulation``
left undeclared (the way to earn 100 % that profiles and refusal probes close).

Load one with ``--impl tests.suites.broken:skip_grad_average``. The patches of
``torch.distributed.reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.13;
``skip_grad_average``, ``skip_post_divide``, ``sum_before_divide``) are installed in the
rank processes of that session only, which exist for it alone.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Shard

from distconform.harness import torch_api
from distconform.impl.api import Implementation, load_implementation
from distconform.impl.reference.policies import gradient_divide_factors
from tests.suites.broken_streams import STREAM_BREAKAGES


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _summing_reduce_scatter(original: Callable) -> Callable:
    # Scaling the input (a temporary buffer in both implementations) by the group size makes
    # the result the sum instead of the mean, whatever the op, synchronous or not.
    @functools.wraps(original)
    def reduce_scatter_single(output, input, *args, **kwargs):
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        input.mul_(dist.get_world_size(group))
        return original(output, input, *args, **kwargs)

    reduce_scatter_single.summing = True  # type: ignore[attr-defined]
    return reduce_scatter_single


def _install_summing_reduce_scatter() -> None:
    name = torch_api.REDUCE_SCATTER_SINGLE
    if not getattr(getattr(dist, name), "summing", False):
        setattr(dist, name, _summing_reduce_scatter(getattr(dist, name)))


def _overflow_safe_factors(world: int) -> tuple[float, float]:
    # FSDP2's split of the default divisor for fp16/fp64, as the reference computes it: a
    # power of two near sqrt(N) before the SUM, the rest after (2 and 1 at N=2, 2 and 2 at 4).
    return gradient_divide_factors(world, torch.float16)


def _reduce_scatter_wrapper(original: Callable, before: Callable, after: Callable) -> Callable:
    """``original`` with ``before(input)`` and ``after(output)`` around each SUM reduce-scatter
    of an overflow-safe dtype (fp16, fp64): the path that divides before and after the sum."""

    @functools.wraps(original)
    def reduce_scatter_single(output, input, *args, **kwargs):
        op = kwargs.get("op", dist.ReduceOp.SUM)
        if input.dtype not in (torch.float16, torch.float64) or op != dist.ReduceOp.SUM:
            return original(output, input, *args, **kwargs)
        world = dist.get_world_size()
        before(input, world)
        work = original(output, input, *args, **kwargs)
        if work is not None:
            work.wait()
        after(output, world)
        return work

    reduce_scatter_single.wrapped = True  # type: ignore[attr-defined]
    return reduce_scatter_single


def _install_reduce_scatter_wrapper(before: Callable, after: Callable) -> None:
    name = torch_api.REDUCE_SCATTER_SINGLE
    if not getattr(getattr(dist, name), "wrapped", False):
        setattr(dist, name, _reduce_scatter_wrapper(getattr(dist, name), before, after))


def _skip_post_divide() -> None:
    # Multiplying the input by the post factor leaves the sum as if never post-divided.
    _install_reduce_scatter_wrapper(
        lambda input, world: input.mul_(_overflow_safe_factors(world)[1]), lambda *_: None
    )


def _sum_before_divide() -> None:
    # Undoing the pre-divide before the SUM and redoing it after: the same value where the
    # plain sum fits in the dtype, inf where it does not.
    _install_reduce_scatter_wrapper(
        lambda input, world: input.mul_(_overflow_safe_factors(world)[0]),
        lambda output, world: output.div_(_overflow_safe_factors(world)[0]),
    )


def _extra_all_reduce(module: nn.Module, args: Any) -> None:
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    dist.all_reduce(torch.zeros(1, device=device))


def _drop_all_reduce(module: nn.Module) -> None:
    # torch's set_requires_gradient_sync turns the all-reduce back on: turn it off after.
    sync, all_reduce = module.set_requires_gradient_sync, module.set_requires_all_reduce
    all_reduce(False, recurse=False)

    def set_requires_gradient_sync(requires: bool, *, recurse: bool = True) -> None:
        sync(requires, recurse=recurse)
        all_reduce(False, recurse=recurse)

    module.set_requires_gradient_sync = set_requires_gradient_sync
    module.set_requires_all_reduce = _noop


def _never_reshard(module: nn.Module) -> None:
    module.set_reshard_after_backward(False, recurse=False)
    module.set_reshard_after_forward(False, recurse=False)
    module.reshard = _noop
    module.set_reshard_after_backward = _noop
    module.set_reshard_after_forward = _noop


def _reverse_backward_prefetch(module: nn.Module) -> None:
    original = module.set_modules_to_backward_prefetch
    module.set_modules_to_backward_prefetch = lambda modules: original(list(modules)[::-1])


def _post_optim_event_kept(module: nn.Module) -> None:
    # The event handed to the root is never discarded: every later forward waits on the
    # last one set, also after a step that set none (and then runs ahead of that step).
    state = {"event": None}
    original = module.set_post_optim_event

    def keep(event: Any) -> None:
        state["event"] = event
        original(event)

    def pre_forward(*_: Any) -> None:
        if state["event"] is not None:
            original(state["event"])

    module.set_post_optim_event = keep
    module.register_forward_pre_hook(pre_forward, prepend=True)


def _keep_first_post_optim_event(module: nn.Module) -> None:
    # Every later step hands the root the first step's event again: a stale wait.
    original = module.set_post_optim_event
    first: list[Any] = []

    def set_post_optim_event(event: Any) -> None:
        if not first:
            first.append(event)
        original(first[0])

    module.set_post_optim_event = set_post_optim_event


def _install_scale_by_stages() -> None:
    # A pipeline integration that divides the step's gradients by its number of stages
    # instead of the factor the schedule passes (its number of microbatches).
    if getattr(PipelineStage.scale_grads, "by_stages", False):
        return
    original = PipelineStage.scale_grads

    def scale_grads(self: Any, grad_scale_factor: int) -> None:
        original(self, self.num_stages)

    scale_grads.by_stages = True  # type: ignore[attr-defined]
    PipelineStage.scale_grads = scale_grads


def _holds_unsharded(module: nn.Module) -> bool:
    params = [p for p in module.parameters()]
    return bool(params) and not any(isinstance(p, DTensor) for p in params)


def _state_dict_skips_reshard(module: nn.Module) -> None:
    # The state dict built from whatever is registered: plain full tensors while unsharded.
    original = module.state_dict

    def state_dict(*args: Any, **kwargs: Any) -> Any:
        if not _holds_unsharded(module):
            return original(*args, **kwargs)
        return OrderedDict((n, p.detach()) for n, p in module.named_parameters())

    module.state_dict = state_dict


def _load_into_unsharded(module: nn.Module) -> None:
    # While unsharded, the loaded values are copied into the registered (unsharded) tensors
    # only; the sharded parameters never see them.
    original = module.load_state_dict

    def load_state_dict(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        if not _holds_unsharded(module):
            return original(state_dict, *args, **kwargs)
        with torch.no_grad():
            for name, param in module.named_parameters():
                value = state_dict[name]
                param.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
        return None

    module.load_state_dict = load_state_dict


def _blocking_async_unshard(module: nn.Module) -> None:
    original = module.unshard

    class Done:
        def wait(self) -> None:
            return None

    def unshard(async_op: bool = False) -> Any:
        original(async_op=False)
        return Done() if async_op else None

    module.unshard = unshard


class _OutputDiscarded:
    """A user's all-gather that runs, and whose output is then replaced by a plain gather."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.allocate(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op=False
    ) -> None:
        source = input_tensor.clone()  # the input may be a slice of the output
        work = self.comm(output_tensor=output_tensor, input_tensor=input_tensor, group=group)
        if work is not None:
            work.wait()
        torch_api.all_gather_single(output_tensor, source, group=group)


def _unchecked_max_input_buffers(module: nn.Module) -> None:
    original = module.set_reduce_scatter_max_input_buffers
    module.set_reduce_scatter_max_input_buffers = lambda cap, **kw: original(max(cap, 1), **kw)


class _NothingToWaitFor:
    def wait(self) -> None:
        return None


def _finalize_nothing(module: nn.Module) -> None:
    module.finalize_backward = lambda *, async_op=False: _NothingToWaitFor() if async_op else None


def _discard_custom_all_gather_output(module: nn.Module) -> None:
    original = module.set_custom_all_gather
    module.set_custom_all_gather = lambda comm: original(_OutputDiscarded(comm))


# Each breakage: how it changes fully_shard's keyword arguments, and what it does to the
# managed module afterwards.
def _dp_mesh_dims_moved(impl: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    dims, mesh = kwargs.get("dp_mesh_dims"), kwargs.get("mesh")
    if dims is None or mesh is None:
        return kwargs
    if dims.shard is not None and dims.replicate is not None:
        moved = impl.DataParallelMeshDims(shard=dims.replicate, replicate=dims.shard)
    else:
        named = dims.shard if dims.shard is not None else dims.replicate
        other = next(name for name in mesh.mesh_dim_names if name != named)
        moved = impl.DataParallelMeshDims(
            shard=other if dims.shard is not None else None,
            replicate=other if dims.replicate is not None else None,
        )
    return {**kwargs, "dp_mesh_dims": moved}


def _int_reshard_as_true(impl: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    value = kwargs.get("reshard_after_forward")
    if isinstance(value, int) and not isinstance(value, bool):
        return {**kwargs, "reshard_after_forward": True}
    return kwargs


_KWARGS: dict[str, Callable[[Any, dict[str, Any]], dict[str, Any]]] = {
    "int_reshard_as_true": _int_reshard_as_true,
    "dp_mesh_dims_on_the_wrong_dim": _dp_mesh_dims_moved,
    "ignore_reduce_dtype": lambda impl, kw: {
        **kw,
        "mp_policy": None
        if kw.get("mp_policy") is None
        else impl.MixedPrecisionPolicy(
            param_dtype=kw["mp_policy"].param_dtype,
            reduce_dtype=None,
            output_dtype=kw["mp_policy"].output_dtype,
            cast_forward_inputs=kw["mp_policy"].cast_forward_inputs,
        ),
    },
    "ignore_ignored_params": lambda impl, kw: {
        k: v for k, v in kw.items() if k != "ignored_params"
    },
    "fsdp_over_dim1": lambda impl, kw: {
        **kw,
        "shard_placement_fn": lambda param: Shard(1) if param.ndim > 1 else None,
    },
}

_MODULE: dict[str, Callable[[nn.Module], None]] = {
    "skip_grad_average": lambda m: _install_summing_reduce_scatter(),
    "ignore_gradient_sync": lambda m: setattr(m, "set_requires_gradient_sync", _noop),
    "ignore_divide_factor": lambda m: setattr(m, "set_gradient_divide_factor", _noop),
    "ignore_all_reduce_hook": lambda m: setattr(m, "set_all_reduce_hook", _noop),
    "ignore_custom_all_gather": lambda m: setattr(m, "set_custom_all_gather", _noop),
    "ignore_custom_reduce_scatter": lambda m: setattr(m, "set_custom_reduce_scatter", _noop),
    "custom_all_gather_output_discarded": _discard_custom_all_gather_output,
    "max_input_buffers_unchecked": _unchecked_max_input_buffers,
    "finalize_backward_does_nothing": _finalize_nothing,
    "ignore_keep_unsharded_storage": lambda m: setattr(m, "set_keep_unsharded_storage", _noop),
    "ignore_reduce_scatter_unused_params": lambda m: setattr(
        m, "set_reduce_scatter_unused_params", _noop
    ),
    "ignore_separate_reduce_scatter_group": lambda m: setattr(
        m, "set_separate_reduce_scatter_group", _noop
    ),
    "ignore_reduce_scatter_divide_factor": lambda m: setattr(
        m, "set_reduce_scatter_divide_factor", _noop
    ),
    "skip_post_divide": lambda m: _skip_post_divide(),
    "sum_before_divide": lambda m: _sum_before_divide(),
    "never_reshard": _never_reshard,
    "drop_hsdp_all_reduce": _drop_all_reduce,
    "always_communicate": lambda m: m.register_forward_pre_hook(_extra_all_reduce),
    "ignore_forward_prefetch": lambda m: setattr(m, "set_modules_to_forward_prefetch", _noop),
    "ignore_backward_prefetch": lambda m: setattr(m, "set_modules_to_backward_prefetch", _noop),
    "reverse_backward_prefetch": _reverse_backward_prefetch,
    "no_implicit_prefetch": lambda m: m.set_modules_to_backward_prefetch([m]),
    "blocking_async_unshard": _blocking_async_unshard,
    "ignore_post_optim_event": lambda m: setattr(m, "set_post_optim_event", _noop),
    "stale_post_optim_event": _keep_first_post_optim_event,
    "post_optim_event_kept": _post_optim_event_kept,
    "pipeline_scales_by_stages": lambda m: _install_scale_by_stages(),
    "state_dict_skips_reshard": _state_dict_skips_reshard,
    "load_into_unsharded": _load_into_unsharded,
    **STREAM_BREAKAGES,
}

BREAKAGES = (*_MODULE, *_KWARGS, "forward_method_once")


class BrokenImplementation(Implementation):
    """``base`` with one behaviour broken (see the module docstring)."""

    def __init__(self, base_spec: str, breakage: str, undeclared: frozenset[str] = frozenset()):
        if breakage not in BREAKAGES:
            raise ValueError(f"unknown breakage {breakage!r}; one of {', '.join(BREAKAGES)}")
        self.base = load_implementation(base_spec)
        self.breakage = breakage
        self.name = f"{self.base.name} with {breakage}"
        self.capabilities = self.base.capabilities - undeclared
        self.MixedPrecisionPolicy = self.base.MixedPrecisionPolicy
        self.OffloadPolicy = self.base.OffloadPolicy
        self.CPUOffloadPolicy = self.base.CPUOffloadPolicy
        self.DataParallelMeshDims = self.base.DataParallelMeshDims
        self.FSDPModule = self.base.FSDPModule

    def _arguments(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        adjust = _KWARGS.get(self.breakage)
        return adjust(self, kwargs) if adjust is not None else kwargs

    def _break(self, result: Any) -> Any:
        after = _MODULE.get(self.breakage)
        if after is not None:
            for module in result if isinstance(result, list) else [result]:
                after(module)
        return result

    def fully_shard(self, module, **kwargs: Any) -> Any:
        return self._break(self.base.fully_shard(module, **self._arguments(kwargs)))

    def replicate(self, module, **kwargs: Any) -> Any:
        return self._break(self.base.replicate(module, **self._arguments(kwargs)))

    def register_fsdp_forward_method(self, module: nn.Module, method_name: str) -> None:
        plain = getattr(module, method_name)
        self.base.register_fsdp_forward_method(module, method_name)
        if self.breakage != "forward_method_once":
            return
        hooked = getattr(module, method_name)
        calls = []

        def first_call_only(*args: Any, **kwargs: Any) -> Any:
            calls.append(None)
            return (hooked if len(calls) == 1 else plain)(*args, **kwargs)

        object.__setattr__(module, method_name, first_call_only)

    def share_comm_ctx(self, modules: list[nn.Module]) -> None:
        self.base.share_comm_ctx(modules)

    def is_managed(self, module: nn.Module) -> bool:
        return self.base.is_managed(module)

    def is_group_unsharded(self, module: nn.Module) -> bool:
        return self.base.is_group_unsharded(module)

    def modules_to_run_forward(self, module: nn.Module) -> set[nn.Module]:
        return self.base.modules_to_run_forward(module)

    def set_unshard_async_op(self, module: nn.Module, async_op: bool) -> None:
        self.base.set_unshard_async_op(module, async_op)


def _factory(base_spec: str, breakage: str) -> Callable[[], BrokenImplementation]:
    def build() -> BrokenImplementation:
        return BrokenImplementation(base_spec, breakage)

    build.__name__ = breakage if base_spec == "reference" else f"{breakage}_{base_spec}"
    return build


def hidden_broken_gradient_sync() -> BrokenImplementation:
    """``ignore_gradient_sync`` that hides it by not declaring ``gradient_accumulation``: the
    refusal probe fails and the report withholds the core profile's percentage."""
    return BrokenImplementation(
        "reference", "ignore_gradient_sync", undeclared=frozenset({"gradient_accumulation"})
    )


# Module-level factories for --impl tests.suites.broken:<name> (and <name>_torch).
for _breakage in BREAKAGES:
    for _base in ("reference", "torch"):
        _build = _factory(_base, _breakage)
        globals()[_build.__name__] = _build
del _breakage, _base, _build
