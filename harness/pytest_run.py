"""Running one ``world_size``-marked pytest item on its ranks and judging the result."""

from __future__ import annotations

import shlex
import sys
import threading
import time
from functools import partial
from typing import TYPE_CHECKING

import pytest

from harness import summary
from harness.config import ConfigError, DistSettings, device_count
from harness.deadline import deadline_for, outer_limit_for, pg_timeout_for
from harness.leasing import LeasedPool
from harness.outcomes import Outcome, RunResult
from harness.pools import PoolKey, PoolManager, RankPool, env_fingerprint
from harness.process.spawning import close_shared_zygote
from harness.rank_warnings import filters_from_config, reemit
from harness.report import DistributedFailure
from harness.task import RankTask, TaskPackingError, pack_call

if TYPE_CHECKING:
    from harness.external import ExternalWorld

POOLS_KEY = pytest.StashKey[PoolManager]()
EXTERNAL_KEY = pytest.StashKey["ExternalWorld"]()
RUN_KEY = pytest.StashKey[RunResult]()
STARTED_KEY = pytest.StashKey[float]()

_echo_lock = threading.Lock()


class HygieneWarning(pytest.PytestWarning):
    """A distributed test left something behind on its ranks; their pool was recycled."""


def _echo(text: str) -> None:
    with _echo_lock:
        sys.stdout.write(text)
        sys.stdout.flush()


def make_pool(key: PoolKey, *, echo) -> RankPool:
    if key.launcher == "process":
        from harness.process.pool import ProcessPool, ProcessPoolSpec

        def process_pool(extra_env: dict[str, str]) -> RankPool:
            spec = ProcessPoolSpec(
                world_size=key.world_size,
                backend=key.backend,
                device_type=key.device_type,
                threads_per_rank=key.threads_per_rank,
                rendezvous=key.rendezvous,
                env=(*key.env, *extra_env.items()),
                echo=echo,
            )
            return ProcessPool(spec)

        total = device_count(key.device_type)
        if total is None:
            return process_pool({})
        # Accelerator ranks: lease devices so parallel pytest workers never share one.
        return LeasedPool(key.device_type, key.world_size, total, process_pool)
    if key.launcher == "thread":
        from harness.threads.host import ThreadHostPool

        return ThreadHostPool(key.world_size, echo=echo)
    raise ConfigError(
        f"the {key.launcher!r} launcher does not start ranks: under torchrun, the ranks "
        f"already exist and each runs pytest with --launcher external"
    )


def configure(config: pytest.Config, settings: DistSettings) -> None:
    streaming = config.getoption("capture") == "no"
    config.stash[POOLS_KEY] = PoolManager(partial(make_pool, echo=_echo if streaming else None))
    if settings.launcher == "external":
        from harness.external import ExternalWorld

        world = ExternalWorld(settings.backend, settings.device_type)
        world.join()
        config.stash[EXTERNAL_KEY] = world


def external_world(config: pytest.Config) -> ExternalWorld | None:
    return config.stash.get(EXTERNAL_KEY, None)


def unconfigure(config: pytest.Config) -> None:
    pools = config.stash.get(POOLS_KEY, None)
    if pools is not None:
        pools.shutdown()
    close_shared_zygote()
    world = external_world(config)
    if world is not None:
        world.close()


def _settings(item: pytest.Item) -> DistSettings:
    from harness.plugin import SETTINGS_KEY

    return item.config.stash[SETTINGS_KEY]


def mark_started(item: pytest.Item) -> None:
    item.stash[STARTED_KEY] = time.monotonic()


def check_resources(item: pytest.Item) -> None:
    """Skip in the parent, before any rank exists, when the machine cannot run the test."""
    from harness.plugin import world_size_of

    settings = _settings(item)
    device_type = settings.device_type
    if settings.launcher == "external":
        return  # torchrun, not the harness, decided how many ranks and devices there are
    if memory_limit_for(item) is not None and settings.launcher != "process":
        pytest.skip("a per-rank memory limit needs rank processes (--launcher process)")
    if item.get_closest_marker("requires_accelerator") and device_type == "cpu":
        pytest.skip("needs an accelerator; this run's device is cpu (choose one with --device)")
    needed = world_size_of(item) if device_type != "cpu" else 0
    marker = item.get_closest_marker("requires_devices")
    if marker is not None:
        needed = max(needed, int(marker.args[0]))
    available = device_count(device_type)
    if available is not None and available < needed:
        pytest.skip(f"needs {needed} {device_type} device(s), this machine has {available}")


