"""The three collectives the reference issues, one call per parameter group each.

Every call goes through the ``torch.distributed`` module attribute at call time (never a name
imported once), so tools that wrap ``dist.all_gather_single`` and friends see our traffic.
Gradients are always reduced with SUM and divided locally (``group.py``): SUM is the one
reduction every backend offers for reduce-scatter and all-reduce (gloo has no PREMUL_SUM, AVG
is not universal), so ``set_force_sum_reduction_for_comms`` changes nothing here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness import torch_api


def all_gather_flat(
    output: torch.Tensor, flat_shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    """Rank-major concatenation of every rank's flat shard into ``output``."""
    return torch_api.all_gather_single(output, flat_shard, group=group, async_op=async_op)


def reduce_scatter_sum(rank_major: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over ranks of ``rank_major`` (shape ``(world, n)``), returning this rank's row."""
    output = rank_major.new_empty(rank_major.shape[1])
    torch_api.reduce_scatter_single(output, rank_major.view(-1), op=dist.ReduceOp.SUM, group=group)
    return output


def all_reduce_sum(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place sum over ranks of ``flat``."""
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return flat
