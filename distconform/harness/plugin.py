"""pytest plugin: markers, the world-size parametrization, the fixtures and the session's set-up.

Registered through the ``pytest11`` entry point ``distconform``. It registers the harness's other
plugin modules (:data:`PLUGIN_MODULES`), each of which registers its own options:
:mod:`distconform.harness.controller.run_options` (the run's settings),
:mod:`distconform.harness.controller.deadline` (``--dist-deadline``),
:mod:`distconform.harness.controller.deadline_history` (deadlines from recorded durations) and
:mod:`distconform.harness.controller.summary_table` (``--dist-summary``). Its own option is
``--backend-plugin``, which it activates first at configure time; it then builds the run's settings
and registers :mod:`distconform.harness.controller.item_runner`, whose hooks run a marked test on
its ranks. The session's state lives in :mod:`distconform.harness.controller.session`. Nothing below
imports this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from distconform.harness.controller import (
    deadline,
    deadline_history,
    hookspecs,
    item_runner,
    run_options,
    summary_table,
)
from distconform.harness.controller.config import ConfigError, device_placement_line
from distconform.harness.controller.external.rank import ExternalRank
from distconform.harness.controller.external.report_diversion import divert_unless_rank_0
from distconform.harness.controller.launcher_registry import launcher_named
from distconform.harness.controller.markers import (
    check_markers,
    slow_world_sizes_of,
    world_sizes_of,
)
from distconform.harness.controller.option_group import option_group
from distconform.harness.controller.session import (
    DIVERSION_KEY,
    SETTINGS_KEY,
    WORLD_SIZE_PARAM,
    external_world,
    requested_launcher,
    world_size_of,
)
from distconform.harness.shared import backend_plugins
from distconform.harness.shared.rank_context import RankContextPlaceholder

if TYPE_CHECKING:
    from distconform.harness.controller.external.world import ExternalWorld

#: The harness's plugin modules registered with this one; each registers its own options.
PLUGIN_MODULES = (run_options, deadline, deadline_history, summary_table)

_SLOW_MARKER = "slow: a long test (world_size(..., slow=...) marks its slow sizes with it)"

_MARKERS = (
    "world_size(*sizes, slow=()): run the test body on every rank, once per world size "
    "(ids ws2, ws4, ...); filter with --world-sizes. The sizes listed in slow= (each one "
    "of *sizes) are marked slow, e.g. world_size(2, 4, slow=(4,)): ws2 runs by default, "
    "ws4 with -m slow",
    "deadline(seconds): the parent's per-test deadline for a distributed test "
    "(default --dist-deadline, ini dist_deadline, 300 s)",
    "fresh_pool: run this distributed test on a pool of its own, discarded afterwards "
    "(for tests that change process-wide state)",
    "requires_devices(n): skip unless the configured device type has at least n devices "
    "(CPU counts as unlimited)",
    "requires_accelerator: skip unless the run's device is an accelerator",
    "memory_limit(size): each rank of this test may allocate at most this much more memory "
    "(e.g. '512MiB'); process ranks only",
    "device_audit(enabled=True): fail this distributed test when its body creates a tensor "
    "with a factory (torch.randn, nn.Linear, ...) and no device, which on an accelerator run "
    "would land on the CPU; device_audit(False) exempts a test from --dist-device-audit",
    "stream_check(enabled=True): on a device that checks stream safety (the fake device), "
    "fail this distributed test when its body leaves an access unordered between streams or "
    "frees memory another stream may still use; stream_check(False) exempts one test",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = option_group(parser)
    group.addoption(
        "--backend-plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE in pytest and in every rank before the process group starts "
        "(a vendor's Backend.register_backend); repeatable",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)
    for module in PLUGIN_MODULES:
        if not pluginmanager.is_registered(module):
            pluginmanager.register(module, module.__name__)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Under torchrun or srun, before pytest builds its terminal: only rank 0 prints the
    report, every other rank's goes to a file
    (:mod:`distconform.harness.controller.external.report_diversion`)."""
    if hasattr(config, "workerinput"):
        return
    try:
        if launcher_named(requested_launcher(config)).starts_ranks:
            return
    except ConfigError:
        return  # an unknown launcher is reported, as a usage error, at configure
    try:
        me = ExternalRank.from_environment()
    except ConfigError:
        return  # reported, as a usage error, when the world is joined
    config.stash[DIVERSION_KEY] = divert_unless_rank_0(config, me)


