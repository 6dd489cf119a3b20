"""What happened on each rank, and which failure is the root cause.

A distributed test has one verdict but N stories. The classification here decides
which story the report tells first: the earliest *primary* failure (an exception
raised by the test body, a crash, a hang), never the peers that merely noticed it
(a collective that lost its peer, a rank killed because another one failed).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

#: What a stream-safety failure's message says (harness/rank/stream_safety.py): reports
#: count these failures by it without loading the checker.
STREAM_SAFETY_HEADLINE = "access(es) to device memory that no synchronisation orders"
#: How the report of a test starts whose ranks could not start or join their group.
INFRASTRUCTURE_HEADLINE = "infrastructure failure before the test body"


class Outcome(enum.StrEnum):
    """How one rank's part of a run ended: its own verdict, before the run's is drawn."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    XFAILED = "xfailed"
    CRASHED = "crashed"
    HUNG = "hung"
    ABORTED_BY_PEER = "aborted-by-peer"
    NOT_STARTED = "not-started"


# Outcomes after which a rank is ready for the next test.
CLEAN_OUTCOMES = frozenset({Outcome.PASSED, Outcome.SKIPPED, Outcome.XFAILED})
PRIMARY_FAILURES = frozenset({Outcome.FAILED, Outcome.CRASHED, Outcome.HUNG})
BAD_OUTCOMES = PRIMARY_FAILURES | {Outcome.ABORTED_BY_PEER, Outcome.NOT_STARTED}


@dataclass(frozen=True)
class GroupLedger:
    """One rank's calls on the default group during a test: collectives, and point-to-point
    messages per peer (global ranks)."""

    collectives: int
    sent: tuple[tuple[int, int], ...] = ()  # (peer, count)
    received: tuple[tuple[int, int], ...] = ()


def unbalanced_ledgers(ledgers: dict[int, GroupLedger]) -> list[str]:
    """Why these ranks' calls on the default group do not match; empty when they do."""
    problems = []
    collectives = {rank: ledger.collectives for rank, ledger in ledgers.items()}
    if len(set(collectives.values())) > 1:
        counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(collectives.items()))
        problems.append(
            f"the ranks issued different numbers of collectives on the default process group "
            f"({counts}): a collective was left unmatched"
        )
    sent = {(rank, peer): n for rank, ledger in ledgers.items() for peer, n in ledger.sent}
    received = {(peer, rank): n for rank, ledger in ledgers.items() for peer, n in ledger.received}
    for src, dst in sorted(set(sent) | set(received)):
        if sent.get((src, dst), 0) != received.get((src, dst), 0):
            problems.append(
                f"rank {src} sent {sent.get((src, dst), 0)} message(s) to rank {dst}, which "
                f"received {received.get((src, dst), 0)} on the default process group: a "
                f"point-to-point call was left unmatched"
            )
    return problems


@dataclass(frozen=True)
class GroupNaming:
    """How one rank's c10d world names the groups created after a test.

    c10d keeps each group's rendezvous keys in the default group's store under the group's
    name and never deletes them. A numbered name comes from a per-process counter, so it
    is the same on every rank only while the ranks' counters are equal; a hashed name
    (``new_group(..., use_local_synchronization=True)``) comes back in a later test. Either
    way a later group on the same warm ranks would read an earlier group's keys: connect
    to ports that are closed, while its peers wait under another name (issue 52).
    """

    #: c10d's group counter after the test: the number in the next numbered group's name.
    counter: int
    #: The hashed names of the groups the test created.
    hashed: tuple[str, ...] = ()


def stale_group_names(namings: dict[int, GroupNaming]) -> str | None:
    """Why the next test on these ranks could read an earlier group's rendezvous keys;
    None when it cannot."""
    counters = {rank: naming.counter for rank, naming in namings.items()}
    if len(set(counters.values())) > 1:
        listed = ", ".join(f"rank {r}: {n}" for r, n in sorted(counters.items()))
        return (
            f"the ranks created different numbers of process groups ({listed}): the next "
            f"group would get a different name on each rank"
        )
    hashed = sorted({name for naming in namings.values() for name in naming.hashed})
    if hashed:
        return (
            f"the test created process groups by local synchronisation ({len(hashed)}, hashed "
            f"names): a later group of the same ranks would get the same name"
        )
    return None


