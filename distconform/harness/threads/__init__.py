"""Thread launcher: N ranks as threads of one process, on this project's ``threaded`` backend.

Running code on rank threads::

    run_threaded(fn, world_size, *args, seed=0, deadline=120.0, **kwargs) -> RunResult
    with ThreadRunner(world_size, seed=0, deadline=120.0, capture_output=False) as runner:
        result = runner.run(fn, *args, deadline=None, **kwargs)   # -> RunResult
    result.ok / result.values / result.results (RankResult per rank) / result.describe()
    result.raise_on_failure()                                     # RunFailedError
    runner.usable                                                 # False after a hang

``RunResult`` and ``RankResult`` are :mod:`distconform.harness.shared.outcomes`' (the process
launcher's too); a thread rank's ``RankResult.error`` also holds the exception object it raised.

``distconform.harness.rank.thread_ranks.ThreadPool`` puts the runner behind
``distconform.harness.controller.pools.RankPool``.

Observing collectives::

    handle = add_collective_listener(fn)   # fn(CollectiveRecord) on the issuing rank
    handle.remove()                        # or: with add_collective_listener(fn): ...
"""

from distconform.harness.threads.backend import (
    BACKEND_NAME,
    ThreadedProcessGroup,
    register_threaded_backend,
)
from distconform.harness.threads.observe import (
    CollectiveRecord,
    ListenerHandle,
    add_collective_listener,
)
from distconform.harness.threads.runner import RunnerUnusableError, ThreadRunner, run_threaded
from distconform.harness.threads.world import (
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
    "RunnerUnusableError",
    "ThreadRunner",
    "ThreadedProcessGroup",
    "add_collective_listener",
    "register_threaded_backend",
    "run_threaded",
]
