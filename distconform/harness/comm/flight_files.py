"""The flight recorder's trace files: where they live, and the parent reading them back.

Kept apart from the recorder (harness/comm/flight.py), which runs in the ranks and needs the
interception machinery: the pytest process only reads the files after a failure, and must
not import DTensor for that.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from distconform.harness.comm.divergence import find_divergence
from distconform.harness.comm.records import CollectiveCall

FLIGHT_ENV = "DISTCONFORM_COMM_FLIGHT"
RING_HALF = 2000


@functools.lru_cache(maxsize=64)  # asked at every task's start: building paths costs 40 us
def trace_paths(directory: str | os.PathLike[str], rank: int) -> tuple[Path, Path]:
    base = Path(directory)
    return base / f"comm-rank{rank}.0.jsonl", base / f"comm-rank{rank}.1.jsonl"


def enabled() -> bool:
    return os.environ.get(FLIGHT_ENV, "1") not in ("0", "off", "false", "")


def read_rank_trace(directory: str | os.PathLike[str], rank: int) -> list[CollectiveCall]:
    """One rank's recorded calls, oldest first (a line cut short by a kill is dropped)."""
    calls = []
    for path in trace_paths(directory, rank):
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for line in lines[1:]:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                calls.append(CollectiveCall.from_json(json.loads(line)))
    return sorted(calls, key=lambda c: c.seq)


def read_traces(
    directory: str | os.PathLike[str] | None, world_size: int
) -> dict[int, list[CollectiveCall]] | None:
    if directory is None or not enabled():
        return None
    return {rank: read_rank_trace(directory, rank) for rank in range(world_size)}


def diagnosis_note(
    traces: Mapping[int, Sequence[CollectiveCall]] | None, rank_states: Mapping[int, str]
) -> str | None:
    """The report paragraph naming the first divergent collective, or None if none."""
    if not traces:
        return None
    divergence = find_divergence(traces)
    if divergence is None:
        return None
    return "collective trace: " + divergence.describe(rank_states)
