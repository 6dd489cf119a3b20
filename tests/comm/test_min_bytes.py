"""The closed-form minimum bytes, against numbers worked out by hand and against a trace."""

from __future__ import annotations

import pytest
import torch

from distconform.harness import torch_api
from distconform.harness.comm import CommTracer, MinBytes, min_bytes_per_rank, padded_numel


def test_padding_rounds_dim_0_up_to_the_shard_size():
    assert padded_numel((10, 4), 4) == 12 * 4
    assert padded_numel((3,), 4) == 4
    assert padded_numel((8, 2, 3), 4) == 8 * 6
    assert padded_numel((), 2) == 2  # a scalar is one row


def test_hsdp_with_mixed_precision_by_hand():
    # Shard 4, replicate 2, fp32 params, bf16 gradients.
    # group 1: (10, 4) pads to 12 x 4 = 48, (3,) pads to 4: 52 elements; group 2: (7,) -> 8.
    # all-gather:     52 * 4 B * 3/4 = 156,  8 * 4 * 3/4 = 24  -> 180
    # reduce-scatter: 52 * 2 B * 3/4 = 78,   8 * 2 * 3/4 = 12  -> 90
    # all-reduce of the shards over 2 replicas: 2 * (52/4) * 2 B * 1/2 = 26, 2 * 2 * 2 * 1/2 = 4
    found = min_bytes_per_rank(
        [[(10, 4), (3,)], [(7,)]],
        shard_size=4,
        replicate_size=2,
        param_dtype=torch.float32,
        reduce_dtype=torch.bfloat16,
    )
    assert found == MinBytes(all_gather=180, reduce_scatter=90, all_reduce=30)
    assert found.total == 300


def test_fsdp_without_replication_has_no_all_reduce():
    # (6, 5) over 2 shards: 30 elements, no padding; fp32: 30 * 4 * 1/2 = 60 each way.
    assert min_bytes_per_rank([[(6, 5)]], shard_size=2) == MinBytes(60, 60, 0)


def test_pure_replication_only_all_reduces():
    # 10 fp32 elements over 4 replicas: 2 * 40 B * 3/4 = 60.
    assert min_bytes_per_rank([[(10,)]], shard_size=1, replicate_size=4) == MinBytes(0, 0, 60)


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        min_bytes_per_rank([[(1,)]], shard_size=0)


@pytest.mark.world_size(2, 4)
def test_a_padded_flat_all_gather_and_reduce_scatter_meet_the_minimum(rank_ctx):
    ws = rank_ctx.world_size
    shapes = [(10, 4), (3,)]
    padded = sum(padded_numel(s, ws) for s in shapes)
    with CommTracer() as trace:
        torch_api.all_gather_single(torch.empty(padded), torch.ones(padded // ws))
        torch_api.reduce_scatter_single(torch.empty(padded // ws), torch.ones(padded))
    minimum = min_bytes_per_rank([shapes], shard_size=ws)
    assert trace.totals("all_gather").wire_bytes == minimum.all_gather, trace.calls
    assert trace.totals("reduce_scatter").wire_bytes == minimum.reduce_scatter, trace.calls
