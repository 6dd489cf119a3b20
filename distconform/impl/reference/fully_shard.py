"""``fully_shard`` and ``replicate``: turn modules into one parameter group and hook them.

Start reading here. ``fully_shard(module)`` collects the parameters of ``module`` that no
nested ``fully_shard`` already owns, shards each one across the mesh (``param.py``), packs the
shards into one flat buffer (``group.py``), registers forward hooks (``state.py``), and swaps
the module's class for a subclass that also derives from ``FSDPModule`` (``module.py``).
``replicate`` is the same with ``Replicate()`` placements: DDP semantics, no all-gathers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from distconform.impl.reference.group import ParamGroup
from distconform.impl.reference.mesh import DataParallelMesh, DataParallelMeshDims
from distconform.impl.reference.module import FSDPModule, ReplicateModule
from distconform.impl.reference.param import ManagedParam, ParamLocation
from distconform.impl.reference.policies import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    require_supported_policies,
)
from distconform.impl.reference.state import FSDPState, state_of

ModuleOrList = TypeVar("ModuleOrList", nn.Module, list[nn.Module])
ShardPlacementFn = Callable[[nn.Parameter], Shard | None]

# Marks an original parameter object with the state that sharded it, so a second group that
# finds the same object (a weight tied across groups) can report it at lazy init.
_OWNER_ATTR = "_distconform_owner"


def fully_shard(
    module: ModuleOrList,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: ShardPlacementFn | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen dataclass)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> ModuleOrList:
    """Shard ``module``'s parameters (a list makes one group of several modules).

    ``ignored_params`` are left as they are: plain local parameters on their own device,
    never gathered, their gradients never reduced (each rank keeps its own).

    ``mesh``: 1-D shards over all its ranks; 2-D ``(replicate, shard)`` is HSDP: parameters
    are ``(Replicate(), Shard(d))`` DTensors, all-gathered within the shard dim, gradients
    reduce-scattered within it and then all-reduced across the replicate dim.

    ``reshard_after_forward``: ``True`` frees unsharded parameters after forward (one more
    all-gather in backward); ``False`` keeps them; ``None`` means ``False`` for the root and
    ``True`` otherwise; an int ``k`` (a divisor of the world size) keeps ``1/k`` of the
    unsharded parameters after forward, so backward all-gathers within groups of ``k``
    consecutive ranks (``k == 1`` means ``False``, ``k == `` the shard dim's size means
    ``True``).

    ``dp_mesh_dims`` makes ``mesh`` the whole SPMD mesh (``mesh.py``): the parameters must be
    ``DTensor``s on it, ``Replicate()`` on the named dims, which are the only ones sharded
    over and reduced over.
    """
    mesh = mesh if mesh is not None else _default_mesh(None)
    dp_mesh = DataParallelMesh.for_fully_shard(mesh, dp_mesh_dims)
    shard_size = dp_mesh.shard_size
    _check_reshard_after_forward(reshard_after_forward, shard_size)
    is_int = isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool)
    if dp_mesh.spmd and is_int:
        raise NotImplementedError(
            "reshard_after_forward as an int is not implemented with dp_mesh_dims"
        )

    def placement(param: nn.Parameter) -> Placement:
        chosen = shard_placement_fn(param) if shard_placement_fn is not None else None
        if chosen is None:
            return Shard(0)
        if not isinstance(chosen, Shard):
            raise NotImplementedError(
                f"shard_placement_fn returned {chosen!r}; the reference accepts Shard(dim) or None"
            )
        return Shard(chosen.dim % param.ndim) if param.ndim else chosen

    post_forward_mesh = None
    if is_int and 1 < reshard_after_forward < shard_size:
        # Collective: every rank calls fully_shard in the same order, so all create it. Rows
        # of k consecutive mesh entries lie inside one shard group since k divides its size.
        post_forward_mesh = DeviceMesh(mesh.device_type, mesh.mesh.view(-1, reshard_after_forward))
    return _manage(
        module,
        dp_mesh,
        placement,
        reshard_after_forward,
        mp_policy,
        offload_policy,
        False,
        post_forward_mesh,
        ignored_params,
    )


def replicate(
    module: ModuleOrList,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> ModuleOrList:
    """Data parallelism with replicated parameters: one all-reduce per group per synced backward.
    ``ignored_params`` stay plain local parameters, their gradients not all-reduced.
    ``dp_mesh_dims`` (a replicate dim only) names the data-parallel dim of a whole SPMD mesh."""
    mesh = mesh if mesh is not None else _default_mesh(("replicate",))
    return _manage(
        module,
        DataParallelMesh.for_replicate(mesh, dp_mesh_dims),
        lambda _: Replicate(),
        False,
        mp_policy,
        offload_policy,
        True,
        ignored_params=ignored_params,
    )


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the unshard/reshard hooks around ``module.<method_name>`` as around ``forward``."""
    state = state_of(module)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not managed by fully_shard or replicate")
    method = getattr(module, method_name)

    def with_hooks(*args, **kwargs):
        args, kwargs = state.pre_forward(module, args, kwargs)
        return state.post_forward(module, args, method(*args, **kwargs))

    # An instance attribute shadows the class's method for this module only.
    object.__setattr__(module, method_name, with_hooks)


