"""Leasing accelerators to pools, so parallel pytest workers never share a device.

Under pytest-xdist every worker has its own pools. Each pool on an accelerator leases
``world_size`` device indices before it starts, by taking an exclusive ``flock`` on one
lock file per device in a directory shared by every process of this user on the
machine. A lease is all-or-nothing; a pool that cannot get enough devices waits (with a
deadline) instead of oversubscribing. The ranks then see only their leased devices
through the device type's visibility variable (``CUDA_VISIBLE_DEVICES`` for CUDA), so
rank ``r`` uses its local device ``r``. The locks are ``filelock``'s (``flock`` on POSIX),
which vanish with the process holding them: a killed worker never leaves a device leased.
A run with ``--dist-share-devices`` leases nothing: its ranks take the devices there are,
round-robin, whoever else uses them.

``DISTCONFORM_FAKE_DEVICE_COUNT`` replaces the real device count, so leasing can be
tested on a machine without accelerators.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from distconform.harness.shared.device_registry import visibility_variable

FAKE_COUNT_ENV = "DISTCONFORM_FAKE_DEVICE_COUNT"
LEASE_DIR_ENV = "DISTCONFORM_LEASE_DIR"

_POLL_S = 0.05


class LeaseTimeout(RuntimeError):
    """Not enough free devices within the deadline."""


@dataclass
class DeviceLease:
    device_type: str
    indices: tuple[int, ...]
    _locks: list[FileLock] = field(default_factory=list, repr=False)

    def visibility_env(self) -> dict[str, str]:
        name = visibility_variable(self.device_type)
        if name is None:
            return {}
        return {name: ",".join(str(i) for i in self.indices)}

    def release(self) -> None:
        for lock in self._locks:
            lock.release(force=True)
        self._locks.clear()


def lease_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"distconform-leases-{os.getuid()}"
    path = Path(os.environ.get(LEASE_DIR_ENV, default))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def fake_device_count() -> int | None:
    value = os.environ.get(FAKE_COUNT_ENV)
    return int(value) if value else None


def lease_devices(device_type: str, count: int, total: int, timeout: float) -> DeviceLease:
    """Lease ``count`` of the ``total`` devices of this type, waiting up to ``timeout`` s."""
    if count > total:
        raise LeaseTimeout(f"{count} {device_type} devices requested, the machine has {total}")
    directory = lease_dir()
    deadline = time.monotonic() + timeout
    while True:
        lease = _try_lease(directory, device_type, count, total)
        if lease is not None:
            return lease
        if time.monotonic() >= deadline:
            raise LeaseTimeout(
                f"could not lease {count} of {total} {device_type} devices within {timeout:g} s: "
                f"the others are leased by other pytest workers on this machine"
            )
        time.sleep(_POLL_S)


def _try_lease(directory: Path, device_type: str, count: int, total: int) -> DeviceLease | None:
    lease = DeviceLease(device_type, ())
    taken: list[int] = []
    for index in range(total):
        # A lock object per attempt, never shared: flock excludes other open files of the
        # same path, so two pools of one process exclude each other too.
        lock = FileLock(directory / f"{device_type}-{index}.lock", is_singleton=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        lease._locks.append(lock)
        taken.append(index)
        if len(taken) == count:
            lease.indices = tuple(taken)
            return lease
    lease.release()
    return None


class LeasedPool:
    """A rank pool that holds a device lease for as long as it lives.

    ``make_pool`` receives the visibility variables of the lease and builds the pool
    whose ranks see only the leased devices.
    """

    def __init__(self, device_type: str, devices: int, total: int, make_pool) -> None:
        self.device_type = device_type
        self.devices = devices
        self.total = total
        self._make_pool = make_pool
        self._lease: DeviceLease | None = None
        self._pool = None

    @property
    def launcher(self) -> str:
        return self._pool.launcher if self._pool is not None else "process"

    @property
    def broken(self) -> bool:
        return self._pool is None or self._pool.broken

    @property
    def lease(self) -> DeviceLease | None:
        return self._lease

    def lease_now(self) -> bool:
        """Take the lease at once if the devices are free (before :meth:`start`, which
        otherwise waits for them); False if they are not."""
        if self._lease is None:
            self._lease = _try_lease(lease_dir(), self.device_type, self.devices, self.total)
        return self._lease is not None

    def start(self, timeout: float | None = None) -> None:
        budget = timeout if timeout is not None else 120.0
        started = time.monotonic()
        if self._lease is None:
            self._lease = lease_devices(self.device_type, self.devices, self.total, budget)
        self._pool = self._make_pool(self._lease.visibility_env())
        try:
            self._pool.start(max(1.0, budget - (time.monotonic() - started)))
        except BaseException:
            self._release()
            raise

    def alive(self) -> bool:
        return self._pool is not None and self._pool.alive()

    def run(self, task, deadline: float, peer_grace: float):
        return self._pool.run(task, deadline, peer_grace)

    def close(self, timeout: float = 10.0) -> None:
        try:
            if self._pool is not None:
                self._pool.close(timeout)
        finally:
            self._release()

    def kill(self) -> None:
        try:
            if self._pool is not None:
                self._pool.kill()
        finally:
            self._release()

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
