"""Deliberately broken implementations: each suite module must fail on at least one.

Each wraps a working implementation (the reference by default; the ``*_torch`` factories
wrap torch's, for suites whose capability the reference does not declare) and breaks one
behaviour through the public surface only, so the breakage survives changes inside the
reference:

* ``skip_grad_average``: gradients come out summed over the ranks, not averaged (every
  reduce-scatter's input is multiplied by its group's size);
* ``ignore_gradient_sync``: ``set_requires_gradient_sync`` does nothing (every backward
  reduces);
* ``never_reshard``: parameters stay unsharded after forward and backward, and ``reshard()``
  does nothing;
* ``drop_hsdp_all_reduce``: the all-reduce across HSDP replicas is never issued;
* ``always_communicate``: every managed module's forward issues an extra all-reduce, even at
  world size 1.

Load one with ``--impl tests.suites.broken:skip_grad_average``. The patch of
``torch.distributed.reduce_scatter_single`` (``skip_grad_average``) is installed in the
rank processes of that session only, which exist for it alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from impl.api import Implementation, load_implementation


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
    if not getattr(dist.reduce_scatter_single, "summing", False):
        dist.reduce_scatter_single = _summing_reduce_scatter(dist.reduce_scatter_single)


def _extra_all_reduce(module: nn.Module, args: Any) -> None:
    dist.all_reduce(torch.zeros(1))


def _drop_all_reduce(module: nn.Module) -> None:
    # torch's set_requires_gradient_sync turns the all-reduce back on: turn it off after.
    sync, all_reduce = module.set_requires_gradient_sync, module.set_requires_all_reduce
    all_reduce(False, recurse=False)

    def set_requires_gradient_sync(requires: bool, *, recurse: bool = True) -> None:
        sync(requires, recurse=recurse)
        all_reduce(False, recurse=recurse)

    module.set_requires_gradient_sync = set_requires_gradient_sync
    module.set_requires_all_reduce = _noop


class BrokenImplementation(Implementation):
    """``base`` with one behaviour broken (see the module docstring)."""

    def __init__(self, base_spec: str, breakage: str) -> None:
        self.base = load_implementation(base_spec)
        self.breakage = breakage
        self.name = f"{self.base.name} with {breakage}"
        self.capabilities = self.base.capabilities
        self.MixedPrecisionPolicy = self.base.MixedPrecisionPolicy
        self.OffloadPolicy = self.base.OffloadPolicy
        self.CPUOffloadPolicy = self.base.CPUOffloadPolicy
        self.FSDPModule = self.base.FSDPModule

    def _break(self, result: Any) -> Any:
        modules = result if isinstance(result, list) else [result]
        for module in modules:
            if self.breakage == "skip_grad_average":
                _install_summing_reduce_scatter()
            elif self.breakage == "ignore_gradient_sync":
                module.set_requires_gradient_sync = _noop
            elif self.breakage == "never_reshard":
                module.set_reshard_after_backward(False, recurse=False)
                module.set_reshard_after_forward(False, recurse=False)
                module.reshard = _noop
                module.set_reshard_after_backward = _noop
                module.set_reshard_after_forward = _noop
            elif self.breakage == "drop_hsdp_all_reduce":
                _drop_all_reduce(module)
            elif self.breakage == "always_communicate":
                module.register_forward_pre_hook(_extra_all_reduce)
            else:
                raise ValueError(f"unknown breakage {self.breakage!r}")
        return result

    def fully_shard(self, module, **kwargs: Any) -> Any:
        return self._break(self.base.fully_shard(module, **kwargs))

    def replicate(self, module, **kwargs: Any) -> Any:
        return self._break(self.base.replicate(module, **kwargs))

    def register_fsdp_forward_method(self, module: nn.Module, method_name: str) -> None:
        self.base.register_fsdp_forward_method(module, method_name)

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


BREAKAGES = (
    "skip_grad_average",
    "ignore_gradient_sync",
    "never_reshard",
    "drop_hsdp_all_reduce",
    "always_communicate",
)


def _factory(base_spec: str, breakage: str) -> Callable[[], BrokenImplementation]:
    def build() -> BrokenImplementation:
        return BrokenImplementation(base_spec, breakage)

    build.__name__ = breakage if base_spec == "reference" else f"{breakage}_{base_spec}"
    return build


skip_grad_average = _factory("reference", "skip_grad_average")
ignore_gradient_sync = _factory("reference", "ignore_gradient_sync")
never_reshard = _factory("reference", "never_reshard")
drop_hsdp_all_reduce = _factory("reference", "drop_hsdp_all_reduce")
always_communicate = _factory("reference", "always_communicate")
skip_grad_average_torch = _factory("torch", "skip_grad_average")
ignore_gradient_sync_torch = _factory("torch", "ignore_gradient_sync")
never_reshard_torch = _factory("torch", "never_reshard")
drop_hsdp_all_reduce_torch = _factory("torch", "drop_hsdp_all_reduce")
always_communicate_torch = _factory("torch", "always_communicate")
