"""torch's own DTensor and FSDP2 (``fully_shard``) on thread ranks.

These go through the functional-collective path (C++ ops resolving the group by name in
the per-thread registry), which a plain Python process group does not reach without the
thread-local world and thread-isolation mode.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from distconform.harness.threads import add_collective_listener


def _exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _dtensor_1d() -> None:
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    # 7 rows do not divide by 2, 3 or 4: uneven shards, possibly empty ones.
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    rows = (7 + ws - 1) // ws
    start = min(dist.get_rank() * rows, 7)
    _exact(sharded.to_local(), full[start : min(start + rows, 7)])
    _exact(sharded.full_tensor(), full)
    _exact(sharded.redistribute(mesh, [Replicate()]).to_local(), full)
    col = distribute_tensor(full, mesh, [Shard(1)])
    _exact(col.full_tensor(), full)


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_dtensor_1d_mesh(runners, ws):
    ops = collections.Counter()
    with add_collective_listener(lambda rec: ops.update([rec.op])):
        runners.run(ws, _dtensor_1d)
    # distribute_tensor scatters, full_tensor gathers through the functional path.
    assert ops["scatter"] >= ws
    assert ops["all_gather_single_coalesced"] + ops["all_gather_single"] >= ws


def _dtensor_partial() -> None:
    r, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    partial = DTensor.from_local(torch.full((2 * ws, 3), float(r + 1)), mesh, [Partial()])
    total = ws * (ws + 1) / 2
    _exact(partial.redistribute(mesh, [Replicate()]).to_local(), torch.full((2 * ws, 3), total))
    _exact(partial.redistribute(mesh, [Shard(0)]).to_local(), torch.full((2, 3), total))


@pytest.mark.parametrize("ws", [2, 4])
def test_dtensor_partial_reductions(runners, ws):
    ops = collections.Counter()
    with add_collective_listener(lambda rec: ops.update([rec.op])):
        runners.run(ws, _dtensor_partial)
    # Partial -> Shard is a functional reduce-scatter: the coalesced form, from C++.
    assert ops["reduce_scatter_single_coalesced"] == ws
    assert ops["allreduce"] == ws


def _dtensor_2d() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    sharded = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    _exact(sharded.to_local(), full[dp * 4 : dp * 4 + 4, tp * 3 : tp * 3 + 3])
    _exact(sharded.full_tensor(), full)
    half = sharded.redistribute(mesh, [Replicate(), Shard(1)])
    _exact(half.to_local(), full[:, tp * 3 : tp * 3 + 3])
    # Each mesh dimension is its own subgroup with its own name.
    dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
    assert dp_group.group_name != tp_group.group_name
    assert dist.get_process_group_ranks(tp_group) == [2 * dp, 2 * dp + 1]


def test_dtensor_2d_mesh(runners):
    runners.run(4, _dtensor_2d)


# --- FSDP2 training parity -----------------------------------------------------------


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )  # fmt: skip


def _mean_in_rank_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    return total.div_(len(tensors))


def _average(grads: list[torch.Tensor], mesh_shape: tuple[int, ...]) -> torch.Tensor:
    """Average per-rank gradients the way the sharded run's collectives do.

    1-D: one averaging reduce-scatter over all ranks. HSDP (R, S): average within each
    shard group (S consecutive ranks, the reduce-scatter), then across the R replicas
    (the all-reduce); floating-point addition is not associative, so the order matters.
    """
    if len(mesh_shape) == 1:
        return _mean_in_rank_order(grads)
    replicas, shards = mesh_shape
    per_replica = [
        _mean_in_rank_order(grads[i * shards : (i + 1) * shards]) for i in range(replicas)
    ]
    return _mean_in_rank_order(per_replica)


def _train_parity(mesh_shape: tuple[int, ...], steps: int = 4) -> list[float]:
    """fully_shard vs a replicated reference whose gradients are averaged by hand.

    The reference computes every rank's gradient on that rank's micro-batch and averages
    them in rank order with the same grouping as the sharded run's collectives, so losses
    and parameters must agree exactly, not just closely.
    """
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # identical init on every rank
    model = _mlp()
    reference = _mlp()
    reference.load_state_dict(model.state_dict())
    if len(mesh_shape) == 1:
        mesh = init_device_mesh("cpu", mesh_shape)
    else:  # HSDP: replicate across dim 0, shard within dim 1
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # same global batch on every rank
        batch = torch.randn(ws * 3, 8)
        micro = batch.split(3)
        loss = model(micro[rank]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

        per_rank = [
            torch.autograd.grad(reference(m).square().mean(), list(reference.parameters()))
            for m in micro
        ]
        with torch.no_grad():
            ref_loss = reference(micro[rank]).square().mean()
        for param, grads in zip(reference.parameters(), zip(*per_rank, strict=True), strict=True):
            param.grad = _average(list(grads), mesh_shape)
        ref_opt.step()
        ref_opt.zero_grad()
        _exact(loss.detach(), ref_loss)
        losses.append(loss.item())
    for (name, param), ref_param in zip(
        model.named_parameters(), reference.parameters(), strict=True
    ):
        full = param.full_tensor()
        assert torch.equal(full, ref_param.detach()), f"{name} diverged from the reference"
    return losses


@pytest.mark.parametrize("ws", [2, 4])
def test_fully_shard_exact_parity(runners, ws):
    losses = runners.run(ws, _train_parity, (ws,))
    assert len({tuple(x) for x in losses}) == ws  # different micro-batches per rank


def test_hsdp_2x2_exact_parity(runners):
    ops = collections.Counter()
    with add_collective_listener(lambda rec: ops.update([(rec.op, len(rec.group_ranks))])):
        runners.run(4, _train_parity, (2, 2))
    # HSDP reduce-scatters within the shard dim and all-reduces across replicas.
    assert ops[("reduce_scatter_single", 2)] > 0
    assert ops[("allreduce", 2)] > 0