@dataclass
class RankResult:
    """One rank's account of one test. Times are ``time.monotonic()`` (system-wide on Linux)."""

    rank: int
    outcome: Outcome
    started_at: float | None = None
    finished_at: float | None = None
    value: Any = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    reason: str | None = None
    exit_code: int | None = None
    signal_name: str | None = None
    stacks: str | None = None
    output: str = ""
    comm_error: bool = False
    note: str | None = None
    hygiene: list[str] = field(default_factory=list)
    #: What this rank issued on the default group during the test, as the flight recorder
    #: counted it; None when it could not tell (recorder off, a receive from any source).
    #: Ledgers that balance across the ranks stand in for the between-tests barrier
    #: (harness/controller/process/pool.py).
    ledger: GroupLedger | None = None
    #: How this rank's c10d world names the next groups; None without a default group.
    group_naming: GroupNaming | None = None
    warnings: list = field(default_factory=list)
    #: The exception itself, for callers in the rank's own process (thread ranks); it
    #: never crosses a process boundary, where only its type, message and traceback go.
    error: BaseException | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "error": None}

    @property
    def duration(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    def summary(self) -> str:
        """One line for the per-rank table."""
        if self.outcome in (Outcome.FAILED, Outcome.ABORTED_BY_PEER) and self.error_type:
            text = f"{self.error_type}: {first_line(self.error_message)}"
        elif self.outcome is Outcome.CRASHED:
            if self.signal_name:
                text = f"killed by {self.signal_name}"
            else:
                text = f"exited with code {self.exit_code}"
        elif self.reason:
            text = self.reason
        elif self.outcome is Outcome.HUNG and not self.note:
            text = "still running at the deadline"
        else:
            text = ""
        if self.note:
            text = f"{text} ({self.note})" if text else self.note
        return text


def needs_barrier(result: RankResult) -> bool:
    """Whether a rank proves its default group with a barrier after this test.

    Only after a clean test (after any other the pool is recycled), and only when the
    flight recorder could not count the rank's default-group collectives: equal counts
    on every rank show the group is in step without a collective of its own.
    """
    return result.outcome in CLEAN_OUTCOMES and not result.hygiene and result.ledger is None


def first_line(text: str | None, limit: int = 160) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


@dataclass
class RunResult:
    """Every rank's result for one test, plus what the harness itself observed."""

    results: list[RankResult]
    seed: int
    deadline: float
    started_at: float
    finished_at: float
    harness_notes: list[str] = field(default_factory=list)
    #: Set when no single rank can be blamed (ranks that share a process all died with
    #: it): the report's headline, in place of "rank N crashed".
    shared_crash: str | None = None
    #: Set when the ranks could not start or join their group, before the test body ran:
    #: what went wrong. An infrastructure failure, not the test's.
    infrastructure_failure: str | None = None
    #: The infrastructure failure of a first attempt that was retried on a fresh pool.
    infrastructure_retry: str | None = None
    #: Why the pool must not serve another test although the test was clean (its ranks
    #: would name their next groups after stale store keys): replaced without a warning.
    retire_pool: str | None = None

    @property
    def hygiene_violations(self) -> dict[int, list[str]]:
        """What each rank left behind that forced the pool to be recycled."""
        return {r.rank: r.hygiene for r in self.results if r.hygiene}

    @property
    def world_size(self) -> int:
        return len(self.results)

    @property
    def duration(self) -> float:
        return self.finished_at - self.started_at

    @property
    def hung(self) -> bool:
        return bool(self.by_outcome(Outcome.HUNG))

    def by_outcome(self, *outcomes: Outcome) -> list[RankResult]:
        return [r for r in self.results if r.outcome in outcomes]

    @property
    def ok(self) -> bool:
        return not self.by_outcome(*BAD_OUTCOMES) and not self.inconsistent_skip

    @property
    def all_skipped(self) -> bool:
        return all(r.outcome is Outcome.SKIPPED for r in self.results)

    @property
    def all_xfailed(self) -> bool:
        return all(r.outcome is Outcome.XFAILED for r in self.results)

    @property
    def inconsistent_skip(self) -> bool:
        skipped = self.by_outcome(Outcome.SKIPPED)
        return bool(skipped) and len(skipped) != len(self.results)

    @property
    def values(self) -> list[Any]:
        return [r.value for r in self.results]

    def primary_failure(self) -> RankResult | None:
        """The earliest root-cause failure; peers that only reacted to it come later."""
        primaries = self.by_outcome(*PRIMARY_FAILURES)
        if not primaries:
            return None
        # A rank that raised its own error explains more than one that timed out
        # in a collective waiting for it, even when the timeout was recorded first.
        own_errors = [r for r in primaries if not r.comm_error] or primaries
        return min(own_errors, key=_event_time)

    def describe(self) -> str:
        """A compact account: one line per rank, the notes, then the failures' tracebacks.

        The report users read is
        :class:`distconform.harness.controller.failure_report.DistributedFailure`'s; this one is
        for code that drives ranks directly (``distconform.harness.threads.ThreadRunner``).
        """
        lines = [f"run on {self.world_size} ranks ({self.duration:.3f} s)"]
        lines += [
            f"  rank {r.rank}: {r.outcome.value} {r.summary()}".rstrip() for r in self.results
        ]
        lines += self.harness_notes
        primary = self.primary_failure()
        for r in [primary] if primary is not None else self.by_outcome(*BAD_OUTCOMES):
            lines.append(f"--- rank {r.rank} ({r.outcome.value}) ---")
            lines.append((r.traceback or "").rstrip())
            if r.stacks:
                lines.append("stack at the deadline:\n" + r.stacks.rstrip())
        return "\n".join(lines)

    def raise_on_failure(self) -> None:
        """Raise :class:`RunFailedError` (its message is :meth:`describe`) unless ``ok``."""
        if not self.ok:
            raise RunFailedError(self.describe())


class RunFailedError(AssertionError):
    """A run driven without pytest did not pass on every rank."""


def _event_time(result: RankResult) -> float:
    return result.finished_at if result.finished_at is not None else float("inf")


def demote_secondary_failures(run: RunResult) -> None:
    """Mark ranks whose failure is a consequence of the primary one as aborted-by-peer.

    A communication error (lost peer, collective timeout) is by nature a reaction to
    what another rank did; reporting its traceback as one more failure is how real
    errors get buried under noise. The primary failure itself is never demoted.
    """
    primary = run.primary_failure()
    if primary is None:
        return
    for result in run.results:
        if result is not primary and result.outcome is Outcome.FAILED and result.comm_error:
            result.outcome = Outcome.ABORTED_BY_PEER
            result.note = f"after rank {primary.rank} {primary.outcome.value}"
