"""Misuse fails with an error that says what is wrong (cases.md §5.1 items 1 and 6).

cases.md §2.8 is in the suites' default run:
``suites/test_shared_params.py::test_shared_params_separate_fsdp_groups_error[ws4]`` (a weight
tied across groups fails at the first forward) and
``::test_layer_by_layer_shard_no_false_positive[ws4]`` (layer-by-layer sharding is no false
tie); the reference's error naming both groups' modules is ``test_structure.py``.
"""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor import Shard


@pytest.mark.world_size(2)
def test_containers_without_forward_are_refused(rank_ctx, impl):
    with pytest.raises(ValueError, match="forward"):
        impl.fully_shard(nn.ModuleList([nn.Linear(2, 2)]))


@pytest.mark.world_size(4)
def test_non_leading_shard_dim_must_divide_evenly(rank_ctx, impl):
    model = nn.Linear(6, 8)  # weight (8, 6): dim 1 has 6 columns, not divisible by 4
    with pytest.raises(Exception, match=r"(?i)even|divisib|uneven") as info:
        impl.fully_shard(model, shard_placement_fn=lambda p: Shard(p.ndim - 1))
    assert isinstance(info.value, (ValueError, NotImplementedError, AssertionError)), info.value


@pytest.mark.world_size(4)
@pytest.mark.parametrize("raf", [3, 0, 8], ids=lambda v: f"raf={v}")
def test_reshard_after_forward_int_must_divide_the_world(rank_ctx, impl, raf):
    with pytest.raises(ValueError, match="reshard_after_forward"):
        impl.fully_shard(nn.Linear(4, 4), reshard_after_forward=raf)


@pytest.mark.world_size(2)
def test_replicate_after_fully_shard_is_refused(rank_ctx, impl):
    model = nn.Linear(4, 4)
    impl.fully_shard(model)
    with pytest.raises(RuntimeError, match="already managed by"):
        impl.replicate(model)


@pytest.mark.world_size(4)
def test_replicate_needs_a_1d_mesh(rank_ctx, impl):
    mesh = rank_ctx.mesh((2, 2), ("a", "b"))
    with pytest.raises(ValueError, match=r"1-?D"):
        impl.replicate(nn.Linear(4, 4), mesh=mesh)
