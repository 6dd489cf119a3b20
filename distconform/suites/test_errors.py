"""Misuse is refused at once, with an error that says what is wrong.

* a container without ``forward`` (``nn.ModuleList``) cannot be a group: its hooks would
  never run;
* a ``Shard(d)`` with ``d > 0`` needs that dim to divide evenly over the shard group (only
  dim 0 is padded);
* an int ``reshard_after_forward`` must divide the shard group (3 does not divide 4; 0 is no
  group; 8 is larger than the group);
* ``replicate`` refuses a module ``fully_shard`` already manages, and any mesh that is not 1-D.

The weight tied across two groups is ``test_shared_params``'s.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from distconform.suites.cases import conformance, grid


@conformance("fsdp.errors.container_without_forward")
def test_containers_without_forward_are_refused(rank_ctx, impl):
    with torch.device(rank_ctx.device):
        container = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="forward"):
        impl.fully_shard(container)


@conformance("fsdp.errors.uneven_non_leading_shard_dim")
def test_non_leading_shard_dim_must_divide_evenly(rank_ctx, impl):
    with torch.device(rank_ctx.device):
        model = nn.Linear(6, 8)  # weight (8, 6): dim 1 has 6 columns, not divisible by 4
    with pytest.raises(Exception, match=r"(?i)even|divisib|uneven") as info:
        impl.fully_shard(model, shard_placement_fn=lambda p: Shard(p.ndim - 1))
    assert isinstance(info.value, ValueError | NotImplementedError | AssertionError), info.value


# Not named "raf": the case table gives int values of "raf" a pool of their own, and these
# never build the sub-mesh that needs one.
@conformance("fsdp.errors.reshard_after_forward_int_must_divide")
@pytest.mark.parametrize("point", grid(reshard_after_forward=[3, 0, 8]))
def test_reshard_after_forward_int_must_divide_the_shard_group(rank_ctx, impl, point):
    with torch.device(rank_ctx.device):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="reshard_after_forward"):
        impl.fully_shard(model, reshard_after_forward=point["reshard_after_forward"])


@conformance("replicate.errors.after_fully_shard")
def test_replicate_after_fully_shard_is_refused(rank_ctx, impl):
    with torch.device(rank_ctx.device):
        model = nn.Linear(4, 4)
    impl.fully_shard(model)
    with pytest.raises(RuntimeError, match="already managed by"):
        impl.replicate(model)


@conformance("replicate.errors.needs_1d_mesh")
def test_replicate_needs_a_1d_mesh(rank_ctx, impl):
    mesh = rank_ctx.mesh((2, 2), ("a", "b"))
    with torch.device(rank_ctx.device):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"1-?D"):
        impl.replicate(model, mesh=mesh)
