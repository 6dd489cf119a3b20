"""Always-on collective traces of rank processes and rank threads that survive a hang or a kill.

While a task runs, each rank appends one JSON line per collective (kind, group, shapes,
dtypes, call site, sequence numbers: about 400 bytes) to a file in the pool's private
temp dir, *before* the collective is issued, with one unbuffered ``write``: a rank stuck
in the collective, or killed in it, has already recorded it. The files are a ring of two
halves of ``RING_HALF`` calls each, so a long test keeps its latest calls in bounded
space. The parent reads them after a failure or hang, before it removes the directory,
and ``flight_files.diagnosis_note`` names the first collective where the ranks diverge.
A rank keeps its two files open from task to task and empties them when the next task
starts: creating and removing them cost a warm rank more than a trivial test's body.

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
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from distconform.harness.comm.flight_files import RING_HALF, enabled, trace_paths
from distconform.harness.comm.intercept import Interceptor, Proceed
from distconform.harness.comm.records import (
    POINT_TO_POINT,
    SEND,
    CollectiveCall,
    RawCall,
    default_group_name,
)
from distconform.harness.comm.tracer import CallNumbering
from distconform.harness.shared.outcomes import GroupLedger


class _RankTraceFiles:
    """One rank's two ring halves, opened once and emptied by each task that reuses them."""

    def __init__(self, paths: tuple[Path, Path]) -> None:
        self.paths = paths
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        self._fds = [os.open(path, flags, 0o600) for path in paths]
        self._written = [False, False]

    def usable(self) -> bool:
        # Their directory may be gone since (a test's own temporary one): writing on into
        # an unlinked file would record what nobody can read.
        try:
            return all(os.fstat(fd).st_nlink > 0 for fd in self._fds)
        except OSError:
            return False

    def start_half(self, part: int, header: bytes) -> None:
        """Empty half ``part`` (O_APPEND: the next write lands at its start) and head it."""
        if self._written[part]:
            os.ftruncate(self._fds[part], 0)
        self.append(part, header)

    def append(self, part: int, line: bytes) -> None:
        os.write(self._fds[part], line)
        self._written[part] = True

    def empty(self) -> None:
        """What the previous task left is not this task's."""
        for part in (0, 1):
            if self._written[part]:
                os.ftruncate(self._fds[part], 0)
                self._written[part] = False

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = [-1, -1]


# Files no recorder holds now, by their paths, oldest first: a rank's next task takes its
# own back. Bounded, as recorders of short-lived directories (a test's own) leave theirs.
_idle_files: dict[tuple[Path, Path], _RankTraceFiles] = {}
_idle_lock = threading.Lock()
_MAX_IDLE = 16


def _take_files(directory: str | os.PathLike[str], rank: int) -> _RankTraceFiles:
    paths = trace_paths(directory, rank)
    with _idle_lock:
        files = _idle_files.pop(paths, None)
    if files is not None:
        if files.usable():
            files.empty()
            return files
        files.close()
    return _RankTraceFiles(paths)


def _give_back_files(files: _RankTraceFiles) -> None:
    with _idle_lock:
        _idle_files[files.paths] = files
        evicted = []
        while len(_idle_files) > _MAX_IDLE:
            evicted.append(_idle_files.pop(next(iter(_idle_files))))
    for old in evicted:
        old.close()


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
        self._directory = directory
        self._rank = rank
        self._task_id = task_id
        self._ring_half = ring_half
        self._numbering = CallNumbering()
        self._files: _RankTraceFiles | None = None
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
        self._files = _take_files(self._directory, self._rank)
        self._start_part(0)
        self._default_group = default_group_name()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._files is not None:  # open for the rank's next task
                _give_back_files(self._files)
                self._files = None

    def abandon(self) -> None:
        # A hung thread keeps this recorder: its files are closed, not handed to the next
        # task, and its late writes fail on a closed descriptor instead of landing there.
        super().abandon()
        if self._files is not None:
            self._files.close()

    def _start_part(self, part: int) -> None:
        assert self._files is not None
        self._part, self._in_part = part, 0
        self._files.start_half(part, (json.dumps({"task": self._task_id}) + "\n").encode())

    def handle(self, raw: RawCall, proceed: Proceed) -> Any:
        call = self._numbering.number(raw, None)
        if self._files is not None:
            if self._in_part >= self._ring_half:
                self._start_part(1 - self._part)
            self._files.append(self._part, (json.dumps(call.to_json()) + "\n").encode())
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
