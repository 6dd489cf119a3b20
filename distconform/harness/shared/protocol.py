"""What the parent and its child processes (rank workers, the thread host) say to each other.

Both sides import this module and nothing else of the other: the parent's pools
(:mod:`distconform.harness.controller.process.pool`,
:mod:`distconform.harness.controller.thread_host.pool`) build the messages, the children
(:mod:`distconform.harness.rank.worker`, :mod:`distconform.harness.rank.thread_host`) read them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from distconform.harness.shared.outcomes import RunResult
from distconform.harness.shared.task import RankTask

# Exit code of a rank whose parent went away: distinguishable from a test's own exit.
EXIT_PARENT_GONE = 70
#: The fork server's last argument when it is to warm up before its first fork.
ZYGOTE_WARM_AT_ONCE = "--warm-at-once"
BETWEEN_TESTS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WorkerSpec:
    """How one rank process starts: JSON on its command line, or from the fork server."""

    rank: int
    world_size: int
    backend: str
    device_type: str
    launcher: str
    threads: int
    control_fd: int
    stack_path: str
    store: dict[str, Any]
    init_timeout: float
    parent_pid: int
    sys_path: tuple[str, ...]
    # The local index of this rank's device (its rank, unless ranks share devices), and
    # whether the process group is bound to it (a plug-in backend cannot be: see
    # distconform.harness.controller.config.binds_device_id).
    device_index: int = 0
    bind_device: bool = True
    # The process hosts every rank as a thread (the thread launcher) instead of being one.
    thread_host: bool = False
    # False: the rank starts without a default process group, for a test that creates its
    # own world (its own backend, store or init method), as under torch's own harness.
    joins_world: bool = True

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        data = json.loads(text)
        data["sys_path"] = tuple(data["sys_path"])
        return cls(**data)


@dataclass(frozen=True)
class ThreadHostRun:
    """One task for the thread host: run it on ``task_world_size`` rank threads."""

    task: RankTask
    deadline: float
    peer_grace: float
    task_world_size: int


@dataclass(frozen=True)
class ThreadHostDone:
    """The thread host's answer to a :class:`ThreadHostRun`."""

    run: RunResult
    #: Whether the host can serve another task: no rank thread hung, and the run left the
    #: process as it found it.
    reusable: bool
