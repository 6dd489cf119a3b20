"""Tensor parallelism under data parallelism: parameters that arrive as ``DTensor``s.

A parameter that is already a ``DTensor`` on a model-parallel mesh (``parallelize_module``
ran first) is managed through its *local* tensor: the group shards, all-gathers and reduces
the TP-local rows exactly like a plain parameter. Its unsharded form is again a ``DTensor`` on
the TP mesh with the TP placements (what the parallelised module expects), and its sharded
form lives on the data-parallel dims followed by the TP dims, e.g. ``(dp, tp)`` with
placements ``(Shard(0), Shard(0))``; when both split the same dim the data-parallel one is a
strided shard, since its rows are a slice of a TP shard rather than of the full tensor.

With ``dp_mesh_dims`` the parameter's mesh is already the whole mesh, ``Replicate()`` on the
data-parallel dims: its sharded form keeps that mesh and its placements, the shard dim's
``Replicate()`` replaced by the data-parallel shard (strided when a model dim after it splits
the same tensor dim). Its gradients are left as they are on the data-parallel dims (a
``Partial`` there is this rank's contribution, which the group's reduction sums).

Building that mesh and the strided placement needs two private torch names
(``impl/_torch_private.py``); everything else here is public DTensor API.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from distconform.impl import _torch_private
from distconform.impl.reference.mesh import DataParallelMesh


@dataclass(frozen=True)
class ModelParallelSpec:
    """How a parameter that arrives as a ``DTensor`` (tensor parallelism) is laid out."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    #: Mesh dims of ``mesh`` that are data-parallel (``dp_mesh_dims``): none for TP.
    data_parallel_dims: frozenset[int] = frozenset()

    @classmethod
    def of(cls, param: torch.Tensor, dp_mesh: DataParallelMesh) -> ModelParallelSpec | None:
        if not isinstance(param, DTensor):
            if dp_mesh.spmd:
                raise ValueError(
                    "with dp_mesh_dims every parameter must be a DTensor on the mesh passed in "
                    "(distribute_module or parallelize_module first); got a plain tensor"
                )
            return None
        placements = tuple(param.placements)
        if not dp_mesh.spmd:
            return cls(param.device_mesh, placements, param.shape, param.stride())
        if param.device_mesh != dp_mesh.mesh:
            raise ValueError(
                f"with dp_mesh_dims the parameters must be DTensors on the mesh passed in "
                f"{dp_mesh.mesh.mesh_dim_names}; got one on {param.device_mesh.mesh_dim_names}"
            )
        for dim in dp_mesh.dims:
            if not placements[dim].is_replicate():
                raise ValueError(
                    f"with dp_mesh_dims a parameter must be Replicate() on the data-parallel "
                    f"dim {dp_mesh.mesh.mesh_dim_names[dim]!r}; got {placements[dim]}"
                )
        return cls(
            param.device_mesh, placements, param.shape, param.stride(), frozenset(dp_mesh.dims)
        )

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient of the unsharded ``DTensor`` parameter as its local tensor, brought to
        the parameter's placements first (a TP gradient may arrive ``Partial``), except on the
        data-parallel dims, which the group reduces itself."""
        if not isinstance(grad, DTensor):
            return grad
        target = tuple(
            now if dim in self.data_parallel_dims else wanted
            for dim, (now, wanted) in enumerate(zip(grad.placements, self.placements, strict=True))
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(self.mesh, target)
        return grad.to_local()

    def splits_of(self, dim: int, after: int = -1) -> int:
        """Into how many pieces the model-parallel mesh dims after ``after`` cut tensor dim
        ``dim``."""
        pieces = 1
        for mesh_dim, placement in enumerate(self.placements):
            if mesh_dim > after and placement.is_shard(dim):
                pieces *= self.mesh.size(mesh_dim)
        return pieces


def sharded_layout(
    data_parallel: DataParallelMesh, over_shard_dim: Placement, spec: ModelParallelSpec | None
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of ``param``'s sharded form: the data-parallel ones, followed
    by the model-parallel ones when ``param`` is a TP ``DTensor``; with ``dp_mesh_dims``, the
    parameter's own with the data-parallel shard in place."""
    if data_parallel.spmd:
        assert spec is not None
        placements = list(spec.placements)
        shard_dim = data_parallel.shard_dim
        if shard_dim is not None and isinstance(over_shard_dim, Shard):
            pieces = spec.splits_of(over_shard_dim.dim, after=shard_dim)
            placements[shard_dim] = (
                _torch_private.strided_shard(over_shard_dim.dim, pieces)
                if pieces > 1
                else over_shard_dim
            )
        return spec.mesh, tuple(placements)
    dp_mesh = data_parallel.mesh
    dp_placements = data_parallel.placements(over_shard_dim)
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
