"""Fast paths the step benchmark led to in the reference mean exactly what the slow forms meant.

``impl/_torch_private.dtensor_factory`` replaces ``DTensor.from_local`` for the sharded
gradients the reference makes every step (benchmarks/impl_step.py profiles showed it among the
reference's largest per-parameter costs). It must build the same ``DTensor``: same global shape,
stride, placements and mesh, the local tensor itself (no copy), no autograd history, and the
same full tensor when gathered.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from distconform.impl import _torch_private


def test_dtensor_factory_refuses_an_unaudited_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.10.0")  # outside the supported window
    with pytest.raises(_torch_private.PrivateTorchAccessError, match="dtensor_factory"):
        _torch_private.dtensor_factory(None, (), torch.Size((1,)), (1,), torch.float32)


@pytest.mark.world_size(2)
def test_dtensor_factory_builds_what_from_local_builds(rank_ctx) -> None:
    mesh = rank_ctx.mesh(2)
    # An uneven dim 0: rank 0 holds 3 of 5 rows, rank 1 holds 2.
    shape, stride = torch.Size((5, 4)), (4, 1)
    local = torch.arange(12.0).view(3, 4)[: 3 - rank_ctx.rank] + 100 * rank_ctx.rank
    wrap = _torch_private.dtensor_factory(mesh, (Shard(0),), shape, stride, local.dtype)
    fast = wrap(local)
    slow = DTensor.from_local(local, mesh, (Shard(0),), run_check=False, shape=shape, stride=stride)

    assert isinstance(fast, DTensor)
    assert (fast.shape, fast.stride(), fast.dtype) == (slow.shape, slow.stride(), slow.dtype)
    assert fast.placements == slow.placements and fast.device_mesh == mesh
    assert fast.to_local().data_ptr() == local.data_ptr()
    assert not fast.requires_grad and fast.grad_fn is None
    torch.testing.assert_close(fast.full_tensor(), slow.full_tensor(), rtol=0, atol=0)

    # What the reference does with it: the sharded gradient of a sharded parameter.
    param = nn.Parameter(
        DTensor.from_local(
            torch.zeros_like(local), mesh, (Shard(0),), run_check=False, shape=shape, stride=stride
        )
    )
    param.grad = fast
    torch.testing.assert_close(param.grad.full_tensor(), slow.full_tensor(), rtol=0, atol=0)
