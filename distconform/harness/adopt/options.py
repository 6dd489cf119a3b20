"""The ``--dist-adopt`` pytest plugin (entry point ``distconform-adopt``): its options, and
the adoption plugin registered when they ask for it.

This module imports nothing of torch's test package: :mod:`distconform.harness.adopt.plugin`, which
does, is registered only in a session that sets ``--dist-adopt`` or ini ``dist_adopt``.
"""

from __future__ import annotations

import importlib

import pytest

#: What torch's test package imports beyond torch itself; the ``adopt`` extra installs it.
ADOPT_EXTRA = "adopt"
ADOPT_NEEDS = ("expecttest",)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("distconform-adopt", "torch's own distributed tests (distconform)")
    group.addoption(
        "--dist-adopt",
        action="store_true",
        default=None,
        help="run unittest classes written for torch's distributed test harness "
        "(MultiProcessTestCase, MultiThreadedTestCase, FSDPTest, DTensorTestBase...) on warm "
        "rank pools, one item per test method at the class's world_size (default: ini "
        "dist_adopt, off)",
    )
    group.addoption(
        "--dist-adopt-fsdp-on-cpu",
        action="store_true",
        default=False,
        help="with --dist-adopt: run FSDPTest methods on CPU ranks, which FSDPTest's own "
        "harness skips when there are fewer accelerators than ranks",
    )
    parser.addini(
        "dist_adopt",
        "run torch's distributed unittest classes on warm rank pools (see --dist-adopt)",
        type="bool",
        default=False,
    )


def adoption_requested(config: pytest.Config) -> bool:
    adopt = config.getoption("dist_adopt")
    return bool(adopt or (adopt is None and config.getini("dist_adopt")))


@pytest.hookimpl(trylast=True)  # after distconform.harness.plugin has stored the session's settings
def pytest_configure(config: pytest.Config) -> None:
    if adoption_requested(config):
        require_adopt_extra()
        from distconform.harness.adopt import (
            plugin as adopt_plugin,  # torch's test package, only if asked
        )

        config.pluginmanager.register(adopt_plugin, adopt_plugin.PLUGIN_NAME)


def require_adopt_extra() -> None:
    """Raise a one-line :class:`pytest.UsageError` naming the ``adopt`` extra when a module
    torch's test package needs is missing, before that package fails on it mid-import."""
    missing = []
    for module in ADOPT_NEEDS:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise pytest.UsageError(
            f"--dist-adopt runs torch's own test classes, whose test package needs "
            f"{', '.join(missing)}: pip install 'distconform[{ADOPT_EXTRA}]' "
            f"(with your constraints file)"
        )
