"""Groups and synchronisation: barrier, the object collectives, and sub-groups (new_group,
split_group, DeviceMesh sub-meshes) used while the default group is busy too."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from distconform.suites.backend.contributions import contribution
from distconform.suites.backend.oracle import Findings, reduce
from distconform.suites.cases import conformance

#: How long rank r waits before the barrier (r times this): long against scheduling noise.
BARRIER_STAGGER_S = 0.1


@conformance("backend.barrier")
def test_barrier_holds_every_rank_until_the_last_arrives(rank_ctx) -> None:
    """Rank r arrives ``r * 0.1`` s late; nobody may leave before the last has arrived.

    Arrival and departure times go through all_gather_object after the barrier, so the check
    reads times taken on one machine's clock (on several hosts, clock skew adds to the slack).
    """
    world, rank = rank_ctx.world_size, rank_ctx.rank
    dist.barrier()  # line everyone up first: the pool's ranks arrive from different places
    time.sleep(BARRIER_STAGGER_S * rank)
    arrived = time.time()
    dist.barrier()
    left = time.time()
    times: list = [None] * world
    dist.all_gather_object(times, (arrived, left))
    last_arrival = max(a for a, _ in times)
    early = [(r, last_arrival - d) for r, (_, d) in enumerate(times) if d < last_arrival - 0.02]
    assert not early, "ranks left the barrier before the last rank arrived: " + ", ".join(
        f"rank {r} {gap * 1000:.0f} ms early" for r, gap in early
    )


@conformance("backend.object_collectives")
def test_object_collectives(rank_ctx) -> None:
    findings = Findings("object collectives")
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device

    def obj(r: int, salt: int = 0) -> dict:
        return {"rank": r, "salt": salt, "payload": list(range(r + salt)), "text": "x" * (r * 7)}

    gathered: list = [None] * world
    dist.all_gather_object(gathered, obj(rank))
    if gathered != [obj(r) for r in range(world)]:
        findings.note(f"all_gather_object gave {gathered!r}")
    for root in range(world):
        into = [None] * world if rank == root else None
        dist.gather_object(obj(rank, root), into, dst=root)
        if rank == root and into != [obj(r, root) for r in range(world)]:
            findings.note(f"gather_object to {root} gave {into!r}")
        listed = [obj(root, 1), obj(root, 2)] if rank == root else [None, None]
        dist.broadcast_object_list(listed, src=root, device=device)
        if listed != [obj(root, 1), obj(root, 2)]:
            findings.note(f"broadcast_object_list from {root} gave {listed!r}")
        received: list = [None]
        scattered = [obj(r, 10 + root) for r in range(world)] if rank == root else None
        dist.scatter_object_list(received, scattered, src=root)
        if received[0] != obj(rank, 10 + root):
            findings.note(f"scatter_object_list from {root} gave {received!r}")
    if world > 1:
        right, left = (rank + 1) % world, (rank - 1) % world
        incoming: list = [None]
        if rank % 2 == 0:
            dist.send_object_list([obj(rank, 99)], dst=right, device=device)
            dist.recv_object_list(incoming, src=left, device=device)
        else:
            dist.recv_object_list(incoming, src=left, device=device)
            dist.send_object_list([obj(rank, 99)], dst=right, device=device)
        if incoming[0] != obj(left, 99):
            findings.note(f"recv_object_list from {left} gave {incoming!r}")
    findings.raise_if_any()


def _check_subgroups_beside_the_default_group(
    findings: Findings, subgroup: dist.ProcessGroup, members: list[int], rank_ctx, what: str
) -> None:
    """An async all_reduce on the default group, then one on the sub-group, waited in reverse
    order: the two must not mix their data or block each other."""
    rank, world, device = rank_ctx.rank, rank_ctx.world_size, rank_ctx.device
    inputs = [
        contribution(r, 37, "int64", op="sum", world_size=world, device=device)
        for r in range(world)
    ]
    everyone = inputs[rank].clone()
    local = (inputs[rank] * 100).clone()
    default_work = dist.all_reduce(everyone, async_op=True)
    sub_work = dist.all_reduce(local, group=subgroup, async_op=True)
    sub_work.wait()
    default_work.wait()
    findings.expect_equal(everyone, reduce(inputs, "sum"), f"{what}: the default group's sum")
    findings.expect_equal(
        local, reduce([inputs[r] * 100 for r in members], "sum"), f"{what}: sum over {members}"
    )
    if dist.get_process_group_ranks(subgroup) != members:
        findings.note(
            f"{what}: group ranks {dist.get_process_group_ranks(subgroup)}, expected {members}"
        )


def _halves(world: int) -> list[list[int]]:
    return [list(range(0, world, 2)), list(range(1, world, 2))] if world > 1 else [[0]]


@conformance("backend.new_group")
def test_new_group_beside_the_default_group(rank_ctx) -> None:
    findings = Findings("new_group")
    rank = rank_ctx.rank
    mine = None
    for members in _halves(rank_ctx.world_size):  # every rank creates every group, in order
        group = dist.new_group(members)
        if rank in members:
            mine = (group, members)
    assert mine is not None
    _check_subgroups_beside_the_default_group(findings, *mine, rank_ctx, "new_group")
    findings.raise_if_any()


@conformance("backend.split_group")
def test_split_group_beside_the_default_group(rank_ctx) -> None:
    findings = Findings("split_group")
    halves = _halves(rank_ctx.world_size)
    group = dist.split_group(split_ranks=halves)
    members = next(m for m in halves if rank_ctx.rank in m)
    assert group is not None, f"split_group gave rank {rank_ctx.rank} no group"
    _check_subgroups_beside_the_default_group(findings, group, members, rank_ctx, "split_group")
    findings.raise_if_any()


@conformance("backend.device_mesh")
def test_device_mesh_sub_meshes(rank_ctx) -> None:
    """A (2, world/2) mesh: each dimension's group, in flight beside the default group,
    reduces over exactly the ranks that differ along that dimension."""
    world, rank = rank_ctx.world_size, rank_ctx.rank
    findings = Findings("DeviceMesh")
    mesh = init_device_mesh(rank_ctx.device_type, (2, world // 2), mesh_dim_names=("row", "col"))
    layout = torch.arange(world, device="cpu").view(2, world // 2)
    row, col = divmod(rank, world // 2)
    # The group of a mesh dimension holds the ranks that differ only along that dimension.
    for name, members in (("row", layout[:, col].tolist()), ("col", layout[row].tolist())):
        _check_subgroups_beside_the_default_group(
            findings, mesh.get_group(name), members, rank_ctx, f"mesh dim {name}"
        )
    findings.raise_if_any()


@conformance("backend.new_subgroups")
def test_new_subgroups_beside_the_default_group(rank_ctx) -> None:
    """``new_subgroups(group_size=2)`` (consecutive pairs) and ``new_subgroups_by_enumeration``
    (even and odd ranks): each rank gets the sub-group it belongs to, and an all_reduce on it,
    in flight beside one on the default group, sums over exactly its members."""
    world, rank = rank_ctx.world_size, rank_ctx.rank
    findings = Findings("new_subgroups")
    by_size, _ = dist.new_subgroups(group_size=2)
    pair = [rank - rank % 2, rank - rank % 2 + 1]
    _check_subgroups_beside_the_default_group(
        findings, by_size, pair, rank_ctx, "new_subgroups(group_size=2)"
    )
    halves = _halves(world)
    by_enumeration, _ = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=halves)
    members = next(m for m in halves if rank in m)
    _check_subgroups_beside_the_default_group(
        findings, by_enumeration, members, rank_ctx, "new_subgroups_by_enumeration"
    )
    findings.raise_if_any()
