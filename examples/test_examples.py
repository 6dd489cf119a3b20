"""Example distributed tests: what a user of the harness writes.

Run them with ``python -m pytest examples --dist-summary``. Each test body runs on
every rank; ``rank_ctx`` tells it where it is.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from distconform.api import torch_api


@pytest.mark.world_size(2, 4)
def test_all_reduce_sums_every_rank(rank_ctx):
    value = torch.tensor([float(rank_ctx.rank + 1)], device=rank_ctx.device)
    dist.all_reduce(value)
    n = rank_ctx.world_size
    assert value.item() == n * (n + 1) / 2


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("rows", [7, 8])
def test_all_gather_single_restores_uneven_rows(rank_ctx, rows):
    full = torch.arange(rows * 3, dtype=torch.float32, device=rank_ctx.device).view(rows, 3)
    chunk = -(-rows // rank_ctx.world_size)
    padded = torch.zeros(chunk * rank_ctx.world_size, 3, device=rank_ctx.device)
    padded[:rows] = full
    mine = padded[rank_ctx.rank * chunk : (rank_ctx.rank + 1) * chunk].contiguous()
    gathered = torch.empty_like(padded)
    torch_api.all_gather_single(gathered, mine)
    torch.testing.assert_close(gathered[:rows], full)


@pytest.mark.world_size(4)
def test_dtensor_on_a_2d_mesh_round_trips(rank_ctx):
    mesh = rank_ctx.mesh((2, 2), ("replicate", "shard"))
    full = torch.randn(6, 4, device=rank_ctx.device)  # the same on every rank: same seed
    sharded = distribute_tensor(full, mesh, [Replicate(), Shard(0)])
    assert sharded.to_local().shape == (3, 4)
    torch.testing.assert_close(sharded.full_tensor(), full)


@pytest.mark.world_size(2)
def test_every_rank_starts_from_the_same_seed(rank_ctx):
    draw = torch.rand(4, device=rank_ctx.device)
    gathered = [torch.empty_like(draw) for _ in range(rank_ctx.world_size)]
    dist.all_gather(gathered, draw)
    for other in gathered:
        torch.testing.assert_close(other, draw)
