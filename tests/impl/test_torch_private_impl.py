"""``impl/_torch_private.py``'s activation-checkpointing accessor: version-checked and working."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from impl import _torch_private


def test_checkpoint_wrapper_api_refuses_an_unaudited_torch(monkeypatch):
    monkeypatch.setattr(_torch_private, "installed_torch_version", lambda: (9, 99))
    with pytest.raises(_torch_private.PrivateTorchAccessError, match="checkpoint_wrapper_api"):
        _torch_private.checkpoint_wrapper_api()


def test_checkpoint_wrapper_api_wraps_with_its_prefix_and_keeps_gradients():
    _wrapper, apply_activation_checkpointing, prefix = _torch_private.checkpoint_wrapper_api()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plain = copy.deepcopy(model)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    names = [name for name, _ in model.named_parameters()]
    assert names and all(prefix in name for name in names), names
    x = torch.randn(3, 4)
    model(x).sum().backward()
    plain(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize(
    ("accessor", "args"), [("concatenate_meshes", ([],)), ("strided_shard", (0, 2))]
)
def test_tensor_parallel_accessors_refuse_an_unaudited_torch(monkeypatch, accessor, args):
    monkeypatch.setattr(_torch_private, "installed_torch_version", lambda: (9, 99))
    with pytest.raises(_torch_private.PrivateTorchAccessError, match=accessor):
        getattr(_torch_private, accessor)(*args)


@pytest.mark.world_size(4)
def test_concatenated_mesh_and_strided_shard_rebuild_the_full_tensor(rank_ctx):
    """The (dp, tp) mesh rebuilt from its slices reuses their groups, and a strided dp shard of
    a tp shard of the same dim gathers back to the full tensor (a plain Shard(0) would put the
    rows in the wrong order)."""
    from torch.distributed.tensor import DTensor, Shard

    root = rank_ctx.mesh((2, 2), ("dp", "tp"))
    mesh = _torch_private.concatenate_meshes([root["dp"], root["tp"]])
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert mesh.mesh.tolist() == root.mesh.tolist()
    assert mesh.get_group("dp") is root.get_group("dp")
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    tp_rows = full.chunk(2)[root.get_local_rank("tp")]
    local = tp_rows.chunk(2)[root.get_local_rank("dp")]
    placements = (_torch_private.strided_shard(0, 2), Shard(0))
    sharded = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )
    torch.testing.assert_close(sharded.full_tensor(), full)
