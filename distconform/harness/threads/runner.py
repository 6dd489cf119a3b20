"""Run a function on N rank threads of the current process, with the ``threaded`` backend.

    with ThreadRunner(world_size=4) as runner:
        result = runner.run(fn, arg, deadline=30.0)
    result.raise_on_failure()  # distconform.harness.shared.outcomes.RunFailedError
    result.values  # [fn's return value on rank 0, 1, 2, 3]

The runner keeps N rank threads for its life, like a warm pool keeps rank processes: each
joined the ``threaded`` default group once, at its first run, and runs ``fn(*args,
**kwargs)`` for every run after. Starting threads and joining and leaving a group cost
1.3 ms a run, more than a trivial test itself. What one run leaves, the next does not see:
 * groups the run created are destroyed on every rank thread when it ends;
 * torch's thread-local switches are checked after each run against a fresh thread's
   (grad mode, inference mode, autocast, the default device): a rank thread that was left
   with one changed gives way to a fresh thread, and a run that destroyed the default
   group leaves it to the next run to join new groups (below);
 * after a run that did not pass (a failure, an abort, unmatched collectives), the next
   run starts a new world: every rank thread leaves its groups and joins new ones, so no
   stray collective or abort flag of the failed run reaches it.

Isolation (see :mod:`distconform.harness.threads.world` for why one rank runs at a time):
 * RNG: every rank starts from ``seed`` for torch's CPU generator, ``random`` and numpy's
   legacy global generator, and owns its stream; the caller's states are restored after.
 * Failure: the first exception on a rank aborts the run: every rank waiting in (or later
   issuing) a collective raises ``RankAbortedError("... aborted because rank N failed")``
   at once, and is reported as aborted-by-peer, not as a failure of its own.
 * Deadlock: when every unfinished rank waits for something no rank can provide, the run
   aborts immediately with ``CollectiveDeadlockError`` (ranks reported as hung).
 * Hang: a rank that does not finish by the deadline (it spins or blocks outside a
   collective while holding the baton) is reported as hung with its Python stack; the
   run is abandoned (waiting ranks are released) and the runner marks itself unusable:
   the thread cannot be killed, so the caller should replace the host process.

With ``capture_output=True`` what each rank prints is kept per rank (``RankResult.output``).
A run's result is the harness's one :class:`~distconform.harness.shared.outcomes.RunResult`, the
same the process launcher returns; each rank's exception object is kept on ``RankResult.error``.

The thread-local c10d world is installed while the runner is open and uninstalled by
``close()``; threads that are not rank threads keep seeing the ordinary c10d state even
while it is installed.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distconform.harness import _torch_private
from distconform.harness.shared.outcomes import Outcome, RankResult, RunResult
from distconform.harness.threads.backend import (
    BACKEND_NAME,
    ThreadedProcessGroup,
    register_threaded_backend,
)
from distconform.harness.threads.output import RankOutputCapture
from distconform.harness.threads.store import RunStore
from distconform.harness.threads.world import (
    CollectiveDeadlockError,
    RankAbortedError,
    ThreadWorld,
    bind_rank,
)

# Ranks released by an abandoned run get this long to unwind before being called hung.
_UNWIND_GRACE_S = 1.0


class RunnerUnusableError(RuntimeError):
    """The runner left a hung thread behind; replace it (and ideally the process)."""


def _is_skip(error: BaseException) -> bool:
    # pytest.skip raises _pytest.outcomes.Skipped; unittest uses SkipTest.
    names = {c.__name__ for c in type(error).__mro__}
    return "Skipped" in names or "SkipTest" in names


def _is_secondary(error: BaseException) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, RankAbortedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class _Job:
    """One run as the rank threads see it."""

    def __init__(
        self,
        world: ThreadWorld,
        store: RunStore,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.world = world
        self.store = store
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        n = world.world_size
        self.runs: list[RankResult | None] = [None] * n
        #: Per rank: why its groups cannot serve the next run (None: they can).
        self.spoiled: list[str | None] = [None] * n
        #: Per rank: its thread left torch's thread-local state changed, and retires.
        self.retired = [False] * n


class ThreadRunner:
    """Runs functions on ``world_size`` rank threads; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        *,
        seed: int = 0,
        deadline: float = 120.0,
        capture_output: bool = False,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        self.world_size = world_size
        self.seed = seed
        self.deadline = deadline
        self.capture_output = capture_output
        self.unusable_reason: str | None = None
        self._zombies: list[threading.Thread] = []
        self._threads: list[threading.Thread] = []
        # The world the rank threads' groups belong to; None: the next run makes a new one.
        self._world: ThreadWorld | None = None
        self._store: RunStore | None = None
        self._jobs = threading.Condition()
        self._job: _Job | None = None
        self._job_number = 0
        self._closing = False
        register_threaded_backend()
        _torch_private.install_thread_local_c10d_world()
        self._installed = True

    @property
    def usable(self) -> bool:
        return self._installed and self.unusable_reason is None

    def __enter__(self) -> ThreadRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the rank threads and uninstall the thread-local c10d world (idempotent).

        Hung threads left by an abandoned run stay alive (threads cannot be killed); they
        are daemon threads, and their c10d cleanup is skipped so they cannot touch the
        process-wide c10d state after this.
        """
        if not self._installed:
            return
        with self._jobs:
            self._closing = True
            self._jobs.notify_all()
        end = time.monotonic() + timeout
        for thread in self._threads:
            if thread not in self._zombies:
                thread.join(max(0.0, end - time.monotonic()))
        self._installed = False
        _torch_private.uninstall_thread_local_c10d_world()

    def run(
        self, fn: Callable[..., Any], *args: Any, deadline: float | None = None, **kwargs: Any
    ) -> RunResult:
        """Run ``fn(*args, **kwargs)`` on every rank; never raises for a rank's failure."""
        if not self._installed:
            raise RunnerUnusableError("ThreadRunner is closed")
        if self.unusable_reason is not None:
            raise RunnerUnusableError(self.unusable_reason)
        self._start_threads()
        limit = self.deadline if deadline is None else deadline
        job = self._next_job(fn, args, kwargs, limit)
        world = job.world
        excepthook = sys.excepthook  # init_process_group wraps it on every call
        start = time.monotonic()
        capture = RankOutputCapture(self.world_size) if self.capture_output else None
        notes: list[str] = []
        try:
            if capture is not None:
                capture.__enter__()
            with self._jobs:
                self._job = job
                self._job_number += 1
                self._jobs.notify_all()
            try:
                finished = self._wait(world, start + limit)
            except BaseException:  # KeyboardInterrupt: release the ranks before leaving
                world.abandon("the runner was interrupted")
                self.unusable_reason = "a run was interrupted; replace this runner"
                raise
            if not finished:
                self._abandon(world, job.runs, limit)
        finally:
            if capture is not None:
                capture.__exit__(None, None, None)
            world.rng.give_back_to_caller()
            sys.excepthook = excepthook
        result = RunResult(
            results=[r for r in job.runs if r is not None],
            seed=self.seed,
            deadline=limit,
            started_at=start,
            finished_at=time.monotonic(),
            harness_notes=notes,
        )
        if capture is not None:
            for run in result.results:
                run.output = capture.output(run.rank)
        leftovers = world.pending_meetings()
        if leftovers and result.ok:
            # A collective some ranks issued and never waited for: the run "passed" but
            # the ranks disagree on what they did, which a process backend would hang on.
            for run in result.results:
                run.outcome = Outcome.FAILED
            notes.append("unmatched collectives at the end of the run: " + "; ".join(leftovers))
        spoiled = [f"rank {rank}: {why}" for rank, why in enumerate(job.spoiled) if why]
        if spoiled:
            notes.append("the next run gets new groups: " + "; ".join(spoiled))
        if not result.ok or spoiled:
            self._world = self._store = None  # the next run joins a new world
        for rank, retired in enumerate(job.retired):
            if retired:  # replaced by a fresh thread at the next run
                self._threads[rank].join(_UNWIND_GRACE_S)
        return result

    def _start_threads(self) -> None:
        """Start every rank thread the first time, and later each one that retired."""
        if not self._threads:
            self._threads = [self._new_thread(rank) for rank in range(self.world_size)]
            for thread in self._threads:
                thread.start()
            return
        for rank, thread in enumerate(self._threads):
            if not thread.is_alive():
                self._threads[rank] = self._new_thread(rank)
                self._threads[rank].start()
                self._world = self._store = None  # a fresh thread has no groups to share

    def _new_thread(self, rank: int) -> threading.Thread:
        return threading.Thread(
            target=self._rank_main,
            args=(rank, self._job_number),  # it starts with the next job
            name=f"distconform-rank{rank}",
            daemon=True,  # a hung rank must not keep the interpreter alive at exit
        )

    def _next_job(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], limit: float
    ) -> _Job:
        if self._world is None or self._store is None:
            self._world = ThreadWorld(self.world_size, self.seed)
            self._store = RunStore(self._world, timeout=timedelta(seconds=limit))
        else:
            self._world.begin_run(self.seed)
            self._store.set_timeout(timedelta(seconds=limit))
        return _Job(self._world, self._store, fn, args, kwargs)

    def _wait(self, world: ThreadWorld, end: float) -> bool:
        with world.lock:
            while not world.all_done():
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return False
                world.main_cond.wait(remaining)
        return True

    def _abandon(self, world: ThreadWorld, runs: list[RankResult | None], limit: float) -> None:
        frames = sys._current_frames()
        states = world.describe_states()
        stacks = {
            rank: "".join(traceback.format_stack(frames[t.ident]))
            for rank, t in enumerate(self._threads)
            if t.ident in frames and states[rank] != "finished"
        }
        world.abandon(f"the run passed its {limit:g} s deadline")
        # Ranks that were waiting get released by the abandon and unwind quickly; the one
        # that was running is the hung one and will not, so nobody waits for it.
        grace_end = time.monotonic() + _UNWIND_GRACE_S
        waiting = [r for r, state in states.items() if state not in ("running", "finished")]
        while time.monotonic() < grace_end and not all(world.has_left(r) for r in waiting):
            time.sleep(0.01)
        now = time.monotonic()
        for rank, thread in enumerate(self._threads):
            run = runs[rank]
            if not world.has_left(rank) or run is None or run.finished_at is None:
                # A fresh record: the zombie thread keeps mutating its own one.
                runs[rank] = RankResult(
                    rank=rank,
                    outcome=Outcome.HUNG,
                    started_at=run.started_at if run is not None else now,
                    finished_at=now,
                    traceback=f"rank {rank} {states[rank]} at the {limit:g} s deadline",
                    stacks=stacks.get(rank),
                )
                if not world.has_left(rank):
                    self._zombies.append(thread)
            elif rank in stacks:
                run.stacks = stacks[rank]
        # Released rank threads go back to waiting for work, but their groups belong to an
        # abandoned world: this runner is done either way.
        names = ", ".join(t.name for t in self._zombies if t.is_alive())
        self.unusable_reason = (
            f"a previous run hung and left rank threads alive ({names}); "
            "replace this runner and its process"
            if names
            else f"a previous run passed its {limit:g} s deadline; replace this runner"
        )

    # --- on the rank threads ----------------------------------------------------------------

    def _rank_main(self, rank: int, seen: int) -> None:
        joined: ThreadWorld | None = None  # the world this thread's groups belong to
        while True:
            with self._jobs:
                while self._job_number == seen and not self._closing:
                    self._jobs.wait()
                if self._closing:
                    break
                seen = self._job_number
                job = self._job
            assert job is not None
            joined = self._run_job(job, rank, joined)
            if job.retired[rank]:
                break
        if joined is not None and not joined.abandoned:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        _torch_private.unbind_thread_c10d_world()
        bind_rank(None)

    def _run_job(self, job: _Job, rank: int, joined: ThreadWorld | None) -> ThreadWorld | None:
        """Run one job on this rank thread; return the world its groups now belong to."""
        world = job.world
        run = job.runs[rank] = RankResult(
            rank=rank, outcome=Outcome.PASSED, started_at=time.monotonic()
        )
        try:
            bind_rank(world, rank)
            world.enter(rank)
            run.started_at = time.monotonic()
            if joined is not world:
                earlier, joined = joined, None
                self._join(job, rank, leave_first=earlier is not None)
                joined = world
            run.value = job.fn(*job.args, **job.kwargs)
        except BaseException as error:
            _record_error(run, error)
            if run.outcome is not Outcome.ABORTED_BY_PEER:
                world.fail(rank, error)
        finally:
            if joined is world and not world.abandoned:
                try:
                    job.spoiled[rank], job.retired[rank] = _leave_as_found()
                except BaseException as error:
                    job.spoiled[rank] = f"its groups could not be cleaned up: {error}"
                    if run.error is None:
                        _record_error(run, error)
                        world.fail(rank, error)
            run.finished_at = time.monotonic()
            world.leave(rank)  # always: the others (and the runner) wait for it
        return joined

    def _join(self, job: _Job, rank: int, leave_first: bool) -> None:
        """Join the job's world, after leaving the groups of an earlier one.

        Until its first join a rank thread sees the process-wide c10d world, whose
        groups are its caller's: only groups of a world it joined itself are left.
        """
        if leave_first and dist.is_initialized():
            dist.destroy_process_group()
        _torch_private.bind_thread_to_fresh_c10d_world()
        register_threaded_backend()  # torch's test package, imported since, may have taken it
        dist.init_process_group(
            backend=BACKEND_NAME,
            store=job.store,
            rank=rank,
            world_size=job.world.world_size,
            # Longer than any deadline: the backend honours group timeouts, and a wait on
            # the default group must end in the hang report, not in a TimeoutError.
            timeout=dist.default_pg_timeout,
        )
        if not isinstance(dist.group.WORLD, ThreadedProcessGroup):
            raise RuntimeError(
                f"'{BACKEND_NAME}' created {type(dist.group.WORLD).__name__}, not "
                "distconform.harness.threads' backend: another module re-registered the name"
            )


