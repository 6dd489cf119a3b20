"""The three collectives the reference issues, one call per parameter group each.

Every call goes through the ``torch.distributed`` module attribute at call time (never a name
imported once), so tools that wrap ``dist.all_gather_single`` and friends see our traffic.
Gradients are always reduced with SUM and divided locally (``group.py``): SUM is the one
reduction every backend offers for reduce-scatter and all-reduce (gloo has no PREMUL_SUM, AVG
is not universal), so ``set_force_sum_reduction_for_comms`` changes nothing here.

A user's all-gather or reduce-scatter (``set_custom_all_gather`` / ``set_custom_reduce_scatter``)
replaces the collective whole: it allocates the buffers it communicates in (its ``allocate``,
FSDP2's ``Comm`` interface) and runs the call; what it leaves in its output is the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from distconform.api import torch_api


class Comm(Protocol):
    """FSDP2's ``Comm``: a user's collective makes the buffers it communicates in."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


class AllGather(Comm, Protocol):
    """FSDP2's custom all-gather: the output buffer comes from ``allocate``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class ReduceScatter(Comm, Protocol):
    """FSDP2's custom reduce-scatter: the input and output buffers come from ``allocate``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None: ...


def all_gather_flat(
    flat_shard: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool,
    comm: AllGather | None = None,
) -> tuple[dist.Work | None, torch.Tensor]:
    """Start the rank-major concatenation of every rank's flat shard: ``(work, output)``."""
    size = (group.size() * flat_shard.numel(),)
    if comm is None:
        output = flat_shard.new_empty(size)
        work = torch_api.all_gather_single(output, flat_shard, group=group, async_op=async_op)
        return work, output
    output = comm.allocate(size, dtype=flat_shard.dtype, device=flat_shard.device)
    work = comm(output_tensor=output, input_tensor=flat_shard, group=group, async_op=async_op)
    return work, output


def reduce_scatter_sum(
    rank_major: torch.Tensor, group: dist.ProcessGroup, comm: ReduceScatter | None = None
) -> torch.Tensor:
    """Sum over ranks of ``rank_major`` (shape ``(world, n)``), returning this rank's row."""
    if comm is None:
        output = rank_major.new_empty(rank_major.shape[1])
        torch_api.reduce_scatter_single(
            output, rank_major.view(-1), op=dist.ReduceOp.SUM, group=group
        )
        return output
    buffers = {"dtype": rank_major.dtype, "device": rank_major.device}
    flat_input = comm.allocate((rank_major.numel(),), **buffers)
    flat_input.copy_(rank_major.view(-1))
    output = comm.allocate((rank_major.shape[1],), **buffers)
    work = comm(output_tensor=output, input_tensor=flat_input, group=group, op=dist.ReduceOp.SUM)
    if work is not None:
        work.wait()
    return output


def all_reduce_sum(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place sum over ranks of ``flat``."""
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return flat
