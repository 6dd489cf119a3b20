"""The ``--dist-adopt`` pytest plugin (entry point ``distconform-adopt``): its options, and
the adoption plugin registered when they ask for it.

This module imports nothing of torch's test package: :mod:`distconform.harness.adopt.plugin`, which
does, is registered only in a session that sets ``--dist-adopt`` or ini ``dist_adopt``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from distconform.harness.adopt import _torch_test_harness as torch_harness
from distconform.harness.controller.item_runner import (
    fork_server_requested,
    start_fork_server_soon,
)
from distconform.harness.controller.session import settings_of

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
        # Before this process imports torch (the plugin below does): the fork server's own
        # import then runs beside it, not after it.
        for source in _named_files(config) if _runs_tests_here(config) else ():
            if start_fork_server_for(config, source):
                break
        from distconform.harness.adopt import (
            plugin as adopt_plugin,  # torch's test package, only if asked
        )

        config.pluginmanager.register(adopt_plugin, adopt_plugin.PLUGIN_NAME)


def start_fork_server_for(config: pytest.Config, source: str) -> bool:
    """Start the rank fork server if a test module's ``source`` names a class of torch's
    harness (it most likely needs ranks), warm, with what torch's test package loads in the
    ranks and, on the CPU, the modules of that package the module imports. A session of
    plain ``TestCase`` modules never starts it. Once started, nothing more is read."""
    if fork_server_requested(config):
        return True
    if not any(name in source for name in torch_harness.FAMILY_BASE_NAMES):
        return False
    on_cpu = settings_of(config).device_type == "cpu"
    preload = torch_harness.test_package_imports(source) if on_cpu else ()
    start_fork_server_soon(config, warm=True, preload=preload)
    return True


def _runs_tests_here(config: pytest.Config) -> bool:
    """False in pytest-xdist's controller, which only hands the tests to its workers."""
    if hasattr(config, "workerinput"):
        return True
    # What pytest-xdist reads to start workers (set from -n before any plugin configures).
    return getattr(config.option, "dist", "no") == "no" or not getattr(config.option, "tx", None)


def _named_files(config: pytest.Config) -> list[str]:
    """The text of each Python file the command line names (``FILE`` or ``FILE::TEST``)."""
    texts = []
    for arg in config.args:
        path = Path(config.invocation_params.dir, arg.split("::", 1)[0])
        if path.suffix == ".py" and path.is_file():
            try:
                texts.append(path.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                continue
    return texts


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
