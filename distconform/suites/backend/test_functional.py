"""Functional collectives and DTensor redistributions: the traced path DTensor, FSDP2 and
torch.compile take, which reaches the backend through different entry points
(``*_single`` ops on the group, wrapped in async tensors) than ``dist.*``."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from distconform.suites import _torch_private
from distconform.suites.backend.collectives import dtype_grid, everyones
from distconform.suites.backend.oracle import Findings, reduce
from distconform.suites.cases import conformance


@conformance("backend.functional")
@pytest.mark.parametrize("dtype", dtype_grid(("float32", "bfloat16", "int64")))
def test_functional_collectives(dtype: str, rank_ctx) -> None:
    funcol = _torch_private.functional_collectives()
    findings = Findings(f"functional collectives {dtype}")
    world, rank, device, group = (
        rank_ctx.world_size,
        rank_ctx.rank,
        rank_ctx.device,
        rank_ctx.group,
    )
    inputs = everyones(6 * world, dtype, op="sum", device=device)
    summed = funcol.all_reduce(inputs[rank].clone(), "sum", group)
    findings.expect_equal(funcol.wait_tensor(summed), reduce(inputs, "sum"), "all_reduce")

    gathered = funcol.all_gather_single(inputs[rank].view(world, 6).clone(), 0, group)
    findings.expect_equal(
        funcol.wait_tensor(gathered), torch.cat([t.view(world, 6) for t in inputs]), "all_gather"
    )

    scattered = funcol.reduce_scatter_single(inputs[rank].clone(), "sum", 0, group)
    block = 6
    findings.expect_equal(
        funcol.wait_tensor(scattered),
        reduce([t[rank * block : (rank + 1) * block] for t in inputs], "sum"),
        "reduce_scatter",
    )

    exchanged = funcol.all_to_all_single(inputs[rank].clone(), None, None, group)
    findings.expect_equal(
        funcol.wait_tensor(exchanged),
        torch.cat([t[rank * block : (rank + 1) * block] for t in inputs]),
        "all_to_all_single",
    )
    findings.raise_if_any()


#: (source placement, target placement): every redistribution DTensor has a collective for.
REDISTRIBUTIONS = {
    "shard0-to-replicate": (Shard(0), Replicate()),  # all_gather
    "replicate-to-shard0": (Replicate(), Shard(0)),  # local chunk, no traffic
    "partial-to-replicate": (Partial(), Replicate()),  # all_reduce
    "partial-to-shard0": (Partial(), Shard(0)),  # reduce_scatter
    "shard0-to-shard1": (Shard(0), Shard(1)),  # all_to_all
}


@conformance("backend.dtensor")
@pytest.mark.parametrize(
    "move", [pytest.param(name, id=f"move={name}") for name in REDISTRIBUTIONS]
)
def test_dtensor_redistribute(move: str, rank_ctx) -> None:
    """A (2·ws + 1) x (ws + 3) tensor (uneven in both dims) redistributed between
    placements; ``full_tensor()`` must give the original back (the Partial case: the sum of
    every rank's contribution)."""
    source, target = REDISTRIBUTIONS[move]
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    mesh = init_device_mesh(rank_ctx.device_type, (world,))
    shape = (2 * world + 1, world + 3)
    numel = shape[0] * shape[1]
    contributions = [
        t.view(shape).float() for t in everyones(numel, "int64", op="sum", device=device)
    ]
    if isinstance(source, Partial):
        start = DTensor.from_local(contributions[rank].clone(), mesh, [Partial()], run_check=False)
        expected = reduce(contributions, "sum")
    else:
        expected = contributions[0]
        start = distribute_tensor(expected.clone(), mesh, [source])
    moved = start.redistribute(mesh, [target])
    assert moved.placements == (target,), f"{move}: placements {moved.placements}"
    full = moved.full_tensor()
    wrong = int((full.cpu() != expected.cpu()).sum())
    assert wrong == 0, f"{move} over {world} ranks: {wrong} of {numel} elements wrong"
