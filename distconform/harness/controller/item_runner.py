"""Running one ``world_size``-marked pytest item on its ranks and judging the result.

The one control file between the plugin's hooks and the pools: the item becomes a
:class:`~distconform.harness.shared.task.RankTask` (:mod:`distconform.harness.controller.dispatch`),
runs on a warm pool (:mod:`distconform.harness.controller.pools`) or the torchrun world
(:mod:`distconform.harness.controller.external.world`), and its
:class:`~distconform.harness.shared.outcomes.RunResult` becomes pytest's verdict and report.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from distconform.harness._pytest_private import skip_at_the_items_location
from distconform.harness.controller import summary_table
from distconform.harness.controller.config import ConfigError, DistSettings
from distconform.harness.controller.deadline_history import history_of
from distconform.harness.controller.dispatch import build_task, pool_manager
from distconform.harness.controller.failure_report import DistributedFailure
from distconform.harness.controller.item_settings import (
    ITEM_SETTINGS_KEY,
    STARTED_KEY,
    ItemSettings,
    resolve_item_settings,
)
from distconform.harness.controller.launcher_registry import launcher_named
from distconform.harness.controller.process.spawning import close_shared_zygote, shared_zygote
from distconform.harness.controller.session import (
    EXTERNAL_KEY,
    INFRASTRUCTURE_RETRY_PROPERTY,
    POOLS_KEY,
    RANK_OUTCOMES_PROPERTY,
    REPRODUCE_PROPERTY,
    external_world,
    pools_of,
    requested_launcher,
    settings_of,
    world_size_of,
)
from distconform.harness.controller.warning_reemit import reemit
from distconform.harness.shared.gc_freeze import freeze_heap
from distconform.harness.shared.outcomes import Outcome, RunResult
from distconform.harness.shared.task import TaskPackingError

RUN_KEY = pytest.StashKey[RunResult]()

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
    """Start the rank fork server at once when a plugin says this session runs distributed
    tests (``--dist-adopt``: warm, see the hook), or the last session here collected some:
    its torch import then runs beside the pytest process's own, not after it.

    Called before anything in this process imports torch. Otherwise the first distributed
    test collected starts it (``pytest_itemcollected``).
    """
    cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
    announced = config.hook.pytest_distconform_expects_ranks(config=config)
    expected = announced or (
        cache is not None and cache.get(RAN_DISTRIBUTED_CACHE_KEY, False) is True
    )
    if expected:
        _start_fork_server(config, requested_launcher(config), warm=bool(announced))


def fork_server_requested(config: pytest.Config) -> bool:
    """Whether this session has already started (or decided on) its rank fork server."""
    return config.stash.get(PRESTARTED_KEY, False)


def start_fork_server_soon(
    config: pytest.Config, warm: bool = False, preload: tuple[str, ...] = ()
) -> None:
    """Start the rank fork server now, unless this session already has: for a plugin that
    learns during collection that ranks will be needed (``--dist-adopt`` finding a class of
    torch's harness), so that their start overlaps the rest of collection."""
    if not fork_server_requested(config):
        _start_fork_server(config, settings_of(config).launcher, warm, preload)


def _start_fork_server(
    config: pytest.Config, launcher: str, warm: bool = False, preload: tuple[str, ...] = ()
) -> None:
    """Start it once per session, for the launchers that fork ranks from it, and never for
    a session that only collects; ``warm`` and ``preload``: see ``Zygote.prestart``."""
    config.stash[PRESTARTED_KEY] = True
    try:
        starts_ranks = launcher_named(launcher).starts_ranks
    except ConfigError:
        return  # reported, as a usage error, at configure
    if starts_ranks and not config.option.collectonly:
        shared_zygote().prestart(warm, preload)


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
    if not fork_server_requested(config) and world_size_of(item) is not None:
        _start_fork_server(config, settings_of(config).launcher)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    item.stash[STARTED_KEY] = time.monotonic()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Resolve a distributed item's settings, and skip it before any rank exists when this
    machine cannot run it."""
    settings = resolve_item_settings(item)
    if settings is not None and settings.skip_reason is not None:
        pytest.skip(settings.skip_reason)


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


def run_item(item: pytest.Function) -> None:
    kwargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    run_item_body(item, item.obj, (), kwargs)


def run_item_body(
    item: pytest.Item, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on the item's ranks and turn the result into pytest's
    verdict: return when every rank passed, raise skip, xfail or a DistributedFailure."""
    settings = item.stash[ITEM_SETTINGS_KEY]
    try:
        task = build_task(
            fn,
            args,
            kwargs,
            test_id=item.nodeid,
            seed=settings.run.seed,
            deadline=settings.deadline,
            memory_limit=settings.memory_limit,
            warning_filters=settings.warning_filters,
            device_audit=settings.device_audit,
            stream_check=settings.stream_check,
            assertions=settings.assertions,
        )
    except TaskPackingError as exc:
        pytest.fail(str(exc), pytrace=False)
    if settings.world is not None:
        run = settings.world.run(task, settings.deadline)
        if settings.world.broken_reason is not None:
            item.session.shouldstop = settings.world.broken_reason
    else:
        run = item.config.stash[POOLS_KEY].run(
            settings.pool,
            task,
            deadline=settings.deadline,
            peer_grace=settings.run.peer_grace,
            fresh=settings.fresh,
            must_end_by=settings.outer_limit,
        )
    item.stash[RUN_KEY] = run
    history_of(item.config).record(item.nodeid, run)
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
    if run.infrastructure_retry is not None:
        item.user_properties.append((INFRASTRUCTURE_RETRY_PROPERTY, run.infrastructure_retry))
    _conclude(item, settings, run)
    return run


_RUN_PROPERTIES = frozenset(
    {RANK_OUTCOMES_PROPERTY, REPRODUCE_PROPERTY, INFRASTRUCTURE_RETRY_PROPERTY}
)


def _group_by_violation(run: RunResult) -> dict[str, list[int]]:
    grouped: dict[str, list[int]] = {}
    for rank, violations in run.hygiene_violations.items():
        for violation in violations:
            grouped.setdefault(violation, []).append(rank)
    return grouped


def _conclude(item: pytest.Item, settings: ItemSettings, run: RunResult) -> None:
    if run.ok:
        if run.all_skipped:
            skip_at_the_items_location(_joined_reasons(run, Outcome.SKIPPED))
        if run.by_outcome(Outcome.XFAILED):
            pytest.xfail(_joined_reasons(run, Outcome.XFAILED))
        return
    item.user_properties.append((REPRODUCE_PROPERTY, settings.reproduce))
    context = settings.failure_context
    if run.hung:
        context += f"; deadline {settings.deadline:g} s: {settings.deadline_reason}"
    raise DistributedFailure(run, context=context, reproducer=settings.reproduce)


def _joined_reasons(run: RunResult, outcome: Outcome) -> str:
    reasons = sorted({r.reason or "" for r in run.by_outcome(outcome)})
    return "; ".join(reasons)


def decorate_report(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport) -> None:
    if report.when != "call":
        return
    run = item.stash.get(RUN_KEY, None)
    if run is not None:
        verdict = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        summary_table.record(item.config, item.nodeid, verdict, run)
    failure = call.excinfo.value if call.excinfo is not None else None
    if isinstance(failure, DistributedFailure) and report.failed:
        report.longrepr = failure.text
        report.distconform_failure_text = failure.text
