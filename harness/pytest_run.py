"""Running one ``world_size``-marked pytest item on its ranks and judging the result.

The one control file between the plugin's hooks and the pools: the item becomes a
:class:`~harness.task.RankTask` (:mod:`harness.launchers`), runs on a warm pool
(:mod:`harness.pools`) or the torchrun world (:mod:`harness.external`), and its
:class:`~harness.outcomes.RunResult` becomes pytest's verdict and report.
"""

from __future__ import annotations

import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest

from harness import summary
from harness._pytest_private import skip_at_the_items_location
from harness.config import ConfigError, DistSettings, device_count, sharing_refusal
from harness.deadline import deadline_for, outer_limit_for
from harness.gc_freeze import freeze_heap
from harness.launcher_registry import launcher_named
from harness.launchers import build_task, pool_key, pool_manager
from harness.markers import memory_limit_of, required_devices_of
from harness.outcomes import Outcome, RunResult
from harness.process.spawning import close_shared_zygote, shared_zygote
from harness.rank_warnings import filters_from_config, reemit
from harness.report import DistributedFailure
from harness.session import (
    EXTERNAL_KEY,
    POOLS_KEY,
    RANK_OUTCOMES_PROPERTY,
    REPRODUCE_PROPERTY,
    assertion_settings_of,
    external_world,
    pools_of,
    requested_launcher,
    settings_of,
    world_size_of,
)
from harness.task import TaskPackingError

RUN_KEY = pytest.StashKey[RunResult]()
STARTED_KEY = pytest.StashKey[float]()

_echo_lock = threading.Lock()


class HygieneWarning(pytest.PytestWarning):
    """A distributed test left something behind on its ranks; their pool was recycled."""


def _echo(text: str) -> None:
    with _echo_lock:
        sys.stdout.write(text)
        sys.stdout.flush()


def configure(config: pytest.Config, settings: DistSettings) -> None:
    """Register this module's hooks, and the pools (or the torchrun world) they run on."""
    config.pluginmanager.register(sys.modules[__name__], "distconform-run")
    streaming = config.getoption("capture") == "no"
    config.stash[POOLS_KEY] = pool_manager(_echo if streaming else None)
    world = launcher_named(settings.launcher).join_world(settings.backend, settings.device_type)
    if world is not None:
        config.stash[EXTERNAL_KEY] = world


def unconfigure(config: pytest.Config) -> None:
    pools = pools_of(config)
    if pools is not None:
        pools.shutdown()
    close_shared_zygote()
    world = external_world(config)
    if world is not None:
        world.close()


# --- hooks ---------------------------------------------------------------------------------

PRESTARTED_KEY = pytest.StashKey[bool]()
# In pytest's cache: whether the last session in this rootdir collected distributed tests.
RAN_DISTRIBUTED_CACHE_KEY = "distconform/collected_distributed_tests"


def prestart_if_expected(config: pytest.Config) -> None:
    """Start the rank fork server at once when the last session here collected distributed
    tests: its torch import then runs beside the pytest process's own, not after it.

    Called before anything in this process imports torch. Otherwise the first distributed
    test collected starts it (``pytest_itemcollected``).
    """
    cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
    if cache is not None and cache.get(RAN_DISTRIBUTED_CACHE_KEY, False) is True:
        _start_fork_server(config, requested_launcher(config))


