"""The one audited place where ``impl/`` touches private PyTorch names.

Each accessor exists because torch has no public API for what ``impl/`` needs (or, for
``queue_autograd_callback``, none before 2.15). Each has an
:class:`~distconform.harness.torch_window.Audit` in ``AUDITS``: what it reads, and what reading each
release of the supported window found. It calls :func:`require_audited_torch` first, which refuses a
torch outside the window, or a release its audit does not cover, naming the window and this file.
Nothing else in ``impl/`` imports a private torch module or reads an underscore attribute of a torch
object; torch's internal testing package is never imported.

Mirrors ``harness/_torch_private.py``. The version window and the check come from
``harness/torch_window.py``, which imports only torch, so ``impl/`` stays usable without pytest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distconform.harness import torch_window
from distconform.harness.torch_window import V2_11, V2_12, V2_13, V2_14, V2_15, Audit
from distconform.harness.torch_window import PrivateTorchAccessError as PrivateTorchAccessError

MODULE = "impl/_torch_private.py"

#: One audit per accessor (``file:line`` are in that release's ``torch/`` directory).
AUDITS: dict[str, Audit] = {}


def require_audited_torch(accessor: str) -> None:
    """Refuse ``accessor`` unless the installed torch is in the window and in its audit."""
    torch_window.require_audited(AUDITS, accessor, MODULE)


# --- autograd (reference implementation) --------------------------------------------------


AUDITS["queue_autograd_callback"] = Audit(
    reads="torch.autograd.Variable._execution_engine (the C++ ImperativeEngine) and its "
    "queue_callback(cb): cb runs once the current backward has finished every node.",
    versions={
        V2_11: "same: autograd/variable.py:15; stub _C/__init__.pyi:2149; outside a backward "
        "it raises as on 2.13",
        V2_12: "same: FSDP calls it at distributed/fsdp/_fully_shard/_fsdp_state.py:405",
        V2_13: "same (baseline)",
        V2_14: "same: _fsdp_state.py:476",
        V2_15: "same: _fsdp_state.py:626; 2.15 adds the public "
        "torch.autograd.graph.queue_callback (graph.py:274) wrapping this call",
    },
)


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished every node.

    Needed to flush gradient reductions of groups whose parameters did not all receive a
    gradient (unused parameters, partial forwards). Must be called from inside a backward.
    """
    require_audited_torch("queue_autograd_callback")
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# --- torch FSDP2 / replicate (torch adapter) --------------------------------------------------


AUDITS["torch_replicate"] = Audit(
    reads="torch.distributed._composable.replicate_with_fsdp.replicate, called with mesh=, "
    "mp_policy= and offload_policy=.",
    versions={
        V2_11: "same for the arguments passed: only the dp_mesh_dims keyword is missing "
        "(replicate_with_fsdp.py:103-163), which the adapter never passes",
        V2_12: "same: file identical to 2.13's",
        V2_13: "same (baseline)",
        V2_14: "same: file identical",
        V2_15: "same: file identical",
    },
)


def torch_replicate() -> Callable[..., Any]:
    """torch's FSDP2-based ``replicate`` (DDP semantics); no public import path in 2.11 to 2.15."""
    require_audited_torch("torch_replicate")
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate


AUDITS["torch_fsdp_group_is_unsharded"] = Audit(
    reads="FSDPModule._get_fsdp_state()._fsdp_param_group.is_unsharded: whether the module's "
    "parameter group is in the UNSHARDED state.",
    versions={
        V2_11: "same value: _fsdp_param_group is a plain attribute (_fsdp_state.py:81), a "
        "module has one group; is_unsharded _fsdp_param_group.py:694 identical",
        V2_12: "same: property _fsdp_state.py:79-98 identical to 2.13's; is_unsharded :739",
        V2_13: "same: _fsdp_param_group property over _fsdp_param_groups :83-102 (baseline)",
        V2_14: "same: :83-102; _get_fsdp_state _fully_shard.py:881",
        V2_15: "same: :91-110; _get_fsdp_state :1085; is_unsharded :1143",
    },
)


