"""Run a function on N rank threads of the current process, with the ``threaded`` backend.

    with ThreadRunner(world_size=4) as runner:
        result = runner.run(fn, arg, deadline=30.0)
    result.raise_on_failure()  # harness.outcomes.RunFailedError
    result.values  # [fn's return value on rank 0, 1, 2, 3]

Each run starts N fresh threads that each call ``init_process_group("threaded")`` on a
world shared only by that run, run ``fn(*args, **kwargs)``, and destroy their groups.
Threads are cheap next to the rest of a test (~0.1 ms each, first torch op included);
fresh threads and a fresh world per run mean nothing leaks from one run into the next:
not a stray async collective, a subgroup or an abort flag, nor torch's thread-local
state (grad mode, autocast) that a test left changed.

Isolation (see :mod:`harness.threads.world` for why one rank runs at a time):
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
A run's result is the harness's one :class:`~harness.outcomes.RunResult`, the same the
process launcher returns; each rank's exception object is kept on ``RankResult.error``.

The thread-local c10d world is installed while the runner is open and uninstalled by
``close()``; threads that are not rank threads keep seeing the ordinary c10d state even
while it is installed.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from harness import _torch_private
from harness.outcomes import Outcome, RankResult, RunResult
from harness.threads.backend import BACKEND_NAME, ThreadedProcessGroup, register_threaded_backend
from harness.threads.output import RankOutputCapture
from harness.threads.store import RunStore
from harness.threads.world import (
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

    def close(self) -> None:
        """Uninstall the thread-local c10d world (idempotent).

        Hung threads left by an abandoned run stay alive (threads cannot be killed); they
        are daemon threads, and their c10d cleanup is skipped so they cannot touch the
        process-wide c10d state after this.
        """
        if self._installed:
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
        limit = self.deadline if deadline is None else deadline
        world = ThreadWorld(self.world_size, self.seed)
        store = RunStore(world, timeout=timedelta(seconds=limit))
        runs: list[RankResult | None] = [None] * self.world_size
        excepthook = sys.excepthook  # init_process_group wraps it on every call
        start = time.monotonic()
        threads = [
            threading.Thread(
                target=self._rank_main,
                args=(world, store, rank, runs, fn, args, kwargs, limit),
                name=f"distconform-rank{rank}",
                daemon=True,  # a hung rank must not keep the interpreter alive at exit
            )
            for rank in range(self.world_size)
        ]
        capture = RankOutputCapture(self.world_size) if self.capture_output else None
        try:
            if capture is not None:
                capture.__enter__()
            for thread in threads:
                thread.start()
            try:
                finished = self._wait(world, start + limit)
            except BaseException:  # KeyboardInterrupt: release the ranks before leaving
                world.abandon("the runner was interrupted")
                raise
            notes: list[str] = []
            if not finished:
                self._abandon(world, threads, runs, limit)
            for thread in threads:
                if not thread.is_alive():
                    thread.join()
        finally:
            if capture is not None:
                capture.__exit__(None, None, None)
            world.rng.give_back_to_caller()
            sys.excepthook = excepthook
            # DTensor's process-wide caches key by mesh, and a mesh of a rank thread differs
            # from its peers' by the thread's ident only; the next run's threads reuse these
            # idents in another order, so a cached plan holding one rank's shard sizes would
            # serve another rank (tests/impl/test_torch_private_impl.py).
            _torch_private.forget_dtensor_caches()
        result = RunResult(
            results=[r for r in runs if r is not None],
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
        return result

    def _wait(self, world: ThreadWorld, end: float) -> bool:
        with world.lock:
            while not world.all_done():
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return False
                world.main_cond.wait(remaining)
        return True

    def _abandon(
        self,
        world: ThreadWorld,
        threads: list[threading.Thread],
        runs: list[RankResult | None],
        limit: float,
    ) -> None:
        frames = sys._current_frames()
        stacks = {
            rank: "".join(traceback.format_stack(frames[t.ident]))
            for rank, t in enumerate(threads)
            if t.ident in frames and t.is_alive()
        }
        states = world.describe_states()
        world.abandon(f"the run passed its {limit:g} s deadline")
        # Ranks that were waiting get released by the abandon and unwind quickly; the one
        # that was running is the hung one and will not, so nobody waits for it.
        grace_end = time.monotonic() + _UNWIND_GRACE_S
        for rank, thread in enumerate(threads):
            if states[rank] != "running":
                thread.join(max(0.0, grace_end - time.monotonic()))
        now = time.monotonic()
        for rank, thread in enumerate(threads):
            run = runs[rank]
            if thread.is_alive() or run is None or run.finished_at is None:
                # A fresh record: the zombie thread keeps mutating its own one.
                runs[rank] = RankResult(
                    rank=rank,
                    outcome=Outcome.HUNG,
                    started_at=run.started_at if run is not None else now,
                    finished_at=now,
                    traceback=f"rank {rank} {states[rank]} at the {limit:g} s deadline",
                    stacks=stacks.get(rank),
                )
                if thread.is_alive():
                    self._zombies.append(thread)
            elif rank in stacks:
                run.stacks = stacks[rank]
        if self._zombies:
            names = ", ".join(t.name for t in self._zombies if t.is_alive())
            self.unusable_reason = (
                f"a previous run hung and left rank threads alive ({names}); "
                "replace this runner and its process"
            )

    @staticmethod
    def _rank_main(
        world: ThreadWorld,
        store: RunStore,
        rank: int,
        runs: list[RankResult | None],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        limit: float,
    ) -> None:
        run = runs[rank] = RankResult(
            rank=rank, outcome=Outcome.PASSED, started_at=time.monotonic()
        )
        initialized = False
        try:
            bind_rank(world, rank)
            _torch_private.bind_thread_to_fresh_c10d_world()
            world.enter(rank)
            run.started_at = time.monotonic()
            dist.init_process_group(
                backend=BACKEND_NAME,
                store=store,
                rank=rank,
                world_size=world.world_size,
                # Longer than any deadline: the backend honours group timeouts, and a wait on
                # the default group must end in the hang report, not in a TimeoutError.
                timeout=dist.default_pg_timeout,
            )
            initialized = True
            if not isinstance(dist.group.WORLD, ThreadedProcessGroup):
                raise RuntimeError(
                    f"'{BACKEND_NAME}' created {type(dist.group.WORLD).__name__}, not "
                    "harness.threads' backend: another module re-registered the name"
                )
            run.value = fn(*args, **kwargs)
        except BaseException as error:
            _record_error(run, error)
            if run.outcome is not Outcome.ABORTED_BY_PEER:
                world.fail(rank, error)
        finally:
            if initialized and not world.abandoned:
                try:
                    dist.destroy_process_group()
                except BaseException as error:
                    if run.error is None:
                        _record_error(run, error)
                        world.fail(rank, error)
            run.finished_at = time.monotonic()
            try:
                _torch_private.unbind_thread_c10d_world()
                bind_rank(None)
            finally:
                world.leave(rank)  # always: the others (and the runner) wait for it


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