def pytest_configure(config: pytest.Config) -> None:
    for line in _MARKERS:
        config.addinivalue_line("markers", line)
    if not any(line.split(":")[0].strip() == "slow" for line in config.getini("markers")):
        # world_size(..., slow=...) adds this mark; a project with --strict-markers that
        # never declared it must not fail on our account.
        config.addinivalue_line("markers", _SLOW_MARKER)
    try:
        backend_plugins.activate(
            config.getoption("backend_plugin"),
            config.getoption("backend"),
            config.getoption("device"),
        )
    except backend_plugins.BackendPluginError as exc:
        raise pytest.UsageError(f"distconform: {exc}") from None
    item_runner.prestart_if_expected(config)  # before settings_from imports torch
    try:
        settings = run_options.settings_from(config)
    except ConfigError as exc:
        raise pytest.UsageError(f"distconform: {exc}") from None
    config.stash[SETTINGS_KEY] = settings
    try:
        item_runner.configure(config, settings)
    except ConfigError as exc:
        raise pytest.UsageError(f"distconform: {exc}") from None


def pytest_unconfigure(config: pytest.Config) -> None:
    item_runner.unconfigure(config)


def pytest_report_header(config: pytest.Config) -> str | None:
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None:
        return None
    header = (
        f"distconform: launcher {settings.launcher}, backend {settings.backend}, "
        f"device {settings.device_type}, seed {settings.seed}, deadline {settings.deadline:g} s"
    )
    world = external_world(config)
    if world is not None:
        header += f", rank {world.rank} of a {world.me.starter} world of {world.world_size}"
    lines = [header]
    if settings.device_type != "cpu" and launcher_named(settings.launcher).starts_ranks:
        lines.append(f"distconform: {device_placement_line(settings)}")
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("world_size")
    if marker is None:
        return
    try:
        sizes = world_sizes_of(marker)
        slow = slow_world_sizes_of(marker, sizes)
        check_markers(metafunc.definition)
    except ConfigError as exc:
        # A collection error shows just this line (a UsageError here came wrapped in
        # pluggy's traceback), and no test of the run starts.
        raise pytest.Collector.CollectError(f"{metafunc.definition.nodeid}: {exc}") from None
    if WORLD_SIZE_PARAM not in metafunc.fixturenames:
        # The world size is a parameter of every marked test, requested or not.
        metafunc.fixturenames.append(WORLD_SIZE_PARAM)
    # The mark rides on the parameter so it exists before `-m` deselects anything.
    metafunc.parametrize(
        WORLD_SIZE_PARAM,
        [
            pytest.param(size, id=f"ws{size}", marks=pytest.mark.slow if size in slow else ())
            for size in sizes
        ],
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.stash[SETTINGS_KEY].world_sizes
    world = external_world(config)
    if world is not None:
        # Under torchrun the world size is fixed: only that parametrization can run.
        wanted = (world.world_size,)
    if wanted is None:
        return
    selected, deselected = [], []
    for item in items:
        size = world_size_of(item)
        (deselected if size is not None and size not in wanted else selected).append(item)
    if deselected and not any(world_size_of(item) is not None for item in selected):
        raise pytest.UsageError(_no_world_size_left(deselected, wanted, world))
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def _no_world_size_left(
    deselected: list[pytest.Item], wanted: tuple[int, ...], world: ExternalWorld | None
) -> str:
    existing = ", ".join(str(size) for size in sorted({world_size_of(i) for i in deselected}))
    count = f"{len(deselected)} distributed test{'s' if len(deselected) != 1 else ''}"
    if world is not None:
        return (
            f"this {world.me.starter} world has {world.world_size} ranks, but none of the {count} "
            f"collected runs at that world size (they run at {existing}); start the "
            f"{world.me.starter} job with one of those numbers of ranks"
        )
    asked = ",".join(str(size) for size in wanted)
    return (
        f"--world-sizes {asked} selects none of the {count} collected; their world sizes "
        f"are {existing}"
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    world = external_world(session.config)
    if world is not None:
        try:
            world.check_same_collection([item.nodeid for item in session.items])
        except ConfigError as exc:
            raise pytest.UsageError(f"distconform: {exc}") from None


@pytest.fixture
def dist_world_size(request: pytest.FixtureRequest) -> int:
    """The world size this instance of a ``world_size``-marked test runs at."""
    if not hasattr(request, "param"):
        raise pytest.UsageError(
            f"{request.node.nodeid}: dist_world_size is only set for tests marked "
            f"@pytest.mark.world_size(...)"
        )
    return request.param


@pytest.fixture
def rank_ctx(request: pytest.FixtureRequest) -> RankContextPlaceholder:
    """The rank's context (rank, world_size, device, backend, group, mesh()), built in the rank."""
    if world_size_of(request.node) is None:
        raise pytest.UsageError(
            f"{request.node.nodeid} uses rank_ctx but is not marked "
            f"@pytest.mark.world_size(...): rank_ctx only exists on ranks"
        )
    return RankContextPlaceholder()
