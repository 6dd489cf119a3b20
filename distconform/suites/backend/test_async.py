"""Asynchronous work and coalesced calls.

A work handle must not report completion before every rank has joined: the check holds the
last rank back (on a barrier of a separate group) until every other rank has issued its
all_reduces and inspected their handles, so a backend whose work completes early is caught
by ``is_completed()`` or by the data read after ``wait()``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from distconform.suites.backend.collectives import dtype_grid, everyones
from distconform.suites.backend.oracle import Findings, reduce, unlike
from distconform.suites.cases import conformance


@conformance("backend.async_work")
def test_async_work_completes_only_when_every_rank_has_joined(rank_ctx) -> None:
    findings = Findings("async work")
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    last = world - 1
    # The last rank is released on a group of its own: on the default group it would have to
    # join the others' pending all_reduces first.
    # On an accelerator the release goes through gloo: NCCL would see the two groups'
    # calls in different orders on different ranks, which it may deadlock on.
    release = dist.new_group(backend=None if rank_ctx.device_type == "cpu" else "gloo")
    inputs = [everyones(37, "float32", op="sum", salt=s, device=device) for s in range(3)]
    tensors = [batch[rank].clone() for batch in inputs]
    if rank != last:
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        if any(work.is_completed() for work in works):
            findings.note(f"is_completed() was True before rank {last} joined the all_reduce")
        futures = [work.get_future() for work in works]
        dist.barrier(group=release)
    else:
        dist.barrier(group=release)  # the others have issued and inspected their works
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        futures = [work.get_future() for work in works]
    for work in reversed(works):  # waiting out of order must still give each its result
        work.wait()
    for i, (work, future, tensor) in enumerate(zip(works, futures, tensors, strict=True)):
        expected = reduce(inputs[i], "sum")
        findings.expect_equal(tensor, expected, f"work {i} after wait()")
        if not work.is_completed():
            findings.note(f"work {i}: is_completed() is False after wait()")
        value = future.wait()
        result = value[0] if isinstance(value, list | tuple) else value
        findings.expect_equal(result, expected, f"work {i}'s future value")
    findings.raise_if_any()


@conformance("backend.coalesced")
@pytest.mark.parametrize("dtype", dtype_grid(("float32", "bfloat16", "int64")))
def test_coalesced_calls(dtype: str, rank_ctx) -> None:
    """The ProcessGroup's coalesced entry points (what FSDP2 issues for several parameters at
    once): each tensor of the batch gets its own right result."""
    findings = Findings(f"coalesced {dtype}")
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    group = rank_ctx.group
    sizes = (1, 37, 8)
    batches = [everyones(n, dtype, op="sum", salt=i, device=device) for i, n in enumerate(sizes)]

    tensors = [batch[rank].clone() for batch in batches]
    group.allreduce_coalesced(tensors, dist.AllreduceCoalescedOptions()).wait()
    for i, tensor in enumerate(tensors):
        findings.expect_equal(tensor, reduce(batches[i], "sum"), f"allreduce_coalesced #{i}")

    outputs = [unlike(torch.cat(batch)) for batch in batches]
    group.allgather_into_tensor_coalesced(
        outputs, [batch[rank].clone() for batch in batches]
    ).wait()
    for i, output in enumerate(outputs):
        findings.expect_equal(
            output, torch.cat(batches[i]), f"allgather_into_tensor_coalesced #{i}"
        )

    wide = [
        everyones(n * world, dtype, op="sum", salt=i, device=device) for i, n in enumerate(sizes)
    ]
    expected = [
        reduce([b[rank * n : (rank + 1) * n] for b in wide[i]], "sum") for i, n in enumerate(sizes)
    ]
    outputs = [unlike(e, device) for e in expected]
    options = dist.ReduceScatterOptions()
    group.reduce_scatter_tensor_coalesced(outputs, [b[rank].clone() for b in wide], options).wait()
    for i, output in enumerate(outputs):
        findings.expect_equal(output, expected[i], f"reduce_scatter_tensor_coalesced #{i}")

    findings.raise_if_any()


@conformance("backend.deprecated_coalesced")
@pytest.mark.parametrize("dtype", dtype_grid(("float32", "int64")))
def test_deprecated_coalesced_spellings(dtype: str, rank_ctx) -> None:
    """``dist.all_reduce_coalesced`` and ``dist.all_gather_coalesced``, deprecated but public,
    forward to the group's ``allreduce_coalesced`` and ``allgather_coalesced``: each tensor of
    the batch gets its own right result."""
    findings = Findings(f"deprecated coalesced {dtype}")
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    group = rank_ctx.group
    batches = [
        everyones(n, dtype, op="sum", salt=i, device=device) for i, n in enumerate((1, 37, 8))
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # their deprecation notices
        tensors = [batch[rank].clone() for batch in batches]
        dist.all_reduce_coalesced(tensors, group=group)
        # One list per rank, of that rank's part of every tensor of the batch.
        gathered = [[unlike(batch[r]) for batch in batches] for r in range(world)]
        dist.all_gather_coalesced(gathered, [batch[rank].clone() for batch in batches], group)
    for i, tensor in enumerate(tensors):
        findings.expect_equal(tensor, reduce(batches[i], "sum"), f"dist.all_reduce_coalesced #{i}")
    for r, outputs_of_rank in enumerate(gathered):
        for i, output in enumerate(outputs_of_rank):
            findings.expect_equal(
                output, batches[i][r], f"dist.all_gather_coalesced #{i}, rank {r}'s part"
            )
    findings.raise_if_any()
