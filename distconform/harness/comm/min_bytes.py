"""The fewest bytes a sharded data-parallel step can move, per rank, by closed formula.

For a shard group of size S and a replicate group of size R (HSDP; R = 1 otherwise),
over all parameter groups g (one all-gather and one reduce-scatter each):

    all-gather     = sum_g padded_numel(g) * param_dtype_size  * (S - 1) / S
    reduce-scatter = sum_g padded_numel(g) * reduce_dtype_size * (S - 1) / S
    all-reduce     = sum_g padded_numel(g) / S * reduce_dtype_size * 2 (R - 1) / R

where padded_numel pads each parameter's dim 0 up to a multiple of S (dim-0 sharding).
These are the bytes each rank sends in a bandwidth-optimal algorithm: the same measure
as ``CollectiveCall.wire_bytes``, so a trace's totals can be compared with them.
Divisions round down per group, as ``wire_bytes`` does per call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def padded_numel(shape: Sequence[int], shard_size: int) -> int:
    """Elements of a parameter after padding dim 0 to a multiple of ``shard_size``."""
    dims = list(shape) or [1]
    return math.ceil(dims[0] / shard_size) * shard_size * math.prod(dims[1:])


@dataclass(frozen=True)
class MinBytes:
    """The fewest bytes per rank each collective kind must move for one step (``total``:
    their sum): the yardstick :func:`min_bytes_per_rank` computes."""

    all_gather: int
    reduce_scatter: int
    all_reduce: int

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def min_bytes_per_rank(
    groups: Sequence[Sequence[Sequence[int]]],
    *,
    shard_size: int,
    replicate_size: int = 1,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype | None = None,
) -> MinBytes:
    """Minimum bytes each rank sends for one all-gather and one gradient reduction per group.

    ``groups`` lists, per parameter group (one ``fully_shard`` call), its parameters'
    shapes. ``reduce_dtype`` defaults to ``param_dtype``.
    """
    if shard_size < 1 or replicate_size < 1:
        raise ValueError("shard_size and replicate_size must be at least 1")
    param_size = _dtype_size(param_dtype)
    reduce_size = _dtype_size(reduce_dtype or param_dtype)
    s, r = shard_size, replicate_size
    gather = scatter = reduce = 0
    for shapes in groups:
        numel = sum(padded_numel(shape, s) for shape in shapes)
        gather += numel * param_size * (s - 1) // s
        scatter += numel * reduce_size * (s - 1) // s
        reduce += 2 * (numel // s) * reduce_size * (r - 1) // r
    return MinBytes(all_gather=gather, reduce_scatter=scatter, all_reduce=reduce)
