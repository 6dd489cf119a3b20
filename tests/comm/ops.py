"""One call of each collective, and the record each should leave: shared by the count tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distconform.harness import torch_api


def issue_each_op(world_size: int, rank: int, mesh) -> None:
    """Issue every collective the tracer claims to see, once, with distinct sizes."""
    from torch.distributed.tensor import DTensor, Shard

    dist.all_reduce(torch.ones(6))
    torch_api.all_gather_single(torch.empty(3 * world_size), torch.ones(3))
    dist.all_gather([torch.empty(5) for _ in range(world_size)], torch.ones(5))
    torch_api.reduce_scatter_single(torch.empty(2), torch.ones(2 * world_size))
    dist.broadcast(torch.ones(7, dtype=torch.float64), src=0)
    dist.all_to_all_single(torch.empty(4 * world_size), torch.ones(4 * world_size))
    if rank == 0:
        dist.send(torch.ones(9, dtype=torch.int32), dst=1)
    elif rank == 1:
        dist.recv(torch.empty(9, dtype=torch.int32), src=0)
    dist.barrier()
    # A functional collective, as DTensor issues it: an all-gather of the local [2, 3] shards.
    local = torch.ones(2, 3, dtype=torch.bfloat16)
    DTensor.from_local(local, mesh, [Shard(0)], run_check=False).full_tensor()


ALL_GATHER = torch_api.ALL_GATHER_SINGLE  # torch.distributed's name in the installed torch


def expected_records(world_size: int, rank: int) -> list[tuple]:
    """(kind, api, shapes, dtypes, numel, nbytes, out_nbytes, wire_bytes) per call, in order."""
    ws = world_size
    part = (ws - 1) / ws
    rows = [
        ("all_reduce", "dist.all_reduce", ((6,),), ("f32",), 6, 24, 24, int(2 * 24 * part)),
        ("all_gather", f"dist.{ALL_GATHER}", ((3,),), ("f32",), 3, 12, 12 * ws, 12 * (ws - 1)),
        ("all_gather", "dist.all_gather", ((5,),), ("f32",), 5, 20, 20 * ws, 20 * (ws - 1)),
        (
            "reduce_scatter",
            f"dist.{torch_api.REDUCE_SCATTER_SINGLE}",
            ((2 * ws,),),
            ("f32",),
            2 * ws,
            8 * ws,
            8,
            8 * (ws - 1),
        ),
        ("broadcast", "dist.broadcast", ((7,),), ("f64",), 7, 56, 56, 56),
        (
            "all_to_all",
            "dist.all_to_all_single",
            ((4 * ws,),),
            ("f32",),
            4 * ws,
            16 * ws,
            16 * ws,
            16 * (ws - 1),
        ),
    ]
    if rank == 0:
        rows.append(("send", "dist.send", ((9,),), ("i32",), 9, 36, 0, 36))
    elif rank == 1:
        rows.append(("recv", "dist.recv", (), (), 0, 0, 36, 0))
    rows.append(("barrier", "dist.barrier", (), (), 0, 0, 0, 0))
    rows.append(
        (
            "all_gather",
            "funcol.all_gather_into_tensor",
            ((2, 3),),
            ("bf16",),
            6,
            12,
            12 * ws,
            12 * (ws - 1),
        )
    )
    return rows


def observed_records(calls) -> list[tuple]:
    return [
        (c.kind, c.api, c.shapes, c.dtypes, c.numel, c.nbytes, c.out_nbytes, c.wire_bytes)
        for c in calls
    ]