def torch_fsdp_group_is_unsharded(module: nn.Module) -> bool:
    """Whether the parameter group made for ``module`` is unsharded."""
    require_audited_torch("torch_fsdp_group_is_unsharded")
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and bool(group.is_unsharded)


AUDITS["torch_fsdp_modules_to_run_forward"] = Audit(
    reads="FSDPState._modules_to_run_forward: the modules of a fully_shard([m1, m2, ...]) "
    "group that have not yet run forward in the current pass.",
    versions={
        V2_11: "same name, older life cycle (_fsdp_state.py:88, hooks :381-423): a partial "
        "group forward is not completed at the root; read as is, the differences are xfails "
        "in suites/expectations/torch-2.11.toml",
        V2_12: "same as 2.11: attribute :70, hooks :417-459, no _force_complete_incomplete_states",
        V2_13: "same: completed from the root's post-forward (:333), cleared in the root "
        "post-backward (:398) (baseline)",
        V2_14: "same as 2.13: attribute :74, hooks :548-607 identical",
        V2_15: "same as 2.13: attribute :82, hooks :705-764 identical",
    },
)


def torch_fsdp_modules_to_run_forward(module: nn.Module) -> set[nn.Module]:
    """Modules of ``module``'s group that have not yet run forward in the current pass."""
    require_audited_torch("torch_fsdp_modules_to_run_forward")
    return set(module._get_fsdp_state()._modules_to_run_forward)


AUDITS["torch_fsdp_set_unshard_async_op"] = Audit(
    reads="FSDPModule._set_unshard_async_op(async_op): sets unshard_async_op on every "
    "parameter group of every FSDP submodule, read by pre-forward and pre-backward.",
    versions={
        V2_11: "same: _fully_shard.py:599-616 sets the single _fsdp_param_group",
        V2_12: "same: :694 identical to 2.13's",
        V2_13: "same: :862 (baseline)",
        V2_14: "same: :862 identical",
        V2_15: "same: :1066 identical; no public setter",
    },
)


def torch_fsdp_set_unshard_async_op(module: nn.Module, async_op: bool) -> None:
    """``FSDPModule._set_unshard_async_op``: issue implicit all-gathers with ``async_op``."""
    require_audited_torch("torch_fsdp_set_unshard_async_op")
    module._set_unshard_async_op(async_op)


# --- activation checkpointing (tests composing checkpointing with an implementation) -------------


AUDITS["checkpoint_wrapper_api"] = Audit(
    reads="torch.distributed.algorithms._checkpoint.checkpoint_wrapper: checkpoint_wrapper, "
    "apply_activation_checkpointing and _CHECKPOINT_PREFIX (the name prefix it inserts).",
    versions={
        V2_11: "same: file byte-identical to 2.13's",
        V2_12: "same: byte-identical",
        V2_13: "same: prefix :16-17, wrapper :196, apply :239 (baseline)",
        V2_14: "same: byte-identical",
        V2_15: "same: two docstring typo fixes only",
    },
)


def checkpoint_wrapper_api() -> tuple[Callable[..., Any], Callable[..., Any], str]:
    """torch's ``(checkpoint_wrapper, apply_activation_checkpointing, _CHECKPOINT_PREFIX)``.

    The wrapper form of activation checkpointing (one form the activation-checkpointing cases
    use) lives in a private module; the prefix is what the wrapper inserts into
    parameter names.
    """
    require_audited_torch("checkpoint_wrapper_api")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        _CHECKPOINT_PREFIX,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    return checkpoint_wrapper, apply_activation_checkpointing, _CHECKPOINT_PREFIX


# --- DTensor construction without autograd (reference implementation) ----------------------------


