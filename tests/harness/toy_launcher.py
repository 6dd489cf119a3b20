"""A launcher in one module, registered at import (``-p tests.harness.toy_launcher``): rank
processes that carry a mark in their environment, and a reproduce command of their own.

It implements :class:`distconform.extension.Launcher` with the harness's (private)
process pool, which is what a vendor's launcher (ranks on another scheduler, say) would replace.
"""

from __future__ import annotations

from distconform.extension import Echo, PoolKey, RankPool, device_backend, register_launcher

NAME = "toy"
#: Every rank this launcher starts has it in its environment.
MARK = ("DISTCONFORM_TOY_LAUNCHER", "1")


class ToyLauncher:
    name = NAME
    starts_ranks = True
    limits_memory = False
    isolates_warnings = True

    def backend_for(self, backend: str | None, device_type: str) -> str:
        return device_backend(backend, device_type)

    def make_pool(self, key: PoolKey, echo: Echo) -> RankPool:
        from distconform.harness.controller.process.pool import (  # as the process launcher
            ProcessPool,
            ProcessPoolSpec,
        )

        return ProcessPool(
            ProcessPoolSpec(
                world_size=key.world_size,
                backend=key.backend,
                device_type=key.device_type,
                threads_per_rank=key.threads_per_rank,
                rendezvous=key.rendezvous,
                devices=key.world_size,
                bind_device=False,
                env=(*key.env, MARK),
                echo=echo,
            )
        )

    def join_world(self, backend: str, device_type: str) -> None:
        return None

    def reproduce_prefix(self, world_size: int) -> list[str]:
        return ["toy-run", "--ranks", str(world_size), "python"]


register_launcher(ToyLauncher())
