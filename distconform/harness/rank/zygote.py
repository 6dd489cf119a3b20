"""A fork server for rank processes: torch is imported once, ranks are forked from it.

Starting a rank as a fresh interpreter costs an import of torch (about 2.6 s of CPU
here), so a pool of 4 ranks on 2 cores takes over 5 s to start. The zygote is a fresh
interpreter started by the parent (never a fork of pytest, which may have initialised
CUDA); it imports torch and the worker once, stays single-threaded in Python, and
forks one child per rank on request. The child detaches into its own session, takes the
pipes the parent passed over the socket as stdin/stdout/stderr and runs the worker.

Protocol on the request socket (AF_UNIX SOCK_SEQPACKET: one message per send):
  parent -> zygote: JSON ``{"spec": ..., "env": {...}}`` with 3 fds (stdin, output, control)
  zygote -> parent: JSON ``{"spawned": pid}`` or ``{"exited": pid, "status": code}``
Exit statuses use subprocess's convention: negative for "killed by signal".
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import sys
import traceback

from distconform.harness.rank import worker
from distconform.harness.shared.gc_freeze import freeze_heap
from distconform.harness.shared.protocol import ZYGOTE_WARM_AT_ONCE

_MAX_MESSAGE = 1 << 20
FDS_PER_SPAWN = 3


def _preload() -> None:
    """Import once, before forking, what every rank needs: each fork starts with it loaded."""
    import torch
    import torch.distributed
    import torch.distributed.tensor  # noqa: F401

    import distconform.harness.rank.execute  # noqa: F401


#: How long the zygote waits without a request before it loads what ranks need later: a
#: session still running by then is likely to start more pools, and a short one (a single
#: test, pytest's own tests of a plugin) ends before it spends the CPU.
_IDLE_S = 3.0


def warm_up() -> None:
    """Load what a rank would otherwise load at first use.

    ``torch._dynamo`` costs every rank 0.6 s of CPU at its first DTensor call (see
    ``_torch_private.import_dynamo``). Importing it before the first pool would delay that
    pool (a 1-test session by 0.5 s); once the first ranks are forked and the zygote has
    idled ``_IDLE_S``, every later pool (another world size, a fresh or replaced pool) forks
    with it loaded. A session whose first ranks load it anyway (torch's own test package
    imports it: ``--dist-adopt``) has the zygote warm up before its first fork instead.
    """
    from distconform.harness import _torch_private

    _torch_private.import_dynamo()
    freeze_heap()


def preload_modules(names: list[str]) -> None:
    """Import, before the first fork, the modules the parent says every rank of this session
    will import (torch's test package, for ``--dist-adopt``): each fork then starts with them,
    not each rank of each pool importing them again (4 ranks on 2 cores: 4 times the CPU).

    Only on a torch built for the CPU alone: such modules ask the accelerator about itself
    at import, which may initialise it, and a process that forks after that hands its ranks
    an accelerator they cannot use. A module that fails to import is left to the ranks,
    whose report names the error.
    """
    import torch

    if any(getattr(torch.version, build, None) for build in ("cuda", "hip", "xpu")):
        return
    for name in names:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit):  # the ranks import it again and report the error
            continue


def _exit_status(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _become_rank(request: dict, fds: list[int], sock: socket.socket, wakeup_r: int) -> None:
    """In the forked child: take the passed pipes, detach, and serve as a rank."""
    stdin_fd, output_fd, control_fd = fds
    sock.close()
    os.close(wakeup_r)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    os.dup2(stdin_fd, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(stdin_fd)
    os.close(output_fd)
    os.environ.clear()
    os.environ.update(request["env"])
    spec = json.loads(request["spec"])
    spec["control_fd"] = control_fd
    # Our parent is the zygote now; it dies with pytest, and we die with it.
    spec["parent_pid"] = os.getppid()
    worker.main(["worker", json.dumps(spec)])


def serve(sock: socket.socket, warm: bool = False) -> None:
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    # A handler (not SIG_IGN) so children stay waitable and the wakeup fd fires.
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "request")
    selector.register(wakeup_r, selectors.EVENT_READ, "child")
    # No watcher thread here: the zygote forks, so it must stay single-threaded.
    selector.register(0, selectors.EVENT_READ, "parent")
    children: set[int] = set()
    warmed_up = warm
    while True:
        events = selector.select(None if warmed_up else _IDLE_S)
        if not events:
            warm_up()
            warmed_up = True
            continue
        for key, _ in events:
            if key.data == "parent":
                if not os.read(0, 4096):
                    return  # pytest is gone; our children die with us (parent-death signal)
                continue
            if key.data == "child":
                os.read(wakeup_r, 4096)
                _reap(children, sock)
                continue
            message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, FDS_PER_SPAWN)
            if not message:
                return  # the parent closed the socket: we are done
            pid = os.fork()
            if pid == 0:
                try:
                    _become_rank(json.loads(message), fds, sock, wakeup_r)
                except BaseException:
                    # Into the rank's output (stderr is its pipe by now), or the report
                    # says only "exited with code 1".
                    traceback.print_exc()
                    sys.stderr.flush()
                finally:
                    os._exit(1)
            children.add(pid)
            for fd in fds:
                os.close(fd)
            _send(sock, {"spawned": pid})
            _reap(children, sock)


def _reap(children: set[int], sock: socket.socket) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            children.discard(pid)
            continue
        if done:
            children.discard(pid)
            _send(sock, {"exited": pid, "status": _exit_status(status)})


def main() -> None:
    fd = int(sys.argv[1])
    worker.set_parent_death_signal(int(sys.argv[2]))
    warm = sys.argv[3:4] == [ZYGOTE_WARM_AT_ONCE]
    _preload()
    if warm:
        warm_up()
        preload_modules(sys.argv[4:])
    # Forked ranks start with torch's objects frozen: their collections skip them, and
    # the pages holding them are not copied on write by the collector's bookkeeping.
    freeze_heap()
    serve(socket.socket(fileno=fd), warm)
    # Skip interpreter teardown with torch loaded (seconds): there is nothing to flush.
    os._exit(0)


if __name__ == "__main__":
    main()
