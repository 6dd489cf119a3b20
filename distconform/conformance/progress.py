"""How far a conformance run got: the live progress line, and the run state its report
carries (complete or not, and why not).

A report must never read as a finished run when the run stopped early (``-x``, Ctrl-C, a
broken pool) or was killed; and on a run of many minutes the user should see how far it
is and how long is left without counting dots.
"""

from __future__ import annotations

import time

import pytest

from distconform.conformance.statuses import RunState

STILL_RUNNING = (
    "the run had not finished when this file was written (a run that was killed leaves it so)"
)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class RunTracker:
    """Counts finished tests against the selection and remembers why a run stopped."""

    def __init__(self, every_s: float, clock=time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self.started = clock()
        self.last_tick = self.started
        self.expected: int | None = None
        self.finished = 0
        self.interrupted: str | None = None

    def tests_selected(self, count: int) -> None:
        self.expected = count

    def test_finished(self) -> None:
        self.finished += 1

    def due(self) -> bool:
        """Whether a progress line (and a report written so far) is due; then resets."""
        now = self._clock()
        if self.every_s <= 0 or now - self.last_tick < self.every_s:
            return False
        self.last_tick = now
        return True

    def progress_line(self) -> str:
        elapsed = self._clock() - self.started
        if not self.expected:
            return f"conformance: {self.finished} tests done, {_duration(elapsed)} elapsed"
        left = ""
        if 0 < self.finished < self.expected:
            eta = elapsed / self.finished * (self.expected - self.finished)
            left = f", about {_duration(eta)} left"
        percent = 100 * self.finished // self.expected
        return (
            f"conformance: {self.finished}/{self.expected} tests done ({percent} %), "
            f"{_duration(elapsed)} elapsed{left}"
        )

    def running_state(self, cut_short: int) -> RunState:
        """The state of a report written while the run goes on."""
        return RunState(
            exit_status=None,
            stopped_because=STILL_RUNNING,
            tests_expected=self.expected,
            tests_cut_short=cut_short,
        )

    def final_state(self, session: pytest.Session, exitstatus: int, cut_short: int) -> RunState:
        try:
            status = pytest.ExitCode(exitstatus).name
        except ValueError:
            status = str(exitstatus)
        return RunState(
            exit_status=status,
            stopped_because=self._stop_reason(session, exitstatus),
            tests_expected=self.expected,
            tests_cut_short=cut_short,
        )

    def _stop_reason(self, session: pytest.Session, exitstatus: int) -> str | None:
        for reason in (session.shouldfail, session.shouldstop):
            if reason:
                return reason if isinstance(reason, str) else "the session was stopped early"
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            return self.interrupted or "interrupted"
        if exitstatus == pytest.ExitCode.INTERNAL_ERROR:
            return "pytest stopped on an internal error (see INTERNALERROR above)"
        if exitstatus == pytest.ExitCode.USAGE_ERROR:
            return "pytest stopped on a usage error before the tests ran"
        return None
