"""The audited private-torch accessors work on 2.13 and refuse any other version loudly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import _torch_private


@pytest.mark.world_size(2)
def test_live_process_groups_lists_default_and_new_groups(rank_ctx):
    before = _torch_private.live_process_groups()
    assert dist.group.WORLD in before
    subgroup = dist.new_group([0, 1])
    # Both ranks must finish connecting before either destroys its end of the group.
    dist.barrier(group=subgroup)
    try:
        assert subgroup in _torch_private.live_process_groups()
        assert subgroup in list(_torch_private.iter_non_default_groups())
        assert dist.group.WORLD not in list(_torch_private.iter_non_default_groups())
    finally:
        dist.destroy_process_group(subgroup)
    assert subgroup not in _torch_private.live_process_groups()


@pytest.mark.parametrize("accessor", ["live_process_groups", "import_dynamo"])
@pytest.mark.parametrize("version", ["2.14.0", "2.12.1+cpu", "3.0.0a0"])
def test_every_accessor_refuses_an_unaudited_torch(monkeypatch, version, accessor):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(_torch_private.PrivateTorchAccessError) as excinfo:
        getattr(_torch_private, accessor)()
    message = str(excinfo.value)
    assert accessor in message and version in message
    assert "AUDITED_TORCH" in message


def test_the_installed_torch_is_audited():
    assert _torch_private.installed_torch_version() in _torch_private.AUDITED_TORCH


@pytest.mark.world_size(2)
def test_forget_dtensor_caches_empties_this_threads_fast_path_cache(rank_ctx):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = rank_ctx.mesh(2)
    sharded = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    sharded + 1
    sharded + 1  # the same schema again: a fast-path cache hit
    hits, misses = _torch_private.dtensor_fast_path_cache_stats()
    assert hits >= 1, (hits, misses)
    assert _torch_private.forget_dtensor_caches(rank_ctx.device_type) is True
    assert _torch_private.dtensor_fast_path_cache_stats() == (0, 0)
    sharded + 1
    assert _torch_private.dtensor_fast_path_cache_stats() == (0, 1)


def test_forget_dtensor_caches_refuses_an_unaudited_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.raises(_torch_private.PrivateTorchAccessError, match="forget_dtensor_caches"):
        _torch_private.forget_dtensor_caches()


@pytest.mark.world_size(2)
def test_registered_group_name_is_the_name_c10d_gave_the_group(rank_ctx):
    subgroup = dist.new_group([0, 1])
    dist.barrier(group=subgroup)
    assert _torch_private.registered_group_name(subgroup) == subgroup.group_name
    assert _torch_private.registered_group_name(dist.group.WORLD) == dist.group.WORLD.group_name


def test_a_group_without_its_own_name_is_named_from_the_registry(monkeypatch):
    from harness.comm import records

    nameless = dist.ProcessGroup(0, 1)  # what a vendor's Python backend hands c10d
    with pytest.raises(RuntimeError, match="name not set"):
        _ = nameless.group_name
    monkeypatch.setattr(_torch_private, "registered_group_name", lambda group: "pg-7")
    assert records.group_name_of(nameless) == "pg-7"


def test_registered_group_name_refuses_an_unaudited_torch(monkeypatch):
    monkeypatch.setattr(_torch_private, "installed_torch_version", lambda: (9, 99))
    with pytest.raises(_torch_private.PrivateTorchAccessError, match="registered_group_name"):
        _torch_private.registered_group_name(None)
