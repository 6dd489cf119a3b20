"""Reductions: all_reduce with every reduce op and dtype, reduce to every destination,
reduce_scatter in its list and single-tensor forms, and the precision contract of
low-precision sums.

Every item checks sizes 0, 1 and 37 (strided tensors: ``test_non_contiguous``) against the
exact result computed from every rank's contribution (``distconform.suites.backend.oracle``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distconform.api import torch_api
from distconform.suites.backend.collectives import everyones, reduce_op, reduction_grid
from distconform.suites.backend.contributions import SIZES
from distconform.suites.backend.oracle import Findings, reduce, rounds, unlike
from distconform.suites.backend_capabilities import REDUCE_OPS
from distconform.suites.cases import conformance, grid_id

#: Ops the reduce and reduce_scatter items cover (all_reduce covers all of them).
ROOTED_OPS = ("sum", "avg", "product", "min", "max", "band")


@conformance("backend.all_reduce")
@pytest.mark.parametrize(("op", "dtype"), reduction_grid(REDUCE_OPS))
def test_all_reduce(op: str, dtype: str, rank_ctx) -> None:
    findings = Findings(f"all_reduce {op} {dtype}")
    for salt, numel in enumerate(SIZES):
        inputs = everyones(numel, dtype, op=op, salt=salt, device=rank_ctx.device)
        tensor = inputs[rank_ctx.rank].clone()
        dist.all_reduce(tensor, op=reduce_op(op))
        findings.expect_equal(
            tensor, reduce(inputs, op), f"{numel} elements", one_rounding=rounds(op)
        )
    findings.raise_if_any()


@conformance("backend.reduce")
@pytest.mark.parametrize(("op", "dtype"), reduction_grid(ROOTED_OPS))
def test_reduce_to_every_rank(op: str, dtype: str, rank_ctx) -> None:
    findings = Findings(f"reduce {op} {dtype}")
    for dst in range(rank_ctx.world_size):
        for salt, numel in enumerate(SIZES):
            inputs = everyones(numel, dtype, op=op, salt=salt + dst, device=rank_ctx.device)
            tensor = inputs[rank_ctx.rank].clone()
            dist.reduce(tensor, dst=dst, op=reduce_op(op))
            if rank_ctx.rank == dst:
                findings.expect_equal(
                    tensor,
                    reduce(inputs, op),
                    f"dst {dst}, {numel} elements",
                    one_rounding=rounds(op),
                )
    findings.raise_if_any()


@conformance("backend.reduce_scatter")
@pytest.mark.parametrize(("op", "dtype"), reduction_grid(ROOTED_OPS))
def test_reduce_scatter(op: str, dtype: str, rank_ctx) -> None:
    """The list form (one input per destination) and ``reduce_scatter_single`` (one flat input
    whose i-th block goes to rank i)."""
    findings = Findings(f"reduce_scatter {op} {dtype}")
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    for salt, numel in enumerate(SIZES):
        # inputs[src] holds src's whole input: world blocks of numel elements.
        inputs = everyones(numel * world, dtype, op=op, salt=salt, device=device)
        blocks = [t.split(numel) if numel else [t] * world for t in inputs]
        expected = reduce([blocks[src][rank] for src in range(world)], op)
        where = f"{numel} elements per rank"

        output = unlike(expected, device)
        pieces = [block.clone() for block in blocks[rank]]
        dist.reduce_scatter(output, pieces, op=reduce_op(op))
        findings.expect_equal(output, expected, f"list form, {where}", one_rounding=rounds(op))

        output = unlike(expected, device)
        torch_api.reduce_scatter_single(output, inputs[rank].clone(), op=reduce_op(op))
        findings.expect_equal(output, expected, f"single form, {where}", one_rounding=rounds(op))
    findings.raise_if_any()


#: Elements per rank of the precision check: enough for a mean error that is stable.
PRECISION_NUMEL = 4096


def _precision_inputs(world: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [
        torch.randn(PRECISION_NUMEL, generator=generator, device="cpu").to(
            dtype=dtype, device=device
        )
        for _ in range(world)
    ]


@conformance("backend.precision")
@pytest.mark.parametrize(
    ("collective", "dtype"),
    [
        pytest.param(c, d, id=grid_id(collective=c, dtype=d))
        for c in ("all_reduce", "reduce_scatter")
        for d in ("bfloat16", "float16")
    ],
)
def test_low_precision_sum_is_as_accurate_as_fp32_accumulation(
    collective: str, dtype: str, rank_ctx
) -> None:
    """A bf16/fp16 sum must be at least as accurate as summing in fp32 and casting once.

    Reducing in the low-precision type rounds after every addition: at 3 ranks and more its
    error grows past a single rounding, which silently degrades gradient averaging.
    """
    world, rank = rank_ctx.world_size, rank_ctx.rank
    low = getattr(torch, dtype)
    inputs = _precision_inputs(world, low, rank_ctx.device)
    exact = torch.stack([t.double().cpu() for t in inputs]).sum(0)
    fp32_then_cast = torch.stack([t.float().cpu() for t in inputs]).sum(0).to(low)
    if collective == "all_reduce":
        result = inputs[rank].clone()
        dist.all_reduce(result)
    else:
        block = PRECISION_NUMEL // world
        result = torch.zeros(block, dtype=low, device=rank_ctx.device)
        torch_api.reduce_scatter_single(result, inputs[rank][: block * world].contiguous())
        exact = exact[rank * block : (rank + 1) * block]
        fp32_then_cast = fp32_then_cast[rank * block : (rank + 1) * block]
    error = (result.cpu().double() - exact).abs().mean().item()
    bound = (fp32_then_cast.double() - exact).abs().mean().item()
    assert error <= bound * 1.01 + 1e-12, (
        f"{collective} of {dtype} over {world} ranks: mean absolute error {error:.3g}, but "
        f"summing in fp32 and casting once gives {bound:.3g}; the backend accumulates in "
        f"{dtype} (each partial sum rounded)"
    )
