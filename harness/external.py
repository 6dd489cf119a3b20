"""``--launcher external``: every rank is a pytest process started by torchrun.

torchrun (on one or several nodes) starts the ranks; each runs the same pytest
command, so each collects the same items in the same order (checked at the start).
The harness joins the world torchrun set up (env:// rendezvous), runs every marked
test whose world size matches the torchrun world in-process, and exchanges the
per-rank results through the rendezvous store: rank 0 gathers them, judges the test
exactly as for the other launchers and publishes the verdict, so every rank reports
the same outcome and rank 0's report carries every rank's story.

There is no parent that can kill a rank here. A rank still running at the deadline
writes its own stacks (a watchdog thread) and the session stops after that test,
because the world can no longer be trusted; a rank blocked in a collective waits for
the process-group timeout, which the harness sets below the deadline.
"""

from __future__ import annotations

import faulthandler
import hashlib
import os
import pickle
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from harness.config import ConfigError
from harness.outcomes import Outcome, RankResult, RunResult, demote_secondary_failures
from harness.rank import hygiene
from harness.rank.context import RankContext
from harness.rank.execute import run_task_in_process
from harness.task import RankTask

_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How long rank 0 waits beyond the deadline for a rank's result (its watchdog writes
# stacks at the deadline) before calling it hung.
_REPORT_MARGIN_S = 5.0
_STORE_PREFIX = "distconform"
_SESSION_OVER_KEY = "session-over"
# Exit code of a rank that hung and ended itself once rank 0 had reported it.
EXIT_HUNG = 71


@dataclass(frozen=True)
class ExternalRank:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environment(cls) -> ExternalRank:
        missing = [name for name in _REQUIRED_ENV if name not in os.environ]
        if missing:
            raise ConfigError(
                f"--launcher external joins a world started by torchrun, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; run "
                f"`torchrun --nproc-per-node N -m pytest ... --launcher external`"
            )
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
        )


class ExternalWorld:
    """This process's membership in the torchrun world, for the whole pytest session."""

    def __init__(self, backend: str, device_type: str, join_timeout: float = 300.0) -> None:
        self.me = ExternalRank.from_environment()
        self.backend = backend
        self.device_type = device_type
        self.join_timeout = join_timeout
        self.broken_reason: str | None = None
        self._sequence = 0
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
        device_id = None
        if self.device_type != "cpu":
            torch.accelerator.set_device_index(self.me.local_rank)
            self._device = torch.device(self.device_type, self.me.local_rank)
            device_id = self._device
        if not dist.is_initialized():
            dist.init_process_group(self.backend, timeout=timeout, device_id=device_id)
        client = dist.TCPStore(
            self.me.master_addr,
            self.me.master_port,
            self.me.world_size,
            is_master=False,
            timeout=timeout,
        )
        self._store = dist.PrefixStore(_STORE_PREFIX, client)

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
        try:
            result = run_task_in_process(task, ctx, trace_dir=None)
        finally:
            watchdog.cancel()
        self._store.set(f"{sequence}/result/{self.rank}", pickle.dumps(result))
        if self.rank == 0:
            run = self._gather(sequence, task, started, deadline)
            self._store.set(f"{sequence}/verdict", pickle.dumps(run))
        else:
            run = self._await_verdict(sequence, deadline)
        every_rank_returned = not run.by_outcome(Outcome.HUNG, Outcome.CRASHED)
        if every_rank_returned and not run.hygiene_violations:
            # Only now is it known that every rank is free to enter the barrier. A test
            # that failed with every rank back is fine; a world that cannot pass a
            # barrier is not.
            broken = hygiene.check_default_group(min(30.0, deadline))
            if broken:
                run.harness_notes.extend(broken)
                run.results[self.rank].hygiene.extend(broken)
        if not every_rank_returned or run.hygiene_violations:
            self.broken_reason = (
                f"{task.test_id} left the torchrun world in an unknown state; restart torchrun"
            )
        return run

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
            harness_notes=[
                "external launcher: each rank printed its own output to its torchrun console"
            ],
        )
        demote_secondary_failures(run)
        return run

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
        finally:
            os._exit(EXIT_HUNG)

    def close(self) -> None:
        if self._store is not None:
            self._store.set(_SESSION_OVER_KEY, str(self.rank))
        if dist.is_initialized() and self.broken_reason is None:
            dist.destroy_process_group()


class _StackWatchdog:
    """Writes this rank's stacks if the test is still running at the deadline."""

    def __init__(self, deadline: float, publish) -> None:
        self._cancelled = threading.Event()
        self._publish = publish
        self._thread = threading.Thread(
            target=self._watch, args=(deadline,), name="distconform-watchdog", daemon=True
        )
        self._thread.start()

    def _watch(self, deadline: float) -> None:
        if self._cancelled.wait(deadline):
            return
        with tempfile.TemporaryFile("w+") as handle:
            faulthandler.dump_traceback(file=handle, all_threads=True)
            handle.seek(0)
            self._publish(handle.read())

    def cancel(self) -> None:
        self._cancelled.set()
        self._thread.join(timeout=1.0)
