"""One distributed item's settings, resolved once, at setup.

The session's settings (:mod:`distconform.harness.controller.config`), the item's markers, the
launcher and backend it runs on, its deadline and pytest-timeout's limit, its pool and the command
that reproduces it: every later step (the run, the verdict, the report) reads the
:class:`ItemSettings` stored on the item, and none derives any of it again.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pytest

from distconform.harness._pytest_private import AssertionSettings
from distconform.harness.controller.config import (
    ConfigError,
    DistSettings,
    device_count,
    sharing_refusal,
)
from distconform.harness.controller.deadline import OuterLimit, deadline_for, outer_limit_for
from distconform.harness.controller.deadline_history import history_of
from distconform.harness.controller.dispatch import pool_key
from distconform.harness.controller.launcher_registry import Launcher, launcher_named
from distconform.harness.controller.markers import memory_limit_of, required_devices_of
from distconform.harness.controller.pools import PoolKey
from distconform.harness.controller.session import (
    assertion_settings_of,
    external_world,
    settings_of,
    world_size_of,
)

if TYPE_CHECKING:
    from distconform.harness.controller.external.world import ExternalWorld

#: Set by ``pytest_runtest_protocol``: when the item's clock (pytest-timeout's too) started.
STARTED_KEY = pytest.StashKey[float]()
ITEM_SETTINGS_KEY = pytest.StashKey["ItemSettings"]()


@dataclass(frozen=True)
class PoolChoice:
    """Where an item runs when it does not take the session's launcher and backend (an
    adopted ``MultiThreadedTestCase`` runs on rank threads), or needs a pool of its own.
    A plugin gives it through the ``pytest_distconform_pool_choice`` hook."""

    launcher: str | None = None
    backend: str | None = None
    fresh: bool = False
    #: Ranks without a default process group, on a pool of their own: for a test that
    #: creates its own world (its own backend), as under torch's own harness.
    own_world: bool = False


@dataclass(frozen=True)
class ItemSettings:
    world_size: int
    #: The session's settings, with the item's own launcher and backend.
    run: DistSettings
    deadline: float
    #: Why ``deadline`` is what it is (a hang's report says it).
    deadline_reason: str
    outer_limit: OuterLimit | None
    memory_limit: int | None
    device_audit: bool
    stream_check: bool
    warning_filters: tuple[tuple[str, bool], ...]
    #: None under torchrun: every rank there is a pytest process that rewrote its modules.
    assertions: AssertionSettings | None
    #: The torchrun or srun world this process is a rank of; None when ranks are started.
    world: ExternalWorld | None
    pool: PoolKey | None
    fresh: bool
    #: A failure report's first line: the run's placement, stack and seed.
    failure_context: str
    reproduce: str
    #: Why this machine cannot run the item; it is skipped before any rank exists.
    skip_reason: str | None


def resolve_item_settings(item: pytest.Item) -> ItemSettings | None:
    """Resolve a distributed item's settings at its setup and keep them on the item, where
    every later step reads them (``item.stash[ITEM_SETTINGS_KEY]``); None for any other item."""
    settings = _resolve(item)
    if settings is not None:
        item.stash[ITEM_SETTINGS_KEY] = settings
    return settings


def _resolve(item: pytest.Item) -> ItemSettings | None:
    # What the session holds first, then what the item's own markers say, then the pieces
    # other modules build from both.
    config = item.config
    world_size = world_size_of(item)
    if world_size is None:
        return None
    run = settings_of(config)
    world = external_world(config)
    assertions = None if world is not None else assertion_settings_of(config)
    choice = config.hook.pytest_distconform_pool_choice(item=item) or PoolChoice()
    if choice.launcher or choice.backend:
        # The item's own launcher and backend: its report and reproduce command name them.
        run = replace(
            run, launcher=choice.launcher or run.launcher, backend=choice.backend or run.backend
        )
    launcher = launcher_named(run.launcher)
    deadline, deadline_reason = _deadline(item, run)
    memory_limit = _memory_limit(item, run)
    device_audit = _enabled_by_marker(item, "device_audit", run.device_audit)
    stream_check = _enabled_by_marker(item, "stream_check", run.stream_check)
    reproduce = _reproducer(item, run, launcher, world, world_size)
    skip_reason = _cannot_run(item, run, launcher, world_size, memory_limit)
    return ItemSettings(
        world_size=world_size,
        run=run,
        deadline=deadline,
        deadline_reason=deadline_reason,
        outer_limit=outer_limit_for(item, item.stash.get(STARTED_KEY, time.monotonic())),
        memory_limit=memory_limit,
        device_audit=device_audit,
        stream_check=stream_check,
        # Ranks that share one warnings state (threads) capture nothing.
        warning_filters=run.warning_filters if launcher.isolates_warnings else (),
        assertions=assertions,
        world=world,
        pool=None
        if world is not None
        else pool_key(
            launcher=run.launcher,
            world_size=world_size,
            backend=run.backend,
            device_type=run.device_type,
            threads_per_rank=run.threads_for(world_size),
            rendezvous=run.rendezvous,
            share_devices=run.share_devices,
            joins_world=not choice.own_world,
        ),
        fresh=choice.fresh
        or choice.own_world
        or run.fresh_pool
        or item.get_closest_marker("fresh_pool") is not None,
        failure_context=(
            f"{run.placement(world_size)}, "
            f"{run.launcher}/{run.backend}/{run.device_type}, seed {run.seed}"
        ),
        reproduce=reproduce,
        skip_reason=skip_reason,
    )


def _deadline(item: pytest.Item, run: DistSettings) -> tuple[float, str]:
    """The test's marker, else a deadline named for the run, else its recorded durations',
    else the default; and which of them it is."""
    if item.get_closest_marker("deadline") is not None:
        return deadline_for(item, run.deadline), "its deadline marker"
    if run.deadline_named:
        return run.deadline, "named for the run (--dist-deadline or ini dist_deadline)"
    return history_of(item.config).deadline(item.nodeid, run.deadline)


def _memory_limit(item: pytest.Item, run: DistSettings) -> int | None:
    marker = item.get_closest_marker("memory_limit")
    if marker is None:
        return run.memory_limit
    try:
        return memory_limit_of(marker)
    except ConfigError as exc:
        raise pytest.UsageError(f"{item.nodeid}: {exc}") from None


def _enabled_by_marker(item: pytest.Item, name: str, default: bool) -> bool:
    """A check's own marker (``device_audit``, ``stream_check``), else the run's setting."""
    marker = item.get_closest_marker(name)
    if marker is None:
        return default
    enabled = marker.kwargs.get("enabled", marker.args[0] if marker.args else True)
    if len(marker.args) > 1 or set(marker.kwargs) - {"enabled"} or not isinstance(enabled, bool):
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.{name} takes one optional bool (enabled), got "
            f"args {marker.args!r} and kwargs {marker.kwargs!r}"
        )
    return enabled


def _cannot_run(
    item: pytest.Item,
    run: DistSettings,
    launcher: Launcher,
    world_size: int,
    memory_limit: int | None,
) -> str | None:
    """Why the machine cannot run the item, decided in the parent before any rank exists."""
    if not launcher.starts_ranks:
        return None  # torchrun, not the harness, decided how many ranks and devices there are
    if memory_limit is not None and not launcher.limits_memory:
        return "a per-rank memory limit needs rank processes (--launcher process)"
    device_type = run.device_type
    if item.get_closest_marker("requires_accelerator") and device_type == "cpu":
        return "needs an accelerator; this run's device is cpu (choose one with --device)"
    available = device_count(device_type)
    needed = world_size if device_type != "cpu" else 0
    if run.share_devices and available:
        refusal = sharing_refusal(run.backend, device_type, world_size, available)
        if refusal is not None:
            return refusal
        needed = min(needed, 1)
    marker = item.get_closest_marker("requires_devices")
    if marker is not None:
        needed = max(needed, required_devices_of(marker))
    if available is not None and available < needed:
        return f"needs {needed} {device_type} device(s), this machine has {available}"
    return None


def _reproducer(
    item: pytest.Item,
    run: DistSettings,
    launcher: Launcher,
    world: ExternalWorld | None,
    world_size: int,
) -> str:
    if world is not None and world.me.starter == "slurm":
        runner = ["srun", "--ntasks", str(world_size), "python"]
    else:
        runner = launcher.reproduce_prefix(world_size)
    command = item.config.hook.pytest_distconform_reproducer_command(config=item.config)
    args = [
        *runner,
        *(command or ["-m", "pytest"]),
        item.nodeid,
        "--launcher",
        run.launcher,
        "--backend",
        run.backend,
        "--device",
        run.device_type,
        "--dist-seed",
        str(run.seed),
    ]
    if run.device_audit:
        args.append("--dist-device-audit")
    if not run.stream_check:
        args.append("--no-dist-stream-check")
    if run.share_devices:
        args.append("--dist-share-devices")
    for extra in item.config.hook.pytest_distconform_reproducer_args(config=item.config):
        args.extend(extra)
    return shlex.join(args)
