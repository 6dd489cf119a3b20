"""The fake device's stream checker, rule by rule, against what CUDA's stream semantics say.

Each test builds one ordering situation on the device with torch's public stream and event
API and states, from those semantics alone, whether a real accelerator would leave an access
unordered: a finding when it would, none when a wait, a synchronize or ``record_stream``
orders it. Every racy case has an ordered twin, so a checker that reports everything fails
as surely as one that reports nothing. Work on the fake device is synchronous: whatever is
found here is found from the order the program asked for, every time.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from distconform.harness.devices import current_stream_set, fakeaccel, stream_checker
from distconform.harness.rank.stream_safety import StreamSafetyError, describe, stream_safety

DEVICE = torch.device("fakeaccel", 0)
module = fakeaccel.module


@pytest.fixture
def checked() -> Iterator[Callable[[], list[dict]]]:
    """The checker on (from a clean state) for the test; call it for the findings so far."""
    module.stream_check(True)
    try:
        yield module.take_stream_findings
    finally:
        module.stream_check(False)


@pytest.fixture
def side() -> torch.Stream:
    return torch.Stream(device=DEVICE)


def current() -> torch.Stream:
    return torch.accelerator.current_stream(DEVICE)


def filled(side: torch.Stream, *shape: int) -> torch.Tensor:
    """Ones made on the default stream, which ``side`` then waits for: only what a test does
    next can be unordered."""
    tensor = torch.ones(*shape, device=DEVICE)
    side.wait_stream(current())
    return tensor


def kinds(findings: list[dict]) -> list[str]:
    return [finding["kind"] for finding in findings]


def test_the_fake_device_offers_the_checker_and_the_cpu_does_not():
    assert stream_checker("fakeaccel") is module
    assert stream_checker("cpu") is None


# --- read after write ----------------------------------------------------------------------------


def write_on(stream: torch.Stream, tensor: torch.Tensor) -> None:
    with current_stream_set(stream):
        tensor.mul_(2)


def test_a_read_of_another_streams_write_with_nothing_between_is_found(checked, side):
    data = filled(side, 256)
    write_on(side, data)
    data.sum()
    (finding,) = checked()
    assert finding["kind"] == "read"
    assert finding["access"]["stream"] == current().stream_id
    assert finding["earlier"]["stream"] == side.stream_id
    assert finding["earlier"]["op"].startswith("aten::mul")
    assert finding["bytes"] == 256 * 4


@pytest.mark.parametrize(
    "order",
    [
        lambda side: current().wait_stream(side),
        lambda side: current().wait_event(side.record_event()),
        lambda side: side.synchronize(),
        lambda side: side.record_event().synchronize(),
        lambda side: torch.accelerator.synchronize(DEVICE),
    ],
    ids=["wait_stream", "event_wait", "stream_synchronize", "event_synchronize", "device_sync"],
)
def test_each_synchronisation_orders_the_read(checked, side, order):
    data = filled(side, 256)
    write_on(side, data)
    order(side)
    data.sum()
    assert checked() == []


def test_a_wait_on_an_event_recorded_before_the_write_does_not_order_it(checked, side):
    """The stale event: recorded, then the write, then the wait on the old record."""
    data = filled(side, 64)
    stale = side.record_event()
    write_on(side, data)
    current().wait_event(stale)
    data.sum()
    assert kinds(checked()) == ["read"]


def test_the_same_stream_is_ordered_by_itself(checked, side):
    data = filled(side, 64)
    with current_stream_set(side):
        data.mul_(2)
        data.add_(1)
        data.sum()
    assert checked() == []


def test_a_view_is_its_bases_memory(checked, side):
    data = filled(side, 8, 8)
    with current_stream_set(side):
        data[2:4].fill_(3.0)
    data.t()[0].sum()
    assert kinds(checked()) == ["read"]


# --- writes after reads and writes ---------------------------------------------------------------


def test_overwriting_what_another_stream_reads_is_found_unless_ordered(checked, side):
    data = filled(side, 64)
    with current_stream_set(side):
        data.sum()
    data.zero_()
    assert kinds(checked()) == ["write-after-read"]
    side.wait_stream(current())
    with current_stream_set(side):
        data.sum()
    current().wait_stream(side)
    data.zero_()
    assert checked() == []


def test_two_streams_writing_one_tensor_is_found(checked, side):
    data = filled(side, 64)
    write_on(side, data)
    data.fill_(5.0)
    assert kinds(checked()) == ["write-after-write"]


# --- host synchronisation ------------------------------------------------------------------------


def test_a_result_brought_to_the_host_waited_for_its_stream(checked, side):
    data = filled(side, 64)
    with current_stream_set(side):
        data.mul_(2)
        data.sum().item()  # the host waits for the side stream, as .item() does on CUDA
    data.sum()
    assert checked() == []


def test_a_non_blocking_copy_to_the_host_does_not_wait(checked, side):
    data = filled(side, 64)
    with current_stream_set(side):
        data.mul_(2)
        data.to("cpu", non_blocking=True)
    data.sum()
    assert kinds(checked()) == ["read"]


# --- frees and reuse -----------------------------------------------------------------------------


def allocate_on(stream: torch.Stream, numel: int) -> torch.Tensor:
    with current_stream_set(stream):
        return torch.ones(numel, device=DEVICE)  # on the stream that allocates it


def test_memory_freed_while_another_stream_reads_it_is_found_when_reused(checked, side):
    """Allocated on the side stream, read on the default one, freed: the side stream may hand
    the memory out again before the read ran, and its next allocation is used at once."""
    data = allocate_on(side, 512)
    current().wait_stream(side)
    data.sum()  # read on the default stream
    del data  # freed back to the side stream, which is not ordered after the read
    assert checked() == []  # a free alone is no race: the reuse is
    allocate_on(side, 512)
    (finding,) = checked()
    assert finding["kind"] == "reuse"
    assert finding["access"]["stream"] == side.stream_id
    assert finding["earlier"]["stream"] == current().stream_id
    assert finding["freed"]["stack"], "the report says where the memory was freed"


@pytest.mark.parametrize(
    "keep_safe",
    [
        lambda data, side: data.record_stream(current()),
        lambda data, side: side.wait_stream(current()),
    ],
    ids=["record_stream", "owner_waits_before_the_free"],
)
def test_record_stream_or_a_wait_makes_the_reuse_safe(checked, side, keep_safe):
    data = allocate_on(side, 512)
    current().wait_stream(side)
    data.sum()
    keep_safe(data, side)
    del data
    allocate_on(side, 512)
    assert checked() == []


def test_the_owner_waiting_after_the_free_but_before_the_reuse_is_safe(checked, side):
    data = allocate_on(side, 512)
    current().wait_stream(side)
    data.sum()
    del data
    side.wait_stream(current())
    allocate_on(side, 512)
    assert checked() == []


# --- what the checker does not see, and what it reports ------------------------------------------


def test_paused_work_is_not_checked(checked, side):
    data = filled(side, 64)
    write_on(side, data)
    with module.stream_check_paused():
        data.sum()
    assert checked() == []


def test_a_kernel_recorded_by_hand_is_checked_like_any_other(checked, side):
    data = filled(side, 64)
    result = torch.empty(64, device=DEVICE)
    with current_stream_set(side):
        module.record_kernel("c10d::allreduce", [data], [result])
    result.sum()
    (finding,) = checked()
    assert finding["earlier"]["op"] == "c10d::allreduce"


def test_the_checker_is_off_unless_turned_on(side):
    data = filled(side, 64)
    write_on(side, data)
    data.sum()
    assert module.take_stream_findings() == []


def test_a_report_names_both_ops_both_streams_and_both_stacks(checked, side):
    data = filled(side, 256)
    write_on(side, data)
    data.sum()
    findings = checked()
    text = describe(findings, rank=3, device_type="fakeaccel")
    this_file = Path(__file__).name
    assert text.startswith("rank 3: 1 access(es)")
    assert f"stream {side.stream_id} of fakeaccel:0" in text
    assert "stream 0 (default) of fakeaccel:0" in text
    assert "aten::sum" in text and "aten::mul" in text
    # Both stacks end in this file: the write in write_on, the read in this test.
    assert f'{this_file}", line' in text
    assert "in write_on" in text
    assert "in test_a_report_names_both_ops_both_streams_and_both_stacks" in text


def test_repeats_of_one_race_are_folded_into_one_finding(checked, side):
    data = filled(side, 64)
    for _ in range(5):
        write_on(side, data)
        data.sum()
    (finding,) = [f for f in checked() if f["kind"] == "read"]
    assert finding["repeats"] == 4


# --- the verdict on a test body (harness/rank/stream_safety.py) ----------------------------------


def racy_body(side: torch.Stream) -> None:
    data = filled(side, 64)
    write_on(side, data)
    data.sum()


def test_a_racy_body_fails_with_the_findings_and_a_clean_one_passes(side):
    expected = pytest.raises(StreamSafetyError, match=r"rank 2: 1 access\(es\)")
    with expected as raised, stream_safety(True, DEVICE, rank=2):
        racy_body(side)
    assert [finding["kind"] for finding in raised.value.findings] == ["read"]
    with stream_safety(True, DEVICE, rank=2):
        data = filled(side, 64)
        write_on(side, data)
        current().wait_stream(side)
        data.sum()
    with stream_safety(False, DEVICE, rank=2):
        racy_body(side)  # not checked


def test_the_findings_come_before_the_bodys_own_failure(side):
    with pytest.raises(StreamSafetyError) as raised, stream_safety(True, DEVICE, rank=0):
        racy_body(side)
        raise ValueError("the loss differs")
    assert "the test body also failed: ValueError: the loss differs" in str(raised.value)
    assert isinstance(raised.value.__cause__, ValueError)


def test_a_skip_stays_a_skip_and_a_clean_failure_stays_itself(side):
    with pytest.raises(unittest.SkipTest), stream_safety(True, DEVICE, rank=0):
        racy_body(side)
        raise unittest.SkipTest("not on this device")
    with pytest.raises(ValueError, match="plain"), stream_safety(True, DEVICE, rank=0):
        raise ValueError("plain")
    assert module.take_stream_findings() == []  # the checker was left off and clean
