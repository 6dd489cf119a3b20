"""The ``thread`` launcher: the ranks are threads of one host process, on the ``threaded``
backend, on the CPU."""

from __future__ import annotations

from distconform.harness.controller.config import THREADED_BACKEND, ConfigError
from distconform.harness.controller.launcher_registry import THREAD, Echo, this_python
from distconform.harness.controller.pools import PoolKey, RankPool


class ThreadLauncher:
    name = THREAD
    starts_ranks = True
    limits_memory = False
    # Rank threads share one warnings state: the test's filters are not applied per rank.
    isolates_warnings = False

    def backend_for(self, backend: str | None, device_type: str) -> str:
        if backend not in (None, "auto", THREADED_BACKEND):
            raise ConfigError(
                f"--launcher thread runs every rank in one process and always uses the "
                f"{THREADED_BACKEND!r} backend; drop --backend {backend} or use --launcher process"
            )
        if device_type != "cpu":
            raise ConfigError(
                f"--launcher thread runs on the CPU only; use --launcher process for {device_type}"
            )
        return THREADED_BACKEND

    def make_pool(self, key: PoolKey, echo: Echo) -> RankPool:
        # The thread host's side imports the process pool (and with it DTensor).
        from distconform.harness.controller.thread_host.pool import ThreadHostPool

        return ThreadHostPool(key.world_size, echo=echo)

    def join_world(self, backend: str, device_type: str) -> None:
        return None

    def reproduce_prefix(self, world_size: int) -> list[str]:
        return this_python()


LAUNCHER = ThreadLauncher()