AUDITS["dtensor_factory"] = Audit(
    reads="distributed.tensor._dtensor_spec.DTensorSpec(mesh, placements, tensor_meta=), "
    "TensorMeta(shape, stride, dtype) and DTensor(local, spec, requires_grad=), whose __new__ "
    "is the C++ _dtensor__new__.",
    versions={
        V2_11: "same: TensorMeta _dtensor_spec.py:58-64 and DTensorSpec fields :69 identical; "
        "DTensor.__new__ _api.py:300-314 identical",
        V2_12: "same: _dtensor_spec.py:67/:78, _api.py:321/335",
        V2_13: "same (baseline)",
        V2_14: "same: _dtensor_spec.py:67/:78, _api.py:387/401",
        V2_15: "same: _dtensor_spec.py:67/:78, _api.py:387/401",
    },
)


def dtensor_factory(
    mesh: Any,
    placements: tuple[Any, ...],
    shape: torch.Size,
    stride: tuple[int, ...],
    dtype: torch.dtype,
) -> Callable[[torch.Tensor], Any]:
    """A function that wraps a local shard in a ``DTensor`` of global ``shape`` and ``stride``.

    What ``DTensor.from_local(local, mesh, placements, run_check=False, shape=, stride=)``
    builds, without its autograd node and placement normalisation: the reference makes one
    sharded gradient per parameter per step, and ``from_local`` cost 15x the bare constructor
    [measured: 380 vs 33 us, 2 loaded cores]. The spec (private ``DTensorSpec``/``TensorMeta``)
    is built once, here.
    """
    require_audited_torch("dtensor_factory")
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(
        mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype)
    )

    def wrap(local: torch.Tensor) -> Any:
        return DTensor(local, spec, requires_grad=local.requires_grad)

    return wrap


# --- tensor parallel composition (reference implementation) --------------------------------------


AUDITS["concatenate_meshes"] = Audit(
    reads="DeviceMesh._concatenate(meshes): one mesh of the meshes' dims, which must share a "
    "root and not overlap (RuntimeError otherwise), reusing their process groups.",
    versions={
        V2_11: "same contract: device_mesh.py:1388-1421 checks with the older _MeshLayout "
        "(check_non_overlap), same semantics and error texts",
        V2_12: "same as 2.11: :1431-1464",
        V2_13: "same: collapse().check_orthogonal() (baseline)",
        V2_14: "same: :1475-1505, error text 'meshs' -> 'meshes' (the caller does not parse it)",
        V2_15: "same: :1570-1601, also carries the first mesh's _preserve_rank_order",
    },
)


def concatenate_meshes(meshes: list[Any]) -> Any:
    """One ``DeviceMesh`` whose dims are the dims of ``meshes`` in order, e.g. ``(dp, tp)``.

    Parameters that are already DTensors on a TP mesh get the data-parallel dims in front;
    their sharded form lives on the mesh of both. When the user built the two meshes by slicing
    one root mesh, that mesh exists as a slice of the root only if its dims are adjacent and
    in order; ``DeviceMesh._concatenate`` (private) builds it from the slices' layouts
    and reuses their process groups, without a collective.
    """
    require_audited_torch("concatenate_meshes")
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(list(meshes))


AUDITS["strided_shard"] = Audit(
    reads="distributed.tensor.placement_types._StridedShard(dim, split_factor=k): a shard of "
    "rows already split k ways, which full_tensor() reassembles in order.",
    versions={
        V2_11: "same call: subclass of the C++ StridedShard, __init__(dim, *, split_factor: int) "
        "(_C/_distributed.pyi:12-15); the caller passes an int",
        V2_12: "same as 2.11: class placement_types.py:662",
        V2_13: "same: Python __init__ (baseline)",
        V2_14: "same: __init__(dim, *, split_factor=1, sf=None) :887-907",
        V2_15: "same: __init__ :884-904 identical to 2.14's",
    },
)


def strided_shard(dim: int, split_factor: int) -> Any:
    """``_StridedShard(dim, split_factor)``: the placement of a data-parallel shard of rows that
    tensor parallelism has already split ``split_factor`` ways (the rows of a shard are
    strided over the full tensor). Private; DTensor needs it for ``full_tensor()``."""
    require_audited_torch("strided_shard")
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)
