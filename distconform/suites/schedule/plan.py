"""The sharding plan: which groups a suite made, with what options, on which ranks.

A suite that wants its collectives checked shards through a :class:`ShardingPlan` instead of
calling ``impl.fully_shard`` directly. The plan passes every call on to the implementation
unchanged and writes down what FSDP2's semantics make of it: each group's parameters (their
shapes before sharding, minus nested groups' and ignored ones), the ranks its collectives run
over, its reshard policy and dtypes. Flags that change the schedule
(``set_requires_gradient_sync``, prefetch lists, ...) go through :meth:`ShardingPlan.controls`,
a stand-in for the managed module that forwards each call and tells the plan's listener.

The plan is the oracle's only input besides the module events of a step; nothing here asks
the implementation what it did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distconform.suites.schedule.layout import GroupLayout, ParamShape

FULLY_SHARD = "fully_shard"
REPLICATE = "replicate"


@dataclass(frozen=True)
class GroupRanks:
    """The global ranks of this rank's collectives for one group."""

    shard: tuple[int, ...]  # all-gather and reduce-scatter; () for replicate
    replicate: tuple[int, ...]  # the gradient all-reduce; () without a replicate dim
    shard_dim: str = "shard"  # the mesh dims' names, for messages
    replicate_dim: str = "replicate"

    @property
    def shard_size(self) -> int:
        return max(len(self.shard), 1)

    @property
    def replicate_size(self) -> int:
        return max(len(self.replicate), 1)

    def post_forward(self, ranks: int, rank: int) -> tuple[int, ...]:
        """``reshard_after_forward=ranks``: the block of that many consecutive shard ranks
        holding ``rank`` (FSDP2 reshapes the shard dim to ``(S // ranks, ranks)``)."""
        index = self.shard.index(rank)
        start = index // ranks * ranks
        return self.shard[start : start + ranks]


def mesh_ranks(mesh: DeviceMesh | None, kind: str, rank: int, world_size: int) -> GroupRanks:
    """FSDP2's mesh convention: 1-D shards (or, for replicate, replicates) over its dim; a
    2-D ``(replicate, shard)`` mesh is HSDP."""
    if mesh is None:
        world = tuple(range(world_size))
        if kind == FULLY_SHARD:
            return GroupRanks(shard=world, replicate=(), shard_dim="world")
        return GroupRanks(shard=(), replicate=world, replicate_dim="world")
    layout = mesh.mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"rank {rank} is not in the mesh {mesh}")
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))

    def along(dim: int) -> tuple[int, ...]:
        index = tuple(slice(None) if d == dim else c for d, c in enumerate(coordinate))
        return tuple(int(r) for r in layout[index].flatten().tolist())

    if mesh.ndim == 1:
        if kind == FULLY_SHARD:
            return GroupRanks(shard=along(0), replicate=(), shard_dim=names[0])
        return GroupRanks(shard=(), replicate=along(0), replicate_dim=names[0])
    if mesh.ndim == 2 and kind == FULLY_SHARD:
        return GroupRanks(along(1), along(0), shard_dim=names[1], replicate_dim=names[0])
    raise ValueError(f"no schedule for {kind} on a {mesh.ndim}-D mesh")


@dataclass
class GroupFlags:
    """The per-group switches FSDP2 lets a user flip between steps."""

    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    reshard_after_backward: bool = True
    reshard_after_forward: bool | int | None = None
    unshard_in_backward: bool = True
    forward_prefetch: tuple[GroupPlan, ...] = ()
    backward_prefetch: tuple[GroupPlan, ...] | None = None  # None: implicit prefetching
    force_sum_reduction: bool = False
    divide_factor: float | None = None

    def copy(self) -> GroupFlags:
        return GroupFlags(**vars(self))


