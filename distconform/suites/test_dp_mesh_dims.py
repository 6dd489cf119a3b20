"""``dp_mesh_dims``: ``fully_shard`` and ``replicate`` on a full SPMD mesh, told which of its dims
are data parallel.

The parameters arrive as ``DTensor``s on the whole mesh, ``Replicate()`` everywhere
(``distribute_module``), and the mesh has one dim that is not data parallel (``other``): its
ranks see the same inputs, as tensor-parallel ranks would, and nothing may be reduced over it.
FSDP2's documented layout: the sharded parameters stay ``DTensor``s on the same mesh with
``Shard(0)`` on the named shard dim and their other placements unchanged; all-gathers and
reduce-scatters run over the shard dim's ranks only, all-reduces over the replicate dim's only;
gradients are the average over the data-parallel ranks. The oracle is the plain model run on
each rank's input, its gradients averaged over the data-parallel groups.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

from distconform.api import CommTracer, assert_sharded_parity
from distconform.suites.cases import conformance, grid
from distconform.suites.models import MLPStack

#: dims under test -> (mesh dim names, shard dim name, replicate dim name)
LAYOUTS: dict[str, tuple[tuple[str, str], str | None, str | None]] = {
    # FSDP over "dp"; "other" is a model dim the parameters are replicated over.
    "shard": (("dp", "other"), "dp", None),
    # HSDP with the shard dim first: the order FSDP2's plain 2-D meshes never take.
    "hsdp": (("dp", "rep"), "dp", "rep"),
    # replicate (DDP) over "dp", the second dim.
    "replicate": (("other", "dp"), None, "dp"),
    # fully_shard told of a replicate dim only: DDP through fully_shard, nothing sharded.
    "fully_shard_replicate": (("other", "dp"), None, "dp"),
}
#: The layouts applied with ``replicate``; ``fully_shard`` applies the others.
REPLICATE_LAYOUTS = frozenset({"replicate"})


def mesh_shape(names: tuple[str, str], data_parallel: str, world_size: int) -> tuple[int, int]:
    """2 x 2 on 4 ranks; on 2, the named data-parallel dim (the shard dim of HSDP) holds both
    ranks and the other dim one."""
    if world_size >= 4:
        return (2, world_size // 2)
    return tuple(world_size if name == data_parallel else 1 for name in names)


def _ranks(mesh, name: str | None) -> tuple[int, ...]:
    if name is None:
        return ()
    return tuple(dist.get_process_group_ranks(mesh.get_group(name)))


@conformance("fsdp.dp_mesh_dims")
@pytest.mark.parametrize("point", grid(dims=list(LAYOUTS)))
def test_named_data_parallel_dims_of_a_full_mesh(rank_ctx, impl, point):
    """``fully_shard(..., mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(shard=...,
    replicate=...))`` (or ``replicate`` with a replicate dim): sharded parameters are
    ``DTensor``s on the full mesh, ``Shard(0)`` on the shard dim only (none without one);
    every all-gather and reduce-scatter runs over the shard dim's ranks, every all-reduce over
    the replicate dim's; the forward equals the plain model's and the gradients are the
    data-parallel average.
    Fails on ``tests.suites.broken:dp_mesh_dims_on_the_wrong_dim`` ("placements of
    '0.in_proj.weight': (Replicate(), Shard(dim=0)); expected (Shard(dim=0), Replicate())",
    and for replicate "all_reduce ran over ranks [(1, 3)]; dp_mesh_dims allows only
    (2, 3)")."""
    names, shard_name, replicate_name = LAYOUTS[point["dims"]]
    mesh = rank_ctx.mesh(
        mesh_shape(names, shard_name or replicate_name, rank_ctx.world_size), names
    )
    with torch.device(rank_ctx.device):
        model = MLPStack(8)
    reference = copy.deepcopy(model)
    distribute_module(model, mesh)  # every parameter Replicate() on both dims
    dims = impl.DataParallelMeshDims(shard=shard_name, replicate=replicate_name)
    apply = impl.replicate if point["dims"] in REPLICATE_LAYOUTS else impl.fully_shard
    for mlp in model:
        apply(mlp, mesh=mesh, dp_mesh_dims=dims)
    apply(model, mesh=mesh, dp_mesh_dims=dims)

    expected_placements = tuple(Shard(0) if name == shard_name else Replicate() for name in names)
    problems = []
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            problems.append(f"{name}: a {type(param).__name__}, not a DTensor on the full mesh")
        elif param.device_mesh.mesh_dim_names != names:
            problems.append(f"{name}: on mesh {param.device_mesh.mesh_dim_names}, not {names}")
        elif tuple(param.placements) != expected_placements:
            problems.append(
                f"placements of {name!r}: {tuple(param.placements)}; expected "
                f"{expected_placements} (Shard(0) on {shard_name!r} only)"
            )
    assert not problems, "\n".join(problems)

    # Ranks that share a data-parallel coordinate (differ only on "other") share an input.
    data_parallel = [n for n in (shard_name, replicate_name) if n is not None]
    seed = sum(mesh.get_local_rank(n) * 10**i for i, n in enumerate(data_parallel))
    torch.manual_seed(42 + seed)
    inp = torch.randn(4, 8, device=rank_ctx.device)
    with CommTracer(functional=False) as trace:
        out = model(DTensor.from_local(inp, mesh, [Replicate(), Replicate()], run_check=False))
        local_out = out.to_local() if isinstance(out, DTensor) else out
        local_out.sum().backward()
    expected_out = reference(inp)
    torch.testing.assert_close(local_out, expected_out, msg=lambda m: f"forward: {m}")
    expected_out.sum().backward()

    wanted = {
        "all_gather": _ranks(mesh, shard_name),
        "reduce_scatter": _ranks(mesh, shard_name),
        "all_reduce": _ranks(mesh, replicate_name),
    }
    for kind, ranks in wanted.items():
        seen = {call.group_ranks for call in trace.select(kind)}
        assert seen <= {ranks}, (
            f"{kind} ran over ranks {sorted(seen)}; dp_mesh_dims allows only {ranks or 'none'}"
        )
    for kind in ("all_gather", "reduce_scatter") if shard_name else ("all_reduce",):
        assert trace.select(kind), f"no {kind} ran in the step"

    groups = [mesh.get_group(n) for n in data_parallel]
    for param in reference.parameters():
        for group in groups:
            dist.all_reduce(param.grad, group=group)
            param.grad /= group.size()
    assert_sharded_parity(reference, model)
