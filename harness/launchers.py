"""From a run's settings to ranks: which pool serves it, and the task the ranks receive.

Every caller that puts work on ranks (a pytest item in :mod:`harness.pytest_run`, a plain
function in :mod:`harness.api`, an example drawn inside a test in
:mod:`harness.session_ranks`) builds its :class:`~harness.pools.PoolKey`, its
:class:`~harness.task.RankTask` and its pools here, so the three never drift apart.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from harness._pytest_private import AssertionSettings
from harness.config import ConfigError, binds_device_id, device_count
from harness.deadline import pg_timeout_for
from harness.leasing import LeasedPool
from harness.pools import PoolKey, PoolManager, RankPool, env_fingerprint
from harness.rewritten_imports import rewritten_modules
from harness.task import RankTask, pack_call

Echo = Callable[[str], None] | None


def pool_key(
    *,
    launcher: str,
    world_size: int,
    backend: str,
    device_type: str,
    threads_per_rank: int,
    rendezvous: str = "file",
    share_devices: bool = False,
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
        rewritten=rewritten_modules() if assertions is not None else (),
        assertions=assertions,
    )


def make_pool(key: PoolKey, *, echo: Echo = None) -> RankPool:
    """A new, not yet started pool for ``key``; ``echo`` streams rank output live (``-s``)."""
    if key.launcher == "process":
        # The pools import harness.comm and with it DTensor: a session that never starts
        # ranks (all its tests local, or under torchrun) does not pay for them.
        from harness.process.pool import ProcessPool, ProcessPoolSpec

        total = device_count(key.device_type)
        # With shared devices the ranks take the devices there are, round-robin.
        devices = min(key.world_size, total) if key.share_devices and total else key.world_size

        def process_pool(extra_env: dict[str, str]) -> RankPool:
            spec = ProcessPoolSpec(
                world_size=key.world_size,
                backend=key.backend,
                device_type=key.device_type,
                threads_per_rank=key.threads_per_rank,
                rendezvous=key.rendezvous,
                devices=devices,
                bind_device=binds_device_id(key.backend),
                env=(*key.env, *extra_env.items()),
                echo=echo,
            )
            return ProcessPool(spec)

        if total is None or key.share_devices:
            # CPU ranks, or ranks that share devices anyway: nothing to lease.
            return process_pool({})
        # Accelerator ranks: lease devices so parallel pytest workers never share one.
        return LeasedPool(key.device_type, devices, total, process_pool)
    if key.launcher == "thread":
        # As above: the thread host's side imports the process pool.
        from harness.threads.host import ThreadHostPool

        return ThreadHostPool(key.world_size, echo=echo)
    raise ConfigError(
        f"the {key.launcher!r} launcher does not start ranks: under torchrun, the ranks "
        f"already exist and each runs pytest with --launcher external"
    )


def pool_manager(echo: Echo = None) -> PoolManager:
    """An empty set of warm pools that starts each pool on first use."""
    return PoolManager(lambda key: make_pool(key, echo=echo))
