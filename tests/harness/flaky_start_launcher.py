"""A launcher whose first pool fails to start (``-p tests.harness.flaky_start_launcher``),
as a rendezvous does on a machine too busy to connect in time; later pools are the
process launcher's."""

from __future__ import annotations

from distconform.extension import Echo, PoolKey, RankPool, device_backend, register_launcher
from distconform.harness.controller.pools import PoolStartFailure
from distconform.harness.controller.process.launcher import LAUNCHER as PROCESS
from distconform.harness.shared.outcomes import Outcome, RankResult

NAME = "flaky-start"
FAILURE = "Gloo connectFullMesh failed: Connection closed by peer (scripted)"


class _FailsToStart:
    launcher = NAME
    broken = False

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def start(self, timeout: float | None = None) -> None:
        raise PoolStartFailure(
            f"could not start {self.world_size} rank processes: rank 1 failed ({FAILURE})",
            [RankResult(r, Outcome.NOT_STARTED, note=FAILURE) for r in range(self.world_size)],
        )


class FlakyStartLauncher:
    name = NAME
    starts_ranks = True
    limits_memory = False
    isolates_warnings = True
    pools_made = 0

    def backend_for(self, backend: str | None, device_type: str) -> str:
        return device_backend(backend, device_type)

    def make_pool(self, key: PoolKey, echo: Echo) -> RankPool:
        type(self).pools_made += 1
        if type(self).pools_made == 1:
            return _FailsToStart(key.world_size)
        return PROCESS.make_pool(key, echo)

    def join_world(self, backend: str, device_type: str) -> object | None:
        return None

    def reproduce_prefix(self, world_size: int) -> list[str]:
        return PROCESS.reproduce_prefix(world_size)


register_launcher(FlakyStartLauncher())