def memory_limit_for(item: pytest.Item) -> int | None:
    marker = item.get_closest_marker("memory_limit")
    if marker is None:
        return _settings(item).memory_limit
    from harness.plugin import _memory_limit

    try:
        return _memory_limit(marker.args[0], "@pytest.mark.memory_limit")
    except ConfigError as exc:
        raise pytest.UsageError(f"{item.nodeid}: {exc}") from None


def device_audit_for(item: pytest.Item) -> bool:
    """The ``device_audit`` marker, else --dist-device-audit / ini ``dist_device_audit``."""
    marker = item.get_closest_marker("device_audit")
    if marker is None:
        return _settings(item).device_audit
    enabled = marker.kwargs.get("enabled", marker.args[0] if marker.args else True)
    if len(marker.args) > 1 or set(marker.kwargs) - {"enabled"} or not isinstance(enabled, bool):
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.device_audit takes one optional bool (enabled), got "
            f"args {marker.args!r} and kwargs {marker.kwargs!r}"
        )
    return enabled


def pool_key(settings: DistSettings, world_size: int) -> PoolKey:
    return PoolKey(
        launcher=settings.launcher,
        world_size=world_size,
        backend=settings.backend,
        device_type=settings.device_type,
        threads_per_rank=settings.threads_for(world_size),
        rendezvous=settings.rendezvous,
        env_fingerprint=env_fingerprint(),
    )


def run_item(item: pytest.Function) -> None:
    from harness.plugin import world_size_of

    settings = _settings(item)
    world_size = world_size_of(item)
    kwargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    deadline = deadline_for(item, settings.deadline)
    try:
        payload, modules = pack_call(item.obj, (), kwargs)
    except TaskPackingError as exc:
        pytest.fail(str(exc), pytrace=False)
    task = RankTask(
        test_id=item.nodeid,
        payload=payload,
        modules=modules,
        sys_path=tuple(p for p in sys.path if p),
        seed=settings.seed,
        pg_timeout=pg_timeout_for(deadline),
        memory_limit=memory_limit_for(item),
        warning_filters=filters_from_config(item.config) if settings.launcher != "thread" else (),
        device_audit=device_audit_for(item),
    )
    world = external_world(item.config)
    if world is not None:
        run = world.run(task, deadline)
        if world.broken_reason is not None:
            item.session.shouldstop = world.broken_reason
    else:
        fresh = settings.fresh_pool or item.get_closest_marker("fresh_pool") is not None
        run = item.config.stash[POOLS_KEY].run(
            pool_key(settings, world_size),
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
        ("rank_outcomes", " ".join(f"{r.rank}:{r.outcome.value}" for r in run.results))
    )
    _conclude(item, settings, run)


_RUN_PROPERTIES = frozenset({"rank_outcomes"})


def _group_by_violation(run: RunResult) -> dict[str, list[int]]:
    grouped: dict[str, list[int]] = {}
    for rank, violations in run.hygiene_violations.items():
        for violation in violations:
            grouped.setdefault(violation, []).append(rank)
    return grouped


def _conclude(item: pytest.Function, settings: DistSettings, run: RunResult) -> None:
    if run.ok:
        if run.all_skipped:
            pytest.skip(_joined_reasons(run, Outcome.SKIPPED))
        if run.by_outcome(Outcome.XFAILED):
            pytest.xfail(_joined_reasons(run, Outcome.XFAILED))
        return
    context = (
        f"ws {run.world_size}, {settings.launcher}/{settings.backend}/{settings.device_type}, "
        f"seed {run.seed}"
    )
    raise DistributedFailure(run, context=context, reproducer=reproducer(item, settings))


def _joined_reasons(run: RunResult, outcome: Outcome) -> str:
    reasons = sorted({r.reason or "" for r in run.by_outcome(outcome)})
    return "; ".join(reasons)


def reproducer(item: pytest.Item, settings: DistSettings) -> str:
    if settings.launcher == "external":
        from harness.plugin import world_size_of

        runner = ["torchrun", "--nproc-per-node", str(world_size_of(item))]
    else:
        runner = [sys.executable.rsplit("/", 1)[-1]]
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
