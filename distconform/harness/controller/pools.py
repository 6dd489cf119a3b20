"""Warm rank pools, keyed by everything that makes two pools interchangeable.

A pool is started lazily for the first test that needs its key and reused by every
later test with the same key, across classes and files. A pool that saw anything
other than a clean pass (failure, crash, hang, hygiene violation) is killed and
dropped; the next test with that key gets a fresh one. So is a pool whose ranks would
name their next process groups after an earlier group's keys in its store (their group
counters differ, or a group got a hashed name), without a warning: the test did no wrong.
Nothing is ever skipped because an earlier test broke a pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from distconform.harness.controller.deadline import OuterLimit, pg_timeout_for
from distconform.harness.shared.environ import lasting_items, raw_environment
from distconform.harness.shared.outcomes import (
    Outcome,
    RankResult,
    RunResult,
    demote_secondary_failures,
)
from distconform.harness.shared.task import RankTask


class RankPool(Protocol):
    """What every launcher provides: ranks that joined one world and run tasks."""

    launcher: str
    broken: bool

    def start(self, timeout: float | None = None) -> None: ...

    def alive(self) -> bool:
        """Whether every rank is still there (a warm pool can lose ranks while idle)."""
        ...

    # Optional: ``start_alone(timeout)``, for a pool whose processes may serve other keys'
    # pools too: start on processes no other pool has used (a fresh-pool test).

    def run(self, task: RankTask, deadline: float, peer_grace: float) -> RunResult: ...

    def close(self, timeout: float = 10.0) -> None: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class PoolKey:
    """What makes two runs able to share warm ranks: a launcher makes one pool per key."""

    launcher: str
    world_size: int
    backend: str
    device_type: str
    threads_per_rank: int
    rendezvous: str = "file"
    share_devices: bool = False
    env: tuple[tuple[str, str], ...] = ()
    env_fingerprint: int = 0
    #: False: ranks without a default process group, for a test that creates its own world.
    joins_world: bool = True

    def describe(self) -> str:
        shared = ", devices shared" if self.share_devices else ""
        bare = ", no default group" if not self.joins_world else ""
        return (
            f"{self.launcher}/{self.backend}/{self.device_type}, ws {self.world_size}, "
            f"{self.threads_per_rank} thread(s) per rank{shared}{bare}"
        )


class PoolStartFailure(RuntimeError):
    """A pool could not start; carries what each rank reported."""

    def __init__(self, message: str, results: list[RankResult]) -> None:
        super().__init__(message)
        self.results = results


PoolFactory = Callable[[PoolKey], RankPool]


def env_fingerprint() -> int:
    """A digest of the environment ranks inherit: a changed variable means a new pool.

    Computed for every test, so it is a set hash (C speed, no sorting); it only has to
    be stable within this process.
    """
    return hash(lasting_items(raw_environment()))


class PoolManager:
    def __init__(self, factory: PoolFactory) -> None:
        self._factory = factory
        self._pools: dict[PoolKey, RankPool] = {}
        self.spawn_count = 0
        self.recycle_count = 0

    def run(
        self,
        key: PoolKey,
        task: RankTask,
        *,
        deadline: float,
        peer_grace: float,
        fresh: bool = False,
        must_end_by: OuterLimit | None = None,
    ) -> RunResult:
        """Run ``task`` on the pool for ``key``, starting one if needed.

        ``must_end_by`` is an outer limit, such as pytest-timeout's: the time spent
        starting a pool is taken from the deadline so the harness still reports before
        that limit, and a note in the run says so.
        """
        started = time.monotonic()
        ends_at = None if must_end_by is None else must_end_by.ends_at

        def start_budget() -> float | None:
            return None if ends_at is None else max(1.0, ends_at - time.monotonic())

        if fresh:
            # Ranks of its own: not the warm ones that earlier tests ran on.
            self._discard(key, recycled=False)
        retried: str | None = None
        try:
            pool = self._acquire(key, start_budget(), fresh)
        except PoolStartFailure as first:
            # Before the test body: the ranks could not start or join their group, which
            # is the machine's failure, not the test's. One retry on a fresh pool, shown.
            retried = str(first)
            try:
                pool = self._acquire(key, start_budget(), fresh)
            except PoolStartFailure as second:
                return RunResult(
                    results=second.results,
                    seed=task.seed,
                    deadline=deadline,
                    started_at=started,
                    finished_at=time.monotonic(),
                    harness_notes=[
                        f"first attempt: {first}",
                        f"retried once on a fresh pool, which failed too: {second}",
                    ],
                    infrastructure_failure=str(second),
                    infrastructure_retry=retried,
                )
        # (the run's note, and what a hung rank's line adds) when the deadline is cut
        cut: tuple[str, str] | None = None
        if must_end_by is not None and must_end_by.ends_at - time.monotonic() < deadline:
            now = time.monotonic()
            allowed = max(0.5, must_end_by.ends_at - now)
            cut = (
                must_end_by.shortening_note(deadline, allowed, now - must_end_by.started_at),
                f"cut from {deadline:g} s to fit pytest-timeout's {must_end_by.timeout:g} s "
                f"limit (see the note below)",
            )
            deadline = allowed
            task = replace(task, pg_timeout=pg_timeout_for(deadline))
        try:
            run = pool.run(task, deadline, peer_grace)
        except BaseException:
            self._discard(key)
            raise
        if cut is not None:
            note, hung_suffix = cut
            run.harness_notes.append(note)
            for result in run.by_outcome(Outcome.HUNG):
                # The headline quotes this note: it must not read as the test's own deadline.
                result.note = f"{result.note or 'hung'}, {hung_suffix}"
        if pool.broken or fresh or run.retire_pool:
            self._discard(key, recycled=pool.broken)
        if run.retire_pool and not pool.broken:
            run.harness_notes.append(f"the pool was replaced after the test: {run.retire_pool}")
        if retried is not None:
            run.infrastructure_retry = retried
            run.harness_notes.append(
                f"retried on a fresh pool after an infrastructure failure before the test "
                f"body: {retried}"
            )
        demote_secondary_failures(run)
        return run

    def _acquire(self, key: PoolKey, start_budget: float | None, fresh: bool = False) -> RankPool:
        pool = self._pools.get(key)
        if pool is not None and pool.alive():
            self._pools[key] = self._pools.pop(key)  # the most recently used comes last
            return pool
        if pool is not None:
            # Its ranks died between tests (killed from outside, their fork server went
            # away, or the thread host they shared was replaced): no test left it broken,
            # and this one gets a new pool.
            self._discard(key, recycled=False)
        pool = self._factory(key)
        self._make_room_for(pool, key)
        self.spawn_count += 1
        # A pool whose processes serve other keys too (the thread launcher's one host)
        # starts on processes of its own for a fresh-pool test.
        start = getattr(pool, "start_alone", pool.start) if fresh else pool.start
        try:
            start(start_budget)
        except PoolStartFailure:
            raise
        except Exception as exc:
            results = [
                RankResult(rank=r, outcome=Outcome.NOT_STARTED, note=str(exc))
                for r in range(key.world_size)
            ]
            raise PoolStartFailure(
                f"the {key.describe()} pool did not start: {exc}", results
            ) from exc
        self._pools[key] = pool
        return pool

    def _make_room_for(self, pool: RankPool, key: PoolKey) -> None:
        """Close this session's idle pools on the same device type, least recently used
        first, until ``pool`` can lease its devices.

        Warm pools of other world sizes keep their devices leased: on a machine with 8
        accelerators, pools of 2 and 4 ranks leave too few for one of 8, which would wait
        for devices this very session holds. Devices that other processes lease are
        waited for as before, in the pool's start.
        """
        lease_now = getattr(pool, "lease_now", None)
        if lease_now is None or lease_now():
            return
        for other in [k for k in self._pools if k.device_type == key.device_type]:
            self._discard(other, recycled=False)
            if lease_now():
                return

    def _discard(self, key: PoolKey, recycled: bool = True) -> None:
        pool = self._pools.pop(key, None)
        if pool is None:
            return
        if recycled:
            self.recycle_count += 1
            pool.kill()
        else:
            pool.close()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close every pool; each close is bounded and ends with a kill."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close(timeout)

    def __len__(self) -> int:
        return len(self._pools)
