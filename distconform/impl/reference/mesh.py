"""Where data parallelism sits in a device mesh: the dims parameters shard and replicate over.

A group's mesh has a *shard* dim, a *replicate* dim, or both (``DataParallelMesh``).
``fully_shard`` on a 1-D mesh shards over it; on a 2-D mesh ``(replicate, shard)`` (HSDP) it
shards over dim 1 and replicates over dim 0; ``replicate`` replicates over its 1-D mesh.

With ``dp_mesh_dims`` the mesh is the whole SPMD mesh instead: the parameters arrive as
``DTensor``s on it, ``Replicate()`` on the named data-parallel dims, and the other dims are the
model's own (tensor parallel, or dims the model leaves replicated). The group then shards and
reduces over the named dims only, with their groups, and its sharded parameters stay
``DTensor``s on that same mesh (``tensor_parallel.sharded_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate


@dataclass
class DataParallelMeshDims:
    """FSDP2's names of the data-parallel dims of a full SPMD mesh (torch 2.12+ has its own;
    either is accepted). A tuple of names flattens several dims into one in FSDP2; the
    reference takes one name per role."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs a shard dim, a replicate dim, or both")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


@dataclass(frozen=True)
class DataParallelMesh:
    """Which dim of ``mesh`` parameters are sharded over and which they are replicated over;
    ``spmd``: ``mesh`` is the full SPMD mesh named by ``dp_mesh_dims``."""

    mesh: DeviceMesh
    shard_dim: int | None
    replicate_dim: int | None
    spmd: bool = False

    @classmethod
    def for_fully_shard(cls, mesh: DeviceMesh, dp_mesh_dims: Any = None) -> DataParallelMesh:
        if dp_mesh_dims is not None:
            return cls.for_named_dims(mesh, dp_mesh_dims)
        if mesh.ndim == 1:
            return cls(mesh, shard_dim=0, replicate_dim=None)
        if mesh.ndim == 2:
            return cls(mesh, shard_dim=1, replicate_dim=0)
        raise ValueError(
            f"fully_shard expects a 1-D mesh (shard) or a 2-D mesh (replicate, shard), got "
            f"{mesh.ndim} dims: {mesh}; name the data-parallel dims of a larger mesh with "
            f"dp_mesh_dims"
        )

    @classmethod
    def for_replicate(cls, mesh: DeviceMesh, dp_mesh_dims: Any = None) -> DataParallelMesh:
        if dp_mesh_dims is not None:
            dp = cls.for_named_dims(mesh, dp_mesh_dims)
            if dp.shard_dim is not None:
                raise ValueError(
                    "replicate shards nothing: its dp_mesh_dims names a replicate dim only"
                )
            return dp
        if mesh.ndim != 1:
            raise ValueError(f"replicate expects a 1-D DeviceMesh, got {mesh.ndim} dims: {mesh}")
        return cls(mesh, shard_dim=None, replicate_dim=0)

    @classmethod
    def for_named_dims(cls, mesh: DeviceMesh, dp_mesh_dims: Any) -> DataParallelMesh:
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError("dp_mesh_dims names mesh dims, but the mesh has no mesh_dim_names")
        shard, replicate = _names(dp_mesh_dims.shard), _names(dp_mesh_dims.replicate)
        if not shard and not replicate:
            raise ValueError("dp_mesh_dims names no dim: set shard, replicate, or both")
        for role, chosen in (("shard", shard), ("replicate", replicate)):
            unknown = [name for name in chosen if name not in names]
            if unknown:
                raise ValueError(
                    f"dp_mesh_dims.{role} names {unknown}, not dims of the mesh {names}"
                )
            if len(chosen) > 1:
                raise NotImplementedError(
                    f"dp_mesh_dims.{role}={chosen}: flattening several mesh dims into one "
                    f"data-parallel dim is not implemented by the reference; name one dim"
                )
        return cls(
            mesh,
            shard_dim=names.index(shard[0]) if shard else None,
            replicate_dim=names.index(replicate[0]) if replicate else None,
            spmd=True,
        )

    @property
    def dims(self) -> tuple[int, ...]:
        """The data-parallel mesh dims."""
        return tuple(d for d in (self.replicate_dim, self.shard_dim) if d is not None)

    @property
    def shard_size(self) -> int:
        return 1 if self.shard_dim is None else self.mesh.size(self.shard_dim)

    @property
    def shard_rank(self) -> int:
        return 0 if self.shard_dim is None else self.mesh.get_local_rank(self.shard_dim)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_dim is None else self.mesh.size(self.replicate_dim)

    def group(self, dim: int | None) -> dist.ProcessGroup | None:
        return None if dim is None else self.mesh.get_group(dim)

    def placements(self, over_shard_dim: Placement) -> tuple[Placement, ...]:
        """A plain parameter's sharded placements, one per data-parallel mesh dim:
        ``Replicate()`` on the replicate dim, ``over_shard_dim`` on the shard dim."""
        return tuple(
            over_shard_dim if dim == self.shard_dim else Replicate() for dim in sorted(self.dims)
        )


def _names(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)
