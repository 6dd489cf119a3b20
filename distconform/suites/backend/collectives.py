"""Small pieces the backend suite's tests share: reduce-op objects, the parameter grids, and
every rank's contributions for one check."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
import torch.distributed as dist

from distconform.suites import _torch_private
from distconform.suites.backend.contributions import contribution, reduction_points
from distconform.suites.backend.oracle import PREMUL_FACTOR
from distconform.suites.backend_capabilities import DTYPES
from distconform.suites.cases import grid_id


def reduce_op(name: str) -> object:
    """The c10d reduce op for a suite op name (PREMUL_SUM carries :data:`PREMUL_FACTOR`)."""
    if name == "premul_sum":
        return _torch_private.premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, name.upper())


def reduction_grid(ops: Iterable[str]) -> list:
    """``op=X-dtype=Y`` params for every valid (op, dtype) pair."""
    return [
        pytest.param(op, dtype, id=grid_id(op=op, dtype=dtype))
        for op, dtype in reduction_points(tuple(ops))
    ]


def dtype_grid(dtypes: Iterable[str] = DTYPES) -> list:
    """``dtype=Y`` params."""
    return [pytest.param(dtype, id=grid_id(dtype=dtype)) for dtype in dtypes]


def everyones(
    numel: int, dtype: str, *, op: str | None = None, salt: int = 0, device: torch.device
) -> list[torch.Tensor]:
    """Every rank's contribution to one call, indexed by group rank."""
    world = dist.get_world_size()
    return [
        contribution(r, numel, dtype, op=op, salt=salt, world_size=world, device=device)
        for r in range(world)
    ]
