"""Sharding arithmetic: which rows of a parameter a rank owns, and how much padding that costs.

Pure functions on shapes, no tensors and no process groups, so they can be tested for every
world size without starting ranks. The layout matches ``DTensor``'s ``Shard(dim)``: the
dimension is cut into ``world_size`` chunks of ``ceil(size / world_size)`` rows; the last
ranks may hold fewer rows, or none. Each rank stores its chunk padded to the full chunk size,
so that an all-gather of equally sized pieces rebuilds the padded parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property


def chunk_size(dim_size: int, world_size: int) -> int:
    """Rows per rank before trimming: ``ceil(dim_size / world_size)``."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if dim_size < 0:
        raise ValueError(f"dim_size must be non-negative, got {dim_size}")
    return math.ceil(dim_size / world_size)


def padded_dim_size(dim_size: int, world_size: int) -> int:
    """Size of the sharded dimension once every rank's chunk is padded to full size."""
    return chunk_size(dim_size, world_size) * world_size


def local_dim_size(dim_size: int, world_size: int, rank: int) -> int:
    """Real (unpadded) rows that ``rank`` owns; zero for ranks past the end."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    chunk = chunk_size(dim_size, world_size)
    return max(0, min(chunk, dim_size - rank * chunk))


def local_dim_offset(dim_size: int, world_size: int, rank: int) -> int:
    """Global index of the first row ``rank`` owns (clamped to ``dim_size`` when it owns none)."""
    return min(rank * chunk_size(dim_size, world_size), dim_size)


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter of ``shape`` is split along ``dim`` across ``world_size`` ranks.

    The derived sizes are cached (frozen fields, read for every parameter at every step).
    """

    shape: tuple[int, ...]
    dim: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        if not self.shape:
            raise ValueError(
                "a 0-dim parameter has no dimension to shard; wrap it in a 1-element tensor"
            )
        if not 0 <= self.dim < len(self.shape):
            raise ValueError(f"cannot shard dim {self.dim} of a tensor with shape {self.shape}")
        if self.dim != 0 and self.shape[self.dim] % self.world_size != 0:
            # A padded non-leading dim would interleave padding with real data in memory, so
            # the local shard could not be a plain view; FSDP2 refuses this too.
            raise ValueError(
                f"Shard({self.dim}) needs dim {self.dim} of shape {self.shape} to be divisible "
                f"by the world size {self.world_size}; uneven sharding is only supported on dim 0"
            )

    @cached_property
    def dim_size(self) -> int:
        return self.shape[self.dim]

    @cached_property
    def chunk(self) -> int:
        return chunk_size(self.dim_size, self.world_size)

    @cached_property
    def local_rows(self) -> int:
        return local_dim_size(self.dim_size, self.world_size, self.rank)

    @cached_property
    def row_offset(self) -> int:
        return local_dim_offset(self.dim_size, self.world_size, self.rank)

    @cached_property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's real shard (what ``DTensor.to_local()`` returns)."""
        return _replace(self.shape, self.dim, self.local_rows)

    @cached_property
    def padded_local_shape(self) -> tuple[int, ...]:
        """Shape of the padded shard every rank contributes to the all-gather."""
        return _replace(self.shape, self.dim, self.chunk)

    @cached_property
    def padded_local_numel(self) -> int:
        return math.prod(self.padded_local_shape)

    @cached_property
    def padded_shape(self) -> tuple[int, ...]:
        return _replace(self.shape, self.dim, self.chunk * self.world_size)

    @cached_property
    def padding_rows(self) -> int:
        return self.chunk - self.local_rows


def _replace(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return (*shape[:dim], size, *shape[dim + 1 :])
