"""The thread host's own loop: it runs in the child process the thread launcher forks.

The parent's side is :mod:`distconform.harness.controller.thread_host.pool`; the messages are
:mod:`distconform.harness.shared.protocol`'s.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from multiprocessing.connection import Connection

import torch

from distconform.harness.comm.intercept import hold_wrappers
from distconform.harness.rank.thread_host_exit import note_path, record_rank_exits
from distconform.harness.rank.thread_ranks import ThreadPool
from distconform.harness.shared.gc_freeze import freeze_heap
from distconform.harness.shared.outcomes import Outcome, RankResult, RunResult
from distconform.harness.shared.protocol import ThreadHostDone, ThreadHostRun, WorkerSpec
from distconform.harness.shared.rank_output import end_marker_line


def _host_error(request: ThreadHostRun, exc: Exception) -> RunResult:
    """The thread pool itself failed: every rank gets the harness's own traceback."""
    now = time.monotonic()
    text = "".join(traceback.format_exception(exc))
    results = [
        RankResult(
            rank=rank,
            outcome=Outcome.FAILED,
            started_at=now,
            finished_at=now,
            error_type=type(exc).__qualname__,
            error_message=f"the thread host could not run the test: {exc}",
            traceback=text,
        )
        for rank in range(request.task_world_size)
    ]
    return RunResult(results, request.task.seed, request.deadline, now, now)


def serve_thread_host(spec: WorkerSpec) -> None:
    """The host process's loop: serve tasks until the parent says stop or goes away."""
    torch.set_num_threads(spec.threads)
    conn = Connection(spec.control_fd)
    record_rank_exits(note_path(spec.stack_path))
    # Temp files in the parent's pool directory: the parent removes it even after a crash.
    temp_root = os.path.dirname(spec.stack_path)
    pools: dict[int, ThreadPool] = {}  # by world size: one host serves them all
    hold_wrappers()
    freeze_heap()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        try:
            pool = pools.get(request.task_world_size)
            if pool is None:
                pool = pools[request.task_world_size] = ThreadPool(
                    request.task_world_size, temp_root=temp_root
                )
            run = pool.run(request.task, request.deadline, request.peer_grace)
            reusable = not pool.broken
        except Exception as exc:
            run, reusable = _host_error(request, exc), False
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(1, end_marker_line(request.task.task_id))
        conn.send(ThreadHostDone(run, reusable))
