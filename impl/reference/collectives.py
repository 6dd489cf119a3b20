"""The three collectives the reference issues, one call per parameter group each.

Every call goes through the ``torch.distributed`` module attribute at call time (never a name
imported once), so tools that wrap ``dist.all_gather_single`` and friends see our traffic.
Gradients are summed and then divided by the group size: SUM is the one reduction every
backend offers for reduce-scatter and all-reduce (AVG and PREMUL_SUM are not universal).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(
    output: torch.Tensor, flat_shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    """Rank-major concatenation of every rank's flat shard into ``output``."""
    return dist.all_gather_single(output, flat_shard, group=group, async_op=async_op)


def reduce_scatter_mean(rank_major: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Mean over ranks of ``rank_major`` (shape ``(world, n)``), returning this rank's row."""
    world_size = rank_major.shape[0]
    output = rank_major.new_empty(rank_major.shape[1])
    dist.reduce_scatter_single(output, rank_major.view(-1), op=dist.ReduceOp.SUM, group=group)
    return output.div_(world_size)


def all_reduce_mean(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place mean over ranks of ``flat``."""
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return flat.div_(dist.get_world_size(group))
