"""What a test may leave behind on a warm rank, and what it may not.

Creating process groups is normal (HSDP and TP tests build meshes): the harness
destroys every group a test created, when the next test arrives. Not at the end of the
test: a rank that finishes first would close its side of a group that a slower rank is
still connecting (gloo's ``connectFullMesh`` then fails with "Connection closed by peer"
on that rank, and its peers wait in the next group until their timeout: issue 52); the
next test arrives only once every rank has finished this one. A group that cannot be
destroyed, a thread the test started and left running, an environment variable the test
changed, or a default group that no longer works is a *hygiene violation*: the pool is
recycled so the next test starts clean, and the test gets a warning naming the leak.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distconform.harness import _torch_private
from distconform.harness.shared.environ import changed_variables, raw_environment
from distconform.harness.shared.outcomes import GroupNaming

# Threads that finish on their own shortly after a test (autograd, timers) get this
# long before they count as leaked.
_THREAD_GRACE_S = 0.5


@dataclass(frozen=True)
class Snapshot:
    threads: frozenset[int]
    env: dict[Any, Any]  # distconform.harness.shared.environ.raw_environment()
    groups: frozenset[int]
    torch_globals: dict[str, object]
    #: Whether the rank had a default group before the test (a pool without one serves
    #: tests that create their own world).
    had_default_group: bool = True


def _torch_globals() -> dict[str, object]:
    """Process-wide torch switches a test can flip and forget to flip back."""
    return {
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "anomaly detection": torch.is_anomaly_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch threads": torch.get_num_threads(),
    }


def take_snapshot() -> Snapshot:
    groups = _torch_private.live_process_groups() if dist.is_initialized() else []
    return Snapshot(
        threads=frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
        env=raw_environment(),
        groups=frozenset(id(g) for g in groups),
        torch_globals=_torch_globals(),
        had_default_group=dist.is_initialized(),
    )


#: The snapshot taken before the last test, whose groups are still to be destroyed.
_last_test: Snapshot | None = None


def clean_up_after_test(before: Snapshot) -> list[str]:
    """Every hygiene violation the test left; its groups stay until the next test arrives
    (:func:`destroy_the_last_tests_groups`)."""
    global _last_test
    _last_test = before
    violations = changes_to_the_process(before)
    if before.had_default_group and not dist.is_initialized():
        violations.insert(0, "the default process group was destroyed by the test")
    return violations


def destroy_the_last_tests_groups(device_type: str = "cpu") -> list[str]:
    """Destroy the groups the last test created, now that every rank has finished it;
    return what could not be destroyed.

    Call it on the thread that ran the test: DTensor's caches of meshes over the destroyed
    groups are dropped with them, and one of those caches is per thread.
    """
    global _last_test
    before, _last_test = _last_test, None
    if before is None:
        return []
    return [
        f"after the previous test: {violation}"
        for violation in _destroy_new_groups(before, device_type)
    ]


def group_naming() -> GroupNaming | None:
    """How this rank's c10d world will name its next groups: read before the test's groups
    are destroyed (their hashed names go with them)."""
    if not dist.is_initialized():
        return None
    hashed = (
        _torch_private.registered_group_name(g) for g in _torch_private.iter_non_default_groups()
    )
    return GroupNaming(
        counter=_torch_private.process_group_count(),
        hashed=tuple(name for name in hashed if not name.isdigit()),
    )


def changes_to_the_process(before: Snapshot) -> list[str]:
    """What a test left changed in its process besides its groups: threads it started and
    left running, environment variables, torch's process-wide switches."""
    return _leaked_threads(before) + _changed_env(before) + _changed_torch_globals(before)


def _changed_torch_globals(before: Snapshot) -> list[str]:
    after = _torch_globals()
    return [
        f"torch {name} changed from {before.torch_globals[name]} to {value}"
        for name, value in after.items()
        if value != before.torch_globals[name]
    ]


def _destroy_new_groups(before: Snapshot, device_type: str) -> list[str]:
    if not before.had_default_group:
        # The test's own world: gone with the test, as with its own harness's process.
        if dist.is_initialized():
            dist.destroy_process_group()
            _release_destroyed_groups(device_type)
        return []
    if not dist.is_initialized():
        return []  # reported when the test ended
    violations = []
    destroyed = 0
    for group in list(_torch_private.iter_non_default_groups()):
        if id(group) in before.groups:
            continue
        try:
            dist.destroy_process_group(group)
            destroyed += 1
        except Exception as exc:
            violations.append(f"could not destroy a process group the test created: {exc}")
    if destroyed:
        _release_destroyed_groups(device_type)
    return violations


def _release_destroyed_groups(device_type: str) -> None:
    # DTensor caches results by mesh *value*: the next test's equal mesh would get back
    # this test's mesh object, whose groups are gone (issue 3).
    _torch_private.forget_dtensor_caches(device_type)
    # A destroyed group lives on while the test's objects (modules, meshes, pipeline
    # stages) that hold it sit in reference cycles, which only a full collection frees.
    # Its backend keeps its threads and sockets meanwhile: gloo's event loops spin once
    # peers close their ends, so a warm pool would burn CPU and grow by dozens of threads
    # per test.
    gc.collect()


def _leaked_threads(before: Snapshot) -> list[str]:
    end = time.monotonic() + _THREAD_GRACE_S
    while True:
        new = [
            t
            for t in threading.enumerate()
            if t.ident not in before.threads and t.is_alive() and not _is_harness_thread(t)
        ]
        if not new or time.monotonic() >= end:
            break
        time.sleep(0.02)
    return [f"thread {t.name!r} started by the test is still running" for t in new]


def _is_harness_thread(thread: threading.Thread) -> bool:
    return thread.name.startswith("distconform-")


def _changed_env(before: Snapshot) -> list[str]:
    return changed_variables(before.env, raw_environment())


def check_default_group(timeout: float) -> list[str]:
    """A barrier on the default group, with a deadline: it must still work for the next test."""
    if not dist.is_initialized():
        return ["the default process group is gone"]
    try:
        work = dist.barrier(async_op=True)
        if not work.wait(timeout=timedelta(seconds=timeout)):
            return [f"the default process group did not complete a barrier in {timeout:g} s"]
    except Exception as exc:
        return [f"the default process group is broken: {exc}"]
    return []
