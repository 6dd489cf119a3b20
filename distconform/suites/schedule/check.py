"""Hold one rank's traced collectives against the oracle's expected calls.

Matching is by signature (kind, ranks, dtype, elements per rank): the k-th expected call
of a signature is the k-th traced call of it. Then every matched call must lie in its
window (between the events the oracle named) and every block must keep its order. A
failure lists each problem with the reason the oracle had for the call, then both
schedules with the module events between the calls.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from distconform.api import CollectiveCall, format_schedule
from distconform.suites.schedule.oracle import Event, ExpectedCall


class ScheduleMismatch(AssertionError):
    """The collectives of a step differ from FSDP2's schedule for the plan."""


def signature(call: CollectiveCall) -> tuple[str, tuple[int, ...], str, int]:
    dtype = call.dtypes[0] if len(set(call.dtypes)) == 1 else ",".join(call.dtypes)
    return (call.kind, tuple(call.group_ranks), dtype, call.numel)


def describe(call: CollectiveCall) -> str:
    op = f" op={call.op}" if call.op else ""
    return (
        f"{call.kind} {call.tensors_text()} over ranks {list(call.group_ranks)}{op} "
        f"(#{call.seq}, {call.api} at {call.site})"
    )


@dataclass(frozen=True)
class StepRecord:
    """What one rank saw in a step: the calls, the events, and where each event fell."""

    calls: Sequence[CollectiveCall]
    events: Sequence[Event]
    positions: Sequence[int]  # positions[i]: calls issued before event i

    def where(self, call_index: int) -> str:
        after = [i for i, p in enumerate(self.positions) if p <= call_index]
        if not after:
            return "before the first module event"
        return f"after `{self.events[after[-1]].label()}`"

    def event_label(self, index: int | None) -> str:
        if index is None or index >= len(self.events):
            return "the end of the step"
        return f"`{self.events[index].label()}`"

    def position(self, index: int | None) -> float:
        if index is None or index >= len(self.positions):
            return float("inf")
        return self.positions[index]


def mismatches(expected: Sequence[ExpectedCall], record: StepRecord) -> list[str]:
    """Every way ``record`` departs from ``expected``; empty when it conforms."""
    unmatched: dict[tuple, deque[int]] = defaultdict(deque)
    for index, call in enumerate(record.calls):
        unmatched[signature(call)].append(index)
    problems: list[str] = []
    matched: list[tuple[ExpectedCall, int]] = []
    for call in expected:
        queue = unmatched.get(call.signature)
        if queue:
            matched.append((call, queue.popleft()))
        else:
            problems.append(
                f"missing: {call.describe()}, due after {record.event_label(call.after)} and "
                f"before {record.event_label(call.before)}"
            )
    for queue in unmatched.values():
        for index in queue:
            call = record.calls[index]
            problems.append(f"unexpected: {describe(call)}, {record.where(index)}")
    for call, index in matched:
        if not record.position(call.after) <= index < record.position(call.before):
            problems.append(
                f"out of place: {call.describe()} is due after {record.event_label(call.after)} "
                f"and before {record.event_label(call.before)}; it was issued "
                f"{record.where(index)}"
            )
        actual_op = record.calls[index].op
        if call.op is not None and actual_op != call.op:
            problems.append(f"wrong reduce op: {call.describe()} was issued with op={actual_op}")
    blocks: dict[int, list[tuple[ExpectedCall, int]]] = defaultdict(list)
    for call, index in matched:
        blocks[call.block].append((call, index))
    for members in blocks.values():
        issued = [index for _, index in members]
        if issued != sorted(issued):
            in_order = "; ".join(call.describe() for call, _ in members)
            actual = "; ".join(describe(record.calls[i]) for i in sorted(issued))
            problems.append(f"out of order: expected {in_order}, issued {actual}")
    return problems


def expected_schedule(expected: Sequence[ExpectedCall], record: StepRecord) -> str:
    """The oracle's calls under the event each is due after."""
    lines = []
    due_after: dict[int, list[ExpectedCall]] = defaultdict(list)
    for call in expected:
        due_after[call.after].append(call)
    for index, event in enumerate(record.events):
        lines.append(f"== {event.label()}")
        for call in due_after.get(index, ()):
            until = "" if call.before == index + 1 else f"  (by {record.event_label(call.before)})"
            lines.append(f"   {call.describe()}{until}")
    return "\n".join(lines)


def assert_schedule_conforms(
    expected: Sequence[ExpectedCall], record: StepRecord, context: str
) -> None:
    problems = mismatches(expected, record)
    if not problems:
        return
    marks = [(p, event.label()) for p, event in zip(record.positions, record.events, strict=True)]
    actual = format_schedule(list(record.calls), with_phase=False, marks=marks)
    raise ScheduleMismatch(
        f"{context}: the collectives differ from FSDP2's schedule for this sharding plan "
        f"(suites/schedule/oracle.py):\n"
        + "".join(f"  - {p}\n" for p in problems)
        + "expected (oracle):\n"
        + expected_schedule(expected, record)
        + "\nissued (this rank):\n"
        + actual
    )
