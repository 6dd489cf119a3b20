"""The thread launcher's host process: the rank threads live in one child process.

Rank threads cannot be killed. Running them inside pytest would leave a hung rank
spinning in the pytest process for the rest of the session, so the threads live in a
host process forked from the fork server, like a process rank. The host runs each
task on its :class:`~distconform.harness.rank.thread_ranks.ThreadPool` of the task's world size and
sends back the judged ``RunResult`` and whether it can serve another task; when it cannot
(a hung thread may still be spinning, or the test left the process changed) the parent
kills the host and the next test gets a new one. A test that failed and changed nothing
keeps the host.

One host serves every world size, as torch's ``MultiThreadedTestCase`` runs every class in
the pytest process: a second host would cost a fork and the test modules' imports again,
more than a test of such a class. Each world size still has a pool of its own for the
pool manager (:class:`ThreadHostPool`), pinned to the host it started on: when that host is
gone (replaced after a hang, a changed process or a fresh-pool test), the pool is no longer
alive and the manager replaces it with one on the current host.

This module is the parent's side; the host's own loop is
:mod:`distconform.harness.rank.thread_host`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from multiprocessing.connection import wait
from pathlib import Path

from distconform.harness.controller.launcher_registry import Echo
from distconform.harness.controller.process.pool import ProcessPool, ProcessPoolSpec
from distconform.harness.rank.thread_host_exit import note_path, read_exit_note
from distconform.harness.shared.outcomes import Outcome, RankResult, RunResult
from distconform.harness.shared.protocol import ThreadHostRun, WorkerSpec
from distconform.harness.shared.task import RankTask

# Beyond the deadline the host's own runner reports a hung thread; this long again,
# and the host process itself is considered stuck.
_HOST_MARGIN_S = 10.0


class ThreadHostPool:
    """``world_size`` rank threads in the current thread host; implements ``RankPool``."""

    launcher = "thread"

    def __init__(self, world_size: int, echo: Echo = None) -> None:
        self.world_size = world_size
        self._echo = echo
        self._host: ThreadHost | None = None

    @property
    def broken(self) -> bool:
        return self._host is not None and self._host.broken

    @property
    def pids(self) -> list[int]:
        return self._host.pids if self._host is not None else []

    def start(self, timeout: float | None = None) -> None:
        self._host = _HOSTS.current_or_new(self._echo, timeout)

    def start_alone(self, timeout: float | None = None) -> None:
        """Start on a new host (a fresh-pool test); pools on the one before are gone."""
        self._host = _HOSTS.new(self._echo, timeout)

    def alive(self) -> bool:
        return self._host is not None and self._host is _HOSTS.current and self._host.alive()

    def run(self, task: RankTask, deadline: float, peer_grace: float) -> RunResult:
        assert self._host is not None, "start() the pool first"
        return self._host.run_threads(task, deadline, peer_grace, self.world_size)

    def close(self, timeout: float = 10.0) -> None:
        if self._host is not None:
            _HOSTS.retire(self._host, timeout)

    def kill(self) -> None:
        if self._host is not None:
            _HOSTS.retire(self._host, None)


class _CurrentHost:
    """The host that new thread pools start on, in this pytest process (whose pool
    managers run on its main thread only)."""

    def __init__(self) -> None:
        self.current: ThreadHost | None = None

    def current_or_new(self, echo: Echo, timeout: float | None) -> ThreadHost:
        if self.current is not None and self.current.alive():
            return self.current
        return self.new(echo, timeout)

    def new(self, echo: Echo, timeout: float | None) -> ThreadHost:
        """Start a host and make it the current one, closing the one before."""
        before, self.current = self.current, None
        if before is not None:
            before.close()
        host = ThreadHost(echo)
        host.start(timeout)  # raises PoolStartFailure, with nothing left running
        self.current = host
        return host

    def retire(self, host: ThreadHost, timeout: float | None) -> None:
        """Close ``host`` (kill it with ``timeout`` None); pools pinned to it are gone."""
        if host is self.current:
            self.current = None
        if timeout is None:
            host.kill()
        else:
            host.close(timeout)


_HOSTS = _CurrentHost()


class ThreadHost(ProcessPool):
    """The host process; its rank threads, of any world size, live inside it."""

    launcher = "thread"
    hosts_rank_threads = True

    def __init__(self, echo: Echo = None) -> None:
        # One process, rank 0 of its own: the rank threads rendezvous inside it.
        super().__init__(
            ProcessPoolSpec(
                world_size=1, backend="threaded", device_type="cpu", threads_per_rank=1, echo=echo
            )
        )

    @property
    def process_count(self) -> int:
        return 1

    def _make_store(self) -> dict:
        return {"kind": "none"}  # the rank threads rendezvous inside the host

    def _worker_spec(self, rank: int, store: dict, control_fd: int, stack_path: Path) -> WorkerSpec:
        return replace(super()._worker_spec(rank, store, control_fd, stack_path), rank=0)

    def run_threads(
        self, task: RankTask, deadline: float, peer_grace: float, world_size: int
    ) -> RunResult:
        """Run ``task`` on ``world_size`` rank threads of this host."""
        self._task_counter += 1
        task = replace(task, task_id=self._task_counter)
        host = self._ranks[0]
        mark = host.output.mark()
        started = time.monotonic()
        host.conn.send(ThreadHostRun(task, deadline, peer_grace, world_size))
        reusable = False
        if wait([host.conn], timeout=deadline + _HOST_MARGIN_S):
            try:
                done = host.conn.recv()
                run, reusable = done.run, done.reusable
            except (EOFError, OSError):
                run = self._host_died(task, host, started, deadline, world_size)
        else:
            run = self._host_stuck(task, host, started, deadline, world_size)
        if host.popen.poll() is None:
            host.output.wait_for_task_end(task.task_id, 2.0)
        else:
            host.output.wait_closed(2.0)
        stray = host.output.text_since(mark)
        if stray.strip():
            run.harness_notes.append(f"output of the thread host outside the ranks:\n{stray}")
        if not reusable:
            # A hung rank thread may still be spinning, or the test left the process
            # changed: only a new host is clean.
            self.kill()
        return run

    def _host_died(
        self, task: RankTask, host, started: float, deadline: float, world_size: int
    ) -> RunResult:
        """Every rank died with the host: blame the rank that exited it, if one did."""
        crash = self._crash_result(host, started)
        finished = time.monotonic()
        exit_note = read_exit_note(note_path(host.stack_path))
        if exit_note is not None:
            culprit, status = exit_note
            results = [
                replace(
                    crash,
                    rank=rank,
                    note=f"it called os._exit({status}), which ended the thread host process",
                )
                if rank == culprit
                else RankResult(
                    rank=rank,
                    outcome=Outcome.ABORTED_BY_PEER,
                    started_at=started,
                    finished_at=finished,
                    note=f"ended with the thread host process when rank {culprit} exited it",
                )
                for rank in range(world_size)
            ]
            return RunResult(results, task.seed, deadline, started, finished)
        results = [
            replace(crash, rank=rank, note="the thread host process died")
            for rank in range(world_size)
        ]
        run = RunResult(results, task.seed, deadline, started, finished)
        run.shared_crash = (
            f"the thread host process {crash.summary()}, ending all {world_size} "
            f"rank threads; which rank caused it is unknown (the ranks share the process; "
            f"run with --launcher process to see the rank)"
        )
        return run

    def _host_stuck(
        self, task: RankTask, host, started: float, deadline: float, world_size: int
    ) -> RunResult:
        stacks = self._dump_stacks([host]).get(0)
        results = [
            RankResult(
                rank=rank,
                outcome=Outcome.HUNG,
                started_at=started,
                stacks=stacks,
                note=f"the thread host did not answer within {deadline + _HOST_MARGIN_S:.1f} s",
            )
            for rank in range(world_size)
        ]
        self.kill()
        return RunResult(results, task.seed, deadline, started, time.monotonic())
