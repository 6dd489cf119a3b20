"""The ``external`` launcher: torchrun or srun started the ranks, and each runs pytest; this
process is one of them and joins their world."""

from __future__ import annotations

from distconform.harness.controller.config import ConfigError, device_backend
from distconform.harness.controller.launcher_registry import EXTERNAL, Echo
from distconform.harness.controller.pools import PoolKey, RankPool


class ExternalLauncher:
    name = EXTERNAL
    starts_ranks = False
    limits_memory = False
    isolates_warnings = True

    def backend_for(self, backend: str | None, device_type: str) -> str:
        return device_backend(backend, device_type)

    def make_pool(self, key: PoolKey, echo: Echo) -> RankPool:
        raise ConfigError(
            "the 'external' launcher does not start ranks: under torchrun, the ranks already "
            "exist and each runs pytest with --launcher external"
        )

    def join_world(self, backend: str, device_type: str) -> object:
        """The world torchrun or srun made, joined (this process's rank in it)."""
        # The rank side (and DTensor, which it imports) stays out of every other session.
        from distconform.harness.controller.external.world import ExternalWorld

        world = ExternalWorld(backend, device_type)
        world.join()
        return world

    def reproduce_prefix(self, world_size: int) -> list[str]:
        return ["torchrun", "--nproc-per-node", str(world_size)]


LAUNCHER = ExternalLauncher()
