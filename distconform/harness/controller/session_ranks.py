"""Running a function on ranks from inside an ordinary pytest test, on the session's pools.

A Hypothesis test draws its examples in the pytest process (Hypothesis cannot run one body
per rank), then ships each example to the ranks with :func:`run_in_session`. Using the
session's :class:`~distconform.harness.controller.pools.PoolManager` keeps the ranks warm across
examples, where ``harness.run_on_ranks`` would start and stop a pool for every one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from distconform.harness.controller.dispatch import build_task, pool_key
from distconform.harness.controller.failure_report import DistributedFailure
from distconform.harness.controller.launcher_registry import THREAD, launcher_named
from distconform.harness.controller.run_function import run_on_ranks
from distconform.harness.controller.session import assertion_settings_of, pools_of, settings_of
from distconform.harness.shared.outcomes import Outcome


def run_in_session(
    config: pytest.Config,
    fn: Callable[..., Any],
    world_size: int,
    kwargs: dict[str, Any] | None = None,
    *,
    launcher: str = THREAD,
    deadline: float = 120.0,
    context: str = "",
    fresh: bool = False,
    device_audit: bool = False,
) -> list[Any]:
    """``fn(**kwargs)`` on ``world_size`` CPU ranks; every rank's return value, in rank order.

    Raises :class:`harness.DistributedFailure` (the full per-rank report) unless every rank
    passed. ``fn`` must be defined at module level and ``kwargs`` must pickle. ``fresh``
    runs it on ranks of its own (for state that outlives the harness's group teardown);
    ``device_audit`` fails a tensor ``fn`` creates without a device
    (``distconform.harness.rank.device_audit``).
    """
    settings = settings_of(config)
    pools = pools_of(config)
    if pools is None or not launcher_named(settings.launcher).starts_ranks:
        return run_on_ranks(
            fn,
            world_size,
            (),
            kwargs,
            launcher=launcher,
            deadline=deadline,
            device_audit=device_audit,
        )
    task = build_task(
        fn,
        (),
        kwargs,
        test_id=context or getattr(fn, "__qualname__", repr(fn)),
        seed=settings.seed,
        deadline=deadline,
        device_audit=device_audit,
        assertions=assertion_settings_of(config),
    )
    key = pool_key(
        launcher=launcher,
        world_size=world_size,
        backend=launcher_named(launcher).backend_for(None, "cpu"),
        device_type="cpu",
        threads_per_rank=settings.threads_for(world_size),
        rendezvous=settings.rendezvous,
    )
    run = pools.run(key, task, deadline=deadline, peer_grace=settings.peer_grace, fresh=fresh)
    if run.results and all(r.outcome is Outcome.NOT_STARTED for r in run.results):
        # The pool never started (e.g. the fork server did not answer on a loaded machine):
        # no rank ran the example, so it says nothing about it. One more try, on a new pool.
        run = pools.run(key, task, deadline=deadline, peer_grace=settings.peer_grace, fresh=fresh)
    if not run.ok or run.by_outcome(Outcome.SKIPPED, Outcome.XFAILED):
        raise DistributedFailure(run, context=context or f"ws {world_size}", reproducer=None)
    return run.values
