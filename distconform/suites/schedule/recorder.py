"""Record a step's collectives and module events, and check them against the oracle.

    plan = ShardingPlan(impl, mesh=mesh)
    for block in model.layers:
        plan.fully_shard(block)
    plan.fully_shard(model)
    recorder = ScheduleRecorder(plan, model)
    for step in range(steps):
        with recorder.step(f"step {step}"):
            model(inp).sum().backward()          # checked when the block exits

Events that happen outside a recorded step (a forward for evaluation, an explicit
``unshard()``) still move the oracle's idea of what each group holds, so the next step is
judged from the right state; their collectives are not checked.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from torch import nn

from distconform.api import CollectiveCall, CommTracer
from distconform.suites.schedule import observe
from distconform.suites.schedule.check import StepRecord, assert_schedule_conforms
from distconform.suites.schedule.oracle import FLAG, RESHARD, UNSHARD, Event, Oracle
from distconform.suites.schedule.plan import GroupPlan, ShardingPlan

_CONTROL_CODES = {"flag": FLAG, "unshard": UNSHARD, "reshard": RESHARD}


class ScheduleRecorder:
    """Module events and collectives of ``model`` (the plan's root), checked step by step."""

    def __init__(self, plan: ShardingPlan, model: nn.Module) -> None:
        plan.name_groups(model)
        self.plan = plan
        self.oracle = Oracle(plan)
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._positions: list[int] = []
        self._trace: CommTracer | None = None
        self._own_calls: list[tuple[int, int]] = []  # [start, end) of the suite's own traffic
        self._handles = observe.install(plan, self._on_module_event)
        plan.add_listener(self._on_control)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.plan.remove_listener(self._on_control)

    def _record(self, event: Event) -> None:
        # Backward hooks may run on an autograd device thread on accelerators.
        with self._lock:
            self._positions.append(len(self._trace.calls) if self._trace is not None else 0)
            self._events.append(event)

    def _on_module_event(self, code: str, group: GroupPlan, module: int) -> None:
        self._record(Event(code, group, module))

    def _on_control(self, what: str, group: GroupPlan, values: dict[str, Any]) -> None:
        self._record(Event(_CONTROL_CODES[what], group, 0, dict(values)))

    def _take_events(self) -> tuple[list[Event], list[int]]:
        with self._lock:
            events, positions = self._events, self._positions
            self._events, self._positions = [], []
        return events, positions

    @contextlib.contextmanager
    def suite_traffic(self) -> Iterator[None]:
        """Collectives the suite itself issues inside a step (a barrier that orders ranks):
        left out of the check."""
        start = len(self._trace.calls) if self._trace is not None else 0
        try:
            yield
        finally:
            if self._trace is not None:
                self._own_calls.append((start, len(self._trace.calls)))

    def _without_own_calls(
        self, calls: list[CollectiveCall], positions: list[int]
    ) -> tuple[list[CollectiveCall], list[int]]:
        own = {i for start, end in self._own_calls for i in range(start, end)}
        self._own_calls = []
        kept = [call for i, call in enumerate(calls) if i not in own]
        moved = [p - sum(1 for i in own if i < p) for p in positions]
        return kept, moved

    @contextlib.contextmanager
    def step(self, context: str) -> Iterator[CommTracer]:
        """Trace the block; on exit, its collectives must be what FSDP2 issues for it."""
        # What happened since the last step changes what the groups hold, unchecked.
        self.oracle.expected(self._take_events()[0])
        # The wrapped torch.distributed functions are what FSDP2-style implementations call;
        # no torch function mode then sits under every tensor op of the step.
        trace = CommTracer(functional=False)
        with trace:
            self._trace = trace
            try:
                yield trace
            finally:
                self._trace = None
        events, positions = self._take_events()
        expected = self.oracle.expected(events)
        self.oracle.end_step()
        calls, positions = self._without_own_calls(list(trace.calls), positions)
        record = StepRecord(calls, events, positions)
        assert_schedule_conforms(expected, record, context)
