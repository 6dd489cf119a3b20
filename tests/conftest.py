"""What every test of this project shares: the pytest sessions the tests start themselves.

Those inner sessions (through ``pytester`` or a plain subprocess) run without hypothesis's
pytest plugin. It imports hypothesis at the end of every session (its terminal summary),
about 1.1 s on 2 cores, paid by each of the default run's hundred-odd inner sessions; the
property cases they may run need hypothesis itself, not its plugin. This session keeps it.
"""

from __future__ import annotations

import os

import pytest

NO_HYPOTHESIS_PLUGIN = "-p no:hypothesispytest"


def _with_no_hypothesis_plugin(addopts: str | None) -> str:
    return f"{addopts or ''} {NO_HYPOTHESIS_PLUGIN}".strip()


@pytest.fixture(scope="session", autouse=True)
def _inner_sessions_without_hypothesis_plugin():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTEST_ADDOPTS", _with_no_hypothesis_plugin(os.environ.get("PYTEST_ADDOPTS")))
        yield


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # pytester clears PYTEST_ADDOPTS for its sessions: set again after it.
    monkeypatch.setenv("PYTEST_ADDOPTS", NO_HYPOTHESIS_PLUGIN)
    return pytester
