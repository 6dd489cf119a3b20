"""Deadlines that fit each test: from the durations its earlier runs recorded.

A hang costs the test's whole deadline, and one global deadline has to fit the slowest test
of the run: a 1-second test that hangs would wait out 300 s. So the harness keeps, in
pytest's cache (as ``--lf`` keeps its failures), each distributed test's longest passing run
(its ranks' body, first start to last end). A test with such a record gets
``max(k * longest, floor)`` instead of the default; one without keeps the default. ``k``
(ini ``dist_deadline_multiplier``, 10) leaves room for a machine ten times busier than the
one that recorded it; ``floor`` (ini ``dist_deadline_floor``, 30 s) for a test whose
recorded time is all start-up. A deadline named
for the test (its ``deadline`` marker) or for the run (``--dist-deadline``, ini
``dist_deadline``) always wins. The failure of a test that hung says which deadline applied
and why. Without pytest's cache (``-p no:cacheprovider``) nothing is kept or used.
"""

from __future__ import annotations

from typing import Any

import pytest

from distconform.harness.shared.outcomes import RunResult

CACHE_KEY = "distconform/durations"
MULTIPLIER = 10.0
FLOOR_S = 30.0

_HISTORY_KEY = pytest.StashKey["DurationHistory"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "dist_deadline_multiplier",
        f"a test with a recorded run gets this many times its longest as its deadline "
        f"(default {MULTIPLIER:g})",
        default=str(MULTIPLIER),
    )
    parser.addini(
        "dist_deadline_floor",
        f"the least deadline a recorded run gives, in seconds (default {FLOOR_S:g})",
        default=str(FLOOR_S),
    )


class DurationHistory:
    """Each test's longest recorded run, as read at the start and as updated by this run."""

    def __init__(self, cache: Any, multiplier: float = MULTIPLIER, floor: float = FLOOR_S) -> None:
        self._cache = cache
        self.multiplier = multiplier
        self.floor = floor
        stored = self._cache.get(CACHE_KEY, {}) if self._cache is not None else {}
        self.longest: dict[str, float] = {
            nodeid: float(seconds)
            for nodeid, seconds in (stored.items() if isinstance(stored, dict) else ())
            if isinstance(seconds, int | float) and seconds > 0
        }
        self._recorded: dict[str, float] = {}

    def deadline(self, nodeid: str, default: float) -> tuple[float, str]:
        """The deadline for ``nodeid`` and why, from its record; the default without one."""
        longest = self.longest.get(nodeid)
        if longest is None:
            return default, "the default: no recorded run of this test"
        adapted = max(self.multiplier * longest, self.floor)
        return adapted, (
            f"{self.multiplier:g} x its longest recorded run ({longest:.2f} s), at least "
            f"{self.floor:g} s (pytest cache {CACHE_KEY}; --dist-deadline overrides)"
        )

    def record(self, nodeid: str, run: RunResult) -> None:
        """Keep the run's duration if every rank passed and it is the longest seen."""
        if not run.ok or run.all_skipped:
            return
        starts = [r.started_at for r in run.results if r.started_at is not None]
        ends = [r.finished_at for r in run.results if r.finished_at is not None]
        if not starts or not ends:
            return
        seconds = max(ends) - min(starts)
        self._recorded[nodeid] = max(seconds, self._recorded.get(nodeid, 0.0))

    def save(self) -> None:
        if self._cache is None or not self._recorded:
            return
        stored = self._cache.get(CACHE_KEY, {})
        merged = dict(stored) if isinstance(stored, dict) else {}
        for nodeid, seconds in self._recorded.items():
            merged[nodeid] = max(seconds, float(merged.get(nodeid, 0.0) or 0.0))
        self._cache.set(CACHE_KEY, merged)


def history_of(config: pytest.Config) -> DurationHistory:
    """The session's history, read from pytest's cache (none without it) on first use."""
    history = config.stash.get(_HISTORY_KEY, None)
    if history is None:
        history = config.stash[_HISTORY_KEY] = DurationHistory(
            getattr(config, "cache", None),
            _positive_ini(config, "dist_deadline_multiplier"),
            _positive_ini(config, "dist_deadline_floor"),
        )
    return history


def _positive_ini(config: pytest.Config, name: str) -> float:
    value = config.getini(name)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if number <= 0:
        raise pytest.UsageError(f"ini {name} must be a positive number, got {value!r}")
    return number


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    # A pytest-xdist worker records into the same cache as its controller would.
    history = session.config.stash.get(_HISTORY_KEY, None)
    if history is not None:
        history.save()
