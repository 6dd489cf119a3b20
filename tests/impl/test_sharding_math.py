"""The reference's sharding arithmetic, for world sizes 1-8, without ranks.

The layout must agree with DTensor's ``Shard(dim)`` (``torch.chunk`` semantics), since the
sharded parameters are DTensors built from these local shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

from distconform.impl.reference.sharding import (
    ShardLayout,
    chunk_size,
    local_dim_offset,
    local_dim_size,
    padded_dim_size,
)

WORLD_SIZES = range(1, 9)
DIM_SIZES = [0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 64, 1025]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim_size", DIM_SIZES)
def test_local_rows_tile_the_dimension_like_torch_chunk(dim_size, world_size):
    chunks = torch.arange(dim_size).chunk(world_size) if dim_size else ()
    expected = [len(c) for c in chunks] + [0] * (world_size - len(chunks))
    rows = [local_dim_size(dim_size, world_size, r) for r in range(world_size)]
    assert rows == expected
    offsets = [local_dim_offset(dim_size, world_size, r) for r in range(world_size)]
    covered = [i for r in range(world_size) for i in range(offsets[r], offsets[r] + rows[r])]
    assert covered == list(range(dim_size)), "every row is owned by exactly one rank, in order"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim_size", DIM_SIZES)
def test_padding_is_less_than_one_row_per_rank(dim_size, world_size):
    chunk = chunk_size(dim_size, world_size)
    padded = padded_dim_size(dim_size, world_size)
    assert padded == chunk * world_size
    assert dim_size <= padded < dim_size + world_size
    assert padded % world_size == 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layout_of_an_uneven_matrix(world_size):
    shape = (17, 3)
    for rank in range(world_size):
        layout = ShardLayout(shape, 0, world_size, rank)
        chunk = math.ceil(17 / world_size)
        assert layout.padded_local_shape == (chunk, 3)
        assert layout.padded_local_numel == chunk * 3
        assert layout.padded_shape == (chunk * world_size, 3)
        assert layout.local_shape == (layout.local_rows, 3)
        assert layout.local_rows + layout.padding_rows == chunk
    assert sum(ShardLayout(shape, 0, world_size, r).local_rows for r in range(world_size)) == 17


def test_examples():
    # 17 rows over 4 ranks: 5, 5, 5, 2 real rows, 3 padding rows on the last rank.
    assert [local_dim_size(17, 4, r) for r in range(4)] == [5, 5, 5, 2]
    assert padded_dim_size(17, 4) == 20
    # 3 rows over 4 ranks: the last rank owns nothing.
    assert [local_dim_size(3, 4, r) for r in range(4)] == [1, 1, 1, 0]
    assert [local_dim_offset(3, 4, r) for r in range(4)] == [0, 1, 2, 3]


def test_non_leading_dim_must_divide_evenly():
    assert ShardLayout((4, 16), 1, 4, 0).local_shape == (4, 4)
    with pytest.raises(ValueError, match="divisible by the world size"):
        ShardLayout((4, 15), 1, 4, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (((), 0, 2, 0), "0-dim"),
        (((4, 4), 2, 2, 0), "cannot shard dim 2"),
    ],
)
def test_layout_rejects_impossible_shards(args, message):
    with pytest.raises(ValueError, match=message):
        ShardLayout(*args)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: chunk_size(4, 0), "world_size must be at least 1"),
        (lambda: chunk_size(-1, 2), "non-negative"),
        (lambda: local_dim_size(4, 2, 2), "outside world size"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()