def _start_fork_server(config: pytest.Config, launcher: str) -> None:
    """Start it once per session, for the launchers that fork ranks from it, and never for
    a session that only collects."""
    config.stash[PRESTARTED_KEY] = True
    try:
        starts_ranks = launcher_named(launcher).starts_ranks
    except ConfigError:
        return  # reported, as a usage error, at configure
    if starts_ranks and not config.option.collectonly:
        shared_zygote().prestart()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Remember for the next session whether this one has distributed tests, and freeze
    what collection left on the heap (torch, DTensor, the items) out of the garbage
    collector's reach: every full collection during the tests would walk it all again.
    Worth 3 ms a trivial distributed test on 2 cores."""
    distributed = any(world_size_of(item) is not None for item in session.items)
    cache = getattr(session.config, "cache", None)
    # An xdist controller collects no items of its own: only its workers can tell.
    if cache is not None and session.items:
        cache.set(RAN_DISTRIBUTED_CACHE_KEY, distributed)
    if distributed:
        freeze_heap()


def pytest_itemcollected(item: pytest.Item) -> None:
    """At the first distributed test collected, start the rank fork server: its torch
    import then overlaps the rest of collection instead of delaying the first test."""
    config = item.config
    if not config.stash.get(PRESTARTED_KEY, False) and world_size_of(item) is not None:
        _start_fork_server(config, settings_of(config).launcher)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    item.stash[STARTED_KEY] = time.monotonic()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if world_size_of(item) is not None:
        check_resources(item)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if world_size_of(pyfuncitem) is None:
        return None
    run_item(pyfuncitem)
    return True


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """How many rank pools the session started: a start costs seconds at ws 8 on 2 cores,
    so replaced pools are worth knowing about. Shown with ``-v``, and whenever a test left
    its pool broken."""
    pools = pools_of(config)
    if pools is None or not pools.spawn_count:
        return
    if pools.recycle_count or config.get_verbosity() > 0:
        terminalreporter.write_line(
            f"distconform: started {pools.spawn_count} rank pool(s); {pools.recycle_count} "
            f"replaced a pool that a test left broken (a failure, a hang or a hygiene "
            f"violation; see the test's report)"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    decorate_report(item, call, report)
    return report


# --- one item on its ranks -----------------------------------------------------------------


def check_resources(item: pytest.Item) -> None:
    """Skip in the parent, before any rank exists, when the machine cannot run the test."""
    settings = settings_of(item.config)
    device_type = settings.device_type
    launcher = launcher_named(settings.launcher)
    if not launcher.starts_ranks:
        return  # torchrun, not the harness, decided how many ranks and devices there are
    if memory_limit_for(item) is not None and not launcher.limits_memory:
        pytest.skip("a per-rank memory limit needs rank processes (--launcher process)")
    if item.get_closest_marker("requires_accelerator") and device_type == "cpu":
        pytest.skip("needs an accelerator; this run's device is cpu (choose one with --device)")
    world_size = world_size_of(item)
    available = device_count(device_type)
    needed = world_size if device_type != "cpu" else 0
    if settings.share_devices and available:
        refusal = sharing_refusal(settings.backend, device_type, world_size, available)
        if refusal is not None:
            pytest.skip(refusal)
        needed = min(needed, 1)
    marker = item.get_closest_marker("requires_devices")
    if marker is not None:
        needed = max(needed, required_devices_of(marker))
    if available is not None and available < needed:
        pytest.skip(f"needs {needed} {device_type} device(s), this machine has {available}")


def memory_limit_for(item: pytest.Item) -> int | None:
    marker = item.get_closest_marker("memory_limit")
    if marker is None:
        return settings_of(item.config).memory_limit
    try:
        return memory_limit_of(marker)
    except ConfigError as exc:
        raise pytest.UsageError(f"{item.nodeid}: {exc}") from None


def device_audit_for(item: pytest.Item) -> bool:
    """The ``device_audit`` marker, else --dist-device-audit / ini ``dist_device_audit``."""
    marker = item.get_closest_marker("device_audit")
    if marker is None:
        return settings_of(item.config).device_audit
    enabled = marker.kwargs.get("enabled", marker.args[0] if marker.args else True)
    if len(marker.args) > 1 or set(marker.kwargs) - {"enabled"} or not isinstance(enabled, bool):
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.device_audit takes one optional bool (enabled), got "
            f"args {marker.args!r} and kwargs {marker.kwargs!r}"
        )
    return enabled


def run_item(item: pytest.Function) -> None:
    kwargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    run_on_ranks(item, item.obj, (), kwargs)


@dataclass(frozen=True)
class PoolChoice:
    """Where an item runs when it does not take the session's launcher and backend (an
    adopted ``MultiThreadedTestCase`` runs on rank threads), or needs a pool of its own."""

    launcher: str | None = None
    backend: str | None = None
    fresh: bool = False


def run_on_ranks(
    item: pytest.Item,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    choice: PoolChoice = PoolChoice(),
) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on the item's ranks and turn the result into pytest's
    verdict: return when every rank passed, raise skip, xfail or a DistributedFailure."""
    settings = settings_of(item.config)
    if choice.launcher or choice.backend:
        # The item's own launcher and backend: its report and reproduce command name them.
        settings = replace(
            settings,
            launcher=choice.launcher or settings.launcher,
            backend=choice.backend or settings.backend,
        )
    world_size = world_size_of(item)
    deadline = deadline_for(item, settings.deadline)
    world = external_world(item.config)
    try:
        task = build_task(
            fn,
            args,
            kwargs,
            test_id=item.nodeid,
            seed=settings.seed,
            deadline=deadline,
            memory_limit=memory_limit_for(item),
            # Ranks that share one warnings state (threads) capture nothing.
            warning_filters=filters_from_config(item.config)
            if launcher_named(settings.launcher).isolates_warnings
            else (),
            device_audit=device_audit_for(item),
            # Under torchrun every rank is a pytest process that rewrote its own modules.
            assertions=None if world is not None else assertion_settings_of(item.config),
        )
    except TaskPackingError as exc:
        pytest.fail(str(exc), pytrace=False)
    if world is not None:
        run = world.run(task, deadline)
        if world.broken_reason is not None:
            item.session.shouldstop = world.broken_reason
    else:
        fresh = (
            choice.fresh or settings.fresh_pool or item.get_closest_marker("fresh_pool") is not None
        )
        key = pool_key(
            launcher=settings.launcher,
            world_size=world_size,
            backend=settings.backend,
            device_type=settings.device_type,
            threads_per_rank=settings.threads_for(world_size),
            rendezvous=settings.rendezvous,
            share_devices=settings.share_devices,
        )
        run = item.config.stash[POOLS_KEY].run(
            key,
            task,
            deadline=deadline,
            peer_grace=settings.peer_grace,
            fresh=fresh,
            must_end_by=outer_limit_for(item, item.stash.get(STARTED_KEY, time.monotonic())),
        )
    item.stash[RUN_KEY] = run
    for result in run.results:
        if result.output:
            item.add_report_section("call", f"output rank {result.rank}", result.output)
    reemit({r.rank: r.warnings for r in run.results if r.warnings})
    for violation, ranks in _group_by_violation(run).items():
        listed = ", ".join(str(rank) for rank in ranks)
        item.warn(HygieneWarning(f"{violation} (ranks {listed}); the pool was recycled"))
    # The item (and its properties) is reused when pytest-rerunfailures retries it.
    item.user_properties[:] = [p for p in item.user_properties if p[0] not in _RUN_PROPERTIES]
    item.user_properties.append(
        (RANK_OUTCOMES_PROPERTY, " ".join(f"{r.rank}:{r.outcome.value}" for r in run.results))
    )
    _conclude(item, settings, run)
    return run