@dataclass
class GroupPlan:
    """One ``fully_shard`` / ``replicate`` call as the schedule oracle sees it."""

    name: str
    kind: str
    modules: tuple[nn.Module, ...]
    layout: GroupLayout
    ranks: GroupRanks
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    flags: GroupFlags = field(default_factory=GroupFlags)

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.param_dtype or self.layout.dtype()

    @property
    def gradient_dtype(self) -> torch.dtype:
        """FSDP2: ``reduce_dtype``, else ``param_dtype``, else the parameters' own dtype."""
        return self.reduce_dtype or self.param_dtype or self.layout.dtype()

    def contains(self, module: nn.Module) -> bool:
        return any(module is sub for own in self.modules for sub in own.modules())

    def trainable_layout(self) -> GroupLayout:
        """The layout of the parameters that require a gradient now: users freeze and unfreeze
        the registered parameters between steps, and only the trainable ones are reduced."""
        return self.layout.only(
            shape
            for shape in self.layout.params
            if self.modules[shape.module_index].get_parameter(shape.name).requires_grad
        )


class ShardingPlan:
    """Shards through ``impl`` and records each group for the schedule oracle.

    ``plan.fully_shard(module, **kwargs)`` and ``plan.replicate(module, **kwargs)`` take
    ``impl.fully_shard``'s arguments. Call them bottom-up, as FSDP2 requires: a group owns
    the parameters of its module(s) that no earlier group owns.
    """

    def __init__(
        self,
        impl: Any,
        *,
        mesh: DeviceMesh | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """``rank`` and ``world_size`` default to this process's (the oracle's own tests give
        them to plan one rank's view without a process group)."""
        self.impl = impl
        self.mesh = mesh
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.groups: list[GroupPlan] = []
        self._listeners: list[Callable[[str, GroupPlan, dict[str, Any]], None]] = []

    # --- sharding -----------------------------------------------------------------------

    def fully_shard(self, module: nn.Module | list[nn.Module], **kwargs: Any) -> Any:
        group = self._record(module, FULLY_SHARD, kwargs)
        result = self.impl.fully_shard(module, **kwargs)
        self.groups.append(group)
        return result

    def replicate(self, module: nn.Module | list[nn.Module], **kwargs: Any) -> Any:
        group = self._record(module, REPLICATE, kwargs)
        result = self.impl.replicate(module, **kwargs)
        self.groups.append(group)
        return result

    def _record(self, module: nn.Module | list[nn.Module], kind: str, kwargs: dict) -> GroupPlan:
        modules = tuple(module) if isinstance(module, list) else (module,)
        ignored = kwargs.get("ignored_params") or set()
        placement_fn = kwargs.get("shard_placement_fn")
        owned = {id(p) for g in self.groups for m in g.modules for p in m.parameters()}
        seen: set[int] = set()
        params = []
        for index, own in enumerate(modules):
            for name, param in own.named_parameters():
                key = id(param)
                if key in owned or key in seen or any(param is p for p in ignored):
                    continue
                seen.add(key)
                shard_dim = _shard_dim(placement_fn, param)
                params.append(ParamShape(name, tuple(param.shape), param.dtype, shard_dim, index))
        mp = kwargs.get("mp_policy")
        flags = GroupFlags(reshard_after_forward=kwargs.get("reshard_after_forward"))
        return GroupPlan(
            name="",  # named when the plan is observed on its root module
            kind=kind,
            modules=modules,
            layout=GroupLayout.of(params),
            ranks=mesh_ranks(kwargs.get("mesh", self.mesh), kind, self.rank, self.world_size),
            param_dtype=getattr(mp, "param_dtype", None),
            reduce_dtype=getattr(mp, "reduce_dtype", None),
            flags=flags,
        )

    # --- lookup -------------------------------------------------------------------------

    def group_of(self, module: nn.Module) -> GroupPlan:
        for group in self.groups:
            if any(module is own for own in group.modules):
                return group
        raise KeyError(f"{type(module).__name__} was not sharded through this plan")

    def groups_under(self, module: nn.Module) -> list[GroupPlan]:
        """FSDP2's ``recurse=True``: every group with a module in ``module``'s subtree."""
        inside = {id(sub) for sub in module.modules()}
        return [g for g in self.groups if any(id(own) in inside for own in g.modules)]

    def root(self) -> GroupPlan:
        """The group whose modules contain every other group's (the last one sharded)."""
        root = self.groups[-1]
        if not all(any(root.contains(m) for m in g.modules) for g in self.groups):
            raise ValueError("the last group of the plan does not contain the others")
        return root

    def name_groups(self, model: nn.Module) -> None:
        names = {id(m): name or "root" for name, m in model.named_modules()}
        for group in self.groups:
            group.name = ", ".join(names.get(id(m), type(m).__name__) for m in group.modules)

    def nested(self, inner: GroupPlan, outer: GroupPlan) -> bool:
        return inner is not outer and all(outer.contains(m) for m in inner.modules)

    # --- flags --------------------------------------------------------------------------

    def controls(self, module: nn.Module) -> GroupControls:
        """A stand-in for managed ``module``: FSDP2's setters, forwarded and recorded."""
        return GroupControls(self, module)

    def add_listener(self, listener: Callable[[str, GroupPlan, dict[str, Any]], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[str, GroupPlan, dict[str, Any]], None]) -> None:
        self._listeners.remove(listener)

    def _notify(self, what: str, group: GroupPlan, values: dict[str, Any]) -> None:
        for listener in list(self._listeners):
            listener(what, group, values)


def _shard_dim(placement_fn: Callable | None, param: nn.Parameter) -> int:
    placement = placement_fn(param) if placement_fn is not None else None
    return 0 if placement is None else placement.dim


class GroupControls:
    """FSDP2's per-module setters, each forwarded to the module and reported to the plan.

    ``recurse=True`` reaches every group in the module's subtree, as in FSDP2; the flags the
    oracle keeps are updated through the plan's listeners (the recorder), so a flag flipped in
    the middle of a recorded step takes effect at the point it was flipped.
    """

    def __init__(self, plan: ShardingPlan, module: nn.Module) -> None:
        self._plan = plan
        self._module = module

    def _groups(self, recurse: bool) -> list[GroupPlan]:
        if recurse:
            return self._plan.groups_under(self._module)
        return [self._plan.group_of(self._module)]

    def _set(self, flag: str, value: Any, recurse: bool) -> None:
        for group in self._groups(recurse):
            setattr(group.flags, flag, value)
            self._plan._notify("flag", group, {flag: value})

    def set_requires_gradient_sync(self, requires: bool, *, recurse: bool = True) -> None:
        self._module.set_requires_gradient_sync(requires, recurse=recurse)
        self._set("requires_gradient_sync", requires, recurse)

    def set_requires_all_reduce(self, requires: bool, *, recurse: bool = True) -> None:
        self._module.set_requires_all_reduce(requires, recurse=recurse)
        self._set("requires_all_reduce", requires, recurse)

    def set_reshard_after_backward(self, reshard: bool, *, recurse: bool = True) -> None:
        self._module.set_reshard_after_backward(reshard, recurse=recurse)
        self._set("reshard_after_backward", reshard, recurse)

    def set_reshard_after_forward(self, reshard: bool, *, recurse: bool = True) -> None:
        self._module.set_reshard_after_forward(reshard, recurse=recurse)
        self._set("reshard_after_forward", reshard, recurse)

    def set_unshard_in_backward(self, unshard: bool) -> None:
        self._module.set_unshard_in_backward(unshard)
        self._set("unshard_in_backward", unshard, recurse=False)

    def set_modules_to_forward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        self._module.set_modules_to_forward_prefetch(list(modules))
        self._set("forward_prefetch", self._targets(modules), recurse=False)

    def set_modules_to_backward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        self._module.set_modules_to_backward_prefetch(list(modules))
        self._set("backward_prefetch", self._targets(modules), recurse=False)

    def set_gradient_divide_factor(self, factor: float) -> None:
        self._module.set_gradient_divide_factor(factor)
        self._set("divide_factor", factor, recurse=False)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        self._module.set_reduce_scatter_divide_factor(factor)
        self._set("divide_factor", factor, recurse=False)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        self._module.set_force_sum_reduction_for_comms(enable)
        self._set("force_sum_reduction", enable, recurse=False)

    def unshard(self, async_op: bool = False) -> Any:
        group = self._plan.group_of(self._module)
        self._plan._notify("unshard", group, {})
        return self._module.unshard(async_op=async_op)

    def reshard(self) -> None:
        self._module.reshard()
        self._plan._notify("reshard", self._plan.group_of(self._module), {})

    def _targets(self, modules: Iterable[nn.Module]) -> tuple[GroupPlan, ...]:
        return tuple(self._plan.group_of(m) for m in modules)
