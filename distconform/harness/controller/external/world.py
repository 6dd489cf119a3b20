"""``--launcher external``: every rank is a pytest process started by torchrun or srun.

torchrun (on one or several nodes) or Slurm's ``srun`` starts the ranks; each runs the
same pytest command, so each collects the same items in the same order (checked at the
start). The harness joins that world (the rendezvous store at ``MASTER_ADDR:MASTER_PORT``:
torchrun's agent store, or one rank 0 hosts under Slurm), runs every marked test whose
world size matches in-process, and exchanges the per-rank results through the store:
rank 0 gathers them, judges the test exactly as for the other launchers and publishes the
verdict, so every rank reports the same outcome and rank 0's report carries every rank's
story.

What happens on each failure kind (docs/how-to/torchrun-and-slurm.md's external-launcher section
says the same):

- A rank whose test fails publishes that in the store at once and destroys its process
  groups, which ends at once any collective a peer is blocked in with it (gloo sees the
  connection close; a watcher on each peer also aborts its groups, which is how NCCL
  peers are released). After any failed test every rank rebuilds the default group on a
  new store prefix, and the session goes on with the next test.
- A rank still running at the deadline publishes its stacks (a watchdog thread), and the
  test is interrupted there. A test stuck in Python code comes back, and the world is
  rebuilt as after a failure. One blocked in C code cannot be reached, and there is no
  parent to kill it: the session stops after that test with the report and a line saying
  why, because that process cannot take part in the next one.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import hashlib
import os
import pickle
import sys
import tempfile
import threading
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from distconform.harness import _torch_private
from distconform.harness.controller.config import ConfigError
from distconform.harness.controller.external.rank import ExternalRank
from distconform.harness.controller.external.report_diversion import report_file
from distconform.harness.rank import hygiene
from distconform.harness.rank.execute import run_task_in_process
from distconform.harness.shared.outcomes import (
    CLEAN_OUTCOMES,
    Outcome,
    RankResult,
    RunResult,
    demote_secondary_failures,
)
from distconform.harness.shared.rank_context import RankContext
from distconform.harness.shared.task import RankTask

# How long rank 0 waits beyond the deadline for a rank's result (its watchdog writes
# stacks at the deadline) before calling it hung.
_REPORT_MARGIN_S = 5.0
_STORE_PREFIX = "distconform"
_SESSION_OVER_KEY = "session-over"
# How often a rank running a test looks for a peer's failure in the store.
_FAILURE_POLL_S = 0.1
# Exit code of a rank that hung and ended itself once rank 0 had reported it.
EXIT_HUNG = 71


class ExternalWorld:
    """This process's membership in the torchrun world, for the whole pytest session."""

    def __init__(self, backend: str, device_type: str, join_timeout: float = 300.0) -> None:
        self.me = ExternalRank.from_environment()
        self.backend = backend
        self.device_type = device_type
        self.join_timeout = join_timeout
        self.broken_reason: str | None = None
        self._sequence = 0
        self._client: dist.Store | None = None
        self._store: dist.Store | None = None
        self._device = torch.device(device_type)

    @property
    def rank(self) -> int:
        return self.me.rank

    @property
    def world_size(self) -> int:
        return self.me.world_size

    def join(self) -> None:
        timeout = timedelta(seconds=self.join_timeout)
        if self.device_type != "cpu":
            torch.accelerator.set_device_index(self.me.local_rank)
            self._device = torch.device(self.device_type, self.me.local_rank)
        self._client = dist.TCPStore(
            self.me.master_addr,
            self.me.master_port,
            self.me.world_size,
            is_master=self.me.hosts_store,
            timeout=timeout,
        )
        self._store = dist.PrefixStore(_STORE_PREFIX, self._client)
        self._init_default_group(generation=0)

    def _init_default_group(self, generation: int) -> None:
        """The default group on its own store prefix: a rebuilt one never meets the keys of
        the one before it."""
        if dist.is_initialized():
            return  # the user's own code (a conftest) initialised it: keep theirs
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"{_STORE_PREFIX}-world/{generation}", self._client),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.join_timeout),
            device_id=self._device if self.device_type != "cpu" else None,
        )

    def check_same_collection(self, nodeids: list[str]) -> None:
        """Every rank must run the same items in the same order, or collectives mismatch."""
        digest = hashlib.sha256("\n".join(nodeids).encode()).hexdigest()
        self._store.set(f"collection/{self.rank}", digest)
        keys = [f"collection/{r}" for r in range(self.world_size)]
        self._store.wait(keys, timedelta(seconds=self.join_timeout))
        digests = {r: self._store.get(k).decode() for r, k in enumerate(keys)}
        different = [r for r, d in digests.items() if d != digests[0]]
        if different:
            raise ConfigError(
                f"ranks {different} collected different tests than rank 0; every rank must "
                f"run the same pytest command (same paths, -k, markers and options)"
            )

    def run(self, task: RankTask, deadline: float) -> RunResult:
        """Run ``task`` here; every rank returns the same judged RunResult."""
        self._sequence += 1
        sequence = self._sequence
        ctx = RankContext(
            rank=self.rank,
            world_size=self.world_size,
            device=self._device,
            backend=self.backend,
            seed=task.seed,
            launcher="external",
        )
        started = time.monotonic()
        watchdog = _StackWatchdog(deadline, lambda stacks: self._give_up(sequence, stacks))
        watch = _PeerFailureWatch(self._store, f"{sequence}/failed", _abort_groups)
        result: RankResult | None = None
        try:
            # An interrupt that lands in the harness's own code after the test body leaves
            # no result: the rank still reports the hang.
            with contextlib.suppress(DeadlineInterrupt):
                result = run_task_in_process(task, ctx, trace_dir=None)
        finally:
            watchdog.test_returned()
            watch.cancel()
        if result is None:
            result = RankResult(
                rank=self.rank,
                outcome=Outcome.HUNG,
                started_at=started,
                finished_at=time.monotonic(),
            )
        if watchdog.stacks is not None:
            result = _came_back_hung(result, watchdog.stacks, deadline)
        if result.outcome not in CLEAN_OUTCOMES:
            # Tell the peers at once, and close every connection this rank has: a peer
            # blocked in a collective with it fails now, not at the group's timeout.
            self._store.set(f"{sequence}/failed", str(self.rank))
            _release_peers()
        self._store.set(f"{sequence}/result/{self.rank}", pickle.dumps(result))
        if self.rank == 0:
            run = self._gather(sequence, task, started, deadline)
            self._store.set(f"{sequence}/verdict", pickle.dumps(run))
        else:
            run = self._await_verdict(sequence, deadline)
        gone = [r.rank for r in run.results if _is_gone(r)]
        if gone:
            self.broken_reason = (
                f"rank(s) {', '.join(map(str, gone))} of the {self.me.starter} world did not "
                f"come back from {task.test_id} (blocked outside Python code, or dead): their "
                f"processes cannot run another test, so the session stops here; run the rest "
                f"with a new {self.me.starter} job"
            )
        elif any(r.outcome not in CLEAN_OUTCOMES for r in run.results) or run.hygiene_violations:
            self._rebuild(sequence, task.test_id, run, deadline)
        return run

    def _rebuild(self, sequence: int, test_id: str, run: RunResult, deadline: float) -> None:
        """After a failed (or untidy) test every rank starts the next one on a new default
        group; the old one may be broken half-way through a collective."""
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            _torch_private.forget_dtensor_caches(self.device_type)
            self._init_default_group(generation=sequence)
            broken = hygiene.check_default_group(min(30.0, deadline))
        except Exception as exc:  # the world could not be rebuilt: nothing can run on it
            broken = [f"the default group could not be rebuilt: {exc}"]
        if broken:
            run.harness_notes.extend(broken)
            self.broken_reason = (
                f"the {self.me.starter} world could not be rebuilt after {test_id} "
                f"({'; '.join(broken)}); start a new {self.me.starter} job"
            )

    def _gather(self, sequence: int, task: RankTask, started: float, deadline: float) -> RunResult:
        results: list[RankResult] = []
        give_up_at = started + deadline + _REPORT_MARGIN_S
        for rank in range(self.world_size):
            key = f"{sequence}/result/{rank}"
            remaining = max(0.1, give_up_at - time.monotonic())
            try:
                self._store.wait([key], timedelta(seconds=remaining))
                results.append(pickle.loads(self._store.get(key)))
            except dist.DistStoreError:
                results.append(self._missing_rank(sequence, rank, deadline))
        run = RunResult(
            results=results,
            seed=task.seed,
            deadline=deadline,
            started_at=started,
            finished_at=time.monotonic(),
            harness_notes=[self._where_output_went()],
        )
        demote_secondary_failures(run)
        return run

    def _where_output_went(self) -> str:
        if self.world_size == 1:
            return ""
        others = report_file(replace(self.me, rank=1)).parent
        ranks = "rank 1" if self.world_size == 2 else f"ranks 1 to {self.world_size - 1}"
        return (
            f"external launcher: the output of {ranks} is in their own pytest reports, "
            f"{others}/rank<N>.txt (on their nodes)"
        )

    def _missing_rank(self, sequence: int, rank: int, deadline: float) -> RankResult:
        stacks_key = f"{sequence}/stacks/{rank}"
        stacks = None
        if self._store.check([stacks_key]):
            stacks = self._store.get(stacks_key).decode(errors="replace")
        return RankResult(
            rank=rank,
            outcome=Outcome.HUNG,
            stacks=stacks,
            note=f"no result within the {deadline:.1f} s deadline",
        )

    def _await_verdict(self, sequence: int, deadline: float) -> RunResult:
        self._store.wait(
            [f"{sequence}/verdict"], timedelta(seconds=deadline + 2 * _REPORT_MARGIN_S)
        )
        return pickle.loads(self._store.get(f"{sequence}/verdict"))

    def _give_up(self, sequence: int, stacks: str) -> None:
        """Called from the watchdog of a rank still running at the deadline.

        Publish the stacks for rank 0's report, wait until rank 0 has finished the
        session, then end this process: nothing else can stop the stuck test, and
        torchrun waits for every rank.
        """
        self._store.set(f"{sequence}/stacks/{self.rank}", stacks)
        try:
            self._store.wait([_SESSION_OVER_KEY], timedelta(seconds=self.join_timeout))
            self._store.set(f"{_SESSION_OVER_KEY}-{self.rank}", "hung")
        finally:
            os._exit(EXIT_HUNG)

    def close(self) -> None:
        if self._store is not None:
            self._store.set(_SESSION_OVER_KEY, str(self.rank))
            self._store.set(f"{_SESSION_OVER_KEY}-{self.rank}", "1")
        if dist.is_initialized() and self.broken_reason is None:
            dist.destroy_process_group()
        if self._store is not None:
            # Rank 0 ends last: under torchrun a rank that exits with failures gets the
            # others killed, so every other rank waits until rank 0's session (its report
            # included) is over; and under srun rank 0's process serves the store, so rank 0
            # waits until every other rank has seen that. Bounded: a rank that never ends is
            # not waited for. The report is written by now, but a console redirected to a
            # file holds its tail in a buffer, which a kill while waiting here would lose.
            sys.stdout.flush()
            sys.stderr.flush()
            others = range(self.world_size) if self.rank == 0 else (0,)
            with contextlib.suppress(Exception):
                self._store.wait(
                    [f"{_SESSION_OVER_KEY}-{r}" for r in others], timedelta(seconds=30)
                )