_RUN_PROPERTIES = frozenset({RANK_OUTCOMES_PROPERTY, REPRODUCE_PROPERTY})


def _group_by_violation(run: RunResult) -> dict[str, list[int]]:
    grouped: dict[str, list[int]] = {}
    for rank, violations in run.hygiene_violations.items():
        for violation in violations:
            grouped.setdefault(violation, []).append(rank)
    return grouped


def _conclude(item: pytest.Item, settings: DistSettings, run: RunResult) -> None:
    if run.ok:
        if run.all_skipped:
            skip_at_the_items_location(_joined_reasons(run, Outcome.SKIPPED))
        if run.by_outcome(Outcome.XFAILED):
            pytest.xfail(_joined_reasons(run, Outcome.XFAILED))
        return
    context = (
        f"{settings.placement(run.world_size)}, "
        f"{settings.launcher}/{settings.backend}/{settings.device_type}, seed {run.seed}"
    )
    command = reproducer(item, settings)
    item.user_properties.append((REPRODUCE_PROPERTY, command))
    raise DistributedFailure(run, context=context, reproducer=command)


def _joined_reasons(run: RunResult, outcome: Outcome) -> str:
    reasons = sorted({r.reason or "" for r in run.by_outcome(outcome)})
    return "; ".join(reasons)


def reproducer(item: pytest.Item, settings: DistSettings) -> str:
    world = external_world(item.config)
    if world is not None and world.me.starter == "slurm":
        runner = ["srun", "--ntasks", str(world_size_of(item)), "python"]
    else:
        runner = launcher_named(settings.launcher).reproduce_prefix(world_size_of(item))
    args = [
        *runner,
        "-m",
        "pytest",
        item.nodeid,
        "--launcher",
        settings.launcher,
        "--backend",
        settings.backend,
        "--device",
        settings.device_type,
        "--dist-seed",
        str(settings.seed),
    ]
    if settings.device_audit:
        args.append("--dist-device-audit")
    if settings.share_devices:
        args.append("--dist-share-devices")
    for extra in item.config.hook.pytest_distconform_reproducer_args(config=item.config):
        args.extend(extra)
    return shlex.join(args)


def decorate_report(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport) -> None:
    if report.when != "call":
        return
    run = item.stash.get(RUN_KEY, None)
    if run is not None:
        verdict = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        summary.record(item.config, item.nodeid, verdict, run)
    failure = call.excinfo.value if call.excinfo is not None else None
    if isinstance(failure, DistributedFailure) and report.failed:
        report.longrepr = failure.text
        report.distconform_failure_text = failure.text
