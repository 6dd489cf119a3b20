"""``impl/_torch_private.py``: each accessor has an audit of every release of the window and
refuses a torch outside it (or a release its audit lacks); the checkpointing and tensor-parallel
accessors work on the installed torch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distconform.impl import _torch_private
from tests.audited_access import audit_tests

MODULE = "impl/_torch_private.py"

#: A call of each accessor; every one must be refused before it touches anything.
CALLS = {
    "queue_autograd_callback": (lambda: None,),
    "torch_replicate": (),
    "torch_fsdp_group_is_unsharded": (None,),
    "torch_fsdp_modules_to_run_forward": (None,),
    "torch_fsdp_set_unshard_async_op": (None, True),
    "checkpoint_wrapper_api": (),
    "dtensor_factory": (None, (), torch.Size((1,)), (1,), torch.float32),
    "concatenate_meshes": ([],),
    "strided_shard": (0, 2),
}

(
    test_every_accessor_has_an_audit_of_every_release,
    test_every_accessor_refuses_a_torch_outside_the_window,
    test_an_accessor_whose_audit_lacks_the_installed_release_is_refused,
) = audit_tests(_torch_private, MODULE, CALLS)


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


def _uneven_full_tensor_on_a_concatenated_mesh() -> list[float]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh = _torch_private.concatenate_meshes([root["dp"], root["tp"]])
    # 5 rows split 3 + 2 over dp, then each dp shard over tp: the inner split, and so the
    # redistribution plan, differs between dp coordinates.
    whole = torch.arange(5.0)
    gathered = distribute_tensor(whole, mesh, [Shard(0), Shard(0)]).full_tensor()
    assert torch.equal(gathered, whole), f"rank {dist.get_rank()}: {gathered.tolist()}"
    return gathered.tolist()


def test_rank_threads_of_later_runs_never_get_an_earlier_runs_plans():
    """On the thread launcher the ranks share DTensor's process-wide caches, which key by mesh
    and keep per-rank plans (a redistribution plan holds the local shard sizes). Meshes of
    rank threads differ by the thread's ident (torch's rule for the ``threaded`` backend),
    and each run starts fresh threads that reuse the last run's idents in another order: a
    rank got a peer's plan ("narrow unexpectedly changed concrete size on dim 0") in
    26 of 30 runs before the runner cleared those caches after each run."""
    from distconform.harness.threads import ThreadRunner

    with ThreadRunner(4) as runner:
        for attempt in range(10):
            run = runner.run(_uneven_full_tensor_on_a_concatenated_mesh)
            assert run.ok, f"run {attempt}:\n{run.describe()}"
            assert run.values == [[0.0, 1.0, 2.0, 3.0, 4.0]] * 4
