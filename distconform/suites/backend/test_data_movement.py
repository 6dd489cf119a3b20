"""Data movement: all_gather, broadcast, gather, scatter and all_to_all, in list and
single-tensor forms, with uneven sizes where c10d allows them, from every source rank.

Contributions differ per rank and offset, so an element taken from the wrong rank or the
wrong place is seen; each item checks sizes 0, 1 and 37 (strided tensors: ``test_non_contiguous``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distconform.api import torch_api
from distconform.suites.backend.collectives import dtype_grid, everyones
from distconform.suites.backend.contributions import SIZES, contribution, pair_salt
from distconform.suites.backend.oracle import Findings, unlike
from distconform.suites.cases import conformance, grid_id


@conformance("backend.all_gather")
@pytest.mark.parametrize("dtype", dtype_grid())
def test_all_gather(dtype: str, rank_ctx) -> None:
    findings = Findings(f"all_gather {dtype}")
    rank, device = rank_ctx.rank, rank_ctx.device
    for salt, numel in enumerate(SIZES):
        inputs = everyones(numel, dtype, salt=salt, device=device)
        where = f"{numel} elements"
        outputs = [unlike(t) for t in inputs]
        dist.all_gather(outputs, inputs[rank].clone())
        findings.expect_each_from_its_rank(outputs, inputs, f"list form, {where}")
        output = unlike(torch.cat(inputs))
        torch_api.all_gather_single(output, inputs[rank].clone())
        findings.expect_equal(output, torch.cat(inputs), f"single form, {where}")
    findings.raise_if_any()


@conformance("backend.all_gather_uneven")
@pytest.mark.parametrize("dtype", dtype_grid())
def test_all_gather_uneven_list(dtype: str, rank_ctx) -> None:
    """Rank r contributes ``base + r`` elements; every output list entry has its source's size."""
    findings = Findings(f"all_gather (uneven) {dtype}")
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    for base in (0, 5):
        inputs = [
            contribution(r, base + r, dtype, salt=base, world_size=world, device=device)
            for r in range(world)
        ]
        outputs = [unlike(t) for t in inputs]
        dist.all_gather(outputs, inputs[rank].clone())
        findings.expect_each_from_its_rank(outputs, inputs, f"{base} + rank elements each")
    findings.raise_if_any()


@conformance("backend.broadcast")
@pytest.mark.parametrize("dtype", dtype_grid())
def test_broadcast_from_every_rank(dtype: str, rank_ctx) -> None:
    findings = Findings(f"broadcast {dtype}")
    for src in range(rank_ctx.world_size):
        for salt, numel in enumerate(SIZES):
            inputs = everyones(numel, dtype, salt=salt + src, device=rank_ctx.device)
            tensor = inputs[rank_ctx.rank].clone()
            dist.broadcast(tensor, src=src)
            findings.expect_equal(tensor, inputs[src], f"src {src}, {numel} elements")
    findings.raise_if_any()


@conformance("backend.gather")
@pytest.mark.parametrize("dtype", dtype_grid())
def test_gather_to_every_rank(dtype: str, rank_ctx) -> None:
    findings = Findings(f"gather {dtype}")
    rank = rank_ctx.rank
    for dst in range(rank_ctx.world_size):
        for salt, numel in enumerate(SIZES):
            inputs = everyones(numel, dtype, salt=salt + dst, device=rank_ctx.device)
            outputs = [unlike(t) for t in inputs] if rank == dst else None
            dist.gather(inputs[rank].clone(), outputs, dst=dst)
            if outputs is not None:
                findings.expect_each_from_its_rank(outputs, inputs, f"dst {dst}, {numel} elements")
    findings.raise_if_any()


@conformance("backend.scatter")
@pytest.mark.parametrize("dtype", dtype_grid())
def test_scatter_from_every_rank(dtype: str, rank_ctx) -> None:
    findings = Findings(f"scatter {dtype}")
    world, rank = rank_ctx.world_size, rank_ctx.rank
    for src in range(world):
        for salt, numel in enumerate(SIZES):
            # Piece i of the source's list goes to rank i: contribution(i) salted by src.
            pieces = everyones(numel, dtype, salt=salt + 3 * src, device=rank_ctx.device)
            output = unlike(pieces[rank])
            sent = [p.clone() for p in pieces] if rank == src else None
            dist.scatter(output, sent, src=src)
            findings.expect_equal(output, pieces[rank], f"src {src}, {numel} elements")
    findings.raise_if_any()


