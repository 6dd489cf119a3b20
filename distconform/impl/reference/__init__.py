"""distconform's reference FSDP2-semantics implementation.

Reading order for one training step: ``fully_shard.py`` (what a call sets up), ``state.py``
(the hooks, in step order), ``group.py`` (one all-gather / one reduction per group),
``param.py`` (sharded and unsharded forms of one parameter), ``sharding.py`` (the arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distconform.impl.api import Implementation
from distconform.impl.reference.fully_shard import (
    fully_shard,
    register_fsdp_forward_method,
    replicate,
)
from distconform.impl.reference.mesh import DataParallelMeshDims
from distconform.impl.reference.module import FSDPModule, ReplicateModule
from distconform.impl.reference.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from distconform.impl.reference.state import FSDPState, GradientReductionHandle, state_of

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReferenceImplementation",
    "ReplicateModule",
    "fully_shard",
    "register_fsdp_forward_method",
    "replicate",
]


class ReferenceImplementation(Implementation):
    name = "reference"
    capabilities = frozenset(
        {
            "replicate",
            "shard_placement_fn",
            "reshard_after_forward_int",
            "gradient_accumulation",
            "async_unshard",
            "forward_method",
            "prefetch",
            "hsdp",
            "mixed_precision",
            "cpu_offload",
            "activation_checkpointing",
            "ignored_params",
            "reset_iter_state",
            "post_optim_event",
            "all_reduce_hook",
            "custom_comms",
            "separate_reduce_scatter_group",
            "reduce_scatter_unused_params",
            "reduce_scatter_max_input_buffers",
            "dp_mesh_dims",
            "manual_backward_finalization",
            "keep_unsharded_storage",
            # Composition (suites/composition): DCP, TP (DTensor parameters get the
            # data-parallel dims in front) and every pipeline schedule pass (pp: the suite's
            # DataParallelStage drives data parallelism for it; the engine drives only torch's
            # FSDPModule).
            "dcp",
            "pp",
            "tp",
        }
    )
    MixedPrecisionPolicy = MixedPrecisionPolicy
    OffloadPolicy = OffloadPolicy
    CPUOffloadPolicy = CPUOffloadPolicy
    DataParallelMeshDims = DataParallelMeshDims
    FSDPModule = FSDPModule

    def fully_shard(
        self,
        module: nn.Module | list[nn.Module],
        *,
        mesh: DeviceMesh | None = None,
        reshard_after_forward: bool | int | None = None,
        shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
        mp_policy: Any = None,
        offload_policy: Any = None,
        ignored_params: set[nn.Parameter] | None = None,
        dp_mesh_dims: Any = None,
    ) -> Any:
        return fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=shard_placement_fn,
            mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
            offload_policy=offload_policy if offload_policy is not None else OffloadPolicy(),
            ignored_params=ignored_params,
            dp_mesh_dims=dp_mesh_dims,
        )

    def replicate(
        self,
        module: nn.Module | list[nn.Module],
        *,
        mesh: DeviceMesh | None = None,
        mp_policy: Any = None,
        offload_policy: Any = None,
        ignored_params: set[nn.Parameter] | None = None,
        dp_mesh_dims: Any = None,
    ) -> Any:
        return replicate(
            module,
            mesh=mesh,
            mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
            offload_policy=offload_policy if offload_policy is not None else OffloadPolicy(),
            ignored_params=ignored_params,
            dp_mesh_dims=dp_mesh_dims,
        )

    def register_fsdp_forward_method(self, module: nn.Module, method_name: str) -> None:
        register_fsdp_forward_method(module, method_name)

    def is_group_unsharded(self, module: nn.Module) -> bool:
        group = _managed_state(module).group
        return group is not None and group.is_unsharded

    def modules_to_run_forward(self, module: nn.Module) -> set[nn.Module]:
        return set(_managed_state(module).modules_to_run_forward)

    def set_unshard_async_op(self, module: nn.Module, async_op: bool) -> None:
        for sub in module.modules():
            state = state_of(sub)
            if state is not None and state.group is not None:
                state.group.unshard_async_op = async_op


def _managed_state(module: nn.Module) -> FSDPState:
    state = state_of(module)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not managed by fully_shard or replicate")
    return state
