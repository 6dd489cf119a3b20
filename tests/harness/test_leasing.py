"""Device leasing: parallel workers get disjoint devices and never oversubscribe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from distconform.harness.controller.leasing import (
    FAKE_COUNT_ENV,
    LEASE_DIR_ENV,
    LeasedPool,
    LeaseTimeout,
    lease_devices,
)
from distconform.harness.controller.pools import PoolKey, PoolManager

HOLDER = textwrap.dedent(
    """
    import json, sys, time
    from distconform.harness.controller.leasing import lease_devices
    lease = lease_devices("cuda", int(sys.argv[1]), int(sys.argv[2]), timeout=float(sys.argv[3]))
    print(json.dumps(list(lease.indices)), flush=True)
    time.sleep(float(sys.argv[4]))
    """
)


@pytest.fixture
def lease_env(tmp_path, monkeypatch):
    monkeypatch.setenv(LEASE_DIR_ENV, str(tmp_path / "leases"))
    return dict(os.environ)


def _holder(env, count, total, timeout, hold) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(count), str(total), str(timeout), str(hold)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_workers_lease_disjoint_devices_and_wait_for_free_ones(lease_env):
    holders = [_holder(lease_env, 2, 8, 10, 3) for _ in range(4)]
    leased = [json.loads(h.stdout.readline()) for h in holders]
    flat = [i for indices in leased for i in indices]
    assert sorted(flat) == list(range(8)), leased  # disjoint, and all devices used
    # All 8 are taken: a fifth worker cannot lease, and says why.
    with pytest.raises(LeaseTimeout, match="leased by other pytest workers"):
        lease_devices("cuda", 2, 8, timeout=0.5)
    # Once the holders exit their locks are gone (no release step needed).
    for holder in holders:
        holder.wait(timeout=30)
    again = lease_devices("cuda", 8, 8, timeout=5)
    assert again.indices == tuple(range(8))
    again.release()


def test_a_killed_worker_frees_its_devices(lease_env):
    holder = _holder(lease_env, 3, 3, 10, 60)
    assert json.loads(holder.stdout.readline()) == [0, 1, 2]
    with pytest.raises(LeaseTimeout):
        lease_devices("cuda", 1, 3, timeout=0.2)
    holder.kill()
    holder.wait(timeout=10)
    lease = lease_devices("cuda", 1, 3, timeout=5)
    assert lease.indices == (0,)
    lease.release()


class _RecordingPool:
    launcher = "process"

    def __init__(self, env):
        self.env = env
        self.broken = False
        self.started = self.killed = False

    def start(self, timeout=None):
        self.started = True

    def run(self, task, deadline, peer_grace):
        raise AssertionError("not used")

    def close(self, timeout=10.0):
        self.killed = True

    def kill(self):
        self.killed = True


def test_a_leased_pool_pins_its_ranks_to_the_lease_and_releases_it(lease_env):
    built = []

    def make(env):
        built.append(_RecordingPool(env))
        return built[-1]

    first, second = LeasedPool("cuda", 2, 4, make), LeasedPool("cuda", 2, 4, make)
    first.start(timeout=5)
    second.start(timeout=5)
    assert built[0].env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert built[1].env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    third = LeasedPool("cuda", 2, 4, make)
    started = time.monotonic()
    with pytest.raises(LeaseTimeout):
        third.start(timeout=0.3)
    assert time.monotonic() - started < 5
    first.kill()
    assert built[0].killed
    third.start(timeout=5)
    assert built[-1].env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    second.close()
    third.close()


def test_the_resource_check_uses_the_fake_device_count(pytester, monkeypatch):
    monkeypatch.setenv(FAKE_COUNT_ENV, "3")
    pytester.makepyfile(
        test_fake="""
        import pytest

        @pytest.mark.world_size(4)
        def test_needs_four(rank_ctx):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", "--device", "cuda")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs 4 cuda device(s), this machine has 3*"])


def test_two_pools_of_one_process_lease_disjoint_devices(lease_env):
    # Both pools live in this process: the locks must exclude each other all the same.
    first = lease_devices("cuda", 2, 3, timeout=1)
    second = lease_devices("cuda", 1, 3, timeout=1)
    assert set(first.indices).isdisjoint(second.indices)
    with pytest.raises(LeaseTimeout):
        lease_devices("cuda", 1, 3, timeout=0.2)
    first.release()
    assert lease_devices("cuda", 2, 3, timeout=1).indices == first.indices


def test_a_session_closes_its_own_idle_pools_to_lease_devices_for_a_larger_world(lease_env):
    # 8 devices: warm pools of 2 and 4 ranks hold 6; a world of 8 must not wait for devices
    # its own session holds, but close them (least recently used first) and start at once.
    built: dict[int, list[_RecordingPool]] = {}

    def factory(key: PoolKey):
        def make(env):
            built.setdefault(key.world_size, []).append(_RecordingPool(env))
            return built[key.world_size][-1]

        return LeasedPool("cuda", key.world_size, 8, make)

    manager = PoolManager(factory)
    keys = {ws: PoolKey("process", ws, "nccl", "cuda", 1) for ws in (2, 4, 8)}
    for ws in (2, 4):
        manager._acquire(keys[ws], start_budget=5)
    started = time.monotonic()
    manager._acquire(keys[8], start_budget=60)
    assert time.monotonic() - started < 5
    assert built[2][0].killed and built[4][0].killed  # closed to make room
    assert built[8][0].env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert len(manager) == 1
    manager.shutdown()
