"""Capturing a rank process's merged stdout/stderr, per task, without losing a line.

A reader thread drains the pipe continuously (a full pipe would block the rank).
At the end of each task the rank writes an end-of-task marker after flushing; the
parent waits for that marker before it cuts the task's output, so nothing printed
just before the result was sent lands in the next test's output.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import BinaryIO

END_MARKER = "\x1edistconform-task-end "


def end_marker_line(task_id: int) -> bytes:
    return f"{END_MARKER}{task_id}\n".encode()


class RankOutput:
    def __init__(self, rank: int, pipe: BinaryIO, echo: Callable[[str], None] | None) -> None:
        self.rank = rank
        self._pipe = pipe
        self._echo = echo
        self._lines: list[str] = []
        self._finished_tasks: set[int] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(
            target=self._drain, name=f"distconform-rank{rank}-output", daemon=True
        )
        self._thread.start()

    def _drain(self) -> None:
        try:
            for raw in iter(self._pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if line.startswith(END_MARKER):
                    with self._cond:
                        self._finished_tasks.add(int(line[len(END_MARKER) :].strip()))
                        self._cond.notify_all()
                    continue
                with self._cond:
                    self._lines.append(line)
                if self._echo is not None:
                    self._echo(f"[rank {self.rank}] {line}")
        except (OSError, ValueError):
            pass
        finally:
            # The rank is gone (end of file): nothing else reads this pipe.
            with contextlib.suppress(OSError):
                self._pipe.close()
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def mark(self) -> int:
        with self._cond:
            return len(self._lines)

    def text_since(self, mark: int) -> str:
        with self._cond:
            return "".join(self._lines[mark:])

    def wait_for_task_end(self, task_id: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: task_id in self._finished_tasks or self._closed, timeout=timeout
            )

    def wait_closed(self, timeout: float) -> bool:
        """After the rank died: wait until everything it wrote has been read."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
