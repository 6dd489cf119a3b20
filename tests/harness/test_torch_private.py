"""The audited private-torch accessors: each has an audit of every release of the window, works
on the installed torch, and refuses a torch outside the window (or a release its audit lacks)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from distconform.harness import _torch_private
from tests.audited_access import audit_tests

#: A call of each accessor; every one must be refused before it touches anything.
CALLS = {
    "live_process_groups": (),
    "registered_group_name": (None,),
    "iter_non_default_groups": (),
    "process_group_count": (),
    "install_thread_local_c10d_world": (),
    "uninstall_thread_local_c10d_world": (),
    "thread_local_c10d_world_installed": (),
    "bind_thread_to_fresh_c10d_world": (),
    "unbind_thread_c10d_world": (),
    "import_dynamo": (),
    "forget_dtensor_caches": (),
    "bound_default_group_timeout": (timedelta(seconds=1),),
    "dtensor_fast_path_cache_stats": (),
    "torch_dispatch_mode_class": (),
    "functional_collective_packets": ((), ()),
    # Refused before it registers anything (these calls only run on a torch it refuses).
    "register_device_module": ("fakeaccel", None),
}

(
    test_every_accessor_has_an_audit_of_every_release,
    test_every_accessor_refuses_a_torch_outside_the_window,
    test_an_accessor_whose_audit_lacks_the_installed_release_is_refused,
) = audit_tests(_torch_private, "harness/_torch_private.py", CALLS)


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


def test_bound_default_group_timeout_lowers_the_defaults_and_restores_them():
    from torch.distributed import distributed_c10d

    gloo, nccl = distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout
    with _torch_private.bound_default_group_timeout(timedelta(seconds=7)):
        assert distributed_c10d._get_default_timeout("gloo") == timedelta(seconds=7)
        if isinstance(nccl, timedelta):  # None in a build without NCCL: left alone
            assert distributed_c10d.default_pg_nccl_timeout == timedelta(seconds=7)
    assert (distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout) == (
        gloo,
        nccl,
    )
    # A bound above the default leaves it as it is: it only ever lowers.
    with _torch_private.bound_default_group_timeout(gloo * 2):
        assert distributed_c10d._get_default_timeout("gloo") == gloo
    assert distributed_c10d.default_pg_timeout == gloo


@pytest.mark.world_size(2)
def test_registered_group_name_is_the_name_c10d_gave_the_group(rank_ctx):
    subgroup = dist.new_group([0, 1])
    dist.barrier(group=subgroup)
    assert _torch_private.registered_group_name(subgroup) == subgroup.group_name
    assert _torch_private.registered_group_name(dist.group.WORLD) == dist.group.WORLD.group_name


@pytest.mark.world_size(2)
def test_process_group_count_names_the_next_numbered_group(rank_ctx):
    before = _torch_private.process_group_count()
    subgroup = dist.new_group([0, 1])
    assert subgroup.group_name == str(before)
    assert _torch_private.process_group_count() == before + 1


def test_a_group_without_its_own_name_is_named_from_the_registry(monkeypatch):
    from distconform.harness.comm import records

    nameless = dist.ProcessGroup(0, 1)  # what a vendor's Python backend hands c10d
    with pytest.raises(RuntimeError, match="name not set"):
        _ = nameless.group_name
    monkeypatch.setattr(_torch_private, "registered_group_name", lambda group: "pg-7")
    assert records.group_name_of(nameless) == "pg-7"
