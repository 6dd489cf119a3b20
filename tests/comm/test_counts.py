"""Exact counts and bytes of every collective, per kind, group and phase, on every rank.

These are rank tests: the outer session runs them on processes (gloo);
test_thread_launcher.py runs this module again with ``--launcher thread``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distconform.harness import torch_api
from distconform.harness.comm import CommTracer
from tests.comm.ops import expected_records, issue_each_op, observed_records


@pytest.mark.world_size(2, 4)
def test_every_op_is_seen_once_with_its_exact_sizes(rank_ctx):
    ws, rank = rank_ctx.world_size, rank_ctx.rank
    mesh = rank_ctx.mesh(ws, ("dp",))
    with CommTracer(mesh=mesh) as trace:
        issue_each_op(ws, rank, mesh)
    assert observed_records(trace.calls) == expected_records(ws, rank)
    assert {c.group for c in trace.calls} == {"dp"}
    assert all(c.group_ranks == tuple(range(ws)) for c in trace.calls)
    assert [c.seq for c in trace.calls] == list(range(len(trace.calls)))
    # Sites name this test's helper module, never torch or the harness.
    assert all("tests/comm/ops.py:" in c.site for c in trace.calls), trace.calls
    totals = trace.totals("all_gather")
    gathered_in = 12 + 20 + 12  # f32[3], f32[5], bf16[2x3]
    assert (totals.calls, totals.nbytes, totals.out_nbytes) == (3, gathered_in, gathered_in * ws)
    assert trace.counts() == {
        "all_reduce": 1,
        "all_gather": 3,
        "reduce_scatter": 1,
        "broadcast": 1,
        "all_to_all": 1,
        "barrier": 1,
        **({"send": 1} if rank == 0 else {"recv": 1} if rank == 1 else {}),
    }


@pytest.mark.world_size(2, 4)
def test_counts_agree_with_comm_debug_mode_on_process_ranks(rank_ctx):
    if rank_ctx.launcher != "process":
        pytest.skip("CommDebugMode does not see the threaded backend's c10d ops")
    from torch.distributed.tensor.debug import CommDebugMode

    ws, rank = rank_ctx.world_size, rank_ctx.rank
    mesh = rank_ctx.mesh(ws, ("dp",))
    with CommDebugMode() as debug, CommTracer(mesh=mesh) as trace:
        issue_each_op(ws, rank, mesh)
    # CommDebugMode counts neither point-to-point calls nor barriers.
    ours = trace.count() - trace.count("send") - trace.count("recv") - trace.count("barrier")
    assert debug.get_total_counts() == ours == 7, (debug.get_comm_counts(), trace.calls)


def _hooked_step(mesh, world_size: int) -> None:
    """Forward all-gathers on dp, backward reduce-scatters on tp, the optimizer all-reduces."""
    model = torch.nn.Linear(4, 4)
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    tp_size = mesh.size(1)

    def gather_in_forward(module, args):
        torch_api.all_gather_single(torch.empty(4 * mesh.size(0)), torch.ones(4), group=dp)

    def scatter_in_backward(grad):
        torch_api.reduce_scatter_single(torch.empty(2), torch.ones(2 * tp_size), group=tp)
        return grad

    model.register_forward_pre_hook(gather_in_forward)
    model.weight.register_hook(scatter_in_backward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(lambda *a: dist.all_reduce(torch.ones(3)))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()


@pytest.mark.world_size(2, 4)
def test_phases_are_detected_and_groups_named_by_mesh_dim(rank_ctx):
    ws = rank_ctx.world_size
    mesh = rank_ctx.mesh((ws // 2, 2), ("dp", "tp"))
    with CommTracer(mesh=mesh) as trace:
        _hooked_step(mesh, ws)
    # At ws 2 the tp dim spans the world and DeviceMesh reuses the default group for it:
    # the mesh's name for a group wins over "world".
    world_label = "tp" if mesh.get_group("tp") is dist.group.WORLD else "world"
    counts = trace.counts("phase", "group", "kind")
    assert counts == {
        ("forward", "dp", "all_gather"): 1,
        ("backward", "tp", "reduce_scatter"): 1,
        ("optimizer", world_label, "all_reduce"): 1,
    }, counts
    # The reduce-scatter input is 2 * tp_size floats; a rank sends half of it in a tp of 2.
    assert trace.totals(phase="backward", group="tp").wire_bytes == 8, trace.calls


@pytest.mark.world_size(2)
def test_explicit_phases_override_detection_and_nest(rank_ctx):
    with CommTracer() as trace:
        with trace.phase("step"):
            dist.all_reduce(torch.ones(1))
            with trace.phase("warmup"):
                dist.all_reduce(torch.ones(1))
        dist.all_reduce(torch.ones(1))
    assert [c.phase for c in trace.calls] == ["step", "warmup", "-"]
    assert [c.group_seq for c in trace.calls] == [0, 1, 2]


class _GatherGradInBackward(torch.autograd.Function):
    """Identity forward; backward all-gathers the gradient through funcol, as DTensor does."""

    @staticmethod
    def forward(ctx, tensor, group_name):
        ctx.group_name = group_name
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        ws = dist.get_world_size()
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(grad, ws, ctx.group_name)
        torch.ops._c10d_functional.wait_tensor(gathered)
        return grad, None


@pytest.mark.world_size(2)
def test_functional_collectives_in_backward_are_seen(rank_ctx):
    # Issue 9: on process ranks a torch function mode is not active inside the autograd
    # engine, so these three were invisible there.
    from torch.distributed.tensor import DTensor, Shard

    mesh = rank_ctx.mesh(2, ("dp",))
    group_name = mesh.get_group(0).group_name
    weight = torch.ones(2, requires_grad=True)
    bias = torch.ones(3, requires_grad=True)

    def gather_in_tensor_hook(grad):
        DTensor.from_local(grad, mesh, [Shard(0)], run_check=False).full_tensor()
        return grad

    def reduce_after_accumulation(param):
        # What fully_shard does for a gradient once it is accumulated, in funcol form.
        out = torch.ops._c10d_functional.reduce_scatter_tensor.default(
            param.grad.repeat(2), "sum", 2, group_name
        )
        torch.ops._c10d_functional.wait_tensor(out)

    weight.register_hook(gather_in_tensor_hook)
    bias.register_post_accumulate_grad_hook(reduce_after_accumulation)
    # dispatch=True: the post-accumulate-grad hook calls an overload, which only the
    # dispatch mode sees; the other two come through the op packets.
    with CommTracer(mesh=mesh, dispatch=True) as trace:
        ((_GatherGradInBackward.apply(weight, group_name) * 2).sum() + bias.sum()).backward()
    seen = sorted((c.kind, c.group, c.phase, c.shapes) for c in trace.calls)
    assert seen == [
        ("all_gather", "dp", "backward", ((2,),)),  # the custom Function's backward
        ("all_gather", "dp", "backward", ((2,),)),  # DTensor.full_tensor in the tensor hook
        ("reduce_scatter", "dp", "backward", ((6,),)),  # the post-accumulate-grad hook
    ], trace.calls
    assert all(c.api.startswith("funcol.") for c in trace.calls), trace.calls
