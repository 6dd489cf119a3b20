"""Strided (non-contiguous) tensors: every operation once, with inputs, and for in-place ops
the tensor written, that are every other element of a larger buffer.

c10d leaves two behaviours open: the right result, or an error saying the tensor must be
contiguous (NCCL's). A backend that reads or writes ``numel`` elements from the data pointer
as if the tensor were dense returns a silently wrong result, and fails.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from harness import torch_api
from suites.backend.collectives import everyones
from suites.backend.contributions import strided
from suites.backend.oracle import Findings, reduce, unlike
from suites.cases import conformance, grid_id

NUMEL = 37
DTYPE = "float32"


def _all_reduce(rank: int, device: torch.device, findings: Findings) -> None:
    inputs = everyones(NUMEL, DTYPE, op="sum", device=device)
    tensor = strided(inputs[rank])
    dist.all_reduce(tensor)
    findings.expect_equal(tensor, reduce(inputs, "sum"), "all_reduce in place")


def _broadcast(rank: int, device: torch.device, findings: Findings) -> None:
    inputs = everyones(NUMEL, DTYPE, device=device)
    tensor = strided(inputs[rank])
    dist.broadcast(tensor, src=0)
    findings.expect_equal(tensor, inputs[0], "broadcast in place")


def _all_gather(rank: int, device: torch.device, findings: Findings) -> None:
    inputs = everyones(NUMEL, DTYPE, device=device)
    outputs = [unlike(t) for t in inputs]
    dist.all_gather(outputs, strided(inputs[rank]))
    findings.expect_each_from_its_rank(outputs, inputs, "all_gather input")


def _reduce_scatter(rank: int, device: torch.device, findings: Findings) -> None:
    world = dist.get_world_size()
    inputs = everyones(NUMEL * world, DTYPE, op="sum", device=device)
    expected = reduce([t[rank * NUMEL : (rank + 1) * NUMEL] for t in inputs], "sum")
    output = unlike(expected, device)
    torch_api.reduce_scatter_single(output, strided(inputs[rank]))
    findings.expect_equal(output, expected, "reduce_scatter_single input")


def _all_to_all(rank: int, device: torch.device, findings: Findings) -> None:
    world = dist.get_world_size()
    inputs = everyones(NUMEL * world, DTYPE, device=device)
    expected = torch.cat([t[rank * NUMEL : (rank + 1) * NUMEL] for t in inputs])
    output = unlike(expected)
    dist.all_to_all_single(output, strided(inputs[rank]))
    findings.expect_equal(output, expected, "all_to_all_single input")


def _send_recv(rank: int, device: torch.device, findings: Findings) -> None:
    world = dist.get_world_size()
    inputs = everyones(NUMEL, DTYPE, device=device)
    right, left = (rank + 1) % world, (rank - 1) % world
    received = strided(unlike(inputs[left]))
    works = [
        dist.isend(strided(inputs[rank]), dst=right),
        dist.irecv(received, src=left),
    ]
    for work in works:
        work.wait()
    findings.expect_equal(received, inputs[left], "isend/irecv, both strided")


#: operation (a token of the item's id) -> its check.
CHECKS: dict[str, Callable[[int, torch.device, Findings], None]] = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "send_recv": _send_recv,
}


@conformance("backend.non_contiguous")
@pytest.mark.parametrize(
    "operation", [pytest.param(name, id=grid_id(operation=name)) for name in CHECKS]
)
def test_strided_tensors_give_the_right_result_or_a_contiguity_error(
    operation: str, rank_ctx
) -> None:
    findings = Findings(f"{operation} on strided tensors")
    try:
        CHECKS[operation](rank_ctx.rank, rank_ctx.device, findings)
    except (RuntimeError, ValueError) as exc:
        if "contiguous" not in str(exc).lower():
            raise  # an error that does not say why is no documented refusal
        return  # the documented refusal
    findings.raise_if_any()
