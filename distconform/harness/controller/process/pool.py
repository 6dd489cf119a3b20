"""A pool of rank processes that joined one process group and run tasks on demand.

Every wait here has a bound. A rank that does not answer by the deadline gets its
Python stacks dumped (faulthandler on SIGUSR1, written to a per-rank file) and is
then killed together with the whole pool's process group.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch.distributed as dist

from distconform.harness.comm import flight_files
from distconform.harness.controller.pools import PoolStartFailure
from distconform.harness.controller.process.spawning import (
    RankHandle,
    start_rank,
    with_package_on_path,
)
from distconform.harness.shared.outcomes import (
    CLEAN_OUTCOMES,
    Outcome,
    RankResult,
    RunResult,
    needs_barrier,
    stale_group_names,
    unbalanced_ledgers,
)
from distconform.harness.shared.protocol import (
    BETWEEN_TESTS_TIMEOUT_S,
    EXIT_PARENT_GONE,
    WorkerSpec,
)
from distconform.harness.shared.rank_output import RankOutput
from distconform.harness.shared.task import RankTask

# How long the parent waits for a rank's output after it has finished or died.
_OUTPUT_SETTLE_S = 2.0
# How long a rank has to write its stacks after SIGUSR1 before it is killed anyway.
_STACK_DUMP_WAIT_S = 1.0


@dataclass(frozen=True)
class ProcessPoolSpec:
    world_size: int
    backend: str
    device_type: str
    threads_per_rank: int
    start_timeout: float = 120.0
    rendezvous: str = "file"
    start_method: str = "forkserver"
    # How many devices the ranks use, round-robin (fewer than ranks when they share them),
    # and whether init_process_group binds each rank to its device.
    devices: int | None = None
    bind_device: bool = True
    env: tuple[tuple[str, str], ...] = ()
    echo: Callable[[str], None] | None = field(default=None, compare=False)
    joins_world: bool = True


@dataclass
class _Rank:
    rank: int
    popen: RankHandle
    conn: Connection
    output: RankOutput
    stack_path: Path
    stack_offset: int = 0


def signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


class ProcessPool:
    """``world_size`` rank processes in one OS process group, in one c10d world."""

    launcher = "process"
    #: Whether the one process this pool starts hosts the ranks as threads.
    hosts_rank_threads = False

    def __init__(self, spec: ProcessPoolSpec) -> None:
        self.spec = spec
        self.broken = False
        self._ranks: list[_Rank] = []
        self._task_counter = 0
        self._tmpdir: str | None = None
        self._store_server = None
        self._start_timeout = spec.start_timeout

    # --- life cycle ----------------------------------------------------------------

    @property
    def started(self) -> bool:
        return bool(self._ranks)

    @property
    def pids(self) -> list[int]:
        return [r.popen.pid for r in self._ranks]

    @property
    def rendezvous_dir(self) -> str | None:
        return self._tmpdir

    def start(self, timeout: float | None = None) -> None:
        """Spawn the ranks and wait until all joined the process group.

        ``timeout`` shortens the spec's start timeout (never lengthens it).
        """
        self._start_timeout = min(self.spec.start_timeout, timeout or self.spec.start_timeout)
        # mkdtemp creates the directory with mode 0700: the FileStore and the
        # stack dumps are readable by this user only.
        self._tmpdir = tempfile.mkdtemp(prefix="distconform-")
        store = self._make_store()
        try:
            for rank in range(self.process_count):
                self._ranks.append(self._spawn(rank, store))
            self._await_ready()
        except BaseException:
            self.kill()
            raise

    def _make_store(self) -> dict:
        if self.spec.rendezvous == "file":
            return {"kind": "file", "path": os.path.join(self._tmpdir, "filestore")}
        if self.spec.rendezvous == "tcp":
            # Bind the listening socket ourselves: TCPStore's host argument would
            # listen on every interface, and a guessed port can collide.
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
            listener.listen(self.spec.world_size * 2)
            port = listener.getsockname()[1]
            self._store_server = dist.TCPStore(
                "127.0.0.1",
                port,
                self.spec.world_size,
                is_master=True,
                timeout=timedelta(seconds=self.spec.start_timeout),
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
            return {"kind": "tcp", "host": "127.0.0.1", "port": port}
        raise ValueError(f"unknown rendezvous {self.spec.rendezvous!r}: use 'file' or 'tcp'")

    def alive(self) -> bool:
        # An idle rank has nothing to say; a readable control socket means it is gone
        # (the kernel closed its end), even before its exit status has arrived.
        return bool(self._ranks) and all(
            r.popen.poll() is None and not r.conn.poll(0) for r in self._ranks
        )

    @property
    def process_count(self) -> int:
        """How many OS processes the pool runs (one per rank here)."""
        return self.spec.world_size

    def _worker_spec(self, rank: int, store: dict, control_fd: int, stack_path: Path) -> WorkerSpec:
        return WorkerSpec(
            rank=rank,
            world_size=self.spec.world_size,
            backend=self.spec.backend,
            device_type=self.spec.device_type,
            device_index=rank % (self.spec.devices or self.spec.world_size),
            bind_device=self.spec.bind_device,
            launcher=self.launcher,
            thread_host=self.hosts_rank_threads,
            joins_world=self.spec.joins_world,
            threads=self.spec.threads_per_rank,
            control_fd=control_fd,
            stack_path=str(stack_path),
            store=store,
            init_timeout=self.spec.start_timeout,
            parent_pid=os.getpid(),
            sys_path=tuple(p for p in sys.path if p),
        )

    def _spawn(self, rank: int, store: dict) -> _Rank:
        parent_sock, child_sock = socket.socketpair()
        stack_path = Path(self._tmpdir) / f"stacks-rank{rank}.txt"
        spec = self._worker_spec(rank, store, child_sock.fileno(), stack_path)
        try:
            process = start_rank(
                self.spec.start_method, spec.to_json(), self._rank_env(), child_sock.fileno()
            )
        finally:
            child_sock.close()
        output = RankOutput(rank, process.stdout, self.spec.echo)
        return _Rank(rank, process, Connection(parent_sock.detach()), output, stack_path)

    def _rank_env(self) -> dict[str, str]:
        env = with_package_on_path(dict(os.environ))
        env["PYTHONUNBUFFERED"] = "1"
        threads = str(self.spec.threads_per_rank)
        env["OMP_NUM_THREADS"] = threads
        env["MKL_NUM_THREADS"] = threads
        # Every rank of a pool is on this host: gloo (the CPU backend, and the one that
        # staged_gloo carries device tensors through) connects over loopback, whatever the
        # host's name resolves to.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.update(dict(self.spec.env))
        return env

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self._start_timeout
        waiting = {r.conn: r for r in self._ranks}
        failed: list[RankResult] = []
        while waiting and not failed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(waiting), timeout=remaining):
                rank = waiting.pop(conn)
                try:
                    conn.recv()
                except (EOFError, OSError):
                    failed.append(self._crash_result(rank, started_at=None))
        if failed or waiting:
            if failed:
                outcome, note = Outcome.ABORTED_BY_PEER, "stopped: another rank failed to start"
            else:
                outcome = Outcome.HUNG
                note = f"did not join the process group within {self._start_timeout:.1f} s"
            results = failed + [
                RankResult(
                    rank=r.rank,
                    outcome=outcome,
                    note=note,
                    stacks=self._dump_stacks([r]).get(r.rank),
                )
                for r in waiting.values()
            ]
            self.kill()
            for result in results:
                rank = self._ranks[result.rank]
                rank.output.wait_closed(_OUTPUT_SETTLE_S)
                result.output = rank.output.text_since(0)
            raise PoolStartFailure(self._start_failure_message(results), sorted_results(results))

    def _start_failure_message(self, results: list[RankResult]) -> str:
        parts = [f"rank {r.rank} {r.outcome.value} ({r.summary()})" for r in results]
        return (
            f"could not start {self.spec.world_size} rank processes "
            f"(backend {self.spec.backend}, device {self.spec.device_type}): " + "; ".join(parts)
        )

    def close(self, timeout: float = 10.0) -> None:
        """Ask the ranks to leave, wait a bounded time, then kill what is left."""
        for rank in self._ranks:
            with contextlib.suppress(OSError):
                rank.conn.send(None)
        end = time.monotonic() + timeout
        for rank in self._ranks:
            try:
                rank.popen.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        self.kill()

    def kill(self) -> None:
        for rank in self._ranks:
            rank.popen.kill_group()
        for rank in self._ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rank.popen.wait(timeout=5.0)
            for stream in (rank.popen.stdin, rank.conn):
                with contextlib.suppress(OSError):
                    stream.close()
        self.broken = True
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._store_server = None

    # --- running a task --------------------------------------------------------------

    def run(self, task: RankTask, deadline: float, peer_grace: float) -> RunResult:
        """Run ``task`` on every rank; never waits longer than ``deadline`` seconds."""
        self._task_counter += 1
        task = _with_task_id(task, self._task_counter)
        started = time.monotonic()
        marks = {r.rank: r.output.mark() for r in self._ranks}
        results: dict[int, RankResult] = {}
        message = pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)  # once, for every rank
        for rank in self._ranks:
            try:
                rank.conn.send_bytes(message)
            except OSError:
                results[rank.rank] = self._crash_result(rank, started)
        hard_stop = started + deadline
        abort_at: float | None = None
        pending = {r.conn: r for r in self._ranks if r.rank not in results}
        while pending:
            if any(_is_primary(r) for r in results.values()) and abort_at is None:
                abort_at = time.monotonic() + peer_grace
            stop = min(hard_stop, abort_at) if abort_at is not None else hard_stop
            remaining = stop - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)
                try:
                    results[rank.rank] = conn.recv()
                except (EOFError, OSError):
                    results[rank.rank] = self._crash_result(rank, started)
        notes: list[str] = []
        # harness/comm: read the ranks' collective traces before a kill removes the temp dir.
        traces = None
        if pending or any(r.outcome not in CLEAN_OUTCOMES for r in results.values()):
            traces = flight_files.read_traces(self._tmpdir, self.spec.world_size)
        if pending:
            self._stop_unfinished(list(pending.values()), results, started, deadline, abort_at)
            notes.append(self._stop_note(results, deadline, abort_at, hard_stop))
        states = {rank: result.outcome.value for rank, result in results.items()}
        if (comm_note := flight_files.diagnosis_note(traces, states)) is not None:
            notes.append(comm_note)
        self._attach_output(task, results, marks)
        retire = None
        if any(r.outcome not in CLEAN_OUTCOMES or r.hygiene for r in results.values()):
            self.broken = True
        else:
            self._collect_between_tests_checks(results, min(BETWEEN_TESTS_TIMEOUT_S, deadline))
            namings = {rank: r.group_naming for rank, r in results.items()}
            if all(naming is not None for naming in namings.values()):
                retire = stale_group_names(namings)
        return RunResult(
            results=sorted_results(results.values()),
            seed=task.seed,
            deadline=deadline,
            started_at=started,
            finished_at=time.monotonic(),
            harness_notes=notes,
            retire_pool=retire,
        )

    def _collect_between_tests_checks(self, results: dict[int, RankResult], timeout: float) -> None:
        """After a clean test the default group must be in step for the next one.

        Equal counts of default-group collectives on every rank show it without a
        collective; ranks that could not count (``needs_barrier``) end the test with a
        barrier on the group and report it.
        """
        barrier = {rank.rank: needs_barrier(results[rank.rank]) for rank in self._ranks}
        if not any(barrier.values()):
            problems = unbalanced_ledgers({rank: r.ledger for rank, r in results.items()})
        elif not all(barrier.values()):
            # Some ranks are in a barrier the others will never enter: only a new pool is
            # clean, so nothing is read from them.
            problems = [
                "some ranks received from any source (their calls cannot be matched) and "
                "the others did not; the default process group is checked with a new pool"
            ]
        else:
            problems = None
        if problems is not None:
            for result in results.values():
                result.hygiene.extend(problems)
            self.broken = self.broken or bool(problems)
            return
        end = time.monotonic() + timeout + _OUTPUT_SETTLE_S
        pending = {r.conn: r for r in self._ranks}
        while pending and time.monotonic() < end:
            for conn in wait(list(pending), timeout=max(0.0, end - time.monotonic())):
                rank = pending.pop(conn)
                try:
                    results[rank.rank].hygiene.extend(conn.recv())
                except (EOFError, OSError):
                    results[rank.rank].hygiene.append("the rank died after the test")
        for rank in pending.values():
            results[rank.rank].hygiene.append(
                f"the rank did not finish the between-tests barrier within {timeout:g} s"
            )
        if any(r.hygiene for r in results.values()):
            self.broken = True

    def _stop_unfinished(
        self,
        unfinished: list[_Rank],
        results: dict[int, RankResult],
        started: float,
        deadline: float,
        abort_at: float | None,
    ) -> None:
        timed_out = abort_at is None or time.monotonic() >= started + deadline
        stacks = self._dump_stacks(unfinished)
        now = time.monotonic()
        for rank in unfinished:
            if timed_out:
                outcome, note = Outcome.HUNG, f"still running at the {deadline:.1f} s deadline"
            else:
                outcome, note = Outcome.ABORTED_BY_PEER, "stopped after a peer failed"
            results[rank.rank] = RankResult(
                rank=rank.rank,
                outcome=outcome,
                started_at=started,
                finished_at=None if timed_out else now,
                stacks=stacks.get(rank.rank),
                note=note,
            )
        self.kill()

    @staticmethod
    def _stop_note(
        results: dict[int, RankResult], deadline: float, abort_at: float | None, hard_stop: float
    ) -> str:
        stopped = sorted(
            r.rank for r in results.values() if r.outcome in (Outcome.HUNG, Outcome.ABORTED_BY_PEER)
        )
        if abort_at is not None and abort_at < hard_stop:
            return f"ranks {stopped} were killed after the grace period that follows a failure"
        return (
            f"ranks {stopped} did not finish within the {deadline:.1f} s deadline and were killed"
        )

    def _dump_stacks(self, ranks: list[_Rank]) -> dict[int, str]:
        """Ask each rank for all its threads' Python stacks; return what they wrote."""
        offsets = {}
        for rank in ranks:
            offsets[rank.rank] = _file_size(rank.stack_path)
            if rank.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank.popen.pid, signal.SIGUSR1)
        end = time.monotonic() + _STACK_DUMP_WAIT_S
        sizes = {r.rank: -1 for r in ranks}
        while time.monotonic() < end:
            time.sleep(0.05)
            now_sizes = {r.rank: _file_size(r.stack_path) for r in ranks}
            grew = all(now_sizes[k] > offsets[k] for k in now_sizes)
            if grew and now_sizes == sizes:
                break
            sizes = now_sizes
        return {r.rank: _read_from(r.stack_path, offsets[r.rank]) for r in ranks}

    def _crash_result(self, rank: _Rank, started_at: float | None) -> RankResult:
        seen_at = time.monotonic()
        offset = rank.stack_offset
        try:
            returncode = rank.popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            returncode = None
        note = None
        if returncode == EXIT_PARENT_GONE:
            note = "the rank saw its parent disappear"
        return RankResult(
            rank=rank.rank,
            outcome=Outcome.CRASHED,
            started_at=started_at,
            finished_at=seen_at,
            exit_code=returncode,
            signal_name=signal_name(returncode),
            stacks=_read_from(rank.stack_path, offset) or None,
            note=note,
        )

    def _attach_output(
        self, task: RankTask, results: dict[int, RankResult], marks: dict[int, int]
    ) -> None:
        for rank in self._ranks:
            if rank.popen.poll() is None:
                rank.output.wait_for_task_end(task.task_id, _OUTPUT_SETTLE_S)
            else:
                rank.output.wait_closed(_OUTPUT_SETTLE_S)
            results[rank.rank].output = rank.output.text_since(marks[rank.rank])
            rank.stack_offset = _file_size(rank.stack_path)


def _is_primary(result: RankResult) -> bool:
    if result.outcome is Outcome.CRASHED:
        return True
    return result.outcome is Outcome.FAILED and not result.comm_error


def sorted_results(results) -> list[RankResult]:
    return sorted(results, key=lambda r: r.rank)


def _with_task_id(task: RankTask, task_id: int) -> RankTask:
    return replace(task, task_id=task_id)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