def _came_back_hung(result: RankResult, stacks: str, deadline: float) -> RankResult:
    """A test interrupted at its deadline is still a hang, with the stacks of that moment."""
    result.outcome = Outcome.HUNG
    result.stacks = stacks
    result.error_type = result.error_message = result.traceback = None
    result.note = (
        f"still running at the {deadline:.1f} s deadline; interrupted there, so this rank "
        f"goes on to the next test"
    )
    return result


def _is_gone(result: RankResult) -> bool:
    """A rank that sent no result (hung in C code, or dead) cannot run the next test."""
    if result.outcome is Outcome.CRASHED:
        return True
    return result.outcome is Outcome.HUNG and result.finished_at is None


def _release_peers() -> None:
    """Destroy every process group of this rank: its peers' pending collectives with it fail
    at once (gloo sees the connections close), instead of waiting for the timeout."""
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


def _abort_groups() -> None:
    """Abort this rank's groups from the watcher thread: NCCL ends the collective the main
    thread is blocked in. gloo ignores abort; its peers are released by the failing rank
    closing its connections (``_release_peers``)."""
    if not dist.is_initialized():
        return
    for group in _torch_private.live_process_groups():
        with contextlib.suppress(Exception):
            group.abort()


class _PeerFailureWatch:
    """While this rank runs a test, watch the store for a peer's failure and then abort."""

    def __init__(self, store: dist.Store, key: str, abort) -> None:
        self._store = store
        self._key = key
        self._abort = abort
        self._cancelled = threading.Event()
        self.seen = False
        self._thread = threading.Thread(
            target=self._watch, name="distconform-peer-watch", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        while not self._cancelled.wait(_FAILURE_POLL_S):
            try:
                failed = self._store.check([self._key])
            except Exception:  # the store is gone: the session is ending
                return
            if failed:
                self.seen = True
                if not self._cancelled.wait(1.0):  # gloo peers need no abort: see above
                    self._abort()
                return

    def cancel(self) -> None:
        self._cancelled.set()
        self._thread.join(timeout=1.0)


class DeadlineInterrupt(BaseException):
    """Raised in a rank's test at its deadline, so the rank comes back for the next test."""


# How long an interrupted test gets to come back before its rank counts as gone.
_COME_BACK_S = 5.0


def _raise_in_thread(thread_id: int, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in another thread at its next Python instruction (CPython's
    documented C API; code blocked inside a C call is not reached)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type)
    )


