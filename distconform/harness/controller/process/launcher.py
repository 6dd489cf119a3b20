"""The ``process`` launcher: every rank a fresh interpreter forked from the fork server, in
one OS process group; accelerator ranks lease their devices."""

from __future__ import annotations

from distconform.harness.controller.config import binds_device_id, device_backend, device_count
from distconform.harness.controller.launcher_registry import PROCESS, Echo, this_python
from distconform.harness.controller.leasing import LeasedPool
from distconform.harness.controller.pools import PoolKey, RankPool


class ProcessLauncher:
    name = PROCESS
    starts_ranks = True
    limits_memory = True
    isolates_warnings = True

    def backend_for(self, backend: str | None, device_type: str) -> str:
        return device_backend(backend, device_type)

    def make_pool(self, key: PoolKey, echo: Echo) -> RankPool:
        # The pools import distconform.harness.comm and with it DTensor: a session that never starts
        # ranks (all its tests local, or under torchrun) does not pay for them.
        from distconform.harness.controller.process.pool import ProcessPool, ProcessPoolSpec

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
                joins_world=key.joins_world,
            )
            return ProcessPool(spec)

        if total is None or key.share_devices:
            # CPU ranks, or ranks that share devices anyway: nothing to lease.
            return process_pool({})
        # Accelerator ranks: lease devices so parallel pytest workers never share one.
        return LeasedPool(key.device_type, devices, total, process_pool)

    def join_world(self, backend: str, device_type: str) -> None:
        return None

    def reproduce_prefix(self, world_size: int) -> list[str]:
        return this_python()


LAUNCHER = ProcessLauncher()
