"""Always-on collective traces of rank processes and rank threads that survive a hang or a kill.

While a task runs, each rank appends one JSON line per collective (kind, group, shapes,
dtypes, call site, sequence numbers: about 400 bytes) to a file in the pool's private
temp dir, *before* the collective is issued, with one unbuffered ``write``: a rank stuck
in the collective, or killed in it, has already recorded it. The files are a ring of two
halves of ``RING_HALF`` calls each, so a long test keeps its latest calls in bounded
space. The parent reads them after a failure or hang, before it removes the directory,
and ``flight_files.diagnosis_note`` names the first collective where the ranks diverge.

It sees what the cheap interception paths see (harness/comm/intercept.py): the
``torch.distributed`` collectives, ``isend``/``irecv`` (through ``ProcessGroup``'s
send and receive), and functional collectives called through their op packets (DTensor,
funcol), in forward and in backward alike. Process ranks and thread ranks record;
``DISTCONFORM_COMM_FLIGHT=0`` in the environment turns the recorder off.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from typing import Any

from harness.comm.flight_files import RING_HALF, enabled, trace_paths
from harness.comm.intercept import Interceptor, Proceed
from harness.comm.records import (
    POINT_TO_POINT,
    SEND,
    CollectiveCall,
    RawCall,
    default_group_name,
)
from harness.comm.tracer import CallNumbering
from harness.outcomes import GroupLedger


class FlightRecorder(Interceptor):
    """Appends each collective of this rank to its ring of trace files.

    Always on, so it takes the cheap paths only (no torch function or dispatch mode): a
    functional collective reached through an op overload held elsewhere (``.default``
    in traced code) is recorded only while a ``CommTracer`` is active at the same time.
    """

    functional = False

    def __init__(
        self, directory: str | os.PathLike[str], rank: int, task_id: int, ring_half: int = RING_HALF
    ) -> None:
        self._paths = trace_paths(directory, rank)
        self._task_id = task_id
        self._ring_half = ring_half
        self._numbering = CallNumbering()
        self._fd = -1
        self._part = 0
        self._in_part = 0
        self._default_group: str | None = None
        self._collectives = 0
        self._sent: Counter[int] = Counter()
        self._received: Counter[int] = Counter()
        self._any_source = False

    def ledger(self) -> GroupLedger | None:
        """This rank's calls on the default group so far; None after a receive from any
        source, which no other rank's ledger can be matched against."""
        if self._any_source:
            return None
        return GroupLedger(
            self._collectives,
            tuple(sorted(self._sent.items())),
            tuple(sorted(self._received.items())),
        )

    def __enter__(self) -> FlightRecorder:
        for path in self._paths:  # the previous task's calls are not this task's
            with contextlib.suppress(OSError):
                path.unlink()
        self._open_part(0)
        self._default_group = default_group_name()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._close()

    def abandon(self) -> None:
        super().abandon()
        self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _open_part(self, part: int) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        self._fd = os.open(self._paths[part], flags, 0o600)
        self._part, self._in_part = part, 0
        os.write(self._fd, (json.dumps({"task": self._task_id}) + "\n").encode())

    def handle(self, raw: RawCall, proceed: Proceed) -> Any:
        call = self._numbering.number(raw, None)
        if self._in_part >= self._ring_half:
            self._open_part(1 - self._part)
        os.write(self._fd, (json.dumps(call.to_json()) + "\n").encode())
        self._in_part += 1
        issued = proceed()
        # Counted only once issued: a call refused on the spot (a strided tensor, a bad
        # argument) never reaches the other ranks, so it must not unbalance the ledger.
        if call.group_name == self._default_group:
            self._count(call)
        return issued

    def _count(self, call: CollectiveCall) -> None:
        if call.kind not in POINT_TO_POINT:
            self._collectives += 1
        elif call.peer is None:
            self._any_source = True
        elif call.kind == SEND:
            self._sent[call.peer] += 1
        else:
            self._received[call.peer] += 1


def recording(directory: str | os.PathLike[str] | None, rank: int, task_id: int) -> Any:
    """The recorder for one task, or a no-op context when turned off or without a directory."""
    if directory is None or not enabled():
        return contextlib.nullcontext()
    return FlightRecorder(directory, rank, task_id)
