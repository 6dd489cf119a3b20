"""``RankPool`` adapter: the thread runner behind the interface of
:mod:`distconform.harness.controller.pools`.

A task runs exactly as in a rank process (``distconform.harness.rank.execute.run_task``: the payload
is unpickled *per rank*, so ranks never share argument objects; rank context, reseeding, skip/xfail
classification), but on the runner's rank threads. A rank whose task did not pass aborts the run at
once, so its peers are released from their collectives instead of waiting for the deadline.

The runner's rank threads and their groups serve task after task, as a process pool's
ranks do; the runner itself starts new groups after a run that did not pass, so a failure
leaves the next test neither a stray collective nor an abort flag. What the rank threads
share is the process: after every run, passed or not, the pool compares it with how the
run found it (threads the test left running, environment variables, torch's process-wide
switches, as a process rank's hygiene check does). A change is reported on every rank, whose
threads share the process, and marks the pool broken, as does a hang, whose abandoned
threads live on: the thread host (harness/controller/thread_host/pool.py) is then replaced.
A failure that changed nothing keeps the host: starting one costs more than a test of a
``MultiThreadedTestCase`` class.

Each rank thread records its collectives like a rank process does (harness/comm/flight.py),
into files in the pool's private temp dir; after a run that did not pass, the report names
the first collective where the ranks diverge, or the rank that never arrived.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from distconform.harness.comm import flight, flight_files
from distconform.harness.rank import hygiene
from distconform.harness.rank.execute import run_task
from distconform.harness.shared.outcomes import Outcome, RankResult, RunResult
from distconform.harness.shared.rank_context import RankContext
from distconform.harness.shared.task import RankTask, ensure_modules
from distconform.harness.threads.backend import BACKEND_NAME
from distconform.harness.threads.runner import ThreadRunner


class _TaskDidNotPass(Exception):
    """Carries a rank's non-passing RankResult out of the rank so the runner aborts peers."""

    def __init__(self, result: RankResult) -> None:
        super().__init__(f"rank {result.rank}: {result.outcome.value}")
        self.result = result
        if result.error_type:
            first = (result.error_message or "").strip().splitlines()
            self.abort_summary = f"{result.error_type}: {first[0] if first else ''}"
        else:
            self.abort_summary = f"{result.outcome.value} ({result.reason or 'no reason'})"


class _Recorders:
    """The flight recorders of one run's rank threads, and which threads left theirs."""

    def __init__(self) -> None:
        self.entered: dict[int, object] = {}
        self.exited: set[int] = set()

    def abandon_unexited(self) -> None:
        # A hung rank thread never leaves its recorder: release what it holds.
        for rank, recorder in self.entered.items():
            if rank not in self.exited and hasattr(recorder, "abandon"):
                recorder.abandon()


def _rank_body(
    task: RankTask, world_size: int, trace_dir: str | None, recorders: _Recorders
) -> RankResult:
    ctx = RankContext(
        rank=dist.get_rank(),
        world_size=world_size,
        device=torch.device("cpu"),
        backend=BACKEND_NAME,
        seed=task.seed,
        launcher="thread",
    )
    recorder = flight.recording(trace_dir, ctx.rank, task.task_id)
    recorders.entered[ctx.rank] = recorder
    try:
        with recorder:
            result = run_task(task, ctx)
    finally:
        recorders.exited.add(ctx.rank)
    if result.outcome is not Outcome.PASSED:
        raise _TaskDidNotPass(result)
    return result


def _task_result(run: RankResult) -> RankResult:
    """The rank's own account of the task, where the runner's wraps it (as the value of a
    passing rank, or inside the exception that made the runner abort the peers)."""
    if isinstance(run.value, RankResult):
        inner = run.value
    elif isinstance(run.error, _TaskDidNotPass):
        inner = run.error.result
    else:
        return run  # the runner's own verdict: hung, aborted by a peer, or a harness error
    inner.output = run.output
    return inner


class ThreadPool:
    """``world_size`` rank threads in this process; implements
    ``distconform.harness.controller.pools.RankPool``."""

    launcher = "thread"

    def __init__(self, world_size: int, temp_root: str | None = None) -> None:
        self.world_size = world_size
        self.broken = False
        self._runner: ThreadRunner | None = None
        self._trace_dir: str | None = None
        # Where the trace directory goes: in a thread host, the parent's pool directory,
        # which the parent removes even when it had to kill the host.
        self._temp_root = temp_root

    def start(self, timeout: float | None = None) -> None:
        """Start the rank threads; ``timeout`` is accepted for the RankPool interface
        (starting threads does not block)."""
        if self._runner is None:
            self._runner = ThreadRunner(self.world_size, capture_output=True)
        if self._trace_dir is None and flight_files.enabled():
            self._trace_dir = tempfile.mkdtemp(prefix="distconform-threads-", dir=self._temp_root)

    def run(self, task: RankTask, deadline: float, peer_grace: float) -> RunResult:
        """Run ``task`` on every rank thread; ``peer_grace`` is moot: peers are released
        the moment a rank fails."""
        self.start()
        assert self._runner is not None
        # Import the test's modules once, in the parent thread, before the ranks unpickle.
        # An import error is not ours to report: every rank imports again in run_task
        # and reports it as its own failure, with its traceback.
        with contextlib.suppress(Exception):
            ensure_modules(task)
        process_before = hygiene.take_snapshot()
        started = time.monotonic()
        recorders = _Recorders()
        run = self._runner.run(
            _rank_body, task, self.world_size, self._trace_dir, recorders, deadline=deadline
        )
        recorders.abandon_unexited()
        results = [_task_result(r) for r in run.results]
        notes = list(run.harness_notes)
        if self._runner.usable:
            left = hygiene.changes_to_the_process(process_before)
            for result in results:
                result.hygiene.extend(left)
            self.broken = self.broken or bool(left)
        else:
            self.broken = True  # a hung thread lives on, and may change the process yet
        if not run.ok:
            traces = flight_files.read_traces(self._trace_dir, self.world_size)
            states = {r.rank: r.outcome.value for r in results}
            if (comm_note := flight_files.diagnosis_note(traces, states)) is not None:
                notes.append(comm_note)
        return RunResult(
            results=results,
            seed=task.seed,
            deadline=deadline,
            started_at=started,
            finished_at=time.monotonic(),
            harness_notes=notes,
        )

    def close(self, timeout: float = 10.0) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._trace_dir is not None:
            shutil.rmtree(self._trace_dir, ignore_errors=True)
            self._trace_dir = None

    def kill(self) -> None:
        # Threads cannot be killed; closing uninstalls the thread world and leaves any
        # hung (daemon) thread to the process's end.
        self.close()
