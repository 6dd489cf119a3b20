"""Collective instrumentation: count, trace, compare, schedule and perturb collectives.

    with CommTracer(mesh=mesh) as trace:            # on every rank
        with trace.phase("forward"): ...
        trace.mark("layers.0")                      # a line in the schedule
    trace.count("all_gather", group="dp", phase="forward") / trace.totals(...) / trace.counts(...)
    assert_schedule(trace, '''...''')               # expecttest inline; rank 0 rewrites
    find_divergence({rank: calls}) -> Divergence | None
    with delay_collectives(0.05, kinds=("all_gather",), ranks=(1,)): ...
    with wrap_collectives(fn, kinds=..., ranks=...): ...      # fn(call: RawCall, proceed)
    min_bytes_per_rank(groups, shard_size=..., replicate_size=...) -> MinBytes

Process ranks also keep an always-on trace (``flight``) that the parent reads after a
hang or failure to name the first divergent collective in the report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distconform._lazy import lazy_exports

if TYPE_CHECKING:
    from distconform.harness.comm.divergence import Divergence, find_divergence
    from distconform.harness.comm.inject import (
        busy_wait,
        delay_collectives,
        device_sleep,
        wrap_collectives,
    )
    from distconform.harness.comm.min_bytes import MinBytes, min_bytes_per_rank, padded_numel
    from distconform.harness.comm.records import CollectiveCall, RawCall
    from distconform.harness.comm.schedule import assert_schedule
    from distconform.harness.comm.tracer import (
        CommTotals,
        CommTracer,
        format_schedule,
        mesh_group_labels,
    )

# Loaded on first use: the interception modules import DTensor (a second of CPU), which
# the pytest process must not pay just to read the flight traces of a failed test.
_HOMES = {
    "CollectiveCall": "records",
    "CommTotals": "tracer",
    "CommTracer": "tracer",
    "Divergence": "divergence",
    "MinBytes": "min_bytes",
    "RawCall": "records",
    "assert_schedule": "schedule",
    "busy_wait": "inject",
    "delay_collectives": "inject",
    "device_sleep": "inject",
    "find_divergence": "divergence",
    "format_schedule": "tracer",
    "mesh_group_labels": "tracer",
    "min_bytes_per_rank": "min_bytes",
    "padded_numel": "min_bytes",
    "wrap_collectives": "inject",
}

__all__ = [
    "CollectiveCall",
    "CommTotals",
    "CommTracer",
    "Divergence",
    "MinBytes",
    "RawCall",
    "assert_schedule",
    "busy_wait",
    "delay_collectives",
    "device_sleep",
    "find_divergence",
    "format_schedule",
    "mesh_group_labels",
    "min_bytes_per_rank",
    "padded_numel",
    "wrap_collectives",
]


__getattr__, __dir__ = lazy_exports(
    __name__, {name: f"{__name__}.{home}" for name, home in _HOMES.items()}, globals()
)
