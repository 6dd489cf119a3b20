"""The fault battery: every failure mode ends in a clear, fast, attributable report.

Each fault runs on both launchers (where meaningful) at world sizes 2 and 4. For each
one the report must name the right outcome, rank and cause within the deadline plus
10 s, and the next test on the same pool key must pass. The battery's table (fault by
launcher by world size: outcome, seconds) is printed at the end of the session.
"""

from __future__ import annotations

import time
from dataclasses import replace

import psutil
import pytest

from distconform.harness import Outcome
from distconform.harness.controller.dispatch import make_pool
from distconform.harness.controller.failure_report import render_failure
from distconform.harness.controller.pools import PoolKey, PoolManager
from distconform.harness.controller.process.spawning import shared_zygote
from distconform.harness.shared.memory_sizes import parse_size
from tests.faults import faults
from tests.faults.conftest import record_row
from tests.harness.conftest import task_for

LAUNCHERS = ("process", "thread")
BACKEND = {"process": "gloo", "thread": "threaded"}


@pytest.fixture(scope="module")
def battery_pools():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    manager = PoolManager(lambda key: make_pool(key, echo=None))
    yield manager
    manager.shutdown()
    # The fork server outlives the battery (the session's own pools use it); everything
    # the battery started must be gone.
    zygote = shared_zygote().pid
    leftover = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.pid != zygote
    ]
    _gone, alive = psutil.wait_procs(leftover, timeout=10)
    assert alive == [], f"the battery left processes behind: {alive}"


def _cases():
    for fault in faults.FAULTS:
        for launcher in LAUNCHERS:
            if launcher not in fault.launchers:
                continue
            for world_size in (2, 4):
                marks = [pytest.mark.slow] if world_size == 4 else []
                yield pytest.param(
                    fault,
                    launcher,
                    world_size,
                    id=f"{fault.name}-{launcher}-ws{world_size}",
                    marks=marks,
                )


# Faults that kill the shared thread host with a signal: nothing tells which rank thread
# raised it, so the report must blame the host, not a rank. (An os._exit is traced.)
_BLAMELESS_ON_THREADS = ("sigkill", "sigsegv")


def _expected_rank(fault: faults.Fault, launcher: str) -> int | None:
    blameless = launcher == "thread" and fault.name in _BLAMELESS_ON_THREADS
    return None if blameless else fault.rank


@pytest.mark.parametrize(("fault", "launcher", "world_size"), list(_cases()))
def test_fault_is_reported_and_the_next_test_passes(battery_pools, fault, launcher, world_size):
    key = PoolKey(
        launcher=launcher,
        world_size=world_size,
        backend=BACKEND[launcher],
        device_type="cpu",
        threads_per_rank=1,
    )
    task = task_for(fault.body)
    task = replace(task, pg_timeout=fault.deadline * 0.8)
    if fault.memory_limit:
        task = replace(task, memory_limit=parse_size(fault.memory_limit))
    # A warm pool first, so the seconds measure the fault, not the pool's start-up.
    assert battery_pools.run(key, task_for(faults.probe), deadline=20.0, peer_grace=0.5).ok
    started = time.monotonic()
    run = battery_pools.run(key, task, deadline=fault.deadline, peer_grace=0.5)
    elapsed = time.monotonic() - started
    text = render_failure(run, context="battery", reproducer=None)
    assert not run.ok, text
    assert elapsed <= fault.deadline + 10, f"reported after {elapsed:.1f} s"
    if fault.outcome is Outcome.SKIPPED:
        assert run.inconsistent_skip
        assert f"ranks {faults.BAD_RANK} skipped" in text
        reported = "inconsistent skip"
    else:
        primary = run.primary_failure()
        assert primary is not None, text
        assert primary.outcome in fault.outcomes, text
        expected_rank = _expected_rank(fault, launcher)
        if expected_rank is not None:
            assert primary.rank == expected_rank, text
        if launcher == "thread" and fault.name in _BLAMELESS_ON_THREADS:
            assert run.shared_crash is not None and "which rank caused it is unknown" in text
            assert not text.startswith(f"rank {primary.rank}"), text
        assert any(cause in text for cause in fault.causes), text
        # The root cause is told once; peers are not buried under copies of it.
        assert text.count("Traceback (most recent call last)") <= 1, text
        who = "the host: rank unknown" if run.shared_crash else f"rank {primary.rank}"
        reported = f"{primary.outcome.value} ({who})"
    record_row(fault.name, launcher, world_size, reported, elapsed)
    after = battery_pools.run(key, task_for(faults.probe), deadline=20.0, peer_grace=0.5)
    assert after.ok and after.values == [float(world_size)] * world_size
