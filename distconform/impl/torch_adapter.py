"""The torch adapter: ``distconform.impl.api`` mapped onto ``torch.distributed.fsdp`` (FSDP2).

``fully_shard``, the policies and ``register_fsdp_forward_method`` are torch's public API.
torch's FSDP2-based ``replicate`` and the introspection hooks have no public path in 2.13; they
go through ``impl/_torch_private.py``, version-checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed import fsdp
from torch.distributed.device_mesh import DeviceMesh

from distconform.impl import _torch_private
from distconform.impl.api import KNOWN_CAPABILITIES, Implementation


def _installed_capabilities() -> frozenset[str]:
    """Every capability, less what the installed torch's FSDP2 lacks (torch 2.11 to 2.15)."""
    absent = set()
    if not hasattr(fsdp.FSDPModule, "reset_iter_state"):  # added in torch 2.13
        absent.add("reset_iter_state")
    if not hasattr(fsdp.FSDPModule, "set_separate_reduce_scatter_group"):  # from torch 2.13
        absent.add("separate_reduce_scatter_group")
    if not hasattr(fsdp.FSDPModule, "set_reduce_scatter_unused_params"):  # from torch 2.13
        absent.add("reduce_scatter_unused_params")
    if not hasattr(fsdp.FSDPModule, "set_reduce_scatter_max_input_buffers"):  # from torch 2.13
        absent.add("reduce_scatter_max_input_buffers")
    if not hasattr(fsdp, "DataParallelMeshDims"):  # from torch 2.12
        absent.add("dp_mesh_dims")
    if not hasattr(fsdp.FSDPModule, "finalize_backward"):  # from torch 2.15
        absent.add("manual_backward_finalization")
    if not hasattr(fsdp.FSDPModule, "set_keep_unsharded_storage"):  # from torch 2.15
        absent.add("keep_unsharded_storage")
    return KNOWN_CAPABILITIES - absent


def _named_dims(dp_mesh_dims: Any) -> dict[str, Any]:
    """``dp_mesh_dims`` as a keyword only when given: torch 2.11 has no such argument."""
    return {} if dp_mesh_dims is None else {"dp_mesh_dims": dp_mesh_dims}


class TorchImplementation(Implementation):
    name = "torch"
    capabilities = _installed_capabilities()
    MixedPrecisionPolicy = fsdp.MixedPrecisionPolicy
    OffloadPolicy = fsdp.OffloadPolicy
    CPUOffloadPolicy = fsdp.CPUOffloadPolicy
    DataParallelMeshDims = getattr(fsdp, "DataParallelMeshDims", None)  # torch 2.12+
    FSDPModule = fsdp.FSDPModule

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
        return fsdp.fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=shard_placement_fn,
            mp_policy=mp_policy if mp_policy is not None else fsdp.MixedPrecisionPolicy(),
            offload_policy=offload_policy if offload_policy is not None else fsdp.OffloadPolicy(),
            ignored_params=ignored_params,
            **_named_dims(dp_mesh_dims),
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
        return _torch_private.torch_replicate()(
            module,
            mesh=mesh,
            mp_policy=mp_policy if mp_policy is not None else fsdp.MixedPrecisionPolicy(),
            offload_policy=offload_policy if offload_policy is not None else fsdp.OffloadPolicy(),
            ignored_params=ignored_params,
            **_named_dims(dp_mesh_dims),
        )

    def register_fsdp_forward_method(self, module: nn.Module, method_name: str) -> None:
        fsdp.register_fsdp_forward_method(module, method_name)

    def share_comm_ctx(self, modules: list[nn.Module]) -> None:
        fsdp.share_comm_ctx(modules)

    def is_group_unsharded(self, module: nn.Module) -> bool:
        return _torch_private.torch_fsdp_group_is_unsharded(module)

    def modules_to_run_forward(self, module: nn.Module) -> set[nn.Module]:
        return _torch_private.torch_fsdp_modules_to_run_forward(module)

    def set_unshard_async_op(self, module: nn.Module, async_op: bool) -> None:
        _torch_private.torch_fsdp_set_unshard_async_op(module, async_op)
