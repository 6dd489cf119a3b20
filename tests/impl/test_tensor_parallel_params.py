"""The reference with parameters that are already TP ``DTensor``s: what it refuses, and why.

Parity of TP + fully_shard/replicate training is the composition suite's
(``suites/composition/test_tensor_parallel.py``); here are the meshes it cannot compose.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from distconform.impl import reference


def tp_linear(tp_mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8))
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel()})
    return model


@pytest.mark.world_size(4)
def test_overlapping_dp_and_tp_meshes_are_refused_with_both_names(rank_ctx):
    # Both are the outer dim of a (2, 2) mesh: the same rank pairs, so no (dp, tp) mesh exists.
    dp_mesh = rank_ctx.mesh((2, 2), ("dp", "other"))["dp"]
    tp_mesh = rank_ctx.mesh((2, 2), ("tp", "unused"))["tp"]
    with pytest.raises(ValueError, match=r"\('dp',\).*\('tp',\).*disjoint slices of one root"):
        reference.fully_shard(tp_linear(tp_mesh), mesh=dp_mesh)


@pytest.mark.world_size(2)
def test_unnamed_meshes_are_refused_with_what_to_do(rank_ctx):
    tp_mesh = rank_ctx.mesh((1, 2), ("dp", "tp"))["tp"]
    unnamed_dp = rank_ctx.mesh(2)
    with pytest.raises(ValueError, match="mesh_dim_names"):
        reference.fully_shard(tp_linear(tp_mesh), mesh=unnamed_dp)
