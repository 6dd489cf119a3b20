"""Entry point of a rank process: ``python -m distconform.harness.rank.worker SPEC_JSON``.

The rank joins the process group once, then serves tasks from the parent over its
control connection until told to stop or until the parent disappears. The module itself
imports no torch: the fork server imports it first, to arm the parent-death signal and the
stack dumps before the seconds torch takes to load; torch comes with serving.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import threading
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from distconform.harness.shared.protocol import (
    BETWEEN_TESTS_TIMEOUT_S,
    EXIT_PARENT_GONE,
    WorkerSpec,
)

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(parent_pid: int) -> None:
    """SIGKILL us when our parent exits (Linux); exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(EXIT_PARENT_GONE)


def die_with_parent(parent_pid: int) -> None:
    """Two independent guards, so no rank outlives a killed pytest.

    The parent-death signal catches the parent's exit; EOF on stdin (whose write end
    only the pytest process holds) catches what the signal misses, such as a rank
    forked by the zygote whose pytest died while the zygote lingered.
    """
    set_parent_death_signal(parent_pid)

    def exit_on_eof() -> None:
        try:
            while os.read(0, 4096):
                pass
        finally:
            os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=exit_on_eof, name="distconform-parent-watch", daemon=True).start()


def _install_stack_dumps(stack_path: str) -> None:
    # The file stays open for the life of the process: faulthandler writes to its fd
    # from a signal handler, which works even while every thread is stuck in C++.
    stack_file = open(stack_path, "w")  # noqa: SIM115
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)


def _make_store(store: dict[str, Any], world_size: int, timeout: timedelta) -> Any:
    import torch.distributed as dist  # torch only once serving: see the module docstring

    if store["kind"] == "file":
        return dist.FileStore(store["path"], world_size)
    if store["kind"] == "tcp":
        return dist.TCPStore(
            store["host"], store["port"], world_size, is_master=False, timeout=timeout
        )
    raise ValueError(f"unknown store kind {store['kind']!r}")


def _join_world(spec: WorkerSpec) -> Any:
    # torch and what imports it only once serving: see the module docstring.
    import torch
    import torch.distributed as dist

    from distconform.harness.shared.rank_context import RankContext

    timeout = timedelta(seconds=spec.init_timeout)
    device = torch.device(spec.device_type)
    device_id = None
    if spec.device_type != "cpu":
        torch.accelerator.set_device_index(spec.device_index)
        device = torch.device(spec.device_type, spec.device_index)
        device_id = device if spec.bind_device else None
    if spec.joins_world:
        dist.init_process_group(
            backend=spec.backend,
            store=_make_store(spec.store, spec.world_size, timeout),
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timeout,
            device_id=device_id,
        )
    return RankContext(
        rank=spec.rank,
        world_size=spec.world_size,
        device=device,
        backend=spec.backend,
        seed=0,
        launcher=spec.launcher,
    )


def _yield_wakeups_to_the_parent(device_type: str) -> None:
    """Let the pytest process keep its CPU when this CPU rank wakes up.

    The parent hands a test to its ranks one after another. Woken by the first hand-over,
    a rank of the default scheduling class takes the CPU of the parent that woke it, and
    the next rank gets its test up to 0.4 ms later, while the first waits for it in its
    first collective (half the tests of a warm ws-2 pool, on 2 cores). A rank of the batch
    class does not take a CPU from a waking task: it runs on an idle core or once the
    parent waits. Only CPU ranks: an accelerator's host threads are left as they are.
    """
    if device_type != "cpu" or not hasattr(os, "SCHED_BATCH"):
        return
    # Lowering one's own class needs no privilege; an odd kernel may still refuse.
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def _send_result(conn: Connection, result: Any) -> None:
    try:
        conn.send(result)
    except Exception as exc:  # the value returned by the test may not pickle
        result.note = f"return value not picklable: {exc}"
        result.value = repr(result.value)
        conn.send(result)


def serve(spec: WorkerSpec) -> None:
    # torch and what imports it only once serving: see the module docstring.
    import torch

    from distconform.harness.comm.intercept import hold_wrappers
    from distconform.harness.rank import hygiene
    from distconform.harness.rank.execute import run_task_in_process
    from distconform.harness.shared.gc_freeze import freeze_heap
    from distconform.harness.shared.outcomes import needs_barrier
    from distconform.harness.shared.rank_output import end_marker_line

    torch.set_num_threads(spec.threads)
    _yield_wakeups_to_the_parent(spec.device_type)  # before gloo starts its threads
    conn = Connection(spec.control_fd)
    base_ctx = _join_world(spec)
    hold_wrappers()
    freeze_heap()  # what joining the world built lives as long as the rank
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        ctx = replace(base_ctx, seed=task.seed)
        # harness/comm: this rank's collectives go to a trace file the parent reads on a hang.
        result = run_task_in_process(task, ctx, trace_dir=os.path.dirname(spec.stack_path))
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(1, end_marker_line(task.task_id))
        _send_result(conn, result)
        if needs_barrier(result):
            # The result is already with the parent; now prove the default group still
            # works for the next test. A rank whose peer failed would wait here in
            # vain, but then the parent recycles the pool without reading this.
            if spec.joins_world:
                timeout = min(BETWEEN_TESTS_TIMEOUT_S, task.pg_timeout)
                conn.send(hygiene.check_default_group(timeout))
            else:
                conn.send([])  # no group of the pool's to prove


def main(argv: list[str]) -> None:
    spec = WorkerSpec.from_json(argv[1])
    die_with_parent(spec.parent_pid)
    _install_stack_dumps(spec.stack_path)
    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    # A vendor's backend registration must happen before this rank's init_process_group.
    from distconform.harness.shared.backend_plugins import import_from_environment

    import_from_environment()
    if spec.thread_host:
        from distconform.harness.rank.thread_host import serve_thread_host  # imports torch

        serve_thread_host(spec)
    else:
        serve(spec)
    # Skip interpreter teardown: destroying a process group whose peers are
    # already gone can block, and the parent has nothing left to learn from us.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
