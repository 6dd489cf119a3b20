"""``set_custom_all_gather`` and ``set_custom_reduce_scatter``: a user's collectives in place of
the implementation's own.

FSDP2's ``Comm`` interface gives a custom collective two parts: ``allocate(size, dtype=,
device=)`` makes the buffers it communicates in, and the call runs it (``output_tensor``,
``input_tensor``, ``group``, ``async_op``, and ``op`` for the reduce-scatter). The comms here do
the real collective on the group they are handed and then scale their output, so an
implementation that never calls them, calls them and keeps its own result, or runs some of its
gathers without them computes other numbers; and they record each call, so the group, the sizes
and the buffers' origin are checked as well. The oracle is the plain model with its weights
scaled as the custom all-gather scales them, its gradients averaged over the ranks and scaled
as the custom reduce-scatter scales them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from distconform.api import assert_sharded_parity, padded_numel, torch_api
from distconform.suites.cases import conformance, grid
from distconform.suites.training import sharded_mlp_stack

#: What the custom all-gather multiplies the gathered parameters by.
GATHER_SCALE = 2.0
#: What the custom reduce-scatter multiplies the reduced gradients by.
REDUCE_SCALE = 3.0


@dataclass(frozen=True)
class CommCall:
    """One call of a custom collective, as the collective saw it."""

    output_numel: int
    input_numel: int
    dtype: torch.dtype
    ranks: tuple[int, ...]
    output_allocated: bool
    #: ``None`` for the all-gather: FSDP2 gathers in place (its input a slice of the output),
    #: which the interface allows but does not promise.
    input_allocated: bool | None


class RecordingComm:
    """``allocate`` hands out plain tensors and remembers them; calls are recorded."""

    def __init__(self) -> None:
        self.allocated: list[torch.Tensor] = []
        self.calls: list[CommCall] = []

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        tensor = torch.empty(size, dtype=dtype, device=device)
        self.allocated.append(tensor)
        return tensor

    def _from_allocate(self, tensor: torch.Tensor) -> bool:
        # A view of an allocated buffer counts (FSDP2 gathers in place, its input a slice).
        storage = tensor.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == storage for t in self.allocated)

    def _record(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        input_checked: bool,
    ) -> None:
        self.calls.append(
            CommCall(
                output_numel=output.numel(),
                input_numel=input.numel(),
                dtype=output.dtype,
                ranks=tuple(dist.get_process_group_ranks(group)),
                output_allocated=self._from_allocate(output),
                input_allocated=self._from_allocate(input) if input_checked else None,
            )
        )


class ScalingAllGather(RecordingComm):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        self._record(output_tensor, input_tensor, group, input_checked=False)
        torch_api.all_gather_single(output_tensor, input_tensor, group=group)
        output_tensor.mul_(GATHER_SCALE)
        return None


class ScalingReduceScatter(RecordingComm):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        self._record(output_tensor, input_tensor, group, input_checked=True)
        torch_api.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
        output_tensor.mul_(REDUCE_SCALE)
        return None


def _problems_with_calls(
    what: str, calls: list[CommCall], expected: CommCall, times: int
) -> list[str]:
    if len(calls) != times:
        return [f"{what} ran {len(calls)} times; expected {times} (calls: {calls})"]
    return [
        f"{what}, call {index}: {call}; expected {expected}"
        for index, call in enumerate(calls)
        if call != expected
    ]


@conformance("fsdp.custom_comms")
@pytest.mark.parametrize("point", grid(mesh=["1d", "hsdp"]))
def test_custom_collectives_replace_the_implementations(rank_ctx, impl, point):
    """Each MLP gets its own custom all-gather and reduce-scatter. In one step (forward and
    backward, the MLPs resharding after forward) the all-gather runs twice per MLP and the
    reduce-scatter once, on the shard group, with buffers from their ``allocate`` and the sizes
    of the MLP's padded shard; the gathered weights the step computes with, and the gradients
    it keeps, are the ones the comms produced; the sharded parameters are left as they were.
    Fails on ``tests.suites.broken:ignore_custom_all_gather`` and
    ``custom_all_gather_output_discarded`` (calls the comm, then gathers over its output):
    "forward with the custom all-gather's weights: Tensor-likes are not close!"; on
    ``ignore_custom_reduce_scatter``: "custom reduce-scatter of MLP 0 ran 0 times; expected
    1"."""
    world = rank_ctx.world_size
    if point["mesh"] == "hsdp":
        mesh = rank_ctx.mesh((world // 2, 2), ("rep", "shard"))
    else:
        mesh = rank_ctx.mesh((world,))
    shard_group = mesh.get_group(mesh.ndim - 1)
    shard_ranks = tuple(dist.get_process_group_ranks(shard_group))
    shard = len(shard_ranks)
    model, reference = sharded_mlp_stack(
        impl, rank_ctx.device, mesh=mesh, reshard_after_forward=True
    )
    scaled = copy.deepcopy(reference)
    with torch.no_grad():
        for param in scaled.parameters():
            param.mul_(GATHER_SCALE)
    gathers = [ScalingAllGather() for _ in model]
    scatters = [ScalingReduceScatter() for _ in model]
    for mlp, gather, scatter in zip(model, gathers, scatters, strict=True):
        mlp.set_custom_all_gather(gather)
        mlp.set_custom_reduce_scatter(scatter)

    torch.manual_seed(42 + rank_ctx.rank + 1)
    inp = torch.randn(4, 8, device=rank_ctx.device)
    out = model(inp)
    expected_out = scaled(inp)
    torch.testing.assert_close(
        out, expected_out, msg=lambda m: f"forward with the custom all-gather's weights: {m}"
    )
    out.sum().backward()
    expected_out.sum().backward()

    problems: list[str] = []
    for index, mlp in enumerate(reference):
        shard_numel = sum(padded_numel(p.shape, shard) for p in mlp.parameters()) // shard
        problems += _problems_with_calls(
            f"custom all-gather of MLP {index}",
            gathers[index].calls,
            CommCall(shard * shard_numel, shard_numel, torch.float32, shard_ranks, True, None),
            times=2,
        )
        problems += _problems_with_calls(
            f"custom reduce-scatter of MLP {index}",
            scatters[index].calls,
            CommCall(shard_numel, shard * shard_numel, torch.float32, shard_ranks, True, True),
            times=1,
        )
    assert not problems, "\n".join(problems)

    for param, scaled_param in zip(reference.parameters(), scaled.parameters(), strict=True):
        dist.all_reduce(scaled_param.grad)
        param.grad = scaled_param.grad * (REDUCE_SCALE / world)
    assert_sharded_parity(reference, model)
