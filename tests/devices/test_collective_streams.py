"""Collectives on the fake device keep NCCL's stream semantics, rule by rule.

torch documents them for NCCL process groups (``torch.distributed`` "CUDA semantics"): a
collective waits for the current stream when it is issued, runs on the group's own stream,
``Work.wait()`` makes the *current* stream wait for it, and a blocking call does that wait
itself. ``staged_gloo`` imitates them on any device with streams
(``harness/backends/staged_gloo.py``); on the fake device its collectives are reported to
the stream checker, so each rule is observable as a finding or its absence. Every rule is
checked with a program that keeps it (no finding) and, where the rule can be broken by the
caller, one that breaks it (the finding the rule predicts).
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from distconform.harness.controller.run_function import run_on_ranks
from distconform.harness.devices import current_stream_set
from distconform.harness.shared.backend_plugins import ENV_VAR

Finding = tuple[str, str, str, bool]  # kind, this op, the earlier op, earlier on this stream


def _findings_of(body: Callable[[torch.device], None]) -> list[Finding]:
    device = torch.device("fakeaccel", torch.accelerator.current_device_index())
    checker = torch.get_device_module("fakeaccel")
    checker.stream_check(True)
    try:
        body(device)
        found = checker.take_stream_findings()
    finally:
        checker.stream_check(False)
    current = torch.accelerator.current_stream(device).stream_id
    return [
        (f["kind"], f["access"]["op"], f["earlier"]["op"], f["earlier"]["stream"] == current)
        for f in found
    ]


def _issued_after_current_stream_write(device: torch.device) -> None:
    data = torch.ones(64, device=device)
    data.mul_(2)  # on the current stream, just before the collective reads it
    dist.all_reduce(data)
    data.sum()


def _issued_after_side_stream_write(device: torch.device) -> None:
    side = torch.Stream(device=device)
    data = torch.ones(64, device=device)
    side.wait_stream(torch.accelerator.current_stream(device))
    with current_stream_set(side):
        data.mul_(2)  # the current stream never waits for this
    dist.all_reduce(data)


def _read_without_wait(device: torch.device) -> None:
    data = torch.ones(64, device=device)
    work = dist.all_reduce(data, async_op=True)
    data.sum()  # the missing wait()
    work.wait()


def _read_after_wait(device: torch.device) -> None:
    data = torch.ones(64, device=device)
    work = dist.all_reduce(data, async_op=True)
    work.wait()
    data.sum()


def _waited_on_another_stream(device: torch.device) -> None:
    data = torch.ones(64, device=device)
    work = dist.all_reduce(data, async_op=True)
    side = torch.Stream(device=device)
    with current_stream_set(side):
        work.wait()  # orders the side stream, which is current here
    data.sum()  # on the default stream, which waited for nothing


def _all_gather_read_after_blocking_call(device: torch.device) -> None:
    shard = torch.full((4,), float(dist.get_rank()), device=device)
    gathered = torch.empty(4 * dist.get_world_size(), device=device)
    dist.all_gather_into_tensor(gathered, shard)
    gathered.sum()


def rules_on_a_rank() -> dict[str, list[Finding]]:
    return {
        name: _findings_of(body)
        for name, body in {
            "issued after a current-stream write": _issued_after_current_stream_write,
            "issued after a side-stream write": _issued_after_side_stream_write,
            "read without wait": _read_without_wait,
            "read after wait": _read_after_wait,
            "waited on another stream": _waited_on_another_stream,
            "blocking all-gather": _all_gather_read_after_blocking_call,
        }.items()
    }


def work_holds_its_tensors_until_waited() -> tuple[bool, bool]:
    device = torch.device("fakeaccel", torch.accelerator.current_device_index())
    data = torch.ones(64, device=device)
    alive = weakref.ref(data)
    work = dist.all_reduce(data, async_op=True)
    del data
    gc.collect()
    held_before_wait = alive() is not None
    work.wait()
    del work  # its result() still names the tensor while it lives, as NCCL's does
    gc.collect()
    return held_before_wait, alive() is None


@pytest.fixture(scope="module")
def rules() -> list[dict[str, list[Finding]]]:
    published = os.environ.get(ENV_VAR)
    results = run_on_ranks(
        rules_on_a_rank, 2, device="fakeaccel", backend="staged_gloo", stream_check=False
    )
    # The fake device was published to these ranks only: every later child process of this
    # session (other pools, child sessions) must start without it.
    assert os.environ.get(ENV_VAR) == published
    return results


def test_a_collective_waits_for_the_current_stream_when_issued(rules):
    for rank in rules:
        assert rank["issued after a current-stream write"] == []


def test_it_waits_for_nothing_else(rules):
    for rank in rules:
        ((kind, op, earlier, earlier_here),) = rank["issued after a side-stream write"]
        assert (kind, op) == ("write-after-write", "c10d::allreduce")
        assert earlier.startswith("aten::mul") and not earlier_here


def test_its_outputs_are_written_on_the_groups_stream_so_a_missing_wait_is_found(rules):
    for rank in rules:
        ((kind, op, earlier, earlier_here),) = rank["read without wait"]
        assert (kind, earlier) == ("read", "c10d::allreduce")
        assert op.startswith("aten::sum")
        assert not earlier_here, "the collective wrote on the group's stream, not the current"


def test_wait_makes_the_current_stream_wait(rules):
    for rank in rules:
        assert rank["read after wait"] == []


def test_wait_orders_only_the_stream_current_at_the_wait(rules):
    for rank in rules:
        assert [f[:3] for f in rank["waited on another stream"]] == [
            ("read", "aten::sum.IntList_out", "c10d::allreduce")
        ]


def test_a_blocking_call_waits_by_itself(rules):
    for rank in rules:
        assert rank["blocking all-gather"] == []


def test_the_work_holds_its_tensors_until_it_is_waited_for():
    results = run_on_ranks(
        work_holds_its_tensors_until_waited,
        2,
        device="fakeaccel",
        backend="staged_gloo",
        stream_check=False,
    )
    assert results == [(True, True), (True, True)]
