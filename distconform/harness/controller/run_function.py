"""Running a function on N ranks from plain Python, outside any pytest test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distconform.harness.controller.config import (
    DEFAULT_DEADLINE_S,
    DEFAULT_PEER_GRACE_S,
    ConfigError,
    check_device_type,
    check_world_size,
    default_threads_per_rank,
    device_count,
    sharing_refusal,
)
from distconform.harness.controller.dispatch import build_task, pool_key, pool_manager
from distconform.harness.controller.failure_report import DistributedFailure
from distconform.harness.controller.launcher_registry import DEFAULT as DEFAULT_LAUNCHER
from distconform.harness.controller.launcher_registry import launcher_named
from distconform.harness.shared import backend_plugins
from distconform.harness.shared.outcomes import Outcome, RunResult


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    launcher: str = DEFAULT_LAUNCHER,
    backend: str | None = None,
    device: str = "cpu",
    deadline: float = DEFAULT_DEADLINE_S,
    seed: int = 0,
    threads_per_rank: int | None = None,
    peer_grace: float = DEFAULT_PEER_GRACE_S,
    rendezvous: str = "file",
    echo: Callable[[str], None] | None = None,
    device_audit: bool = False,
    stream_check: bool = True,
    share_devices: bool = False,
) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on every rank of a fresh pool; return every rank's result.

    ``fn`` must be importable by reference (defined at module level) and its arguments
    picklable. Inside ``fn``, ``harness.get_rank_context()`` gives the rank's context.
    Nothing is raised for a failing rank: inspect the returned :class:`RunResult`.
    ``device_audit`` fails ``fn`` on a rank when it creates a tensor without a device
    (:mod:`distconform.harness.rank.device_audit`). ``stream_check`` fails it on a rank when, on a
    device that checks stream safety, it leaves an access unordered between streams
    (:mod:`distconform.harness.rank.stream_safety`). ``share_devices`` places the ranks round-robin
    on fewer devices than ranks, where the backend can share one (``--dist-share-devices``).
    """
    world_size = check_world_size(world_size)
    chosen = launcher_named(launcher)
    if not chosen.starts_ranks:
        raise ConfigError(
            f"launch() starts its own ranks, and the {launcher!r} launcher starts none; with "
            f"torchrun, run pytest in every rank with --launcher {launcher} instead"
        )
    # A bundled device or backend registers itself, published to these ranks only: the
    # caller's later children (other sessions, other pools) must not load it.
    with backend_plugins.published((), backend, device):
        device_type = check_device_type(device)
        backend = chosen.backend_for(backend, device_type)
        available = device_count(device_type)
        if share_devices and available:
            refusal = sharing_refusal(backend, device_type, world_size, available)
            if refusal is not None:
                raise ConfigError(refusal)
        elif available is not None and available < world_size:
            raise ConfigError(
                f"{world_size} ranks need {world_size} {device_type} devices, this machine has "
                f"{available}; each rank owns one device (or share them: share_devices=True)"
            )
        if deadline <= 0:
            raise ConfigError(f"deadline must be positive, got {deadline}")
        task = build_task(
            fn,
            args,
            kwargs,
            test_id=getattr(fn, "__qualname__", repr(fn)),
            seed=seed,
            deadline=deadline,
            device_audit=device_audit,
            stream_check=stream_check,
        )
        key = pool_key(
            launcher=launcher,
            world_size=world_size,
            backend=backend,
            device_type=device_type,
            threads_per_rank=threads_per_rank or default_threads_per_rank(world_size),
            rendezvous=rendezvous,
            share_devices=share_devices,
        )
        pools = pool_manager(echo)
        try:
            return pools.run(key, task, deadline=deadline, peer_grace=peer_grace)
        finally:
            pools.shutdown()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> list[Any]:
    """Like :func:`launch`, but return the per-rank return values or raise the report.

    Raises :class:`harness.DistributedFailure` (its text is the full per-rank report,
    its ``run`` attribute the :class:`RunResult`) unless every rank passed.
    """
    run = launch(fn, world_size, args, kwargs, **options)
    if not run.ok or run.by_outcome(Outcome.SKIPPED, Outcome.XFAILED):
        context = f"ws {world_size}, run_on_ranks({getattr(fn, '__qualname__', fn)})"
        raise DistributedFailure(run, context=context, reproducer=None)
    return run.values
