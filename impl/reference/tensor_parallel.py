"""Tensor parallelism under data parallelism: parameters that arrive as ``DTensor``s.

A parameter that is already a ``DTensor`` on a model-parallel mesh (``parallelize_module``
ran first) is managed through its *local* tensor: the group shards, all-gathers and reduces
the TP-local rows exactly like a plain parameter. Its unsharded form is again a ``DTensor`` on
the TP mesh with the TP placements (what the parallelised module expects), and its sharded
form lives on the data-parallel dims followed by the TP dims, e.g. ``(dp, tp)`` with
placements ``(Shard(0), Shard(0))``; when both split the same dim the data-parallel one is a
strided shard, since its rows are a slice of a TP shard rather than of the full tensor.

Building that mesh and the strided placement needs two private torch names
(``impl/_torch_private.py``); everything else here is public DTensor API.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from impl import _torch_private


@dataclass(frozen=True)
class ModelParallelSpec:
    """How a parameter that arrives as a ``DTensor`` (tensor parallelism) is laid out."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @classmethod
    def of(cls, param: torch.Tensor) -> ModelParallelSpec | None:
        if not isinstance(param, DTensor):
            return None
        return cls(param.device_mesh, tuple(param.placements), param.shape, param.stride())

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient of the unsharded ``DTensor`` parameter as its local tensor, brought to
        the parameter's placements first (a TP gradient may arrive ``Partial``)."""
        if not isinstance(grad, DTensor):
            return grad
        if tuple(grad.placements) != self.placements:
            grad = grad.redistribute(self.mesh, self.placements)
        return grad.to_local()

    def splits_of(self, dim: int) -> int:
        """Into how many pieces the model-parallel dims cut tensor dim ``dim``."""
        pieces = 1
        for mesh_dim, placement in enumerate(self.placements):
            if placement.is_shard(dim):
                pieces *= self.mesh.size(mesh_dim)
        return pieces


def sharded_layout(
    dp_mesh: DeviceMesh, dp_placements: tuple[Placement, ...], param: torch.Tensor
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of ``param``'s sharded form: the data-parallel ones, followed
    by the model-parallel ones when ``param`` is a TP ``DTensor``."""
    spec = ModelParallelSpec.of(param)
    if spec is None:
        return dp_mesh, dp_placements
    if dp_mesh.mesh_dim_names is None or spec.mesh.mesh_dim_names is None:
        raise ValueError(
            "a DTensor parameter composes with the data-parallel mesh only when both meshes "
            "have dim names: slice both from one init_device_mesh(..., mesh_dim_names=...)"
        )
    try:
        mesh = _torch_private.concatenate_meshes([dp_mesh, spec.mesh])
    except RuntimeError as error:
        raise ValueError(
            f"the data-parallel mesh {dp_mesh.mesh_dim_names} and the parameter's mesh "
            f"{spec.mesh.mesh_dim_names} must be disjoint slices of one root mesh: {error}"
        ) from error
    dp_shard = dp_placements[-1]
    if isinstance(dp_shard, Shard) and spec.splits_of(dp_shard.dim) > 1:
        dp_shard = _torch_private.strided_shard(dp_shard.dim, spec.splits_of(dp_shard.dim))
    return mesh, (*dp_placements[:-1], dp_shard, *spec.placements)


def local_data(param: torch.Tensor) -> torch.Tensor:
    """What the data-parallel group shards: the tensor itself, or a ``DTensor``'s local part."""
    with torch.no_grad():
        return param.to_local() if isinstance(param, DTensor) else param.detach()
