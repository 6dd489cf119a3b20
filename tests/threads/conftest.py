"""Shared fixtures: one ThreadRunner per world size, opened lazily, closed at module end."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from distconform.harness.threads import ThreadRunner


class Runners:
    def __init__(self) -> None:
        self._runners: dict[int, ThreadRunner] = {}

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list:
        """Run fn on world_size ranks; fail the test with the full report unless all pass."""
        runner = self._runners.get(world_size)
        if runner is None:
            runner = self._runners[world_size] = ThreadRunner(world_size, deadline=60.0)
        result = runner.run(fn, *args, **kwargs)
        result.raise_on_failure()
        return result.values

    def close(self) -> None:
        for runner in self._runners.values():
            runner.close()


@pytest.fixture(scope="module")
def runners() -> Iterator[Runners]:
    found = Runners()
    yield found
    found.close()