def _piece(src: int, dst: int, numel: int, dtype: str, device: torch.device) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst`` in an all-to-all: distinct for every pair of up to
    8 ranks (``pair_salt``), so a piece delivered to or from the wrong rank is seen."""
    return contribution(src, numel, dtype, salt=pair_salt(dst), world_size=1, device=device)


@conformance("backend.all_to_all")
@pytest.mark.parametrize("dtype", dtype_grid())
def test_all_to_all(dtype: str, rank_ctx) -> None:
    """The list form with equal sizes, ``all_to_all_single`` with even splits, and with uneven
    splits (rank src sends ``src + dst + 1`` rows to dst, as a mixture-of-experts dispatch)."""
    findings = Findings(f"all_to_all {dtype}")
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    for numel in SIZES:
        where = f"{numel} elements per peer"
        sent = [_piece(rank, dst, numel, dtype, device) for dst in range(world)]
        received = [unlike(_piece(src, rank, numel, dtype, device)) for src in range(world)]
        dist.all_to_all(received, sent)
        for src in range(world):
            findings.expect_equal(
                received[src], _piece(src, rank, numel, dtype, device), f"list, from {src}, {where}"
            )
        flat = torch.cat([_piece(rank, dst, numel, dtype, device) for dst in range(world)])
        expected = torch.cat([_piece(src, rank, numel, dtype, device) for src in range(world)])
        output = unlike(expected)
        dist.all_to_all_single(output, flat)
        findings.expect_equal(output, expected, f"single, even splits, {where}")

    in_splits = [rank + dst + 1 for dst in range(world)]
    out_splits = [src + rank + 1 for src in range(world)]
    flat = torch.cat([_piece(rank, dst, n, dtype, device) for dst, n in enumerate(in_splits)])
    expected = torch.cat([_piece(src, rank, n, dtype, device) for src, n in enumerate(out_splits)])
    output = unlike(expected)
    dist.all_to_all_single(output, flat, out_splits, in_splits)
    findings.expect_equal(output, expected, f"single, uneven splits {in_splits}")
    findings.raise_if_any()


@conformance("backend.all_to_all_uneven")
@pytest.mark.parametrize("dtype", dtype_grid())
def test_all_to_all_uneven_list(dtype: str, rank_ctx) -> None:
    """The list form where rank src sends ``src + dst + 1`` elements to dst."""
    findings = Findings(f"all_to_all (uneven list) {dtype}")
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    sent = [_piece(rank, dst, rank + dst + 1, dtype, device) for dst in range(world)]
    received = [unlike(_piece(src, rank, src + rank + 1, dtype, device)) for src in range(world)]
    dist.all_to_all(received, sent)
    for src in range(world):
        findings.expect_equal(
            received[src], _piece(src, rank, src + rank + 1, dtype, device), f"from rank {src}"
        )
    findings.raise_if_any()


#: The large size: a 64 MiB float32 buffer (the full buffer, as nccl-tests counts it).
LARGE_NUMEL = 64 * 2**20 // 4


@conformance("backend.large")
@pytest.mark.parametrize(
    "collective",
    [
        pytest.param(c, id=grid_id(collective=c))
        for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
    ],
)
def test_64_mib(collective: str, rank_ctx) -> None:
    """One 64 MiB float32 buffer per collective: chunking and pipelining paths of a backend
    only start past a few MiB. Values encode (rank, index) exactly in float32."""
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    numel = LARGE_NUMEL - LARGE_NUMEL % world
    index = torch.arange(numel, device=device, dtype=torch.float32)

    def mine(r: int) -> torch.Tensor:
        return (index % 4093) + 8192 * r

    if collective == "all_reduce":
        tensor = mine(rank)
        dist.all_reduce(tensor)
        expected = (index % 4093) * world + 8192 * sum(range(world))
    elif collective == "broadcast":
        tensor = mine(rank)
        dist.broadcast(tensor, src=world - 1)
        expected = mine(world - 1)
    elif collective == "all_gather":
        block = numel // world
        tensor = torch.zeros(numel, device=device)
        torch_api.all_gather_single(tensor, mine(rank)[rank * block : (rank + 1) * block])
        expected = torch.cat([mine(r)[r * block : (r + 1) * block] for r in range(world)])
    elif collective == "reduce_scatter":
        block = numel // world
        tensor = torch.zeros(block, device=device)
        torch_api.reduce_scatter_single(tensor, mine(rank))
        expected = ((index % 4093) * world + 8192 * sum(range(world)))[
            rank * block : (rank + 1) * block
        ]
    else:
        block = numel // world
        tensor = torch.zeros(numel, device=device)
        dist.all_to_all_single(tensor, mine(rank))
        expected = torch.cat([mine(src)[rank * block : (rank + 1) * block] for src in range(world)])
    wrong = int((tensor != expected).sum())
    assert wrong == 0, f"{collective} of 64 MiB over {world} ranks: {wrong} elements wrong"
