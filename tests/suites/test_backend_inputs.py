"""The backend suite's inputs keep the power to catch a misrouted or skipped reduction: the
properties ``suites/backend/contributions.py`` promises, checked for every world size the
suite runs (an input whose reduction is constant, or whose blocks repeat, would let a
backend that reduces the wrong block, or none, pass)."""

from __future__ import annotations

import itertools

import pytest
import torch

from distconform.suites.backend.contributions import contribution, pair_salt
from distconform.suites.backend.oracle import reduce, unlike

WORLD_SIZES = (2, 3, 4, 8)
NUMEL = 37
REDUCTIONS = [
    ("product", "int32"),
    ("band", "int32"),
    ("bor", "int32"),
    ("bxor", "int32"),
    ("sum", "bfloat16"),
    ("min", "int32"),
    ("max", "int32"),
    ("band", "bool"),
    ("bor", "bool"),
    ("bxor", "bool"),
    ("min", "bool"),
    ("max", "bool"),
]


def everyone(world: int, numel: int, dtype: str, op: str | None, salt: int = 0) -> list:
    return [contribution(r, numel, dtype, op=op, salt=salt, world_size=world) for r in range(world)]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize(("op", "dtype"), REDUCTIONS)
def test_reductions_depend_on_the_element_and_on_every_block(world, op, dtype):
    result = reduce(everyone(world, NUMEL, dtype, op), op)
    assert len(set(result.tolist())) > 1, f"{op} {dtype} at ws {world} is constant"
    # reduce_scatter: rank r's block must differ from every other rank's block.
    whole = reduce(everyone(world, NUMEL * world, dtype, op), op).view(world, NUMEL)
    for a, b in itertools.combinations(range(world), 2):
        assert not torch.equal(whole[a], whole[b]), f"{op} {dtype} ws {world}: blocks {a}, {b}"


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("op", ["band", "bor", "min", "max"])
def test_bool_reductions_differ_from_any_single_rank(world, op):
    """A backend that returns its own input (or one rank's) instead of the reduction fails."""
    inputs = everyone(world, NUMEL, "bool", op)
    result = reduce(inputs, op)
    assert all(not torch.equal(result, mine) for mine in inputs), (op, world)


@pytest.mark.parametrize("world", [*WORLD_SIZES, 1])
def test_exact_sums_and_products_fit_every_dtype(world):
    total = reduce(everyone(world, NUMEL, "int64", "sum"), "sum")
    assert total.abs().max() <= 127 and total.abs().max() <= 256  # int8; exact in bf16
    product = reduce(everyone(world, NUMEL, "int64", "product"), "product")
    assert product.abs().max() <= 2


def test_all_to_all_pieces_differ_for_every_pair():
    pieces = {
        (src, dst): tuple(contribution(src, NUMEL, "int32", salt=pair_salt(dst)).tolist())
        for src in range(8)
        for dst in range(8)
    }
    assert len(set(pieces.values())) == len(pieces)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int64", "bool", "complex64"])
def test_a_result_buffer_differs_from_the_result_everywhere(dtype):
    expected = contribution(1, NUMEL, dtype, op="sum" if dtype != "bool" else "bor", world_size=3)
    assert not (unlike(expected) == expected).any()
