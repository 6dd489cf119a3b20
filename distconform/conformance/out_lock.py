"""One conformance run per report directory.

Two runs writing one directory would overwrite each other's files while both run, and the
last to finish would leave its report as if it were the only one. A run therefore holds a
lock file in its report directory (:data:`LOCK_NAME`) from its start to its end, naming its
process, when it started and its command line. A second run into that directory is refused
in one line that names the holder and says how to write elsewhere. A lock whose process is
gone (killed with ``kill -9``, or a machine that rebooted) is stale and taken over with a
note. The directory is created only once the lock is the run's, so a refused run leaves
nothing behind; a run that created its directory and is refused later (a usage error after
the lock, or one that ran no test) removes the directory again.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

LOCK_NAME = ".conformance.lock"


@dataclass(frozen=True)
class Holder:
    pid: int
    started: str
    command: str
    #: The process's start time as the kernel counts it (Linux), so that a reused pid is not
    #: mistaken for the holder; None where it cannot be read.
    process_start: str | None = None

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # another user's process: alive
        return self.process_start is None or self.process_start == process_start(self.pid)


def process_start(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks), or None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count after its ")".
    return stat.rsplit(")", 1)[1].split()[19]


def this_process() -> Holder:
    return Holder(
        pid=os.getpid(),
        started=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=shlex.join(sys.argv),
        process_start=process_start(os.getpid()),
    )


def read_holder(lock: Path) -> Holder | None:
    """The lock's holder; None when the file is gone or unreadable (a holder mid-write)."""
    try:
        data = json.loads(lock.read_text())
        return Holder(**data)
    except (OSError, ValueError, TypeError):
        return None


class OutputLock:
    """The lock on one report directory, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, directory: Path, option: str) -> None:
        self.directory = directory
        self.option = option
        self.path = directory / LOCK_NAME
        self.created_directory = False
        self.note: str | None = None  # set when a stale lock was taken over
        self._held = False

    def acquire(self) -> None:
        """Take the lock, or raise ``pytest.UsageError`` naming the run that holds it."""
        self._refuse_if_held()
        if not self.directory.exists():
            self.directory.mkdir(parents=True)
            self.created_directory = True
        me = this_process()
        try:
            descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self._refuse_if_held()  # another run took it between the check and the create
            raise pytest.UsageError(
                f"{self.option} {self.directory}: its lock {self.path} appeared while this run "
                f"started; run again"
            ) from None
        with os.fdopen(descriptor, "w") as sink:
            json.dump(me.__dict__, sink)
        self._held = True

    def _refuse_if_held(self) -> None:
        if not self.path.exists():
            return
        holder = read_holder(self.path)
        if holder is not None and not holder.alive():
            self.path.unlink(missing_ok=True)
            self.note = (
                f"took over the stale lock of process {holder.pid} (started {holder.started}), "
                f"which is gone"
            )
            return
        who = (
            f"the conformance run of process {holder.pid} (started {holder.started}: "
            f"{holder.command})"
            if holder is not None
            else f"another conformance run (lock {self.path})"
        )
        raise pytest.UsageError(
            f"{self.option} {self.directory} is in use by {who}; wait for it to finish, or "
            f"write this run's report elsewhere with --out DIR (--conformance-out DIR under "
            f"pytest)"
        )

    def release(self, *, discard: bool = False) -> None:
        """Give the lock up (if this run still holds it). A directory this run created goes
        too when it holds nothing else, or whatever it holds when ``discard`` (a run refused
        before any test: everything in it is this run's)."""
        if not self._held:
            return
        self._held = False
        holder = read_holder(self.path)
        if holder is not None and holder.pid == os.getpid():
            self.path.unlink(missing_ok=True)
        if not self.created_directory:
            return
        if discard:
            shutil.rmtree(self.directory, ignore_errors=True)
            return
        with contextlib.suppress(OSError):
            self.directory.rmdir()  # only when empty: a written report stays
