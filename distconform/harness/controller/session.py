"""What one pytest session holds for distributed tests, and which world size an item runs at.

Each key has one owner that sets it: :mod:`distconform.harness.plugin` stores the settings at
configure time, :mod:`distconform.harness.controller.item_runner` the pools and, under torchrun, the
external world. Every other module reads them through the accessors below, so nothing climbs back up
into the plugin for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from distconform.harness._pytest_private import AssertionSettings, assertion_settings
from distconform.harness.controller.config import DistSettings
from distconform.harness.controller.external.report_diversion import ReportDiversion

if TYPE_CHECKING:
    from distconform.harness.controller.external.world import ExternalWorld
    from distconform.harness.controller.pools import PoolManager

#: The fixture parameter the ``world_size`` marker parametrizes every marked test with.
WORLD_SIZE_PARAM = "dist_world_size"

#: User properties of a distributed test (JUnit ``<property>``, the conformance report): every
#: rank's outcome as ``"rank:outcome ..."``, and for a run that did not pass, the command
#: that reproduces it.
RANK_OUTCOMES_PROPERTY = "rank_outcomes"
REPRODUCE_PROPERTY = "reproduce"
#: Set on a test whose first attempt failed before its body and was retried on a fresh pool.
INFRASTRUCTURE_RETRY_PROPERTY = "infrastructure_retry"

SETTINGS_KEY = pytest.StashKey[DistSettings]()
POOLS_KEY = pytest.StashKey["PoolManager"]()
EXTERNAL_KEY = pytest.StashKey["ExternalWorld"]()
ASSERTIONS_KEY = pytest.StashKey["AssertionSettings | None"]()
#: The world size of a distributed item that is not a ``world_size``-parametrized function.
ITEM_WORLD_SIZE_KEY = pytest.StashKey[int]()
# Set under torchrun/srun on every rank but 0: its report goes to a file.
DIVERSION_KEY = pytest.StashKey[ReportDiversion | None]()


def settings_of(config: pytest.Config) -> DistSettings:
    """The run's settings; a usage error when the distconform plugin did not configure."""
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None:
        raise pytest.UsageError(
            "distconform is not configured in this session: is the plugin disabled "
            "(-p no:distconform)?"
        )
    return settings


def pools_of(config: pytest.Config) -> PoolManager | None:
    """The session's warm pools (None under torchrun or before configure)."""
    return config.stash.get(POOLS_KEY, None)


def external_world(config: pytest.Config) -> ExternalWorld | None:
    """The torchrun world this pytest process is a rank of, with ``--launcher external``."""
    return config.stash.get(EXTERNAL_KEY, None)


def requested_launcher(config: pytest.Config) -> str:
    """The launcher this session asks for (``--launcher``, else the ``dist_launcher`` ini
    value), as written: unchecked, and readable before the settings exist."""
    return config.getoption("launcher") or config.getini("dist_launcher")


def assertion_settings_of(config: pytest.Config) -> AssertionSettings | None:
    """How ranks rewrite and explain asserts in this session (read once)."""
    if ASSERTIONS_KEY not in config.stash:
        config.stash[ASSERTIONS_KEY] = assertion_settings(config)
    return config.stash[ASSERTIONS_KEY]


def prints_the_report(config: pytest.Config) -> bool:
    """False on a torchrun or srun rank other than 0: rank 0 reports for the world."""
    return config.stash.get(DIVERSION_KEY, None) is None


def world_size_of(item: pytest.Item) -> int | None:
    """The world size a distributed item runs at: a ``world_size``-marked test's parameter,
    or the size an item that is not a Python function declared (:data:`ITEM_WORLD_SIZE_KEY`,
    e.g. an adopted unittest method); None for any other item."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return item.stash.get(ITEM_WORLD_SIZE_KEY, None)
    return callspec.params.get(WORLD_SIZE_PARAM)
