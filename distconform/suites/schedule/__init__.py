"""Wire-level checks: the collectives of each step against FSDP2's schedule.

A conformance verdict on numerics alone can be earned by an implementation that issues the
wrong collectives (prefetching ignored, a reduce dtype ignored, an int
``reshard_after_forward`` gathering over the whole group): losses and gradients stay exact.
This package checks what goes on the wire, per rank and per step, against a schedule it
computes itself from FSDP2's documented semantics.

Reading order: ``layout.py`` (elements per rank of a group's collectives), ``plan.py`` (the
groups a suite made and the flags it set, recorded as it shards through the implementation),
``oracle.py`` (the rules: which collective, over which ranks, in which dtype, between which
module events), ``observe.py`` (the module events, from hooks the suite owns),
``check.py`` (matching the trace to the oracle, and the failure message), ``recorder.py``
(one step recorded and checked).
"""

from distconform.suites.schedule.check import ScheduleMismatch
from distconform.suites.schedule.plan import GroupControls, ShardingPlan
from distconform.suites.schedule.recorder import ScheduleRecorder

__all__ = ["GroupControls", "ScheduleMismatch", "ScheduleRecorder", "ShardingPlan"]