# --- shared machinery ----------------------------------------------------------------------


def _manage(
    module: ModuleOrList,
    dp_mesh: DataParallelMesh,
    placement: Callable[[nn.Parameter], Placement],
    reshard_after_forward: bool | int | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    replicated: bool,
    post_forward_mesh: DeviceMesh | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> ModuleOrList:
    require_supported_policies(mp_policy, offload_policy)
    modules = tuple(module) if isinstance(module, list) else (module,)
    api = "replicate" if replicated else "fully_shard"
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"{api} expects an nn.Module or a list of them, got {type(m).__name__}")
        if type(m).forward is nn.Module.forward:
            raise ValueError(
                f"{api} needs a module with a forward (its hooks drive unshard/reshard); "
                f"{type(m).__name__} has none: apply {api} to its children or to the module "
                f"that owns it"
            )
        if state_of(m) is not None:
            kind = "replicate" if state_of(m).replicated else "fully_shard"
            raise RuntimeError(f"{api}: {type(m).__name__} is already managed by {kind}")
    device = _device_of(dp_mesh.mesh)

    originals: list[nn.Parameter] = []
    managed: list[ManagedParam] = []
    tied_elsewhere: list[tuple[str, FSDPState]] = []
    by_identity: dict[int, ManagedParam] = {}
    ignored = {id(p) for p in ignored_params or ()}
    for owner, name, fqn, param in _unmanaged_params(modules):
        if id(param) in ignored:
            continue
        if id(param) in by_identity:
            by_identity[id(param)].locations.append(ParamLocation(owner, name))
            continue
        if (owning_state := getattr(param, _OWNER_ATTR, None)) is not None:
            tied_elsewhere.append((fqn, owning_state))
        mp = ManagedParam(
            fqn,
            param,
            [ParamLocation(owner, name)],
            dp_mesh,
            placement(param),
        )
        by_identity[id(param)] = mp
        originals.append(param)
        managed.append(mp)
    for m in modules:
        _move_buffers(m, device)

    group = (
        ParamGroup(
            managed,
            originals,
            dp_mesh,
            device,
            replicated,
            post_forward_mesh,
            mp_policy,
            offload_policy,
        )
        if managed
        else None
    )
    state = FSDPState(modules, device, group, reshard_after_forward, replicated, tied_elsewhere)
    state.mp_policy = mp_policy
    for param in originals:
        setattr(param, _OWNER_ATTR, state)
    mixin = ReplicateModule if replicated else FSDPModule
    for m in modules:
        _swap_class(m, mixin)
    return module


def _unmanaged_params(
    modules: tuple[nn.Module, ...],
) -> Iterator[tuple[nn.Module, str, str, nn.Parameter]]:
    """(owner, name, fqn, param) for parameters no nested fully_shard/replicate owns."""

    def walk(module: nn.Module, prefix: str, is_top: bool):
        if not is_top and state_of(module) is not None:
            return
        for name, param in module.named_parameters(recurse=False):
            yield module, name, prefix + name, param
        for child_name, child in module.named_children():
            yield from walk(child, f"{prefix}{child_name}.", False)

    for index, module in enumerate(modules):
        yield from walk(module, f"[{index}]." if len(modules) > 1 else "", True)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer.device != device:
                setattr(sub, name, buffer.to(device))


_MANAGED_CLASSES: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    key = (mixin, cls)
    if key not in _MANAGED_CLASSES:
        prefix = "Replicate" if mixin is ReplicateModule else "FSDP"
        _MANAGED_CLASSES[key] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    module.__class__ = _MANAGED_CLASSES[key]


def _default_mesh(names: tuple[str, ...] | None) -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard/replicate need an initialized default process group")
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    device_type = accelerator.type if accelerator is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=names)


def _device_of(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device()
    )


def _check_reshard_after_forward(value: bool | int | None, world_size: int) -> None:
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward must be None, a bool or an int, got {value!r}")
    if value < 1 or world_size % value != 0:
        raise ValueError(
            f"reshard_after_forward={value}: an int must be a positive divisor of the shard "
            f"world size {world_size}"
        )