def _thread_state() -> dict[str, object]:
    """torch's per-thread switches that a run could leave changed for the next one."""
    return {
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "CPU autocast": torch.is_autocast_enabled("cpu"),
        "default device": torch.get_default_device(),
    }


_FRESH_THREAD_STATE: dict[str, object] = {}  # _thread_state() of a new thread, once read


def _leave_as_found() -> tuple[str | None, bool]:
    """Destroy the groups this run created; say why the next run needs new groups, if it
    does, and whether this thread must give way to a fresh one."""
    if not dist.is_initialized():
        return "the run destroyed the default group", False
    for group in list(_torch_private.iter_non_default_groups()):
        dist.destroy_process_group(group)
    # DTensor caches plans by mesh value, and an equal mesh of the next run has new groups;
    # a mesh of a rank thread also differs from its peers' by the thread's ident only, so
    # one rank's cached shard sizes must not serve another's (tests/impl/
    # test_torch_private_impl.py). One of the caches is per thread: cleared on each.
    _torch_private.forget_dtensor_caches()
    if not _FRESH_THREAD_STATE:
        fresh: dict[str, object] = {}
        probe = threading.Thread(target=lambda: fresh.update(_thread_state()))
        probe.start()
        probe.join()
        _FRESH_THREAD_STATE.update(fresh)
    changed = [
        f"{name} left at {value}"
        for name, value in _thread_state().items()
        if value != _FRESH_THREAD_STATE[name]
    ]
    if changed:
        return ", ".join(changed) + " (a fresh rank thread takes over)", True
    return None, False


def _record_error(run: RankResult, error: BaseException) -> None:
    run.error = error
    run.error_type = type(error).__qualname__
    run.error_message = str(error)
    run.traceback = "".join(traceback.format_exception(error))
    run.finished_at = time.monotonic()
    if isinstance(error, CollectiveDeadlockError):
        run.outcome = Outcome.HUNG
    elif _is_secondary(error):
        run.outcome = Outcome.ABORTED_BY_PEER
        run.comm_error = True
    elif _is_skip(error):
        run.outcome = Outcome.SKIPPED
        run.reason = str(error)
    else:
        run.outcome = Outcome.FAILED


def run_threaded(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    seed: int = 0,
    deadline: float = 120.0,
    capture_output: bool = False,
    **kwargs: Any,
) -> RunResult:
    """One-shot: open a runner, run ``fn`` once, close it."""
    with ThreadRunner(
        world_size, seed=seed, deadline=deadline, capture_output=capture_output
    ) as runner:
        return runner.run(fn, *args, **kwargs)
