"""Starting rank processes: through the zygote (default) or as fresh interpreters.

Both give a handle with the subset of ``subprocess.Popen`` the pool uses (``pid``,
``stdin``, ``stdout``, ``poll``, ``wait``) plus ``kill_group``. Every rank leads its
own process group, so killing it takes anything it started too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import BinaryIO, Protocol

import distconform
from distconform.harness.shared.protocol import ZYGOTE_WARM_AT_ONCE

START_METHODS = ("forkserver", "spawn")
_SPAWN_REPLY_TIMEOUT_S = 30.0
# A new fork server imports torch before it can answer: seconds on an idle machine, more
# than a minute on a loaded one (seen at load average 30+ on 2 cores).
_FIRST_REPLY_TIMEOUT_S = 240.0


class RankHandle(Protocol):
    pid: int
    stdin: BinaryIO | None
    stdout: BinaryIO | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill_group(self) -> None: ...


def package_root() -> str:
    return str(Path(distconform.__file__).resolve().parent.parent)


def with_package_on_path(env: dict[str, str]) -> dict[str, str]:
    entries = [package_root(), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(entries))}


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


class _SpawnedRank(subprocess.Popen):
    def kill_group(self) -> None:
        _kill_group(self.pid)


def spawn_fresh(spec_json: str, env: dict[str, str], control_fd: int) -> RankHandle:
    return _SpawnedRank(
        [sys.executable, "-m", "distconform.harness.rank.worker", spec_json],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        pass_fds=(control_fd,),
        env=with_package_on_path(env),
        start_new_session=True,
    )


class ForkedRank:
    """A rank forked by the zygote; its exit status arrives over the zygote's socket."""

    def __init__(self, pid: int, stdin: BinaryIO, stdout: BinaryIO, zygote: Zygote) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self._zygote = zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_status(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_status(self.pid, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return self.returncode

    def kill_group(self) -> None:
        _kill_group(self.pid)


class Zygote:
    """The parent's end of the fork server; started on first use, one per pytest process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._statuses: dict[int, int] = {}
        self._replies: list[int] = []
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen | None = None
        self._dead = False
        self._answered = False

    @property
    def pid(self) -> int | None:
        """The fork server's process id, if it is running."""
        return self._process.pid if self._process is not None and not self._dead else None

    def _ensure_started(self, warm: bool = False, preload: tuple[str, ...] = ()) -> socket.socket:
        if self._sock is not None and not self._dead:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = with_package_on_path(dict(os.environ, PYTHONUNBUFFERED="1"))
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distconform.harness.rank.zygote",
                str(theirs.fileno()),
                str(os.getpid()),
                *([ZYGOTE_WARM_AT_ONCE, *preload] if warm else []),
            ],
            stdin=subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
            env=env,
            start_new_session=True,
        )
        theirs.close()
        self._sock, self._dead = ours, False
        self._replies, self._statuses = [], {}
        self._answered = False
        threading.Thread(
            target=self._read, args=(ours,), name="distconform-zygote", daemon=True
        ).start()
        return ours

    def _read(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._dead = True
                    self._changed.notify_all()
                    return
                message = json.loads(data)
                if "spawned" in message:
                    self._replies.append(message["spawned"])
                else:
                    self._statuses[message["exited"]] = message["status"]
                self._changed.notify_all()

    def prestart(self, warm: bool = False, preload: tuple[str, ...] = ()) -> None:
        """Start the fork server now, without waiting for it: it imports torch while the
        parent goes on (collecting tests), so the first pool does not wait for both.

        ``warm``: it also loads, before its first fork, what it otherwise loads once idle
        (:func:`distconform.harness.rank.zygote.warm_up`), for a session whose first ranks need it,
        and the modules ``preload`` names (:func:`distconform.harness.rank.zygote.preload_modules`).
        A fork server already running keeps what it loaded.
        """
        with self._lock:
            self._ensure_started(warm, preload)

    def spawn(self, spec_json: str, env: dict[str, str], control_fd: int) -> ForkedRank:
        with self._lock:
            sock = self._ensure_started()
            stdin_r, stdin_w = os.pipe()
            out_r, out_w = os.pipe()
            request = json.dumps({"spec": spec_json, "env": env}).encode()
            try:
                socket.send_fds(sock, [request], [stdin_r, out_w, control_fd])
            finally:
                os.close(stdin_r)
                os.close(out_w)
            timeout = _SPAWN_REPLY_TIMEOUT_S if self._answered else _FIRST_REPLY_TIMEOUT_S
            with self._changed:
                if (
                    not self._changed.wait_for(lambda: self._replies or self._dead, timeout=timeout)
                    or not self._replies
                ):
                    os.close(stdin_w)
                    os.close(out_r)
                    self._dead = True
                    raise RuntimeError("the rank fork server did not answer; it will be restarted")
                pid = self._replies.pop(0)
                self._answered = True
        return ForkedRank(pid, os.fdopen(stdin_w, "wb"), os.fdopen(out_r, "rb"), self)

    def exit_status(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._statuses or self._dead, timeout=timeout)
            if pid in self._statuses:
                return self._statuses.pop(pid)
            if self._dead:
                # The zygote is gone, so were its children (parent-death signal).
                return -signal.SIGKILL
            return None

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
                self._sock = None
            if self._process is not None:
                with contextlib.suppress(OSError):
                    self._process.stdin.close()
                try:
                    self._process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait(timeout=5)
                self._process = None


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def shared_zygote() -> Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            _zygote = Zygote()
        return _zygote


def close_shared_zygote() -> None:
    global _zygote
    with _zygote_lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None


def start_rank(method: str, spec_json: str, env: dict[str, str], control_fd: int) -> RankHandle:
    if method == "forkserver":
        return shared_zygote().spawn(spec_json, env, control_fd)
    if method == "spawn":
        return spawn_fresh(spec_json, env, control_fd)
    raise ValueError(f"unknown start method {method!r}: use {' or '.join(START_METHODS)}")
