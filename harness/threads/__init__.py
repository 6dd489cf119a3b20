"""Thread launcher: N ranks as threads of one process, on this project's ``threaded`` backend."""

from harness.threads.backend import BACKEND_NAME, ThreadedProcessGroup, register_threaded_backend
from harness.threads.observe import CollectiveRecord, ListenerHandle, add_collective_listener
from harness.threads.runner import (
    RankOutcome,
    RankRun,
    RunnerUnusableError,
    RunResult,
    ThreadRunError,
    ThreadRunner,
    run_threaded,
)
from harness.threads.world import (
    BatonError,
    CollectiveDeadlockError,
    CollectiveMismatchError,
    RankAbortedError,
)

__all__ = [
    "BACKEND_NAME",
    "BatonError",
    "CollectiveDeadlockError",
    "CollectiveMismatchError",
    "CollectiveRecord",
    "ListenerHandle",
    "RankAbortedError",
    "RankOutcome",
    "RankRun",
    "RunResult",
    "RunnerUnusableError",
    "ThreadRunError",
    "ThreadRunner",
    "ThreadedProcessGroup",
    "add_collective_listener",
    "register_threaded_backend",
    "run_threaded",
]
