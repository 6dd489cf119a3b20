"""The options and ini values that make a run's settings, and the settings built from them.

Which launcher, backend, device and world sizes a run uses, its seed, threads per rank,
rendezvous, peer grace, memory limit, device audit and device sharing: registered here and
read once, at configure time, into the :class:`~distconform.harness.controller.config.DistSettings`
that :mod:`distconform.harness.plugin` stores for the session.
"""

from __future__ import annotations

import pytest

from distconform.harness.controller.config import (
    ConfigError,
    DistSettings,
    check_device_type,
    parse_memory_limit,
    parse_world_sizes,
)
from distconform.harness.controller.deadline import configured_deadline
from distconform.harness.controller.launcher_registry import BUILT_IN_LAUNCHERS, launcher_named
from distconform.harness.controller.launcher_registry import DEFAULT as DEFAULT_LAUNCHER
from distconform.harness.controller.option_group import option_group
from distconform.harness.controller.session import requested_launcher


def pytest_addoption(parser: pytest.Parser) -> None:
    group = option_group(parser)
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
        "--no-dist-stream-check",
        dest="dist_stream_check",
        action="store_false",
        default=None,
        help="do not check stream safety on devices that can (the fake device): unordered "
        "accesses between streams and early frees (default: ini dist_stream_check, on; "
        "marker stream_check for one test)",
    )
    group.addoption(
        "--dist-share-devices",
        action="store_true",
        default=False,
        help="with fewer devices than ranks, place the ranks round-robin on the devices there "
        "are, where the backend can share one (staged_gloo, gloo; not nccl) (default: ini "
        "dist_share_devices, off: one device per rank)",
    )
    parser.addini("dist_launcher", "default launcher", default=DEFAULT_LAUNCHER)
    parser.addini(
        "dist_share_devices",
        "place ranks round-robin on fewer devices than ranks (see --dist-share-devices)",
        type="bool",
        default=False,
    )
    parser.addini(
        "dist_stream_check",
        "check stream safety on devices that can (see --no-dist-stream-check)",
        type="bool",
        default=True,
    )
    parser.addini(
        "dist_device_audit",
        "fail distributed tests whose body creates a tensor without a device",
        type="bool",
        default=False,
    )


def settings_from(config: pytest.Config) -> DistSettings:
    """The run's settings, from these options and ini values, checked."""
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
        deadline_named=config.getoption("dist_deadline") is not None
        or bool(config.getini("dist_deadline")),
        threads_per_rank=threads,
        world_sizes=parse_world_sizes(config.getoption("world_sizes")),
        fresh_pool=config.getoption("dist_fresh_pool"),
        peer_grace=grace,
        rendezvous=config.getoption("dist_rendezvous"),
        memory_limit=parse_memory_limit(
            config.getoption("dist_memory_limit"), "--dist-memory-limit"
        ),
        device_audit=config.getoption("dist_device_audit") or config.getini("dist_device_audit"),
        stream_check=_stream_check(config),
        share_devices=config.getoption("dist_share_devices") or config.getini("dist_share_devices"),
        warning_filters=warning_filters(config),
    )


def _stream_check(config: pytest.Config) -> bool:
    chosen = config.getoption("dist_stream_check")
    return bool(config.getini("dist_stream_check")) if chosen is None else chosen


def warning_filters(config: pytest.Config) -> tuple[tuple[str, bool], ...]:
    """The ini ``filterwarnings`` lines, then ``-W`` options (later ones win).

    Each comes with whether its text is literal (command line) or a regex (ini).
    """
    ini = [(line.strip(), False) for line in config.getini("filterwarnings") if line.strip()]
    cli = [(line, True) for line in config.known_args_namespace.pythonwarnings or []]
    return (*ini, *cli)
