"""Turning a RunResult into the text a person reads when a distributed test fails.

Order matters: the root cause first (with its rank), then one line per rank, then
the stacks of ranks that were stopped, then a command that reproduces the test.
Each rank's captured output goes into its own pytest report section.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from distconform.harness.shared.outcomes import (
    INFRASTRUCTURE_HEADLINE,
    Outcome,
    RankResult,
    RunResult,
    demote_secondary_failures,
)

# Frames that belong to the harness or to the thread machinery, not to the test.
_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))
_BOOTSTRAP_FRAME_MARKERS = (
    f'File "{_HARNESS_DIR}/',
    'File "<frozen runpy>"',
    f'File "{os.path.dirname(threading.__file__)}/threading.py"',
)


class DistributedFailure(AssertionError):
    """A distributed run did not pass; ``str()`` is the full report."""

    def __init__(self, run: RunResult, *, context: str, reproducer: str | None) -> None:
        self.run = run
        self.text = render_failure(run, context=context, reproducer=reproducer)
        super().__init__(self.text)


def verdict_headline(run: RunResult) -> str:
    if run.infrastructure_failure is not None:
        return f"{INFRASTRUCTURE_HEADLINE}: {run.infrastructure_failure}"
    if run.shared_crash is not None:
        return run.shared_crash
    primary = run.primary_failure()
    if primary is not None:
        return f"rank {primary.rank} {primary.outcome.value}: {primary.summary()}"
    if run.inconsistent_skip:
        return "inconsistent skip: " + _describe_skip_split(run)
    bad = run.by_outcome(Outcome.ABORTED_BY_PEER, Outcome.NOT_STARTED)
    if bad:
        return f"rank {bad[0].rank} {bad[0].outcome.value}: {bad[0].summary()}"
    return "all ranks passed"


def _describe_skip_split(run: RunResult) -> str:
    skipped = run.by_outcome(Outcome.SKIPPED)
    others = [r for r in run.results if r.outcome is not Outcome.SKIPPED]
    reasons = sorted({r.reason or "" for r in skipped})
    return (
        f"ranks {_ranks(skipped)} skipped ({'; '.join(reasons)}) but ranks {_ranks(others)} "
        f"did not. A skip must be decided the same way on every rank: decide it in the parent "
        f"(a marker or a fixture), or from values every rank shares."
    )


def _ranks(results: Iterable[RankResult]) -> str:
    return ", ".join(str(r.rank) for r in results)


def rank_table(run: RunResult) -> str:
    rows = [("rank", "outcome", "time", "detail")]
    for result in run.results:
        duration = f"{result.duration:.2f} s" if result.duration is not None else "-"
        rows.append((str(result.rank), result.outcome.value, duration, result.summary()))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        f"{row[0]:>{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}".rstrip()
        for row in rows
    )


def render_failure(run: RunResult, *, context: str, reproducer: str | None) -> str:
    """The long report of a failed distributed test."""
    demote_secondary_failures(run)
    parts = [f"{verdict_headline(run)}    [{context}]"]
    primary = run.primary_failure()
    if primary is not None:
        parts.append(_cause_text(primary, shared=run.shared_crash is not None))
    for other in _other_primary_failures(run, primary):
        parts.append(f"rank {other.rank} also {other.outcome.value}:\n{_cause_text(other)}")
    parts.append(rank_table(run))
    for result in run.results:
        if result.stacks and result is not primary:
            parts.append(
                f"stacks of rank {result.rank} when it was stopped:\n{clean_stacks(result.stacks)}"
            )
    parts.extend(run.harness_notes)
    if reproducer:
        parts.append(f"reproduce with:\n  {reproducer}")
    return "\n\n".join(p.rstrip() for p in parts if p)


def _cause_text(result: RankResult, shared: bool = False) -> str:
    if shared:  # the process every rank shared died: nothing here is one rank's
        text = f"the process of every rank {result.summary()}"
        if result.stacks and result.stacks.strip():
            text += f"\nfaulthandler output:\n{clean_stacks(result.stacks)}"
        return text
    if result.outcome is Outcome.FAILED:
        return (result.traceback or f"{result.error_type}: {result.error_message}").rstrip()
    if result.outcome is Outcome.HUNG:
        stacks = clean_stacks(result.stacks) if result.stacks else "(no stacks were written)"
        return f"stacks of rank {result.rank} at the deadline:\n{stacks}"
    if result.outcome is Outcome.CRASHED:
        text = f"rank {result.rank} process {result.summary()}"
        if result.stacks and result.stacks.strip():
            text += f"\nfaulthandler output:\n{clean_stacks(result.stacks)}"
        tail = _tail(result.output)
        if tail:
            text += f"\nlast output of rank {result.rank}:\n{tail}"
        return text
    return result.summary()


def _other_primary_failures(run: RunResult, primary: RankResult | None) -> list[RankResult]:
    """Independent failures on other ranks; identical errors are named, not repeated."""
    others = []
    for result in run.by_outcome(Outcome.FAILED, Outcome.CRASHED, Outcome.HUNG):
        if result is primary:
            continue
        if (
            primary is not None
            and result.outcome is primary.outcome
            and (result.error_type, result.error_message)
            == (primary.error_type, primary.error_message)
        ):
            result.note = f"same error as rank {primary.rank}"
            continue
        if result.outcome is Outcome.HUNG:
            continue  # its stacks are listed with the stopped ranks
        others.append(result)
    return others


def clean_stacks(stacks: str) -> str:
    """Stack dumps without the harness's own threads and frames.

    Handles faulthandler's format (one line per frame) and traceback's (a ``File``
    line, then the source line). A thread with no frame outside the harness (the
    parent watcher, a watchdog) is dropped; in the others, the frames below the test
    body are.
    """
    cleaned = []
    for block in stacks.strip().split("\n\n"):
        lines = block.splitlines()
        header = lines[:1] if lines and not lines[0].strip().startswith("File ") else []
        kept = _user_frames(lines[len(header) :])
        if kept:
            cleaned.append("\n".join([*header, *kept]))
    return "\n\n".join(cleaned) if cleaned else stacks.strip()


def _user_frames(lines: list[str]) -> list[str]:
    kept: list[str] = []
    dropping = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("File "):
            dropping = stripped.startswith(_BOOTSTRAP_FRAME_MARKERS)
        if not dropping:
            kept.append(line)
    return kept


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])
