"""The fault catalogue: one misbehaving rank body per fault, and what must be reported."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distconform.harness import Outcome

BAD_RANK = 1


def raise_on_one_rank() -> None:
    if dist.get_rank() == BAD_RANK:
        raise ValueError("deliberate failure")
    dist.barrier()


def raise_on_every_rank() -> None:
    raise ValueError("deliberate failure everywhere")


def exit_with_code() -> None:
    if dist.get_rank() == BAD_RANK:
        os._exit(7)
    dist.barrier()


def kill_itself() -> None:
    if dist.get_rank() == BAD_RANK:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    dist.barrier()


def segfault() -> None:
    if dist.get_rank() == BAD_RANK:
        ctypes.string_at(0)
    dist.barrier()


def spin_forever() -> None:
    while True:
        pass


def infinite_loop() -> None:
    if dist.get_rank() == BAD_RANK:
        spin_forever()
    dist.barrier()


def block_in_native_code() -> None:
    if dist.get_rank() == BAD_RANK:
        ctypes.CDLL(None).sleep(3600)
    dist.barrier()


def skip_a_collective() -> None:
    if dist.get_rank() != BAD_RANK:
        dist.all_reduce(torch.ones(4))


def mismatched_shapes() -> None:
    dist.all_reduce(torch.ones(4 + dist.get_rank()))


def mismatched_ops() -> None:
    tensor = torch.ones(4)
    if dist.get_rank() == BAD_RANK:
        dist.broadcast(tensor, src=0)
    else:
        dist.all_reduce(tensor)


def inconsistent_skip() -> None:
    import pytest

    if dist.get_rank() == BAD_RANK:
        pytest.skip("only this rank skips")


def exceed_memory_limit() -> None:
    size = 512 if dist.get_rank() == BAD_RANK else 1
    torch.ones(size * 2**20 // 4)


def probe() -> float:
    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


@dataclass(frozen=True)
class Fault:
    name: str
    body: object
    outcome: Outcome | tuple[Outcome, ...]
    cause: str | tuple[str, ...]
    # None: the fault cannot be attributed to one rank (a crash of the thread host).
    rank: int | None = BAD_RANK
    deadline: float = 20.0
    launchers: tuple[str, ...] = ("process", "thread")
    memory_limit: str | None = None

    @property
    def causes(self) -> tuple[str, ...]:
        return self.cause if isinstance(self.cause, tuple) else (self.cause,)

    @property
    def outcomes(self) -> tuple[Outcome, ...]:
        return self.outcome if isinstance(self.outcome, tuple) else (self.outcome,)


FAULTS = [
    Fault("exception-one-rank", raise_on_one_rank, Outcome.FAILED, "deliberate failure"),
    Fault(
        "exception-all-ranks", raise_on_every_rank, Outcome.FAILED, "failure everywhere", rank=None
    ),
    Fault("os-exit", exit_with_code, Outcome.CRASHED, "exited with code 7"),
    Fault("sigkill", kill_itself, Outcome.CRASHED, "killed by SIGKILL"),
    Fault("sigsegv", segfault, Outcome.CRASHED, "killed by SIGSEGV"),
    Fault("infinite-loop", infinite_loop, Outcome.HUNG, "infinite_loop", deadline=4.0),
    Fault("native-block", block_in_native_code, Outcome.HUNG, "block_in_native_code", deadline=4.0),
    Fault("collective-never-entered", skip_a_collective, Outcome.FAILED, "", rank=0, deadline=6.0),
    # gloo either raises a size mismatch or aborts the process (SIGABRT), depending on
    # which rank sees the other's message first.
    Fault(
        "mismatched-shapes",
        mismatched_shapes,
        (Outcome.FAILED, Outcome.CRASHED),
        # The trace diagnosis (process ranks) or the threaded backend's own check.
        ("called different collectives", "ranks disagree on the collective"),
        rank=None,
        deadline=6.0,
    ),
    Fault(
        "mismatched-ops",
        mismatched_ops,
        (Outcome.FAILED, Outcome.CRASHED),
        ("called different collectives", "ranks disagree on the collective"),
        rank=None,
        deadline=6.0,
    ),
    Fault("inconsistent-skip", inconsistent_skip, Outcome.SKIPPED, "inconsistent skip"),
    Fault(
        "memory-limit",
        exceed_memory_limit,
        Outcome.FAILED,
        f"rank {BAD_RANK} exceeded its memory limit",
        launchers=("process",),
        memory_limit="128MiB",
    ),
]
