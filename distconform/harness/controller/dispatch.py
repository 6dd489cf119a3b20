"""From a run's settings to ranks: which pool serves it, and the task the ranks receive.

Every caller that puts work on ranks (a pytest item in
:mod:`distconform.harness.controller.item_runner`, a plain function in
:mod:`distconform.harness.controller.run_function`, an example drawn inside a test in
:mod:`distconform.harness.controller.session_ranks`) builds its pool key, its task and its pools
here, so the three never drift apart.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from distconform.harness._pytest_private import AssertionSettings
from distconform.harness.controller.deadline import pg_timeout_for
from distconform.harness.controller.launcher_registry import Echo, launcher_named
from distconform.harness.controller.pools import PoolKey, PoolManager, RankPool, env_fingerprint
from distconform.harness.shared.rewritten_imports import rewritten_modules
from distconform.harness.shared.task import RankTask, pack_call


def pool_key(
    *,
    launcher: str,
    world_size: int,
    backend: str,
    device_type: str,
    threads_per_rank: int,
    rendezvous: str = "file",
    share_devices: bool = False,
    joins_world: bool = True,
) -> PoolKey:
    """The key of the warm pool that can run this world, the inherited environment included."""
    return PoolKey(
        launcher=launcher,
        world_size=world_size,
        backend=backend,
        device_type=device_type,
        threads_per_rank=threads_per_rank,
        rendezvous=rendezvous,
        share_devices=share_devices and device_type != "cpu",
        env_fingerprint=env_fingerprint(),
        joins_world=joins_world,
    )


def build_task(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    test_id: str,
    seed: int,
    deadline: float,
    memory_limit: int | None = None,
    warning_filters: tuple[tuple[str, bool], ...] = (),
    device_audit: bool = False,
    stream_check: bool = True,
    assertions: AssertionSettings | None = None,
) -> RankTask:
    """``fn(*args, **kwargs)`` packed for the ranks; raises ``TaskPackingError`` when it
    cannot travel (a local function, an argument that does not pickle). With
    ``assertions``, ranks rewrite the modules pytest rewrote here."""
    payload, modules = pack_call(fn, tuple(args), dict(kwargs or {}))
    return RankTask(
        test_id=test_id,
        payload=payload,
        modules=modules,
        sys_path=tuple(p for p in sys.path if p),
        seed=seed,
        pg_timeout=pg_timeout_for(deadline),
        memory_limit=memory_limit,
        warning_filters=warning_filters,
        device_audit=device_audit,
        stream_check=stream_check,
        rewritten=rewritten_modules() if assertions is not None else (),
        assertions=assertions,
    )


def make_pool(key: PoolKey, *, echo: Echo = None) -> RankPool:
    """A new, not yet started pool for ``key``; ``echo`` streams rank output live (``-s``)."""
    return launcher_named(key.launcher).make_pool(key, echo)


def pool_manager(echo: Echo = None) -> PoolManager:
    """An empty set of warm pools that starts each pool on first use."""
    return PoolManager(lambda key: make_pool(key, echo=echo))
