"""What the always-on flight recorder sees: point-to-point and functional collectives too.

Rank tests; test_thread_launcher.py runs this module again with ``--launcher thread``.
The recorder takes only the cheap interception paths (no torch function or dispatch mode),
so these calls reach it through ``ProcessGroup``'s send/recv and the functional ops' packets.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from distconform.harness.comm.flight import FlightRecorder
from distconform.harness.comm.flight_files import read_rank_trace


class _ReduceGradInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group_name):
        ctx.group_name = group_name
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        reduced = torch.ops._c10d_functional.all_reduce(grad, "sum", ctx.group_name)
        return torch.ops._c10d_functional.wait_tensor(reduced), None


def _point_to_point(rank: int) -> None:
    peer = 1 - rank
    sent, received = torch.full((3,), float(rank)), torch.empty(3)
    if rank == 0:
        requests = [dist.isend(sent, peer), dist.irecv(received, peer)]
    else:
        requests = [dist.irecv(received, peer), dist.isend(sent, peer)]
    for request in requests:
        request.wait()
    assert received.tolist() == [float(peer)] * 3
    ops = [dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, received, peer)]
    for request in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
        request.wait()


@pytest.mark.world_size(2)
def test_the_recorder_sees_point_to_point_and_functional_collectives(rank_ctx):
    from torch.distributed.tensor import DTensor, Shard

    rank = rank_ctx.rank
    mesh = rank_ctx.mesh(2, ("dp",))
    group_name = mesh.get_group(0).group_name
    weight = torch.ones(2, requires_grad=True)
    with tempfile.TemporaryDirectory() as directory:
        with FlightRecorder(directory, rank=rank, task_id=1):
            _point_to_point(rank)
            DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False).full_tensor()
            (_ReduceGradInBackward.apply(weight, group_name) * 2).sum().backward()
        calls = read_rank_trace(directory, rank)
    if rank_ctx.launcher == "thread":
        # The threaded backend's groups have their own send/recv; its listener reports them.
        send_api, recv_api, peer = "threaded.send", "threaded.recv", None
    else:
        send_api, recv_api, peer = "ProcessGroup.send", "ProcessGroup.recv", 1 - rank
    send = ("send", send_api, peer, ((3,),), 0)  # sends contribute their tensor
    recv = ("recv", recv_api, peer, (), 3)  # receives fill theirs
    recorded = [(c.kind, c.api, c.peer, c.shapes, c.out_numel) for c in calls]
    # isend/irecv, then batch_isend_irecv (which goes through isend/irecv too).
    assert recorded[:4] == ([send, recv] if rank == 0 else [recv, send]) * 2, recorded
    assert recorded[4:] == [
        ("all_gather", "funcol.all_gather_into_tensor", None, ((2,),), 4),  # full_tensor
        ("all_reduce", "funcol.all_reduce", None, ((2,),), 2),  # in backward
    ], recorded
    assert [c.phase for c in calls[4:]] == ["-", "backward"]
    assert weight.grad.tolist() == [4.0, 4.0]