class _StackWatchdog:
    """At the deadline: dump this rank's stacks, then interrupt the test in the main thread.

    A test stuck in Python code comes back (``DeadlineInterrupt``) and its rank takes part
    in the next test; one that is not back within ``_COME_BACK_S`` (blocked in C code) is
    handed to ``on_gone``.
    """

    def __init__(self, deadline: float, on_gone) -> None:
        self.stacks: str | None = None
        self._main = threading.get_ident()
        self._on_gone = on_gone
        self._lock = threading.Lock()
        self._returned = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, args=(deadline,), name="distconform-watchdog", daemon=True
        )
        self._thread.start()

    def _watch(self, deadline: float) -> None:
        if self._returned.wait(deadline):
            return
        with tempfile.TemporaryFile("w+") as handle:
            faulthandler.dump_traceback(file=handle, all_threads=True)
            handle.seek(0)
            self.stacks = handle.read()
        with self._lock:  # never interrupt a test that has already returned
            if self._returned.is_set():
                return
            _raise_in_thread(self._main, DeadlineInterrupt)
        if not self._returned.wait(_COME_BACK_S):
            self._on_gone(self.stacks)

    def test_returned(self) -> None:
        """No interrupt comes after this returns; one that landed just before is absorbed."""
        while True:
            try:
                with self._lock:
                    self._returned.set()
                break
            except DeadlineInterrupt:  # injected as the test returned: the flag is set now
                continue
        self._thread.join(timeout=1.0)
