"""pytest plugin: options, markers, the world-size parametrization and the fixtures.

Registered through the ``pytest11`` entry point ``distconform``. This module only holds
options, markers, the world-size parametrization and the fixtures; at configure time it
registers the plugins that do the work: :mod:`harness.controller.item_runner` (its hooks
run a marked test on its ranks) and :mod:`harness.controller.summary_table` (the end-of-run
table). The session's state lives in :mod:`harness.controller.session`. Nothing below
imports this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from harness.controller import hookspecs, item_runner, summary_table
from harness.controller.config import (
    ConfigError,
    DistSettings,
    check_device_type,
    device_placement_line,
    parse_memory_limit,
    parse_world_sizes,
)
from harness.controller.deadline import configured_deadline
from harness.controller.external.rank import ExternalRank
from harness.controller.external.report import divert_unless_rank_0
from harness.controller.launcher_registry import BUILT_IN as BUILT_IN_LAUNCHERS
from harness.controller.launcher_registry import DEFAULT as DEFAULT_LAUNCHER
from harness.controller.launcher_registry import launcher_named
from harness.controller.markers import check_markers, slow_world_sizes_of, world_sizes_of
from harness.controller.session import (
    DIVERSION_KEY,
    SETTINGS_KEY,
    WORLD_SIZE_PARAM,
    external_world,
    requested_launcher,
    world_size_of,
)
from harness.shadowing import shadowed_message
from harness.shared import backend_plugins
from harness.shared.rank_context import RankContextPlaceholder

if TYPE_CHECKING:
    from harness.controller.external.world import ExternalWorld

# Here, before the conformance plugin (loaded after this one) imports impl and suites: a
# vendor's package of the same name earlier on sys.path would fail there with an import
# error naming neither. pytest prints a UsageError raised while loading a plugin as one line.
if (_shadowed := shadowed_message()) is not None:
    raise pytest.UsageError(_shadowed)

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
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("distconform", "distributed tests on N ranks (distconform)")
    group.addoption(
        "--launcher",
        default=None,
        help=f"how ranks are started: {', '.join(BUILT_IN_LAUNCHERS)}, or a launcher another "
        f"package registers (default: {DEFAULT_LAUNCHER})",
    )
    group.addoption(
        "--backend",
        default=None,
        help="process-group backend (default: the device's default, gloo on CPU; "
        "'threaded' with --launcher thread)",
    )
    group.addoption("--device", default=None, help="device type of the ranks (default: cpu)")
    group.addoption(
        "--world-sizes",
        default=None,
        metavar="N[,N...]",
        help="run only these world sizes of tests marked world_size",
    )
    group.addoption(
        "--dist-seed",
        type=int,
        default=0,
        help="seed applied identically on every rank before each test (printed in failures)",
    )
    group.addoption(
        "--dist-deadline",
        default=None,
        metavar="SECONDS",
        help="per-test deadline owned by the harness (default: ini dist_deadline or 300)",
    )
    group.addoption(
        "--dist-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads per rank (default: cores // world size, at least 1)",
    )
    group.addoption(
        "--dist-fresh-pool",
        action="store_true",
        default=False,
        help="start a new pool of ranks for every distributed test",
    )
    group.addoption(
        "--dist-peer-grace",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how long other ranks may keep running after one rank failed",
    )
    group.addoption(
        "--dist-rendezvous",
        default="file",
        choices=("file", "tcp"),
        help="FileStore in a private temp dir, or a TCPStore on 127.0.0.1 (default: file)",
    )
    group.addoption(
        "--dist-memory-limit",
        default=None,
        metavar="SIZE",
        help="default per-rank memory limit for distributed tests, e.g. 2GiB (process ranks)",
    )
    group.addoption(
        "--dist-device-audit",
        action="store_true",
        default=False,
        help="fail every distributed test whose body creates a tensor without a device "
        "(default: ini dist_device_audit, off; marker device_audit for one test)",
    )
    group.addoption(
        "--dist-share-devices",
        action="store_true",
        default=False,
        help="with fewer devices than ranks, place the ranks round-robin on the devices there "
        "are, where the backend can share one (staged_gloo, gloo; not nccl) (default: ini "
        "dist_share_devices, off: one device per rank)",
    )
    group.addoption(
        "--dist-summary",
        action="store_true",
        default=False,
        help="print a per-rank outcome table of every distributed test at the end",
    )
    group.addoption(
        "--backend-plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE in pytest and in every rank before the process group starts "
        "(a vendor's Backend.register_backend); repeatable",
    )
    parser.addini("dist_deadline", "default per-test deadline in seconds", default="")
    parser.addini("dist_launcher", "default launcher", default=DEFAULT_LAUNCHER)
    parser.addini(
        "dist_share_devices",
        "place ranks round-robin on fewer devices than ranks (see --dist-share-devices)",
        type="bool",
        default=False,
    )
    parser.addini(
        "dist_device_audit",
        "fail distributed tests whose body creates a tensor without a device",
        type="bool",
        default=False,
    )


@pytest.hookimpl(tryfirst=True)
def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Under torchrun or srun, before pytest builds its terminal: only rank 0 prints the
    report, every other rank's goes to a file (:mod:`harness.controller.external.report`)."""
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
    item_runner.prestart_if_expected(config)  # before _settings_from imports torch
    try:
        settings = _settings_from(config)
    except ConfigError as exc:
        raise pytest.UsageError(f"distconform: {exc}") from None
    config.stash[SETTINGS_KEY] = settings
    try:
        item_runner.configure(config, settings)
    except ConfigError as exc:
        raise pytest.UsageError(f"distconform: {exc}") from None
    summary_table.configure(config)


def _settings_from(config: pytest.Config) -> DistSettings:
    launcher = launcher_named(requested_launcher(config))
    device_type = check_device_type(config.getoption("device") or "cpu")
    backend = launcher.backend_for(config.getoption("backend"), device_type)
    threads = config.getoption("dist_threads")
    if threads is not None and threads < 1:
        raise ConfigError(f"--dist-threads must be at least 1, got {threads}")
    grace = config.getoption("dist_peer_grace")
    if grace < 0:
        raise ConfigError(f"--dist-peer-grace must not be negative, got {grace}")
    return DistSettings(
        launcher=launcher.name,
        backend=backend,
        device_type=device_type,
        seed=config.getoption("dist_seed"),
        deadline=configured_deadline(config),
        threads_per_rank=threads,
        world_sizes=parse_world_sizes(config.getoption("world_sizes")),
        fresh_pool=config.getoption("dist_fresh_pool"),
        peer_grace=grace,
        rendezvous=config.getoption("dist_rendezvous"),
        memory_limit=parse_memory_limit(
            config.getoption("dist_memory_limit"), "--dist-memory-limit"
        ),
        device_audit=config.getoption("dist_device_audit") or config.getini("dist_device_audit"),
        share_devices=config.getoption("dist_share_devices") or config.getini("dist_share_devices"),
    )


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
